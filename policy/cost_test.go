package policy_test

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// pending reports a fresh native load with the given waiting uncached tokens.
func (c *cacheEnv) pending(id state.EngineID, tokens uint64) {
	c.native(id, loadmon.Report{Native: &loadmon.NativeLoad{WaitingUncachedTokens: tokens}})
}

// docs/design.md §9.11. A 256-token prompt; "holder" holds its first 128 tokens (the system
// prompt, at the 16-token hit gate of these tests), "idle" and "other" hold nothing. cost =
// pending + uncached; the alternative must save more than the margin (here 64 tokens) and more
// than twice the 128 tokens of prefix it recomputes: every engine has pending work ("idle" 1
// token), so the whole factor applies.
func TestCostComparisonMovesARequestOffABusyHolderOnlyWhenMateriallyCheaper(t *testing.T) {
	t.Parallel()
	tok := prompt(256, 31)
	group := engines(state.StagePrefill, "holder", "idle", "other")
	for _, tt := range []struct {
		name          string
		holderPending uint64
		opts          policy.CacheAwareOptions
		want          state.EngineID
		reason        string
	}{
		// holder 300 + 128 = 428 vs idle 1 + 256: saves 171 > 64, but not > 2 × 128.
		{"saving below twice the recomputed prefix", 300, policy.CacheAwareOptions{}, "holder", label.ReasonCacheCandidate},
		// holder 400 + 128 = 528: saves 271 > 256.
		{"saving above twice the recomputed prefix", 400, policy.CacheAwareOptions{}, "idle", label.ReasonCostDiverted},
		{"factor 1 moves earlier", 300, policy.CacheAwareOptions{RecomputeFactor: 1}, "idle", label.ReasonCostDiverted},
		{"margin above the saving", 400, policy.CacheAwareOptions{CostMarginTokens: u64(271)}, "holder", label.ReasonCacheCandidate},
		{"disabled: the upstream rules alone", 1 << 20, policy.CacheAwareOptions{DisableCostComparison: true}, "holder", label.ReasonCacheCandidate},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c := newCacheEnv(t)
			c.hold(t, "holder", tok, 8)
			c.pending("holder", tt.holderPending)
			c.pending("idle", 1)
			c.pending("other", 50)
			opts := tt.opts
			if opts.CostMarginTokens == nil {
				opts.CostMarginTokens = u64(64)
			}
			pk, err := c.policy(t, opts).Pick(ctx, group, creq(tok))
			require.NoError(t, err)
			assert.Equal(t, tt.want, pk.Engine.ID())
			assert.Equal(t, tt.reason, pk.Reason)
			d := c.dec.last()
			if tt.want == "idle" {
				assert.Equal(t, label.DecisionCostDiverted, d.Decision)
				assert.Equal(t, 8, d.DivertedBlocks, "the 8 blocks the holder held")
				assert.True(t, d.CostOverride)
				assert.Equal(t, uint64(256), pk.PrefillTokens, "the idle engine prefills the whole prompt")
				assert.Equal(t, []state.EngineID{"holder", "idle"}, c.check.Calls(), "admission once on the holder, once on the alternative")
			} else {
				assert.Equal(t, label.DecisionCacheHit, d.Decision)
				assert.False(t, d.CostOverride)
				assert.Equal(t, uint64(128), pk.PrefillTokens)
				assert.Equal(t, []state.EngineID{"holder"}, c.check.Calls())
			}
		})
	}
}

// docs/design.md §9.11: the recompute factor is weighed by the share of priced engines that have
// pending prefill work. The same request as above: "holder" (300 pending, 128 uncached) costs 428,
// "idle" (0 pending, 256 uncached) costs 256, a saving of 172 tokens for 128 tokens of extra
// prefill. With the default factor 2 the threshold is 2 × busy ÷ 4 × 128 tokens.
func TestCostComparisonWeighsRecomputationByTheShareOfBusyEngines(t *testing.T) {
	t.Parallel()
	tok := prompt(256, 31)
	group := engines(state.StagePrefill, "holder", "idle", "x", "y")
	for _, tt := range []struct {
		name string
		x, y uint64 // pending tokens of the two other engines
		want state.EngineID
	}{
		// busy 1 of 4: threshold 64 < 172. Under a fixed factor 2 (256) the holder kept it.
		{"only the holder is busy", 0, 0, "idle"},
		// busy 2 of 4: threshold 128 < 172.
		{"half the engines busy", 50, 0, "idle"},
		// busy 3 of 4: threshold 192 > 172.
		{"most engines busy", 50, 50, "holder"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c := newCacheEnv(t)
			c.hold(t, "holder", tok, 8)
			c.pending("holder", 300)
			c.pending("idle", 0)
			c.pending("x", tt.x)
			c.pending("y", tt.y)
			pk, err := c.policy(t, policy.CacheAwareOptions{CostMarginTokens: u64(64)}).Pick(ctx, group, creq(tok))
			require.NoError(t, err)
			assert.Equal(t, tt.want, pk.Engine.ID())
			assert.Equal(t, tt.want == "idle", c.dec.last().CostOverride)
		})
	}
}

// The collapse the comparison prevents: every request carries the same 128-token system prompt
// and one engine holds it. Without the comparison every request goes to that engine; with it the
// requests held open spread as soon as its queue outweighs recomputing the prompt.
func TestCostComparisonPreventsLockInOnASharedPrefix(t *testing.T) {
	t.Parallel()
	system := prompt(128, 32)
	group := engines(state.StagePrefill, "e0", "e1", "e2", "e3")
	run := func(disable bool) map[state.EngineID]int {
		c := newCacheEnv(t)
		c.hold(t, "e0", system, 8)
		for _, id := range []state.EngineID{"e0", "e1", "e2", "e3"} {
			c.pending(id, 0)
		}
		p := c.policy(t, policy.CacheAwareOptions{DisableCostComparison: disable, CostMarginTokens: u64(0)})
		got := map[state.EngineID]int{}
		for i := range 40 {
			tok := append(append([]uint32(nil), system...), prompt(128, uint32(100+i))...)
			pk, err := p.Pick(ctx, group, creq(tok))
			require.NoError(t, err)
			got[pk.Engine.ID()]++
			c.inflight.Acquire(pk.Engine.ID(), -1, pk.PrefillTokens) // dispatched, never reported
		}
		return got
	}
	assert.Equal(t, map[state.EngineID]int{"e0": 40}, run(true), "upstream rules: the first holder takes everything")
	got := run(false)
	for _, id := range []state.EngineID{"e0", "e1", "e2", "e3"} {
		assert.GreaterOrEqual(t, got[id], 5, "engine %s; picks %v", id, got)
	}
}

func TestCostComparisonPicksTheCheapestHolder(t *testing.T) {
	t.Parallel()
	tok := prompt(256, 33)
	c := newCacheEnv(t)
	c.hold(t, "deep", tok, 16)   // 0 uncached
	c.hold(t, "shallow", tok, 8) // 128 uncached, outside a 16-token switch margin
	c.pending("deep", 2000)
	c.pending("shallow", 0)
	p := c.policy(t, policy.CacheAwareOptions{SwitchMarginTokens: u64(16), CostMarginTokens: u64(64)})
	pk, err := p.Pick(ctx, engines(state.StagePrefill, "deep", "shallow"), creq(tok))
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("shallow"), pk.Engine.ID(), "2000 + 0 against 0 + 128")
	assert.Equal(t, label.ReasonCacheCandidate, pk.Reason)
	assert.Equal(t, label.DecisionCacheHit, c.dec.last().Decision)
	assert.True(t, c.dec.last().CostOverride)
}

func TestCostComparisonNeedsAFreshReportEverywhereAndKeepsTheWinnerOnRejection(t *testing.T) {
	t.Parallel()
	tok := prompt(256, 34)
	group := engines(state.StagePrefill, "holder", "idle", "silent")
	t.Run("an engine without a fresh report: no comparison", func(t *testing.T) {
		t.Parallel()
		c := newCacheEnv(t)
		c.hold(t, "holder", tok, 8)
		c.pending("holder", 1<<20)
		c.pending("idle", 0)
		pk, err := c.policy(t, policy.CacheAwareOptions{}).Pick(ctx, group, creq(tok))
		require.NoError(t, err)
		assert.Equal(t, state.EngineID("holder"), pk.Engine.ID())
	})
	t.Run("an engine without native figures is priced on its waiting requests", func(t *testing.T) {
		t.Parallel()
		c := newCacheEnv(t)
		c.hold(t, "holder", tok, 8)
		c.pending("holder", 1<<20)
		require.NoError(t, c.load.Report(loadmon.Report{Engine: "idle", WaitingRequests: 1})) // an old publisher
		require.NoError(t, c.load.Report(loadmon.Report{Engine: "silent", WaitingRequests: 2}))
		pk, err := c.policy(t, policy.CacheAwareOptions{}).Pick(ctx, group, creq(tok))
		require.NoError(t, err)
		assert.Equal(t, state.EngineID("idle"), pk.Engine.ID(), "1 waiting request priced at 256 tokens, against 1 Mi")
		assert.True(t, c.dec.last().CostOverride)
	})
	t.Run("the alternative is rejected by admission: the holder stays", func(t *testing.T) {
		t.Parallel()
		c := newCacheEnv(t)
		c.hold(t, "holder", tok, 8)
		c.pending("holder", 1<<20)
		c.pending("idle", 0)
		c.pending("silent", 10)
		c.check.reject = map[state.EngineID]string{"idle": admission.LimitRunningRequests}
		pk, err := c.policy(t, policy.CacheAwareOptions{}).Pick(ctx, group, creq(tok))
		require.NoError(t, err)
		assert.Equal(t, state.EngineID("holder"), pk.Engine.ID())
		assert.Equal(t, []state.EngineID{"holder", "idle"}, c.check.Calls(), "one check each, no second alternative")
	})
}

// On a miss the power-of-k sample's winner is compared with the cheapest engine of the tier.
func TestCostComparisonOnAMissTakesTheCheapestOfTheTier(t *testing.T) {
	t.Parallel()
	tok := prompt(256, 35)
	c := newCacheEnv(t)
	for id, pend := range map[state.EngineID]uint64{"a": 5000, "b": 6000, "c": 0, "d": 7000} {
		// Eight running requests no dispatch here explains: another router sends to the group,
		// so the fallback samples (docs/design.md §9.9).
		c.native(id, loadmon.Report{RunningRequests: 8, Native: &loadmon.NativeLoad{WaitingUncachedTokens: pend}})
	}
	group := engines(state.StagePrefill, "a", "b", "c", "d")
	c.rnd.vals = []int{0, 1} // the sample is a and b
	pk, err := c.policy(t, policy.CacheAwareOptions{}).Pick(ctx, group, creq(tok))
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("c"), pk.Engine.ID())
	assert.Equal(t, label.ReasonNoCacheCandidate, pk.Reason)
	assert.True(t, c.dec.last().CostOverride)
	assert.Equal(t, []state.EngineID{"c"}, c.check.Calls(), "admission once, on the engine returned")

	c.rnd.vals = []int{0, 1}
	c.check.calls = nil
	pk, err = c.policy(t, policy.CacheAwareOptions{DisableCostComparison: true}).Pick(ctx, group, creq(tok))
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("a"), pk.Engine.ID(), "the sample's winner")
}

// docs/design.md §9.10: a pick records the prompt for the engine it chose, so the next request with
// that prefix finds a holder before any KV event; the entry expires unless a real event confirms
// it, and the option turns the recording off.
func TestRoutePlacementsAreRecordedExpireAndCanBeTurnedOff(t *testing.T) {
	t.Parallel()
	tok := prompt(256, 36)
	group := engines(state.StagePrefill, "a", "b", "c")
	newPolicy := func(c *cacheEnv, disable bool) policy.Policy {
		src, err := kvindex.NewLocalSource(c.index) // a Placer; the counting wrapper is not
		require.NoError(t, err)
		return c.policy(t, policy.CacheAwareOptions{Source: src, DisableRoutePlacements: disable})
	}
	c := newCacheEnv(t)
	p := newPolicy(c, false)
	first, err := p.Pick(ctx, group, creq(tok))
	require.NoError(t, err)
	m := c.index.Match(c.index.Hasher().Keys(tok))
	assert.Equal(t, []kvindex.EngineMatch{{Engine: first.Engine.ID(), Blocks: 16}}, m.Engines, "every block, for the chosen engine")
	second, err := p.Pick(ctx, group, creq(append(append([]uint32(nil), tok...), prompt(64, 37)...)))
	require.NoError(t, err)
	assert.Equal(t, first.Engine.ID(), second.Engine.ID())
	assert.Equal(t, label.ReasonCacheCandidate, second.Reason)

	c.clk.Advance(approxTTL + time.Second)
	assert.Empty(t, c.index.Match(c.index.Hasher().Keys(tok)).Engines, "unconfirmed placements expire")

	c = newCacheEnv(t)
	p = newPolicy(c, true)
	_, err = p.Pick(ctx, group, creq(tok))
	require.NoError(t, err)
	assert.Empty(t, c.index.Match(c.index.Hasher().Keys(tok)).Engines, "DisableRoutePlacements")
	assert.Zero(t, c.index.Stats().ApproximateBlocks)
}

// A pick's prefix view starts empty: what the previous pick's lookup found (its scratch is pooled)
// must not price the next request. "h" holds all of prompt A; prompt B is cold. For B, the
// fallback takes "o" (less pending work) and the cost comparison keeps it: h costs 200 + 2,048
// tokens against o's 100 + 2,048. Had h kept A's 2,048 matched tokens, it would cost 200 and win.
func TestCostComparisonDoesNotSeeThePreviousPicksPrefix(t *testing.T) {
	c := newCacheEnv(t)
	a, b := prompt(2048, 41), prompt(2048, 42)
	c.hold(t, "h", a, 128)
	c.pending("h", 200)
	c.pending("o", 100)
	group := engines(state.StagePrefill, "h", "o")
	p := c.policy(t, policy.CacheAwareOptions{DisableRoutePlacements: true})
	pk, err := p.Pick(ctx, group, creq(a))
	require.NoError(t, err)
	require.Equal(t, state.EngineID("h"), pk.Engine.ID())
	pk, err = p.Pick(ctx, group, creq(b))
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("o"), pk.Engine.ID())
	assert.Equal(t, label.ReasonNoCacheCandidate, pk.Reason)
	assert.False(t, c.dec.last().CostOverride)
}

// The cost comparison skips its scan of the group's other engines when even their uncached
// tokens alone keep the winner within the cost margin (cheaper, "materially cheaper" in
// docs/design.md §9.11). The skip must never change a pick: over random groups, holdings, loads
// (some engines without native data), hit thresholds, queue limits, margins and factors, a policy with the skip and one that
// always scans pick the same engine for the same reason and report the same decision, and both
// the skip and the scan happen.
func TestCostComparisonSkipsOnlyScansThatCannotChangeThePick(t *testing.T) {
	t.Parallel()
	ids := []state.EngineID{"e0", "e1", "e2", "e3", "e4", "e5"}
	group := engines(state.StagePrefill, ids...)
	skipped, scanned, diverted := 0, 0, 0
	for seed := range uint64(400) {
		rng := rand.New(rand.NewPCG(seed, 0xc057))
		c := newCacheEnv(t)
		tok := prompt(blockTokens*(4+rng.IntN(60)), uint32(seed))
		nb := len(tok) / blockTokens
		for _, id := range ids {
			if rng.IntN(3) > 0 {
				c.hold(t, id, tok, 1+rng.IntN(nb))
			}
			switch r := rng.IntN(10); {
			case r == 0: // no native data: the coverage rule keeps the winner
				require.NoError(t, c.load.Report(loadmon.Report{Engine: id, WaitingRequests: 1}))
			default:
				pending := uint64(0)
				if r >= 4 {
					pending = uint64(rng.IntN(4 * len(tok)))
				}
				c.native(id, loadmon.Report{WaitingRequests: uint64(rng.IntN(3)),
					Native: &loadmon.NativeLoad{WaitingUncachedTokens: pending}})
			}
		}
		opts := policy.CacheAwareOptions{
			Source: c.source,
			// Holders below the threshold are not candidates, but the scan prices them with
			// their cached tokens; a queue limit sets queued holders aside.
			MinMatchedTokens:       blockTokens * []uint64{1, 4, 16}[rng.IntN(3)],
			EngineQueueLimit:       []*uint64{nil, u64(2)}[rng.IntN(2)],
			DisableRoutePlacements: true, // both picks see the same index
			CostMarginTokens:       u64([]uint64{0, 16, 64, 512}[rng.IntN(4)]),
			RecomputeFactor:        []float64{0, 1, 4}[rng.IntN(3)],
			Observer:               c.dec,
		}
		var picks [2]policy.Pick
		var decs [2]policy.CacheDecision
		var scans [2]int
		for i, always := range []bool{false, true} {
			cfg := c.cfg()
			cfg.Rand = rand.New(rand.NewPCG(seed, 1)).IntN // the same draws for both
			p, err := policy.NewCacheAware(cfg, opts)
			require.NoError(t, err)
			policy.SetCostScan(p, always, func() { scans[i]++ })
			picks[i], err = p.Pick(ctx, group, creq(tok))
			require.NoError(t, err)
			decs[i] = c.dec.last()
		}
		require.Equal(t, picks[1].Engine.ID(), picks[0].Engine.ID(), "seed %d", seed)
		require.Equal(t, picks[1].Reason, picks[0].Reason, "seed %d", seed)
		require.Equal(t, picks[1].PrefillTokens, picks[0].PrefillTokens, "seed %d", seed)
		require.Equal(t, decs[1], decs[0], "seed %d", seed)
		switch {
		case scans[0] < scans[1]:
			skipped++
		case scans[0] > 0:
			scanned++
		}
		if decs[0].Decision == label.DecisionCostDiverted {
			diverted++
		}
	}
	t.Logf("skipped %d, scanned %d, diverted %d of 400", skipped, scanned, diverted)
	assert.Greater(t, skipped, 40, "picks whose scan was skipped")
	assert.Greater(t, scanned, 40, "picks that scanned with the skip on")
	assert.Greater(t, diverted, 10, "picks the scan diverted")
}

// A match below the hit gate is a miss for the cost comparison too: it earns no credit, so a
// shared prefix shorter than the gate (a system prompt) does not draw traffic to its holders
// (docs/design.md §9.1, §9.11). Prompt of 256 tokens, gate 128: "w" holds all 16 blocks, serving
// 240 tokens, with 250 pending (cost 266), "near" holds 7 blocks, 112 tokens, below the gate (cost
// 256, not 144), "far" holds nothing (cost 256). Saving 10 tokens does not pay the 240 tokens of
// recomputation (threshold 2 × 1/3 busy × 240 = 160), so w stays; crediting near's 112 tokens
// would divert the request there (saving 122 > 2 × 1/3 × 128).
func TestCostComparisonGivesNoCreditBelowTheHitGate(t *testing.T) {
	t.Parallel()
	c := newCacheEnv(t)
	tok := prompt(256, 77)
	c.hold(t, "w", tok, 16)
	c.hold(t, "near", tok, 7)
	c.pending("w", 250)
	c.pending("near", 0)
	c.pending("far", 0)
	p := c.policy(t, policy.CacheAwareOptions{MinMatchedTokens: 128, CostMarginTokens: u64(0), RecomputeFactor: 2})
	scans := 0
	policy.SetCostScan(p, false, func() { scans++ })
	pk, err := p.Pick(ctx, engines(state.StagePrefill, "far", "near", "w"), creq(tok))
	require.NoError(t, err)
	assert.Equal(t, 1, scans, "the scan ran")
	assert.Equal(t, state.EngineID("w"), pk.Engine.ID())
	assert.Equal(t, label.ReasonCacheCandidate, pk.Reason)
	assert.Equal(t, uint64(16), pk.PrefillTokens)
}

// docs/design.md §9.7, §9.9: a native report counts the prefill in progress until the next
// report; the prefill this router saw end since (the host reports first tokens) is not pending.
// A cold prompt, "ended" and "busy" both reported prefilling this router's dispatches, "ended"
// the longer one (8,000 tokens to 7,200); then "ended"'s first token arrives: the miss goes to
// it, not to the engine still prefilling.
func TestCacheAwareMissSkipsAnEngineWhosePrefillEndedAfterItsReport(t *testing.T) {
	t.Parallel()
	tok := prompt(256, 61)
	group := engines(state.StagePrefill, "busy", "ended")
	for _, tt := range []struct {
		name       string
		firstToken bool
		want       state.EngineID
	}{
		{"no first token: as reported", false, "busy"},
		{"first token since the report", true, "ended"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c := newCacheEnv(t)
			c.inflight.Acquire("busy", -1, 7200)
			g := c.inflight.Acquire("ended", -1, 8000)
			c.clk.Advance(time.Millisecond)
			c.pending("busy", 7200)
			c.pending("ended", 8000)
			c.clk.Advance(time.Millisecond)
			if tt.firstToken {
				g.FirstToken()
			}
			pk, err := c.policy(t, policy.CacheAwareOptions{}).Pick(ctx, group, creq(tok))
			require.NoError(t, err)
			assert.Equal(t, tt.want, pk.Engine.ID())
			assert.Equal(t, label.ReasonNoCacheCandidate, pk.Reason)
			assert.Equal(t, label.DecisionCacheMiss, c.dec.last().Decision)
		})
	}
}
