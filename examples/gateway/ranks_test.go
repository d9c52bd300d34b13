package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/zap"

	"github.com/enginepick/enginepick/examples/gateway/internal/fakeengine"
	"github.com/enginepick/enginepick/examples/gateway/internal/gw"
	"github.com/enginepick/enginepick/state"
)

// vllmLabelledLoad is a vLLM /metrics page with one series per engine label, each rank running
// one request with waiting[i] waiting.
func vllmLabelledLoad(labels []string, waiting ...int) string {
	var b strings.Builder
	for i, l := range labels {
		fmt.Fprintf(&b, "vllm:num_requests_running{engine=%q} 1\nvllm:num_requests_waiting{engine=%q} %d\n", l, l, waiting[i])
	}
	return b.String()
}

// publishOn is publishRank on a topic.
func (p *publisher) publishOn(t *testing.T, topic string, rank int, events ...any) {
	raw, err := msgpack.Marshal([]any{float64(time.Now().UnixNano()) / 1e9, events, rank})
	require.NoError(t, err)
	p.mu.Lock()
	seq := uint64(len(p.batches))
	p.batches = append(p.batches, raw)
	p.mu.Unlock()
	require.NoError(t, p.pub.SendMulti(zmq4.NewMsgFrom([]byte(topic), be64(seq), raw)))
}

// completion posts a completion for model and returns the status.
func completion(t *testing.T, gwURL, model string) int {
	t.Helper()
	resp := post(t, context.Background(), gwURL+"/v1/completions", `{"model":"`+model+`","prompt":"hello"}`, nil)
	_, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// An engine whose two ranks run as separate servers, each with its own /metrics page (labelled
// engine="0" or its own rank) and its own KV-event publisher on the topic kv@host:port@model, is
// given rank by rank (--engine ranks.R.KEY): both ranks' load is known, rank 1's events are rank
// 1's, and a request picked for rank 1 (its prefix holder) goes to rank 1's server, without a rank
// header: that server is the rank.
func TestPerRankServersGetTheirRanksRequests(t *testing.T) {
	t.Parallel()
	r0, r1 := newEngine(t), newEngine(t)
	r0.SetLoad(vllmLabelledLoad([]string{"0"}, 0)) // idle, but without the prefix
	r1.SetLoad(vllmLabelledLoad([]string{"1"}, 1))
	var pubs []*publisher
	var topics []string
	flag := "--engine=url=" + r0.URL() + ",model=m,kind=vllm"
	for r, e := range []*fakeengine.Engine{r0, r1} {
		pub, addr, replay := newPublisher(t)
		pubs = append(pubs, pub)
		topics = append(topics, "kv@"+strings.TrimPrefix(e.URL(), "http://")+"@m")
		flag += fmt.Sprintf(",ranks.%d.url=%s,ranks.%d.kv_events=%s,ranks.%d.kv_topic=%s,ranks.%d.kv_replay=%s", r, e.URL(), r, addr, r, topics[r], r, replay)
	}
	const block = 4
	g, gwSrv := startGateway(t, flag, "--block-tokens=4", "--min-matched-tokens=64", "--load-interval=100ms", "--load-timeout=100ms")
	id := state.EngineID(r0.URL())
	require.Eventually(t, func() bool {
		l, ok := g.table.Snapshot().Load(id)
		return ok && len(l.RankLoads) == 2 && l.RankLoads[1].WaitingRequests == 1
	}, 20*time.Second, 5*time.Millisecond, "both ranks' load, each from its own page")

	text := strings.Repeat("the quick brown fox jumps over the lazy dog. ", 3)
	tokens, hashes := promptBlocks(text, block, 1000)
	keys := g.index.Hasher().Keys(tokens)
	require.Eventually(t, func() bool {
		pubs[1].publishOn(t, topics[1], 1, blockStored(hashes, tokens, block))
		return g.index.Match(keys).Blocks(id) == len(hashes)
	}, 10*time.Second, 20*time.Millisecond, "rank 1's events, on its own topic")
	pubs[1].mu.Lock()
	last := uint64(len(pubs[1].batches) - 1)
	pubs[1].mu.Unlock()
	require.Eventually(t, func() bool {
		for _, st := range g.kv.sub.Stats().Streams {
			if st.DPRank == 1 && st.LastSeq == last && st.Trusted {
				return g.index.Match(keys).Blocks(id) == len(hashes)
			}
		}
		return false
	}, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, []int{1}, g.index.Match(keys).DPRanks)
	for _, st := range g.kv.sub.Stats().Streams {
		assert.Zero(t, st.Malformed, "rank %d: no batch refused", st.DPRank)
	}

	chatOK(t, gwSrv.URL, text, 2)
	require.Len(t, r1.Requests(), 2, "rank 1's server serves the requests picked for rank 1")
	assert.Empty(t, r1.Requests()[0].Header.Get(gw.VLLMRankHeader), "the server is the rank: no rank header")
	assert.Empty(t, r0.Requests())
}

// In a routing configuration (--config), ranks with their own url and load page are one engine
// whose least pressured rank gets the request at its own server.
func TestConfigFilePerRankServers(t *testing.T) {
	t.Parallel()
	r0, r1 := newEngine(t), newEngine(t)
	r0.SetLoad(vllmLabelledLoad([]string{"0"}, 4))
	r1.SetLoad(vllmLabelledLoad([]string{"0"}, 0)) // a per-rank page may call its rank 0
	path := writeConfig(t, fmt.Sprintf(`
load: {poll_interval: 50ms, poll_timeout: 50ms}
engines:
  - id: %[1]q
    model: m
    ranks:
      - {url: %[1]q, load: {url: "%[1]s/metrics", format: vllm_metrics}}
      - {url: %[2]q, load: {url: "%[2]s/metrics", format: vllm_metrics}}
models: [{id: m, buckets: [{id: all, groups: {plain: {policy: {type: least_load}}}}]}]
`, r0.URL(), r1.URL()))
	g, gwSrv := startGateway(t, "--config="+path, "--tokenize=false")
	require.Eventually(t, func() bool {
		l, ok := g.table.Snapshot().Load(state.EngineID(r0.URL()))
		return ok && len(l.RankLoads) == 2 && l.RankLoads[0].WaitingRequests == 4
	}, 20*time.Second, 5*time.Millisecond, "both ranks' load")
	require.Equal(t, http.StatusOK, completion(t, gwSrv.URL, "m"))
	require.Len(t, r1.Requests(), 1, "rank 1 queues nothing: its server gets the request")
	assert.Empty(t, r1.Requests()[0].Header.Get(gw.VLLMRankHeader))
	assert.Empty(t, r0.Requests())
}

// An engine serving global DP ranks 4..7 (vLLM) or 2..3 (SGLang) of a larger group reports them
// under their global numbers; with dp_rank_start its load is known, and the rank it is sent is the
// global one it knows.
func TestRankStartEngineGetsTheGlobalRank(t *testing.T) {
	t.Parallel()
	v, s := newEngine(t), newEngine(t)
	v.SetLoad(vllmLabelledLoad([]string{"4", "5", "6", "7"}, 5, 3, 0, 2))
	s.SetLoad(`{"loads":[{"dp_rank":2,"num_running_reqs":1,"num_waiting_reqs":4},{"dp_rank":3,"num_running_reqs":1,"num_waiting_reqs":1}]}`)
	g, gwSrv := startGateway(t, "--policy=least_load", "--tokenize=false",
		"--engine=url="+v.URL()+",model=v,kind=vllm,dp_ranks=4,dp_rank_start=4",
		"--engine=url="+s.URL()+",model=s,kind=sglang,dp_ranks=2,dp_rank_start=2", "--load-interval=100ms", "--load-timeout=100ms")
	waitLoad(t, g, v, s)
	for _, model := range []string{"v", "s"} {
		require.Equal(t, http.StatusOK, completion(t, gwSrv.URL, model))
	}
	require.Len(t, v.Requests(), 1)
	assert.Equal(t, "6", v.Requests()[0].Header.Get(gw.VLLMRankHeader), "local rank 2 (global 6) queues nothing")
	require.Len(t, s.Requests(), 1)
	assert.JSONEq(t, `3`, string(s.Requests()[0].Body["routed_dp_rank"]), "local rank 1 is global rank 3")
}

func TestEngineFlagRankKeys(t *testing.T) {
	t.Parallel()
	s, err := parseEngineFlag("url=http://h:8000,model=m,kind=vllm,dp_rank_start=2,ranks.1.url=http://h:8001,ranks.0.url=http://h:8000," +
		"ranks.0.kv_events=tcp://h:5557,ranks.1.kv_events=tcp://h:5557,ranks.0.kv_topic=kv@h:8000@m,ranks.1.kv_topic=kv@h:8001@m," +
		"ranks.0.load_url=http://h:8000/metrics,ranks.1.load_url=http://h:8001/metrics,ranks.1.kv_replay=tcp://h:5600")
	require.NoError(t, err)
	assert.Equal(t, 2, s.DPRankStart)
	assert.Equal(t, []rankSpec{
		{URL: "http://h:8000", LoadURL: "http://h:8000/metrics", KVEvents: "tcp://h:5557", KVTopic: "kv@h:8000@m"},
		{URL: "http://h:8001", LoadURL: "http://h:8001/metrics", KVEvents: "tcp://h:5557", KVTopic: "kv@h:8001@m", KVReplay: "tcp://h:5600"},
	}, s.Ranks)
	c, err := s.engineConfig()
	require.NoError(t, err)
	assert.Equal(t, 2, c.DPRanks)
	assert.Equal(t, 2, c.DPRankStart)
	assert.Equal(t, []string{"http://h:8000", "http://h:8001"}, c.RankURLs)
	tg, ok, err := s.loadTarget(gw.KindVLLM)
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, []string{"http://h:8000/metrics", "http://h:8001/metrics"}, tg.RankURLs)
	assert.Equal(t, 2, tg.RankStart)

	path := filepath.Join(t.TempDir(), "engines.yaml")
	require.NoError(t, os.WriteFile(path, []byte(`engines:
  - url: http://h:8000
    model: m
    kind: vllm
    dp_rank_start: 2
    ranks:
      - {url: "http://h:8000", load_url: "http://h:8000/metrics", kv_events: "tcp://h:5557", kv_topic: "kv@h:8000@m"}
      - {url: "http://h:8001", load_url: "http://h:8001/metrics", kv_events: "tcp://h:5557", kv_topic: "kv@h:8001@m", kv_replay: "tcp://h:5600"}
`), 0o600))
	specs, err := loadFile(path)
	require.NoError(t, err)
	require.Len(t, specs, 1)
	assert.Equal(t, s, specs[0], "the file's keys are the flag's")
	require.NoError(t, os.WriteFile(path, []byte("engines:\n  - {url: \"http://h:8000\", model: m, kind: vllm, ranks: [{port: 1}]}\n"), 0o600))
	_, err = loadFile(path)
	assert.ErrorIs(t, err, state.ErrInvalidConfiguration, "an unknown rank key")

	for _, key := range []string{"ranks.0.port=1", "ranks.x.url=http://h", "ranks.-1.url=http://h", "ranks.1024.url=http://h", "ranks.url=http://h"} {
		_, err := parseEngineFlag("url=http://h:8000,model=m,kind=vllm," + key)
		assert.ErrorIs(t, err, state.ErrInvalidConfiguration, key)
	}
}

// Contradictory rank descriptions are refused when the gateway is built.
func TestEngineRanksRefusals(t *testing.T) {
	t.Parallel()
	const base = "--engine=url=http://127.0.0.1:1,model=m,kind=vllm,load=none,"
	cases := []struct {
		name, flag, msg string
	}{
		{"negative_rank_start", "dp_rank_start=-1", "engine http://127.0.0.1:1: dp_rank_start -1 is negative: invalid configuration"},
		{"rank_count_disagrees", "dp_ranks=3,ranks.0.url=http://127.0.0.1:1,ranks.1.url=http://127.0.0.1:2",
			"engine http://127.0.0.1:1: dp_ranks 3, but 2 ranks are listed: invalid configuration"},
		{"engine_kv_events_with_ranks", "kv_events=tcp://127.0.0.1:5557,ranks.0.url=http://127.0.0.1:1",
			"engine http://127.0.0.1:1: ranks are listed: give load_url and kv_events, kv_topic, kv_replay per rank, not for the engine: invalid configuration"},
		{"empty_first_rank", "ranks.1.url=http://127.0.0.1:2",
			"engine http://127.0.0.1:1: ranks.0 is empty: a rank needs url, load_url or kv_events (for a rank count alone, use dp_ranks): invalid configuration"},
		{"url_for_some_ranks", "ranks.0.url=http://127.0.0.1:1,ranks.1.kv_events=tcp://127.0.0.1:5557",
			"engine http://127.0.0.1:1: ranks.1.url: set it for every rank or none: invalid configuration"},
		{"topic_without_publisher", "ranks.0.url=http://127.0.0.1:1,ranks.0.kv_topic=kv",
			"engine http://127.0.0.1:1: ranks.0: kv_topic and kv_replay need kv_events: invalid configuration"},
		{"rank_url_with_a_path", "ranks.0.url=http://127.0.0.1:1/v1", ""},
		{"global_ranks_past_1023", "dp_ranks=2,dp_rank_start=1023", ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			o, err := parseArgs([]string{base + tc.flag, "--policy=round_robin"}, io.Discard)
			require.NoError(t, err)
			_, err = build(o, zap.NewNop())
			require.ErrorIs(t, err, state.ErrInvalidConfiguration)
			if tc.msg != "" {
				assert.EqualError(t, err, tc.msg)
			}
		})
	}
}
