package gw_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/examples/gateway/internal/fakeengine"
	"github.com/enginepick/enginepick/examples/gateway/internal/gw"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// recorder is a policy that picks the first candidate, naming the DP rank ranks gives for its
// URL if any, and records each request.
type recorder struct {
	mu    sync.Mutex
	reqs  []policy.Request
	ranks map[string]int
}

func (r *recorder) Pick(_ context.Context, es []state.Engine, req *policy.Request) (policy.Pick, error) {
	r.mu.Lock()
	r.reqs = append(r.reqs, *req)
	r.mu.Unlock()
	pk := policy.Pick{Engine: es[0], Reason: "first"}
	if rank, ok := r.ranks[string(es[0].ID())]; ok {
		pk.DPRank, pk.HasDPRank = rank, true
	}
	return pk, nil
}

func (r *recorder) last() policy.Request {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.reqs[len(r.reqs)-1]
}

type fixture struct {
	srv      *httptest.Server
	rec      *recorder
	registry *gw.Registry
	inflight *loadmon.InFlight
	metrics  *gw.Metrics
}

// newFixture serves a gateway over the given engines (plain, or one prefill and one decode),
// with every group picking its first candidate.
func newFixture(t *testing.T, configs []gw.EngineConfig, opts gw.Options) *fixture {
	return newRankedFixture(t, configs, opts, nil)
}

// newRankedFixture is newFixture with picks naming ranks[engine URL] when present.
func newRankedFixture(t *testing.T, configs []gw.EngineConfig, opts gw.Options, ranks map[string]int) *fixture {
	t.Helper()
	reg, err := gw.NewRegistry(configs, gw.BreakerConfig{})
	require.NoError(t, err)
	rec := &recorder{ranks: ranks}
	group := func() *bucket.EngineGroup {
		g, err := bucket.NewEngineGroup(rec, nil)
		require.NoError(t, err)
		return g
	}
	var b *bucket.Bucket
	if configs[0].Stage == state.StagePlain {
		b, err = bucket.NewPlainBucket(bucket.Spec{ID: "plain"}, group())
	} else {
		b, err = bucket.NewPDBucket(bucket.Spec{ID: "pd"}, group(), group())
	}
	require.NoError(t, err)
	res, err := bucket.NewResolver([]*bucket.Bucket{b}, bucket.ResolverOptions{})
	require.NoError(t, err)
	inflight := loadmon.NewInFlight(nil)
	router, err := enginepick.NewRouter(enginepick.Options{Registry: reg, InFlight: inflight,
		Resolvers: map[state.ModelID]*bucket.Resolver{"m": res}})
	require.NoError(t, err)
	opts.Router, opts.Registry = router, reg
	if opts.Metrics == nil {
		opts.Metrics = gw.NewMetrics(prometheus.NewRegistry(), reg)
	}
	s, err := gw.NewServer(opts)
	require.NoError(t, err)
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	return &fixture{srv: srv, rec: rec, registry: reg, inflight: inflight, metrics: opts.Metrics}
}

// upstreamFailures reads gateway_upstream_failures_total of kind, over every engine.
func (f *fixture) upstreamFailures(t *testing.T, kind string) float64 {
	t.Helper()
	mfs, err := f.metrics.Registry().Gather()
	require.NoError(t, err)
	var n float64
	for _, mf := range mfs {
		if mf.GetName() != "gateway_upstream_failures_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetName() == "kind" && lp.GetValue() == kind {
					n += m.GetCounter().GetValue()
				}
			}
		}
	}
	return n
}

func (f *fixture) post(t *testing.T, path, body string, header map[string]string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, f.srv.URL+path, strings.NewReader(body))
	require.NoError(t, err)
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func engine(t *testing.T) *fakeengine.Engine {
	e := fakeengine.New()
	t.Cleanup(e.Close)
	return e
}

func TestSessionAndRoutingKeyHeadersReachThePolicy(t *testing.T) {
	t.Parallel()
	e := engine(t)
	f := newFixture(t, []gw.EngineConfig{{URL: e.URL(), Model: "m", Kind: gw.KindVLLM}},
		gw.Options{SessionHeader: "x-session-id", RoutingKeyHeader: "x-sgl-routing-key"})
	code, _ := f.post(t, "/v1/completions", `{"model":"m","prompt":"hi","max_tokens":10}`,
		map[string]string{"X-Session-Id": "s-1", "X-Sgl-Routing-Key": "tenant-7"})
	require.Equal(t, http.StatusOK, code)
	req := f.rec.last()
	assert.Equal(t, "s-1", req.SessionKey)
	assert.Equal(t, "tenant-7", req.RoutingKey)
	assert.Nil(t, req.TokenIDs, "no tokenizer: the length is estimated")
	assert.Equal(t, uint64(gw.EstimateTokens(len(`{"model":"m","prompt":"hi","max_tokens":10}`), 4)), req.InputTokens)
	assert.True(t, req.HasExpectedPeak)
	assert.Equal(t, req.InputTokens+10, req.ExpectedPeakTokens)
}

func TestTokenizedPromptReachesThePolicy(t *testing.T) {
	t.Parallel()
	e := engine(t)
	reg, err := gw.NewRegistry([]gw.EngineConfig{{URL: e.URL(), Model: "m", Kind: gw.KindVLLM}}, gw.BreakerConfig{})
	require.NoError(t, err)
	f := newFixture(t, []gw.EngineConfig{{URL: e.URL(), Model: "m", Kind: gw.KindVLLM}},
		gw.Options{Tokenizer: &gw.EngineTokenizer{Registry: reg}})
	code, _ := f.post(t, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"abc"}]}`, nil)
	require.Equal(t, http.StatusOK, code)
	req := f.rec.last()
	assert.Equal(t, fakeengine.Tokens("abc"), req.TokenIDs)
	assert.Equal(t, uint64(3), req.InputTokens)
	assert.False(t, req.HasExpectedPeak, "no max_tokens: the peak is unknown, not the input")

	code, _ = f.post(t, "/v1/completions", `{"model":"m","prompt":[5,6,7,8]}`, nil)
	require.Equal(t, http.StatusOK, code)
	assert.Equal(t, []uint32{5, 6, 7, 8}, f.rec.last().TokenIDs, "a token-ID prompt is used as is")
}

// The DP rank a pick names reaches the engine the way each engine reads it: vLLM the
// X-data-parallel-rank header, SGLang the routed_dp_rank body field.
func TestPickRankReachesTheEngine(t *testing.T) {
	t.Parallel()
	v, s := engine(t), engine(t)
	fv := newRankedFixture(t, []gw.EngineConfig{{URL: v.URL(), Model: "m", Kind: gw.KindVLLM, DPRanks: 4}}, gw.Options{}, map[string]int{v.URL(): 3})
	fs := newRankedFixture(t, []gw.EngineConfig{{URL: s.URL(), Model: "m", Kind: gw.KindSGLang, DPRanks: 4}}, gw.Options{}, map[string]int{s.URL(): 3})
	for _, f := range []*fixture{fv, fs} {
		code, _ := f.post(t, "/v1/completions", `{"model":"m","prompt":"hi"}`, nil)
		require.Equal(t, http.StatusOK, code)
	}
	require.Len(t, v.Requests(), 1)
	assert.Equal(t, "3", v.Requests()[0].Header.Get(gw.VLLMRankHeader))
	_, inBody := v.Requests()[0].Body["routed_dp_rank"]
	assert.False(t, inBody)
	require.Len(t, s.Requests(), 1)
	assert.JSONEq(t, `3`, string(s.Requests()[0].Body["routed_dp_rank"]))
	assert.Empty(t, s.Requests()[0].Header.Get(gw.VLLMRankHeader))

	// Without a rank nothing is added.
	w := engine(t)
	fw := newFixture(t, []gw.EngineConfig{{URL: w.URL(), Model: "m", Kind: gw.KindSGLang}}, gw.Options{})
	code, _ := fw.post(t, "/v1/completions", `{"model":"m","prompt":"hi"}`, map[string]string{gw.VLLMRankHeader: "7"})
	require.Equal(t, http.StatusOK, code)
	_, inBody = w.Requests()[0].Body["routed_dp_rank"]
	assert.False(t, inBody)
	assert.Empty(t, w.Requests()[0].Header.Get(gw.VLLMRankHeader), "a client's own rank header is not forwarded")
}

// In PD the bootstrap room agrees with the prefill rank sent (room mod prefill DP size = rank),
// the decode leg learns the prefill rank, and each leg carries its own rank.
func TestPDRanksAndRoom(t *testing.T) {
	t.Parallel()
	p, d := engine(t), engine(t)
	ranks := map[string]int{p.URL(): 2, d.URL(): 5}
	f := newRankedFixture(t, []gw.EngineConfig{
		{URL: p.URL(), Model: "m", Kind: gw.KindSGLang, Stage: state.StagePrefill, DPRanks: 4, BootstrapPort: 8998},
		{URL: d.URL(), Model: "m", Kind: gw.KindSGLang, Stage: state.StageDecode, DPRanks: 8},
	}, gw.Options{}, ranks)
	for range 20 {
		code, body := f.post(t, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, nil)
		require.Equal(t, http.StatusOK, code, body)
	}
	for i, pr := range p.Requests() {
		dr := d.Requests()[i]
		var room uint64
		require.NoError(t, json.Unmarshal(pr.Body["bootstrap_room"], &room))
		assert.Equal(t, uint64(2), room%4, "room mod prefill DP size is the prefill rank")
		assert.Less(t, room, uint64(1)<<63)
		assert.JSONEq(t, string(pr.Body["bootstrap_room"]), string(dr.Body["bootstrap_room"]))
		assert.JSONEq(t, `2`, string(pr.Body["routed_dp_rank"]))
		assert.JSONEq(t, `5`, string(dr.Body["routed_dp_rank"]))
		assert.JSONEq(t, `2`, string(dr.Body["disagg_prefill_dp_rank"]))
		_, ok := pr.Body["disagg_prefill_dp_rank"]
		assert.False(t, ok)
	}
}

func TestBootstrapRoom(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name    string
		u       uint64
		dp      int
		rank    int
		hasRank bool
		want    uint64
	}{
		{"top_bit_cleared", 1<<63 | 12345, 1, 0, false, 12345},
		{"no_rank_keeps_random", 1000, 4, 0, false, 1000},
		{"rank_aligned_down", 1001, 4, 2, true, 1002},
		{"single_rank_ignores_rank", 1001, 1, 0, true, 1001},
		{"near_the_top", 1<<63 - 1, 10, 9, true, (1<<63 - 1) - (1<<63-1)%10 + 9 - 10},
		{"rank_out_of_range_ignored", 77, 4, 9, true, 77},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got := gw.BootstrapRoom(tc.u, tc.dp, tc.rank, tc.hasRank)
			assert.Equal(t, tc.want, got)
			assert.Less(t, got, uint64(1)<<63)
			if tc.hasRank && tc.dp > 1 && tc.rank < tc.dp {
				assert.Equal(t, uint64(tc.rank), got%uint64(tc.dp))
			}
		})
	}
}

func TestBreaker(t *testing.T) {
	t.Parallel()
	reg, err := gw.NewRegistry([]gw.EngineConfig{{URL: "http://127.0.0.1:1", Model: "m", Kind: gw.KindVLLM}}, gw.BreakerConfig{FailureStreak: 2})
	require.NoError(t, err)
	e := reg.All()[0]
	e.Record(gw.OutcomeServerError)
	e.Record(gw.OutcomeOK)
	e.Record(gw.OutcomeServerError)
	assert.True(t, e.Healthy(), "an OK answer resets the streak")
	e.Record(gw.OutcomeServerError)
	assert.False(t, e.Healthy(), "two engine failures in a row open the breaker")
	assert.Equal(t, uint64(1), e.Opens())
	reg2, _ := gw.NewRegistry([]gw.EngineConfig{{URL: "http://127.0.0.1:1", Model: "m", Kind: gw.KindVLLM}}, gw.BreakerConfig{})
	reg2.All()[0].Record(gw.OutcomeConnError)
	assert.False(t, reg2.All()[0].Healthy(), "one connection failure opens it")
	assert.Equal(t, gw.OutcomeOK, gw.OutcomeOf(404))
	assert.Equal(t, gw.OutcomeAmbiguous, gw.OutcomeOf(503))
	reg3, _ := gw.NewRegistry([]gw.EngineConfig{{URL: "http://127.0.0.1:1", Model: "m", Kind: gw.KindVLLM}}, gw.BreakerConfig{FailureStreak: 2})
	e3 := reg3.All()[0]
	e3.Record(gw.OutcomeServerError)
	for range 5 {
		e3.Record(gw.OutcomeAmbiguous)
	}
	assert.True(t, e3.Healthy(), "an ambiguous outcome does not count")
	e3.Record(gw.OutcomeServerError)
	assert.False(t, e3.Healthy(), "nor does it reset the streak")
}

func TestNewRegistryValidates(t *testing.T) {
	t.Parallel()
	ok := gw.EngineConfig{URL: "http://h:1", Model: "m", Kind: gw.KindVLLM}
	for name, c := range map[string]gw.EngineConfig{
		"relative_url":  {URL: "h:1", Model: "m", Kind: gw.KindVLLM},
		"url_with_path": {URL: "http://h:1/v1", Model: "m", Kind: gw.KindVLLM},
		"no_model":      {URL: "http://h:1", Kind: gw.KindVLLM},
		"no_kind":       {URL: "http://h:1", Model: "m"},
		"bad_stage":     {URL: "http://h:1", Model: "m", Kind: gw.KindVLLM, Stage: 7},
		"bad_ranks":     {URL: "http://h:1", Model: "m", Kind: gw.KindVLLM, DPRanks: 2000},
		"bad_port":      {URL: "http://h:1", Model: "m", Kind: gw.KindVLLM, BootstrapPort: 70000},
	} {
		_, err := gw.NewRegistry([]gw.EngineConfig{c}, gw.BreakerConfig{})
		assert.ErrorIs(t, err, state.ErrInvalidConfiguration, name)
	}
	_, err := gw.NewRegistry([]gw.EngineConfig{ok, {URL: "http://h:1/", Model: "m", Kind: gw.KindVLLM}}, gw.BreakerConfig{})
	assert.ErrorIs(t, err, state.ErrInvalidConfiguration, "the same engine twice (trailing slash trimmed)")
}

func TestEstimateTokens(t *testing.T) {
	t.Parallel()
	assert.Equal(t, int64(1), gw.EstimateTokens(0, 4))
	assert.Equal(t, int64(1), gw.EstimateTokens(4, 4))
	assert.Equal(t, int64(2), gw.EstimateTokens(5, 4))
	assert.Equal(t, int64(7), gw.EstimateTokens(7, 0), "a ratio below 1 reads as 1")
}

// The breaker counts what the engine causes and nothing the request causes: four requests to one
// engine whose answers or failures are the case's, with the default streak of 3. A 4xx never
// counts and probes nothing; a 5xx or a connection closed after the whole request was sent could
// be the request's doing: each probes the engine, and only a failed probe counts.
func TestBreakerCountsOnlyEngineFailures(t *testing.T) {
	t.Parallel()
	answer := func(code int) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			w.WriteHeader(code)
		}
	}
	const ok, down = http.StatusOK, http.StatusServiceUnavailable
	for _, tc := range []struct {
		name    string
		handler http.HandlerFunc
		health  int
		probes  bool // each request probes the engine
		codes   []int
		healthy []bool
	}{
		{"answers_400", answer(400), down, false, []int{400, 400, 400, 400}, []bool{true, true, true, true}},
		{"answers_413", answer(413), down, false, []int{413, 413, 413, 413}, []bool{true, true, true, true}},
		{"answers_422", answer(422), down, false, []int{422, 422, 422, 422}, []bool{true, true, true, true}},
		{"answers_500_health_ok", answer(500), ok, true, []int{500, 500, 500, 500}, []bool{true, true, true, true}},
		{"answers_503_health_ok", answer(503), ok, true, []int{503, 503, 503, 503}, []bool{true, true, true, true}},
		{"closes_after_reading_the_body_health_ok", hangUp(false), ok, true, []int{502, 502, 502, 502}, []bool{true, true, true, true}},
		{"answers_500_health_down", answer(500), down, true, []int{500, 500, 500, 503}, []bool{true, true, false, false}},
		{"answers_503_health_down", answer(503), down, true, []int{503, 503, 503, 503}, []bool{true, true, false, false}},
		{"closes_after_reading_the_body_health_down", hangUp(false), down, true, []int{502, 502, 502, 503}, []bool{true, true, false, false}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			eng := newProbedEngine(t, tc.handler, nil)
			eng.health.Store(int32(tc.health))
			f := newFixture(t, []gw.EngineConfig{{URL: eng.srv.URL, Model: "m", Kind: gw.KindVLLM}}, gw.Options{})
			e := f.registry.All()[0]
			var codes []int
			var healthy []bool
			var probes uint64
			for range 4 {
				code, body := f.post(t, "/v1/completions", `{"model":"m","prompt":"hi"}`, nil)
				codes = append(codes, code)
				if tc.probes && !strings.Contains(body, "no engine can take the request now") { // it reached the engine
					probes++
				}
				settled(t, e, probes)
				healthy = append(healthy, e.Healthy())
			}
			assert.Equal(t, tc.codes, codes)
			assert.Equal(t, tc.healthy, healthy)
			assert.Equal(t, int64(probes), eng.calls.Load())
		})
	}
}

// A prefill leg that outlives PrefillTimeout is the prefill engine's failure: it counts toward its
// streak.
func TestPrefillTimeoutCountsAgainstThePrefillEngine(t *testing.T) {
	t.Parallel()
	pe, de := engine(t), engine(t)
	pe.SetDelay(time.Hour) // ends when the gateway gives up on the leg
	f := newFixture(t, []gw.EngineConfig{
		{URL: pe.URL(), Model: "m", Kind: gw.KindSGLang, Stage: state.StagePrefill},
		{URL: de.URL(), Model: "m", Kind: gw.KindSGLang, Stage: state.StageDecode},
	}, gw.Options{PrefillTimeout: 50 * time.Millisecond})
	prefill, _ := f.registry.Lookup(state.EngineID(pe.URL()))
	var codes []int
	var healthy []bool
	for range 3 {
		code, _ := f.post(t, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, nil)
		codes = append(codes, code)
		healthy = append(healthy, prefill.Healthy())
	}
	assert.Equal(t, []int{502, 502, 502}, codes)
	assert.Equal(t, []bool{true, true, false}, healthy)
}

// A request the gateway refuses gets a 400 whose message names the field and the cause, quoting
// the value; nothing reaches the engine.
func TestRequestValidationNamesTheCause(t *testing.T) {
	t.Parallel()
	eng := engine(t)
	f := newFixture(t, []gw.EngineConfig{{URL: eng.URL(), Model: "m", Kind: gw.KindVLLM}}, gw.Options{})
	chat := func(extra string) string {
		return `{"model":"m","messages":[{"role":"user","content":"hi"}]` + extra + `}`
	}
	// tooLarge is the message for a token count over the bound left by the prompt's estimated length.
	tooLarge := func(field, value, body string) string {
		in := gw.EstimateTokens(len(body), gw.DefaultBytesPerToken)
		return fmt.Sprintf("%s %s is too large: at most %d, so that it plus the prompt's %d tokens stays within %d",
			field, value, int64(math.MaxInt64)-in, in, int64(math.MaxInt64))
	}
	const maxInt64 = `,"max_tokens":9223372036854775807`
	const overInt64 = `,"max_completion_tokens":9223372036854775808`
	for _, tc := range []struct {
		name, path, body string
		code             int
		message          string
	}{
		{"max_tokens_max_int64", "/v1/chat/completions", chat(maxInt64), 400, tooLarge("max_tokens", "9223372036854775807", chat(maxInt64))},
		{"max_completion_tokens_over_int64", "/v1/chat/completions", chat(overInt64), 400, tooLarge("max_completion_tokens", "9223372036854775808", chat(overInt64))},
		{"max_tokens_word", "/v1/chat/completions", chat(`,"max_tokens":"ten"`), 400, `max_tokens must be an integer, got "ten"`},
		{"max_tokens_exponent", "/v1/chat/completions", chat(`,"max_tokens":1e30`), 400, `max_tokens must be an integer, got 1e30`},
		{"max_tokens_fraction", "/v1/completions", `{"model":"m","prompt":"hi","max_tokens":16.5}`, 400, `max_tokens must be an integer, got 16.5`},
		{"max_tokens_negative", "/v1/chat/completions", chat(`,"max_tokens":-1`), 400, `max_tokens must be a non-negative integer, got -1`},
		{"max_tokens_below_int64", "/v1/chat/completions", chat(`,"max_tokens":-9223372036854775809`), 400, `max_tokens must be a non-negative integer, got -9223372036854775809`},
		{"max_completion_tokens_bool", "/v1/chat/completions", chat(`,"max_completion_tokens":true`), 400, `max_completion_tokens must be an integer, got true`},
		{"max_tokens_long_string", "/v1/chat/completions", chat(`,"max_tokens":"` + strings.Repeat("9", 100) + `"`), 400, `max_tokens must be an integer, got "` + strings.Repeat("9", 31) + `…`},
		{"messages_empty", "/v1/chat/completions", `{"model":"m","messages":[ ]}`, 400, `messages must be a non-empty array`},
		{"messages_string", "/v1/chat/completions", `{"model":"m","messages":"hi"}`, 400, `messages must be an array, got "hi"`},
		{"messages_null", "/v1/chat/completions", `{"model":"m","messages":null}`, 400, `messages is required`},
		{"messages_missing", "/v1/chat/completions", `{"model":"m"}`, 400, `messages is required`},
		{"prompt_missing", "/v1/completions", `{"model":"m"}`, 400, `prompt is required`},
		{"model_missing", "/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}]}`, 400, `model is required`},
		{"model_empty", "/v1/chat/completions", `{"model":"","messages":[{"role":"user","content":"hi"}]}`, 400, `model is required`},
		{"model_number", "/v1/chat/completions", `{"model":5,"messages":[{"role":"user","content":"hi"}]}`, 400, `model must be a string, got 5`},
		{"stream_string", "/v1/chat/completions", chat(`,"stream":"yes"`), 400, `stream must be a boolean, got "yes"`},
		{"not_json", "/v1/chat/completions", `hello`, 400, `the request body is not a JSON object`},
		{"json_array", "/v1/chat/completions", `[1,2]`, 400, `the request body is not a JSON object`},
		{"json_null", "/v1/chat/completions", `null`, 400, `the request body is not a JSON object`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, body := f.post(t, tc.path, tc.body, nil)
			assert.Equal(t, tc.code, code, "body %s", body)
			var e struct {
				Error struct {
					Message string `json:"message"`
					Type    string `json:"type"`
					Code    int    `json:"code"`
				} `json:"error"`
			}
			require.NoError(t, json.Unmarshal([]byte(body), &e), "body %s", body)
			assert.Equal(t, tc.message, e.Error.Message)
			assert.Equal(t, "invalid_request_error", e.Error.Type)
			assert.Equal(t, tc.code, e.Error.Code)
		})
	}
	assert.Empty(t, eng.Requests(), "no refused request reached the engine")
	for _, body := range []string{chat(`,"max_tokens":null`), chat(`,"max_tokens":0,"max_completion_tokens":16,"stream":false`)} {
		code, answer := f.post(t, "/v1/chat/completions", body, nil)
		assert.Equal(t, http.StatusOK, code, "%s: %s", body, answer)
	}
}

// A body over MaxBodyBytes is the gateway's own 413, whether its Content-Length says so (refused
// unread) or it is sent chunked; nothing reaches the engine.
func TestBodyOverTheLimitIs413(t *testing.T) {
	t.Parallel()
	eng := engine(t)
	f := newFixture(t, []gw.EngineConfig{{URL: eng.URL(), Model: "m", Kind: gw.KindVLLM}}, gw.Options{MaxBodyBytes: 64})
	body := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("x", 64) + `"}]}`
	for name, reader := range map[string]io.Reader{
		"content_length": strings.NewReader(body),
		"chunked":        io.MultiReader(strings.NewReader(body)), // no length known: sent chunked
	} {
		resp, err := http.Post(f.srv.URL+"/v1/chat/completions", "application/json", reader)
		require.NoError(t, err, name)
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		assert.Equal(t, http.StatusRequestEntityTooLarge, resp.StatusCode, name)
		assert.JSONEq(t, `{"error":{"message":"request body is larger than 64 bytes","type":"invalid_request_error","code":413}}`, string(b), name)
	}
	assert.Empty(t, eng.Requests())
}
