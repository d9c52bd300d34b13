package policy_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// docs/design.md §9.6 and §9.11: engines that every rule leaves equal take turns. A fleet of 8
// engines with fresh reports and nothing pending; every request starts with a 128-token shared
// prefix (a system prompt, past the 16-token hit gate of these tests). With every engine holding
// the prefix, each pick is a tie among idle holders; with only a holder buried under prefill
// work, each pick is a cost diversion to one of the 7 idle engines, a tie on cost. Either way no
// engine may get fewer than half the mean of the requests: the lowest IDs must not take them all.
func TestCacheAwareTiesTakeTurns(t *testing.T) {
	t.Parallel()
	const picks = 64
	shared := prompt(128, 41)
	ids := make([]state.EngineID, 8)
	for i := range ids {
		ids[i] = state.EngineID(fmt.Sprintf("e%d", i))
	}
	group := engines(state.StagePrefill, ids...)
	for _, tt := range []struct {
		name    string
		holders []state.EngineID // hold the shared prefix
		busy    state.EngineID   // has 1 << 20 prefill tokens pending; "" none
		native  bool             // native reports, else basic ones (running and waiting only)
		want    []state.EngineID // the engines that share the requests
	}{
		{"idle holders of a shared prefix, native reports", ids, "", true, ids},
		{"idle holders of a shared prefix, basic reports", ids, "", false, ids},
		{"diversions off a busy holder", ids[:1], "e0", true, ids[1:]},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c := newCacheEnv(t)
			for _, id := range tt.holders {
				c.hold(t, id, shared, 8)
			}
			for _, id := range ids {
				switch {
				case id == tt.busy:
					c.pending(id, 1<<20)
				case tt.native:
					c.pending(id, 0)
				default:
					require.NoError(t, c.load.Report(loadmon.Report{Engine: id}))
				}
			}
			p := c.policy(t, policy.CacheAwareOptions{})
			got := map[state.EngineID]int{}
			for i := range picks {
				tok := append(append([]uint32(nil), shared...), prompt(64, uint32(100+i))...)
				pk, err := p.Pick(ctx, group, creq(tok))
				require.NoError(t, err)
				got[pk.Engine.ID()]++
			}
			mean := float64(picks) / float64(len(tt.want))
			for _, id := range tt.want {
				assert.GreaterOrEqual(t, float64(got[id]), mean/2, "engine %s: %d of %d requests (%v)", id, got[id], picks, got)
			}
		})
	}
}
