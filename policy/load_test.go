package policy_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

func TestPowerOfNRejectsZeroChoices(t *testing.T) {
	t.Parallel()
	e := newEnv()
	for _, n := range []int{0, -1} {
		_, err := policy.NewPowerOfN(e.cfg(), n)
		assert.ErrorIs(t, err, policy.ErrInvalidConfiguration, "N = %d", n)
	}
	p, err := policy.NewPowerOfN(e.cfg(), 2)
	require.NoError(t, err)
	assert.Equal(t, 2, policy.Choices(p))
}

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg.rs` power_of_n_checks_selected_engine_and_propagates_rejection_without_fallback.
func TestPowerOfNChecksTheLessLoadedEngineOnceAndNeverFallsBack(t *testing.T) {
	t.Parallel()
	for _, order := range [][]int{{0, 1}, {1, 0}} {
		e := newEnv()
		e.native("busy", loadmon.Report{WaitingRequests: 9})
		e.native("idle", loadmon.Report{WaitingRequests: 1})
		cands := engines(state.StagePrefill, "busy", "idle")
		e.rnd.vals = append([]int(nil), order...)
		p, _ := policy.NewPowerOfN(e.cfg(), 2)

		pk, err := p.Pick(ctx, cands, &policy.Request{Stage: state.StagePrefill})
		require.NoError(t, err)
		assert.Equal(t, state.EngineID("idle"), pk.Engine.ID(), "sample order %v", order)
		assert.Equal(t, label.ReasonPowerOfTwo, pk.Reason)
		assert.Equal(t, []state.EngineID{"idle"}, e.check.Calls(), "admission once, on the winner")

		e.check.reject = map[state.EngineID]string{"idle": "full"}
		e.rnd.vals = append([]int(nil), order...)
		_, err = p.Pick(ctx, cands, &policy.Request{Stage: state.StagePrefill})
		var rej *policy.AdmissionRejectedError
		require.ErrorAs(t, err, &rej)
		assert.Equal(t, state.EngineID("idle"), rej.Engine.ID())
		assert.Equal(t, "full", rej.Limit)
		assert.Equal(t, []state.EngineID{"idle", "idle"}, e.check.Calls(), "no second check on the busy engine")
	}
}

func TestPowerOfNSingleCandidateStillReadsLoadForAdmission(t *testing.T) {
	t.Parallel()
	e := newEnv()
	e.native("only", loadmon.Report{RunningRequests: 2, KVCapacityTokens: 100, UsedKVTokens: 100})
	cfg := e.cfg()
	cfg.Admission = admission.Limits{MaxKVTokens: admission.Cap(100)}
	p, _ := policy.NewPowerOfN(cfg, 2)
	_, err := p.Pick(ctx, engines(state.StagePlain, "only"), &policy.Request{})
	var rej *policy.AdmissionRejectedError
	require.ErrorAs(t, err, &rej)
	assert.Equal(t, admission.LimitKVTokens, rej.Limit)
	assert.Equal(t, uint64(100), rej.Observed)

	e.native("only", loadmon.Report{RunningRequests: 2, KVCapacityTokens: 100, UsedKVTokens: 99})
	pk, err := p.Pick(ctx, engines(state.StagePlain, "only"), &policy.Request{})
	require.NoError(t, err, "99 of cap 100 admits")
	assert.Equal(t, state.EngineID("only"), pk.Engine.ID())

	cfg.Admission = admission.Limits{MaxRunningRequests: admission.Cap(2)}
	p, _ = policy.NewPowerOfN(cfg, 2)
	_, err = p.Pick(ctx, engines(state.StagePlain, "only"), &policy.Request{})
	require.ErrorAs(t, err, &rej)
	assert.Equal(t, admission.LimitRunningRequests, rej.Limit)
}

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg_power_of_n.rs` plain_and_prefill_use_pending_work_while_decode_uses_request_pressure.
func TestPowerOfNStagePressure(t *testing.T) {
	t.Parallel()
	e := newEnv()
	// a: little pending prefill work but many waiting decode requests; b: the opposite.
	e.native("a", loadmon.Report{WaitingRequests: 5, Native: &loadmon.NativeLoad{WaitingUncachedTokens: 100}})
	e.native("b", loadmon.Report{WaitingRequests: 1, Native: &loadmon.NativeLoad{WaitingUncachedTokens: 5000}})
	p, _ := policy.NewPowerOfN(e.cfg(), 2)
	for stage, want := range map[state.Stage]state.EngineID{state.StagePlain: "a", state.StagePrefill: "a", state.StageDecode: "b"} {
		for _, order := range [][]int{{0, 1}, {1, 0}} {
			e.rnd.vals = append([]int(nil), order...)
			pk, err := p.Pick(ctx, engines(stage, "a", "b"), &policy.Request{Stage: stage})
			require.NoError(t, err)
			assert.Equal(t, want, pk.Engine.ID(), "stage %v, order %v", stage, order)
		}
	}
}

// A fresh report without usable native data (an older publisher, a vLLM /metrics poll, unknown
// capacity) still counts: both engines are compared on reported running and waiting requests,
// not on in-flight alone, as the upstream router does (docs/design-notes.md "Basic reports count").
func TestPowerOfNBasicReportsCompareOnReportedRequests(t *testing.T) {
	t.Parallel()
	cases := map[string]loadmon.Report{
		"old publisher":    {Engine: "b", KVCapacityTokens: 100},
		"unknown capacity": {Engine: "b", Native: &loadmon.NativeLoad{MaxRunningRequests: 8}},
	}
	for name, rb := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv()
			// a reports far more load than b, but has fewer requests in flight from this router.
			e.native("a", loadmon.Report{WaitingRequests: 50})
			require.NoError(t, e.load.Report(rb))
			e.inflight.Acquire("b", -1, 0)
			e.inflight.Acquire("b", -1, 0)
			e.inflight.Acquire("a", -1, 0)
			p, _ := policy.NewPowerOfN(e.cfg(), 2)
			for _, stage := range []state.Stage{state.StagePrefill, state.StageDecode} {
				e.rnd.vals = []int{1, 0}
				pk, err := p.Pick(ctx, engines(stage, "a", "b"), &policy.Request{Stage: stage})
				require.NoError(t, err)
				assert.Equal(t, state.EngineID("b"), pk.Engine.ID(), "%s: compared on waiting requests (a 50, b 0)", stage)
			}
		})
	}
}

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg_power_of_n.rs` unusable_telemetry_falls_back_to_local_load_for_both_candidates.
func TestPowerOfNUnusableTelemetryFallsBackToLocalLoadForBoth(t *testing.T) {
	t.Parallel()
	cases := map[string]func(e *env){
		"missing report": func(e *env) {},
		"stale report": func(e *env) {
			e.native("b", loadmon.Report{WaitingRequests: 0})
			e.clk.Advance(loadmon.DefaultFreshness + time.Millisecond)
			e.native("a", loadmon.Report{WaitingRequests: 50})
		},
		"incomplete ranks": func(e *env) {
			require.NoError(t, e.load.Expect("b", 2))
			e.native("b", loadmon.Report{WaitingRequests: 0})
		},
	}
	for name, setup := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv()
			// a reports far more load than b, but has fewer requests in flight from this router.
			e.native("a", loadmon.Report{WaitingRequests: 50})
			setup(e)
			e.inflight.Acquire("b", -1, 0)
			e.inflight.Acquire("b", -1, 0)
			e.inflight.Acquire("a", -1, 0)
			p, _ := policy.NewPowerOfN(e.cfg(), 2)
			for _, stage := range []state.Stage{state.StagePrefill, state.StageDecode} {
				e.rnd.vals = []int{1, 0}
				pk, err := p.Pick(ctx, engines(stage, "a", "b"), &policy.Request{Stage: stage})
				require.NoError(t, err)
				assert.Equal(t, state.EngineID("a"), pk.Engine.ID(), "%s: both compared by in-flight (a 1, b 2)", stage)
			}
		})
	}
}

func TestPowerOfNEqualReportedPressureUsesLocalLoad(t *testing.T) {
	t.Parallel()
	e := newEnv()
	e.native("a", loadmon.Report{WaitingRequests: 3})
	e.native("b", loadmon.Report{WaitingRequests: 3})
	e.native("c", loadmon.Report{WaitingRequests: 30})
	cands := engines(state.StageDecode, "a", "b", "c") // three candidates, so two are sampled
	e.inflight.Acquire("a", -1, 0)
	p, _ := policy.NewPowerOfN(e.cfg(), 2)
	e.rnd.vals = []int{0, 1}
	pk, _ := p.Pick(ctx, cands, &policy.Request{Stage: state.StageDecode})
	assert.Equal(t, state.EngineID("b"), pk.Engine.ID())
	e.inflight.Acquire("b", -1, 0)
	for _, order := range [][]int{{0, 1}, {1, 0}} {
		e.rnd.vals = append([]int(nil), order...)
		pk, _ = p.Pick(ctx, cands, &policy.Request{Stage: state.StageDecode})
		assert.Equal(t, []state.EngineID{"a", "b"}[order[0]], pk.Engine.ID(), "a complete tie keeps the first sampled")
	}
}

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg_power_of_n.rs` sample_size_bounds_the_winners_load: N distinct samples can never
// return one of the N−1 busiest engines; with N ≥ candidates it is the exact minimum.
func TestPowerOfNSampleSizeBoundsTheWinnersLoad(t *testing.T) {
	t.Parallel()
	const n = 10
	e := newEnv()
	cands := manyEngines(n)
	for i, c := range cands { // engine i has load i: e009 is the busiest
		e.native(c.ID(), loadmon.Report{WaitingRequests: uint64(i)})
	}
	for _, k := range []int{1, 2, 3, 5, 9, 10, 20} {
		cfg := e.cfg()
		cfg.Rand = nil
		p, _ := policy.NewPowerOfN(cfg, k)
		worst := 0
		for range 300 {
			pk, err := p.Pick(ctx, cands, &policy.Request{})
			require.NoError(t, err)
			for i, c := range cands {
				if c == pk.Engine && i > worst {
					worst = i
				}
			}
		}
		limit := n - min(k, n)
		assert.LessOrEqual(t, worst, limit, "N=%d never picks one of the %d busiest", k, min(k, n)-1)
		if k >= n {
			assert.Zero(t, worst, "N=%d covers the group: exact minimum", k)
		}
		if k >= 2 {
			assert.Less(t, worst, n-1, "N=%d never selects the unique busiest engine", k)
		}
	}
}

func TestPowerOfNSamplesDistinctEngines(t *testing.T) {
	t.Parallel()
	e := newEnv()
	e.native("a", loadmon.Report{WaitingRequests: 0})
	e.native("b", loadmon.Report{WaitingRequests: 9})
	e.native("c", loadmon.Report{WaitingRequests: 9})
	// The source repeats index 1 (b) before offering 2 (c): the duplicate is redrawn, not compared twice.
	e.rnd.vals = []int{1, 1, 1, 2}
	p, _ := policy.NewPowerOfN(e.cfg(), 2)
	pk, err := p.Pick(ctx, engines(state.StagePlain, "a", "b", "c"), &policy.Request{})
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("b"), pk.Engine.ID(), "tie between b and c keeps the first sampled")
	assert.Equal(t, 4, e.rnd.n, "four draws: b, b (dup), b (dup), c")
}

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg_load.rs` selected_load_reaches_admission_and_next_pick_reads_fresh_state.
func TestSelectedLoadReachesAdmissionAndNextPickReadsFreshState(t *testing.T) {
	t.Parallel()
	e := newEnv()
	require.NoError(t, e.load.Expect("a", 2))
	require.NoError(t, e.load.Expect("b", 2))
	e.native("c", loadmon.Report{RunningRequests: 50}) // a third, busy candidate: two of three are sampled
	for _, id := range []state.EngineID{"a", "b"} {
		for rank := range 2 {
			e.native(id, loadmon.Report{DPRank: rank, RunningRequests: 2, WaitingRequests: 2})
		}
	}
	// The second random draw happens after the pick captured its snapshot; a report arriving then
	// must not reach admission.
	e.rnd.vals = []int{0, 1}
	e.rnd.hook = func(call int) {
		if call == 2 {
			// Both ranks: picks compare a rank's own figures (docs/design.md §6), so one busy
			// rank alone would leave "a" tied with "b" on its other rank.
			e.native("a", loadmon.Report{DPRank: 0, RunningRequests: 100, WaitingRequests: 100})
			e.native("a", loadmon.Report{DPRank: 1, RunningRequests: 100, WaitingRequests: 100})
		}
	}
	p, _ := policy.NewPowerOfN(e.cfg(), 2)
	cands := engines(state.StagePlain, "a", "b", "c")
	pk, err := p.Pick(ctx, cands, &policy.Request{})
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("a"), pk.Engine.ID(), "tie at selection time keeps the first sampled")
	assert.Equal(t, 2, e.rnd.n)
	assert.Equal(t, admission.Metrics{RunningRequests: admission.Known(4), WaitingRequests: admission.Known(4),
		KVTokens: admission.Known(0), PendingPrefillTokens: admission.Known(0)}, e.check.metrics[0],
		"admission sees the selection snapshot: two ranks summed, running 4, waiting 4")

	e.rnd.hook = nil
	e.rnd.vals = []int{0, 1}
	pk, err = p.Pick(ctx, cands, &policy.Request{})
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("b"), pk.Engine.ID(), "the next pick reads the new report")
}

// sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg_load.rs` missing_stale_and_incomplete_reports_reach_admission_as_unknown.
func TestMissingStaleAndIncompleteReportsReachAdmissionAsUnknown(t *testing.T) {
	t.Parallel()
	e := newEnv()
	require.NoError(t, e.load.Expect("incomplete", 2))
	e.native("incomplete", loadmon.Report{RunningRequests: 7})
	e.native("stale", loadmon.Report{RunningRequests: 7})
	e.clk.Advance(loadmon.DefaultFreshness + time.Second)
	e.inflight.Acquire("stale", -1, 0)
	p, _ := policy.NewPowerOfN(e.cfg(), 1)
	for _, id := range []state.EngineID{"missing", "stale", "incomplete"} {
		e.check.metrics = nil
		_, err := p.Pick(ctx, engines(state.StagePlain, id), &policy.Request{})
		require.NoError(t, err)
		m := e.check.metrics[0]
		assert.False(t, m.RunningRequests.Known || m.WaitingRequests.Known || m.KVTokens.Known || m.PendingPrefillTokens.Known,
			"%s: every reported metric is unknown, not zero: %+v", id, m)
		if id == "stale" {
			assert.Equal(t, uint64(1), m.InFlightRequests, "in-flight is always known")
		}
	}
}

func TestLeastLoadScoresReportsPlusDispatchesSinceThem(t *testing.T) {
	t.Parallel()
	e := newEnv()
	e.native("a", loadmon.Report{WaitingRequests: 2, RunningRequests: 1}) // 3
	e.native("b", loadmon.Report{WaitingRequests: 1, RunningRequests: 3}) // 4
	e.native("c", loadmon.Report{WaitingRequests: 4, RunningRequests: 0}) // 4
	p, _ := policy.NewLeastLoad(e.cfg())
	cands := engines(state.StagePlain, "a", "b", "c")
	pk, err := p.Pick(ctx, cands, nil)
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("a"), pk.Engine.ID())
	assert.Equal(t, label.ReasonLeastLoad, pk.Reason)

	// Two dispatches to a after its report: 3 + 2 = 5 > 4. b and c tie at 4: the tie is broken by
	// one draw of Rand(2), where 0 lets the second tied engine replace the first (reservoir).
	e.clk.Advance(time.Millisecond)
	e.inflight.Acquire("a", -1, 0)
	e.inflight.Acquire("a", -1, 0).Release()
	e.rnd.vals = []int{1}
	pk, _ = p.Pick(ctx, cands, nil)
	assert.Equal(t, state.EngineID("b"), pk.Engine.ID(), "dispatches since the report count; draw 1 keeps b")
	e.rnd.vals = []int{0}
	pk, _ = p.Pick(ctx, cands, nil)
	assert.Equal(t, state.EngineID("c"), pk.Engine.ID(), "draw 0 replaces b with c")

	// b gains an in-flight request dispatched BEFORE its next report: the report covers it, so it
	// is not counted twice, but the tie with c now goes to the fewer in-flight requests.
	e.inflight.Acquire("b", -1, 0)
	e.clk.Advance(time.Millisecond)
	e.native("b", loadmon.Report{WaitingRequests: 1, RunningRequests: 3})
	pk, _ = p.Pick(ctx, cands, nil)
	assert.Equal(t, state.EngineID("c"), pk.Engine.ID())
}

func TestLeastLoadFallsBackToInFlightWhenAnyReportIsMissing(t *testing.T) {
	t.Parallel()
	e := newEnv()
	e.native("a", loadmon.Report{WaitingRequests: 0})
	e.native("b", loadmon.Report{WaitingRequests: 100})
	e.inflight.Acquire("a", -1, 0)
	e.inflight.Acquire("a", -1, 0)
	e.inflight.Acquire("c", -1, 0)
	p, _ := policy.NewLeastLoad(e.cfg())
	pk, err := p.Pick(ctx, engines(state.StagePlain, "a", "b", "c"), nil)
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("b"), pk.Engine.ID(), "c has no report: all scored by in-flight (a 2, b 0, c 1)")
}

func TestPowerOfNTerminatesWithADegenerateRandomSource(t *testing.T) {
	t.Parallel()
	e := newEnv()
	for _, id := range []state.EngineID{"a", "b", "c", "d"} {
		e.native(id, loadmon.Report{WaitingRequests: 1})
	}
	e.native("c", loadmon.Report{WaitingRequests: 0})
	cfg := e.cfg()
	cfg.Rand = func(int) int { return 0 } // always the same index
	p, _ := policy.NewPowerOfN(cfg, 3)
	pk, err := p.Pick(ctx, engines(state.StagePlain, "a", "b", "c", "d"), &policy.Request{})
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("c"), pk.Engine.ID(), "samples a, then b and c by probing; c is least loaded")
}

// The coverage rule compares a set on the best basis every engine of it has (docs/design.md §6):
// native figures when all are native, reported requests when all have a fresh report, else
// in-flight only. PowerOfN with N covering the group scans every engine.
func TestPowerOfNComparesOnTheBestCommonBasis(t *testing.T) {
	t.Parallel()
	basic := func(e *env, id state.EngineID, waiting uint64) {
		require.NoError(t, e.load.Report(loadmon.Report{Engine: id, WaitingRequests: waiting}))
	}
	cases := []struct {
		name  string
		setup func(e *env)
		want  state.EngineID
	}{
		{"all native: fewest waiting uncached tokens", func(e *env) {
			e.native("a", loadmon.Report{WaitingRequests: 5, Native: &loadmon.NativeLoad{WaitingUncachedTokens: 100}})
			e.native("b", loadmon.Report{WaitingRequests: 1, Native: &loadmon.NativeLoad{WaitingUncachedTokens: 5000}})
			e.native("c", loadmon.Report{WaitingRequests: 3, Native: &loadmon.NativeLoad{WaitingUncachedTokens: 9000}})
		}, "a"},
		{"native and basic: fewest waiting requests", func(e *env) {
			e.native("a", loadmon.Report{WaitingRequests: 5, Native: &loadmon.NativeLoad{WaitingUncachedTokens: 100}})
			basic(e, "b", 1)
			e.native("c", loadmon.Report{WaitingRequests: 3, Native: &loadmon.NativeLoad{WaitingUncachedTokens: 9000}})
		}, "b"},
		{"all basic: fewest waiting requests, in-flight after them", func(e *env) {
			e.inflight.Acquire("b", -1, 0) // before the reports: they reflect these
			e.inflight.Acquire("b", -1, 0)
			e.clk.Advance(time.Millisecond)
			basic(e, "a", 4)
			basic(e, "b", 2)
			basic(e, "c", 3)
		}, "b"},
		{"all basic: the dispatches since a report count as waiting", func(e *env) {
			basic(e, "a", 4)
			basic(e, "b", 2)
			basic(e, "c", 3)
			e.inflight.Acquire("b", -1, 0)
			e.inflight.Acquire("b", -1, 0)
		}, "c"},
		{"one unknown: in-flight only", func(e *env) {
			basic(e, "a", 0)
			basic(e, "b", 9)
			e.inflight.Acquire("a", -1, 0)
			e.inflight.Acquire("c", -1, 0)
		}, "b"},
		{"unknown is not idle: a known idle engine with fewer in flight wins", func(e *env) {
			basic(e, "a", 0)
			basic(e, "b", 0)
			e.inflight.Acquire("b", -1, 0)
			e.inflight.Acquire("c", -1, 0)
			e.inflight.Acquire("c", -1, 0)
		}, "a"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv()
			tc.setup(e)
			p, err := policy.NewPowerOfN(e.cfg(), 3)
			require.NoError(t, err)
			pk, err := p.Pick(ctx, engines(state.StagePrefill, "a", "b", "c"), &policy.Request{Stage: state.StagePrefill})
			require.NoError(t, err)
			assert.Equal(t, tc.want, pk.Engine.ID())
		})
	}
}
