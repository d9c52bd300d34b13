package policy_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// holdRank records that engine's DP rank holds the first blocks of tokens.
func (c *cacheEnv) holdRank(t testing.TB, engine state.EngineID, rank int, tokens []uint32, blocks int) {
	t.Helper()
	require.NoError(t, c.index.Store(kvindex.StoreEvent{Engine: engine, DPRank: rank, BlockHashes: c.hashesFor(blocks),
		TokenIDs: tokens[:blocks*blockTokens], Tier: kvindex.TierDevice}))
}

// ranks declares the engine's DP ranks and reports each rank's native load.
func (e *env) ranks(t testing.TB, id state.EngineID, reports ...loadmon.Report) {
	t.Helper()
	require.NoError(t, e.load.Expect(id, len(reports)))
	for i, r := range reports {
		r.DPRank = i
		e.native(id, r)
	}
}

// docs/design.md §6: a cache hit is served by the rank holding the deepest prefix, even when
// another rank is less pressured, and the route-time placement is recorded on that rank.
func TestCacheAwarePicksTheRankHoldingTheDeepestPrefix(t *testing.T) {
	t.Parallel()
	c := newCacheEnv(t)
	tok := prompt(10*blockTokens, 1)
	c.holdRank(t, "a", 0, tok, 3)
	c.holdRank(t, "a", 2, tok, 6)
	c.ranks(t, "a", loadmon.Report{}, loadmon.Report{}, loadmon.Report{WaitingRequests: 3}, loadmon.Report{})
	c.native("b", loadmon.Report{})
	// The local source itself (a Placer), so that the pick records its placement.
	p := c.policy(t, policy.CacheAwareOptions{Source: c.source.inner, DisableCostComparison: true})
	pk, err := p.Pick(ctx, engines(state.StagePrefill, "a", "b"), creq(tok))
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("a"), pk.Engine.ID())
	assert.Equal(t, label.ReasonCacheCandidate, pk.Reason)
	require.True(t, pk.HasDPRank)
	assert.Equal(t, 2, pk.DPRank)

	m := c.index.Match(c.index.Hasher().Keys(tok))
	require.Equal(t, []kvindex.EngineMatch{{Engine: "a", Blocks: 10}}, m.Engines)
	assert.Equal(t, []int{2}, m.DPRanks, "the placement extends rank 2's prefix, not rank 0's")
}

// The reproduction of the PR report's known flaw: the queue gate compared the sum of the DP
// ranks' queues with EngineQueueLimit, so an engine of four ranks each queueing 2 (8 in all) was
// diverted at a limit of 4 although the rank holding the prefix queues 2. It now reads the rank's
// own queue (docs/design.md §9.3).
func TestCacheAwareQueueGateReadsTheRanksOwnQueue(t *testing.T) {
	t.Parallel()
	c := newCacheEnv(t)
	tok := prompt(10*blockTokens, 1)
	c.holdRank(t, "a", 1, tok, 8)
	two := loadmon.Report{WaitingRequests: 2}
	c.ranks(t, "a", two, two, two, two)
	c.native("b", loadmon.Report{})
	p := c.policy(t, policy.CacheAwareOptions{EngineQueueLimit: u64(4), DisableCostComparison: true})
	group := engines(state.StagePrefill, "a", "b")
	pk, err := p.Pick(ctx, group, creq(tok))
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("a"), pk.Engine.ID(), "rank 1 queues 2 < 4: not diverted")
	assert.Equal(t, label.DecisionCacheHit, c.dec.last().Decision)
	assert.Equal(t, 1, pk.DPRank)

	// The holding rank itself queued at the limit is diverted, whatever its sibling ranks.
	c.ranks(t, "a", loadmon.Report{}, loadmon.Report{WaitingRequests: 4}, loadmon.Report{}, loadmon.Report{})
	pk, err = p.Pick(ctx, group, creq(tok))
	require.NoError(t, err)
	assert.Equal(t, label.DecisionCacheWorkerQueued, c.dec.last().Decision)
	assert.Equal(t, 0, c.dec.last().Evaluated)
	assert.False(t, c.dec.last().FleetAllQueued, "a's other ranks are idle")
	_ = pk

	// Every rank of every engine at or over the limit: the fleet is all queued, by ranks.
	c.ranks(t, "a", loadmon.Report{WaitingRequests: 4}, loadmon.Report{WaitingRequests: 4}, loadmon.Report{WaitingRequests: 5}, loadmon.Report{WaitingRequests: 4})
	c.native("b", loadmon.Report{WaitingRequests: 4})
	_, err = p.Pick(ctx, group, creq(tok))
	require.NoError(t, err)
	assert.True(t, c.dec.last().FleetAllQueued)
	c.ranks(t, "a", loadmon.Report{WaitingRequests: 4}, loadmon.Report{WaitingRequests: 4}, loadmon.Report{WaitingRequests: 3}, loadmon.Report{WaitingRequests: 4})
	_, err = p.Pick(ctx, group, creq(tok))
	require.NoError(t, err)
	assert.False(t, c.dec.last().FleetAllQueued, "rank 2 of a queues 3 < 4, though a's sum is 15")
}

// docs/design.md §6: pressure comparisons between engines read the named rank's own figures,
// and a pick names the least pressured rank. Before, "a" was compared on its sum (10 waiting)
// and lost to "b" (3).
func TestPowerOfNComparesTheRanksOwnFigures(t *testing.T) {
	t.Parallel()
	e := newEnv()
	e.ranks(t, "a", loadmon.Report{WaitingRequests: 10}, loadmon.Report{WaitingRequests: 0})
	e.native("b", loadmon.Report{WaitingRequests: 3})
	p, err := policy.NewPowerOfN(e.cfg(), 2)
	require.NoError(t, err)
	pk, err := p.Pick(ctx, engines(state.StageDecode, "a", "b"), &policy.Request{Stage: state.StageDecode})
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("a"), pk.Engine.ID())
	require.True(t, pk.HasDPRank)
	assert.Equal(t, 1, pk.DPRank)
	require.Len(t, e.check.metrics, 1)
	assert.Equal(t, admission.Known(10), e.check.metrics[0].WaitingRequests, "admission reads the engine's sum")

	// An engine of one rank is named no rank.
	pk, err = p.Pick(ctx, engines(state.StageDecode, "b"), &policy.Request{Stage: state.StageDecode})
	require.NoError(t, err)
	assert.False(t, pk.HasDPRank)
}

// Every policy names a rank for an engine with several reporting ranks, and none when its load
// is unknown.
func TestEveryPolicyNamesTheLeastPressuredRank(t *testing.T) {
	t.Parallel()
	e := newEnv()
	e.ranks(t, "a", loadmon.Report{WaitingRequests: 5}, loadmon.Report{WaitingRequests: 1}, loadmon.Report{WaitingRequests: 3})
	rr, err := policy.NewRoundRobin(e.cfg())
	require.NoError(t, err)
	rnd, err := policy.NewRandom(e.cfg())
	require.NoError(t, err)
	ll, err := policy.NewLeastLoad(e.cfg())
	require.NoError(t, err)
	for name, p := range map[string]policy.Policy{"round_robin": rr, "random": rnd, "least_load": ll} {
		pk, err := p.Pick(ctx, engines(state.StagePlain, "a"), &policy.Request{})
		require.NoError(t, err, name)
		assert.True(t, pk.HasDPRank, name)
		assert.Equal(t, 1, pk.DPRank, name)
	}
	pk, err := rr.Pick(ctx, engines(state.StagePlain, "unknown"), &policy.Request{})
	require.NoError(t, err)
	assert.False(t, pk.HasDPRank, "nothing is known: the engine places the request")
}

// docs/design.md §12 "DP ranks": every request of a session or routing key reaches the same DP
// rank of a multi-rank engine, whose prefix cache is its own, while the least pressured rank
// moves from turn to turn; keys spread over the ranks. Before, each turn went to the least
// pressured rank and a conversation's prefix was recomputed whenever that rank changed.
func TestAffinityKeysKeepTheirDPRank(t *testing.T) {
	t.Parallel()
	const keys, ranks = 40, 4
	build := map[string]func(e *env) policy.Policy{
		"session_aware": func(e *env) policy.Policy {
			p, err := policy.NewSessionAware(e.cfg(), policy.SessionAwareOptions{Store: memStore(t)})
			require.NoError(t, err)
			return p
		},
		"sticky_store": func(e *env) policy.Policy {
			p, err := policy.NewSticky(e.cfg(), policy.StickyOptions{Store: memStore(t)})
			require.NoError(t, err)
			return p
		},
		"sticky_rendezvous": func(e *env) policy.Policy {
			p, err := policy.NewSticky(e.cfg(), policy.StickyOptions{Rendezvous: true})
			require.NoError(t, err)
			return p
		},
	}
	for name, mk := range build {
		e := newEnv()
		p := mk(e)
		cands := engines(state.StagePlain, "a")
		rankOf := map[string]int{}
		perRank := make([]int, ranks)
		for turn := range 6 {
			reports := make([]loadmon.Report, ranks)
			for r := range reports {
				if r != turn%ranks {
					reports[r].WaitingRequests = 5 // the least pressured rank moves each turn
				}
			}
			e.ranks(t, "a", reports...)
			for k := range keys {
				key := fmt.Sprintf("conversation-%d", k)
				pk, err := p.Pick(ctx, cands, &policy.Request{SessionKey: key, RoutingKey: key, Stage: state.StagePlain})
				require.NoError(t, err, name)
				require.True(t, pk.HasDPRank, name)
				if turn == 0 {
					rankOf[key] = pk.DPRank
					perRank[pk.DPRank]++
					continue
				}
				assert.Equal(t, rankOf[key], pk.DPRank, "%s: %s turn %d", name, key, turn)
			}
		}
		for r, n := range perRank {
			assert.GreaterOrEqual(t, n, 4, "%s: keys on rank %d of %v", name, r, perRank)
		}
	}
}

// docs/design.md §12.4: a change in the number of ranks moves only the keys of the rank added
// (rendezvous hashing): from 4 to 5 ranks, every key keeps its rank or moves to rank 4, and some
// do move.
func TestAffinityKeyRanksMoveOnlyToAnAddedRank(t *testing.T) {
	t.Parallel()
	e := newEnv()
	p, err := policy.NewSticky(e.cfg(), policy.StickyOptions{Rendezvous: true})
	require.NoError(t, err)
	cands := engines(state.StagePlain, "a")
	rankOf := func(key string) int {
		pk, err := p.Pick(ctx, cands, &policy.Request{RoutingKey: key, Stage: state.StagePlain})
		require.NoError(t, err)
		require.True(t, pk.HasDPRank)
		return pk.DPRank
	}
	e.ranks(t, "a", make([]loadmon.Report, 4)...)
	before := map[string]int{}
	for k := range 200 {
		key := fmt.Sprintf("user-%d", k)
		before[key] = rankOf(key)
	}
	e.ranks(t, "a", make([]loadmon.Report, 5)...)
	moved := 0
	for key, r := range before {
		if now := rankOf(key); now != r {
			assert.Equal(t, 4, now, "%s moved from rank %d to an old rank", key, r)
			moved++
		}
	}
	assert.Positive(t, moved, "the added rank takes some keys")
	assert.Less(t, moved, 80, "about a fifth of the keys move, not most")
}
