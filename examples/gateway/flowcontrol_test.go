package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/internal/testengine"
)

// series reads one labelled series (name{labels}, labels in the exposition's order) from the
// gateway's /metrics; 0 when absent.
func series(t *testing.T, g *gateway, nameAndLabels string) float64 {
	t.Helper()
	v, _ := lookupSeries(t, g, nameAndLabels)
	return v
}

// lookupSeries reads one series (name, or name{labels} in the exposition's order) from the
// gateway's /metrics, and whether it exists.
func lookupSeries(t *testing.T, g *gateway, nameAndLabels string) (float64, bool) {
	t.Helper()
	rec := httptest.NewRecorder()
	g.handler.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	require.Equal(t, http.StatusOK, rec.Code)
	for _, line := range strings.Split(rec.Body.String(), "\n") {
		if v, ok := strings.CutPrefix(line, nameAndLabels+" "); ok {
			var f float64
			_, err := fmt.Sscan(v, &f)
			require.NoError(t, err)
			return f, true
		}
	}
	return 0, false
}

// openAIError decodes an OpenAI-style error body.
func openAIError(t *testing.T, resp *http.Response) (typ, msg string) {
	t.Helper()
	var e struct {
		Error struct {
			Message string `json:"message"`
			Type    string `json:"type"`
			Code    int    `json:"code"`
		} `json:"error"`
	}
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &e), "body %s", b)
	assert.Equal(t, resp.StatusCode, e.Error.Code)
	return e.Error.Type, e.Error.Message
}

// The --config file's flow_control block makes the gateway queue what its fleet cannot take: with
// the one engine at its in-flight cap, requests wait in their bands (x-enginepick-priority) and
// flows (x-enginepick-flow, else the body's user) and are served by band when the dispatch ends;
// a sheddable band gets 429 with Retry-After, a band's TTL 503, and a client that leaves stops
// waiting.
func TestFlowControlFromTheConfigFile(t *testing.T) {
	t.Parallel()
	eng := newEngine(t)
	gate := make(chan struct{})
	eng.SetGate(gate)
	path := writeConfig(t, fmt.Sprintf(`
flow_control:
  bands: [{priority: 0}, {priority: 5}, {priority: 9, ttl: 50ms}, {priority: -1, sheddable: true}]
  flow_weights: {gold: 2, acme: 1}
engines: [{id: %q, model: m}]
models:
  - id: m
    buckets: [{id: all, groups: {plain: {policy: {type: round_robin, admission: {max_inflight_requests: 1}}}}}]
`, eng.URL()))
	g, srv := startGateway(t, "--config="+path, "--tokenize=false")
	var once sync.Once
	release := func() { once.Do(func() { close(gate) }) }
	t.Cleanup(release) // before the gateway stops, which waits for the held requests
	queued := func(band string) float64 {
		return series(t, g, `enginepick_flow_control_queued_requests{band="`+band+`",model_id="m"}`)
	}
	type answer struct {
		code int
		err  error
	}
	send := func(ctx context.Context, prompt, user string, header map[string]string) chan answer {
		body := `{"model":"m","prompt":"` + prompt + `"`
		if user != "" {
			body += `,"user":"` + user + `"`
		}
		done := make(chan answer, 1)
		go func() {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/v1/completions", strings.NewReader(body+"}"))
			for k, v := range header {
				req.Header.Set(k, v)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				done <- answer{err: err}
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			done <- answer{code: resp.StatusCode}
		}()
		return done
	}

	a := send(context.Background(), "a", "", nil)
	require.Eventually(t, func() bool { return eng.InFlight() == 1 }, 5*time.Second, time.Millisecond)
	c := send(context.Background(), "c", "acme", nil)
	require.Eventually(t, func() bool { return queued("0") == 1 }, 5*time.Second, time.Millisecond, "c waits in band 0")
	b := send(context.Background(), "b", "acme", map[string]string{"x-enginepick-priority": "5", "x-enginepick-flow": "gold"})
	require.Eventually(t, func() bool { return queued("5") == 1 }, 5*time.Second, time.Millisecond, "b waits in band 5")

	gone, leave := context.WithCancel(context.Background())
	e := send(gone, "e", "", nil)
	require.Eventually(t, func() bool { return queued("0") == 2 }, 5*time.Second, time.Millisecond)
	leave()
	require.Error(t, (<-e).err)
	require.Eventually(t, func() bool { return queued("0") == 1 }, 5*time.Second, time.Millisecond, "a client that leaves stops waiting")

	resp := post(t, context.Background(), srv.URL+"/v1/completions", `{"model":"m","prompt":"d"}`, map[string]string{"x-enginepick-priority": "-3"})
	assert.Equal(t, http.StatusTooManyRequests, resp.StatusCode, "priority -3 waits in the lowest band, sheddable")
	assert.Equal(t, "60", resp.Header.Get("Retry-After"), "2 waiting ÷ 1 dispatch in the last minute, at most 60 s")
	typ, _ := openAIError(t, resp)
	resp.Body.Close()
	assert.Equal(t, "rate_limit_exceeded", typ)

	resp = post(t, context.Background(), srv.URL+"/v1/completions", `{"model":"m","prompt":"f"}`, map[string]string{"x-enginepick-priority": "9"})
	assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, "band 9's TTL ends the wait")
	assert.Empty(t, resp.Header.Get("Retry-After"))
	typ, msg := openAIError(t, resp)
	resp.Body.Close()
	assert.Equal(t, "engine_unavailable", typ)
	assert.Equal(t, "the request waited its priority's time limit and no engine took it", msg)

	release()
	for _, ch := range []chan answer{a, b, c} {
		ans := <-ch
		require.NoError(t, ans.err)
		assert.Equal(t, http.StatusOK, ans.code)
	}
	var order []string
	for _, r := range eng.Requests() {
		order = append(order, string(r.Body["prompt"]))
	}
	assert.Equal(t, []string{`"a"`, `"b"`, `"c"`}, order, "band 5 before band 0")
	for labels, want := range map[string]float64{
		`band="5",flow="gold",model_id="m",outcome="served"`:      1,
		`band="0",flow="acme",model_id="m",outcome="served"`:      1,
		`band="0",flow="other",model_id="m",outcome="canceled"`:   1,
		`band="-1",flow="other",model_id="m",outcome="sheddable"`: 1,
		`band="9",flow="other",model_id="m",outcome="expired"`:    1,
	} {
		assert.Equal(t, want, series(t, g, "enginepick_flow_control_requests_total{"+labels+"}"), labels)
	}
	assert.Equal(t, 1.0, series(t, g, `enginepick_selection_failures_total{model_id="m",reason="flow_rejected"}`))
	assert.Equal(t, 1.0, series(t, g, `enginepick_selection_failures_total{model_id="m",reason="flow_timeout"}`))
	assert.Equal(t, 1.0, series(t, g, `gateway_selection_failures_total{code="429"}`))
}

// A priority that is not an integer and a user that is not a string are the client's 400s.
func TestFlowControlRequestFieldsRefused(t *testing.T) {
	t.Parallel()
	eng := newEngine(t)
	_, srv := startGateway(t, engineFlag(eng, ""))
	for _, tc := range []struct {
		name, body, priority, msg string
	}{
		{"priority not an integer", `{"model":"m","prompt":"x"}`, "high", `header x-enginepick-priority must be an integer, got "high"`},
		{"user not a string", `{"model":"m","prompt":"x","user":42}`, "", "user must be a string, got 42"},
	} {
		header := map[string]string{}
		if tc.priority != "" {
			header["x-enginepick-priority"] = tc.priority
		}
		resp := post(t, context.Background(), srv.URL+"/v1/completions", tc.body, header)
		assert.Equal(t, http.StatusBadRequest, resp.StatusCode, tc.name)
		typ, msg := openAIError(t, resp)
		resp.Body.Close()
		assert.Equal(t, "invalid_request_error", typ, tc.name)
		assert.Equal(t, tc.msg, msg, tc.name)
	}
	assert.Empty(t, eng.Requests())
}

// With --engine-priority the gateway forwards each request's band, negated, as the body's
// priority, and a vLLM engine run with --scheduling-policy priority (the test engine) serves its
// waiting requests by it: behind a running request, a band-1 request (x-enginepick-priority 5)
// overtakes an earlier band-0 one. Without the flag the engine serves them in arrival order.
func TestEnginePriorityForwardsTheBand(t *testing.T) {
	t.Parallel()
	for _, forward := range []bool{true, false} {
		t.Run(fmt.Sprint("forward=", forward), func(t *testing.T) {
			t.Parallel()
			e, err := testengine.Start(testengine.Options{Model: e2eModel, MaxNumSeqs: 1, SchedulingPolicy: "priority",
				PrefillPerToken: -1, DecodePerToken: 5 * time.Millisecond, KVEvents: testengine.KVEventsOptions{Disabled: true}})
			require.NoError(t, err)
			t.Cleanup(func() { assert.NoError(t, e.Close()) })
			path := writeConfig(t, fmt.Sprintf(`
flow_control: {bands: [{priority: 1}, {priority: 0}, {priority: -1}]}
engines: [{id: %q, model: %s}]
models: [{id: %s, buckets: [{id: all, groups: {plain: {policy: {type: round_robin}}}}]}]
`, e.URL(), e2eModel, e2eModel))
			args := []string{"--config=" + path, "--tokenize=false"}
			if forward {
				args = append(args, "--engine-priority")
			}
			_, srv := startGateway(t, args...)
			var wg sync.WaitGroup
			for i, r := range []struct{ name, priority string }{{"running", "0"}, {"band0", "0"}, {"band1", "5"}} {
				tokens := 2
				if i == 0 {
					tokens = 100 // runs 0.5 s while the others queue behind it
				}
				wg.Go(func() {
					resp := post(t, context.Background(), srv.URL+"/v1/completions",
						fmt.Sprintf(`{"model":%q,"prompt":"%s","max_tokens":%d}`, e2eModel, r.name, tokens),
						map[string]string{"x-enginepick-priority": r.priority})
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					assert.Equal(t, http.StatusOK, resp.StatusCode, r.name)
				})
				require.Eventually(t, func() bool { st := e.Stats(0); return st.Running+st.Waiting == i+1 }, 5*time.Second, time.Millisecond)
			}
			wg.Wait()
			var sent []string
			order := make([]string, 3) // the prompts in the order the engine served them
			for _, r := range e.Requests() {
				sent = append(sent, string(r.Body["priority"]))
				var prompt string
				require.NoError(t, json.Unmarshal(r.Body["prompt"], &prompt))
				require.True(t, r.FirstToken >= 1 && r.FirstToken <= len(order), "%s: first token %d", prompt, r.FirstToken)
				order[r.FirstToken-1] = prompt
			}
			if forward {
				assert.Equal(t, []string{"running", "band1", "band0"}, order)
				assert.Equal(t, []string{"0", "0", "-1"}, sent, "the band, negated")
			} else {
				assert.Equal(t, []string{"running", "band0", "band1"}, order)
				assert.Equal(t, []string{"", "", ""}, sent, "the body as the client sent it")
			}
		})
	}
}
