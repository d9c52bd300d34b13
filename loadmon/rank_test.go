package loadmon_test

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

// rankTable returns a table whose engine "e" has the given per-rank reports (DPRank set from the
// index), all native unless plain, and a fixed clock.
func rankTable(t *testing.T, plain bool, reports ...loadmon.Report) (*loadmon.Table, *loadmon.InFlight) {
	t.Helper()
	now := time.Unix(1000, 0)
	clock := func() time.Time { return now }
	tab := loadmon.NewTable(loadmon.WithClock(clock))
	require.NoError(t, tab.Expect("e", len(reports)))
	for i, r := range reports {
		r.Engine, r.DPRank = "e", i
		if !plain {
			r.KVCapacityTokens = max(r.KVCapacityTokens, 1000)
			if r.Native == nil {
				r.Native = &loadmon.NativeLoad{MaxRunningRequests: 8}
			}
		}
		require.NoError(t, tab.Report(r))
	}
	return tab, loadmon.NewInFlight(clock)
}

// An engine with several DP ranks keeps each rank's own load beside the sum.
func TestRankLoads(t *testing.T) {
	t.Parallel()
	tab, _ := rankTable(t, false,
		loadmon.Report{WaitingRequests: 7, RunningRequests: 1, Native: &loadmon.NativeLoad{MaxRunningRequests: 8, WaitingUncachedTokens: 700}},
		loadmon.Report{WaitingRequests: 1, RunningRequests: 3, Native: &loadmon.NativeLoad{MaxRunningRequests: 8, WaitingUncachedTokens: 100}})
	l, ok := tab.Snapshot().Load("e")
	require.True(t, ok)
	assert.Equal(t, uint64(8), l.WaitingRequests, "the engine's load is the sum")
	require.Len(t, l.RankLoads, 2)
	r1, ok := l.Rank(1)
	require.True(t, ok)
	assert.Equal(t, 1, r1.Ranks)
	assert.Equal(t, uint64(1), r1.WaitingRequests)
	assert.Equal(t, uint64(3), r1.RunningRequests)
	assert.Equal(t, uint64(100), r1.WaitingUncachedTokens)
	assert.True(t, r1.Native)
	assert.Equal(t, uint64(1), l.LeastRankWaitingRequests(), "rank 1 queues 1, not the engine's 8")
	_, ok = l.Rank(2)
	assert.False(t, ok)

	one, _ := rankTable(t, false, loadmon.Report{WaitingRequests: 4})
	l, ok = one.Snapshot().Load("e")
	require.True(t, ok)
	assert.Nil(t, l.RankLoads, "one rank: the engine's load is the rank's")
	assert.Equal(t, uint64(4), l.LeastRankWaitingRequests())
}

// The least pressured rank is named, and the observation's figures are that rank's own.
func TestObserveLeastPressuredNamesTheRank(t *testing.T) {
	t.Parallel()
	nat := func(uncached uint64, waiting uint64) loadmon.Report {
		return loadmon.Report{WaitingRequests: waiting, Native: &loadmon.NativeLoad{MaxRunningRequests: 8, WaitingUncachedTokens: uncached}}
	}
	tab, inf := rankTable(t, false, nat(5000, 1), nat(200, 3), nat(900, 0))
	o := loadmon.ObserveLeastPressured(tab.Snapshot(), inf, state.StagePrefill, "e")
	require.True(t, o.HasDPRank)
	assert.Equal(t, 1, o.DPRank, "prefill: fewest waiting uncached tokens")
	assert.Equal(t, uint64(3), o.Figures().WaitingRequests)
	w, _ := o.WaitingRequests()
	assert.Equal(t, uint64(3), w, "the rank's own queue, not the engine's 4")
	assert.Equal(t, uint64(4), o.Load.WaitingRequests, "admission still reads the engine's sum")

	o = loadmon.ObserveLeastPressured(tab.Snapshot(), inf, state.StageDecode, "e")
	assert.Equal(t, 2, o.DPRank, "decode: fewest waiting requests")

	// Without native data, waiting then running requests.
	tab, inf = rankTable(t, true, loadmon.Report{WaitingRequests: 2, RunningRequests: 1},
		loadmon.Report{WaitingRequests: 1, RunningRequests: 9}, loadmon.Report{WaitingRequests: 1, RunningRequests: 4})
	o = loadmon.ObserveLeastPressured(tab.Snapshot(), inf, state.StagePlain, "e")
	assert.Equal(t, 2, o.DPRank)
}

// Ranks are compared on the best basis every rank has: one rank without native figures makes
// them all compare on reported requests, and decode reads basic ranks' KV usage too.
func TestObserveLeastPressuredComparesOnTheRanksBasis(t *testing.T) {
	t.Parallel()
	// Rank 0 has the fewest waiting uncached tokens but more waiting requests; rank 1 then reports
	// without the native extension.
	tab, inf := rankTable(t, false,
		loadmon.Report{WaitingRequests: 3, Native: &loadmon.NativeLoad{MaxRunningRequests: 8, WaitingUncachedTokens: 10}},
		loadmon.Report{},
		loadmon.Report{WaitingRequests: 2, Native: &loadmon.NativeLoad{MaxRunningRequests: 8, WaitingUncachedTokens: 9000}})
	require.NoError(t, tab.Report(loadmon.Report{Engine: "e", DPRank: 1, WaitingRequests: 1, KVCapacityTokens: 1000}))
	o := loadmon.ObserveLeastPressured(tab.Snapshot(), inf, state.StagePrefill, "e")
	assert.Equal(t, 1, o.DPRank, "reported requests: rank 1's single waiting request")
	assert.Equal(t, loadmon.BasisReported, o.Basis())

	tab, inf = rankTable(t, true,
		loadmon.Report{UsedKVTokens: 600, KVCapacityTokens: 1000},
		loadmon.Report{UsedKVTokens: 700, KVCapacityTokens: 2000})
	o = loadmon.ObserveLeastPressured(tab.Snapshot(), inf, state.StageDecode, "e")
	assert.Equal(t, 1, o.DPRank, "decode, basic ranks: KV usage 35 % against 60 %")
}

// A burst between two reports spreads over the ranks: dispatches that named a rank count on it.
func TestObserveLeastPressuredCountsRankDispatches(t *testing.T) {
	t.Parallel()
	tab, inf := rankTable(t, true, loadmon.Report{}, loadmon.Report{}, loadmon.Report{})
	var got []int
	for range 6 {
		o := loadmon.ObserveLeastPressured(tab.Snapshot(), inf, state.StagePlain, "e")
		require.True(t, o.HasDPRank)
		got = append(got, o.DPRank)
		inf.Acquire("e", o.DPRank, 100)
	}
	assert.Equal(t, []int{0, 1, 2, 0, 1, 2}, got)
	assert.Equal(t, uint64(6), inf.Count("e"))
	assert.Equal(t, uint64(2), inf.CountRank("e", 1))
	n, tok := inf.DispatchedSince("e", 1, time.Unix(1000, 0))
	assert.Equal(t, uint64(2), n)
	assert.Equal(t, uint64(200), tok)
}

// No rank is named for an engine of one rank, an unknown load, or an incomplete one.
func TestObserveNamesNoRankWhenNothingIsKnown(t *testing.T) {
	t.Parallel()
	one, inf := rankTable(t, false, loadmon.Report{})
	o := loadmon.ObserveLeastPressured(one.Snapshot(), inf, state.StagePlain, "e")
	assert.False(t, o.HasDPRank)
	assert.Nil(t, o.RankLoad)
	o = loadmon.ObserveRank(one.Snapshot(), inf, "e", 0)
	assert.False(t, o.HasDPRank, "one rank: the engine places the request itself")

	tab := loadmon.NewTable()
	require.NoError(t, tab.Expect("e", 2))
	require.NoError(t, tab.Report(loadmon.Report{Engine: "e", DPRank: 0}))
	o = loadmon.ObserveLeastPressured(tab.Snapshot(), inf, state.StagePlain, "e")
	assert.False(t, o.HasDPRank, "rank 1 never reported: the engine's load is unknown")
	assert.Nil(t, o.Figures())
	o = loadmon.ObserveLeastPressured(tab.Snapshot(), inf, state.StagePlain, "unknown")
	assert.False(t, o.HasDPRank)
}

// ObserveRank names the given rank, with that rank's dispatches since its own report.
func TestObserveRank(t *testing.T) {
	t.Parallel()
	tab, inf := rankTable(t, false, loadmon.Report{WaitingRequests: 9}, loadmon.Report{WaitingRequests: 2})
	inf.Acquire("e", 0, 10)
	inf.Acquire("e", 0, 10)
	inf.Acquire("e", 1, 10)
	inf.Acquire("e", -1, 10) // named no rank: counted for the engine only
	o := loadmon.ObserveRank(tab.Snapshot(), inf, "e", 0)
	require.True(t, o.HasDPRank)
	assert.Equal(t, 0, o.DPRank)
	assert.Equal(t, uint64(2), o.Dispatched)
	assert.Equal(t, uint64(20), o.DispatchedTokens)
	assert.Equal(t, uint64(2), o.RankInFlight)
	assert.Equal(t, uint64(4), o.InFlight)
	w, _ := o.WaitingRequests()
	assert.Equal(t, uint64(11), w)
	assert.False(t, loadmon.ObserveRank(tab.Snapshot(), inf, "e", 2).HasDPRank, "out of range")
}

// Rank guards release both counters once; Remove drops the ranks' counters too.
func TestRankGuards(t *testing.T) {
	t.Parallel()
	inf := loadmon.NewInFlight(nil)
	g := inf.Acquire("e", 3, 0)
	assert.Equal(t, uint64(1), inf.CountRank("e", 3))
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(g.Release)
	}
	wg.Wait()
	assert.Zero(t, inf.CountRank("e", 3))
	assert.Zero(t, inf.Count("e"))
	g = inf.Acquire("e", 3, 0)
	inf.Remove("e")
	assert.Zero(t, inf.CountRank("e", 3), "removed")
	g.Release()
	assert.Zero(t, inf.CountRank("e", 3), "a guard from before the removal never drives the new counter negative")
	assert.Zero(t, inf.Count("e"))
	neg := inf.Acquire("e", -1, 0)
	assert.Equal(t, uint64(1), inf.Count("e"), "a negative rank counts on the engine only")
	neg.Release()
}
