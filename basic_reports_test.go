package enginepick_test

import (
	"context"
	"slices"
	"sync"
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

// A prefix every request shares stops piling onto its holder once the holder has a full round
// queued for its running slots (docs/design.md §9.3), with basic reports (running and waiting
// only) and with native ones, many requests inside one report interval. Four engines of 4
// running slots each; a holds a 1,100-token system prompt; each request is the system prompt and
// 24 tokens of its own, so a holder prefills 36 tokens and any other engine 1,124. Two rounds of
// 16 requests, held open, each within one report interval and followed by the report of a 4-slot
// engine (running up to 4, the rest waiting). Before, every request went to a (32 of 32): a
// waiting request was priced at its prefill tokens, so recomputing the prompt elsewhere never
// looked cheaper. Now, once a has a round queued, the requests go to engines with a free slot,
// each of which recomputes the prompt once and serves the next as hits; when none has a free slot
// the holders share them. With basic reports the slots are learnt from a's report of the first
// round (4 running, 12 waiting), so that round all goes to a; native reports give them at once.
func TestSharedPrefixSpreadsWhenItsHoldersSlotsAreFull(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name           string
		native         bool
		round1, round2 map[state.EngineID]int
	}{
		{name: "basic reports", round1: map[state.EngineID]int{"a": 16}, round2: map[state.EngineID]int{"b": 5, "c": 5, "d": 6}},
		{name: "native reports", native: true, round1: map[state.EngineID]int{"a": 8, "c": 4, "d": 4}, round2: map[state.EngineID]int{"a": 1, "b": 4, "c": 5, "d": 6}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newSlotFleet(t, tc.native)
			assert.Equal(t, tc.round1, f.round(t, false), "round 1")
			assert.Equal(t, tc.round2, f.round(t, false), "round 2")
			assert.Equal(t, 3, f.recomputed, "picks that recompute the system prompt: one per engine taking it over")
		})
	}
}

// The same with the second round's 16 selections concurrent: however they interleave, a, whose
// round stays queued, takes at most one round of its slots more (a selection that runs before
// others' placements on b, c and d are recorded still sees a as the only holder), and every
// selection is served.
func TestSharedPrefixSpreadsUnderConcurrentSelections(t *testing.T) {
	t.Parallel()
	f := newSlotFleet(t, false)
	require.Equal(t, map[state.EngineID]int{"a": 16}, f.round(t, false))
	got := f.round(t, true)
	assert.LessOrEqual(t, got["a"], slotFleetSlots, "picks %v", got)
	assert.Equal(t, 16, got["a"]+got["b"]+got["c"]+got["d"], "picks %v", got)
}

// slotFleet is the fleet of TestSharedPrefixSpreadsWhenItsHoldersSlotsAreFull.
type slotFleet struct {
	r          *plainRouter
	native     bool
	system     []uint32
	mu         sync.Mutex
	inflight   map[state.EngineID]int
	recomputed int
	seq        uint32
}

var slotFleetIDs = []state.EngineID{"a", "b", "c", "d"}

const slotFleetSlots = 4

func newSlotFleet(t *testing.T, native bool) *slotFleet {
	f := &slotFleet{r: newPlainRouter(t, slotFleetIDs, cacheAwareWith(policy.CacheAwareOptions{})), native: native,
		system: tokens(1100, 9), inflight: map[state.EngineID]int{}}
	f.report(t)
	f.r.storeAll(t, "a", f.system)
	return f
}

// report sends every engine's report: running up to its slots, the rest of this router's
// requests waiting.
func (f *slotFleet) report(t *testing.T) {
	for _, id := range slotFleetIDs {
		run := min(f.inflight[id], slotFleetSlots)
		rep := loadmon.Report{Engine: id, RunningRequests: uint64(run), WaitingRequests: uint64(f.inflight[id] - run), KVCapacityTokens: 1 << 20}
		if f.native {
			rep.Native = &loadmon.NativeLoad{MaxRunningRequests: slotFleetSlots, WaitingUncachedTokens: uint64(36 * (f.inflight[id] - run))}
		}
		require.NoError(t, f.r.load.Report(rep))
	}
}

// round runs 16 selections, held open (concurrently when concurrent), then the reports, and
// returns the picks per engine.
func (f *slotFleet) round(t *testing.T, concurrent bool) map[state.EngineID]int {
	got := map[state.EngineID]int{}
	pick := func() {
		f.mu.Lock()
		f.seq++
		tok := append(slices.Clone(f.system), tokens(24, 600+f.seq)...)
		f.mu.Unlock()
		d, err := f.r.router.Select(context.Background(), &bucket.Request{Model: "m", TokenIDs: tok,
			Signals: bucket.Signals{InputTokens: int64(len(tok))}})
		if !assert.NoError(t, err) {
			return
		}
		f.mu.Lock()
		defer f.mu.Unlock()
		got[d.Selection.Plain.Engine.ID()]++
		f.inflight[d.Selection.Plain.Engine.ID()]++
		if d.Selection.Plain.PrefillTokens > 1000 {
			f.recomputed++
		}
	}
	var wg sync.WaitGroup
	for range 16 {
		if concurrent {
			wg.Go(pick)
		} else {
			pick()
		}
	}
	wg.Wait()
	time.Sleep(time.Millisecond) // the reports follow the dispatches
	f.report(t)
	return got
}
