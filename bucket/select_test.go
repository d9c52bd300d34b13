package bucket_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/flowcontrol"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg.rs` selected_pd_bucket_owns_both_memberships_and_policies.
func TestSelectedPDBucketOwnsBothMembershipsAndPolicies(t *testing.T) {
	t.Parallel()
	p1, p2 := eng("p1", state.StagePrefill), eng("p2", state.StagePrefill)
	d1, d2 := eng("d1", state.StageDecode), eng("d2", state.StageDecode)
	reg := registry(p1, p2, d1, d2)
	pp, dp := first(), first()
	b := pdBucket(bucket.Spec{ID: "shared"}, group(pp, "p2", "d2"), group(dp, "d2", "p2"))
	sel, err := b.PickEngines(ctx, reg, &bucket.Request{Model: "m"})
	require.NoError(t, err)
	assert.True(t, sel.IsPD())
	assert.Same(t, p2, sel.Prefill.Engine)
	assert.Same(t, d2, sel.Decode.Engine)
	assert.Equal(t, []state.Engine{p2, d2}, sel.Engines())
	require.Equal(t, 1, pp.Calls())
	require.Equal(t, 1, dp.Calls())
	assert.Equal(t, "shared", pp.reqs[0].BucketID)
	assert.Equal(t, state.StagePrefill, pp.reqs[0].Stage)
	assert.Equal(t, "shared", dp.reqs[0].BucketID)
	assert.Equal(t, state.StageDecode, dp.reqs[0].Stage)
}

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg.rs` resolver_includes_empty_groups_without_invoking_policies.
func TestResolverIncludesEmptyGroupsWithoutInvokingPolicies(t *testing.T) {
	t.Parallel()
	reg := registry(eng("a", state.StagePlain))
	ghost := first()
	empty := plainBucket(bucket.Spec{ID: "empty", MaxInputTokens: 10}, group(ghost, "missing"))
	full := plainBucket(bucket.Spec{ID: "full"}, allGroup(first()))
	r, err := bucket.NewResolver([]*bucket.Bucket{full, empty}, bucket.ResolverOptions{})
	require.NoError(t, err)
	bs, err := r.Resolve(bucket.Signals{InputTokens: 5})
	require.NoError(t, err)
	assert.Equal(t, []string{"empty", "full"}, ids(bs), "a bucket whose members are missing still resolves, first")
	_, err = bs[0].PickEngines(ctx, reg, &bucket.Request{Model: "m"})
	assert.ErrorIs(t, err, policy.ErrNoCandidates)
	assert.Zero(t, ghost.Calls())

	sel, err := bucket.Select(ctx, r, reg, &bucket.Request{Model: "m", Signals: bucket.Signals{InputTokens: 5}})
	require.NoError(t, err)
	assert.Equal(t, "full", sel.Bucket.ID(), "the loop advances past the empty bucket")
}

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg.rs` bucket_scopes_plain_pick_and_preserves_request_facts.
func TestBucketScopesPlainPickAndPreservesRequestFacts(t *testing.T) {
	t.Parallel()
	a := eng("a", state.StagePlain)
	fp := first()
	b := plainBucket(bucket.Spec{ID: "plain-b"}, allGroup(fp))
	tokens := []uint32{7, 8}
	sel, err := b.PickEngines(ctx, registry(a), &bucket.Request{
		Model:    "m",
		Signals:  bucket.Signals{InputTokens: 2, ExpectedPeakTokens: 12, HasExpectedPeak: true},
		TokenIDs: tokens, SessionKey: "s", RoutingKey: "k",
	})
	require.NoError(t, err)
	assert.False(t, sel.IsPD())
	assert.Same(t, a, sel.Plain.Engine)
	assert.Nil(t, sel.Decode.Engine, "a plain pick has no decode")
	assert.Equal(t, []state.Engine{a}, sel.Engines())
	assert.Equal(t, policy.Request{
		Model: "m", Stage: state.StagePlain, BucketID: "plain-b", InputTokens: 2,
		ExpectedPeakTokens: 12, HasExpectedPeak: true, TokenIDs: tokens, SessionKey: "s", RoutingKey: "k",
	}, fp.reqs[0])

	_, err = b.PickEngines(ctx, registry(a), &bucket.Request{Model: "m", Signals: bucket.Signals{InputTokens: -1}})
	assert.ErrorIs(t, err, policy.ErrInvalidSignal)

	// Token IDs that disagree with InputTokens are rejected before any policy runs.
	calls := len(fp.reqs)
	for _, n := range []int64{1, 3} {
		_, err = b.PickEngines(ctx, registry(a), &bucket.Request{Model: "m", TokenIDs: tokens, Signals: bucket.Signals{InputTokens: n}})
		assert.ErrorIs(t, err, policy.ErrInvalidSignal, "input %d with %d token IDs", n, len(tokens))
	}
	assert.Len(t, fp.reqs, calls, "no policy saw the inconsistent request")
}

func pdFleet() (*state.StaticRegistry, map[string]*state.StaticEngine) {
	es := map[string]*state.StaticEngine{}
	var all []state.Engine
	for _, id := range []string{"p1", "p2"} {
		es[id] = eng(state.EngineID(id), state.StagePrefill)
		all = append(all, es[id])
	}
	for _, id := range []string{"d1", "d2"} {
		es[id] = eng(state.EngineID(id), state.StageDecode)
		all = append(all, es[id])
	}
	return registry(all...), es
}

// docs/design.md §3: a decode failure discards the tentative prefill pick; the next bucket
// re-picks both stages.
func TestDecodeFailureDiscardsPrefillAndNextBucketRepicksBoth(t *testing.T) {
	t.Parallel()
	for name, decodeErr := range map[string]error{
		"no candidates": nil, // decode group membership matches nothing
		"rejection":     errors.New("placeholder"),
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			reg, es := pdFleet()
			p1Policy, p2Policy, d2Policy := first(), first(), first()
			var decode1 *bucket.EngineGroup
			if decodeErr == nil {
				decode1, _ = bucket.NewEngineGroup(first(), []state.EngineID{})
			} else {
				decode1 = group(rejecting("max_running_requests"), "d1")
			}
			b1 := pdBucket(bucket.Spec{ID: "b1", MaxInputTokens: 100}, group(p1Policy, "p1"), decode1)
			b2 := pdBucket(bucket.Spec{ID: "b2"}, group(p2Policy, "p2"), group(d2Policy, "d2"))
			r, err := bucket.NewResolver([]*bucket.Bucket{b1, b2}, bucket.ResolverOptions{})
			require.NoError(t, err)
			sel, err := bucket.Select(ctx, r, reg, &bucket.Request{Model: "m", Signals: bucket.Signals{InputTokens: 10}})
			require.NoError(t, err)
			assert.Equal(t, "b2", sel.Bucket.ID())
			assert.Same(t, es["p2"], sel.Prefill.Engine, "the prefill pick of b1 is never reused")
			assert.Same(t, es["d2"], sel.Decode.Engine)
			assert.Equal(t, 1, p1Policy.Calls())
			assert.Equal(t, 1, p2Policy.Calls(), "the next bucket picks prefill again")
		})
	}
}

func TestStageErrorsKeepTheirStage(t *testing.T) {
	t.Parallel()
	reg, _ := pdFleet()
	b := pdBucket(bucket.Spec{ID: "x"}, allGroup(first()), allGroup(failing(policy.ErrNoCandidates)))
	_, err := b.PickEngines(ctx, reg, &bucket.Request{Model: "m"})
	var se *bucket.StageError
	require.ErrorAs(t, err, &se)
	assert.Equal(t, state.StageDecode, se.Stage)
	assert.Equal(t, "x", se.Bucket)
	assert.ErrorIs(t, err, policy.ErrNoCandidates)
}

// The exhaustion error (503) carries every rejection, engine and limit.
func TestExhaustionCarriesEveryRejection(t *testing.T) {
	t.Parallel()
	reg, es := pdFleet()
	b1 := pdBucket(bucket.Spec{ID: "b1", MaxInputTokens: 100}, group(rejecting("max_kv_tokens"), "p1"), allGroup(first()))
	b2 := pdBucket(bucket.Spec{ID: "b2", MaxInputTokens: 200}, group(first(), "p2"), group(rejecting("max_running_requests"), "d2"))
	b3, _ := bucket.NewPlainBucket(bucket.Spec{ID: "b3"}, allGroup(first())) // no plain engines
	r, err := bucket.NewResolver([]*bucket.Bucket{b1, b2, b3}, bucket.ResolverOptions{})
	require.NoError(t, err)
	_, err = bucket.Select(ctx, r, reg, &bucket.Request{Model: "m", Signals: bucket.Signals{InputTokens: 10}})
	var ex *bucket.ExhaustedError
	require.ErrorAs(t, err, &ex)
	require.Len(t, ex.Rejections, 2)
	assert.Same(t, es["p1"], ex.Rejections[0].Engine)
	assert.Equal(t, "max_kv_tokens", ex.Rejections[0].Limit)
	assert.Same(t, es["d2"], ex.Rejections[1].Engine)
	assert.Equal(t, "max_running_requests", ex.Rejections[1].Limit)
	assert.ErrorIs(t, ex.Last, policy.ErrNoCandidates, "the last bucket had no plain engines")
	assert.Equal(t, http.StatusServiceUnavailable, bucket.StatusCode(err))
	var rej *policy.AdmissionRejectedError
	assert.ErrorAs(t, err, &rej)
	assert.Contains(t, err.Error(), `"d2" (max_running_requests: 1 of cap 1)`)
}

func TestExhaustionWithoutRejectionsReportsTheLastUnavailableStage(t *testing.T) {
	t.Parallel()
	reg, _ := pdFleet()
	noDecode, _ := bucket.NewEngineGroup(first(), []state.EngineID{})
	b := pdBucket(bucket.Spec{ID: "b"}, allGroup(first()), noDecode)
	r, _ := bucket.NewResolver([]*bucket.Bucket{b}, bucket.ResolverOptions{})
	_, err := bucket.Select(ctx, r, reg, &bucket.Request{Model: "m"})
	var ex *bucket.ExhaustedError
	require.ErrorAs(t, err, &ex)
	assert.Empty(t, ex.Rejections)
	var se *bucket.StageError
	require.ErrorAs(t, err, &se)
	assert.Equal(t, state.StageDecode, se.Stage)
	assert.Equal(t, http.StatusServiceUnavailable, bucket.StatusCode(err))
}

func TestSelectStopsOnInvalidSignalConfigurationAndForeignPicks(t *testing.T) {
	t.Parallel()
	for _, stop := range []error{
		policy.ErrInvalidSignal, policy.ErrInvalidConfiguration,
		&policy.OutsideCandidatesError{Engine: "x"}, errors.New("checker failed"),
	} {
		reg := registry(eng("a", state.StagePlain))
		next := first()
		b1 := plainBucket(bucket.Spec{ID: "b1", MaxInputTokens: 10}, allGroup(failing(stop)))
		b2 := plainBucket(bucket.Spec{ID: "b2"}, allGroup(next))
		r, _ := bucket.NewResolver([]*bucket.Bucket{b1, b2}, bucket.ResolverOptions{})
		_, err := bucket.Select(ctx, r, reg, &bucket.Request{Model: "m", Signals: bucket.Signals{InputTokens: 1}})
		assert.ErrorIs(t, err, stop)
		assert.Zero(t, next.Calls(), "%v stops the loop", stop)
		assert.Equal(t, http.StatusInternalServerError, bucket.StatusCode(err))
	}
}

func TestSelectResolveErrors(t *testing.T) {
	t.Parallel()
	reg := registry(eng("a", state.StagePlain))
	r, _ := bucket.NewResolver([]*bucket.Bucket{plainBucket(bucket.Spec{ID: "small", MaxInputTokens: 10}, allGroup(first()))}, bucket.ResolverOptions{})
	_, err := bucket.Select(ctx, r, reg, &bucket.Request{Model: "m", Signals: bucket.Signals{InputTokens: 11}})
	assert.ErrorIs(t, err, bucket.ErrNoMatchingBucket)
	assert.Equal(t, http.StatusBadRequest, bucket.StatusCode(err))
	_, err = bucket.Select(ctx, r, reg, &bucket.Request{Model: "m", Signals: bucket.Signals{InputTokens: 5, ExpectedPeakTokens: 4, HasExpectedPeak: true}})
	assert.ErrorIs(t, err, policy.ErrInvalidSignal)

	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	_, err = bucket.Select(cancelled, r, reg, &bucket.Request{Model: "m", Signals: bucket.Signals{InputTokens: 5}})
	assert.ErrorIs(t, err, context.Canceled)
	assert.Equal(t, 499, bucket.StatusCode(err))
}

func TestStatusCode(t *testing.T) {
	t.Parallel()
	a := eng("a", state.StagePlain)
	tests := []struct {
		err  error
		want int
	}{
		{nil, http.StatusOK},
		{fmt.Errorf("x: %w", bucket.ErrNoMatchingBucket), http.StatusBadRequest},
		{fmt.Errorf("x: %w", bucket.ErrUnknownModel), http.StatusNotFound},
		{&bucket.ExhaustedError{Last: policy.ErrNoCandidates}, http.StatusServiceUnavailable},
		{&bucket.StageError{Err: policy.ErrNoCandidates}, http.StatusServiceUnavailable},
		{&policy.AdmissionRejectedError{Engine: a}, http.StatusServiceUnavailable},
		{&policy.NoAdmissibleEngineError{}, http.StatusServiceUnavailable},
		{fmt.Errorf("x: %w", policy.ErrInvalidSignal), http.StatusInternalServerError},
		{fmt.Errorf("x: %w", policy.ErrInvalidConfiguration), http.StatusInternalServerError},
		{&policy.OutsideCandidatesError{}, http.StatusInternalServerError},
		{context.DeadlineExceeded, http.StatusGatewayTimeout},
		{errors.New("other"), http.StatusInternalServerError},
		{fmt.Errorf("x: %w", &flowcontrol.RejectedError{Reason: "queue_full"}), http.StatusTooManyRequests},
		{errors.Join(&flowcontrol.RejectedError{Reason: "sheddable"}, &bucket.ExhaustedError{Last: policy.ErrNoCandidates}), http.StatusTooManyRequests},
		{fmt.Errorf("x: %w", flowcontrol.ErrTimeout), http.StatusServiceUnavailable},
		{fmt.Errorf("x: %w", errors.Join(context.DeadlineExceeded, &bucket.ExhaustedError{})), http.StatusGatewayTimeout},
	}
	for _, tt := range tests {
		assert.Equal(t, tt.want, bucket.StatusCode(tt.err), "StatusCode(%v)", tt.err)
	}
}
