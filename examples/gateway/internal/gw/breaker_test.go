package gw_test

import (
	"bufio"
	"bytes"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/examples/gateway/internal/gw"
)

// probedEngine is an engine on loopback whose inference answers are the test's and whose
// GET /health counts its calls, the most in flight at once, and answers health (200 unless set),
// after a receive from hold when hold is set.
type probedEngine struct {
	srv       *httptest.Server
	infer     http.HandlerFunc
	health    atomic.Int32
	hold      chan struct{}
	calls     atomic.Int64
	inFlight  atomic.Int64
	maxFlight atomic.Int64
}

func newProbedEngine(t *testing.T, infer http.HandlerFunc, hold chan struct{}) *probedEngine {
	t.Helper()
	p := &probedEngine{infer: infer, hold: hold}
	p.health.Store(http.StatusOK)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		p.calls.Add(1)
		n := p.inFlight.Add(1)
		defer p.inFlight.Add(-1)
		for {
			m := p.maxFlight.Load()
			if n <= m || p.maxFlight.CompareAndSwap(m, n) {
				break
			}
		}
		if p.hold != nil {
			select {
			case <-p.hold:
			case <-r.Context().Done():
				return
			}
		}
		w.WriteHeader(int(p.health.Load()))
	})
	mux.HandleFunc("POST /v1/completions", infer)
	p.srv = httptest.NewServer(mux)
	t.Cleanup(p.srv.Close)
	return p
}

// answer200 reads the request and answers a completion.
func answer200(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, `{"choices":[{"text":"ok"}]}`)
}

// hangUp reads the whole request, then closes the connection without an answer: with reset, by a
// TCP reset (linger 0), else by an orderly close (the gateway reads EOF).
func hangUp(reset bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		conn, _, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		if tc, ok := conn.(*net.TCPConn); ok && reset {
			_ = tc.SetLinger(0)
		}
		_ = conn.Close()
	}
}

// settled waits until e's probes that ended number n, and returns how many failed.
func settled(t *testing.T, e *gw.Engine, n uint64) uint64 {
	t.Helper()
	require.Eventually(t, func() bool { ok, failed := e.Probes(); return ok+failed == n }, 10*time.Second, time.Millisecond,
		"%d probes end", n)
	_, failed := e.Probes()
	return failed
}

// An engine with a 4 MiB body limit that reads a larger body whole (or lets socket buffers take
// it) and then closes the connection without answering: the gateway cannot tell the request's
// doing from the engine's, so it answers 502 and probes the engine, which is healthy. Eight such
// requests (more than the streak of 3) open no breaker, and a normal request is served.
func TestOversizedBodyWrittenWholeNeverOpensTheBreaker(t *testing.T) {
	t.Parallel()
	const limit = 4 << 20
	big := `{"model":"m","prompt":"` + strings.Repeat("x", 5<<20+1<<19) + `"}`
	for _, tc := range []struct {
		name  string
		reset bool
	}{{"closes", false}, {"resets", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			eng := newProbedEngine(t, func(w http.ResponseWriter, r *http.Request) {
				if r.ContentLength > limit {
					hangUp(tc.reset)(w, r)
					return
				}
				answer200(w, r)
			}, nil)
			f := newFixture(t, []gw.EngineConfig{{URL: eng.srv.URL, Model: "m", Kind: gw.KindVLLM}}, gw.Options{})
			e := f.registry.All()[0]
			var codes []int
			var healthy []bool
			for i := range 8 {
				code, _ := f.post(t, "/v1/completions", big, nil)
				codes = append(codes, code)
				assert.Zero(t, settled(t, e, uint64(i+1)), "the probe after request %d answers 200", i+1)
				healthy = append(healthy, e.Healthy())
			}
			assert.Equal(t, []int{502, 502, 502, 502, 502, 502, 502, 502}, codes)
			assert.Equal(t, []bool{true, true, true, true, true, true, true, true}, healthy)
			assert.Zero(t, e.Opens())
			assert.Equal(t, int64(8), eng.calls.Load(), "one probe per failure")
			code, body := f.post(t, "/v1/completions", `{"model":"m","prompt":"hi"}`, nil)
			assert.Equal(t, http.StatusOK, code, body)
		})
	}
}

// An engine that closes the connection before it has read the whole body either refuses the body
// (a body over its limit) or is dying; its probe tells which. Alive (/health 200), the client gets
// a 413 and the engine stays in rotation; /health failing, a 502 and the failed probes count;
// its listener closed, a 502 and the breaker opens at once.
func TestBodyUnreadIsRefusedOnlyByALiveEngine(t *testing.T) {
	t.Parallel()
	const limit = 4 << 20
	big := `{"model":"m","prompt":"` + strings.Repeat("x", 5<<20+1<<19) + `"}`
	for _, tc := range []struct {
		name    string
		health  int
		dies    bool // the engine closes its listener before it hangs up
		codes   []int
		healthy []bool
	}{
		{"alive", http.StatusOK, false, []int{413, 413, 413, 413}, []bool{true, true, true, true}},
		{"health_failing", http.StatusServiceUnavailable, false, []int{502, 502, 502, 503}, []bool{true, true, false, false}},
		{"dies", http.StatusOK, true, []int{502, 503, 503, 503}, []bool{false, false, false, false}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var eng *probedEngine
			eng = newProbedEngine(t, func(w http.ResponseWriter, r *http.Request) {
				if r.ContentLength <= limit {
					answer200(w, r)
					return
				}
				if tc.dies {
					_ = eng.srv.Listener.Close()
				}
				if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
					_ = conn.Close() // without reading the body
				}
			}, nil)
			eng.health.Store(int32(tc.health))
			f := newFixture(t, []gw.EngineConfig{{URL: eng.srv.URL, Model: "m", Kind: gw.KindVLLM}}, gw.Options{})
			e := f.registry.All()[0]
			var codes []int
			var healthy []bool
			for range 4 {
				code, _ := f.post(t, "/v1/completions", big, nil)
				codes = append(codes, code)
				healthy = append(healthy, e.Healthy())
			}
			assert.Equal(t, tc.codes, codes)
			assert.Equal(t, tc.healthy, healthy)
		})
	}
}

// A request that makes the engine's handler fail gets the engine's 500, as it is; the engine's
// /health answers 200, so however often the request is sent the engine stays in rotation.
func TestRequestCausedServerErrorsNeverOpenTheBreaker(t *testing.T) {
	t.Parallel()
	eng := newProbedEngine(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if bytes.Contains(b, []byte("poison")) {
			w.WriteHeader(http.StatusInternalServerError)
			_, _ = io.WriteString(w, `{"error":"handler failed"}`)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[{"text":"ok"}]}`)
	}, nil)
	f := newFixture(t, []gw.EngineConfig{{URL: eng.srv.URL, Model: "m", Kind: gw.KindVLLM}}, gw.Options{})
	e := f.registry.All()[0]
	for i := range 6 {
		code, body := f.post(t, "/v1/completions", `{"model":"m","prompt":"poison"}`, nil)
		assert.Equal(t, http.StatusInternalServerError, code)
		assert.Equal(t, `{"error":"handler failed"}`, body, "the engine's answer is relayed")
		assert.Zero(t, settled(t, e, uint64(i+1)))
		assert.True(t, e.Healthy(), "after %d 500s", i+1)
	}
	assert.Zero(t, e.Opens())
	code, _ := f.post(t, "/v1/completions", `{"model":"m","prompt":"hi"}`, nil)
	assert.Equal(t, http.StatusOK, code)
}

// An engine that is down leaves the rotation as fast as before: no connection opens its breaker at
// once; failures whose probe finds /health failing count toward the streak of 3; and an answer cut
// off because the engine died is followed by a probe that cannot connect, which opens the breaker
// at once.
func TestDownEngineLeavesTheRotation(t *testing.T) {
	t.Parallel()
	t.Run("listener_closed", func(t *testing.T) {
		t.Parallel()
		eng := newProbedEngine(t, answer200, nil)
		f := newFixture(t, []gw.EngineConfig{{URL: eng.srv.URL, Model: "m", Kind: gw.KindVLLM}}, gw.Options{})
		e := f.registry.All()[0]
		eng.srv.Close()
		code, _ := f.post(t, "/v1/completions", `{"model":"m","prompt":"hi"}`, nil)
		assert.Equal(t, http.StatusBadGateway, code)
		assert.False(t, e.Healthy(), "one connection failure opens the breaker")
		code, _ = f.post(t, "/v1/completions", `{"model":"m","prompt":"hi"}`, nil)
		assert.Equal(t, http.StatusServiceUnavailable, code)
		assert.Zero(t, eng.calls.Load(), "no probe needed")
	})
	for _, tc := range []struct {
		name  string
		infer http.HandlerFunc
		code  int
	}{
		{"answers_500_health_503", func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			w.WriteHeader(http.StatusInternalServerError)
		}, 500},
		{"hangs_up_health_503", hangUp(false), 502},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			eng := newProbedEngine(t, tc.infer, nil)
			eng.health.Store(http.StatusServiceUnavailable)
			f := newFixture(t, []gw.EngineConfig{{URL: eng.srv.URL, Model: "m", Kind: gw.KindVLLM}}, gw.Options{})
			e := f.registry.All()[0]
			var codes []int
			var healthy []bool
			for i := range 3 {
				code, _ := f.post(t, "/v1/completions", `{"model":"m","prompt":"hi"}`, nil)
				codes = append(codes, code)
				assert.Equal(t, uint64(i+1), settled(t, e, uint64(i+1)), "every probe fails")
				healthy = append(healthy, e.Healthy())
			}
			assert.Equal(t, []int{tc.code, tc.code, tc.code}, codes)
			assert.Equal(t, []bool{true, true, false}, healthy, "three failed probes open the breaker")
			code, _ := f.post(t, "/v1/completions", `{"model":"m","prompt":"hi"}`, nil)
			assert.Equal(t, http.StatusServiceUnavailable, code)
		})
	}
	t.Run("dies_mid_answer", func(t *testing.T) {
		t.Parallel()
		started := make(chan struct{})
		eng := newProbedEngine(t, func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, "data: {}\n\n")
			_ = http.NewResponseController(w).Flush()
			close(started)
			<-r.Context().Done()
		}, nil)
		f := newFixture(t, []gw.EngineConfig{{URL: eng.srv.URL, Model: "m", Kind: gw.KindVLLM}}, gw.Options{})
		e := f.registry.All()[0]
		resp, err := http.Post(f.srv.URL+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"hi","stream":true}`))
		require.NoError(t, err)
		defer resp.Body.Close()
		line, err := bufio.NewReader(resp.Body).ReadString('\n')
		require.NoError(t, err)
		require.Equal(t, "data: {}\n", line)
		<-started
		eng.srv.CloseClientConnections()
		eng.srv.Close()
		_, _ = io.ReadAll(resp.Body)
		assert.Equal(t, uint64(1), settled(t, e, 1), "the probe cannot connect")
		assert.False(t, e.Healthy(), "a probe that cannot connect opens the breaker at once")
	})
}

// Many concurrent failures of one engine, each the request's or the engine's, cause one probe:
// at most one is in flight per engine, and a failure while one is in flight is left to it. A 5xx
// is relayed at once; a connection closed without an answer is a 502 once the probe has ended, so
// that a client retrying finds a dead engine out of rotation already.
func TestConcurrentFailuresProbeOnce(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		infer http.HandlerFunc
		kind  string // the upstream failure's kind
		code  int
	}{
		{"answers_500", func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			w.WriteHeader(http.StatusInternalServerError)
		}, "server_error", 500},
		{"hangs_up", hangUp(false), "no_answer", 502},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			hold := make(chan struct{})
			eng := newProbedEngine(t, tc.infer, hold)
			f := newFixture(t, []gw.EngineConfig{{URL: eng.srv.URL, Model: "m", Kind: gw.KindVLLM}}, gw.Options{})
			e := f.registry.All()[0]
			const n = 32
			codes := make([]int, n)
			var answered atomic.Int64
			var wg sync.WaitGroup
			for i := range n {
				wg.Go(func() {
					codes[i], _ = f.post(t, "/v1/completions", `{"model":"m","prompt":"hi"}`, nil)
					answered.Add(1)
				})
			}
			// Every failure has joined the first probe (it is counted after), which is held.
			require.Eventually(t, func() bool { return f.upstreamFailures(t, tc.kind) == n }, 10*time.Second, time.Millisecond)
			if tc.code == http.StatusBadGateway {
				assert.Zero(t, answered.Load(), "no 502 before the probe has ended")
			}
			close(hold)
			wg.Wait()
			for i, c := range codes {
				assert.Equal(t, tc.code, c, "request %d", i)
			}
			assert.Zero(t, settled(t, e, 1))
			assert.Equal(t, int64(1), eng.calls.Load(), "one probe for %d failures", n)
			assert.Equal(t, int64(1), eng.maxFlight.Load())
			assert.True(t, e.Healthy())
			ok, failed := e.Probes()
			assert.Equal(t, [2]uint64{1, 0}, [2]uint64{ok, failed})
		})
	}
}
