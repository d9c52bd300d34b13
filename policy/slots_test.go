package policy_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// docs/design.md §9.3 without a limit: the gate acts on running slots. "owner" holds the prompt,
// "cold" nothing; both report as vLLM does (running and waiting) unless a case gives the owner
// native figures with a batch cap of 4. The owner's report and this router's requests there
// decide whether it has a full round queued; cold takes the request only with a free slot (its
// own reports show none: it counts the owner's 4).
func TestCacheAwareDivertsFromAHolderWithARoundQueuedForItsSlots(t *testing.T) {
	t.Parallel()
	tok := prompt(8*blockTokens, 7)
	group := engines(state.StagePrefill, "cold", "owner")
	cases := []struct {
		name                      string
		owner                     loadmon.Report
		ownerInFlight, coldFlight int
		limit                     *uint64
		want                      state.EngineID
		decision                  string
	}{
		{"reports show 4 slots, 5 in flight", loadmon.Report{RunningRequests: 4, WaitingRequests: 4}, 5, 0, nil, "cold", label.DecisionCacheWorkerQueued},
		{"no request beyond the slots", loadmon.Report{RunningRequests: 4, WaitingRequests: 4}, 4, 0, nil, "owner", label.DecisionCacheHit},
		{"fewer waiting than running show no slots", loadmon.Report{RunningRequests: 4, WaitingRequests: 3}, 12, 0, nil, "owner", label.DecisionCacheHit},
		{"one running request shows no slots", loadmon.Report{RunningRequests: 1, WaitingRequests: 3}, 12, 0, nil, "owner", label.DecisionCacheHit},
		{"no free slot elsewhere: the holder is readmitted", loadmon.Report{RunningRequests: 4, WaitingRequests: 4}, 5, 4, nil, "owner", label.DecisionCacheHit},
		{"a free slot elsewhere", loadmon.Report{RunningRequests: 4, WaitingRequests: 4}, 5, 3, nil, "cold", label.DecisionCacheWorkerQueued},
		{"native cap, short of a round", loadmon.Report{RunningRequests: 4, KVCapacityTokens: 1 << 20, Native: &loadmon.NativeLoad{MaxRunningRequests: 4}}, 7, 0, nil, "owner", label.DecisionCacheHit},
		{"native cap, a round", loadmon.Report{RunningRequests: 4, KVCapacityTokens: 1 << 20, Native: &loadmon.NativeLoad{MaxRunningRequests: 4}}, 8, 0, nil, "cold", label.DecisionCacheWorkerQueued},
		{"a limit replaces the slots", loadmon.Report{RunningRequests: 4, WaitingRequests: 4}, 12, 0, u64(100), "owner", label.DecisionCacheHit},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCacheEnv(t)
			c.hold(t, "owner", tok, 8)
			tc.owner.Engine = "owner"
			require.NoError(t, c.load.Report(tc.owner))
			require.NoError(t, c.load.Report(loadmon.Report{Engine: "cold"}))
			for range tc.ownerInFlight {
				c.inflight.Acquire("owner", -1, 16)
			}
			for range tc.coldFlight {
				c.inflight.Acquire("cold", -1, 16)
			}
			pk, err := c.policy(t, policy.CacheAwareOptions{EngineQueueLimit: tc.limit}).Pick(ctx, group, creq(tok))
			require.NoError(t, err)
			assert.Equal(t, tc.want, pk.Engine.ID())
			d := c.dec.last()
			assert.Equal(t, tc.decision, d.Decision)
			if tc.decision == label.DecisionCacheWorkerQueued {
				assert.Equal(t, label.ReasonNoCacheCandidate, pk.Reason)
				assert.Equal(t, 1, d.GateRejected)
				assert.Equal(t, 8, d.DivertedBlocks)
			}
		})
	}
}
