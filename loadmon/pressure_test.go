package loadmon_test

import (
	"math"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

// nat returns a fresh, complete native observation.
func nat(l loadmon.EngineLoad, inflight uint64) loadmon.Observation {
	l.Native = true
	if l.KVCapacityTokens == 0 {
		l.KVCapacityTokens = 1000
	}
	if l.MaxRunningRequests == 0 {
		l.MaxRunningRequests = 8
	}
	return loadmon.Observation{Load: &l, InFlight: inflight}
}

// basic returns a fresh, complete observation without native figures, as a vLLM /metrics poll
// gives.
func basic(l loadmon.EngineLoad, inflight uint64) loadmon.Observation {
	return loadmon.Observation{Load: &l, InFlight: inflight}
}

func TestObservationBasis(t *testing.T) {
	t.Parallel()
	unknown := loadmon.Observation{InFlight: 4}
	b := basic(loadmon.EngineLoad{WaitingRequests: 3}, 0)
	n := nat(loadmon.EngineLoad{}, 0)
	assert.Equal(t, loadmon.BasisInFlight, unknown.Basis())
	assert.Equal(t, loadmon.BasisReported, b.Basis())
	assert.Equal(t, loadmon.BasisNative, n.Basis())
	assert.Equal(t, "in_flight reported native", unknown.Basis().String()+" "+b.Basis().String()+" "+n.Basis().String())
	rank := loadmon.Observation{Load: n.Load, RankLoad: b.Load, HasDPRank: true}
	assert.Equal(t, loadmon.BasisReported, rank.Basis(), "a named rank's own figures decide")
}

// since adds dispatches made after the observation's report.
func since(o loadmon.Observation, n, tokens uint64) loadmon.Observation {
	o.Dispatched, o.DispatchedTokens = n, tokens
	return o
}

func withQueue(d time.Duration) loadmon.EngineLoad {
	return loadmon.EngineLoad{HasPrefillRate: true, PrefillTokensPerSecond: 1, EstimatedPrefillQueue: d}
}

func TestComparePressure(t *testing.T) {
	t.Parallel()
	plain, prefill, decode := state.StagePlain, state.StagePrefill, state.StageDecode
	native, reported, inFlight := loadmon.BasisNative, loadmon.BasisReported, loadmon.BasisInFlight
	tests := []struct {
		name  string
		stage state.Stage
		a, b  loadmon.Observation
		basis loadmon.Basis
		want  int
	}{
		{"prefill: uncached tokens before waiting requests", prefill,
			nat(loadmon.EngineLoad{WaitingUncachedTokens: 10, WaitingRequests: 9}, 0),
			nat(loadmon.EngineLoad{WaitingUncachedTokens: 20, WaitingRequests: 1}, 0), native, -1},
		{"prefill: waiting requests then running", prefill,
			nat(loadmon.EngineLoad{WaitingRequests: 2, RunningRequests: 0}, 0),
			nat(loadmon.EngineLoad{WaitingRequests: 1, RunningRequests: 9}, 0), native, 1},
		{"prefill: running requests", plain,
			nat(loadmon.EngineLoad{RunningRequests: 3}, 0),
			nat(loadmon.EngineLoad{RunningRequests: 4}, 0), native, -1},
		{"prefill: queue time wins when both have it", prefill,
			nat(func() loadmon.EngineLoad {
				l := withQueue(10 * time.Millisecond)
				l.WaitingUncachedTokens = 9000
				return l
			}(), 0),
			nat(func() loadmon.EngineLoad {
				l := withQueue(20 * time.Millisecond)
				l.WaitingUncachedTokens = 10
				return l
			}(), 0), native, -1},
		{"prefill: queue time ignored when one lacks it", prefill,
			nat(func() loadmon.EngineLoad {
				l := withQueue(10 * time.Millisecond)
				l.WaitingUncachedTokens = 9000
				return l
			}(), 0),
			nat(loadmon.EngineLoad{WaitingUncachedTokens: 10}, 0), native, 1},
		{"decode ignores uncached tokens, orders by waiting", decode,
			nat(loadmon.EngineLoad{WaitingRequests: 1, WaitingUncachedTokens: 9999}, 0),
			nat(loadmon.EngineLoad{WaitingRequests: 2}, 0), native, -1},
		{"decode: running after waiting", decode,
			nat(loadmon.EngineLoad{WaitingRequests: 1, RunningRequests: 5}, 0),
			nat(loadmon.EngineLoad{WaitingRequests: 1, RunningRequests: 4}, 0), native, 1},
		{"decode: KV fraction before used tokens", decode,
			nat(loadmon.EngineLoad{UsedKVTokens: 500, KVCapacityTokens: 1000}, 0),
			nat(loadmon.EngineLoad{UsedKVTokens: 600, KVCapacityTokens: 2000}, 0), native, 1},
		{"decode: huge fractions that round to the same float64 compare exactly", decode,
			nat(loadmon.EngineLoad{UsedKVTokens: math.MaxUint64 - 1, KVCapacityTokens: math.MaxUint64}, 0),
			nat(loadmon.EngineLoad{UsedKVTokens: math.MaxUint64 - 2, KVCapacityTokens: math.MaxUint64}, 0), native, 1},
		{"decode: equal fraction, fewer used tokens", decode,
			nat(loadmon.EngineLoad{UsedKVTokens: 100, KVCapacityTokens: 1000}, 0),
			nat(loadmon.EngineLoad{UsedKVTokens: 200, KVCapacityTokens: 2000}, 0), native, -1},
		{"equal reported pressure falls to in-flight", prefill,
			nat(loadmon.EngineLoad{WaitingRequests: 1}, 5),
			nat(loadmon.EngineLoad{WaitingRequests: 1}, 3), native, 1},
		{"complete tie", decode, nat(loadmon.EngineLoad{}, 2), nat(loadmon.EngineLoad{}, 2), native, 0},
		{"coverage rule off: in-flight only", prefill,
			nat(loadmon.EngineLoad{WaitingRequests: 0}, 5),
			nat(loadmon.EngineLoad{WaitingRequests: 100}, 3), inFlight, 1},
		{"one side unknown: in-flight only", decode,
			nat(loadmon.EngineLoad{WaitingRequests: 0}, 5),
			loadmon.Observation{InFlight: 3}, native, 1},
		{"prefill: dispatched tokens add to the reported uncached tokens", prefill,
			since(nat(loadmon.EngineLoad{WaitingUncachedTokens: 0}, 1), 1, 600),
			nat(loadmon.EngineLoad{WaitingUncachedTokens: 512, WaitingRequests: 1}, 0), native, 1},
		{"prefill: dispatched tokens add to the queue time at the engine's rate", prefill,
			since(nat(withQueue(10*time.Millisecond), 0), 1, 1), // 1 token at 1 token/s: +1 s
			nat(withQueue(20*time.Millisecond), 0), native, 1},
		{"prefill: dispatch count adds to waiting requests", prefill,
			since(nat(loadmon.EngineLoad{WaitingRequests: 1}, 0), 2, 0),
			nat(loadmon.EngineLoad{WaitingRequests: 2}, 0), native, 1},
		{"decode: dispatch count adds to waiting requests", decode,
			since(nat(loadmon.EngineLoad{WaitingRequests: 0}, 0), 1, 0),
			nat(loadmon.EngineLoad{WaitingRequests: 0, RunningRequests: 9}, 0), native, 1},
		{"one side not native: reported requests, not native figures", plain,
			loadmon.Observation{Load: &loadmon.EngineLoad{WaitingRequests: 1}, InFlight: 5},
			nat(loadmon.EngineLoad{WaitingRequests: 0, WaitingUncachedTokens: 9000}, 3), native, 1},
		{"basic reports: waiting requests", plain,
			basic(loadmon.EngineLoad{WaitingRequests: 0, RunningRequests: 9}, 5),
			basic(loadmon.EngineLoad{WaitingRequests: 83, RunningRequests: 1}, 0), native, -1},
		{"basic reports: running requests after waiting", prefill,
			basic(loadmon.EngineLoad{WaitingRequests: 2, RunningRequests: 3}, 0),
			basic(loadmon.EngineLoad{WaitingRequests: 2, RunningRequests: 1}, 9), reported, 1},
		{"basic reports: dispatch count adds to waiting requests", plain,
			since(basic(loadmon.EngineLoad{WaitingRequests: 0}, 0), 3, 0),
			basic(loadmon.EngineLoad{WaitingRequests: 2}, 0), reported, 1},
		{"basic reports: decode reads KV usage", decode,
			basic(loadmon.EngineLoad{UsedKVTokens: 500, KVCapacityTokens: 1000}, 0),
			basic(loadmon.EngineLoad{UsedKVTokens: 600, KVCapacityTokens: 2000}, 0), reported, 1},
		{"reported basis skips native figures", prefill,
			nat(loadmon.EngineLoad{WaitingUncachedTokens: 10, WaitingRequests: 9}, 0),
			nat(loadmon.EngineLoad{WaitingUncachedTokens: 20, WaitingRequests: 1}, 0), reported, 1},
		{"reported basis skips queue time", prefill,
			nat(withQueue(10*time.Millisecond), 2),
			nat(withQueue(20*time.Millisecond), 1), reported, 1},
		{"in-flight basis ignores basic reports", plain,
			basic(loadmon.EngineLoad{WaitingRequests: 0}, 5),
			basic(loadmon.EngineLoad{WaitingRequests: 100}, 3), inFlight, 1},
		{"one side unknown, other basic: in-flight only", plain,
			basic(loadmon.EngineLoad{WaitingRequests: 0}, 5),
			loadmon.Observation{InFlight: 3}, native, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got := loadmon.ComparePressure(tt.stage, &tt.a, &tt.b, tt.basis)
			assert.Equal(t, tt.want, sign(got), "ComparePressure(a, b)")
			assert.Equal(t, -tt.want, sign(loadmon.ComparePressure(tt.stage, &tt.b, &tt.a, tt.basis)), "ComparePressure(b, a) is the mirror")
		})
	}
}

func sign(x int) int {
	switch {
	case x < 0:
		return -1
	case x > 0:
		return 1
	}
	return 0
}

func TestObserve(t *testing.T) {
	t.Parallel()
	tab := loadmon.NewTable()
	f := loadmon.NewInFlight(nil)
	f.Acquire("a", -1, 0)
	_ = tab.Report(loadmon.Report{Engine: "a", WaitingRequests: 3})
	o := loadmon.Observe(tab.Snapshot(), f, "a")
	assert.Equal(t, uint64(1), o.InFlight)
	if assert.NotNil(t, o.Load) {
		assert.Equal(t, uint64(3), o.Load.WaitingRequests)
	}
	assert.False(t, o.HasNative())
	assert.Zero(t, o.Dispatched, "the dispatch came before the report")
	o = loadmon.Observe(tab.Snapshot(), nil, "b")
	assert.Nil(t, o.Load)
	assert.Zero(t, o.InFlight)
}

func TestObserveCountsDispatchesSinceTheReport(t *testing.T) {
	t.Parallel()
	clk := newClock()
	tab := loadmon.NewTable(loadmon.WithClock(clk.Now))
	f := loadmon.NewInFlight(clk.Now)
	f.Acquire("a", -1, 100) // before the report: the report reflects it
	clk.Advance(time.Millisecond)
	_ = tab.Report(loadmon.Report{Engine: "a", WaitingRequests: 1, KVCapacityTokens: 1000,
		Native: &loadmon.NativeLoad{MaxRunningRequests: 8, WaitingUncachedTokens: 100}})
	clk.Advance(time.Millisecond)
	f.Acquire("a", -1, 300)
	f.Acquire("a", -1, 0) // no prefill work (a decode dispatch)
	f.Acquire("unknown", -1, 50)
	o := loadmon.Observe(tab.Snapshot(), f, "a")
	assert.Equal(t, uint64(3), o.InFlight)
	assert.Equal(t, uint64(2), o.Dispatched)
	assert.Equal(t, uint64(300), o.DispatchedTokens)
	w, ok := o.WaitingRequests()
	assert.True(t, ok)
	assert.Equal(t, uint64(3), w)
	pending, ok := o.PendingPrefillTokens()
	assert.True(t, ok)
	assert.Equal(t, uint64(400), pending)
	_, ok = o.PendingPrefillTime()
	assert.False(t, ok, "no prefill rate yet")

	u := loadmon.Observe(tab.Snapshot(), f, "unknown")
	assert.Equal(t, loadmon.Observation{InFlight: 1}, u, "no report: nothing is counted since it")
	_, ok = u.PendingPrefillTokens()
	assert.False(t, ok)
	_, ok = u.WaitingRequests()
	assert.False(t, ok)
}

// Without native figures the pending prefill is estimated from the waiting requests, priced at the
// mean prefill tokens of the router's recent dispatches to the engine (the caller's per-request
// figure when it has recorded none), plus the tokens dispatched since the report.
func TestEstimatePendingPrefillTokens(t *testing.T) {
	t.Parallel()
	clk := newClock()
	tab := loadmon.NewTable(loadmon.WithClock(clk.Now))
	f := loadmon.NewInFlight(clk.Now)
	f.Acquire("a", -1, 1000)
	f.Acquire("a", -1, 3000)
	f.Acquire("a", -1, 0) // no prefill work: counts in the mean as 0 tokens
	clk.Advance(time.Millisecond)
	require.NoError(t, tab.Report(loadmon.Report{Engine: "a", WaitingRequests: 4}))
	require.NoError(t, tab.Report(loadmon.Report{Engine: "b", WaitingRequests: 4}))
	require.NoError(t, tab.Report(loadmon.Report{Engine: "n", WaitingRequests: 4, KVCapacityTokens: 100,
		Native: &loadmon.NativeLoad{MaxRunningRequests: 8, WaitingUncachedTokens: 700}}))
	clk.Advance(time.Millisecond)
	f.Acquire("a", -1, 500)
	f.Acquire("n", -1, 50)
	snap := tab.Snapshot()

	a := loadmon.Observe(snap, f, "a")
	got, ok := a.EstimatePendingPrefillTokens(f, 77)
	assert.True(t, ok)
	assert.Equal(t, uint64(4*1125+500), got, "4 waiting × (1000 + 3000 + 0 + 500) ÷ 4, + the 500 dispatched since")
	got, _ = a.EstimatePendingPrefillTokens(nil, 77)
	assert.Equal(t, uint64(4*77+500), got, "no in-flight counters: the caller's figure per request")

	b := loadmon.Observe(snap, f, "b")
	got, ok = b.EstimatePendingPrefillTokens(f, 77)
	assert.True(t, ok)
	assert.Equal(t, uint64(4*77), got, "no dispatch recorded: the caller's figure per request")

	n := loadmon.Observe(snap, f, "n")
	got, ok = n.EstimatePendingPrefillTokens(f, 77)
	assert.True(t, ok)
	assert.Equal(t, uint64(750), got, "native: the reported waiting uncached tokens, exact")

	u := loadmon.Observe(snap, f, "unknown")
	_, ok = u.EstimatePendingPrefillTokens(f, 77)
	assert.False(t, ok)

	huge := basic(loadmon.EngineLoad{WaitingRequests: math.MaxUint64}, 0)
	got, _ = huge.EstimatePendingPrefillTokens(nil, 2)
	assert.Equal(t, uint64(math.MaxUint64), got, "saturates")
}

// The mean covers the 64 most recent dispatches; a named rank's, the dispatches that named it.
func TestEstimatePendingPrefillTokensMeansTheRecentDispatches(t *testing.T) {
	t.Parallel()
	clk := newClock()
	tab := loadmon.NewTable(loadmon.WithClock(clk.Now))
	f := loadmon.NewInFlight(clk.Now)
	for range 64 {
		f.Acquire("a", -1, 10)
	}
	for range 64 {
		f.Acquire("a", -1, 30)
	}
	f.Acquire("a", -1, 94)
	f.Acquire("r", 1, 200)
	f.Acquire("r", -1, 5000)      // named no rank
	clk.Advance(time.Millisecond) // the reports follow the dispatches
	require.NoError(t, tab.Report(loadmon.Report{Engine: "a", WaitingRequests: 1}))
	o := loadmon.Observe(tab.Snapshot(), f, "a")
	got, _ := o.EstimatePendingPrefillTokens(f, 0)
	assert.Equal(t, uint64(31), got, "(63 × 30 + 94) ÷ 64")

	require.NoError(t, tab.Expect("r", 2))
	require.NoError(t, tab.Report(loadmon.Report{Engine: "r", DPRank: 0, WaitingRequests: 1}))
	require.NoError(t, tab.Report(loadmon.Report{Engine: "r", DPRank: 1, WaitingRequests: 3}))
	o = loadmon.ObserveRank(tab.Snapshot(), f, "r", 1)
	got, _ = o.EstimatePendingPrefillTokens(f, 0)
	assert.Equal(t, uint64(600), got, "3 waiting × the rank's 200")
}

func TestPendingPrefillTimeAddsDispatchedTokensAtTheMeasuredRate(t *testing.T) {
	t.Parallel()
	o := since(nat(loadmon.EngineLoad{HasPrefillRate: true, PrefillTokensPerSecond: 1000,
		WaitingUncachedTokens: 500, EstimatedPrefillQueue: 500 * time.Millisecond}, 0), 1, 250)
	d, ok := o.PendingPrefillTime()
	assert.True(t, ok)
	assert.Equal(t, 750*time.Millisecond, d)
	assert.Equal(t, time.Duration(math.MaxInt64), o.Load.TokensTime(math.MaxUint64), "saturates")
	assert.Zero(t, (&loadmon.EngineLoad{}).TokensTime(10), "no rate")
}

func BenchmarkSnapshotObserve64(b *testing.B) {
	tab := loadmon.NewTable()
	f := loadmon.NewInFlight(nil)
	ids := make([]state.EngineID, 64)
	for i := range ids {
		ids[i] = state.EngineID("http://engine-" + string(rune('a'+i%26)) + string(rune('a'+i/26)))
		_ = tab.Report(loadmon.Report{Engine: ids[i], KVCapacityTokens: 1000, Native: &loadmon.NativeLoad{MaxRunningRequests: 8}})
	}
	b.ReportAllocs()
	for b.Loop() {
		s := tab.Snapshot()
		for _, id := range ids {
			_ = loadmon.Observe(s, f, id)
		}
	}
}

// A basic report counts a request being prefilled as running, not waiting. Once the host reports
// first tokens, the estimate is at least the prefill tokens of the router's dispatches there whose
// first token has not arrived (docs/design.md §9.11): an engine busy prefilling a long prompt
// dispatched before its report is not taken for idle.
func TestEstimatePendingPrefillTokensCountsPrefillsInFlight(t *testing.T) {
	t.Parallel()
	clk := newClock()
	tab := loadmon.NewTable(loadmon.WithClock(clk.Now))
	f := loadmon.NewInFlight(clk.Now)
	long := f.Acquire("a", -1, 8000)
	short := f.Acquire("a", 1, 300)
	done := f.Acquire("b", -1, 5000)
	clk.Advance(time.Millisecond)
	require.NoError(t, tab.Report(loadmon.Report{Engine: "a", RunningRequests: 2}))
	require.NoError(t, tab.Report(loadmon.Report{Engine: "b", RunningRequests: 1}))
	est := func(engine string) uint64 {
		o := loadmon.Observe(tab.Snapshot(), f, state.EngineID(engine))
		got, ok := o.EstimatePendingPrefillTokens(f, 77)
		require.True(t, ok)
		return got
	}
	assert.Zero(t, est("a"), "no first token reported yet: the report alone (nothing waiting)")

	done.FirstToken()
	assert.Equal(t, uint64(8300), est("a"), "both prefills still in flight")
	assert.Zero(t, est("b"), "b's prefill has ended")
	short.FirstToken()
	short.FirstToken()
	assert.Equal(t, uint64(8000), est("a"), "FirstToken is idempotent")
	short.Release()
	assert.Equal(t, uint64(8000), est("a"), "a release after the first token subtracts nothing more")
	long.Release()
	assert.Zero(t, est("a"), "a released dispatch no longer prefills")

	// The larger of the two estimates: a report's waiting requests priced at the recent mean.
	f.Acquire("c", -1, 100)
	clk.Advance(time.Millisecond)
	require.NoError(t, tab.Report(loadmon.Report{Engine: "c", WaitingRequests: 10}))
	assert.Equal(t, uint64(10*100), est("c"), "10 waiting × the mean 100 exceeds the 100 in flight")
	// A native report already counts the prefill in progress (its waiting uncached tokens): it is
	// used as reported, however much of this router's prefill is in flight there.
	f.Acquire("n", -1, 9000)
	clk.Advance(time.Millisecond)
	require.NoError(t, tab.Report(loadmon.Report{Engine: "n", KVCapacityTokens: 100,
		Native: &loadmon.NativeLoad{MaxRunningRequests: 8, WaitingUncachedTokens: 700}}))
	assert.Equal(t, uint64(700), est("n"), "native: the reported waiting uncached tokens")
	var nilGuard *loadmon.Guard
	nilGuard.FirstToken()
}

// Concurrent first tokens and releases leave no prefill counted once every dispatch has ended.
func TestPrefillsInFlightUnderConcurrency(t *testing.T) {
	t.Parallel()
	clk := newClock()
	tab := loadmon.NewTable(loadmon.WithClock(clk.Now))
	f := loadmon.NewInFlight(clk.Now)
	first := f.Acquire("a", -1, 1)
	first.FirstToken() // the host reports first tokens
	first.Release()
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for i := range 500 {
				g := f.Acquire("a", w%2, uint64(i+1))
				var racer sync.WaitGroup
				if i%3 != 0 {
					racer.Go(g.FirstToken) // the first token races the release
				}
				g.Release()
				racer.Wait()
				g.FirstToken()
			}
		})
	}
	wg.Wait()
	clk.Advance(time.Millisecond) // the report follows the dispatches
	require.NoError(t, tab.Report(loadmon.Report{Engine: "a"}))
	o := loadmon.Observe(tab.Snapshot(), f, "a")
	got, _ := o.EstimatePendingPrefillTokens(f, 0)
	assert.Zero(t, got)
	assert.Zero(t, f.Count("a"))
}

// A native report counts the prefill in progress until the next report. Once the host reports
// first tokens, the prefill this router saw end since the report no longer counts as pending
// (docs/design.md §9.7): an engine that finished its prefill just after reporting is not taken
// for busy. Engine "n" reports 7,000 waiting uncached tokens at 10,000 tokens/s (0.7 s) with this
// router's dispatches a (6,000 tokens) and b (1,000) in progress.
func TestNativePendingPrefillDropsPrefillEndedSinceReport(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name string
		// before runs before the report, after after it; both get the dispatches a and b.
		before, after func(f *loadmon.InFlight, a, b *loadmon.Guard)
		want          uint64
		wantTime      time.Duration
	}{
		{"no first token since the report", nil, func(*loadmon.InFlight, *loadmon.Guard, *loadmon.Guard) {}, 7000, 700 * time.Millisecond},
		{"a's first token after the report", nil, func(_ *loadmon.InFlight, a, _ *loadmon.Guard) { a.FirstToken() }, 1000, 100 * time.Millisecond},
		{"a's first token before the report: the report has it", func(_ *loadmon.InFlight, a, _ *loadmon.Guard) { a.FirstToken() },
			func(*loadmon.InFlight, *loadmon.Guard, *loadmon.Guard) {}, 7000, 700 * time.Millisecond},
		{"a dispatch since the report that ended adds nothing", nil, func(f *loadmon.InFlight, a, _ *loadmon.Guard) {
			a.FirstToken()
			f.Acquire("n", -1, 500).FirstToken()
		}, 1000, 100 * time.Millisecond},
		{"one still prefilling since the report adds its tokens", nil, func(f *loadmon.InFlight, a, _ *loadmon.Guard) {
			a.FirstToken()
			f.Acquire("n", -1, 500)
		}, 1500, 150 * time.Millisecond},
		{"a released before its first token: aborted", func(_ *loadmon.InFlight, _, b *loadmon.Guard) { b.FirstToken() },
			func(_ *loadmon.InFlight, a, _ *loadmon.Guard) { a.Release() }, 1000, 100 * time.Millisecond},
		{"a host without first tokens: a release is not a prefill end", nil,
			func(_ *loadmon.InFlight, a, _ *loadmon.Guard) { a.Release() }, 7000, 700 * time.Millisecond},
		{"more ended than reported: 0", nil, func(f *loadmon.InFlight, a, b *loadmon.Guard) {
			a.FirstToken()
			b.FirstToken()
			g := f.Acquire("n", -1, 9000)
			g.FirstToken()
		}, 0, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			clk := newClock()
			tab := loadmon.NewTable(loadmon.WithClock(clk.Now))
			f := loadmon.NewInFlight(clk.Now)
			report := func(uncached, total uint64, busy time.Duration) {
				require.NoError(t, tab.Report(loadmon.Report{Engine: "n", KVCapacityTokens: 1 << 20, Native: native(uncached, 8, total, busy)}))
			}
			report(0, 0, 0)
			a, b := f.Acquire("n", -1, 6000), f.Acquire("n", -1, 1000)
			if tt.before != nil {
				tt.before(f, a, b)
			}
			clk.Advance(time.Millisecond)
			report(7000, 10_000, time.Second) // 10,000 tokens/s
			clk.Advance(time.Millisecond)
			tt.after(f, a, b)
			o := loadmon.Observe(tab.Snapshot(), f, "n")
			got, ok := o.PendingPrefillTokens()
			require.True(t, ok)
			assert.Equal(t, tt.want, got)
			est, ok := o.EstimatePendingPrefillTokens(f, 1)
			require.True(t, ok)
			assert.Equal(t, tt.want, est)
			d, ok := o.PendingPrefillTime()
			require.True(t, ok)
			assert.Equal(t, tt.wantTime, d)
		})
	}
}

// The prefill ends counted against a named DP rank's report are those of the dispatches that
// named the rank.
func TestNativePendingPrefillOfARankDropsItsEndedPrefill(t *testing.T) {
	t.Parallel()
	clk := newClock()
	tab := loadmon.NewTable(loadmon.WithClock(clk.Now))
	f := loadmon.NewInFlight(clk.Now)
	require.NoError(t, tab.Expect("e", 2))
	r0, r1 := f.Acquire("e", 0, 3000), f.Acquire("e", 1, 2000)
	clk.Advance(time.Millisecond)
	for rank, w := range []uint64{3000, 2000} {
		require.NoError(t, tab.Report(loadmon.Report{Engine: "e", DPRank: rank, KVCapacityTokens: 1 << 20, Native: native(w, 8, 0, 0)}))
	}
	clk.Advance(time.Millisecond)
	r1.FirstToken()
	pending := func(rank int) uint64 {
		o := loadmon.ObserveRank(tab.Snapshot(), f, "e", rank)
		require.True(t, o.HasDPRank)
		got, ok := o.PendingPrefillTokens()
		require.True(t, ok)
		return got
	}
	assert.Equal(t, uint64(3000), pending(0))
	assert.Equal(t, uint64(0), pending(1))
	r0.FirstToken()
	assert.Equal(t, uint64(0), pending(0))
}
