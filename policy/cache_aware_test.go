package policy_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// indexerFunc adapts a function to kvindex.RemoteIndexer.
type indexerFunc func(ctx context.Context, q kvindex.RemoteQuery) ([]kvindex.EngineMatch, error)

func (f indexerFunc) MatchPrefix(ctx context.Context, q kvindex.RemoteQuery) ([]kvindex.EngineMatch, error) {
	return f(ctx, q)
}

const blockTokens = 16

// prompt returns n deterministic tokens; prompts with the same seed share prefixes.
func prompt(n int, seed uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = seed*100_000 + uint32(i)
	}
	return out
}

// cacheEnv is an env plus a prefix index.
type cacheEnv struct {
	*env
	index  *kvindex.Index
	source *countingSource
	hashes atomic.Uint64
	dec    *decisions
}

type countingSource struct {
	inner kvindex.Source
	calls atomic.Int32
}

func (s *countingSource) Lookup(ctx context.Context, q kvindex.Query) (kvindex.Result, error) {
	s.calls.Add(1)
	return s.inner.Lookup(ctx, q)
}

type decisions struct {
	mu  sync.Mutex
	all []policy.CacheDecision
}

func (d *decisions) ObserveCacheDecision(c *policy.CacheDecision) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.all = append(d.all, *c)
}

func (d *decisions) last() policy.CacheDecision {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.all[len(d.all)-1]
}

func (d *decisions) count() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.all)
}

func newCacheEnv(t testing.TB) *cacheEnv {
	t.Helper()
	h, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: blockTokens})
	require.NoError(t, err)
	e := newEnv()
	idx, err := kvindex.NewIndex(h, kvindex.Options{Now: e.clk.Now})
	require.NoError(t, err)
	local, err := kvindex.NewLocalSource(idx)
	require.NoError(t, err)
	return &cacheEnv{env: e, index: idx, source: &countingSource{inner: local}, dec: &decisions{}}
}

// hashesFor returns n fresh engine block hashes.
func (c *cacheEnv) hashesFor(n int) []uint64 {
	hs := make([]uint64, n)
	for i := range hs {
		hs[i] = c.hashes.Add(1)
	}
	return hs
}

// hold records that engine holds the first blocks of tokens.
func (c *cacheEnv) hold(t testing.TB, engine state.EngineID, tokens []uint32, blocks int) {
	t.Helper()
	hs := make([]uint64, blocks)
	for i := range hs {
		hs[i] = c.hashes.Add(1)
	}
	require.NoError(t, c.index.Store(kvindex.StoreEvent{Engine: engine, BlockHashes: hs,
		TokenIDs: tokens[:blocks*blockTokens], Tier: kvindex.TierDevice}))
}

func (c *cacheEnv) policy(t testing.TB, opts policy.CacheAwareOptions) policy.Policy {
	t.Helper()
	if opts.Source == nil {
		opts.Source = c.source
	}
	if opts.MinMatchedTokens == 0 {
		opts.MinMatchedTokens = blockTokens
	}
	opts.Observer = c.dec
	p, err := policy.NewCacheAware(c.cfg(), opts)
	require.NoError(t, err)
	return p
}

func u64(v uint64) *uint64 { return &v }

func creq(tokens []uint32) *policy.Request {
	return &policy.Request{Model: "m", Stage: state.StagePrefill, BucketID: "b", InputTokens: uint64(len(tokens)), TokenIDs: tokens}
}

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg_cache_aware.rs` local_prefix_wins_within_group_and_threshold_misses_use_load.
func TestCacheAwareLocalPrefixWinsWithinGroupAndThresholdMissesUseLoad(t *testing.T) {
	t.Parallel()
	c := newCacheEnv(t)
	tok := prompt(10*blockTokens, 1)
	c.hold(t, "outside", tok, 10) // deepest, but not in the group
	c.hold(t, "deep", tok, 6)
	c.hold(t, "shallow", tok, 3)
	c.native("deep", loadmon.Report{WaitingRequests: 3})
	c.native("shallow", loadmon.Report{WaitingRequests: 2})
	c.native("cold", loadmon.Report{WaitingRequests: 0})
	group := engines(state.StagePrefill, "cold", "deep", "shallow")

	p := c.policy(t, policy.CacheAwareOptions{})
	pk, err := p.Pick(ctx, group, creq(tok))
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("deep"), pk.Engine.ID())
	assert.Equal(t, label.ReasonCacheCandidate, pk.Reason)
	assert.Equal(t, label.DecisionCacheHit, c.dec.last().Decision)

	// 6 of 10 blocks of a 160-token prompt = 96 matched tokens.
	for name, opts := range map[string]policy.CacheAwareOptions{
		"min matched tokens": {MinMatchedTokens: 97},
		"min match ratio":    {MinMatchRatio: 0.9},
	} {
		p := c.policy(t, opts)
		c.rnd.vals = []int{0, 1}
		pk, err := p.Pick(ctx, group, creq(tok))
		require.NoError(t, err)
		assert.Equal(t, state.EngineID("cold"), pk.Engine.ID(), "%s: a miss goes to the less loaded engine", name)
		assert.Equal(t, label.ReasonNoCacheCandidate, pk.Reason)
		assert.Equal(t, label.DecisionCacheMiss, c.dec.last().Decision)
	}
	// 96 tokens is exactly the gate: it passes.
	pk, err = c.policy(t, policy.CacheAwareOptions{MinMatchedTokens: 96}).Pick(ctx, group, creq(tok))
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("deep"), pk.Engine.ID())
}

// docs/design.md §9.1: an engine holding b leading blocks of an n-token prompt is credited the
// tokens it would serve from its prefix cache, min(b, ⌊(n − 1) ÷ 16⌋) × 16: whole blocks, and never
// the block holding the last prompt token, which the engine computes again. The hit gate reads
// that, and the pick's PrefillTokens is the rest of the prompt (the whole prompt on a miss).
func TestCacheAwareMatchedTokensAreTheTokensTheEngineServes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		n, held int
		matched uint64
	}{
		{"a partial last block is prefilled", 4*blockTokens + 8, 2, 32},
		{"every full block of a prompt with a partial last block", 4*blockTokens + 8, 4, 64},
		{"a prompt ending on a block boundary computes its last block again", 4 * blockTokens, 4, 48},
		{"one token more and the last full block is served", 4*blockTokens + 1, 4, 64},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCacheEnv(t)
			tok := prompt(tc.n, 2)
			c.hold(t, "a", tok, tc.held)
			c.inflight.Acquire("a", -1, 0) // so that a miss falls back to b
			group := engines(state.StagePrefill, "a", "b")
			for _, gate := range []uint64{tc.matched, tc.matched + 1} {
				c.rnd.vals = []int{1, 0}
				pk, err := c.policy(t, policy.CacheAwareOptions{MinMatchedTokens: gate}).Pick(ctx, group, creq(tok))
				require.NoError(t, err)
				if gate == tc.matched {
					assert.Equal(t, state.EngineID("a"), pk.Engine.ID(), "gate %d: a hit", gate)
					assert.Equal(t, uint64(tc.n)-tc.matched, pk.PrefillTokens, "gate %d", gate)
				} else {
					assert.Equal(t, state.EngineID("b"), pk.Engine.ID(), "gate %d: a miss", gate)
					assert.Equal(t, uint64(tc.n), pk.PrefillTokens, "gate %d", gate)
				}
			}
		})
	}
}

// docs/design.md §9.1: unset, the hit gate is a fifth of the prompt, ⌈input tokens ÷ 5⌉ matched
// tokens, whatever the prompt's length: a short chat's prefix counts, and a long prompt's shared
// system prompt alone does not.
func TestCacheAwareDefaultHitGate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		n    int // prompt tokens
		held int // blocks engine a holds
		hit  bool
	}{
		{"321 tokens: gate 65, 64 matched", 20*blockTokens + 1, 4, false},
		{"321 tokens: gate 65, 80 matched", 20*blockTokens + 1, 5, true},
		{"320 tokens: gate 64, 64 matched", 20 * blockTokens, 4, true},
		{"8,193 tokens: gate 1,639, 1,632 matched", 8193, 102, false},
		{"8,193 tokens: gate 1,639, 1,648 matched", 8193, 103, true},
		{"40,960 tokens: gate 8,192, 2,048 matched (a system prompt)", 40960, 128, false},
		{"40,960 tokens: gate 8,192, 8,176 matched", 40960, 511, false},
		{"40,960 tokens: gate 8,192, 8,192 matched", 40960, 512, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCacheEnv(t)
			tok := prompt(tc.n, 4)
			c.hold(t, "a", tok, tc.held)
			c.inflight.Acquire("a", -1, 0) // so that a miss falls back to b
			c.rnd.vals = []int{1, 0}
			p, err := policy.NewCacheAware(c.cfg(), policy.CacheAwareOptions{Source: c.source})
			require.NoError(t, err)
			pk, err := p.Pick(ctx, engines(state.StagePrefill, "a", "b"), creq(tok))
			require.NoError(t, err)
			if tc.hit {
				assert.Equal(t, state.EngineID("a"), pk.Engine.ID())
				assert.Equal(t, label.ReasonCacheCandidate, pk.Reason)
				assert.Equal(t, uint64(tc.n-tc.held*blockTokens), pk.PrefillTokens)
			} else {
				assert.Equal(t, state.EngineID("b"), pk.Engine.ID())
				assert.Equal(t, label.ReasonNoCacheCandidate, pk.Reason)
				assert.Equal(t, uint64(tc.n), pk.PrefillTokens)
			}
		})
	}
}

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg_cache_aware.rs` remote_urls_are_exact_duplicate_depths_merge_and_block_counts_are_capped.
func TestCacheAwareRemoteEngineIdentityIsExact(t *testing.T) {
	t.Parallel()
	c := newCacheEnv(t)
	h, _ := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: blockTokens})
	remote, err := kvindex.NewRemoteSource(indexerFunc(func(context.Context, kvindex.RemoteQuery) ([]kvindex.EngineMatch, error) {
		return []kvindex.EngineMatch{{Engine: "http://b/", Blocks: math.MaxInt32}, {Engine: "http://a", Blocks: 2}, {Engine: "http://a", Blocks: 3}}, nil
	}), h, kvindex.RemoteOptions{})
	require.NoError(t, err)
	tok := prompt(4*blockTokens, 3)
	p := c.policy(t, policy.CacheAwareOptions{Source: remote})
	pk, err := p.Pick(ctx, engines(state.StagePrefill, "http://a", "http://b"), creq(tok))
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("http://a"), pk.Engine.ID(), `"http://b/" is not "http://b"; duplicate depths of a merge to 3`)
	assert.Equal(t, label.ReasonCacheCandidate, pk.Reason)
}

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg_cache_aware.rs` memo_reuses_io_but_reruns_admission_and_group_selection.
func TestCacheAwareMemoReusesLookupButRerunsAdmissionAndSelection(t *testing.T) {
	t.Parallel()
	c := newCacheEnv(t)
	tok := prompt(8*blockTokens, 4)
	c.hold(t, "p1", tok, 8)
	c.hold(t, "p2", tok, 8)
	p := c.policy(t, policy.CacheAwareOptions{})
	req := creq(tok)
	req.Memo = new(kvindex.Memo)
	for i, group := range [][]state.EngineID{{"p1"}, {"p2"}, {"p1", "p2"}} {
		pk, err := p.Pick(ctx, engines(state.StagePrefill, group...), req)
		require.NoError(t, err)
		assert.Equal(t, group[0], pk.Engine.ID(), "pick %d selects within its own group", i)
	}
	assert.Equal(t, int32(1), c.source.calls.Load(), "one lookup for three picks")
	assert.Equal(t, []state.EngineID{"p1", "p2", "p1", "p2"}, c.check.Calls(), "admission runs on every pick's own holders")

	other := &countingSource{inner: c.source.inner}
	p2 := c.policy(t, policy.CacheAwareOptions{Source: other})
	_, err := p2.Pick(ctx, engines(state.StagePrefill, "p1"), req)
	require.NoError(t, err)
	assert.Equal(t, int32(1), other.calls.Load(), "another source (namespace) is looked up on its own")

	fresh := creq(tok)
	fresh.Memo = new(kvindex.Memo)
	_, err = p.Pick(ctx, engines(state.StagePrefill, "p1"), fresh)
	require.NoError(t, err)
	assert.Equal(t, int32(2), c.source.calls.Load(), "a new request looks up again")
}

func TestCacheAwareConcurrentPicksShareOneLookup(t *testing.T) {
	t.Parallel()
	c := newCacheEnv(t)
	tok := prompt(8*blockTokens, 5)
	c.hold(t, "p1", tok, 8)
	p := c.policy(t, policy.CacheAwareOptions{})
	req := creq(tok)
	req.Memo = new(kvindex.Memo)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			r := *req
			pk, err := p.Pick(ctx, engines(state.StagePrefill, "p1", "p2"), &r)
			if assert.NoError(t, err) {
				assert.Equal(t, state.EngineID("p1"), pk.Engine.ID())
			}
		})
	}
	wg.Wait()
	assert.Equal(t, int32(1), c.source.calls.Load())
}

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg_cache_aware.rs` unavailable_index_falls_back_but_rejected_queries_fail.
func TestCacheAwareUnavailableFallsBackButRejectedQueriesFail(t *testing.T) {
	t.Parallel()
	h, _ := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: blockTokens})
	tok := prompt(8*blockTokens, 6)
	for name, backendErr := range map[string]error{
		"unreachable": errors.New("connection refused"),
		"deadline":    context.DeadlineExceeded,
	} {
		c := newCacheEnv(t)
		var calls atomic.Int32
		remote, err := kvindex.NewRemoteSource(indexerFunc(func(context.Context, kvindex.RemoteQuery) ([]kvindex.EngineMatch, error) {
			calls.Add(1)
			return nil, backendErr
		}), h, kvindex.RemoteOptions{})
		require.NoError(t, err)
		c.native("busy", loadmon.Report{WaitingRequests: 9})
		c.native("idle", loadmon.Report{WaitingRequests: 0})
		p := c.policy(t, policy.CacheAwareOptions{Source: remote})
		req := creq(tok)
		req.Memo = new(kvindex.Memo)
		for range 2 {
			pk, err := p.Pick(ctx, engines(state.StagePrefill, "busy", "idle"), req)
			require.NoError(t, err, name)
			assert.Equal(t, state.EngineID("idle"), pk.Engine.ID(), "%s: falls back to the least loaded", name)
			assert.Equal(t, label.ReasonNoCacheCandidate, pk.Reason)
			assert.Equal(t, kvindex.OutcomeUnavailable, c.dec.last().Lookup)
		}
		assert.Equal(t, int32(1), calls.Load(), "%s: unavailability is memoized", name)
	}

	c := newCacheEnv(t)
	remote, _ := kvindex.NewRemoteSource(indexerFunc(func(context.Context, kvindex.RemoteQuery) ([]kvindex.EngineMatch, error) {
		return nil, fmt.Errorf("bad namespace: %w", state.ErrInvalidSignal)
	}), h, kvindex.RemoteOptions{})
	p := c.policy(t, policy.CacheAwareOptions{Source: remote})
	_, err := p.Pick(ctx, engines(state.StagePrefill, "a"), creq(tok))
	assert.ErrorIs(t, err, policy.ErrInvalidSignal)
	assert.Empty(t, c.check.Calls())
	assert.Zero(t, c.dec.count(), "a failed pick records no decision")
}

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg_cache_aware.rs` queue_diversion_and_saturation_use_only_this_group.
func TestCacheAwareQueueDiversionAndSaturationUseOnlyThisGroup(t *testing.T) {
	t.Parallel()
	tok := prompt(8*blockTokens, 7)
	group := engines(state.StagePrefill, "cold", "owner")
	setup := func(ownerWaiting, coldWaiting uint64) *cacheEnv {
		c := newCacheEnv(t)
		c.hold(t, "owner", tok, 8)
		c.native("owner", loadmon.Report{WaitingRequests: ownerWaiting})
		c.native("cold", loadmon.Report{WaitingRequests: coldWaiting})
		c.native("idle-outsider", loadmon.Report{WaitingRequests: 0}) // not in the group
		return c
	}

	c := setup(4, 0)
	pk, err := c.policy(t, policy.CacheAwareOptions{EngineQueueLimit: u64(4)}).Pick(ctx, group, creq(tok))
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("cold"), pk.Engine.ID(), "the owner at the limit (4 of 4) is queued: diverted to the idle peer")
	assert.Equal(t, label.ReasonNoCacheCandidate, pk.Reason)
	d := c.dec.last()
	assert.Equal(t, label.DecisionCacheWorkerQueued, d.Decision)
	assert.Equal(t, 8, d.DivertedBlocks, "the forfeited prefix depth")
	assert.Equal(t, 1, d.GateRejected)
	assert.Zero(t, d.Evaluated)

	c = setup(3, 0)
	pk, _ = c.policy(t, policy.CacheAwareOptions{EngineQueueLimit: u64(4)}).Pick(ctx, group, creq(tok))
	assert.Equal(t, state.EngineID("owner"), pk.Engine.ID(), "one below the limit passes the gate")
	assert.Equal(t, label.DecisionCacheHit, c.dec.last().Decision)

	c = setup(3, 0)
	c.inflight.Acquire("owner", -1, 100) // dispatched after the report: a fourth waiting request
	pk, _ = c.policy(t, policy.CacheAwareOptions{EngineQueueLimit: u64(4)}).Pick(ctx, group, creq(tok))
	assert.Equal(t, state.EngineID("cold"), pk.Engine.ID(), "3 reported + 1 dispatched since reach the limit")

	c = setup(3, 0)
	require.NoError(t, c.load.Report(loadmon.Report{Engine: "owner", WaitingRequests: 4})) // no native data
	pk, _ = c.policy(t, policy.CacheAwareOptions{EngineQueueLimit: u64(4)}).Pick(ctx, group, creq(tok))
	assert.Equal(t, state.EngineID("cold"), pk.Engine.ID(), "a basic report's waiting requests gate as a native one's")

	c = setup(5, 4)
	pk, _ = c.policy(t, policy.CacheAwareOptions{EngineQueueLimit: u64(4), SaturationQueueFloor: u64(4)}).Pick(ctx, group, creq(tok))
	assert.Equal(t, state.EngineID("owner"), pk.Engine.ID(), "the cold peer queues too: pinned to the owner")
	assert.Equal(t, label.ReasonSaturationPin, pk.Reason)

	c = setup(5, 3)
	pk, _ = c.policy(t, policy.CacheAwareOptions{EngineQueueLimit: u64(4), SaturationQueueFloor: u64(2)}).Pick(ctx, group, creq(tok))
	assert.Equal(t, state.EngineID("owner"), pk.Engine.ID(), "floor 2, cold at 3: nothing provably idle, owner pinned")
	assert.Equal(t, label.ReasonSaturationPin, pk.Reason)

	c = setup(5, 1)
	pk, _ = c.policy(t, policy.CacheAwareOptions{EngineQueueLimit: u64(4), SaturationQueueFloor: u64(2)}).Pick(ctx, group, creq(tok))
	assert.Equal(t, state.EngineID("cold"), pk.Engine.ID(), "a provably idle group engine (1 < floor 2) vetoes the pin")

	c = setup(5, 4)
	c.load.Forget("cold") // unknown queue is not idle
	pk, _ = c.policy(t, policy.CacheAwareOptions{EngineQueueLimit: u64(4), SaturationQueueFloor: u64(4)}).Pick(ctx, group, creq(tok))
	assert.Equal(t, label.ReasonSaturationPin, pk.Reason, "an unknown queue is not idle")

	c = setup(4, 9)
	pk, _ = c.policy(t, policy.CacheAwareOptions{EngineQueueLimit: u64(4)}).Pick(ctx, group, creq(tok))
	assert.Equal(t, state.EngineID("owner"), pk.Engine.ID(), "the whole group queues and no floor: the prefix is kept")
	assert.Equal(t, label.ReasonCacheCandidate, pk.Reason)
	assert.True(t, c.dec.last().FleetAllQueued)

	c = setup(4, 9)
	c.load.Forget("cold")
	c.rnd.vals = []int{0, 1}
	pk, _ = c.policy(t, policy.CacheAwareOptions{EngineQueueLimit: u64(4)}).Pick(ctx, group, creq(tok))
	assert.Equal(t, state.EngineID("cold"), pk.Engine.ID(), "fleet saturation needs a fresh sample everywhere: no re-admission")
}

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg_cache_aware.rs`
// hard_rejection_never_becomes_cold_fallback_or_saturation_bypass, with the cost comparison off;
// on, the cheapest engine admission admits takes the request (docs/design.md §9.11).
func TestCacheAwareHardRejectionNeverBecomesColdFallbackOrSaturationBypass(t *testing.T) {
	t.Parallel()
	tok := prompt(8*blockTokens, 8)
	group := engines(state.StagePrefill, "cold", "owner")
	c := newCacheEnv(t)
	c.hold(t, "owner", tok, 8)
	c.native("owner", loadmon.Report{WaitingRequests: 5})
	c.native("cold", loadmon.Report{WaitingRequests: 0})
	cfg := c.cfg()
	lim := admission.Limits{MaxWaitingRequests: admission.Cap(5)}
	rec := &recorder{}
	cfg.Admission = checkerFunc(func(e state.Engine, m admission.Metrics) (admission.Verdict, error) {
		_, _ = rec.Check(e, m)
		return lim.Check(e, m)
	})
	p, err := policy.NewCacheAware(cfg, policy.CacheAwareOptions{Source: c.source, MinMatchedTokens: blockTokens, DisableCostComparison: true})
	require.NoError(t, err)
	_, err = p.Pick(ctx, group, creq(tok))
	var none *policy.NoAdmissibleEngineError
	require.ErrorAs(t, err, &none)
	require.Len(t, none.Rejections, 1)
	assert.Equal(t, state.EngineID("owner"), none.Rejections[0].Engine.ID())
	assert.Equal(t, admission.LimitWaitingRequests, none.Rejections[0].Limit)
	assert.Equal(t, []state.EngineID{"owner"}, rec.Calls(), "admission once, on the owner; no cold fallback")
	assert.Equal(t, admission.Known(5), rec.metrics[0].WaitingRequests)

	// With the cost comparison, the idle cold engine recomputes the prompt; busy (one waiting
	// request, one running, or one in flight from this router), it still has room and takes it
	// as the cheapest admitted engine (docs/design.md §9.11); at its cap too, the pick fails.
	p, err = policy.NewCacheAware(cfg, policy.CacheAwareOptions{Source: c.source, MinMatchedTokens: blockTokens})
	require.NoError(t, err)
	pk, err := p.Pick(ctx, group, creq(tok))
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("cold"), pk.Engine.ID())
	assert.Equal(t, label.ReasonNoCacheCandidate, pk.Reason)
	assert.Equal(t, []state.EngineID{"owner", "owner", "cold"}, rec.Calls(), "the owner, then the idle engine")
	for name, busy := range map[string]func() func(){
		"waiting": func() func() { c.native("cold", loadmon.Report{WaitingRequests: 1}); return func() {} },
		"running": func() func() { c.native("cold", loadmon.Report{RunningRequests: 1}); return func() {} },
		"in flight": func() func() {
			c.native("cold", loadmon.Report{})
			return c.inflight.Acquire("cold", -1, 0).Release
		},
	} {
		release := busy()
		pk, err = p.Pick(ctx, group, creq(tok))
		require.NoError(t, err, name)
		assert.Equal(t, state.EngineID("cold"), pk.Engine.ID(), name)
		assert.Equal(t, label.ReasonNoCacheCandidate, pk.Reason, name)
		release()
	}
	c.native("cold", loadmon.Report{WaitingRequests: 5})
	_, err = p.Pick(ctx, group, creq(tok))
	require.ErrorAs(t, err, &none, "cold at its cap too")
	require.Len(t, none.Rejections, 2)
	assert.Equal(t, state.EngineID("cold"), none.Rejections[1].Engine.ID())

	// The saturation pin cannot bypass admission either: the rejected owner is not pinned, and
	// the request goes to cold, which has room.
	p, _ = policy.NewCacheAware(cfg, policy.CacheAwareOptions{Source: c.source, MinMatchedTokens: blockTokens,
		EngineQueueLimit: u64(1), SaturationQueueFloor: u64(1)})
	c.native("cold", loadmon.Report{WaitingRequests: 1})
	pk, err = p.Pick(ctx, group, creq(tok))
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("cold"), pk.Engine.ID(), "the pinned owner is rejected: the engine with room")

	// Without a cache hit, a rejected fallback pick is an AdmissionRejected.
	c.native("cold", loadmon.Report{WaitingRequests: 7})
	p, _ = policy.NewCacheAware(cfg, policy.CacheAwareOptions{Source: c.source, MinMatchedTokens: blockTokens})
	_, err = p.Pick(ctx, group, creq(prompt(8*blockTokens, 99)))
	var rej *policy.AdmissionRejectedError
	require.ErrorAs(t, err, &rej)
	assert.Equal(t, state.EngineID("owner"), rej.Engine.ID(), "the less loaded of 5 and 7 waiting, then rejected")
}

type checkerFunc func(state.Engine, admission.Metrics) (admission.Verdict, error)

func (f checkerFunc) Check(e state.Engine, m admission.Metrics) (admission.Verdict, error) {
	return f(e, m)
}

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg_cache_aware.rs` guard_switches_near_ties_only_with_complete_fresh_telemetry.
func TestCacheAwareGuardSwitchesNearTiesOnlyWithCompleteFreshTelemetry(t *testing.T) {
	t.Parallel()
	tok := prompt(10*blockTokens+1, 9)
	group := engines(state.StagePrefill, "deep", "shallow")
	setup := func() *cacheEnv {
		c := newCacheEnv(t)
		c.hold(t, "deep", tok, 10)   // 1 uncached
		c.hold(t, "shallow", tok, 9) // 17 uncached
		c.native("deep", loadmon.Report{Native: &loadmon.NativeLoad{WaitingUncachedTokens: 5000}})
		c.native("shallow", loadmon.Report{Native: &loadmon.NativeLoad{WaitingUncachedTokens: 10}})
		return c
	}
	// The cost comparison (§9.11) is off: this is the upstream guard alone.
	c := setup()
	pk, _ := c.policy(t, policy.CacheAwareOptions{DisableCostComparison: true, SwitchMarginTokens: u64(0)}).Pick(ctx, group, creq(tok))
	assert.Equal(t, state.EngineID("deep"), pk.Engine.ID(), "margin 0: the deepest holder wins")

	pk, _ = c.policy(t, policy.CacheAwareOptions{DisableCostComparison: true, SwitchMarginTokens: u64(16)}).Pick(ctx, group, creq(tok))
	assert.Equal(t, state.EngineID("shallow"), pk.Engine.ID(), "within the margin, the materially more pressured deep holder loses")
	d := c.dec.last()
	assert.Equal(t, 1, d.GuardCompared)
	assert.Equal(t, 1, d.GuardOverrides)
	assert.Equal(t, "native_queue_tokens", d.PressureSource)

	pk, _ = c.policy(t, policy.CacheAwareOptions{DisableCostComparison: true, SwitchMarginTokens: u64(16), DisablePressureGuard: true}).Pick(ctx, group, creq(tok))
	assert.Equal(t, state.EngineID("deep"), pk.Engine.ID(), "guard disabled")

	pk, _ = c.policy(t, policy.CacheAwareOptions{DisableCostComparison: true, SwitchMarginTokens: u64(16), PressureAbsThresholdTokens: 5000}).Pick(ctx, group, creq(tok))
	assert.Equal(t, state.EngineID("deep"), pk.Engine.ID(), "a 4,990-token gap is not above an absolute threshold of 5,000")

	// Without native figures the guard still compares, on pending prefill tokens estimated from the
	// reported waiting requests (docs/design.md §9.7): the shallow holder's report shows an empty
	// queue, the deep one's 5,000 waiting uncached tokens.
	c = setup()
	require.NoError(t, c.load.Report(loadmon.Report{Engine: "shallow"})) // an old publisher: no native data
	guarded := policy.CacheAwareOptions{DisableCostComparison: true, SwitchMarginTokens: u64(16)}
	pk, _ = c.policy(t, guarded).Pick(ctx, group, creq(tok))
	assert.Equal(t, state.EngineID("shallow"), pk.Engine.ID(), "a native queue against an empty basic one")
	assert.Equal(t, "estimated_queue_tokens", c.dec.last().PressureSource)
	assert.Equal(t, 1, c.dec.last().GuardOverrides)

	// Both basic: 3 waiting requests priced at the request's own 160 input tokens (the router has
	// recorded no dispatch to the engine) are 480 tokens, not materially more.
	require.NoError(t, c.load.Report(loadmon.Report{Engine: "deep", WaitingRequests: 3}))
	pk, _ = c.policy(t, guarded).Pick(ctx, group, creq(tok))
	assert.Equal(t, state.EngineID("deep"), pk.Engine.ID(), "480 estimated tokens are within the 1,024-token threshold")
	assert.Equal(t, 1, c.dec.last().GuardCompared)
	assert.Zero(t, c.dec.last().GuardOverrides)
	// Priced at the mean of the router's dispatches there (2,000 tokens each): 6,000 tokens.
	c.inflight.Acquire("deep", -1, 2000)
	c.clk.Advance(time.Millisecond)
	require.NoError(t, c.load.Report(loadmon.Report{Engine: "deep", WaitingRequests: 3}))
	pk, _ = c.policy(t, guarded).Pick(ctx, group, creq(tok))
	assert.Equal(t, state.EngineID("shallow"), pk.Engine.ID(), "3 × 2,000 estimated tokens against none")
	assert.Equal(t, 1, c.dec.last().GuardOverrides)

	c = setup()
	c.clk.Advance(loadmon.DefaultFreshness + time.Millisecond)
	c.native("deep", loadmon.Report{Native: &loadmon.NativeLoad{WaitingUncachedTokens: 5000}}) // shallow is stale
	pk, _ = c.policy(t, policy.CacheAwareOptions{DisableCostComparison: true, SwitchMarginTokens: u64(16)}).Pick(ctx, group, creq(tok))
	assert.Equal(t, state.EngineID("deep"), pk.Engine.ID(), "unknown load on one side: in-flight only, a tie")
	assert.Equal(t, "router_local", c.dec.last().PressureSource)
}

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg_cache_aware.rs` candidate_cap_is_applied_before_admission.
func TestCacheAwareCandidateCapIsAppliedBeforeAdmission(t *testing.T) {
	t.Parallel()
	c := newCacheEnv(t)
	tok := prompt(8*blockTokens, 10)
	c.hold(t, "deep", tok, 8)
	c.hold(t, "mid", tok, 6)
	c.hold(t, "low", tok, 4)
	group := engines(state.StagePrefill, "deep", "low", "mid")
	_, err := c.policy(t, policy.CacheAwareOptions{CandidateMinEngines: 1, CandidateMaxEngines: 1}).Pick(ctx, group, creq(tok))
	require.NoError(t, err)
	assert.Equal(t, []state.EngineID{"deep"}, c.check.Calls(), "cap 1: only the deep owner is checked, once")

	c.check.calls = nil
	_, err = c.policy(t, policy.CacheAwareOptions{CandidateMinEngines: 2, CandidateMaxEngines: 2}).Pick(ctx, group, creq(tok))
	require.NoError(t, err)
	assert.Equal(t, []state.EngineID{"deep", "mid"}, c.check.Calls())
}

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg_cache_aware.rs` decode_group_and_invalid_configuration_are_rejected.
func TestCacheAwareRejectsDecodeAndInvalidConfiguration(t *testing.T) {
	t.Parallel()
	c := newCacheEnv(t)
	for name, opts := range map[string]policy.CacheAwareOptions{
		"no source":                {},
		"negative min engines":     {Source: c.source, CandidateMinEngines: -1},
		"max below min":            {Source: c.source, CandidateMinEngines: 9, CandidateMaxEngines: 8},
		"NaN ratio":                {Source: c.source, CandidateRatio: math.NaN()},
		"ratio above 1":            {Source: c.source, CandidateRatio: 1.5},
		"negative match ratio":     {Source: c.source, MinMatchRatio: -0.1},
		"match ratio above 1":      {Source: c.source, MinMatchRatio: 1.1},
		"rel threshold 1":          {Source: c.source, PressureRelThreshold: 1},
		"rel threshold NaN":        {Source: c.source, PressureRelThreshold: math.NaN()},
		"rel threshold inf":        {Source: c.source, PressureRelThreshold: math.Inf(1)},
		"negative abs duration":    {Source: c.source, PressureAbsThreshold: -1},
		"queue limit 0":            {Source: c.source, EngineQueueLimit: u64(0)},
		"floor without limit":      {Source: c.source, SaturationQueueFloor: u64(1)},
		"floor above limit":        {Source: c.source, EngineQueueLimit: u64(2), SaturationQueueFloor: u64(3)},
		"floor 0":                  {Source: c.source, EngineQueueLimit: u64(2), SaturationQueueFloor: u64(0)},
		"negative min load choice": {Source: c.source, MinLoadChoices: -2},
	} {
		_, err := policy.NewCacheAware(c.cfg(), opts)
		assert.ErrorIs(t, err, policy.ErrInvalidConfiguration, name)
	}
	p := c.policy(t, policy.CacheAwareOptions{})
	ss, ok := p.(interface{ SupportsStage(state.Stage) bool })
	require.True(t, ok, "the cache-aware policy has the optional SupportsStage method")
	assert.False(t, ss.SupportsStage(state.StageDecode))
	assert.True(t, ss.SupportsStage(state.StagePrefill))
	assert.True(t, ss.SupportsStage(state.StagePlain))
	_, err := p.Pick(ctx, engines(state.StageDecode, "d"), &policy.Request{Stage: state.StageDecode})
	assert.ErrorIs(t, err, policy.ErrInvalidConfiguration)
	_, err = p.Pick(ctx, nil, creq(prompt(32, 1)))
	assert.ErrorIs(t, err, policy.ErrNoCandidates)
	assert.Zero(t, c.source.calls.Load(), "no candidates: no lookup")
}

// docs/design.md §9.8; sgl-project/sglang `experimental/sgl-router/src/policies/selection.rs`
// cache_aware_fallback_decision.
func TestCacheAwareFallbackDecisionLabels(t *testing.T) {
	t.Parallel()
	tests := []struct {
		rejected, evaluated int
		allQueued           bool
		want                string
	}{
		{0, 0, false, label.DecisionCacheMiss},
		{0, 3, true, label.DecisionCacheMiss},
		{2, 2, true, label.DecisionAllQueued},
		{2, 0, true, label.DecisionAllQueued},
		{2, 1, false, label.DecisionCacheMiss},
		{2, 0, false, label.DecisionCacheWorkerQueued},
	}
	for _, tt := range tests {
		got := policy.CacheAwareFallbackDecision(tt.rejected, tt.evaluated, tt.allQueued)
		assert.Equal(t, tt.want, got, "(rejected %d, evaluated %d, fleet all queued %v)", tt.rejected, tt.evaluated, tt.allQueued)
	}
}

func TestCacheAwareInertQueueGateWarningIsSampled(t *testing.T) {
	t.Parallel()
	core, logs := observer.New(zap.WarnLevel)
	c := newCacheEnv(t)
	p, err := policy.NewCacheAware(c.cfg(), policy.CacheAwareOptions{Source: c.source, EngineQueueLimit: u64(4), Logger: zap.New(core)})
	require.NoError(t, err)
	for range 128 {
		_, err := p.Pick(ctx, engines(state.StagePrefill, "a", "b"), creq(prompt(32, 1)))
		require.NoError(t, err)
	}
	assert.Equal(t, 2, logs.Len(), "one warning per 64 blind picks")
	c.native("a", loadmon.Report{})
	for range 128 {
		_, _ = p.Pick(ctx, engines(state.StagePrefill, "a", "b"), creq(prompt(32, 1)))
	}
	assert.Equal(t, 2, logs.Len(), "no warning while some engine has a fresh sample")
}

func TestCacheAwareRecordsExactlyOneDecisionPerSelection(t *testing.T) {
	t.Parallel()
	c := newCacheEnv(t)
	tok := prompt(8*blockTokens, 11)
	c.hold(t, "a", tok, 8)
	p := c.policy(t, policy.CacheAwareOptions{})
	for range 5 {
		_, err := p.Pick(ctx, engines(state.StagePrefill, "a", "b"), creq(tok))
		require.NoError(t, err)
	}
	c.check.reject = map[state.EngineID]string{"a": "full", "b": "full"}
	_, err := p.Pick(ctx, engines(state.StagePrefill, "a", "b"), creq(tok))
	require.Error(t, err)
	assert.Equal(t, 5, c.dec.count())
}

func TestCacheAwareConcurrentPicksRaceEventsAndRemoval(t *testing.T) {
	t.Parallel()
	c := newCacheEnv(t)
	// Placements live 300 ms of the test clock, so that they expire while the picks run.
	idx, err := kvindex.NewIndex(c.index.Hasher(), kvindex.Options{Now: c.clk.Now, ApproxTTL: 300 * time.Millisecond})
	require.NoError(t, err)
	local, err := kvindex.NewLocalSource(idx)
	require.NoError(t, err)
	c.index, c.source = idx, &countingSource{inner: local}
	p := c.policy(t, policy.CacheAwareOptions{EngineQueueLimit: u64(3)})
	// The same over the bare LocalSource: every pick records a route-time placement, racing the
	// engines' events (which take the placed blocks), their removal and expiry.
	placed, err := policy.NewCacheAware(c.cfg(), policy.CacheAwareOptions{Source: local, EngineQueueLimit: u64(3)})
	require.NoError(t, err)
	group := engines(state.StagePrefill, "a", "b", "c")
	var wg sync.WaitGroup
	for w := range 3 {
		wg.Go(func() {
			for i := range 200 {
				tok := prompt(4*blockTokens, uint32(i%7))
				pol := policy.Policy(p)
				if (i+w)%2 == 0 {
					pol = placed
				}
				if _, err := pol.Pick(ctx, group, creq(tok)); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Go(func() {
		for i := range 200 {
			id := group[i%3].ID()
			c.hold(t, id, prompt(4*blockTokens, uint32(i%7)), 4)
			c.native(id, loadmon.Report{WaitingRequests: uint64(i % 5)})
			if i%10 == 0 {
				_ = c.index.RemoveEngine(id)
				c.load.Forget(id)
			}
			// Approximate entries for an engine without events, and their expiry (a placement
			// drops the expired ones first).
			_ = local.Place("c", 0, kvindex.Query{TokenIDs: prompt(4*blockTokens, uint32(i%7))}, nil)
			c.clk.Advance(100 * time.Millisecond)
		}
	})
	wg.Wait()
}

// A queue-gate diversion allocates no more than a cache hit: the unqueued tier of the fallback is
// built on the stack, even for a large group.
func TestCacheAwareDiversionAllocatesLikeAHit(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector changes escape analysis; allocation counts are checked without -race")
	}
	c := newCacheEnv(t)
	tok := prompt(8*blockTokens, 12)
	c.hold(t, "owner", tok, 8)
	ids := []state.EngineID{"owner"}
	for i := range 40 {
		id := state.EngineID(fmt.Sprintf("cold-%02d", i))
		ids = append(ids, id)
		c.native(id, loadmon.Report{WaitingRequests: uint64(i % 3)})
	}
	c.native("queued", loadmon.Report{WaitingRequests: 9})
	ids = append(ids, "queued")
	slices.Sort(ids) // groups hand policies their candidates sorted by ID
	group := engines(state.StagePrefill, ids...)
	cfg := c.cfg()
	cfg.Admission = admission.Limits{}
	cfg.Rand = nil
	p, err := policy.NewCacheAware(cfg, policy.CacheAwareOptions{Source: c.source, MinMatchedTokens: blockTokens, EngineQueueLimit: u64(4)})
	require.NoError(t, err)
	req := creq(tok)
	pick := func() policy.Pick {
		pk, err := p.Pick(ctx, group, req)
		require.NoError(t, err)
		return pk
	}

	c.native("owner", loadmon.Report{WaitingRequests: 0})
	require.Equal(t, label.ReasonCacheCandidate, pick().Reason)
	hitAllocs := testing.AllocsPerRun(100, func() { pick() })

	c.native("owner", loadmon.Report{WaitingRequests: 9})
	require.Equal(t, label.ReasonNoCacheCandidate, pick().Reason, "the owner is queued: diverted")
	divAllocs := testing.AllocsPerRun(100, func() { pick() })
	assert.LessOrEqual(t, divAllocs, hitAllocs, "a diversion over a 41-engine unqueued tier allocates %v, a hit %v", divAllocs, hitAllocs)
}

func TestCacheAwareRejectsTokenIDsThatDisagreeWithInputTokens(t *testing.T) {
	t.Parallel()
	c := newCacheEnv(t)
	p := c.policy(t, policy.CacheAwareOptions{})
	tok := prompt(4*blockTokens, 9)
	for _, n := range []uint64{0, uint64(len(tok)) - 1, uint64(len(tok)) + 1} {
		req := creq(tok)
		req.InputTokens = n
		_, err := p.Pick(ctx, engines(state.StagePrefill, "a", "b"), req)
		assert.ErrorIs(t, err, policy.ErrInvalidSignal, "input %d with %d token IDs", n, len(tok))
	}
	assert.Zero(t, c.source.calls.Load(), "no lookup for an inconsistent request")
	_, err := p.Pick(ctx, engines(state.StagePrefill, "a", "b"), creq(tok))
	assert.NoError(t, err)
}

// docs/design.md §9.6: holders with equal uncached tokens are ordered by stage pressure, ID last;
// without complete native data, holders within the switch margin are ordered by router-local
// in-flight requests.
func TestCacheAwareHoldersWithinTheMarginAreOrderedByPressure(t *testing.T) {
	t.Parallel()
	tok := prompt(10*blockTokens+1, 21)
	t.Run("equal holders, native: less pending prefill wins without a material gap", func(t *testing.T) {
		t.Parallel()
		c := newCacheEnv(t)
		c.hold(t, "a", tok, 10)
		c.hold(t, "b", tok, 10)
		c.native("a", loadmon.Report{Native: &loadmon.NativeLoad{WaitingUncachedTokens: 100}})
		c.native("b", loadmon.Report{Native: &loadmon.NativeLoad{WaitingUncachedTokens: 50}})
		pk, err := c.policy(t, policy.CacheAwareOptions{}).Pick(ctx, engines(state.StagePrefill, "a", "b"), creq(tok))
		require.NoError(t, err)
		assert.Equal(t, state.EngineID("b"), pk.Engine.ID())
		assert.Zero(t, c.dec.last().GuardCompared, "an exact tie in uncached tokens is not a guard comparison")
	})
	t.Run("equal holders, complete tie: lowest ID", func(t *testing.T) {
		t.Parallel()
		c := newCacheEnv(t)
		c.hold(t, "a", tok, 10)
		c.hold(t, "b", tok, 10)
		pk, err := c.policy(t, policy.CacheAwareOptions{}).Pick(ctx, engines(state.StagePrefill, "a", "b"), creq(tok))
		require.NoError(t, err)
		assert.Equal(t, state.EngineID("a"), pk.Engine.ID())
	})
	t.Run("no native data: fewer in-flight within the margin wins", func(t *testing.T) {
		t.Parallel()
		c := newCacheEnv(t)
		c.hold(t, "deep", tok, 10)   // 1 uncached
		c.hold(t, "shallow", tok, 9) // 17 uncached
		for range 3 {
			c.inflight.Acquire("deep", -1, 0)
		}
		c.inflight.Acquire("shallow", -1, 0)
		group := engines(state.StagePrefill, "deep", "shallow")
		pk, _ := c.policy(t, policy.CacheAwareOptions{SwitchMarginTokens: u64(16)}).Pick(ctx, group, creq(tok))
		assert.Equal(t, state.EngineID("shallow"), pk.Engine.ID())
		pk, _ = c.policy(t, policy.CacheAwareOptions{SwitchMarginTokens: u64(15)}).Pick(ctx, group, creq(tok))
		assert.Equal(t, state.EngineID("deep"), pk.Engine.ID(), "16 more uncached tokens is outside a 15-token margin")
	})
}

// docs/design.md §9.2: when more holders than the candidate limit lie within the switch margin, the
// cut keeps the least pressured of them, not the lowest IDs; the rest of the ranking is unchanged.
func TestCacheAwareCandidateCutKeepsTheLeastPressuredWithinTheMargin(t *testing.T) {
	t.Parallel()
	tok := prompt(10*blockTokens, 22)
	group := engines(state.StagePrefill, "e0", "e1", "e2", "e3", "far")
	setup := func() *cacheEnv {
		c := newCacheEnv(t)
		for _, id := range []state.EngineID{"e0", "e1", "e2", "e3"} {
			c.hold(t, id, tok, 10)
		}
		c.hold(t, "far", tok, 2) // 128 uncached: outside the margin
		return c
	}
	c := setup()
	for id, pending := range map[state.EngineID]uint64{"e0": 300, "e1": 0, "e2": 200, "e3": 100, "far": 0} {
		c.native(id, loadmon.Report{Native: &loadmon.NativeLoad{WaitingUncachedTokens: pending}})
	}
	opts := policy.CacheAwareOptions{CandidateMinEngines: 2, CandidateMaxEngines: 2, SwitchMarginTokens: u64(64)}
	pk, err := c.policy(t, opts).Pick(ctx, group, creq(tok))
	require.NoError(t, err)
	assert.Equal(t, []state.EngineID{"e1", "e3"}, c.check.Calls(), "native: the two least pending, in ID order")
	assert.Equal(t, state.EngineID("e1"), pk.Engine.ID())

	c = setup()
	c.inflight.Acquire("e0", -1, 0)
	c.inflight.Acquire("e1", -1, 0)
	c.inflight.Acquire("e1", -1, 0)
	_, err = c.policy(t, opts).Pick(ctx, group, creq(tok))
	require.NoError(t, err)
	assert.Equal(t, []state.EngineID{"e2", "e3"}, c.check.Calls(), "no reports: the two fewest in flight, ID last")

	c = setup()
	_, err = c.policy(t, policy.CacheAwareOptions{CandidateMinEngines: 5, CandidateMaxEngines: 5}).Pick(ctx, group, creq(tok))
	require.NoError(t, err)
	assert.Equal(t, []state.EngineID{"e0", "e1", "e2", "e3", "far"}, c.check.Calls(), "under the limit: rank order")
}

// docs/design.md §9.3: an engine without a fresh report passes the queue gate only while its
// router-local in-flight count is below the limit, for holders and for the fallback's tier.
func TestCacheAwareUnknownLoadPassesTheGateOnlyBelowTheLimitInFlight(t *testing.T) {
	t.Parallel()
	tok := prompt(10*blockTokens, 23)
	c := newCacheEnv(t)
	c.hold(t, "holder", tok, 10) // never reports
	c.native("cold", loadmon.Report{WaitingRequests: 0})
	group := engines(state.StagePrefill, "cold", "holder")
	p := c.policy(t, policy.CacheAwareOptions{EngineQueueLimit: u64(2)})
	c.inflight.Acquire("holder", -1, 0)
	pk, err := p.Pick(ctx, group, creq(tok))
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("holder"), pk.Engine.ID(), "1 in flight < limit 2: unknown fails open")
	c.inflight.Acquire("holder", -1, 0)
	pk, err = p.Pick(ctx, group, creq(tok))
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("cold"), pk.Engine.ID(), "2 in flight: set aside")
	d := c.dec.last()
	assert.Equal(t, label.DecisionCacheWorkerQueued, d.Decision)
	assert.Equal(t, 1, d.GateRejected)
	assert.False(t, d.FleetAllQueued, "unknown is never proof of a queue")

	// Miss: the unqueued tier excludes the unknown engine at the limit, whatever the sample says.
	c.rnd.vals = []int{1, 0}
	pk, err = p.Pick(ctx, group, creq(prompt(10*blockTokens, 24)))
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("cold"), pk.Engine.ID())
}

// TestCacheAwarePartialDiversionRecordsForfeitedBlocks checks CacheDecision.ForfeitedBlocks
// (docs/design.md §9.8): when the queue gate sets the deepest holder aside and a shallower holder
// wins, the decision is a cache_hit that records the prefix given up; a winner at full depth, an
// all-queued re-admission and a full diversion record none.
func TestCacheAwarePartialDiversionRecordsForfeitedBlocks(t *testing.T) {
	t.Parallel()
	tok := prompt(8*blockTokens, 11)
	group := engines(state.StagePrefill, "cold", "deep", "shallow")
	for _, tc := range []struct {
		name                       string
		deep, shallow, cold        uint64 // waiting requests
		deepUncached               uint64 // deep's waiting uncached tokens
		winner                     state.EngineID
		decision                   string
		forfeited, diverted, gated int
	}{
		{"deepest holder queued, shallower wins", 4, 0, 0, 0, "shallow", label.DecisionCacheHit, 5, 0, 1},
		{"nothing queued", 0, 0, 0, 0, "deep", label.DecisionCacheHit, 0, 0, 0},
		{"shallower holder queued", 0, 4, 0, 0, "deep", label.DecisionCacheHit, 0, 0, 1},
		{"every holder queued", 4, 4, 0, 0, "cold", label.DecisionCacheWorkerQueued, 0, 8, 2},
		{"all queued: re-admitted, nothing forfeited", 4, 5, 6, 0, "deep", label.DecisionCacheHit, 0, 0, 2},
		// Re-admitted, then the pressure guard (not the gate) prefers the shallower holder.
		{"all queued: the guard's choice is not a diversion", 4, 5, 6, 100_000, "shallow", label.DecisionCacheHit, 0, 0, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCacheEnv(t)
			c.hold(t, "deep", tok, 8)
			c.hold(t, "shallow", tok, 3)
			c.native("deep", loadmon.Report{WaitingRequests: tc.deep, Native: &loadmon.NativeLoad{WaitingUncachedTokens: tc.deepUncached}})
			c.native("shallow", loadmon.Report{WaitingRequests: tc.shallow})
			c.native("cold", loadmon.Report{WaitingRequests: tc.cold})
			pk, err := c.policy(t, policy.CacheAwareOptions{EngineQueueLimit: u64(4)}).Pick(ctx, group, creq(tok))
			require.NoError(t, err)
			assert.Equal(t, tc.winner, pk.Engine.ID())
			d := c.dec.last()
			assert.Equal(t, tc.decision, d.Decision)
			assert.Equal(t, tc.forfeited, d.ForfeitedBlocks, "forfeited blocks")
			assert.Equal(t, tc.diverted, d.DivertedBlocks, "diverted blocks")
			assert.Equal(t, tc.gated, d.GateRejected)
		})
	}
}

// A cache-aware pick without a Memo or an observer allocates nothing: the lookup's result, its
// keys (kept for the route-time placement) and the decision record live in pooled scratch
// (docs/performance.md, "kvindex at production scale"). A hit on a prompt the winner holds whole
// (after the first pick recorded its placement), and a miss with placements off (recording a
// new prompt grows the index).
func TestCacheAwarePickWithoutMemoAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector changes escape analysis; allocation counts are checked without -race")
	}
	c := newCacheEnv(t)
	tok := prompt(16*blockTokens, 21)
	c.hold(t, "a", tok, 8)
	group := engines(state.StagePrefill, "a", "b", "c")
	for _, id := range []state.EngineID{"a", "b", "c"} {
		c.native(id, loadmon.Report{})
	}
	for _, off := range []bool{false, true} {
		p, err := policy.NewCacheAware(c.cfg(), policy.CacheAwareOptions{Source: c.source, MinMatchedTokens: blockTokens, DisableRoutePlacements: off})
		require.NoError(t, err)
		// The request is built once, as the bucket's pooled one is: a call through the Policy
		// interface lets it escape.
		pick := func(req *policy.Request) policy.Pick {
			pk, err := p.Pick(ctx, group, req)
			require.NoError(t, err)
			return pk
		}
		hit := creq(tok)
		require.Equal(t, label.ReasonCacheCandidate, pick(hit).Reason)
		assert.Zero(t, testing.AllocsPerRun(100, func() { pick(hit) }), "a hit (placements off: %v)", off)
		if off {
			cold := creq(prompt(16*blockTokens, 22))
			require.Equal(t, label.ReasonNoCacheCandidate, pick(cold).Reason)
			assert.Zero(t, testing.AllocsPerRun(100, func() { pick(cold) }), "a miss")
		}
	}
}
