package loadmon_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

// adapterObs is a fresh observation for adapter on an engine with the given load and LoRA
// residency (nil: unknown).
func adapterObs(adapter string, l loadmon.EngineLoad, residency *loadmon.LoRALoad, inflight uint64) loadmon.Observation {
	l.LoRA = residency
	return loadmon.Observation{Load: &l, InFlight: inflight, Adapter: adapter}
}

func resident(maxAdapters int, running, waiting []string) *loadmon.LoRALoad {
	return &loadmon.LoRALoad{MaxAdapters: maxAdapters, Running: running, Waiting: waiting}
}

// TestComparePressureAdapter: for a request for a LoRA adapter, engines equal on the waiting keys
// are ordered by their residency of the adapter (running, free slot, waiting, full) before
// running requests and in-flight; the waiting keys still come first; unknown residency, a base
// request and the in-flight basis ignore it.
func TestComparePressureAdapter(t *testing.T) {
	t.Parallel()
	plain, decode := state.StagePlain, state.StageDecode
	idle := loadmon.EngineLoad{}
	busy := loadmon.EngineLoad{RunningRequests: 9}
	queued := loadmon.EngineLoad{WaitingRequests: 1}
	running := resident(2, []string{"A"}, nil)
	free := resident(2, []string{"B"}, nil)
	waiting := resident(2, []string{"B"}, []string{"A"})
	full := resident(2, []string{"B", "C"}, nil)
	tests := []struct {
		name  string
		stage state.Stage
		a, b  loadmon.Observation
		basis loadmon.Basis
		want  int
	}{
		{"running beats a free slot despite more running requests", plain,
			adapterObs("A", busy, running, 5), adapterObs("A", idle, free, 0), loadmon.BasisReported, -1},
		{"a free slot beats waiting", plain,
			adapterObs("A", busy, free, 0), adapterObs("A", idle, waiting, 0), loadmon.BasisReported, -1},
		{"waiting beats full", plain,
			adapterObs("A", busy, waiting, 0), adapterObs("A", idle, full, 0), loadmon.BasisReported, -1},
		{"full loses to a free slot", plain,
			adapterObs("A", idle, full, 0), adapterObs("A", busy, free, 0), loadmon.BasisReported, 1},
		{"a queue is not comparable: the resident adapter on a queued engine loses", plain,
			adapterObs("A", queued, running, 0), adapterObs("A", busy, full, 0), loadmon.BasisReported, 1},
		{"the same class goes on to running requests", plain,
			adapterObs("A", busy, running, 0), adapterObs("A", idle, resident(3, []string{"A", "B"}, nil), 0), loadmon.BasisReported, 1},
		{"decode: after waiting, before running", decode,
			adapterObs("A", busy, running, 0), adapterObs("A", idle, full, 0), loadmon.BasisReported, -1},
		{"unknown residency is neutral", plain,
			adapterObs("A", busy, nil, 0), adapterObs("A", idle, full, 0), loadmon.BasisReported, 1},
		{"unknown slots and the adapter absent are neutral", plain,
			adapterObs("A", busy, resident(0, []string{"B"}, nil), 0), adapterObs("A", idle, running, 0), loadmon.BasisReported, 1},
		{"a base-model request ignores residency", plain,
			adapterObs("", busy, running, 0), adapterObs("", idle, full, 0), loadmon.BasisReported, 1},
		{"the in-flight basis ignores residency", plain,
			adapterObs("A", busy, running, 3), adapterObs("A", idle, full, 1), loadmon.BasisInFlight, 1},
		{"native: after the waiting uncached tokens", plain,
			func() loadmon.Observation {
				o := nat(loadmon.EngineLoad{RunningRequests: 9}, 0)
				o.Load.LoRA, o.Adapter = running, "A"
				return o
			}(),
			func() loadmon.Observation {
				o := nat(loadmon.EngineLoad{}, 0)
				o.Load.LoRA, o.Adapter = full, "A"
				return o
			}(), loadmon.BasisNative, -1},
		{"native: pending uncached tokens come first", plain,
			func() loadmon.Observation {
				o := nat(loadmon.EngineLoad{WaitingUncachedTokens: 1}, 0)
				o.Load.LoRA, o.Adapter = running, "A"
				return o
			}(),
			func() loadmon.Observation {
				o := nat(loadmon.EngineLoad{}, 0)
				o.Load.LoRA, o.Adapter = full, "A"
				return o
			}(), loadmon.BasisNative, 1},
	}
	for _, tc := range tests {
		assert.Equal(t, tc.want, loadmon.ComparePressure(tc.stage, &tc.a, &tc.b, tc.basis), "%s: a vs b", tc.name)
		assert.Equal(t, -tc.want, loadmon.ComparePressure(tc.stage, &tc.b, &tc.a, tc.basis), "%s: b vs a", tc.name)
	}
}

// TestTableLoRAResidency: the table keeps its own copy of each rank's residency, publishes the
// engine's as the union over ranks with the fewest slots, only when every rank reports one, and
// forgets it with the load when the reports go stale.
func TestTableLoRAResidency(t *testing.T) {
	t.Parallel()
	now := time.Unix(1000, 0)
	tab := loadmon.NewTable(loadmon.WithClock(func() time.Time { return now }))
	require.NoError(t, tab.Expect("e", 2))
	running := []string{"b", "a"}
	require.NoError(t, tab.ReportBatch([]loadmon.Report{
		{Engine: "e", DPRank: 0, LoRA: &loadmon.LoRALoad{MaxAdapters: 4, Running: running, Waiting: []string{"c"}}},
		{Engine: "e", DPRank: 1},
	}))
	l, ok := tab.Snapshot().Load("e")
	require.True(t, ok)
	assert.Nil(t, l.LoRA, "rank 1 reports no residency: unknown")

	require.NoError(t, tab.Report(loadmon.Report{Engine: "e", DPRank: 1, LoRA: &loadmon.LoRALoad{MaxAdapters: 2, Running: []string{"a", "d"}}}))
	running[0] = "changed" // the table kept its own copy
	l, ok = tab.Snapshot().Load("e")
	require.True(t, ok)
	assert.Equal(t, &loadmon.LoRALoad{MaxAdapters: 2, Running: []string{"a", "b", "d"}, Waiting: []string{"c"}}, l.LoRA)
	r0, ok := l.Rank(0)
	require.True(t, ok)
	assert.Equal(t, &loadmon.LoRALoad{MaxAdapters: 4, Running: []string{"b", "a"}, Waiting: []string{"c"}}, r0.LoRA, "a rank keeps its own")

	now = now.Add(loadmon.DefaultFreshness + time.Second)
	_, ok = tab.Snapshot().Load("e")
	assert.False(t, ok, "stale: load and residency unknown")
}

func TestTableRefusesBadLoRA(t *testing.T) {
	t.Parallel()
	tab := loadmon.NewTable()
	for _, l := range []*loadmon.LoRALoad{
		{MaxAdapters: -1},
		{MaxAdapters: 2, Running: []string{""}},
		{MaxAdapters: 2, Waiting: []string{"a", ""}},
	} {
		err := tab.Report(loadmon.Report{Engine: "e", LoRA: l})
		assert.ErrorIs(t, err, loadmon.ErrInvalidReport, "%+v", l)
	}
	assert.Zero(t, tab.Snapshot().Version(), "nothing recorded")
}
