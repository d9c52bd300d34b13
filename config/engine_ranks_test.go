package config_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/config"
	"github.com/enginepick/enginepick/state"
)

// TestConfigEngineRanks decodes the keys of an engine deployed rank by rank (dp_rank_start and
// ranks) in YAML and JSON; their refusals are cases of TestConfigMalformed.
func TestConfigEngineRanks(t *testing.T) {
	t.Parallel()
	want := config.Engine{ID: "e1", Model: "m", DPRankStart: 2, Ranks: []config.Rank{
		{URL: "http://h:8000", Load: &config.LoadEndpoint{URL: "http://h:8000/metrics", Format: "vllm_metrics"},
			KVEvents: &config.KVEventsEndpoint{Endpoint: "tcp://h:5557", Replay: "tcp://h:5600", Topic: "kv@h:8000@m"}},
		{URL: "http://h:8001", Load: &config.LoadEndpoint{URL: "http://h:8001/metrics", Format: "vllm_metrics"},
			KVEvents: &config.KVEventsEndpoint{Endpoint: "ipc:///run/kv1", Topic: "kv@h:8001@m", Bind: true}},
	}}
	docs := []struct {
		name   string
		format config.Format
		doc    string
	}{
		{"yaml", config.FormatYAML, `
engines:
  - id: e1
    model: m
    dp_rank_start: 2
    ranks:
      - url: http://h:8000
        load: {url: "http://h:8000/metrics", format: vllm_metrics}
        kv_events: {endpoint: "tcp://h:5557", replay: "tcp://h:5600", topic: "kv@h:8000@m"}
      - url: http://h:8001
        load: {url: "http://h:8001/metrics", format: vllm_metrics}
        kv_events: {endpoint: "ipc:///run/kv1", topic: "kv@h:8001@m", bind: true}
models: [{id: m, buckets: [{id: a, groups: {plain: {}}}]}]
`},
		{"json", config.FormatJSON, `{"engines": [{"id": "e1", "model": "m", "dp_rank_start": 2, "ranks": [
  {"url": "http://h:8000", "load": {"url": "http://h:8000/metrics", "format": "vllm_metrics"},
   "kv_events": {"endpoint": "tcp://h:5557", "replay": "tcp://h:5600", "topic": "kv@h:8000@m"}},
  {"url": "http://h:8001", "load": {"url": "http://h:8001/metrics", "format": "vllm_metrics"},
   "kv_events": {"endpoint": "ipc:///run/kv1", "topic": "kv@h:8001@m", "bind": true}}]}],
 "models": [{"id": "m", "buckets": [{"id": "a", "groups": {"plain": {}}}]}]}`},
	}
	for _, d := range docs {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			cfg, err := config.ParseAs([]byte(d.doc), d.format)
			require.NoError(t, err)
			require.Len(t, cfg.Engines, 1)
			assert.Equal(t, want, cfg.Engines[0])
			assert.Equal(t, 2, cfg.Engines[0].RankCount(), "the rank count is the ranks listed")
			detected, err := config.Parse([]byte(d.doc))
			require.NoError(t, err, "Parse detects the syntax")
			assert.Equal(t, cfg, detected)
		})
	}
	counts := []struct {
		e    config.Engine
		want int
	}{
		{config.Engine{}, 1},
		{config.Engine{DPRanks: 4}, 4},
		{config.Engine{Ranks: make([]config.Rank, 3)}, 3},
		{config.Engine{DPRanks: 3, Ranks: make([]config.Rank, 3)}, 3},
	}
	for _, c := range counts {
		assert.Equal(t, c.want, c.e.RankCount(), "%+v", c.e)
	}
}

// vllmRankMetrics is a vLLM /metrics page with one rank per label, running running[i] requests
// with waiting[i] waiting.
func vllmRankMetrics(labels []string, running, waiting []int) string {
	var b strings.Builder
	for i, l := range labels {
		fmt.Fprintf(&b, "vllm:num_requests_running{engine=%q,model_name=\"m\"} %d\nvllm:num_requests_waiting{engine=%q,model_name=\"m\"} %d\n",
			l, running[i], l, waiting[i])
	}
	return b.String()
}

// metricsServer serves page at /metrics.
func metricsServer(t *testing.T, page string) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			http.NotFound(w, r)
			return
		}
		_, _ = w.Write([]byte(page))
	}))
	t.Cleanup(srv.Close)
	return srv
}

// freePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freePort(t *testing.T) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// kvPublisher is an engine rank's KV-event publisher: a ZMQ PUB bound on 127.0.0.1:port, as vLLM
// binds it.
func kvPublisher(t *testing.T, port int) zmq4.Socket {
	pub := zmq4.NewPub(context.Background())
	require.NoError(t, pub.Listen(fmt.Sprintf("tcp://127.0.0.1:%d", port)))
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

// publishHeld publishes one BlockStored batch of tokens, sequence 0, as the given global DP rank
// on pub once the subscriber has joined pub, waits until the index holds the tokens for engine, and
// returns the rank the index holds them under. ZMQ drops what a PUB socket sends before a
// subscriber has joined, so it first probes on a topic the subscriber does not follow until the
// subscriber counts a probe. The batch is sent once: sequence 0 again would come from a restarted
// publisher, and the subscriber would clear the rank and apply it anew, a moment in which the index
// does not hold the tokens.
func publishHeld(t *testing.T, r *config.Router, pub zmq4.Socket, topic string, globalRank int, hashes []uint64, tokens []uint32, engine state.EngineID) int {
	t.Helper()
	seq := make([]byte, 8)
	binary.BigEndian.PutUint64(seq, 0)
	probes := r.KVEventStats().UnknownTopics
	require.Eventually(t, func() bool {
		require.NoError(t, pub.SendMulti(zmq4.NewMsgFrom([]byte("probe"), seq, []byte{0x90})))
		return r.KVEventStats().UnknownTopics > probes
	}, 10*time.Second, 20*time.Millisecond, "the subscriber joins the publisher")
	ev := []any{"BlockStored", hashes, nil, tokens, 4, nil, "GPU"}
	payload, err := msgpack.Marshal([]any{1789095808.83, []any{ev}, globalRank})
	require.NoError(t, err)
	require.NoError(t, pub.SendMulti(zmq4.NewMsgFrom([]byte(topic), seq, payload)))
	keys := r.Index().Hasher().Keys(tokens)
	require.Eventually(t, func() bool {
		return r.Index().Match(keys).Blocks(engine) == len(hashes)
	}, 10*time.Second, 5*time.Millisecond, "the index holds the published blocks")
	m := r.Index().Match(keys)
	for i, e := range m.Engines {
		if e.Engine == engine {
			return m.DPRanks[i]
		}
	}
	return -1
}

// rankLoads returns each rank's running and waiting requests once the engine's load is known.
func rankLoads(t *testing.T, r *config.Router, engine state.EngineID) [][2]uint64 {
	t.Helper()
	var out [][2]uint64
	require.Eventually(t, func() bool {
		l, ok := r.LoadTable().Snapshot().Load(engine)
		if !ok {
			return false
		}
		out = out[:0]
		for _, rl := range l.RankLoads {
			out = append(out, [2]uint64{rl.RunningRequests, rl.WaitingRequests})
		}
		return true
	}, 10*time.Second, 10*time.Millisecond, "the engine's load becomes known")
	return out
}

// TestNewPerPortRanks: an engine whose two DP ranks run as separate servers (vLLM's external DP
// load balancing, llm-d's simulator), each with its own /metrics page on its own HTTP port and its
// own KV-event publisher with the topic kv@host:port@model, is one engine of two ranks: both
// ranks' load is known and each rank's events are applied to that rank.
func TestNewPerPortRanks(t *testing.T) {
	t.Parallel()
	web := []*httptest.Server{
		metricsServer(t, vllmRankMetrics([]string{"0"}, []int{3}, []int{1})),
		metricsServer(t, vllmRankMetrics([]string{"1"}, []int{5}, []int{2})),
	}
	var ranks strings.Builder
	var pubs []zmq4.Socket
	var topics []string
	for i, w := range web {
		port := freePort(t)
		pubs = append(pubs, kvPublisher(t, port))
		topics = append(topics, "kv@"+strings.TrimPrefix(w.URL, "http://")+"@m")
		fmt.Fprintf(&ranks, "      - {url: %q, load: {url: \"%s/metrics\", format: vllm_metrics}, kv_events: {endpoint: \"tcp://127.0.0.1:%d\", topic: %q}}\n",
			w.URL, w.URL, port, topics[i])
	}
	cfg := mustParse(t, `
kv: {block_tokens: 4}
load: {poll_interval: 50ms, poll_timeout: 50ms}
engines:
  - id: e1
    model: m
    ranks:
`+ranks.String()+`
models: [{id: m, buckets: [{id: a, groups: {plain: {policy: {type: cache_aware, cache_aware: {min_matched_tokens: 8}}}}}]}]
`)
	r := mustNew(t, cfg, nil)
	defer r.Close()

	assert.Equal(t, [][2]uint64{{3, 1}, {5, 2}}, rankLoads(t, r, "e1"), "both ranks' load, each from its own page")
	r0 := []uint32{1, 2, 3, 4, 5, 6, 7, 8}
	r1 := []uint32{9, 10, 11, 12, 13, 14, 15, 16}
	assert.Equal(t, 0, publishHeld(t, r, pubs[0], topics[0], 0, []uint64{101, 102}, r0, "e1"))
	assert.Equal(t, 1, publishHeld(t, r, pubs[1], topics[1], 1, []uint64{201, 202}, r1, "e1"), "rank 1's events, on its own topic, are rank 1's")
	for _, st := range r.KVEventStats().Streams {
		assert.Zero(t, st.Malformed, "rank %d: no batch refused", st.DPRank)
		assert.Zero(t, st.RankClears, "rank %d: never cleared, as after a publisher restart", st.DPRank)
	}

	// A prompt extending rank 1's blocks by a token: both are served from its cache, 8 tokens.
	d, err := r.Select(context.Background(), &bucket.Request{Model: "m", TokenIDs: append(r1[:8:8], 17), Signals: bucket.Signals{InputTokens: 9}})
	require.NoError(t, err)
	defer d.Release()
	p := d.Selection.Plain
	assert.True(t, p.HasDPRank)
	assert.Equal(t, 1, p.DPRank, "the prefix lives on rank 1")
}

// TestNewRankStartNode: a vLLM node owning global DP ranks 4..7 of a larger group labels its
// /metrics series engine="4".."7" and publishes data_parallel_rank 4..7 on the base port + its
// local rank; with dp_rank_start 4 its load is known and rank 5's events are applied to its rank 1.
func TestNewRankStartNode(t *testing.T) {
	t.Parallel()
	web := metricsServer(t, vllmRankMetrics([]string{"4", "5", "6", "7"}, []int{1, 2, 3, 4}, []int{0, 1, 0, 2}))
	port := freePort(t) // rank 1's; the base port is one below
	pub := kvPublisher(t, port)
	cfg := mustParse(t, fmt.Sprintf(`
kv: {block_tokens: 4}
load: {poll_interval: 50ms, poll_timeout: 50ms}
engines:
  - {id: node, model: m, dp_ranks: 4, dp_rank_start: 4, load: {url: "%s/metrics", format: vllm_metrics}, kv_events: {endpoint: "tcp://127.0.0.1:%d", topic: kv}}
models: [{id: m, buckets: [{id: a, groups: {plain: {policy: {type: cache_aware, cache_aware: {min_matched_tokens: 8}}}}}]}]
`, web.URL, port-1))
	r := mustNew(t, cfg, nil)
	defer r.Close()

	assert.Equal(t, [][2]uint64{{1, 0}, {2, 1}, {3, 0}, {4, 2}}, rankLoads(t, r, "node"), "global ranks 4..7 are the node's ranks 0..3")
	assert.Equal(t, 1, publishHeld(t, r, pub, "kv", 5, []uint64{501, 502}, []uint32{1, 2, 3, 4, 5, 6, 7, 8}, "node"),
		"data_parallel_rank 5 is the node's rank 1")
	for _, st := range r.KVEventStats().Streams {
		assert.Zero(t, st.Malformed, "rank %d: no batch refused", st.DPRank)
		assert.Zero(t, st.RankClears, "rank %d: never cleared, as after a publisher restart", st.DPRank)
	}
}
