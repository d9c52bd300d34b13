package policy_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

var ctx = context.Background()

// conformance: every policy satisfies the Policy contract (docs/design.md §4).
func TestPolicyConformance(t *testing.T) {
	t.Parallel()
	builders := map[string]func(policy.Config) (policy.Policy, error){
		"round_robin": func(c policy.Config) (policy.Policy, error) { return policy.NewRoundRobin(c) },
		"random":      func(c policy.Config) (policy.Policy, error) { return policy.NewRandom(c) },
		"power_of_2":  func(c policy.Config) (policy.Policy, error) { return policy.NewPowerOfN(c, 2) },
		"power_of_1":  func(c policy.Config) (policy.Policy, error) { return policy.NewPowerOfN(c, 1) },
		"power_of_64": func(c policy.Config) (policy.Policy, error) { return policy.NewPowerOfN(c, 64) },
		"least_load":  func(c policy.Config) (policy.Policy, error) { return policy.NewLeastLoad(c) },
	}
	for name, build := range builders {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			for _, broken := range []policy.Config{
				{InFlight: loadmon.NewInFlight(nil)},
				{Load: loadmon.NewTable()},
			} {
				_, err := build(broken)
				assert.ErrorIs(t, err, policy.ErrInvalidConfiguration, "nil state handle is rejected")
			}

			e := newEnv()
			e.rnd = nil
			cfg := e.cfg()
			cfg.Rand = nil // the default source must be safe concurrently
			p, err := build(cfg)
			require.NoError(t, err)

			_, err = p.Pick(ctx, nil, &policy.Request{})
			assert.ErrorIs(t, err, policy.ErrNoCandidates)
			assert.Empty(t, e.check.Calls(), "no candidates: admission is not called")

			cands := manyEngines(5)
			var wg sync.WaitGroup
			for range 8 {
				wg.Go(func() {
					for range 100 {
						pk, err := p.Pick(ctx, cands, &policy.Request{Stage: state.StagePlain})
						if err != nil {
							t.Error(err)
							return
						}
						found := false
						for _, c := range cands {
							found = found || c == pk.Engine
						}
						if !found || pk.Reason == "" {
							t.Errorf("pick %v (%q) is not a candidate or has no reason", pk.Engine, pk.Reason)
						}
					}
				})
			}
			wg.Wait()
			assert.Len(t, e.check.Calls(), 800, "admission runs exactly once per pick")

			e.check.reject = map[state.EngineID]string{}
			for _, c := range cands {
				e.check.reject[c.ID()] = "full"
			}
			before := len(e.check.Calls())
			_, err = p.Pick(ctx, cands, &policy.Request{})
			var rej *policy.AdmissionRejectedError
			require.ErrorAs(t, err, &rej)
			assert.Equal(t, "full", rej.Limit)
			assert.ErrorIs(t, err, policy.ErrAdmissionRejected)
			assert.Len(t, e.check.Calls(), before+1, "a rejection is returned, never retried on another engine")

			e.check.err = errors.New("checker broke")
			_, err = p.Pick(ctx, cands, &policy.Request{})
			assert.ErrorIs(t, err, e.check.err, "a checker error propagates")
		})
	}
}

func TestRoundRobinRotatesWithOneCursorPerInstance(t *testing.T) {
	t.Parallel()
	e := newEnv()
	a, _ := policy.NewRoundRobin(e.cfg())
	b, _ := policy.NewRoundRobin(e.cfg())
	cands := engines(state.StagePlain, "a", "b", "c")
	var got []state.EngineID
	for range 4 {
		pk, err := a.Pick(ctx, cands, nil)
		require.NoError(t, err)
		assert.Equal(t, label.ReasonRoundRobin, pk.Reason)
		got = append(got, pk.Engine.ID())
	}
	assert.Equal(t, []state.EngineID{"a", "b", "c", "a"}, got)
	pk, _ := b.Pick(ctx, cands, nil)
	assert.Equal(t, state.EngineID("a"), pk.Engine.ID(), "another instance has its own cursor")

	e.check.reject = map[state.EngineID]string{"b": "full"}
	_, err := a.Pick(ctx, cands, nil)
	var rej *policy.AdmissionRejectedError
	require.ErrorAs(t, err, &rej)
	assert.Equal(t, state.EngineID("b"), rej.Engine.ID())
	pk, _ = a.Pick(ctx, cands, nil)
	assert.Equal(t, state.EngineID("c"), pk.Engine.ID(), "the cursor moved past the rejected engine")
}

func TestRandomUsesItsSource(t *testing.T) {
	t.Parallel()
	e := newEnv()
	e.rnd.vals = []int{2, 0, 1}
	p, _ := policy.NewRandom(e.cfg())
	cands := engines(state.StagePlain, "a", "b", "c")
	var got []state.EngineID
	for range 3 {
		pk, err := p.Pick(ctx, cands, nil)
		require.NoError(t, err)
		assert.Equal(t, label.ReasonRandom, pk.Reason)
		got = append(got, pk.Engine.ID())
	}
	assert.Equal(t, []state.EngineID{"c", "a", "b"}, got)
}

func TestRandomIsRoughlyUniform(t *testing.T) {
	t.Parallel()
	e := newEnv()
	cfg := e.cfg()
	cfg.Rand = nil
	p, _ := policy.NewRandom(cfg)
	cands := engines(state.StagePlain, "a", "b", "c", "d")
	counts := map[state.EngineID]int{}
	for range 8000 {
		pk, _ := p.Pick(ctx, cands, nil)
		counts[pk.Engine.ID()]++
	}
	for id, n := range counts {
		assert.InDelta(t, 2000, n, 250, "engine %s picked %d of 8000 times", id, n)
	}
	assert.Len(t, counts, 4)
}

func TestErrorTaxonomy(t *testing.T) {
	t.Parallel()
	a := state.NewStaticEngine("a", "m", state.StagePlain)
	b := state.NewStaticEngine("b", "m", state.StagePlain)
	ra := &policy.AdmissionRejectedError{Engine: a, Limit: admission.LimitKVTokens, Observed: 100, Cap: 100}
	rb := &policy.AdmissionRejectedError{Engine: b, Limit: admission.LimitRunningRequests, Observed: 2, Cap: 2}
	var err error = &policy.NoAdmissibleEngineError{Rejections: []*policy.AdmissionRejectedError{ra, rb}}
	assert.ErrorIs(t, err, policy.ErrAdmissionRejected)
	var got *policy.AdmissionRejectedError
	require.ErrorAs(t, err, &got)
	assert.Same(t, ra, got)
	assert.ErrorIs(t, err, rb)
	assert.Contains(t, err.Error(), `"b" max_running_requests`)

	var oc error = &policy.OutsideCandidatesError{Engine: "x"}
	assert.ErrorIs(t, oc, policy.ErrOutsideCandidates)
	assert.NotErrorIs(t, oc, policy.ErrAdmissionRejected)
	assert.ErrorIs(t, policy.ErrInvalidSignal, state.ErrInvalidSignal)
	assert.ErrorIs(t, policy.ErrInvalidConfiguration, state.ErrInvalidConfiguration)
}

// Zero-allocation promise of the pick path (docs/performance.md).
func TestSimplePicksDoNotAllocate(t *testing.T) {
	e := newEnv()
	cfg := e.cfg()
	cfg.Admission = admission.Limits{MaxInFlightRequests: admission.Cap(1000)}
	cfg.Rand = nil
	cands := manyEngines(64)
	for _, c := range cands {
		e.native(c.ID(), loadmon.Report{})
	}
	rr, _ := policy.NewRoundRobin(cfg)
	rnd, _ := policy.NewRandom(cfg)
	p2, _ := policy.NewPowerOfN(cfg, 2)
	p8, _ := policy.NewPowerOfN(cfg, 8)
	pAll, _ := policy.NewPowerOfN(cfg, 64)
	ll, _ := policy.NewLeastLoad(cfg)
	req := &policy.Request{Stage: state.StagePrefill}
	for name, p := range map[string]policy.Policy{"round_robin": rr, "random": rnd, "power_of_2": p2, "power_of_8": p8, "power_of_64": pAll, "least_load": ll} {
		allocs := testing.AllocsPerRun(200, func() {
			if _, err := p.Pick(ctx, cands, req); err != nil {
				t.Fatal(err)
			}
		})
		assert.Zero(t, allocs, "%s allocates %.1f per pick", name, allocs)
	}
}

// Every policy's pick carries the in-flight cap its engine was admitted under, from a custom
// checker's verdict (here a per-engine cap) as from admission.Limits, so that the dispatch can be
// counted under it atomically (docs/design.md §5). An engine admitted without one carries none.
func TestPickCarriesTheInFlightCapItWasAdmittedUnder(t *testing.T) {
	t.Parallel()
	perEngine := checkerFunc(func(e state.Engine, _ admission.Metrics) (admission.Verdict, error) {
		if e.ID() == "a" {
			return admission.Verdict{Admit: true, InFlightCap: 3, HasInFlightCap: true}, nil
		}
		return admission.Verdict{Admit: true}, nil
	})
	c := newCacheEnv(t)
	tok := prompt(4*blockTokens, 1)
	c.hold(t, "a", tok, 4) // a cache-aware pick of a is a hit, of b a miss
	store, err := affinity.NewMemoryStore(affinity.Options{})
	require.NoError(t, err)
	builders := map[string]func(policy.Config) (policy.Policy, error){
		"round_robin": func(c policy.Config) (policy.Policy, error) { return policy.NewRoundRobin(c) },
		"random":      func(c policy.Config) (policy.Policy, error) { return policy.NewRandom(c) },
		"power_of_2":  func(c policy.Config) (policy.Policy, error) { return policy.NewPowerOfN(c, 2) },
		"least_load":  func(c policy.Config) (policy.Policy, error) { return policy.NewLeastLoad(c) },
		"cache_aware": func(cfg policy.Config) (policy.Policy, error) {
			return policy.NewCacheAware(cfg, policy.CacheAwareOptions{Source: c.source, MinMatchedTokens: blockTokens})
		},
		"session_aware": func(c policy.Config) (policy.Policy, error) {
			return policy.NewSessionAware(c, policy.SessionAwareOptions{Store: store})
		},
		"sticky": func(c policy.Config) (policy.Policy, error) {
			return policy.NewSticky(c, policy.StickyOptions{Store: store})
		},
		"sticky_rendezvous": func(c policy.Config) (policy.Policy, error) {
			return policy.NewSticky(c, policy.StickyOptions{Rendezvous: true})
		},
	}
	for name, build := range builders {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			for _, tt := range []struct {
				checker admission.Checker
				engine  state.EngineID
				cap     uint64
				has     bool
			}{
				{perEngine, "a", 3, true},
				{perEngine, "b", 0, false},
				{admission.Limits{MaxInFlightRequests: admission.Cap(5)}, "b", 5, true},
				{admission.Limits{MaxWaitingRequests: admission.Cap(5)}, "a", 0, false},
			} {
				cfg := c.cfg()
				cfg.Admission = tt.checker
				p, err := build(cfg)
				require.NoError(t, err)
				req := creq(tok)
				req.SessionKey, req.RoutingKey = name+string(tt.engine), name+string(tt.engine)
				pk, err := p.Pick(ctx, engines(state.StagePrefill, tt.engine), req)
				require.NoError(t, err)
				assert.Equal(t, tt.engine, pk.Engine.ID())
				assert.Equal(t, [2]any{tt.cap, tt.has}, [2]any{pk.InFlightCap, pk.HasInFlightCap}, "%s admitted by %T", tt.engine, tt.checker)
				if name == "cache_aware" && tt.engine == "a" {
					assert.Equal(t, label.ReasonCacheCandidate, pk.Reason, "a holder's admission")
				}
			}
		})
	}
}
