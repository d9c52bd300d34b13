package loadsource_test

import (
	"context"
	"errors"
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
	"go.uber.org/goleak"

	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/loadmon/loadsource"
	"github.com/enginepick/enginepick/state"
)

type fakeClock struct{ ns atomic.Int64 }

func newClock() *fakeClock {
	c := &fakeClock{}
	c.ns.Store(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	return c
}
func (c *fakeClock) Now() time.Time          { return time.Unix(0, c.ns.Load()).UTC() }
func (c *fakeClock) Advance(d time.Duration) { c.ns.Add(int64(d)) }

// engine is a fake engine's load endpoint whose answer the test changes between polls.
type engine struct {
	mu     sync.Mutex
	status int
	body   string
	hang   bool
	srv    *httptest.Server
}

func newEngine(t *testing.T, body string) *engine {
	e := &engine{status: http.StatusOK, body: body}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.mu.Lock()
		status, body, hang := e.status, e.body, e.hang
		e.mu.Unlock()
		if hang {
			<-r.Context().Done() // an engine that never answers
			return
		}
		w.WriteHeader(status)
		_, _ = w.Write([]byte(body))
	}))
	t.Cleanup(e.srv.Close)
	return e
}

func (e *engine) set(status int, body string, hang bool) {
	e.mu.Lock()
	e.status, e.body, e.hang = status, body, hang
	e.mu.Unlock()
}

func TestPollRecordsEachFormat(t *testing.T) {
	t.Parallel()
	cases := []struct {
		format loadsource.Format
		body   string
		want   loadmon.EngineLoad
	}{
		{loadsource.FormatVLLMMetrics, vllmPage, loadmon.EngineLoad{Ranks: 2, RunningRequests: 8, WaitingRequests: 2, UsedKVTokens: 20000, KVCapacityTokens: 48000}},
		{loadsource.FormatSGLangGetLoad, `[{"dp_rank": 0, "num_reqs": 9, "num_waiting_reqs": 4}, {"dp_rank": 1, "num_reqs": 1, "num_waiting_reqs": 0}]`,
			loadmon.EngineLoad{Ranks: 2, RunningRequests: 6, WaitingRequests: 4}},
		{loadsource.FormatSGLangLoads, sglangLoads, loadmon.EngineLoad{Ranks: 2, RunningRequests: 6, WaitingRequests: 2,
			UsedKVTokens: 5100, KVCapacityTokens: 200000, Native: true, WaitingUncachedTokens: 900, MaxRunningRequests: 512, RunningSlots: 512}},
	}
	for _, tc := range cases {
		t.Run(tc.format.String(), func(t *testing.T) {
			t.Parallel()
			clk := newClock()
			tab := loadmon.NewTable(loadmon.WithClock(clk.Now))
			require.NoError(t, tab.Expect("e", 2))
			eng := newEngine(t, tc.body)
			p, err := loadsource.NewPoller(tab, []loadsource.Target{{Engine: "e", URL: eng.srv.URL + tc.format.Path(), Format: tc.format, Ranks: 2}},
				loadsource.Options{Client: eng.srv.Client(), Interval: 5 * time.Second, Timeout: 5 * time.Second})
			require.NoError(t, err)
			require.NoError(t, p.Poll(context.Background(), "e"))
			l, ok := tab.Snapshot().Load("e")
			require.True(t, ok)
			got := *l
			got.Engine, got.ReportedAt = "", time.Time{}
			assert.Len(t, got.RankLoads, 2, "two ranks, each with its own load")
			got.RankLoads = nil
			assert.Equal(t, tc.want, got)
			st := p.Stats()
			require.Len(t, st, 1)
			assert.Equal(t, uint64(1), st[0].Polls)
			assert.Zero(t, st[0].Failures)
			assert.False(t, st[0].LastSuccess.IsZero())
		})
	}
}

// TestFailedPollsGoStaleNeverZero: every way a poll can fail leaves the last good reports in the
// table untouched (same version), and once they pass the freshness the engine is unknown, never
// an engine with zero load.
func TestFailedPollsGoStaleNeverZero(t *testing.T) {
	t.Parallel()
	const good = `{"loads": [{"dp_rank": 0, "num_running_reqs": 7, "num_waiting_reqs": 3}]}`
	cases := []struct {
		name  string
		set   func(e *engine)
		check func(t *testing.T, err error)
	}{
		{"status_500", func(e *engine) { e.set(500, good, false) }, func(t *testing.T, err error) { assert.ErrorIs(t, err, loadsource.ErrStatus) }},
		{"malformed", func(e *engine) { e.set(200, `{"loads": [{"num_running_reqs": NaN}]}`, false) },
			func(t *testing.T, err error) { assert.ErrorIs(t, err, loadsource.ErrMalformed) }},
		{"negative", func(e *engine) { e.set(200, `{"loads": [{"num_running_reqs": -1, "num_waiting_reqs": 0}]}`, false) },
			func(t *testing.T, err error) { assert.ErrorIs(t, err, loadsource.ErrMalformed) }},
		{"missing_value", func(e *engine) { e.set(200, `{"loads": [{"num_running_reqs": 1}]}`, false) },
			func(t *testing.T, err error) { assert.ErrorIs(t, err, loadsource.ErrMalformed) }},
		{"rank_beyond_expected", func(e *engine) {
			e.set(200, `{"loads": [{"dp_rank": 0, "num_running_reqs": 1, "num_waiting_reqs": 0}, {"dp_rank": 1, "num_running_reqs": 1, "num_waiting_reqs": 0}]}`, false)
		}, func(t *testing.T, err error) { assert.ErrorIs(t, err, loadmon.ErrRankOutOfRange) }},
		{"too_large", func(e *engine) { e.set(200, good+strings.Repeat(" ", 2048), false) },
			func(t *testing.T, err error) { assert.ErrorIs(t, err, loadsource.ErrBodyTooLarge) }},
		{"hangs", func(e *engine) { e.set(200, good, true) }, func(t *testing.T, err error) { assert.ErrorIs(t, err, context.DeadlineExceeded) }},
		{"down", func(e *engine) { e.srv.Close() }, func(t *testing.T, err error) {
			var op *net.OpError
			assert.True(t, errors.As(err, &op), "got %v", err)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			clk := newClock()
			tab := loadmon.NewTable(loadmon.WithClock(clk.Now))
			eng := newEngine(t, good)
			p, err := loadsource.NewPoller(tab, []loadsource.Target{{Engine: "e", URL: eng.srv.URL + "/v1/loads", Format: loadsource.FormatSGLangLoads}},
				loadsource.Options{Client: eng.srv.Client(), Timeout: 2 * time.Second, Interval: 5 * time.Second, MaxBodyBytes: 1024})
			require.NoError(t, err)
			require.NoError(t, p.Poll(context.Background(), "e"))
			before := tab.Snapshot()

			tc.set(eng)
			start := time.Now()
			err = p.Poll(context.Background(), "e")
			require.Error(t, err)
			tc.check(t, err)
			// The timeout is generous so that the good polls never miss it on a loaded CI machine.
			assert.Less(t, time.Since(start), 15*time.Second, "a hanging engine is cut off by the timeout")
			after := tab.Snapshot()
			assert.Equal(t, before.Version(), after.Version(), "a failed poll records nothing")
			l, ok := after.Load("e")
			require.True(t, ok, "still fresh: the last good poll stands")
			assert.Equal(t, uint64(7), l.RunningRequests)

			clk.Advance(loadmon.DefaultFreshness + time.Nanosecond)
			_, ok = tab.Snapshot().Load("e")
			assert.False(t, ok, "stale after the freshness: unknown, never zero")
			st := p.Stats()[0]
			assert.Equal(t, uint64(2), st.Polls)
			assert.Equal(t, uint64(1), st.Failures)
			assert.NotEmpty(t, st.LastError)
		})
	}
}

func TestMissingRankMakesTheEngineUnknown(t *testing.T) {
	t.Parallel()
	clk := newClock()
	tab := loadmon.NewTable(loadmon.WithClock(clk.Now))
	require.NoError(t, tab.Expect("e", 3))
	const rank0 = `{"dp_rank": 0, "num_reqs": 1, "num_waiting_reqs": 0}`
	const rank1 = `{"dp_rank": 1, "num_reqs": 2, "num_waiting_reqs": 0}`
	const rank2 = `{"dp_rank": 2, "num_reqs": 3, "num_waiting_reqs": 1}`
	eng := newEngine(t, "["+rank0+","+rank2+"]")
	p, err := loadsource.NewPoller(tab, []loadsource.Target{{Engine: "e", URL: eng.srv.URL + "/get_load", Format: loadsource.FormatSGLangGetLoad, Ranks: 3}},
		loadsource.Options{Client: eng.srv.Client(), Interval: 5 * time.Second, Timeout: 5 * time.Second})
	require.NoError(t, err)

	err = p.Poll(context.Background(), "e")
	var me *loadsource.MissingRanksError
	require.True(t, errors.As(err, &me), "got %v", err)
	assert.Equal(t, []int{1}, me.Missing)
	assert.Equal(t, state.EngineID("e"), me.Engine)
	_, ok := tab.Snapshot().Load("e")
	assert.False(t, ok, "rank 1 never reported: the engine is unknown, not the sum of two ranks")

	eng.set(200, "["+rank0+","+rank1+","+rank2+"]", false)
	require.NoError(t, p.Poll(context.Background(), "e"))
	l, ok := tab.Snapshot().Load("e")
	require.True(t, ok)
	assert.Equal(t, uint64(5), l.RunningRequests)

	clk.Advance(2 * time.Second)
	eng.set(200, "["+rank2+"]", false)
	err = p.Poll(context.Background(), "e")
	require.True(t, errors.As(err, &me))
	assert.Equal(t, []int{0, 1}, me.Missing)
	_, ok = tab.Snapshot().Load("e")
	assert.True(t, ok, "ranks 0 and 1 reported 2 s ago are still fresh")
	clk.Advance(loadmon.DefaultFreshness - 2*time.Second + time.Nanosecond)
	_, ok = tab.Snapshot().Load("e")
	assert.False(t, ok, "ranks 0 and 1 went stale: the engine is unknown")
	assert.Equal(t, uint64(2), p.Stats()[0].Failures)
}

func TestRunPollsUntilStopped(t *testing.T) {
	// Cleanups run last-in first-out: the leak check runs after the servers and connections close.
	t.Cleanup(func() { goleak.VerifyNone(t) })
	tab := loadmon.NewTable()
	a := newEngine(t, `[{"num_reqs": 1, "num_waiting_reqs": 0}]`)
	b := newEngine(t, "vllm:num_requests_running 2\nvllm:num_requests_waiting 5\n")
	client := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(client.CloseIdleConnections)
	var okA, okB, polls atomic.Int64
	p, err := loadsource.NewPoller(tab, []loadsource.Target{
		{Engine: "a", URL: a.srv.URL + "/get_load", Format: loadsource.FormatSGLangGetLoad},
		{Engine: "b", URL: b.srv.URL + "/metrics", Format: loadsource.FormatVLLMMetrics},
	}, loadsource.Options{Client: client, Interval: 100 * time.Millisecond, Timeout: 100 * time.Millisecond, Jitter: 0.5,
		Observe: func(e state.EngineID, err error) {
			polls.Add(1)
			if err == nil && e == "a" {
				okA.Add(1)
			} else if err == nil && e == "b" {
				okB.Add(1)
			}
		}})
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	require.Eventually(t, func() bool { return okA.Load() >= 3 && okB.Load() >= 3 }, 10*time.Second, time.Millisecond,
		"each engine is polled again and again")
	assert.ErrorIs(t, p.Run(ctx), state.ErrInvalidConfiguration, "a second Run while running is refused")
	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return after cancellation")
	}
	la, ok := tab.Snapshot().Load("a")
	require.True(t, ok)
	assert.Equal(t, uint64(1), la.RunningRequests)
	lb, ok := tab.Snapshot().Load("b")
	require.True(t, ok)
	assert.Equal(t, uint64(5), lb.WaitingRequests)
	n := polls.Load()
	time.Sleep(300 * time.Millisecond)
	assert.Equal(t, n, polls.Load(), "no poll after Run returned")
}

func TestNewPollerValidates(t *testing.T) {
	t.Parallel()
	tab := loadmon.NewTable()
	ok := loadsource.Target{Engine: "e", URL: "http://127.0.0.1:1/metrics", Format: loadsource.FormatVLLMMetrics}
	with := func(edit func(*loadsource.Target)) []loadsource.Target {
		t := ok
		edit(&t)
		return []loadsource.Target{t}
	}
	cases := []struct {
		name    string
		table   *loadmon.Table
		targets []loadsource.Target
		opts    loadsource.Options
	}{
		{"nil_table", nil, []loadsource.Target{ok}, loadsource.Options{}},
		{"empty_engine", tab, with(func(t *loadsource.Target) { t.Engine = "" }), loadsource.Options{}},
		{"relative_url", tab, with(func(t *loadsource.Target) { t.URL = "/metrics" }), loadsource.Options{}},
		{"ftp_url", tab, with(func(t *loadsource.Target) { t.URL = "ftp://h/metrics" }), loadsource.Options{}},
		{"no_format", tab, with(func(t *loadsource.Target) { t.Format = 0 }), loadsource.Options{}},
		{"negative_ranks", tab, with(func(t *loadsource.Target) { t.Ranks = -1 }), loadsource.Options{}},
		{"too_many_ranks", tab, with(func(t *loadsource.Target) { t.Ranks = loadmon.MaxRanks + 1 }), loadsource.Options{}},
		{"duplicate_engine", tab, []loadsource.Target{ok, ok}, loadsource.Options{}},
		{"negative_interval", tab, []loadsource.Target{ok}, loadsource.Options{Interval: -1}},
		{"timeout_above_interval", tab, []loadsource.Target{ok}, loadsource.Options{Interval: time.Second, Timeout: 2 * time.Second}},
		{"negative_timeout", tab, []loadsource.Target{ok}, loadsource.Options{Timeout: -1}},
		{"jitter_above_one", tab, []loadsource.Target{ok}, loadsource.Options{Jitter: 1.5}},
		{"negative_jitter", tab, []loadsource.Target{ok}, loadsource.Options{Jitter: -0.1}},
		{"negative_body_limit", tab, []loadsource.Target{ok}, loadsource.Options{MaxBodyBytes: -1}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := loadsource.NewPoller(tc.table, tc.targets, tc.opts)
			assert.ErrorIs(t, err, state.ErrInvalidConfiguration)
		})
	}
	p, err := loadsource.NewPoller(tab, nil, loadsource.Options{})
	require.NoError(t, err)
	assert.ErrorIs(t, p.Poll(context.Background(), "e"), state.ErrInvalidConfiguration, "an engine without a target")
}
