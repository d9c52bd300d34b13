package enginepick_test

import (
	"context"
	"net/http"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

type fixture struct {
	index    *kvindex.Index
	reg      *state.StaticRegistry
	load     *loadmon.Table
	inflight *loadmon.InFlight
	router   *enginepick.Router
}

// newFixture: model "plain" has two plain engines; model "pd" has one PD bucket with two prefill
// and two decode engines; every group runs power-of-two with an in-flight cap of 2.
func newFixture(t *testing.T) *fixture {
	t.Helper()
	f := &fixture{reg: &state.StaticRegistry{}, load: loadmon.NewTable(), inflight: loadmon.NewInFlight(nil)}
	h, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: 16})
	require.NoError(t, err)
	f.index, err = kvindex.NewIndex(h, kvindex.Options{})
	require.NoError(t, err)
	for _, e := range []*state.StaticEngine{
		state.NewStaticEngine("a", "plain", state.StagePlain),
		state.NewStaticEngine("b", "plain", state.StagePlain),
		state.NewStaticEngine("p1", "pd", state.StagePrefill),
		state.NewStaticEngine("p2", "pd", state.StagePrefill),
		state.NewStaticEngine("d1", "pd", state.StageDecode),
		state.NewStaticEngine("d2", "pd", state.StageDecode),
	} {
		require.NoError(t, f.reg.Add(e))
	}
	cfg := policy.Config{Load: f.load, InFlight: f.inflight, Admission: admission.Limits{MaxInFlightRequests: admission.Cap(2)}}
	p2, err := policy.NewPowerOfN(cfg, 2)
	require.NoError(t, err)
	g, err := bucket.NewEngineGroup(p2, nil)
	require.NoError(t, err)
	plainB, err := bucket.NewPlainBucket(bucket.Spec{ID: "all"}, g)
	require.NoError(t, err)
	pdB, err := bucket.NewPDBucket(bucket.Spec{ID: "pd"}, g, g)
	require.NoError(t, err)
	rp, err := bucket.NewResolver([]*bucket.Bucket{plainB}, bucket.ResolverOptions{})
	require.NoError(t, err)
	rd, err := bucket.NewResolver([]*bucket.Bucket{pdB}, bucket.ResolverOptions{})
	require.NoError(t, err)
	f.router, err = enginepick.NewRouter(enginepick.Options{
		Registry: f.reg, InFlight: f.inflight, Load: f.load, Index: f.index,
		Resolvers: map[state.ModelID]*bucket.Resolver{"plain": rp, "pd": rd},
	})
	require.NoError(t, err)
	return f
}

func TestRouterUnknownModelIs404WithoutFallback(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	_, err := f.router.Select(context.Background(), &bucket.Request{Model: "nope"})
	assert.ErrorIs(t, err, enginepick.ErrUnknownModel)
	assert.Equal(t, http.StatusNotFound, bucket.StatusCode(err))
}

func TestRouterDispatchGuardsExactlyTheSelectedEngines(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	d, err := f.router.Select(context.Background(), &bucket.Request{Model: "pd"})
	require.NoError(t, err)
	require.True(t, d.Selection.IsPD())
	pID, dID := d.Selection.Prefill.Engine.ID(), d.Selection.Decode.Engine.ID()
	for _, id := range []state.EngineID{"a", "b", "p1", "p2", "d1", "d2"} {
		want := uint64(0)
		if id == pID || id == dID {
			want = 1
		}
		assert.Equal(t, want, f.inflight.Count(id), "in-flight of %s", id)
	}
	d.Release()
	d.Release()
	for _, id := range []state.EngineID{pID, dID} {
		assert.Zero(t, f.inflight.Count(id), "released once, idempotently")
	}

	d, err = f.router.Select(context.Background(), &bucket.Request{Model: "plain"})
	require.NoError(t, err)
	assert.False(t, d.Selection.IsPD())
	assert.Equal(t, uint64(1), f.inflight.Count(d.Selection.Plain.Engine.ID()))
	d.Release()
}

func TestRouterExhaustionAcquiresNothingAndReports503(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	var held []*enginepick.Dispatch
	for range 4 { // in-flight cap 2 on each of a and b
		d, err := f.router.Select(context.Background(), &bucket.Request{Model: "plain"})
		require.NoError(t, err)
		held = append(held, d)
	}
	_, err := f.router.Select(context.Background(), &bucket.Request{Model: "plain"})
	var ex *bucket.ExhaustedError
	require.ErrorAs(t, err, &ex)
	require.Len(t, ex.Rejections, 1)
	assert.Equal(t, admission.LimitInFlightRequests, ex.Rejections[0].Limit)
	assert.Equal(t, http.StatusServiceUnavailable, bucket.StatusCode(err))
	assert.Equal(t, uint64(2), f.inflight.Count("a"))
	assert.Equal(t, uint64(2), f.inflight.Count("b"))
	for _, d := range held {
		d.Release()
	}
}

func TestRouterRemoveEngineIsSafeWithRequestsInFlight(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	d, err := f.router.Select(context.Background(), &bucket.Request{Model: "plain"})
	require.NoError(t, err)
	id := d.Selection.Plain.Engine.ID()
	require.NoError(t, f.load.Report(loadmon.Report{Engine: id, RunningRequests: 3}))
	require.NoError(t, f.index.Store(kvindex.StoreEvent{Engine: id, BlockHashes: []uint64{1}, TokenIDs: make([]uint32, 16), Tier: kvindex.TierDevice}))
	f.router.RemoveEngine(id)
	_, ok := f.load.Snapshot().Load(id)
	assert.False(t, ok, "the removed engine's reports are forgotten")
	assert.Empty(t, f.index.Match(f.index.Hasher().Keys(make([]uint32, 16))).Engines, "and its blocks dropped from the index")
	f.router.RemoveEngine("never-seen") // no-op
	assert.Zero(t, f.inflight.Count(id))
	d.Release()
	assert.Zero(t, f.inflight.Count(id), "a late release never drives the re-added counter negative")
}

func TestRouterConcurrentSelectAndRelease(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 200 {
				d, err := f.router.Select(context.Background(), &bucket.Request{Model: "pd"})
				if err != nil {
					continue // exhaustion under contention is allowed
				}
				d.Release()
			}
		})
	}
	wg.Go(func() {
		for range 200 {
			f.router.RemoveEngine("p1")
			_ = f.load.Report(loadmon.Report{Engine: "d1", WaitingRequests: 1})
		}
	})
	wg.Wait()
	for _, id := range []state.EngineID{"p1", "p2", "d1", "d2"} {
		assert.Zero(t, f.inflight.Count(id))
	}
}

func TestNewRouterRejectsMissingPieces(t *testing.T) {
	t.Parallel()
	reg := &state.StaticRegistry{}
	in := loadmon.NewInFlight(nil)
	rs := map[state.ModelID]*bucket.Resolver{}
	for name, o := range map[string]enginepick.Options{
		"no registry":  {InFlight: in, Resolvers: rs},
		"no inflight":  {Registry: reg, Resolvers: rs},
		"no resolvers": {Registry: reg, InFlight: in},
		"nil resolver": {Registry: reg, InFlight: in, Resolvers: map[state.ModelID]*bucket.Resolver{"m": nil}},
	} {
		_, err := enginepick.NewRouter(o)
		assert.ErrorIs(t, err, policy.ErrInvalidConfiguration, name)
	}
}

func TestRouterNilInputs(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	_, err := f.router.Select(context.Background(), nil)
	assert.ErrorIs(t, err, policy.ErrInvalidSignal)
	//lint:ignore SA1012 a nil context is what this test checks
	d, err := f.router.Select(nil, &bucket.Request{Model: "plain"}) //nolint:staticcheck
	require.NoError(t, err, "a nil context means Background")
	d.Release()
	var none *enginepick.Dispatch
	none.Release() // no panic
}
