package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"

	"github.com/enginepick/enginepick/examples/gateway/internal/fakeengine"
	"github.com/enginepick/enginepick/state"
)

// startGateway builds the gateway from flags, serves it on loopback and runs its background work
// until the test ends.
func startGateway(t testing.TB, args ...string) (*gateway, *httptest.Server) {
	t.Helper()
	o, err := parseArgs(args, io.Discard)
	require.NoError(t, err)
	g, err := build(o, zap.NewNop())
	require.NoError(t, err)
	srv := httptest.NewServer(g.handler)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = g.runBackground(ctx); close(done) }()
	t.Cleanup(func() {
		srv.Close()
		cancel()
		<-done
		g.close()
	})
	return g, srv
}

func newEngine(t testing.TB) *fakeengine.Engine {
	e := fakeengine.New()
	t.Cleanup(e.Close)
	return e
}

func engineFlag(e *fakeengine.Engine, extra string) string {
	s := "--engine=url=" + e.URL() + ",model=m,kind=vllm,load=none"
	if extra != "" {
		s += "," + extra
	}
	return s
}

func post(t *testing.T, ctx context.Context, url, body string, header map[string]string) *http.Response {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	return resp
}

const chatBody = `{"model":"m","stream":true,"messages":[{"role":"user","content":"hello there"}],"max_tokens":16}`

// A stream is relayed byte for byte, each chunk as it arrives: the client reads the first event
// while the engine still holds the second back.
func TestStreamRelayedByteForByteAsItArrives(t *testing.T) {
	t.Parallel()
	eng := newEngine(t)
	chunks := []string{"data: {\"a\":1}\n\n", ": keep-alive comment\n\ndata: {\"b\":\"é\\u00e9\"}\n\n", "data: [DONE]\n\n"}
	next := make(chan struct{})
	eng.SetChunks(chunks, next, false)
	_, gwSrv := startGateway(t, engineFlag(eng, ""))

	resp := post(t, context.Background(), gwSrv.URL+"/v1/chat/completions", chatBody, nil)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, "text/event-stream", resp.Header.Get("Content-Type"))
	first := make([]byte, len(chunks[0]))
	_, err := io.ReadFull(resp.Body, first)
	require.NoError(t, err, "the first event arrives before the engine sends the second")
	assert.Equal(t, chunks[0], string(first))
	next <- struct{}{}
	next <- struct{}{}
	rest, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	assert.Equal(t, chunks[1]+chunks[2], string(rest))
}

// The in-flight guard is held while the stream runs and released when the client disconnects;
// the engine sees its request cancelled.
func TestClientDisconnectReleasesGuard(t *testing.T) {
	t.Parallel()
	eng := newEngine(t)
	eng.SetChunks([]string{"data: {\"a\":1}\n\n"}, nil, true)
	g, gwSrv := startGateway(t, engineFlag(eng, ""))
	id := state.EngineID(eng.URL())

	ctx, cancel := context.WithCancel(context.Background())
	resp := post(t, ctx, gwSrv.URL+"/v1/chat/completions", chatBody, nil)
	_, err := bufio.NewReader(resp.Body).ReadString('\n')
	require.NoError(t, err)
	assert.Equal(t, uint64(1), g.inflight.Count(id), "held while the stream is open")
	cancel()
	resp.Body.Close()
	require.Eventually(t, func() bool { return g.inflight.Count(id) == 0 }, 5*time.Second, 5*time.Millisecond,
		"released when the client leaves")
	require.Eventually(t, func() bool { return eng.InFlight() == 0 }, 5*time.Second, 5*time.Millisecond)
	reqs := eng.Requests()
	require.Len(t, reqs, 1)
	assert.False(t, reqs[0].Completed, "the engine request was cancelled with the client")
	assert.True(t, g.registry.All()[0].Healthy(), "a client leaving is not the engine's failure")
}

func pdArgs(prefill, decode *fakeengine.Engine) []string {
	return []string{
		"--engine=url=" + prefill.URL() + ",model=m,kind=sglang,stage=prefill,bootstrap_port=8998,load=none",
		"--engine=url=" + decode.URL() + ",model=m,kind=sglang,stage=decode,load=none",
		"--policy=round_robin",
	}
}

func TestPDLegsCarryMatchingBootstrapFields(t *testing.T) {
	t.Parallel()
	prefill, decode := newEngine(t), newEngine(t)
	g, gwSrv := startGateway(t, pdArgs(prefill, decode)...)
	for _, stream := range []bool{false, true} {
		body := fmt.Sprintf(`{"model":"m","stream":%v,"messages":[{"role":"user","content":"hi"}]}`, stream)
		resp := post(t, context.Background(), gwSrv.URL+"/v1/chat/completions", body, nil)
		got, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode, "body %s", got)
		if stream {
			assert.Contains(t, string(got), "data: [DONE]")
		} else {
			assert.Contains(t, string(got), `"content":"Hello"`)
		}
	}
	// The legs run concurrently: the client's answer (the decode leg) can end before the prefill
	// leg of the same request has reached its engine.
	require.Eventually(t, func() bool { return len(prefill.Requests()) == 2 }, 5*time.Second, 5*time.Millisecond,
		"both prefill legs reach the prefill engine")
	pr, dr := prefill.Requests(), decode.Requests()
	require.Len(t, pr, 2)
	require.Len(t, dr, 2)
	// Pair the legs by room: the prefill legs may reach their engine in either order.
	prefillOf := map[string]int{}
	for i := range pr {
		prefillOf[string(pr[i].Body["bootstrap_room"])] = i
	}
	rooms := map[string]bool{}
	for j := range 2 {
		i, ok := prefillOf[string(dr[j].Body["bootstrap_room"])]
		require.True(t, ok, "decode leg %d's room %s was sent to the prefill engine", j, dr[j].Body["bootstrap_room"])
		for _, field := range []string{"bootstrap_host", "bootstrap_port", "bootstrap_room", "messages", "model", "stream"} {
			assert.JSONEq(t, string(pr[i].Body[field]), string(dr[j].Body[field]), "field %s equal on both legs", field)
		}
		assert.JSONEq(t, `"127.0.0.1"`, string(pr[i].Body["bootstrap_host"]), "the prefill engine's host")
		assert.JSONEq(t, `8998`, string(pr[i].Body["bootstrap_port"]))
		var room uint64
		require.NoError(t, json.Unmarshal(pr[i].Body["bootstrap_room"], &room))
		assert.Less(t, room, uint64(1)<<63, "room in [0, 2^63)")
		rooms[string(pr[i].Body["bootstrap_room"])] = true
	}
	assert.Len(t, rooms, 2, "each request draws its own room")
	require.Eventually(t, func() bool {
		return g.inflight.Count(state.EngineID(prefill.URL())) == 0 && g.inflight.Count(state.EngineID(decode.URL())) == 0
	}, 5*time.Second, 5*time.Millisecond)
}

// The prefill leg completes even if the client leaves, and its guard is held until it does; the
// decode leg's guard is released with the decode leg (Dispatch.ReleaseStage, per leg).
func TestPDPrefillCompletesWhenClientLeaves(t *testing.T) {
	t.Parallel()
	prefill, decode := newEngine(t), newEngine(t)
	gate := make(chan struct{})
	var once sync.Once
	open := func() { once.Do(func() { close(gate) }) }
	t.Cleanup(open) // runs before the engines close, so a failed test does not hang
	prefill.SetGate(gate)
	decode.SetChunks([]string{"data: {\"a\":1}\n\n"}, nil, true)
	g, gwSrv := startGateway(t, pdArgs(prefill, decode)...)
	p, d := state.EngineID(prefill.URL()), state.EngineID(decode.URL())

	ctx, cancel := context.WithCancel(context.Background())
	resp := post(t, ctx, gwSrv.URL+"/v1/chat/completions", chatBody, nil)
	_, err := bufio.NewReader(resp.Body).ReadString('\n')
	require.NoError(t, err)
	cancel()
	resp.Body.Close()
	require.Eventually(t, func() bool { return decode.InFlight() == 0 }, 5*time.Second, 5*time.Millisecond,
		"the decode request ends with the client")
	time.Sleep(20 * time.Millisecond)
	assert.Equal(t, int64(1), prefill.InFlight(), "the prefill request still runs")
	assert.Equal(t, uint64(1), g.inflight.Count(p), "its guard is held")
	require.Eventually(t, func() bool { return g.inflight.Count(d) == 0 }, 5*time.Second, 5*time.Millisecond,
		"the decode leg ended with the client: its guard is released")
	open()
	require.Eventually(t, func() bool { return g.inflight.Count(p) == 0 && g.inflight.Count(d) == 0 }, 5*time.Second, 5*time.Millisecond,
		"released once the prefill leg ended")
	require.Len(t, prefill.Requests(), 1)
	require.Eventually(t, func() bool { return prefill.Requests()[0].Completed }, 5*time.Second, 5*time.Millisecond,
		"the prefill request ran to the end although the client left")
}

func TestPDPrefillClientErrorIsRelayed(t *testing.T) {
	t.Parallel()
	prefill, decode := newEngine(t), newEngine(t)
	prefill.SetStatus(http.StatusBadRequest, `{"object":"error","message":"bad sampling params","code":400}`)
	g, gwSrv := startGateway(t, pdArgs(prefill, decode)...)
	resp := post(t, context.Background(), gwSrv.URL+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, nil)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	assert.Equal(t, http.StatusBadRequest, resp.StatusCode)
	assert.JSONEq(t, `{"object":"error","message":"bad sampling params","code":400}`, string(body))
	for _, e := range g.registry.All() {
		assert.True(t, e.Healthy(), "a 4xx is the client's error")
	}
}

// Engine errors are relayed with their status and body. 4xx never count against the engine; a 5xx
// probes it, and a streak of failed probes marks it unhealthy (selection then fails with 503); a
// probe of the periodic round brings it back.
func TestEngineErrorsAndCircuitBreaker(t *testing.T) {
	t.Parallel()
	eng := newEngine(t)
	g, gwSrv := startGateway(t, engineFlag(eng, ""), "--breaker-failures=3", "--probe-interval=10ms")
	e := g.registry.All()[0]
	body := `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	call := func() (int, string) {
		resp := post(t, context.Background(), gwSrv.URL+"/v1/chat/completions", body, nil)
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp.StatusCode, string(b)
	}

	eng.SetStatus(http.StatusBadRequest, `{"error":{"message":"context too long"}}`)
	eng.SetHealth(http.StatusServiceUnavailable) // the prober must not be what keeps it healthy
	for range 5 {
		code, b := call()
		assert.Equal(t, http.StatusBadRequest, code)
		assert.Equal(t, `{"error":{"message":"context too long"}}`, b)
	}
	assert.True(t, e.Healthy(), "4xx answers never count")
	ok, failed := e.Probes()
	assert.Equal(t, [2]uint64{0, 0}, [2]uint64{ok, failed}, "nor probe the engine")

	eng.SetStatus(http.StatusInternalServerError, `{"error":{"message":"CUDA error"}}`)
	for i := range 3 {
		code, b := call()
		assert.Equal(t, http.StatusInternalServerError, code, "a 5xx is relayed with its status")
		assert.Equal(t, `{"error":{"message":"CUDA error"}}`, b)
		require.Eventually(t, func() bool { _, failed := e.Probes(); return failed >= uint64(i+1) }, 5*time.Second, time.Millisecond,
			"each 5xx probes the engine, whose /health fails")
		assert.Equal(t, i < 2, e.Healthy(), "after %d 5xx and failed probes", i+1)
	}
	code, b := call()
	assert.Equal(t, http.StatusServiceUnavailable, code, "no healthy engine left")
	assert.NotContains(t, b, eng.URL())
	assert.NotContains(t, b, "127.0.0.1")

	eng.SetStatus(0, "")
	eng.SetHealth(http.StatusOK)
	require.Eventually(t, e.Healthy, 5*time.Second, 5*time.Millisecond, "a successful probe closes the breaker")
	code, _ = call()
	assert.Equal(t, http.StatusOK, code)
}

// An engine that closes the connection before reading a small body has failed: no engine server
// limits bodies under 4 MiB, so the client gets a 502, not the 413 of a refused body, even when
// the engine's health probe answers 200 at once (an engine restarted while the body was sent).
// Before, a body just under 1 MiB an engine dropped was a 413.
func TestSmallBodyDroppedIsTheEnginesFailure(t *testing.T) {
	t.Parallel()
	a := newEngine(t)
	a.SetBodyLimit(64, true)
	_, gwSrv := startGateway(t, engineFlag(a, ""), "--policy=round_robin", "--probe-interval=1h")
	body := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("x", 1<<20-1<<10) + `"}]}`
	resp := post(t, context.Background(), gwSrv.URL+"/v1/chat/completions", body, nil)
	resp.Body.Close()
	assert.Equal(t, http.StatusBadGateway, resp.StatusCode)
}

// A body the engines refuse is the client's error, never the engines': requests with a 5.5 MiB
// body, under the gateway's limit and over the engines' 4 MiB, each get a 413 whether the engine
// answers 413 or closes the connection before reading the body; every breaker stays closed and the
// next normal request is served. The PD case sends fewer (each costs two 5.5 MiB legs), still more
// than the breaker's streak of 3.
func TestOversizedBodiesNeverOpenTheBreaker(t *testing.T) {
	t.Parallel()
	const engineLimit = 4 << 20
	big := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("x", 5<<20+1<<19) + `"}]}`
	for _, tc := range []struct {
		name     string
		pd, drop bool
		requests int
	}{
		{"plain_answers_413", false, false, 8},
		{"plain_closes_connection", false, true, 8},
		{"pd_closes_connection", true, true, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			a, b := newEngine(t), newEngine(t)
			for _, e := range []*fakeengine.Engine{a, b} {
				e.SetBodyLimit(engineLimit, tc.drop)
			}
			args := []string{engineFlag(a, ""), engineFlag(b, ""), "--policy=round_robin"}
			if tc.pd {
				// Without tokenization: the oversized prompts' /tokenize calls only cost time here.
				args = append(pdArgs(a, b), "--tokenize=false")
			}
			g, gwSrv := startGateway(t, append(args, "--probe-interval=1h")...)
			var codes []int
			for range tc.requests {
				resp := post(t, context.Background(), gwSrv.URL+"/v1/chat/completions", big, nil)
				body, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				require.NoError(t, err)
				codes = append(codes, resp.StatusCode)
				// The engine's own 413 body is relayed as it is; the gateway's is OpenAI-style.
				var e struct {
					Error struct {
						Code int `json:"code"`
					} `json:"error"`
					Code int `json:"code"`
				}
				require.NoError(t, json.Unmarshal(body, &e), "an error body: %s", body)
				assert.Equal(t, http.StatusRequestEntityTooLarge, max(e.Error.Code, e.Code), "body %s", body)
			}
			want := make([]int, tc.requests)
			for i := range want {
				want[i] = http.StatusRequestEntityTooLarge
			}
			assert.Equal(t, want, codes)
			for _, e := range g.registry.All() {
				assert.True(t, e.Healthy(), "engine %s healthy", e.ID())
				assert.Zero(t, e.Opens(), "engine %s's breaker never opened", e.ID())
			}
			resp := post(t, context.Background(), gwSrv.URL+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, nil)
			resp.Body.Close()
			assert.Equal(t, http.StatusOK, resp.StatusCode, "the next normal request is served")
		})
	}
}

func TestConnectionFailureMarksEngineUnhealthy(t *testing.T) {
	t.Parallel()
	eng := newEngine(t)
	url := eng.URL()
	g, gwSrv := startGateway(t, "--engine=url="+url+",model=m,kind=vllm,load=none", "--tokenize=false", "--probe-interval=1h")
	eng.Close()
	resp := post(t, context.Background(), gwSrv.URL+"/v1/completions", `{"model":"m","prompt":"hi"}`, nil)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	assert.Equal(t, http.StatusBadGateway, resp.StatusCode)
	assert.NotContains(t, string(b), url)
	assert.False(t, g.registry.All()[0].Healthy(), "one connection failure opens the breaker")
}

func TestSelectionErrorsAreOpenAIJSON(t *testing.T) {
	t.Parallel()
	eng := newEngine(t)
	_, gwSrv := startGateway(t, engineFlag(eng, ""), "--max-body-bytes=4096")
	cases := []struct {
		name, body string
		code       int
		typ        string
	}{
		{"unknown_model", `{"model":"other","messages":[{"role":"user","content":"hi"}]}`, http.StatusNotFound, "model_not_found"},
		{"no_model", `{"messages":[]}`, http.StatusBadRequest, "invalid_request_error"},
		{"not_json", `hello`, http.StatusBadRequest, "invalid_request_error"},
		{"no_messages", `{"model":"m"}`, http.StatusBadRequest, "invalid_request_error"},
		{"negative_max_tokens", `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":-1}`, http.StatusBadRequest, "invalid_request_error"},
		{"body_too_large", `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("x", 5000) + `"}]}`, http.StatusRequestEntityTooLarge, "invalid_request_error"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			resp := post(t, context.Background(), gwSrv.URL+"/v1/chat/completions", tc.body, nil)
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			assert.Equal(t, tc.code, resp.StatusCode)
			var e struct {
				Error struct {
					Message string `json:"message"`
					Type    string `json:"type"`
					Code    int    `json:"code"`
				} `json:"error"`
			}
			require.NoError(t, json.Unmarshal(b, &e), "body %s", b)
			assert.Equal(t, tc.typ, e.Error.Type)
			assert.Equal(t, tc.code, e.Error.Code)
			assert.NotEmpty(t, e.Error.Message)
			assert.NotContains(t, string(b), eng.URL())
			if tc.code == http.StatusNotFound {
				assert.Equal(t, `model "other" is not served here: GET /v1/models lists the served models`, e.Error.Message)
			}
		})
	}
	assert.Empty(t, eng.Requests(), "no request reached the engine")
}

func TestPromptsTokenizedThroughTheEngine(t *testing.T) {
	t.Parallel()
	eng := newEngine(t)
	g, gwSrv := startGateway(t, engineFlag(eng, ""))
	resp := post(t, context.Background(), gwSrv.URL+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, nil)
	resp.Body.Close()
	tok := eng.LastTokenize()
	assert.JSONEq(t, `[{"role":"user","content":"hi"}]`, string(tok["messages"]), "chat requests are tokenized with their messages")
	assert.JSONEq(t, `"m"`, string(tok["model"]))

	resp = post(t, context.Background(), gwSrv.URL+"/v1/completions", `{"model":"m","prompt":"once upon"}`, nil)
	resp.Body.Close()
	tok = eng.LastTokenize()
	assert.JSONEq(t, `"once upon"`, string(tok["prompt"]))
	_, hasMessages := tok["messages"]
	assert.False(t, hasMessages)
	assert.Equal(t, int64(2), eng.Tokenized.Load())
	assert.Zero(t, metricValue(t, g, "gateway_estimated_prompts_total"))

	eng.SetTokenizeStatus(http.StatusNotFound) // an engine without /tokenize
	resp = post(t, context.Background(), gwSrv.URL+"/v1/completions", `{"model":"m","prompt":"once upon"}`, nil)
	resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode, "the request is served with an estimated length")
	assert.Equal(t, float64(1), metricValue(t, g, "gateway_estimated_prompts_total"))
}

// metricValue reads one unlabelled series from the gateway's /metrics; the series must exist.
func metricValue(t *testing.T, g *gateway, name string) float64 {
	t.Helper()
	v, ok := lookupSeries(t, g, name)
	require.True(t, ok, "metric %s not found", name)
	return v
}

func TestLoadPolledFromEngines(t *testing.T) {
	t.Parallel()
	v, s := newEngine(t), newEngine(t)
	v.SetLoad("vllm:num_requests_running{engine=\"0\"} 3\nvllm:num_requests_waiting{engine=\"0\"} 7\n")
	s.SetLoad(`{"loads":[{"dp_rank":0,"num_running_reqs":1,"num_waiting_reqs":2},{"dp_rank":1,"num_running_reqs":4,"num_waiting_reqs":0}]}`)
	g, _ := startGateway(t, "--engine=url="+v.URL()+",model=m,kind=vllm",
		"--engine=url="+s.URL()+",model=m,kind=sglang,dp_ranks=2", "--load-interval=100ms", "--load-timeout=100ms")
	require.Eventually(t, func() bool {
		_, a := g.table.Snapshot().Load(state.EngineID(v.URL()))
		_, b := g.table.Snapshot().Load(state.EngineID(s.URL()))
		return a && b
	}, 20*time.Second, 5*time.Millisecond)
	lv, _ := g.table.Snapshot().Load(state.EngineID(v.URL()))
	assert.Equal(t, uint64(7), lv.WaitingRequests)
	ls, _ := g.table.Snapshot().Load(state.EngineID(s.URL()))
	assert.Equal(t, uint64(5), ls.RunningRequests)
	assert.Equal(t, 2, ls.Ranks)
}

func TestHealthz(t *testing.T) {
	t.Parallel()
	eng := newEngine(t)
	_, gwSrv := startGateway(t, engineFlag(eng, ""))
	resp, err := http.Get(gwSrv.URL + "/healthz")
	require.NoError(t, err)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, "ok\n", string(b))
}

// mainArgsEnv makes the test binary run main with these (space-separated) arguments, so that
// TestHelpPrintedOnce sees the command's real stdout, stderr and exit code.
const mainArgsEnv = "GATEWAY_TEST_MAIN_ARGS"

// --help and -h print the usage once, to stdout; a bad flag prints one line, to stderr.
func TestHelpPrintedOnce(t *testing.T) {
	if args, ok := os.LookupEnv(mainArgsEnv); ok {
		os.Args = append([]string{"gateway"}, strings.Fields(args)...)
		main()
		os.Exit(0)
	}
	t.Parallel()
	command := func(args string) (stdout, stderr string, code int) {
		cmd := exec.Command(os.Args[0], "-test.run=^TestHelpPrintedOnce$")
		cmd.Env = append(os.Environ(), mainArgsEnv+"="+args)
		var out, errOut bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errOut
		err := cmd.Run()
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			return out.String(), errOut.String(), exit.ExitCode()
		}
		require.NoError(t, err)
		return out.String(), errOut.String(), 0
	}
	for _, arg := range []string{"--help", "-h"} {
		stdout, stderr, code := command(arg)
		assert.Zero(t, code, arg)
		assert.Equal(t, 1, strings.Count(stdout, "Usage: gateway [flags]"), "%s: the usage once", arg)
		assert.Equal(t, 1, strings.Count(stdout, "\n  -listen string\n"), "%s: the flags once", arg)
		assert.True(t, strings.HasPrefix(stdout, "gateway: an OpenAI-compatible HTTP gateway"), arg)
		assert.Empty(t, stderr, arg)
	}
	stdout, stderr, code := command("--listne=:1")
	assert.Equal(t, 1, code)
	assert.Empty(t, stdout)
	assert.Equal(t, "gateway: flag provided but not defined: -listne (gateway --help lists the flags)\n", stderr)
}

// GET /v1/models lists the served models in OpenAI's format, as vLLM's server does.
func TestModelsListsTheServedModels(t *testing.T) {
	t.Parallel()
	e1, e2, e3 := newEngine(t), newEngine(t), newEngine(t)
	before := time.Now().Unix()
	_, gwSrv := startGateway(t, "--engine=url="+e1.URL()+",model=llama,kind=vllm,load=none",
		"--engine=url="+e2.URL()+",model=qwen,kind=sglang,load=none",
		"--engine=url="+e3.URL()+",model=llama,kind=vllm,load=none")
	after := time.Now().Unix()
	resp, err := http.Get(gwSrv.URL + "/v1/models")
	require.NoError(t, err)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, "body %s", b)
	assert.Equal(t, "application/json", resp.Header.Get("Content-Type"))
	var list struct {
		Object string `json:"object"`
		Data   []struct {
			ID      string `json:"id"`
			Object  string `json:"object"`
			Created int64  `json:"created"`
			OwnedBy string `json:"owned_by"`
		} `json:"data"`
	}
	require.NoError(t, json.Unmarshal(b, &list), "body %s", b)
	assert.Equal(t, "list", list.Object)
	require.Len(t, list.Data, 2, "each model once: %s", b)
	for i, id := range []string{"llama", "qwen"} {
		assert.Equal(t, id, list.Data[i].ID)
		assert.Equal(t, "model", list.Data[i].Object)
		assert.Equal(t, "enginepick", list.Data[i].OwnedBy)
		assert.GreaterOrEqual(t, list.Data[i].Created, before)
		assert.LessOrEqual(t, list.Data[i].Created, after)
	}
}

// --help documents every flag, and each flag has a description.
func TestHelpDocumentsEveryFlag(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	err := run(context.Background(), []string{"--help"}, &out, io.Discard, nil)
	require.ErrorIs(t, err, flag.ErrHelp)
	var o options
	fs := newFlagSet(&o)
	n := 0
	fs.VisitAll(func(f *flag.Flag) {
		n++
		assert.Contains(t, out.String(), "  -"+f.Name, "flag %s in --help", f.Name)
		assert.GreaterOrEqual(t, len(f.Usage), 20, "flag %s has a description", f.Name)
	})
	assert.GreaterOrEqual(t, n, 20)
	for _, key := range []string{"url=", "model=", "kind=", "stage=", "dp_ranks=", "bootstrap_port=", "pd_compatibility=",
		"load=", "load_url=", "kv_events=", "kv_topic=", "kv_replay=", "kv_bind=", "dp_rank_start=", "ranks.R.KEY="} {
		assert.Contains(t, out.String(), key, "engine key %s documented", key)
	}
}

func TestInvalidConfigurationIsRefused(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	unknown := filepath.Join(dir, "unknown.yaml")
	require.NoError(t, os.WriteFile(unknown, []byte("engines:\n  - url: http://127.0.0.1:1\n    model: m\n    kind: vllm\n    colour: red\n"), 0o600))
	good := filepath.Join(dir, "good.yaml")
	require.NoError(t, os.WriteFile(good, []byte("engines:\n  - url: http://127.0.0.1:1\n    model: m\n    kind: sglang\n    stage: plain\n    load: sglang_get_load\n"), 0o600))
	cases := []struct {
		name string
		args []string
	}{
		{"no_engines", nil},
		{"unknown_file_key", []string{"--engines-file=" + unknown}},
		{"unknown_flag_key", []string{"--engine=url=http://127.0.0.1:1,model=m,kind=vllm,colour=red"}},
		{"bad_kind", []string{"--engine=url=http://127.0.0.1:1,model=m,kind=tgi"}},
		{"bad_stage", []string{"--engine=url=http://127.0.0.1:1,model=m,kind=vllm,stage=mixed"}},
		{"prefill_without_decode", []string{"--engine=url=http://127.0.0.1:1,model=m,kind=sglang,stage=prefill"}},
		{"bad_load_format", []string{"--engine=url=http://127.0.0.1:1,model=m,kind=vllm,load=prometheus"}},
		{"bad_policy", []string{"--engine=url=http://127.0.0.1:1,model=m,kind=vllm", "--policy=fastest"}},
		{"cache_aware_decode", []string{"--engine=url=http://127.0.0.1:1,model=m,kind=vllm,stage=prefill",
			"--engine=url=http://127.0.0.1:2,model=m,kind=vllm,stage=decode", "--decode-policy=cache_aware"}},
		{"duplicate_engine", []string{"--engines-file=" + good, "--engine=url=http://127.0.0.1:1,model=m,kind=vllm"}},
		{"bad_block_tokens", []string{"--engine=url=http://127.0.0.1:1,model=m,kind=vllm", "--block-tokens=0"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var o options
			fs := newFlagSet(&o)
			require.NoError(t, fs.Parse(tc.args))
			_, err := build(o, zap.NewNop())
			assert.ErrorIs(t, err, state.ErrInvalidConfiguration)
		})
	}
	var o options
	fs := newFlagSet(&o)
	require.NoError(t, fs.Parse([]string{"--engines-file=" + good}))
	g, err := build(o, zap.NewNop())
	require.NoError(t, err, "a valid file")
	assert.Len(t, g.registry.All(), 1)
}

// Every policy flag value is the policy's configuration name (least_load and the others):
// the gateway accepts each name the configuration accepts, and the former load_based spelling is
// refused.
func TestPolicyFlagNamesAreConfigurationNames(t *testing.T) {
	t.Parallel()
	plain := "--engine=url=http://127.0.0.1:1,model=m,kind=vllm"
	for _, name := range []string{"round_robin", "random", "power_of_two", "least_load", "cache_aware"} {
		t.Run(name, func(t *testing.T) {
			o, err := parseArgs([]string{plain, "--policy=" + name}, io.Discard)
			require.NoError(t, err)
			g, err := build(o, zap.NewNop())
			require.NoError(t, err, "--policy=%s", name)
			g.close()
		})
	}
	o, err := parseArgs([]string{plain, "--policy=load_based"}, io.Discard)
	require.NoError(t, err)
	_, err = build(o, zap.NewNop())
	assert.ErrorIs(t, err, state.ErrInvalidConfiguration, "load_based is no longer a name")
}
