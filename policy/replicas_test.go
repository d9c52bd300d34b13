package policy_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/internal/loadbridge"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// replicas makes c's router replica rank of n, as package peersync records it.
func (c *cacheEnv) replicas(rank, n int) { loadbridge.SetReplicas(c.inflight, rank, n) }

// docs/design.md §6 "Router replicas": a cache-aware replica's miss fallback samples its home
// engines (index ≡ rank mod n) when it has at least two. Eight engines e0…e7, each running 8
// requests that no dispatch here explains (so the fallback samples, §9.9), and a cold prompt:
// every first draw of the sample's random source, 0…7, and the engines the picks chose.
func TestCacheAwareReplicaMissSamplesItsHomeEngines(t *testing.T) {
	t.Parallel()
	group := manyEngines(8)
	tok := prompt(256, 51)
	for _, tt := range []struct {
		name    string
		rank, n int
		want    []state.EngineID
	}{
		{"alone: the whole group", 0, 1, []state.EngineID{"http://e000", "http://e001", "http://e002", "http://e003",
			"http://e004", "http://e005", "http://e006", "http://e007"}},
		{"second of four: e1 and e5", 1, 4, []state.EngineID{"http://e001", "http://e005"}},
		{"first of two: the even engines", 0, 2, []state.EngineID{"http://e000", "http://e002", "http://e004", "http://e006"}},
		{"one home engine: the whole group", 3, 8, []state.EngineID{"http://e000", "http://e001", "http://e002", "http://e003",
			"http://e004", "http://e005", "http://e006", "http://e007"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c := newCacheEnv(t)
			for _, e := range group {
				c.native(e.ID(), loadmon.Report{RunningRequests: 8})
			}
			c.replicas(tt.rank, tt.n)
			p := c.policy(t, policy.CacheAwareOptions{DisableRoutePlacements: true})
			picked := map[state.EngineID]bool{}
			for v := range 8 {
				c.rnd.vals = []int{v, v + 1}
				pk, err := p.Pick(ctx, group, creq(tok))
				require.NoError(t, err)
				assert.Equal(t, label.ReasonNoCacheCandidate, pk.Reason)
				picked[pk.Engine.ID()] = true
			}
			var got []state.EngineID
			for _, e := range group {
				if picked[e.ID()] {
					got = append(got, e.ID())
				}
			}
			assert.Equal(t, tt.want, got)
		})
	}
}

// docs/design.md §9.11 with router replicas: the cost comparison's cheapest engine is a home
// engine unless another is cheaper by more than CostMarginTokens (1,024). e0 holds the prompt's
// first 128 tokens and has 5,000 tokens pending; the other engines hold nothing, so each costs its
// pending tokens plus 256. Replica 1 of 2 has e1 and e3 at home; replica 0 of 2, e0 and e2.
func TestCacheAwareReplicaCostComparisonPrefersItsHomeEngines(t *testing.T) {
	t.Parallel()
	tok := prompt(256, 52)
	group := engines(state.StagePrefill, "e0", "e1", "e2", "e3")
	for _, tt := range []struct {
		name      string
		rank, n   int
		e1Pending uint64
		want      state.EngineID
	}{
		{"alone: the cheapest", 0, 1, 500, "e2"},
		{"home within the margin", 1, 2, 500, "e1"},
		{"another cheaper by the margin exactly", 1, 2, 1024, "e1"},
		{"another cheaper by more than the margin", 1, 2, 1025, "e2"},
		{"another at home", 0, 2, 500, "e2"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c := newCacheEnv(t)
			c.hold(t, "e0", tok, 8)
			c.pending("e0", 5000)
			c.pending("e1", tt.e1Pending)
			c.pending("e2", 0)
			c.pending("e3", 2000)
			c.replicas(tt.rank, tt.n)
			pk, err := c.policy(t, policy.CacheAwareOptions{}).Pick(ctx, group, creq(tok))
			require.NoError(t, err)
			assert.Equal(t, tt.want, pk.Engine.ID())
			assert.Equal(t, label.ReasonCostDiverted, pk.Reason)
		})
	}
}

// docs/design.md §9.6 with router replicas: between a home engine and another holding as much of
// the prompt, pending prefill tokens decide, the other's handicapped by CostMarginTokens (1,024);
// between two home engines or two others, pressure as for a router alone. Four engines hold the
// prompt's first 128 tokens; replica 0 of 2 has e0 and e2 at home.
func TestCacheAwareReplicaPrefersItsHomeHolders(t *testing.T) {
	t.Parallel()
	tok := prompt(256, 53)
	group := engines(state.StagePrefill, "e0", "e1", "e2", "e3")
	for _, tt := range []struct {
		name    string
		rank, n int
		pending [4]uint64
		want    state.EngineID
	}{
		{"alone: the least pressured", 0, 1, [4]uint64{600, 0, 900, 100}, "e1"},
		{"home within the margin", 0, 2, [4]uint64{600, 0, 900, 100}, "e0"},
		{"the less pressured of two home engines", 0, 2, [4]uint64{900, 0, 600, 100}, "e2"},
		{"another less pressured by more than the margin", 0, 2, [4]uint64{1500, 0, 1600, 100}, "e1"},
		{"the less pressured of two others", 1, 2, [4]uint64{0, 600, 100, 300}, "e3"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c := newCacheEnv(t)
			for i, e := range group {
				c.hold(t, e.ID(), tok, 8)
				c.pending(e.ID(), tt.pending[i])
			}
			c.replicas(tt.rank, tt.n)
			pk, err := c.policy(t, policy.CacheAwareOptions{}).Pick(ctx, group, creq(tok))
			require.NoError(t, err)
			assert.Equal(t, tt.want, pk.Engine.ID(), fmt.Sprint(tt.pending))
			assert.Equal(t, label.ReasonCacheCandidate, pk.Reason)
			assert.False(t, c.dec.last().CostOverride, "the winner stands: no holder is cheaper by more than the margin")
		})
	}
}

// docs/design.md §9.11 and §6 with router replicas: when admission rejects every holder, the idle
// engine that takes the request is a home engine among idle engines within CostMarginTokens of
// each other, so that replicas deciding within the delay of each other's dispatches do not all
// send their requests to one idle engine. e0 holds the prompt and is at its waiting cap; e1, e2
// and e3 are idle and hold nothing. Replica 0 of 2 has e0 and e2 at home; replica 1, e1 and e3.
func TestCacheAwareReplicaIdleEngineIsAHomeEngine(t *testing.T) {
	t.Parallel()
	tok := prompt(8*blockTokens, 54)
	group := engines(state.StagePrefill, "e0", "e1", "e2", "e3")
	for _, tt := range []struct {
		name    string
		rank, n int
		busy    state.EngineID // an engine with one running request: not idle ("" for none)
		want    state.EngineID
	}{
		{"alone: the first idle engine", 0, 1, "", "e1"},
		{"first of two: e2", 0, 2, "", "e2"},
		{"second of two: e1", 1, 2, "", "e1"},
		{"second of two, e1 busy: e3", 1, 2, "e1", "e3"},
		{"first of two, its idle home engine busy: e1", 0, 2, "e2", "e1"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c := newCacheEnv(t)
			c.hold(t, "e0", tok, 8)
			c.native("e0", loadmon.Report{WaitingRequests: 5})
			for _, id := range []state.EngineID{"e1", "e2", "e3"} {
				r := loadmon.Report{}
				if id == tt.busy {
					r.RunningRequests = 1
				}
				c.native(id, r)
			}
			c.replicas(tt.rank, tt.n)
			cfg := c.cfg()
			lim := admission.Limits{MaxWaitingRequests: admission.Cap(5)}
			cfg.Admission = lim
			p, err := policy.NewCacheAware(cfg, policy.CacheAwareOptions{Source: c.source, MinMatchedTokens: blockTokens})
			require.NoError(t, err)
			pk, err := p.Pick(ctx, group, creq(tok))
			require.NoError(t, err)
			assert.Equal(t, tt.want, pk.Engine.ID())
			assert.Equal(t, label.ReasonNoCacheCandidate, pk.Reason)
		})
	}
}
