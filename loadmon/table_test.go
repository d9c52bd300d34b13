package loadmon_test

import (
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

// fakeClock is a manually advanced clock, safe for concurrent reads.
type fakeClock struct{ ns atomic.Int64 }

func newClock() *fakeClock {
	c := &fakeClock{}
	c.ns.Store(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	return c
}
func (c *fakeClock) Now() time.Time          { return time.Unix(0, c.ns.Load()).UTC() }
func (c *fakeClock) Advance(d time.Duration) { c.ns.Add(int64(d)) }

func native(uncached, maxRunning, prefilled uint64, busy time.Duration) *loadmon.NativeLoad {
	return &loadmon.NativeLoad{WaitingUncachedTokens: uncached, MaxRunningRequests: maxRunning,
		PrefillUncachedTokensTotal: prefilled, PrefillBusyTime: busy}
}

func TestLoadSumsEveryExpectedRank(t *testing.T) {
	t.Parallel()
	clk := newClock()
	tab := loadmon.NewTable(loadmon.WithClock(clk.Now))
	require.NoError(t, tab.Expect("e", 2))

	require.NoError(t, tab.Report(loadmon.Report{Engine: "e", DPRank: 0, RunningRequests: 1, WaitingRequests: 3, UsedKVTokens: 10, KVCapacityTokens: 100}))
	_, ok := tab.Snapshot().Load("e")
	assert.False(t, ok, "one of two expected ranks missing: unknown, not half the load")

	clk.Advance(time.Second)
	require.NoError(t, tab.Report(loadmon.Report{Engine: "e", DPRank: 1, RunningRequests: 3, WaitingRequests: 1, UsedKVTokens: 30, KVCapacityTokens: 100}))
	l, ok := tab.Snapshot().Load("e")
	require.True(t, ok)
	assert.Equal(t, uint64(4), l.RunningRequests)
	assert.Equal(t, uint64(4), l.WaitingRequests)
	assert.Equal(t, uint64(40), l.UsedKVTokens)
	assert.Equal(t, uint64(200), l.KVCapacityTokens)
	assert.Equal(t, 2, l.Ranks)
	assert.Equal(t, clk.Now().Add(-time.Second), l.ReportedAt, "timestamp is the oldest rank's")
	assert.False(t, l.Native, "basic reports carry no native pressure")
	f, ok := l.KVUsageFraction()
	assert.True(t, ok)
	assert.InDelta(t, 0.2, f, 1e-12)
}

func TestAnyStaleRankExcludesTheEngine(t *testing.T) {
	t.Parallel()
	clk := newClock()
	tab := loadmon.NewTable(loadmon.WithClock(clk.Now), loadmon.WithFreshness(5*time.Second))
	require.NoError(t, tab.Expect("e", 2))
	require.NoError(t, tab.Report(loadmon.Report{Engine: "e", DPRank: 0}))
	clk.Advance(3 * time.Second)
	require.NoError(t, tab.Report(loadmon.Report{Engine: "e", DPRank: 1}))

	clk.Advance(2 * time.Second) // rank 0 is exactly 5 s old: still fresh
	_, ok := tab.Snapshot().Load("e")
	assert.True(t, ok, "age equal to the freshness is fresh")

	clk.Advance(time.Nanosecond)
	_, ok = tab.Snapshot().Load("e")
	assert.False(t, ok, "rank 0 is stale, so the whole engine is unknown although rank 1 is fresh")

	require.NoError(t, tab.Report(loadmon.Report{Engine: "e", DPRank: 0}))
	_, ok = tab.Snapshot().Load("e")
	assert.True(t, ok)
}

func TestUndeclaredEngineHasOneRankAndRejectsOthers(t *testing.T) {
	t.Parallel()
	tab := loadmon.NewTable()
	require.NoError(t, tab.Report(loadmon.Report{Engine: "e", RunningRequests: 2}))
	err := tab.Report(loadmon.Report{Engine: "e", DPRank: 1, RunningRequests: 99})
	assert.ErrorIs(t, err, loadmon.ErrRankOutOfRange)
	assert.ErrorIs(t, err, state.ErrInvalidSignal)
	l, ok := tab.Snapshot().Load("e")
	require.True(t, ok)
	assert.Equal(t, uint64(2), l.RunningRequests, "a rejected report leaves the table unchanged")
}

func TestBadReportsAndExpectationsAreTypedErrors(t *testing.T) {
	t.Parallel()
	tab := loadmon.NewTable()
	v := tab.Snapshot().Version()
	for name, r := range map[string]loadmon.Report{
		"empty engine":        {},
		"negative rank":       {Engine: "e", DPRank: -1},
		"used above capacity": {Engine: "e", UsedKVTokens: 11, KVCapacityTokens: 10},
		"negative busy time":  {Engine: "e", Native: native(0, 1, 0, -time.Second)},
	} {
		assert.ErrorIs(t, tab.Report(r), state.ErrInvalidSignal, name)
	}
	assert.Equal(t, v, tab.Snapshot().Version(), "rejected reports publish nothing")

	for name, n := range map[string]int{"zero": 0, "negative": -3, "too many": loadmon.MaxRanks + 1} {
		assert.ErrorIs(t, tab.Expect("e", n), state.ErrInvalidConfiguration, name)
	}
	assert.ErrorIs(t, tab.Expect("", 1), state.ErrInvalidConfiguration)
}

func TestForgetClearsEveryRank(t *testing.T) {
	t.Parallel()
	tab := loadmon.NewTable()
	require.NoError(t, tab.Expect("e", 2))
	require.NoError(t, tab.Report(loadmon.Report{Engine: "e", DPRank: 0}))
	require.NoError(t, tab.Report(loadmon.Report{Engine: "e", DPRank: 1}))
	_, ok := tab.Snapshot().Load("e")
	require.True(t, ok)

	tab.Forget("e")
	_, ok = tab.Snapshot().Load("e")
	assert.False(t, ok)
	// After Forget the engine starts over with one expected rank: rank 1 is out of range and a
	// single rank-0 report is complete.
	assert.ErrorIs(t, tab.Report(loadmon.Report{Engine: "e", DPRank: 1}), loadmon.ErrRankOutOfRange)
	require.NoError(t, tab.Report(loadmon.Report{Engine: "e", DPRank: 0, WaitingRequests: 7}))
	l, ok := tab.Snapshot().Load("e")
	require.True(t, ok)
	assert.Equal(t, uint64(7), l.WaitingRequests)
	tab.Forget("never-seen") // no-op
}

func TestSnapshotIsImmutableAndVersioned(t *testing.T) {
	t.Parallel()
	tab := loadmon.NewTable()
	require.NoError(t, tab.Report(loadmon.Report{Engine: "e", RunningRequests: 1}))
	snap := tab.Snapshot()
	require.NoError(t, tab.Report(loadmon.Report{Engine: "e", RunningRequests: 9}))
	l, ok := snap.Load("e")
	require.True(t, ok)
	assert.Equal(t, uint64(1), l.RunningRequests, "a report after capture does not change the snapshot")
	next := tab.Snapshot()
	assert.Greater(t, next.Version(), snap.Version())
	l, _ = next.Load("e")
	assert.Equal(t, uint64(9), l.RunningRequests, "the next snapshot reads fresh state")

	var zero loadmon.Snapshot
	_, ok = zero.Load("e")
	assert.False(t, ok)
	assert.Zero(t, zero.Version())
}

func TestNativeRequiresEveryRankAndCapacity(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name       string
		rank0      loadmon.Report
		wantNative bool
	}{
		{"complete native", loadmon.Report{KVCapacityTokens: 100, Native: native(5, 8, 0, 0)}, true},
		{"old publisher rank", loadmon.Report{KVCapacityTokens: 100}, false},
		{"unknown KV capacity", loadmon.Report{Native: native(5, 8, 0, 0)}, false},
		{"unknown max running", loadmon.Report{KVCapacityTokens: 100, Native: native(5, 0, 0, 0)}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			tab := loadmon.NewTable()
			require.NoError(t, tab.Expect("e", 2))
			r0 := tt.rank0
			r0.Engine = "e"
			require.NoError(t, tab.Report(r0))
			require.NoError(t, tab.Report(loadmon.Report{Engine: "e", DPRank: 1, KVCapacityTokens: 100, Native: native(7, 8, 0, 0)}))
			l, ok := tab.Snapshot().Load("e")
			require.True(t, ok, "basic load exists either way")
			assert.Equal(t, tt.wantNative, l.Native)
			if tt.wantNative {
				assert.Equal(t, uint64(12), l.WaitingUncachedTokens)
				assert.Equal(t, uint64(16), l.MaxRunningRequests)
			} else {
				assert.Zero(t, l.WaitingUncachedTokens, "non-native loads expose no native fields")
			}
		})
	}
}

func TestPrefillQueueTimeNeedsTwoSamplesOnEveryRank(t *testing.T) {
	t.Parallel()
	clk := newClock()
	tab := loadmon.NewTable(loadmon.WithClock(clk.Now))
	require.NoError(t, tab.Expect("e", 2))
	rep := func(rank int, uncached, total uint64, busy time.Duration) {
		t.Helper()
		require.NoError(t, tab.Report(loadmon.Report{Engine: "e", DPRank: rank, KVCapacityTokens: 1000, Native: native(uncached, 8, total, busy)}))
	}
	rep(0, 1000, 0, 0)
	rep(1, 1000, 0, 0)
	l, _ := tab.Snapshot().Load("e")
	assert.False(t, l.HasPrefillRate, "one sample per rank gives no rate")

	rep(0, 1000, 10_000, time.Second) // 10,000 tokens/s
	l, _ = tab.Snapshot().Load("e")
	assert.False(t, l.HasPrefillRate, "rank 1 has no rate yet")

	rep(1, 2000, 30_000, 2*time.Second) // 15,000 tokens/s
	l, _ = tab.Snapshot().Load("e")
	require.True(t, l.HasPrefillRate)
	assert.InDelta(t, 25_000, l.PrefillTokensPerSecond, 1e-9)
	assert.Equal(t, 3000, int(l.WaitingUncachedTokens))
	assert.Equal(t, 120*time.Millisecond, l.EstimatedPrefillQueue, "3,000 tokens at 25,000 tokens/s")

	// An idle rank (counters unchanged) keeps its rate; a counter going backwards (engine restart)
	// loses it until the next increasing pair.
	rep(1, 0, 30_000, 2*time.Second)
	l, _ = tab.Snapshot().Load("e")
	assert.True(t, l.HasPrefillRate)
	rep(1, 0, 5, time.Millisecond)
	l, _ = tab.Snapshot().Load("e")
	assert.False(t, l.HasPrefillRate)
	assert.Zero(t, l.EstimatedPrefillQueue)
}

func TestSumsSaturateInsteadOfOverflowing(t *testing.T) {
	t.Parallel()
	tab := loadmon.NewTable()
	require.NoError(t, tab.Expect("e", 2))
	require.NoError(t, tab.Report(loadmon.Report{Engine: "e", DPRank: 0, WaitingRequests: math.MaxUint64}))
	require.NoError(t, tab.Report(loadmon.Report{Engine: "e", DPRank: 1, WaitingRequests: 5}))
	l, ok := tab.Snapshot().Load("e")
	require.True(t, ok)
	assert.Equal(t, uint64(math.MaxUint64), l.WaitingRequests)
}

func TestExpectChangesKeepSurvivingRanks(t *testing.T) {
	t.Parallel()
	tab := loadmon.NewTable()
	require.NoError(t, tab.Expect("e", 3))
	for r := range 3 {
		require.NoError(t, tab.Report(loadmon.Report{Engine: "e", DPRank: r, RunningRequests: uint64(r + 1)}))
	}
	require.NoError(t, tab.Expect("e", 2))
	l, ok := tab.Snapshot().Load("e")
	require.True(t, ok)
	assert.Equal(t, uint64(3), l.RunningRequests, "ranks 0 and 1 kept, rank 2 dropped")
	require.NoError(t, tab.Expect("e", 4))
	_, ok = tab.Snapshot().Load("e")
	assert.False(t, ok, "two new ranks not yet reported")
}

func TestTableConcurrentReportsSnapshotsAndForget(t *testing.T) {
	t.Parallel()
	tab := loadmon.NewTable()
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for w := range 4 {
		wg.Go(func() {
			for i := range 500 {
				id := state.EngineID(fmt.Sprintf("e%d", i%8))
				_ = tab.Expect(id, 1+w%2)
				_ = tab.Report(loadmon.Report{Engine: id, DPRank: w % 2, RunningRequests: uint64(i)})
				if i%50 == 0 {
					tab.Forget(id)
				}
			}
		})
	}
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			s := tab.Snapshot()
			for i := range 8 {
				if l, ok := s.Load(state.EngineID(fmt.Sprintf("e%d", i))); ok && l.Ranks < 1 {
					t.Error("published load with no ranks")
				}
			}
		}
	})
	time.Sleep(10 * time.Millisecond)
	close(stop)
	wg.Wait()
}

func TestReportBatchIsAllOrNothing(t *testing.T) {
	t.Parallel()
	good := func(rank int, running uint64) loadmon.Report {
		return loadmon.Report{Engine: "e", DPRank: rank, RunningRequests: running}
	}
	cases := []struct {
		name  string
		batch []loadmon.Report
		want  error
	}{
		{"rank_out_of_range_last", []loadmon.Report{good(0, 7), good(1, 7), good(2, 7)}, loadmon.ErrRankOutOfRange},
		{"rank_out_of_range_first", []loadmon.Report{good(2, 7), good(0, 7), good(1, 7)}, loadmon.ErrRankOutOfRange},
		{"used_above_capacity", []loadmon.Report{good(0, 7), {Engine: "e", DPRank: 1, UsedKVTokens: 11, KVCapacityTokens: 10}}, loadmon.ErrInvalidReport},
		{"empty_engine", []loadmon.Report{good(0, 7), {DPRank: 1}}, loadmon.ErrInvalidReport},
		{"duplicate_rank", []loadmon.Report{good(0, 7), good(1, 7), good(0, 8)}, loadmon.ErrInvalidReport},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			clk := newClock()
			tab := loadmon.NewTable(loadmon.WithClock(clk.Now))
			require.NoError(t, tab.Expect("e", 2))
			require.NoError(t, tab.ReportBatch([]loadmon.Report{good(0, 1), good(1, 2)}))
			before := tab.Snapshot()

			err := tab.ReportBatch(tc.batch)
			require.ErrorIs(t, err, tc.want)
			assert.ErrorIs(t, err, state.ErrInvalidSignal)
			after := tab.Snapshot()
			assert.Equal(t, before.Version(), after.Version(), "a rejected batch publishes nothing")
			l, ok := after.Load("e")
			require.True(t, ok)
			assert.Equal(t, uint64(3), l.RunningRequests, "the earlier batch's sums stand")
		})
	}
}

func TestReportBatchPublishesEveryRankAtOnce(t *testing.T) {
	t.Parallel()
	clk := newClock()
	tab := loadmon.NewTable(loadmon.WithClock(clk.Now))
	require.NoError(t, tab.Expect("a", 2))
	v0 := tab.Snapshot().Version()
	require.NoError(t, tab.ReportBatch([]loadmon.Report{
		{Engine: "a", DPRank: 1, RunningRequests: 2, WaitingRequests: 5},
		{Engine: "b", RunningRequests: 9},
		{Engine: "a", DPRank: 0, RunningRequests: 1, WaitingRequests: 4},
	}))
	s := tab.Snapshot()
	assert.Equal(t, v0+2, s.Version(), "one publication per touched engine")
	a, ok := s.Load("a")
	require.True(t, ok, "both ranks arrived in one batch: the engine is known at once")
	assert.Equal(t, uint64(3), a.RunningRequests)
	assert.Equal(t, uint64(9), a.WaitingRequests)
	assert.Equal(t, clk.Now(), a.ReportedAt)
	b, ok := s.Load("b")
	require.True(t, ok)
	assert.Equal(t, uint64(9), b.RunningRequests)

	require.NoError(t, tab.ReportBatch(nil))
	assert.Equal(t, s.Version(), tab.Snapshot().Version(), "an empty batch does nothing")
}

// TestReportedIgnoresFreshness checks Snapshot.Reported: the last complete load stays readable
// with its arrival time after it went stale (for metrics), while Load no longer returns it.
func TestReportedIgnoresFreshness(t *testing.T) {
	t.Parallel()
	clk := newClock()
	tab := loadmon.NewTable(loadmon.WithClock(clk.Now), loadmon.WithFreshness(time.Second))
	require.NoError(t, tab.Expect("e", 2))
	require.NoError(t, tab.Report(loadmon.Report{Engine: "e", DPRank: 0, WaitingRequests: 2}))
	_, ok := tab.Snapshot().Reported("e")
	assert.False(t, ok, "rank-incomplete: never reported")
	at := clk.Now()
	require.NoError(t, tab.Report(loadmon.Report{Engine: "e", DPRank: 1, WaitingRequests: 1}))
	clk.Advance(10 * time.Second)
	snap := tab.Snapshot()
	_, fresh := snap.Load("e")
	assert.False(t, fresh)
	l, ok := snap.Reported("e")
	require.True(t, ok)
	assert.Equal(t, at, l.ReportedAt)
	assert.Equal(t, uint64(3), l.WaitingRequests)
	tab.Forget("e")
	_, ok = tab.Snapshot().Reported("e")
	assert.False(t, ok)
	_, ok = loadmon.Snapshot{}.Reported("e")
	assert.False(t, ok)
}

// OnChange callbacks run once per changed engine, after the change is visible, and never for a
// refused report; a removed callback runs no more.
func TestOnChange(t *testing.T) {
	t.Parallel()
	tab := loadmon.NewTable()
	var mu sync.Mutex
	var seen []string
	removeA := tab.OnChange(func(e state.EngineID) {
		_, visible := tab.Snapshot().Reported(e)
		mu.Lock()
		seen = append(seen, fmt.Sprintf("a:%s:%v", e, visible))
		mu.Unlock()
	})
	removeB := tab.OnChange(func(e state.EngineID) {
		mu.Lock()
		seen = append(seen, "b:"+string(e))
		mu.Unlock()
	})
	require.NoError(t, tab.Report(loadmon.Report{Engine: "e1", WaitingRequests: 1}))
	require.NoError(t, tab.Expect("e2", 2))
	require.NoError(t, tab.ReportBatch([]loadmon.Report{{Engine: "e2", DPRank: 0}, {Engine: "e1"}, {Engine: "e2", DPRank: 1}}))
	require.ErrorIs(t, tab.Report(loadmon.Report{Engine: "e1", DPRank: 3}), loadmon.ErrRankOutOfRange)
	require.Error(t, tab.ReportBatch([]loadmon.Report{{Engine: "e1"}, {Engine: "e1"}}))
	removeB()
	removeB()
	tab.Forget("e1")
	tab.Forget("e1") // not known any more: no change
	removeA()
	require.NoError(t, tab.Report(loadmon.Report{Engine: "e1"}))
	assert.Equal(t, []string{"a:e1:true", "b:e1", "a:e2:true", "b:e2", "a:e1:true", "b:e1", "a:e1:false"}, seen)
}
