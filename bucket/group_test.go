package bucket_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg.rs` groups_isolate_model_health_stage_and_membership.
func TestGroupsIsolateModelHealthStageAndMembership(t *testing.T) {
	t.Parallel()
	t.Run("versioned registry", func(t *testing.T) { testGroupsIsolate(t, func(r *state.StaticRegistry) state.Registry { return r }) })
	t.Run("plain registry", func(t *testing.T) {
		testGroupsIsolate(t, func(r *state.StaticRegistry) state.Registry { return unversioned{r} })
	})
}

// unversioned hides StaticRegistry's EnginesVersion, so groups filter on every pick.
type unversioned struct{ r *state.StaticRegistry }

func (u unversioned) Engines(m state.ModelID) []state.Engine { return u.r.Engines(m) }

func testGroupsIsolate(t *testing.T, wrap func(*state.StaticRegistry) state.Registry) {
	b := eng("b", state.StagePlain)
	a := eng("a", state.StagePlain)
	broken := eng("0-broken", state.StagePlain)
	broken.SetHealthy(false)
	other := state.NewStaticEngine("00-other-model", "other", state.StagePlain)
	p := eng("p", state.StagePrefill)
	d := eng("d", state.StageDecode)
	static := registry(b, a, broken, other, p, d)
	reg := wrap(static)

	fp := first()
	catchAll := allGroup(fp)
	req := &policy.Request{Model: "m", Stage: state.StagePlain}
	pk, err := catchAll.Pick(ctx, reg, req)
	require.NoError(t, err)
	assert.Same(t, a, pk.Engine, "healthy same-model plain engines in ID order: a first")
	assert.Equal(t, []state.EngineID{"a", "b"}, fp.seen[0], "breaker-open, other-model and PD engines never appear")

	a.SetHealthy(false)
	pk, err = catchAll.Pick(ctx, reg, req)
	require.NoError(t, err)
	assert.Same(t, b, pk.Engine, "a health change is seen on the next pick")
	a.SetHealthy(true)
	static.Remove("a")
	pk, err = catchAll.Pick(ctx, reg, req)
	require.NoError(t, err)
	assert.Same(t, b, pk.Engine)
	static.Remove("b")
	_, err = catchAll.Pick(ctx, reg, req)
	assert.ErrorIs(t, err, policy.ErrNoCandidates)
	assert.Equal(t, 3, fp.Calls(), "no candidates: the policy is not called")

	cross := first()
	spanning := group(cross, "p", "d", "b")
	pk, err = spanning.Pick(ctx, reg, &policy.Request{Model: "m", Stage: state.StagePrefill})
	require.NoError(t, err)
	assert.Same(t, p, pk.Engine, "a membership spanning roles returns only the stage's role")
	pk, err = spanning.Pick(ctx, reg, &policy.Request{Model: "m", Stage: state.StageDecode})
	require.NoError(t, err)
	assert.Same(t, d, pk.Engine)
	assert.Equal(t, [][]state.EngineID{{"p"}, {"d"}}, cross.seen)

	none := first()
	empty, err := bucket.NewEngineGroup(none, []state.EngineID{}) // explicit empty, non-nil membership
	require.NoError(t, err)
	_, err = empty.Pick(ctx, reg, &policy.Request{Model: "m", Stage: state.StagePrefill})
	assert.ErrorIs(t, err, policy.ErrNoCandidates)
	assert.Zero(t, none.Calls())

	_, err = catchAll.Pick(ctx, nil, req)
	assert.ErrorIs(t, err, policy.ErrInvalidConfiguration, "nil registry")
}

func TestGroupSortsCandidatesByIDWithoutTouchingTheRegistry(t *testing.T) {
	t.Parallel()
	reg := registry(eng("c", state.StagePlain), eng("a", state.StagePlain), eng("b", state.StagePlain))
	fp := first()
	_, err := allGroup(fp).Pick(ctx, reg, &policy.Request{Model: "m"})
	require.NoError(t, err)
	assert.Equal(t, []state.EngineID{"a", "b", "c"}, fp.seen[0])
	var order []state.EngineID
	for _, e := range reg.Engines("m") {
		order = append(order, e.ID())
	}
	assert.Equal(t, []state.EngineID{"c", "a", "b"}, order, "the registry's slice is never reordered")
}

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg.rs` group_propagates_rejections_misses_and_invalid_signals.
func TestGroupPropagatesRejectionsMissesAndInvalidSignals(t *testing.T) {
	t.Parallel()
	a := eng("a", state.StagePlain)
	reg := registry(a)
	rej := &policy.AdmissionRejectedError{Engine: a, Limit: "full"}
	for _, want := range []error{rej, policy.ErrNoCandidates, policy.ErrInvalidSignal} {
		_, err := allGroup(failing(want)).Pick(ctx, reg, &policy.Request{Model: "m"})
		assert.Same(t, want, err, "the policy's error is returned unchanged")
	}
}

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg.rs` group_rejects_foreign_pick_even_with_same_worker_id.
func TestGroupRejectsForeignPickEvenWithSameID(t *testing.T) {
	t.Parallel()
	reg := registry(eng("a", state.StagePlain))
	impostor := &fakePolicy{choose: func([]state.Engine, *policy.Request) (policy.Pick, error) {
		return policy.Pick{Engine: eng("a", state.StagePlain), Reason: "impostor"}, nil
	}}
	_, err := allGroup(impostor).Pick(ctx, reg, &policy.Request{Model: "m"})
	var oc *policy.OutsideCandidatesError
	require.ErrorAs(t, err, &oc)
	assert.Equal(t, state.EngineID("a"), oc.Engine)

	nilPick := &fakePolicy{choose: func([]state.Engine, *policy.Request) (policy.Pick, error) { return policy.Pick{}, nil }}
	_, err = allGroup(nilPick).Pick(ctx, reg, &policy.Request{Model: "m"})
	assert.ErrorIs(t, err, policy.ErrOutsideCandidates, "a pick with no engine is outside the candidates")
}

func TestNewEngineGroupRejectsBadInput(t *testing.T) {
	t.Parallel()
	_, err := bucket.NewEngineGroup(nil, nil)
	assert.ErrorIs(t, err, policy.ErrInvalidConfiguration, "nil policy")
	_, err = bucket.NewEngineGroup(first(), []state.EngineID{"a", ""})
	assert.ErrorIs(t, err, policy.ErrInvalidConfiguration, "empty member ID")
}

func TestGroupCacheFollowsRegistryIdentity(t *testing.T) {
	t.Parallel()
	fp := first()
	g := allGroup(fp)
	r1 := registry(eng("x", state.StagePlain))
	r2 := registry(eng("y", state.StagePlain)) // same version number as r1
	for _, tc := range []struct {
		reg  state.Registry
		want state.EngineID
	}{{r1, "x"}, {r2, "y"}, {r1, "x"}} {
		pk, err := g.Pick(ctx, tc.reg, &policy.Request{Model: "m"})
		require.NoError(t, err)
		assert.Equal(t, tc.want, pk.Engine.ID())
	}
}

// Picks race registry changes and health flips; every pick must be a current candidate value.
func TestGroupPicksRaceRegistryChanges(t *testing.T) {
	t.Parallel()
	reg := &state.StaticRegistry{}
	stable := eng("stable", state.StagePlain)
	require.NoError(t, reg.Add(stable))
	g := allGroup(&fakePolicy{choose: func(es []state.Engine, _ *policy.Request) (policy.Pick, error) {
		return policy.Pick{Engine: es[len(es)-1], Reason: "last"}, nil
	}})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range 500 {
			e := eng(state.EngineID(fmt.Sprintf("e%03d", i)), state.StagePlain)
			_ = reg.Add(e)
			e.SetHealthy(i%2 == 0)
			stable.SetHealthy(i%3 != 0)
			if i%2 == 1 {
				reg.Remove(e.ID())
			}
		}
	}()
	for {
		select {
		case <-done:
			return
		default:
		}
		pk, err := g.Pick(ctx, reg, &policy.Request{Model: "m"})
		if err != nil {
			require.ErrorIs(t, err, policy.ErrNoCandidates)
			continue
		}
		require.NotNil(t, pk.Engine)
	}
}

// hostPicker is a GroupPicker that is not an *EngineGroup.
type hostPicker struct{}

func (hostPicker) Pick(context.Context, state.Registry, *policy.Request) (policy.Pick, error) {
	return policy.Pick{}, policy.ErrNoCandidates
}

func TestBucketEngines(t *testing.T) {
	t.Parallel()
	down := eng("down", state.StagePlain)
	down.SetHealthy(false)
	reg := registry(eng("c", state.StagePlain), eng("a", state.StagePlain), eng("b", state.StagePlain), down,
		state.NewStaticEngine("other-model", "n", state.StagePlain),
		eng("p2", state.StagePrefill), eng("p1", state.StagePrefill), eng("d1", state.StageDecode))
	listed := plainBucket(bucket.Spec{ID: "listed"}, group(first(), "c", "a", "missing", "down"))
	all := plainBucket(bucket.Spec{ID: "all"}, allGroup(first()))
	none := plainBucket(bucket.Spec{ID: "none"}, group(first(), []state.EngineID{}...))
	host := plainBucket(bucket.Spec{ID: "host"}, hostPicker{})
	pd := pdBucket(bucket.Spec{ID: "pd"}, allGroup(first()), allGroup(first()))
	engineIDs := func(es []state.Engine) []state.EngineID {
		out := []state.EngineID{}
		for _, e := range es {
			out = append(out, e.ID())
		}
		return out
	}
	for _, tc := range []struct {
		b     *bucket.Bucket
		stage state.Stage
		reg   state.Registry
		want  []state.EngineID
	}{
		{listed, state.StagePlain, reg, []state.EngineID{"a", "c"}},
		{all, state.StagePlain, reg, []state.EngineID{"a", "b", "c"}},
		{none, state.StagePlain, reg, []state.EngineID{}},
		{host, state.StagePlain, reg, []state.EngineID{"a", "b", "c"}},
		{pd, state.StagePrefill, reg, []state.EngineID{"p1", "p2"}},
		{pd, state.StageDecode, reg, []state.EngineID{"d1"}},
		{pd, state.StagePlain, reg, []state.EngineID{}},
		{all, state.StageDecode, reg, []state.EngineID{}},
		{all, state.StagePlain, nil, []state.EngineID{}},
	} {
		assert.Equal(t, tc.want, engineIDs(tc.b.Engines(tc.reg, "m", tc.stage, nil)), "%s %s", tc.b.ID(), tc.stage)
	}
	assert.Len(t, all.Engines(reg, "m", state.StagePlain, make([]state.Engine, 1, 8)), 4, "appends to dst")
}
