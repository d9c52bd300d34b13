package enginepick_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

// A pick that names a DP rank is counted on that rank, so that the next pick sees it
// (docs/design.md §6): a burst spreads over the ranks of an engine between two load reports.
func TestRouterCountsDispatchesOnTheNamedRank(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	for _, id := range []state.EngineID{"a", "b"} {
		require.NoError(t, f.load.Expect(id, 2))
		for r := range 2 {
			require.NoError(t, f.load.Report(loadmon.Report{Engine: id, DPRank: r}))
		}
	}
	d1, err := f.router.Select(context.Background(), &bucket.Request{Model: "plain"})
	require.NoError(t, err)
	require.True(t, d1.Selection.Plain.HasDPRank)
	e, r := d1.Selection.Plain.Engine.ID(), d1.Selection.Plain.DPRank
	rankInFlight := func() uint64 { return loadmon.ObserveRank(f.load.Snapshot(), f.inflight, e, r).RankInFlight }
	assert.Equal(t, uint64(1), rankInFlight())
	d2, err := f.router.Select(context.Background(), &bucket.Request{Model: "plain"})
	require.NoError(t, err)
	assert.NotEqual(t, e, d2.Selection.Plain.Engine.ID(), "fewer in flight")
	assert.Equal(t, 0, d2.Selection.Plain.DPRank)
	// Each engine has one request in flight, on rank 0: the third goes to rank 1 of either.
	d3, err := f.router.Select(context.Background(), &bucket.Request{Model: "plain"})
	require.NoError(t, err)
	require.True(t, d3.Selection.Plain.HasDPRank)
	assert.Equal(t, 1, d3.Selection.Plain.DPRank, "the rank just dispatched to is no longer the least pressured")
	for _, d := range []*enginepick.Dispatch{d1, d2, d3} {
		d.Release()
	}
	assert.Zero(t, rankInFlight())
}

// Per-leg release: the prefill guard ends with the prefill leg while the decode stream goes on.
func TestDispatchReleaseStage(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	d, err := f.router.Select(context.Background(), &bucket.Request{Model: "pd"})
	require.NoError(t, err)
	pID, dID := d.Selection.Prefill.Engine.ID(), d.Selection.Decode.Engine.ID()
	d.ReleaseStage(state.StagePrefill)
	d.ReleaseStage(state.StagePrefill)
	assert.Zero(t, f.inflight.Count(pID), "the prefill leg ended")
	assert.Equal(t, uint64(1), f.inflight.Count(dID), "the decode leg goes on")
	d.ReleaseStage(state.StagePlain) // not a leg of a PD dispatch
	assert.Equal(t, uint64(1), f.inflight.Count(dID))
	d.Release()
	assert.Zero(t, f.inflight.Count(dID))
	assert.Zero(t, f.inflight.Count(pID), "released once: never negative")

	d, err = f.router.Select(context.Background(), &bucket.Request{Model: "pd"})
	require.NoError(t, err)
	d.ReleaseStage(state.StageDecode)
	assert.Zero(t, f.inflight.Count(d.Selection.Decode.Engine.ID()))
	assert.Equal(t, uint64(1), f.inflight.Count(d.Selection.Prefill.Engine.ID()))
	d.Release()

	plain, err := f.router.Select(context.Background(), &bucket.Request{Model: "plain"})
	require.NoError(t, err)
	plain.ReleaseStage(state.StagePrefill)
	plain.ReleaseStage(state.StagePlain)
	assert.Equal(t, uint64(1), f.inflight.Count(plain.Selection.Plain.Engine.ID()), "a plain dispatch ends with Release or Done")
	plain.Release()
}
