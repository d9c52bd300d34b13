package policy_test

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// loadPolicies builds every load-aware policy over env e, each named by its configuration name.
func loadPolicies(t *testing.T, c *cacheEnv) map[string]policy.Policy {
	t.Helper()
	least, err := policy.NewLeastLoad(c.cfg())
	require.NoError(t, err)
	p2, err := policy.NewPowerOfN(c.cfg(), 2)
	require.NoError(t, err)
	p3, err := policy.NewPowerOfN(c.cfg(), 3)
	require.NoError(t, err)
	return map[string]policy.Policy{
		"least_load":   least,
		"power_of_two": p2,
		"power_of_n":   p3,
		"cache_aware":  c.policy(t, policy.CacheAwareOptions{}),
	}
}

// loraReport reports a basic (vLLM /metrics-like) load with LoRA residency for engine id.
func loraReport(t *testing.T, c *cacheEnv, id state.EngineID, running, waiting uint64, residency *loadmon.LoRALoad) {
	t.Helper()
	require.NoError(t, c.load.Report(loadmon.Report{Engine: id, RunningRequests: running, WaitingRequests: waiting, LoRA: residency}))
}

func lreq(stage state.Stage, adapter string, tokens []uint32) *policy.Request {
	return &policy.Request{Model: "m", Stage: stage, BucketID: "b", InputTokens: uint64(len(tokens)), TokenIDs: tokens, Adapter: adapter}
}

// TestLoadPoliciesPreferTheAdapter: every load-aware policy sends a request for a LoRA adapter,
// among engines equal on their waiting figures, to the engine running the adapter, else one with
// a free slot, else one where its requests wait, never before one that would evict an adapter in
// use; a queue is not comparable, and unknown residency is neutral. The engines are listed so that
// a complete tie keeps the first (the scripted random source answers 1), which the adapter rule
// must overturn.
func TestLoadPoliciesPreferTheAdapter(t *testing.T) {
	t.Parallel()
	full := &loadmon.LoRALoad{MaxAdapters: 2, Running: []string{"B", "C"}}
	running := &loadmon.LoRALoad{MaxAdapters: 2, Running: []string{"A", "B"}}
	free := &loadmon.LoRALoad{MaxAdapters: 2, Running: []string{"B"}}
	waiting := &loadmon.LoRALoad{MaxAdapters: 2, Running: []string{"B", "C"}, Waiting: []string{"A"}}
	type eng struct {
		running, waiting uint64
		lora             *loadmon.LoRALoad
	}
	cases := []struct {
		name    string
		a, b, c eng
		adapter string
		want    state.EngineID
	}{
		{"running beats full at equal load", eng{2, 0, full}, eng{2, 0, running}, eng{2, 0, full}, "A", "http://b"},
		{"a free slot beats full", eng{1, 0, full}, eng{1, 0, free}, eng{1, 0, full}, "A", "http://b"},
		{"waiting beats full", eng{1, 0, full}, eng{1, 0, waiting}, eng{1, 0, full}, "A", "http://b"},
		{"running beats a free slot", eng{3, 0, free}, eng{3, 0, running}, eng{3, 0, free}, "A", "http://b"},
		{"a queue is not comparable: the engine without one wins", eng{1, 0, full}, eng{1, 1, running}, eng{1, 1, running}, "A", "http://a"},
		{"unknown residency is neutral: the tie keeps the first", eng{2, 0, nil}, eng{2, 0, running}, eng{2, 0, nil}, "A", "http://a"},
		{"a base-model request ignores residency", eng{2, 0, full}, eng{2, 0, running}, eng{2, 0, full}, "", "http://a"},
	}
	group := engines(state.StagePrefill, "http://a", "http://b", "http://c")
	for _, tc := range cases {
		c := newCacheEnv(t)
		for i, e := range []eng{tc.a, tc.b, tc.c} {
			loraReport(t, c, group[i].ID(), e.running, e.waiting, e.lora)
		}
		for name, p := range loadPolicies(t, c) {
			// Ties keep the first: a sampling policy (power-of-two, cache-aware's miss fallback)
			// samples a then b; an exact scan keeps its incumbent on every tie.
			c.rnd.vals = []int{1, 1, 1, 1}
			if name == "power_of_two" || name == "cache_aware" {
				c.rnd.vals = []int{0, 1}
			}
			pk, err := p.Pick(ctx, group, lreq(state.StagePrefill, tc.adapter, prompt(4*blockTokens, 9)))
			require.NoError(t, err, "%s: %s", tc.name, name)
			assert.Equal(t, tc.want, pk.Engine.ID(), "%s: %s", tc.name, name)
		}
	}
}

// TestLeastLoadAdapterBreaksTiesOnLoadOnly: least_load's band is its load score: the adapter's
// residency decides between engines of equal waiting + running requests, never against a lower
// score.
func TestLeastLoadAdapterBreaksTiesOnLoadOnly(t *testing.T) {
	t.Parallel()
	c := newCacheEnv(t)
	loraReport(t, c, "http://a", 1, 0, &loadmon.LoRALoad{MaxAdapters: 1, Running: []string{"B"}})
	loraReport(t, c, "http://b", 2, 0, &loadmon.LoRALoad{MaxAdapters: 1, Running: []string{"A"}})
	p, err := policy.NewLeastLoad(c.cfg())
	require.NoError(t, err)
	group := engines(state.StagePlain, "http://a", "http://b")
	pk, err := p.Pick(ctx, group, lreq(state.StagePlain, "A", nil))
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("http://a"), pk.Engine.ID(), "score 1 beats score 2 whatever the residency")
	c.inflight.Acquire("http://b", -1, 0) // a dispatch since b's report: its score is 3
	c.clk.Advance(time.Millisecond)
	loraReport(t, c, "http://a", 2, 0, &loadmon.LoRALoad{MaxAdapters: 1, Running: []string{"B"}})
	pk, err = p.Pick(ctx, group, lreq(state.StagePlain, "A", nil))
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("http://a"), pk.Engine.ID())
	c.clk.Advance(time.Millisecond)
	loraReport(t, c, "http://b", 2, 0, &loadmon.LoRALoad{MaxAdapters: 1, Running: []string{"A"}})
	loraReport(t, c, "http://a", 2, 0, &loadmon.LoRALoad{MaxAdapters: 1, Running: []string{"B"}})
	c.rnd.vals = []int{1, 1}
	pk, err = p.Pick(ctx, group, lreq(state.StagePlain, "A", nil))
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("http://b"), pk.Engine.ID(), "equal scores: the adapter before in-flight")
}

// TestBaseRequestsIgnoreLoRAReports: for base-model requests every load-aware policy picks exactly
// as it does without LoRA reports, over many random fleets.
func TestBaseRequestsIgnoreLoRAReports(t *testing.T) {
	t.Parallel()
	group := engines(state.StagePrefill, "http://a", "http://b", "http://c", "http://d")
	rng := rand.New(rand.NewPCG(7, 11))
	names := []string{"A", "B", "C"}
	for round := range 200 {
		type eng struct {
			running, waiting uint64
			lora             *loadmon.LoRALoad
		}
		fleet := make([]eng, len(group))
		for i := range fleet {
			l := &loadmon.LoRALoad{MaxAdapters: 1 + rng.IntN(2)}
			for _, n := range names {
				switch rng.IntN(3) {
				case 0:
					l.Running = append(l.Running, n)
				case 1:
					l.Waiting = append(l.Waiting, n)
				}
			}
			fleet[i] = eng{uint64(rng.IntN(3)), uint64(rng.IntN(2)), l}
		}
		draws := []int{rng.IntN(4), rng.IntN(4), rng.IntN(4), rng.IntN(4), rng.IntN(4), rng.IntN(4)}
		tokens := prompt(4*blockTokens, uint32(round))
		picks := map[bool]map[string]state.EngineID{}
		for _, withLoRA := range []bool{false, true} {
			c := newCacheEnv(t)
			if round%2 == 0 { // half the rounds with a cache hit
				c.hold(t, group[round%4].ID(), tokens, 3)
			}
			for i, e := range fleet {
				r := e.lora
				if !withLoRA {
					r = nil
				}
				loraReport(t, c, group[i].ID(), e.running, e.waiting, r)
			}
			picks[withLoRA] = map[string]state.EngineID{}
			for name, p := range loadPolicies(t, c) {
				c.rnd.vals = append([]int(nil), draws...)
				pk, err := p.Pick(ctx, group, lreq(state.StagePrefill, "", tokens))
				require.NoError(t, err)
				picks[withLoRA][name] = pk.Engine.ID()
			}
		}
		require.Equal(t, picks[false], picks[true], "round %d: fleet %+v", round, fleet)
	}
}

// TestCacheAwareMatchesOnlyTheAdaptersBlocks: a cache-aware request for adapter A matches the
// blocks stored under A, never the base model's, and a base request never A's.
func TestCacheAwareMatchesOnlyTheAdaptersBlocks(t *testing.T) {
	t.Parallel()
	c := newCacheEnv(t)
	tok := prompt(8*blockTokens, 3)
	c.hold(t, "http://base", tok, 8) // the base model's blocks, deepest
	hs := c.hashesFor(4)
	require.NoError(t, c.index.Store(kvindex.StoreEvent{Engine: "http://lora", BlockHashes: hs,
		TokenIDs: tok[:4*blockTokens], Tier: kvindex.TierDevice, Adapter: "A"}))
	group := engines(state.StagePrefill, "http://base", "http://idle", "http://lora")
	for _, id := range []state.EngineID{"http://base", "http://idle", "http://lora"} {
		loraReport(t, c, id, 0, 0, nil)
	}
	p := c.policy(t, policy.CacheAwareOptions{DisableRoutePlacements: true})
	for _, tc := range []struct {
		adapter string
		want    state.EngineID
		uncache uint64
	}{{"A", "http://lora", 8*blockTokens - 4*blockTokens}, {"", "http://base", blockTokens}} {
		pk, err := p.Pick(ctx, group, lreq(state.StagePrefill, tc.adapter, tok))
		require.NoError(t, err)
		assert.Equal(t, tc.want, pk.Engine.ID(), "adapter %q", tc.adapter)
		assert.Equal(t, label.ReasonCacheCandidate, pk.Reason, "adapter %q", tc.adapter)
		assert.Equal(t, tc.uncache, pk.PrefillTokens, "adapter %q", tc.adapter)
	}
}

// TestCacheAwareCostNeverDivertsToAFullEngine: the cost comparison would move a request from its
// busy holder to an idle engine, but not to one with no slot for the request's adapter.
func TestCacheAwareCostNeverDivertsToAFullEngine(t *testing.T) {
	t.Parallel()
	tok := prompt(4*blockTokens, 5)
	for _, tc := range []struct {
		name    string
		idle    *loadmon.LoRALoad
		adapter string
		want    state.EngineID
		reason  string
	}{
		{"the idle engine has a free slot: diverted", &loadmon.LoRALoad{MaxAdapters: 2, Running: []string{"B"}}, "A", "http://idle", label.ReasonCostDiverted},
		{"the idle engine is full: the holder keeps it", &loadmon.LoRALoad{MaxAdapters: 1, Running: []string{"B"}}, "A", "http://holder", label.ReasonCacheCandidate},
		{"a base request is diverted whatever the adapters", &loadmon.LoRALoad{MaxAdapters: 1, Running: []string{"B"}}, "", "http://idle", label.ReasonCostDiverted},
	} {
		c := newCacheEnv(t)
		hs := c.hashesFor(3)
		require.NoError(t, c.index.Store(kvindex.StoreEvent{Engine: "http://holder", BlockHashes: hs,
			TokenIDs: tok[:3*blockTokens], Tier: kvindex.TierDevice, Adapter: tc.adapter}))
		c.native("http://holder", loadmon.Report{WaitingRequests: 10, Native: &loadmon.NativeLoad{WaitingUncachedTokens: 50_000},
			LoRA: &loadmon.LoRALoad{MaxAdapters: 2, Running: []string{"A"}}})
		c.native("http://idle", loadmon.Report{LoRA: tc.idle})
		p := c.policy(t, policy.CacheAwareOptions{DisableRoutePlacements: true})
		pk, err := p.Pick(ctx, engines(state.StagePrefill, "http://holder", "http://idle"), lreq(state.StagePrefill, tc.adapter, tok))
		require.NoError(t, err, tc.name)
		assert.Equal(t, tc.want, pk.Engine.ID(), tc.name)
		assert.Equal(t, tc.reason, pk.Reason, tc.name)
	}
}
