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

# free_port prints a port P such that P and P+10000 (the cluster bus) are free and not yet taken.
taken=" "
free_port() {
  local p
  for _ in $(seq 1 200); do
    p=$((20000 + RANDOM % 20000))
    if [[ "$taken" != *" $p "* ]] && port_free "$p" && port_free $((p + 10000)); then
      taken="$taken$p "
      echo "$p"
      return 0
    fi
  done
  echo "redis.sh: no free port found" >&2
  return 1
}

start_server() { # dir port [extra args...]
  local dir=$1 port=$2
  shift 2
  mkdir -p "$dir/$port"
  redis-server --bind 127.0.0.1 --port "$port" --dir "$dir/$port" --daemonize yes \
    --pidfile "$dir/$port/redis.pid" --logfile "$dir/$port/redis.log" \
    --save "" --appendonly no "$@" >&2
  echo "$port" >>"$dir/ports"
  for _ in $(seq 1 100); do
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
  single=$(free_port)
  start_server "$dir" "$single"
  nodes=()
  for _ in 1 2 3; do
    p=$(free_port)
    start_server "$dir" "$p" --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 5000
    nodes+=("127.0.0.1:$p")
  done
  redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >&2
  for _ in $(seq 1 200); do
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
