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
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// labelled is an engine with a host-set PD compatibility label.
type labelled struct {
	*state.StaticEngine
	label string
}

func (e *labelled) PDCompatibility() string { return e.label }

func labelledEng(id state.EngineID, stage state.Stage, label string) *labelled {
	return &labelled{StaticEngine: eng(id, stage), label: label}
}

// plainRegistry hides StaticRegistry's version, so groups take the uncached path.
type plainRegistry struct{ r *state.StaticRegistry }

func (p plainRegistry) Engines(m state.ModelID) []state.Engine { return p.r.Engines(m) }

// pick returns a policy that picks the candidate with the given ID, or fails with ErrNoCandidates.
func pickID(id state.EngineID) *fakePolicy {
	return &fakePolicy{choose: func(es []state.Engine, _ *policy.Request) (policy.Pick, error) {
		for _, e := range es {
			if e.ID() == id {
				return policy.Pick{Engine: e, Reason: "by_id"}, nil
			}
		}
		return policy.Pick{}, policy.ErrNoCandidates
	}}
}

// docs/design.md §3: the decode engine is picked only among decode engines whose label equals the
// chosen prefill engine's; unlabelled engines pair only with unlabelled ones. Before the rule the
// decode policy saw every decode engine and could pair a prefill engine with one it cannot send KV
// to.
func TestDecodeIsPickedAmongEnginesCompatibleWithThePrefillPick(t *testing.T) {
	t.Parallel()
	fleet := func() *state.StaticRegistry {
		return registry(
			labelledEng("pA", state.StagePrefill, "mooncake/A"), labelledEng("pB", state.StagePrefill, "mooncake/B"),
			eng("pU", state.StagePrefill),
			labelledEng("dA1", state.StageDecode, "mooncake/A"), labelledEng("dA2", state.StageDecode, "mooncake/A"),
			labelledEng("dB", state.StageDecode, "mooncake/B"), eng("dU", state.StageDecode),
			labelledEng("dE", state.StageDecode, ""), // an empty label is unlabelled
		)
	}
	cases := []struct {
		prefill state.EngineID
		decodes []state.EngineID
	}{
		{"pA", []state.EngineID{"dA1", "dA2"}},
		{"pB", []state.EngineID{"dB"}},
		{"pU", []state.EngineID{"dE", "dU"}},
	}
	for _, versioned := range []bool{true, false} {
		for _, tc := range cases {
			t.Run(fmt.Sprintf("prefill=%s,versioned=%v", tc.prefill, versioned), func(t *testing.T) {
				t.Parallel()
				var reg state.Registry = fleet()
				if !versioned {
					reg = plainRegistry{reg.(*state.StaticRegistry)}
				}
				decodePolicy := first()
				b := pdBucket(bucket.Spec{ID: "pd"}, allGroup(pickID(tc.prefill)), allGroup(decodePolicy))
				for range 2 { // twice: the second pick reads the versioned group cache
					sel, err := b.PickEngines(ctx, reg, &bucket.Request{Model: "m"})
					require.NoError(t, err)
					assert.Equal(t, tc.prefill, sel.Prefill.Engine.ID())
					assert.Equal(t, tc.decodes[0], sel.Decode.Engine.ID())
				}
				require.Equal(t, 2, decodePolicy.Calls())
				assert.Equal(t, tc.decodes, decodePolicy.seen[0], "the decode policy sees only compatible engines")
				assert.Equal(t, tc.decodes, decodePolicy.seen[1])
			})
		}
	}
}

func TestUnhealthyCompatibleDecodeIsNotACandidate(t *testing.T) {
	t.Parallel()
	dA := labelledEng("dA", state.StageDecode, "A")
	reg := registry(labelledEng("pA", state.StagePrefill, "A"), dA, labelledEng("dB", state.StageDecode, "B"))
	b := pdBucket(bucket.Spec{ID: "pd"}, allGroup(first()), allGroup(first()))
	dA.SetHealthy(false)
	_, err := b.PickEngines(ctx, reg, &bucket.Request{Model: "m"})
	assert.ErrorIs(t, err, bucket.ErrNoCompatibleEngine, "the only healthy decode engine is incompatible")
}

// docs/design.md §3: a bucket whose prefill pick has no compatible decode engine advances like
// any other missing candidate; the next bucket picks both stages again.
func TestNoCompatibleDecodeAdvancesToTheNextBucket(t *testing.T) {
	t.Parallel()
	reg := registry(
		labelledEng("pA", state.StagePrefill, "A"), labelledEng("pB", state.StagePrefill, "B"),
		labelledEng("dB", state.StageDecode, "B"),
	)
	decode1 := first()
	b1 := pdBucket(bucket.Spec{ID: "b1", MaxInputTokens: 100}, group(first(), "pA"), allGroup(decode1))
	b2 := pdBucket(bucket.Spec{ID: "b2"}, group(first(), "pB"), allGroup(first()))

	_, err := b1.PickEngines(ctx, reg, &bucket.Request{Model: "m"})
	var se *bucket.StageError
	require.True(t, errors.As(err, &se))
	assert.Equal(t, state.StageDecode, se.Stage)
	assert.ErrorIs(t, err, bucket.ErrNoCompatibleEngine)
	assert.ErrorIs(t, err, policy.ErrNoCandidates)
	assert.True(t, bucket.Advances(err))
	assert.Zero(t, decode1.Calls(), "the decode policy is not called without a compatible candidate")

	r, err := bucket.NewResolver([]*bucket.Bucket{b1, b2}, bucket.ResolverOptions{})
	require.NoError(t, err)
	sel, err := bucket.Select(ctx, r, reg, &bucket.Request{Model: "m", Signals: bucket.Signals{InputTokens: 10}})
	require.NoError(t, err)
	assert.Equal(t, "b2", sel.Bucket.ID())
	assert.Equal(t, state.EngineID("pB"), sel.Prefill.Engine.ID())
	assert.Equal(t, state.EngineID("dB"), sel.Decode.Engine.ID())

	r, err = bucket.NewResolver([]*bucket.Bucket{b1}, bucket.ResolverOptions{})
	require.NoError(t, err)
	_, err = bucket.Select(ctx, r, reg, &bucket.Request{Model: "m", Signals: bucket.Signals{InputTokens: 10}})
	assert.Equal(t, http.StatusServiceUnavailable, bucket.StatusCode(err), "no other bucket: exhausted, 503")
}

// hiddenPicker is a host's own GroupPicker, not an *EngineGroup.
type hiddenPicker struct{ g *bucket.EngineGroup }

func (h hiddenPicker) Pick(ctx context.Context, r state.Registry, req *policy.Request) (policy.Pick, error) {
	return h.g.Pick(ctx, r, req)
}

// A decode group that is not an *EngineGroup is called with Pick and its pick checked.
func TestCustomDecodePickerIsChecked(t *testing.T) {
	t.Parallel()
	reg := registry(labelledEng("pA", state.StagePrefill, "A"),
		labelledEng("dA", state.StageDecode, "A"), labelledEng("dB", state.StageDecode, "B"))
	bad := pdBucket(bucket.Spec{ID: "bad"}, allGroup(first()), hiddenPicker{allGroup(pickID("dB"))})
	_, err := bad.PickEngines(ctx, reg, &bucket.Request{Model: "m"})
	assert.ErrorIs(t, err, bucket.ErrNoCompatibleEngine)
	assert.True(t, bucket.Advances(err))

	good := pdBucket(bucket.Spec{ID: "good"}, allGroup(first()), hiddenPicker{allGroup(pickID("dA"))})
	sel, err := good.PickEngines(ctx, reg, &bucket.Request{Model: "m"})
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("dA"), sel.Decode.Engine.ID())
}

func TestPlainGroupsIgnoreLabels(t *testing.T) {
	t.Parallel()
	reg := registry(labelledEng("a", state.StagePlain, "A"), labelledEng("b", state.StagePlain, "B"), eng("c", state.StagePlain))
	p := first()
	b := plainBucket(bucket.Spec{ID: "plain"}, allGroup(p))
	_, err := b.PickEngines(ctx, reg, &bucket.Request{Model: "m"})
	require.NoError(t, err)
	assert.Equal(t, []state.EngineID{"a", "b", "c"}, p.seen[0])
}

func TestPDCompatibilityOf(t *testing.T) {
	t.Parallel()
	assert.Equal(t, "x", state.PDCompatibilityOf(labelledEng("a", state.StagePrefill, "x")))
	assert.Equal(t, "", state.PDCompatibilityOf(eng("b", state.StagePrefill)), "no capability: unlabelled")
}
