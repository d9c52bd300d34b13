package bucket_test

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

func resolver(t *testing.T, opts bucket.ResolverOptions, specs ...bucket.Spec) *bucket.Resolver {
	t.Helper()
	bs := make([]*bucket.Bucket, len(specs))
	for i, s := range specs {
		bs[i] = plainBucket(s, allGroup(first()))
	}
	r, err := bucket.NewResolver(bs, opts)
	require.NoError(t, err)
	return r
}

func resolveIDs(t *testing.T, r *bucket.Resolver, s bucket.Signals) []string {
	t.Helper()
	bs, err := r.Resolve(s)
	require.NoError(t, err)
	return ids(bs)
}

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg.rs` resolve_orders_all_length_fits_by_capacity_rank_and_id.
func TestResolveOrdersAllLengthFitsByCapacityRankAndID(t *testing.T) {
	t.Parallel()
	r := resolver(t, bucket.ResolverOptions{},
		bucket.Spec{ID: "catch-all"},
		bucket.Spec{ID: "later", MaxInputTokens: 20, Rank: 2},
		bucket.Spec{ID: "z", MaxInputTokens: 20, Rank: 1},
		bucket.Spec{ID: "a", MaxInputTokens: 20, Rank: 1},
		bucket.Spec{ID: "min", MinInputTokens: 11, MaxInputTokens: 15, Rank: 9},
		bucket.Spec{ID: "too-small", MaxInputTokens: 5},
		bucket.Spec{ID: "ctx", MaxInputTokens: 100, MaxContextTokens: 18, Rank: 5}, // capacity 18
	)
	tests := []struct {
		input int64
		want  []string
	}{
		{10, []string{"ctx", "a", "z", "later", "catch-all"}},
		{11, []string{"min", "ctx", "a", "z", "later", "catch-all"}},
		{15, []string{"min", "ctx", "a", "z", "later", "catch-all"}},
		{16, []string{"ctx", "a", "z", "later", "catch-all"}},
		{20, []string{"a", "z", "later", "catch-all"}},
		{21, []string{"catch-all"}},
		{0, []string{"too-small", "ctx", "a", "z", "later", "catch-all"}},
		{5, []string{"too-small", "ctx", "a", "z", "later", "catch-all"}},
	}
	for _, tt := range tests {
		assert.Equal(t, tt.want, resolveIDs(t, r, bucket.Signals{InputTokens: tt.input}), "input %d", tt.input)
	}
}

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg.rs` context_capacity_checks_peak_when_known_and_input_otherwise.
func TestContextCapacityChecksPeakWhenKnownAndInputOtherwise(t *testing.T) {
	t.Parallel()
	r := resolver(t, bucket.ResolverOptions{},
		bucket.Spec{ID: "short", MaxContextTokens: 20},
		bucket.Spec{ID: "long", MaxContextTokens: 30})
	peak := func(in, pk int64) bucket.Signals {
		return bucket.Signals{InputTokens: in, ExpectedPeakTokens: pk, HasExpectedPeak: true}
	}
	assert.Equal(t, []string{"short", "long"}, resolveIDs(t, r, peak(10, 20)))
	assert.Equal(t, []string{"long"}, resolveIDs(t, r, peak(10, 21)))
	assert.Empty(t, resolveIDs(t, r, peak(10, 31)))
	assert.Empty(t, resolveIDs(t, r, bucket.Signals{InputTokens: 31}))
	assert.Equal(t, []string{"short", "long"}, resolveIDs(t, r, bucket.Signals{InputTokens: 20}), "unknown peak: input is checked")

	_, err := r.Resolve(peak(10, 9))
	assert.ErrorIs(t, err, policy.ErrInvalidSignal, "peak below input")
	_, err = r.Resolve(bucket.Signals{InputTokens: -1})
	assert.ErrorIs(t, err, policy.ErrInvalidSignal, "negative input")
	_, err = r.Resolve(peak(-5, -1))
	assert.ErrorIs(t, err, policy.ErrInvalidSignal)

	empty, err := bucket.NewResolver(nil, bucket.ResolverOptions{})
	require.NoError(t, err)
	bs, err := empty.Resolve(bucket.Signals{InputTokens: 1})
	require.NoError(t, err)
	assert.Empty(t, bs)
}

func TestExpectedPeakChecksOverflowAndSign(t *testing.T) {
	t.Parallel()
	p, err := bucket.ExpectedPeak(1024, 512)
	require.NoError(t, err)
	assert.Equal(t, int64(1536), p)
	for _, c := range [][2]int64{{math.MaxInt64, 1}, {1, math.MaxInt64}, {-1, 5}, {5, -1}} {
		_, err := bucket.ExpectedPeak(c[0], c[1])
		assert.ErrorIs(t, err, policy.ErrInvalidSignal, "ExpectedPeak(%d, %d)", c[0], c[1])
	}
	p, err = bucket.ExpectedPeak(math.MaxInt64-1, 1)
	require.NoError(t, err)
	assert.Equal(t, int64(math.MaxInt64), p)
}

func TestNewResolverAndBucketsRejectBadConfiguration(t *testing.T) {
	t.Parallel()
	g := allGroup(first())
	for name, spec := range map[string]bucket.Spec{
		"empty ID":          {},
		"inverted range":    {ID: "x", MinInputTokens: 10, MaxInputTokens: 9},
		"min above context": {ID: "x", MinInputTokens: 10, MaxContextTokens: 9},
		"negative TTFT":     {ID: "x", TTFTEstimate: -time.Second},
		"NaN TPS":           {ID: "x", TPSEstimate: math.NaN()},
		"infinite TPS":      {ID: "x", TPSEstimate: math.Inf(1)},
		"negative TPS":      {ID: "x", TPSEstimate: -1},
	} {
		_, err := bucket.NewPlainBucket(spec, g)
		assert.ErrorIs(t, err, policy.ErrInvalidConfiguration, name)
		_, err = bucket.NewPDBucket(spec, g, g)
		assert.ErrorIs(t, err, policy.ErrInvalidConfiguration, name)
	}
	_, err := bucket.NewPlainBucket(bucket.Spec{ID: "x"}, nil)
	assert.ErrorIs(t, err, policy.ErrInvalidConfiguration, "nil plain group")
	_, err = bucket.NewPDBucket(bucket.Spec{ID: "x"}, g, nil)
	assert.ErrorIs(t, err, policy.ErrInvalidConfiguration, "partial PD bucket")
	_, err = bucket.NewPDBucket(bucket.Spec{ID: "x"}, nil, g)
	assert.ErrorIs(t, err, policy.ErrInvalidConfiguration, "partial PD bucket")

	a := plainBucket(bucket.Spec{ID: "a"}, g)
	_, err = bucket.NewResolver([]*bucket.Bucket{a, plainBucket(bucket.Spec{ID: "a", Rank: 3}, g)}, bucket.ResolverOptions{})
	assert.ErrorIs(t, err, policy.ErrInvalidConfiguration, "duplicate ID")
	_, err = bucket.NewResolver([]*bucket.Bucket{a, nil}, bucket.ResolverOptions{})
	assert.ErrorIs(t, err, policy.ErrInvalidConfiguration, "nil bucket")
	_, err = bucket.NewResolver(nil, bucket.ResolverOptions{TTFTPreference: 7})
	assert.ErrorIs(t, err, policy.ErrInvalidConfiguration, "unknown preference")
}

// decodeOnly is a policy that cannot serve decode (like CacheAware).
type decodeOnly struct{ *fakePolicy }

func (decodeOnly) SupportsStage(s state.Stage) bool { return s != state.StageDecode }

func TestBucketRejectsAPolicyOnAStageItCannotServe(t *testing.T) {
	t.Parallel()
	cacheLike := allGroup(decodeOnly{first()})
	other := allGroup(first())
	_, err := bucket.NewPDBucket(bucket.Spec{ID: "x"}, other, cacheLike)
	assert.ErrorIs(t, err, policy.ErrInvalidConfiguration, "cache-aware on decode")
	_, err = bucket.NewPDBucket(bucket.Spec{ID: "x"}, cacheLike, other)
	assert.NoError(t, err, "cache-aware on prefill")
	_, err = bucket.NewPlainBucket(bucket.Spec{ID: "x"}, cacheLike)
	assert.NoError(t, err)
}

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg_slo.rs` slo_tiers_keep_length_constraints_and_capacity_rank_order.
func TestSLOTiersKeepLengthConstraintsAndCapacityRankOrder(t *testing.T) {
	t.Parallel()
	specs := []bucket.Spec{
		{ID: "fast-small", MaxInputTokens: 100, TTFTEstimate: 100 * time.Millisecond, TPSEstimate: 80},
		{ID: "slow-small", MaxInputTokens: 100, Rank: 1, TTFTEstimate: 900 * time.Millisecond, TPSEstimate: 20},
		{ID: "fast-ttft-big", MaxInputTokens: 1000, TTFTEstimate: 200 * time.Millisecond, TPSEstimate: 20},
		{ID: "no-estimate", MaxInputTokens: 2000},
		{ID: "tiny-fast", MaxInputTokens: 10, TTFTEstimate: time.Millisecond, TPSEstimate: 1000},
	}
	targets := bucket.Signals{InputTokens: 50, TTFTTarget: 300 * time.Millisecond, HasTTFTTarget: true, TPSTarget: 50, HasTPSTarget: true}
	tests := []struct {
		name      string
		ttft, tps bucket.SLOPreference
		want      []string
	}{
		{"disabled: capacity then rank", bucket.SLODisabled, bucket.SLODisabled,
			[]string{"fast-small", "slow-small", "fast-ttft-big", "no-estimate"}},
		{"both slo_first: both-match first", bucket.SLOFirst, bucket.SLOFirst,
			[]string{"fast-small", "fast-ttft-big", "slow-small", "no-estimate"}},
		{"both best_effort: non-matching first", bucket.SLOBestEffort, bucket.SLOBestEffort,
			[]string{"slow-small", "no-estimate", "fast-ttft-big", "fast-small"}},
		{"ttft slo_first only", bucket.SLOFirst, bucket.SLODisabled,
			[]string{"fast-small", "fast-ttft-big", "slow-small", "no-estimate"}},
		{"tps slo_first only", bucket.SLODisabled, bucket.SLOFirst,
			[]string{"fast-small", "slow-small", "fast-ttft-big", "no-estimate"}},
		{"mixed: ttft slo_first, tps best_effort", bucket.SLOFirst, bucket.SLOBestEffort,
			[]string{"fast-ttft-big", "fast-small", "slow-small", "no-estimate"}},
	}
	for _, tt := range tests {
		r := resolver(t, bucket.ResolverOptions{TTFTPreference: tt.ttft, TPSPreference: tt.tps}, specs...)
		got := resolveIDs(t, r, targets)
		assert.Equal(t, tt.want, got, tt.name)
		assert.NotContains(t, got, "tiny-fast", "%s: an SLO never relaxes the input range", tt.name)
	}
}

func TestSLOAbsentTargetsAreNeutralAndInvalidTargetsFailOnlyWhenEnabled(t *testing.T) {
	t.Parallel()
	specs := []bucket.Spec{
		{ID: "slow", MaxInputTokens: 100, TTFTEstimate: time.Second, TPSEstimate: 10},
		{ID: "fast", MaxInputTokens: 200, TTFTEstimate: time.Millisecond, TPSEstimate: 100},
		{ID: "inf", MaxInputTokens: 300, TTFTEstimate: 0, TPSEstimate: 0},
	}
	on := resolver(t, bucket.ResolverOptions{TTFTPreference: bucket.SLOFirst, TPSPreference: bucket.SLOFirst}, specs...)
	off := resolver(t, bucket.ResolverOptions{}, specs...)
	assert.Equal(t, []string{"slow", "fast", "inf"}, resolveIDs(t, on, bucket.Signals{InputTokens: 1}), "no targets: neutral")

	invalid := []bucket.Signals{
		{InputTokens: 1, HasTTFTTarget: true},
		{InputTokens: 1, HasTTFTTarget: true, TTFTTarget: -time.Second},
		{InputTokens: 1, HasTPSTarget: true},
		{InputTokens: 1, HasTPSTarget: true, TPSTarget: -1},
		{InputTokens: 1, HasTPSTarget: true, TPSTarget: math.NaN()},
		{InputTokens: 1, HasTPSTarget: true, TPSTarget: math.Inf(1)},
	}
	for _, s := range invalid {
		_, err := on.Resolve(s)
		assert.ErrorIs(t, err, policy.ErrInvalidSignal, "enabled: %+v", s)
		assert.Equal(t, []string{"slow", "fast", "inf"}, resolveIDs(t, off, s), "disabled preferences ignore %+v", s)
	}
	// A bucket without estimates never matches: with SLOFirst it sorts after a matching one.
	got := resolveIDs(t, on, bucket.Signals{InputTokens: 1, TTFTTarget: time.Hour, HasTTFTTarget: true})
	assert.Equal(t, []string{"slow", "fast", "inf"}, got, "estimate 0 never matches even a generous target")
}

func TestSLOPreferencesNeverRelaxPeakCapacity(t *testing.T) {
	t.Parallel()
	r := resolver(t, bucket.ResolverOptions{TTFTPreference: bucket.SLOFirst},
		bucket.Spec{ID: "fast-short", MaxContextTokens: 100, TTFTEstimate: time.Millisecond},
		bucket.Spec{ID: "slow-long", MaxContextTokens: 1000, TTFTEstimate: time.Second})
	got := resolveIDs(t, r, bucket.Signals{InputTokens: 10, ExpectedPeakTokens: 500, HasExpectedPeak: true,
		TTFTTarget: 10 * time.Millisecond, HasTTFTTarget: true})
	assert.Equal(t, []string{"slow-long"}, got)
}

func TestResolveIntoDoesNotAllocate(t *testing.T) {
	r := resolver(t, bucket.ResolverOptions{TTFTPreference: bucket.SLOFirst},
		bucket.Spec{ID: "a", MaxInputTokens: 100}, bucket.Spec{ID: "b"}, bucket.Spec{ID: "c", TTFTEstimate: time.Second})
	buf := make([]*bucket.Bucket, 0, 8)
	s := bucket.Signals{InputTokens: 10, TTFTTarget: 2 * time.Second, HasTTFTTarget: true}
	allocs := testing.AllocsPerRun(100, func() { _, _ = r.ResolveInto(buf[:0], s) })
	assert.Zero(t, allocs)
}
