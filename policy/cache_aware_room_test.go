package policy_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/internal/flowbridge"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// rejectedIDs lists the engines of err's *NoAdmissibleEngineError, in order.
func rejectedIDs(t *testing.T, err error) []state.EngineID {
	t.Helper()
	var none *policy.NoAdmissibleEngineError
	require.ErrorAs(t, err, &none)
	ids := make([]state.EngineID, len(none.Rejections))
	for i, r := range none.Rejections {
		ids[i] = r.Engine.ID()
	}
	return ids
}

// docs/design.md §9.11: a request whose holders admission rejected goes to the cheapest engine
// admission admits (pending prefill + uncached tokens), busy or not, and waits only when every
// engine of the group is rejected. "owner" holds the prompt; "far" has 3,000 pending prefill
// tokens, "near" 1,000; each has a waiting request, so none is idle.
func TestCacheAwareRejectedHoldersGoWhereThereIsRoom(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		rejected   []state.EngineID
		noCost     bool
		want       state.EngineID   // "" when the pick fails
		rejections []state.EngineID // of the *NoAdmissibleEngineError
	}{
		{name: "the cheapest with room", rejected: []state.EngineID{"owner"}, want: "near"},
		{name: "the next cheapest", rejected: []state.EngineID{"owner", "near"}, want: "far"},
		{name: "no engine with room", rejected: []state.EngineID{"owner", "near", "far"},
			rejections: []state.EngineID{"owner", "near", "far"}},
		{name: "cost comparison off", rejected: []state.EngineID{"owner"}, noCost: true,
			rejections: []state.EngineID{"owner"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCacheEnv(t)
			tok := prompt(16*blockTokens, 3)
			c.hold(t, "owner", tok, 16)
			for id, pending := range map[state.EngineID]uint64{"owner": 0, "far": 3000, "near": 1000} {
				c.native(id, loadmon.Report{WaitingRequests: 1, Native: &loadmon.NativeLoad{WaitingUncachedTokens: pending}})
			}
			c.check.reject = map[state.EngineID]string{}
			for _, id := range tc.rejected {
				c.check.reject[id] = admission.LimitInFlightRequests
			}
			p := c.policy(t, policy.CacheAwareOptions{DisableCostComparison: tc.noCost})
			pk, err := p.Pick(ctx, engines(state.StagePrefill, "far", "near", "owner"), creq(tok))
			if tc.want == "" {
				assert.Equal(t, tc.rejections, rejectedIDs(t, err))
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, pk.Engine.ID())
			assert.Equal(t, label.ReasonNoCacheCandidate, pk.Reason)
			assert.Equal(t, label.DecisionCacheMiss, c.dec.last().Decision)
		})
	}
}

// docs/design.md §17: for a request that flow control holds off engines still prefilling a
// dispatch of the router (flowbridge.WithPrefillHold), such an engine is rejected as admission
// would: the request goes to the cheapest engine that is not prefilling, and the rejections name
// every engine when all are. Unmarked, the prefilling holder takes it.
func TestCacheAwarePrefillHoldRejectsPrefillingEngines(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		held       bool
		prefilling []state.EngineID
		want       state.EngineID
		limits     []string // of the *NoAdmissibleEngineError when the pick fails
	}{
		{name: "not held", prefilling: []state.EngineID{"owner"}, want: "owner"},
		{name: "held, the holder prefilling", held: true, prefilling: []state.EngineID{"owner"}, want: "near"},
		{name: "held, the holder free", held: true, prefilling: []state.EngineID{"near"}, want: "owner"},
		{name: "held, every engine prefilling", held: true, prefilling: []state.EngineID{"owner", "near", "far"},
			limits: []string{flowbridge.LimitPrefilling, flowbridge.LimitPrefilling, flowbridge.LimitPrefilling}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCacheEnv(t)
			g := c.inflight.Acquire("elsewhere", -1, 100) // the host reports first tokens
			g.FirstToken()
			g.Release()
			for _, id := range tc.prefilling {
				c.inflight.Acquire(id, -1, 500)
			}
			tok := prompt(16*blockTokens, 5)
			c.hold(t, "owner", tok, 16)
			for id, pending := range map[state.EngineID]uint64{"owner": 0, "far": 3000, "near": 0} {
				c.native(id, loadmon.Report{RunningRequests: 2, Native: &loadmon.NativeLoad{WaitingUncachedTokens: pending}})
			}
			pctx := ctx
			if tc.held {
				pctx = flowbridge.WithPrefillHold(ctx)
			}
			pk, err := c.policy(t, policy.CacheAwareOptions{}).Pick(pctx, engines(state.StagePrefill, "far", "near", "owner"), creq(tok))
			if tc.want == "" {
				var none *policy.NoAdmissibleEngineError
				require.ErrorAs(t, err, &none)
				limits := make([]string, len(none.Rejections))
				for i, r := range none.Rejections {
					limits[i] = r.Limit
				}
				assert.Equal(t, tc.limits, limits)
				assert.Equal(t, []state.EngineID{"owner", "near", "far"}, rejectedIDs(t, err))
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, pk.Engine.ID())
		})
	}
}

// docs/design.md §17: a request below flow control's top band (flowbridge.WithPrefillHold) is
// admitted to an engine only below its in-flight cap's last slot, which is the top band's. "owner"
// holds the prompt and runs 2 requests under a cap of 3: the held request goes to "near"; the
// unmarked one, or any with owner at 1, takes owner.
func TestCacheAwareLowerBandLeavesTheLastSlot(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		held    bool
		running int
		want    state.EngineID
	}{
		{name: "held, one slot left", held: true, running: 2, want: "near"},
		{name: "held, two slots left", held: true, running: 1, want: "owner"},
		{name: "not held, one slot left", running: 2, want: "owner"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCacheEnv(t)
			for range tc.running {
				g := c.inflight.Acquire("owner", -1, 10)
				g.FirstToken() // the router sees first tokens; owner prefills nothing
			}
			tok := prompt(16*blockTokens, 9)
			c.hold(t, "owner", tok, 16)
			for _, id := range []state.EngineID{"owner", "near"} {
				c.native(id, loadmon.Report{RunningRequests: uint64(tc.running), Native: &loadmon.NativeLoad{}})
			}
			cfg := c.cfg()
			cfg.Admission = admission.Limits{MaxInFlightRequests: admission.Cap(3)}
			p, err := policy.NewCacheAware(cfg, policy.CacheAwareOptions{Source: c.source, MinMatchedTokens: blockTokens})
			require.NoError(t, err)
			pctx := ctx
			if tc.held {
				pctx = flowbridge.WithPrefillHold(ctx)
			}
			pk, err := p.Pick(pctx, engines(state.StagePrefill, "near", "owner"), creq(tok))
			require.NoError(t, err)
			assert.Equal(t, tc.want, pk.Engine.ID())
			assert.True(t, pk.HasInFlightCap)
			assert.Equal(t, uint64(3), pk.InFlightCap, "the Router lowers the cap for the held request itself")
		})
	}
}

// docs/design.md §9.9: a miss whose fallback engine admission rejects (an in-flight cap, or the
// prefill hold) goes to the cheapest engine admission admits, and waits only when every engine of
// the group is rejected. The prompt is cold; "idle" has no pending prefill, "near" 1,000 tokens,
// "far" 3,000. In the held cases "near" and "far" are queued (8 waiting, over the limit of 4), so
// the fallback's tier is "idle", which is prefilling a dispatch of the router.
func TestCacheAwareMissGoesWhereThereIsRoom(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		capped     []state.EngineID
		held       bool
		want       state.EngineID   // "" when the pick fails
		rejections []state.EngineID // of the *NoAdmissibleEngineError
	}{
		{name: "fallback engine at its cap", capped: []state.EngineID{"idle"}, want: "near"},
		{name: "the next cheapest", capped: []state.EngineID{"idle", "near"}, want: "far"},
		{name: "no engine with room", capped: []state.EngineID{"idle", "near", "far"},
			rejections: []state.EngineID{"idle", "near", "far"}},
		{name: "fallback engine prefilling", held: true, want: "near"},
		{name: "prefilling, the others at their cap", held: true, capped: []state.EngineID{"near", "far"},
			rejections: []state.EngineID{"idle", "near", "far"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCacheEnv(t)
			limit := uint64(4)
			waiting := map[state.EngineID]uint64{"idle": 1, "near": 1, "far": 1}
			if tc.held {
				g := c.inflight.Acquire("elsewhere", -1, 100) // the host reports first tokens
				g.FirstToken()
				g.Release()
				c.inflight.Acquire("idle", -1, 500)
				waiting["near"], waiting["far"] = 8, 8
			}
			for id, pending := range map[state.EngineID]uint64{"idle": 0, "near": 1000, "far": 3000} {
				c.native(id, loadmon.Report{WaitingRequests: waiting[id], Native: &loadmon.NativeLoad{WaitingUncachedTokens: pending}})
			}
			c.check.reject = map[state.EngineID]string{}
			for _, id := range tc.capped {
				c.check.reject[id] = admission.LimitInFlightRequests
			}
			pctx := ctx
			if tc.held {
				pctx = flowbridge.WithPrefillHold(ctx)
			}
			p := c.policy(t, policy.CacheAwareOptions{EngineQueueLimit: &limit})
			pk, err := p.Pick(pctx, engines(state.StagePrefill, "far", "near", "idle"), creq(prompt(16*blockTokens, 7)))
			if tc.want == "" {
				assert.ElementsMatch(t, tc.rejections, rejectedIDs(t, err))
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, pk.Engine.ID())
			assert.Equal(t, label.ReasonNoCacheCandidate, pk.Reason)
		})
	}
}

// docs/design.md §9.11 and §18: of the engines with room for a request whose holders admission
// rejected, one with no slot for the request's LoRA adapter comes last, however cheap. "owner"
// holds the prompt for adapter A and is rejected; "near" (1,000 pending prefill tokens) runs
// adapter B in its only slot, "far" (3,000) has a free slot.
func TestCacheAwareRejectedHoldersSkipEnginesWithoutAnAdapterSlot(t *testing.T) {
	t.Parallel()
	c := newCacheEnv(t)
	tok := prompt(16*blockTokens, 3)
	require.NoError(t, c.index.Store(kvindex.StoreEvent{Engine: "owner", BlockHashes: c.hashesFor(16),
		TokenIDs: tok, Tier: kvindex.TierDevice, Adapter: "A"}))
	c.native("owner", loadmon.Report{WaitingRequests: 1, LoRA: &loadmon.LoRALoad{MaxAdapters: 2, Running: []string{"A"}}})
	c.native("near", loadmon.Report{WaitingRequests: 1, Native: &loadmon.NativeLoad{WaitingUncachedTokens: 1000},
		LoRA: &loadmon.LoRALoad{MaxAdapters: 1, Running: []string{"B"}}})
	c.native("far", loadmon.Report{WaitingRequests: 1, Native: &loadmon.NativeLoad{WaitingUncachedTokens: 3000},
		LoRA: &loadmon.LoRALoad{MaxAdapters: 2, Running: []string{"B"}}})
	c.check.reject = map[state.EngineID]string{"owner": admission.LimitInFlightRequests}
	p := c.policy(t, policy.CacheAwareOptions{})
	pk, err := p.Pick(ctx, engines(state.StagePrefill, "far", "near", "owner"), lreq(state.StagePrefill, "A", tok))
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("far"), pk.Engine.ID())
	assert.Equal(t, label.ReasonNoCacheCandidate, pk.Reason)
}
