package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"

	"github.com/enginepick/enginepick/config"
	"github.com/enginepick/enginepick/examples/gateway/internal/fakeengine"
	"github.com/enginepick/enginepick/state"
)

// writeConfig writes a routing configuration file into a test directory.
func writeConfig(t *testing.T, text string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "routing.yaml")
	require.NoError(t, os.WriteFile(path, []byte(text), 0o600))
	return path
}

// TestConfigFileRoutesThroughNew runs the gateway from a routing configuration file (--config):
// the file's round_robin group over two engines alternates between them, the session header the
// file names is read, the load endpoints the file lists are polled by the Router New built, and
// /metrics serves the enginepick_* families next to the gateway's.
func TestConfigFileRoutesThroughNew(t *testing.T) {
	t.Parallel()
	a, b := newEngine(t), newEngine(t)
	a.SetLoad("vllm:num_requests_running{engine=\"0\"} 2\nvllm:num_requests_waiting{engine=\"0\"} 5\n")
	b.SetLoad(`{"loads":[{"dp_rank":0,"num_running_reqs":1,"num_waiting_reqs":0}]}`)
	path := writeConfig(t, fmt.Sprintf(`
affinity: {session_header: x-conversation}
load: {poll_interval: 50ms, poll_timeout: 50ms}
engines:
  - {id: %q, model: m, load: {url: "%s/metrics", format: vllm_metrics}}
  - {id: %q, model: m, load: {url: "%s/v1/loads", format: sglang_loads}}
models:
  - id: m
    buckets: [{id: all, groups: {plain: {policy: {type: round_robin}}}}]
  - id: chat
    buckets: [{id: all, groups: {plain: {engine_ids: [], policy: {type: session_aware}}}}]
`, a.URL(), a.URL(), b.URL(), b.URL()))
	g, gwSrv := startGateway(t, "--config="+path, "--tokenize=false")
	require.Len(t, g.registry.All(), 2)
	kinds := []string{g.registry.All()[0].Config().Kind.String(), g.registry.All()[1].Config().Kind.String()}
	assert.Equal(t, []string{"vllm", "sglang"}, kinds, "the software follows the load format")
	assert.Same(t, g.router.LoadTable(), g.table)

	for range 4 {
		resp := post(t, context.Background(), gwSrv.URL+"/v1/completions", `{"model":"m","prompt":"hello"}`, nil)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
	}
	assert.Len(t, a.Requests(), 2, "round_robin from the file alternates")
	assert.Len(t, b.Requests(), 2)

	require.Eventually(t, func() bool {
		_, okA := g.table.Snapshot().Load(state.EngineID(a.URL()))
		_, okB := g.table.Snapshot().Load(state.EngineID(b.URL()))
		return okA && okB
	}, 20*time.Second, 5*time.Millisecond, "New polls the file's load endpoints")
	la, _ := g.table.Snapshot().Load(state.EngineID(a.URL()))
	assert.Equal(t, uint64(5), la.WaitingRequests)

	var rec *httptest.ResponseRecorder
	var body string
	// Each dispatch ends (Done) after its answer has been relayed: wait for the last one.
	require.Eventually(t, func() bool {
		rec = httptest.NewRecorder()
		g.handler.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
		body = rec.Body.String()
		return strings.Contains(body, `enginepick_request_duration_seconds_count{engine="`+a.URL()+`",model_id="m",policy="round_robin",stage="plain"} 2`) &&
			strings.Contains(body, `enginepick_request_duration_seconds_count{engine="`+b.URL()+`",model_id="m",policy="round_robin",stage="plain"} 2`)
	}, 5*time.Second, 5*time.Millisecond, "every dispatch ended with Done")
	assert.Contains(t, body, `enginepick_decisions_total{bucket="all",model_id="m",policy="round_robin",reason="round_robin",stage="plain"} 4`)
	assert.Contains(t, body, "gateway_requests_total")
	assert.True(t, strings.Contains(body, `enginepick_load_polls_total{engine="`+a.URL()+`"}`), "the Router's poller is exported")
	for _, e := range []string{a.URL(), b.URL()} {
		// Each plain dispatch ends with Done: its time to first byte and its duration are observed.
		assert.Contains(t, body, `enginepick_ttft_seconds_count{engine="`+e+`",model_id="m",policy="round_robin",stage="plain"} 2`)
		assert.Contains(t, body, `enginepick_request_duration_seconds_count{engine="`+e+`",model_id="m",policy="round_robin",stage="plain"} 2`)
	}
	a.SetStatus(http.StatusInternalServerError, `{"error":"boom"}`)
	b.SetStatus(http.StatusInternalServerError, `{"error":"boom"}`)
	resp := post(t, context.Background(), gwSrv.URL+"/v1/completions", `{"model":"m","prompt":"hello"}`, nil)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusInternalServerError, resp.StatusCode)
	// The dispatch ends (Done) after the answer has been relayed, so the client can see the 500
	// before the gateway has reported it.
	require.Eventually(t, func() bool {
		rec = httptest.NewRecorder()
		g.handler.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
		return strings.Contains(rec.Body.String(), `enginepick_dispatch_failures_total{model_id="m",reason="error"} 1`)
	}, 5*time.Second, 5*time.Millisecond, "a 5xx answer is a failed dispatch")
	for _, e := range []string{a.URL(), b.URL()} {
		assert.Contains(t, rec.Body.String(), `enginepick_ttft_seconds_count{engine="`+e+`",model_id="m",policy="round_robin",stage="plain"} 2`, "and records no TTFT")
	}

	// The file's session header is the one read: an empty group answers 503 for model chat,
	// whatever the header, but the request must get that far.
	resp = post(t, context.Background(), gwSrv.URL+"/v1/completions", `{"model":"chat","prompt":"hi"}`, map[string]string{"x-conversation": "c1"})
	resp.Body.Close()
	assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
}

// TestConfigFileRefusals checks the mistakes of --config: a flag the file replaces, a file the
// loader rejects (with its typed error), an engine ID that is no base URL, an unknown
// --engine-kind.
func TestConfigFileRefusals(t *testing.T) {
	t.Parallel()
	good := writeConfig(t, "engines: [{id: \"http://127.0.0.1:1\", model: m}]\nmodels: [{id: m, buckets: [{id: a, groups: {plain: {}}}]}]\n")
	slash := writeConfig(t, "engines: [{id: \"http://127.0.0.1:1/\", model: m}]\nmodels: [{id: m, buckets: [{id: a, groups: {plain: {}}}]}]\n")
	noEngines := writeConfig(t, "models: [{id: m, buckets: [{id: a, groups: {plain: {}}}]}]\n")
	removed := writeConfig(t, "models: [{id: m, buckets: [{id: a, groups: {plain: {policy: {type: score_policy}}}}]}]\n")
	for _, tc := range []struct {
		name string
		args []string
		want error
		msg  string
	}{
		{"with_policy_flags", []string{"--config=" + good, "--policy=random", "--freshness=1s"}, state.ErrInvalidConfiguration,
			"--config and --policy, --freshness are exclusive: the file holds the engines, policies and shared settings: invalid configuration"},
		{"with_engine", []string{"--config=" + good, "--engine=url=http://127.0.0.1:2,model=m,kind=vllm"}, state.ErrInvalidConfiguration, ""},
		{"removed_option", []string{"--config=" + removed}, state.ErrRemovedOption, ""},
		{"trailing_slash", []string{"--config=" + slash}, state.ErrInvalidConfiguration, ""},
		{"no_engines", []string{"--config=" + noEngines}, state.ErrInvalidConfiguration, ""},
		{"bad_kind", []string{"--config=" + good, "--engine-kind=tgi"}, state.ErrInvalidConfiguration, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o, err := parseArgs(tc.args, io.Discard)
			require.NoError(t, err)
			_, err = build(o, zap.NewNop())
			require.ErrorIs(t, err, tc.want)
			if tc.msg != "" {
				assert.EqualError(t, err, tc.msg)
			}
		})
	}
}

// TestExampleConfigsBuildTheGateway builds the gateway from every file under examples/configs,
// the files examples/replay -config replays: the same file describes the fleet in both. The
// Redis example's store is only built (go-redis dials lazily); Close stops New's pollers.
func TestExampleConfigsBuildTheGateway(t *testing.T) {
	t.Parallel()
	files, err := filepath.Glob("../configs/*")
	require.NoError(t, err)
	require.Len(t, files, 5, "the example configurations; TestExampleFlowControlConfig serves flow-control.yaml")
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			o, err := parseArgs([]string{"--config=" + f}, io.Discard)
			require.NoError(t, err)
			g, err := build(o, zap.NewNop())
			require.NoError(t, err)
			cfg, err := config.Load(f)
			require.NoError(t, err)
			assert.Len(t, g.registry.All(), len(cfg.Engines))
			assert.Equal(t, cfg.Affinity.Store == "redis", g.router.AffinityStore() != nil && len(g.closers) == 2)
			g.close()
		})
	}
}

// TestConfigFilePDDispatchEndsWithDone checks that a PD dispatch ends with Dispatch.Done once both
// legs have ended: the decode leg's time to first byte is observed for both engines, and a prefill
// engine's 5xx makes the dispatch a failed one (docs/design.md §15.1).
func TestConfigFilePDDispatchEndsWithDone(t *testing.T) {
	t.Parallel()
	p, d := newEngine(t), newEngine(t)
	path := writeConfig(t, fmt.Sprintf(`
engines:
  - {id: %q, model: m, stage: prefill}
  - {id: %q, model: m, stage: decode}
models:
  - id: m
    buckets: [{id: all, groups: {pd: {prefill: {policy: {type: round_robin}}, decode: {policy: {type: round_robin}}}}}]
`, p.URL(), d.URL()))
	g, gwSrv := startGateway(t, "--config="+path, "--tokenize=false")
	metrics := func() string {
		rec := httptest.NewRecorder()
		g.handler.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
		return rec.Body.String()
	}
	for _, stream := range []bool{false, true} {
		resp := post(t, context.Background(), gwSrv.URL+"/v1/chat/completions",
			fmt.Sprintf(`{"model":"m","stream":%v,"messages":[{"role":"user","content":"hi"}]}`, stream), nil)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
	}
	ttft := func(e, stage string, n int) string {
		return fmt.Sprintf(`enginepick_ttft_seconds_count{engine=%q,model_id="m",policy="round_robin",stage=%q} %d`, e, stage, n)
	}
	require.Eventually(t, func() bool {
		m := metrics()
		return strings.Contains(m, ttft(p.URL(), "prefill", 2)) && strings.Contains(m, ttft(d.URL(), "decode", 2))
	}, 5*time.Second, 5*time.Millisecond, "both PD dispatches ended with Done and a time to first token")

	p.SetStatus(http.StatusInternalServerError, `{"error":"boom"}`)
	resp := post(t, context.Background(), gwSrv.URL+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, nil)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	assert.Equal(t, http.StatusBadGateway, resp.StatusCode)
	require.Eventually(t, func() bool {
		return strings.Contains(metrics(), `enginepick_dispatch_failures_total{model_id="m",reason="error"} 1`)
	}, 5*time.Second, 5*time.Millisecond, "a failed prefill leg makes the dispatch a failed one")
	assert.Contains(t, metrics(), ttft(d.URL(), "decode", 2), "and records no time to first token")
}

// TestExampleFlowControlConfig serves examples/configs/flow-control.yaml over two test engines
// (the file's, at their addresses): with both engines at their caps of 32, a best-effort request
// (x-enginepick-priority: -1) is shed at once with 429, an interactive one (priority 1) waits, and
// when one response ends the interactive request takes its place on that engine.
func TestExampleFlowControlConfig(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("../configs/flow-control.yaml")
	require.NoError(t, err)
	engines := []*fakeengine.Engine{newEngine(t), newEngine(t)}
	gates := []chan struct{}{make(chan struct{}), make(chan struct{})}
	text := string(raw)
	for i, e := range engines {
		e.SetGate(gates[i])
		e.SetLoad("vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")
		text = strings.ReplaceAll(text, fmt.Sprintf("http://10.0.0.%d:8000", i+1), e.URL())
	}
	require.NotContains(t, text, "10.0.0.")
	_, srv := startGateway(t, "--config="+writeConfig(t, text), "--tokenize=false")
	var once sync.Once
	releaseAll := func() {
		once.Do(func() {
			for _, g := range gates {
				close(g)
			}
		})
	}
	t.Cleanup(releaseAll) // before the gateway stops, which waits for the held requests

	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 128}}
	t.Cleanup(client.CloseIdleConnections)
	send := func(prompt, priority string) chan int {
		done := make(chan int, 1)
		go func() {
			req, _ := http.NewRequest(http.MethodPost, srv.URL+"/v1/completions",
				strings.NewReader(`{"model":"llama-3.1-8b","prompt":"`+prompt+`"}`))
			req.Header.Set("x-enginepick-priority", priority)
			resp, err := client.Do(req)
			if err != nil {
				done <- 0
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			done <- resp.StatusCode
		}()
		return done
	}
	var held []chan int
	for i := range 64 {
		held = append(held, send(fmt.Sprintf("bulk-%d", i), "0"))
	}
	// Below the top band a request leaves each engine's last slot to the interactive band.
	require.Eventually(t, func() bool { return engines[0].InFlight() == 31 && engines[1].InFlight() == 31 },
		5*time.Second, time.Millisecond, "both engines at their caps for the default band")

	assert.Equal(t, http.StatusTooManyRequests, <-send("best-effort", "-1"), "best effort is shed while both engines are at their caps")
	interactive := send("interactive", "1")
	prompts := func(e *fakeengine.Engine) []string {
		var out []string
		for _, r := range e.Requests() {
			out = append(out, string(r.Body["prompt"]))
		}
		return out
	}
	require.Eventually(t, func() bool {
		return slices.Contains(prompts(engines[0]), `"interactive"`) || slices.Contains(prompts(engines[1]), `"interactive"`)
	}, 5*time.Second, time.Millisecond, "the interactive request takes an engine's last slot at once")
	assert.Equal(t, 63, len(prompts(engines[0]))+len(prompts(engines[1])), "two default-band requests still wait")

	releaseAll()
	assert.Equal(t, http.StatusOK, <-interactive)
	for _, ch := range held {
		assert.Equal(t, http.StatusOK, <-ch)
	}
}

// enginePriority maps a request's priority to its band's, negated, as vLLM's priority field.
func TestEnginePriorityMapping(t *testing.T) {
	t.Parallel()
	assert.Nil(t, enginePriority(false, []int{0}), "off: the body is forwarded as it is")
	for _, tc := range []struct {
		bands []int
		in    map[int]int
	}{
		{nil, map[int]int{3: -3, 0: 0, -2: 2}},
		{[]int{1, 0, -1}, map[int]int{5: -1, 1: -1, 0: 0, -1: 1, -7: 1}},
		{[]int{10, 0}, map[int]int{9: 0, 10: -10, -1: 0}},
	} {
		f := enginePriority(true, tc.bands)
		for p, want := range tc.in {
			assert.Equal(t, want, f(p), "bands %v, priority %d", tc.bands, p)
		}
	}
}
