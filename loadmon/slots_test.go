package loadmon_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/loadmon"
)

// An engine's running slots (EngineLoad.RunningSlots, docs/design.md §6 "Running slots"): a
// native rank's MaxRunningRequests; a basic rank's running count from a report with at least as
// many waiting requests as its 2 or more running ones, kept while the next reports still have
// requests waiting at that running count; the sum when every rank shows them, else 0.
func TestRunningSlots(t *testing.T) {
	t.Parallel()
	type counts struct{ running, waiting uint64 }
	cases := []struct {
		name    string
		reports []counts // one rank's reports, in order
		want    []uint64 // RunningSlots after each
	}{
		{"a full round waiting shows the slots", []counts{{0, 0}, {4, 12}}, []uint64{0, 4}},
		{"fewer waiting than running shows nothing", []counts{{4, 3}, {8, 7}}, []uint64{0, 0}},
		{"kept while requests wait at the same running count", []counts{{4, 4}, {4, 3}, {4, 1}, {4, 0}, {4, 3}}, []uint64{4, 4, 4, 0, 0}},
		{"a new running count ends them", []counts{{4, 8}, {3, 2}, {5, 2}}, []uint64{4, 0, 0}},
		{"a new full round shows the new count", []counts{{4, 8}, {6, 6}}, []uint64{4, 6}},
		{"one running request is no evidence", []counts{{1, 5}, {1, 5}}, []uint64{0, 0}},
		{"two are", []counts{{2, 2}}, []uint64{2}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tab := loadmon.NewTable()
			for i, c := range tc.reports {
				require.NoError(t, tab.Report(loadmon.Report{Engine: "e", RunningRequests: c.running, WaitingRequests: c.waiting}))
				l, ok := tab.Snapshot().Load("e")
				require.True(t, ok)
				assert.Equal(t, tc.want[i], l.RunningSlots, "after report %d %+v", i, c)
			}
		})
	}
}

func TestRunningSlotsOfNativeAndSeveralRanks(t *testing.T) {
	t.Parallel()
	tab := loadmon.NewTable()
	require.NoError(t, tab.Expect("e", 2))
	require.NoError(t, tab.Report(loadmon.Report{Engine: "e", DPRank: 0, RunningRequests: 1, KVCapacityTokens: 1 << 20,
		Native: &loadmon.NativeLoad{MaxRunningRequests: 256}}))
	require.NoError(t, tab.Report(loadmon.Report{Engine: "e", DPRank: 1, RunningRequests: 4, WaitingRequests: 1}))
	l, ok := tab.Snapshot().Load("e")
	require.True(t, ok)
	assert.Equal(t, uint64(0), l.RunningSlots, "rank 1 shows none: the engine's are unknown")
	assert.Equal(t, uint64(256), l.RankLoads[0].RunningSlots, "a native rank's cap, whatever its queue")
	assert.Equal(t, uint64(0), l.RankLoads[1].RunningSlots)

	require.NoError(t, tab.Report(loadmon.Report{Engine: "e", DPRank: 1, RunningRequests: 4, WaitingRequests: 4}))
	l, ok = tab.Snapshot().Load("e")
	require.True(t, ok)
	assert.Equal(t, uint64(260), l.RunningSlots)
	assert.Equal(t, uint64(4), l.RankLoads[1].RunningSlots)
	assert.False(t, l.Native)
}
