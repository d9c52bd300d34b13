package enginepick_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// Engines that report load as vLLM's /metrics does (running and waiting requests only, no native
// extension) are compared on those counts (docs/design.md §6, "Pressure comparisons"). Five plain
// engines report running/waiting 1/83, 12/78, 1/5, 0/0 and 0/0; 100 sequential select + release
// of cold prompts. Before, basic reports were ignored: the two queued engines got 32 of 100 under
// power-of-two and 41 under the cache-aware miss fallback. Now basic reports give what native ones
// give, with the same seeded random source: power-of-two sends a request to a queued engine only
// when both sampled engines are queued (about (2/5)(1/4) = 10 %), least-load never does, and the
// cache-aware miss fallback's cost comparison moves such a sample's winner to an idle engine.
func TestBasicReportsCountInPressure(t *testing.T) {
	t.Parallel()
	ids := []state.EngineID{"a", "b", "c", "d", "e"}
	counts := []struct{ running, waiting uint64 }{{1, 83}, {12, 78}, {1, 5}, {0, 0}, {0, 0}}
	policies := map[string]func(policy.Config, kvindex.Source) (policy.Policy, error){
		"power_of_two": func(cfg policy.Config, _ kvindex.Source) (policy.Policy, error) { return policy.NewPowerOfN(cfg, 2) },
		"least_load":   func(cfg policy.Config, _ kvindex.Source) (policy.Policy, error) { return policy.NewLeastLoad(cfg) },
		"cache_aware":  cacheAwareWith(policy.CacheAwareOptions{}),
	}
	reports := map[string]func(i int) loadmon.Report{
		"basic": func(i int) loadmon.Report {
			return loadmon.Report{Engine: ids[i], RunningRequests: counts[i].running, WaitingRequests: counts[i].waiting}
		},
		"native": func(i int) loadmon.Report {
			r := nativeReport(ids[i], counts[i].waiting, counts[i].waiting*2048)
			r.RunningRequests = counts[i].running
			return r
		},
	}
	cases := []struct {
		policy, reports string
		queued          int // picks of a and b, the two queued engines
	}{
		{"power_of_two", "native", 11},
		{"power_of_two", "basic", 11},
		{"least_load", "native", 0},
		{"least_load", "basic", 0},
		{"cache_aware", "native", 0},
		{"cache_aware", "basic", 0},
	}
	for _, tc := range cases {
		t.Run(tc.policy+"/"+tc.reports, func(t *testing.T) {
			t.Parallel()
			r := newPlainRouter(t, ids, policies[tc.policy])
			for i := range ids {
				require.NoError(t, r.load.Report(reports[tc.reports](i)))
			}
			got := r.selectReleased(t, 100, func(i int) []uint32 { return tokens(2048, uint32(500+i)) })
			assert.Equal(t, tc.queued, got["a"]+got["b"], "picks %v", got)
		})
	}
}

// Holders of a prefix every request shares stop absorbing traffic once their queued prefill makes
// the recompute elsewhere cheaper, with basic reports and across report intervals
// (docs/design.md §9.11). Four engines report as vLLM's /metrics does; a holds a 2,048-token
// system prompt; each request is the system prompt and 1,000 tokens of its own. Four rounds of 6
// requests, each within one report interval, each followed by reports that count every request
// as running (being prefilled: nothing has ended) and none waiting. A basic report counts a
// request being prefilled as running, so from the reports alone the holders look idle at every
// new interval: a and b (a holder by route-time placement) take all 24 and c and d none. Once
// the host reports first tokens (Dispatch.FirstToken), the router counts the prefill tokens of
// its dispatches still waiting for their first token, and every engine serves at least 5.
func TestSharedPrefixHoldersStopWhenTheirPrefillsQueue(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name        string
		firstTokens bool
		want        map[state.EngineID]int
	}{
		{"first tokens reported", true, map[state.EngineID]int{"a": 8, "b": 6, "c": 5, "d": 5}},
		{"no first tokens", false, map[state.EngineID]int{"a": 13, "b": 11}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ids := []state.EngineID{"a", "b", "c", "d"}
			r := newPlainRouter(t, ids, cacheAwareWith(policy.CacheAwareOptions{}))
			report := func(picks map[state.EngineID]int) {
				for _, id := range ids {
					require.NoError(t, r.load.Report(loadmon.Report{Engine: id, RunningRequests: uint64(picks[id]), KVCapacityTokens: 1 << 20}))
				}
			}
			report(nil)
			system := tokens(2048, 9)
			r.storeAll(t, "a", system)
			if tc.firstTokens {
				d, err := r.router.Select(context.Background(), &bucket.Request{Model: "m", TokenIDs: tokens(64, 1),
					Signals: bucket.Signals{InputTokens: 64}})
				require.NoError(t, err)
				d.FirstToken()
				d.Release()
			}
			total := map[state.EngineID]int{}
			for round := range 4 {
				picks := r.selectHeld(t, 6, func(i int) []uint32 {
					return append(slices.Clone(system), tokens(1000, uint32(600+6*round+i))...)
				})
				for id, n := range picks {
					total[id] += n
				}
				time.Sleep(time.Millisecond) // the report follows the dispatches
				report(total)
			}
			assert.Equal(t, tc.want, total)
		})
	}
}
