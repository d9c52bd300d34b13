#!/usr/bin/env bash
# Test servers for affinity/redisstore: one standalone redis-server and a three-master Redis
# Cluster, all on free 127.0.0.1 ports, with their files in a new temporary directory.
#
#   eval "$(.ci/redis.sh start)"   # prints export lines: ENGINEPICK_REDIS_ADDR,
#                                  # ENGINEPICK_REDIS_CLUSTER_ADDRS, ENGINEPICK_REDIS_DIR
#   go test ./affinity/redisstore/
#   .ci/redis.sh stop "$ENGINEPICK_REDIS_DIR"
#
# Needs redis-server and redis-cli (Debian: apt-get install -y redis-server). Progress goes to
# stderr so that stdout holds only the exports.
set -euo pipefail

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# free_port sets PORT to a port P such that P and P+10000 (the cluster bus) are free and were not
# handed out before. It runs in the current shell (never in $(...)), so that it remembers them.
taken=" "
free_port() {
  local p
  for _ in $(seq 1 200); do
    p=$((20000 + RANDOM % 20000))
    if [[ "$taken" != *" $p "* ]] && port_free "$p" && port_free $((p + 10000)); then
      taken="$taken$p "
      PORT=$p
      return 0
    fi
  done
  echo "redis.sh: no free port found" >&2
  return 1
}

start_server() { # dir port [extra args...]: launches a daemonized redis-server
  local dir=$1 port=$2
  shift 2
  mkdir -p "$dir/$port"
  redis-server --bind 127.0.0.1 --port "$port" --dir "$dir/$port" --daemonize yes \
    --pidfile "$dir/$port/redis.pid" --logfile "$dir/$port/redis.log" \
    --save "" --appendonly no "$@" >&2
  echo "$port" >>"$dir/ports"
}

wait_server() { # dir port: waits until the server answers PING
  local dir=$1 port=$2
  for _ in $(seq 1 200); do
    redis-cli -p "$port" ping >/dev/null 2>&1 && return 0
    sleep 0.05
  done
  echo "redis.sh: redis-server on port $port did not start; log:" >&2
  cat "$dir/$port/redis.log" >&2 || true
  return 1
}

stop_all() { # dir
  local dir=$1
  [ -f "$dir/ports" ] || return 0
  while read -r port; do
    redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
  done <"$dir/ports"
  # A server that did not shut down (its pid file is still there) is killed by its own pid.
  while read -r port; do
    if [ -f "$dir/$port/redis.pid" ]; then
      kill "$(cat "$dir/$port/redis.pid")" 2>/dev/null || true
    fi
  done <"$dir/ports"
  rm -rf "$dir"
}

case "${1:-}" in
start)
  command -v redis-server >/dev/null && command -v redis-cli >/dev/null || {
    echo "redis.sh: redis-server and redis-cli are needed (apt-get install -y redis-server)" >&2
    exit 1
  }
  dir=$(mktemp -d "${TMPDIR:-/tmp}/enginepick-redis.XXXXXX")
  trap 'stop_all "$dir"' ERR
  free_port
  single=$PORT
  start_server "$dir" "$single"
  nodes=()
  for _ in 1 2 3; do
    free_port
    p=$PORT
    start_server "$dir" "$p" --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 5000
    nodes+=("127.0.0.1:$p")
  done
  wait_server "$dir" "$single"
  for n in "${nodes[@]}"; do wait_server "$dir" "${n##*:}"; done
  # Assign a third of the slots to each node and introduce the nodes to each other (what
  # redis-cli --cluster create does, without its fixed one-second waits).
  ranges=("0 5460" "5461 10922" "10923 16383")
  for i in 0 1 2; do
    redis-cli -p "${nodes[$i]##*:}" cluster addslotsrange ${ranges[$i]} >/dev/null
  done
  for i in 1 2; do
    redis-cli -p "${nodes[0]##*:}" cluster meet 127.0.0.1 "${nodes[$i]##*:}" >/dev/null
  done
  for _ in $(seq 1 600); do
    ok=1
    for n in "${nodes[@]}"; do
      redis-cli -p "${n##*:}" cluster info 2>/dev/null | grep -q '^cluster_state:ok' || ok=0
    done
    [ "$ok" = 1 ] && break
    sleep 0.05
  done
  [ "$ok" = 1 ] || { echo "redis.sh: cluster did not reach cluster_state:ok" >&2; exit 1; }
  trap - ERR
  addrs=$(IFS=,; echo "${nodes[*]}")
  echo "export ENGINEPICK_REDIS_ADDR=127.0.0.1:$single"
  echo "export ENGINEPICK_REDIS_CLUSTER_ADDRS=$addrs"
  echo "export ENGINEPICK_REDIS_DIR=$dir"
  ;;
stop)
  [ -n "${2:-}" ] || { echo "usage: redis.sh stop DIR" >&2; exit 2; }
  stop_all "$2"
  ;;
*)
  echo "usage: redis.sh start | stop DIR" >&2
  exit 2
  ;;
esac
