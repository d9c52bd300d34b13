package enginepick_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// An in-flight cap holds under concurrency (docs/design.md §5, "a configured cap is a promise"):
// 64 Selects released together by a start barrier, each holding its dispatch until every one has
// returned, never put more than the cap in flight on an engine, whichever policy admitted it, and
// on both legs of a PD pair. Before the check and the acquire were one atomic step, least-load
// over two engines with a cap of 4 admitted up to 64 requests to one engine in a few trials of a
// hundred; with a checker that yields after checking, every policy broke the cap in most trials.

const capGoroutines = 64

// capTrials is the number of bursts per case: 1,000, or 100 with -short.
func capTrials() int {
	if testing.Short() {
		return 100
	}
	return 1000
}

// capRouter is one model ("m") with one bucket whose groups run the policy mk builds, with an
// in-flight cap per stage, over plain engines, or prefill and decode engines for PD.
type capRouter struct {
	router   *enginepick.Router
	inflight *loadmon.InFlight
	engines  map[state.Stage][]state.EngineID
	caps     map[state.Stage]uint64
	tokens   []uint32 // the prompt of every request; its blocks are stored on every engine
}

type capPolicy func(cfg policy.Config, src kvindex.Source, store affinity.Store) (policy.Policy, error)

// yieldingLimits is admission.Limits that yields the processor after each check, widening the
// window between a policy's check and the Router's acquire in which other selections run, so that
// a check and an acquire that are not one atomic step break the cap in most trials rather than in
// a few of them.
type yieldingLimits struct{ admission.Limits }

func (l yieldingLimits) Check(e state.Engine, m admission.Metrics) (admission.Verdict, error) {
	v, err := l.Limits.Check(e, m)
	runtime.Gosched()
	return v, err
}

// newCapRouter builds the router; yield checks with yieldingLimits rather than admission.Limits.
func newCapRouter(t *testing.T, mk capPolicy, engines map[state.Stage][]state.EngineID, caps map[state.Stage]uint64, yield bool) *capRouter {
	t.Helper()
	r := &capRouter{inflight: loadmon.NewInFlight(nil), engines: engines, caps: caps, tokens: tokens(64, 7)}
	load := loadmon.NewTable()
	h, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: 16})
	require.NoError(t, err)
	index, err := kvindex.NewIndex(h, kvindex.Options{})
	require.NoError(t, err)
	src, err := kvindex.NewLocalSource(index)
	require.NoError(t, err)
	store, err := affinity.NewMemoryStore(affinity.Options{})
	require.NoError(t, err)
	reg := &state.StaticRegistry{}
	groups := map[state.Stage]*bucket.EngineGroup{}
	for stage, ids := range engines {
		for _, id := range ids {
			require.NoError(t, reg.Add(state.NewStaticEngine(id, "m", stage)))
			require.NoError(t, index.Store(kvindex.StoreEvent{Engine: id, BlockHashes: h.Keys(r.tokens), TokenIDs: r.tokens, Tier: kvindex.TierDevice}))
		}
		var check admission.Checker = admission.Limits{MaxInFlightRequests: admission.Cap(caps[stage])}
		if yield {
			check = yieldingLimits{check.(admission.Limits)}
		}
		p, err := mk(policy.Config{Load: load, InFlight: r.inflight, Admission: check}, src, store)
		require.NoError(t, err)
		groups[stage], err = bucket.NewEngineGroup(p, nil)
		require.NoError(t, err)
	}
	var b *bucket.Bucket
	if g, ok := groups[state.StagePlain]; ok {
		b, err = bucket.NewPlainBucket(bucket.Spec{ID: "all"}, g)
	} else {
		b, err = bucket.NewPDBucket(bucket.Spec{ID: "pd"}, groups[state.StagePrefill], groups[state.StageDecode])
	}
	require.NoError(t, err)
	res, err := bucket.NewResolver([]*bucket.Bucket{b}, bucket.ResolverOptions{})
	require.NoError(t, err)
	r.router, err = enginepick.NewRouter(enginepick.Options{Registry: reg, InFlight: r.inflight, Load: load, Index: index,
		Resolvers: map[state.ModelID]*bucket.Resolver{"m": res}})
	require.NoError(t, err)
	return r
}

// trials runs capTrials() bursts of capGoroutines selections, each burst released together by a
// start barrier and held until every selection of the burst has returned, and describes every
// trial in which an engine went past its cap, the in-flight counters differed from the dispatches
// held, or a failure was not an admission rejection (503). The workers live across trials, so that
// a trial costs selections, not goroutine starts.
func (r *capRouter) trials() []string {
	trials := capTrials()
	var (
		starts = make([]chan struct{}, trials)
		done   sync.WaitGroup
		ds     [capGoroutines]*enginepick.Dispatch
		errs   [capGoroutines]error
		broken []string
	)
	for i := range starts {
		starts[i] = make(chan struct{})
	}
	for g := range capGoroutines {
		go func() {
			for i := range trials {
				key := fmt.Sprintf("k%d-%d", i, g) // a new session and routing key: bound on this pick
				req := &bucket.Request{Model: "m", TokenIDs: r.tokens, Signals: bucket.Signals{InputTokens: int64(len(r.tokens))},
					SessionKey: key, RoutingKey: key}
				<-starts[i]
				ds[g], errs[g] = r.router.Select(context.Background(), req)
				done.Done()
			}
		}()
	}
	for i := range trials {
		done.Add(capGoroutines)
		close(starts[i])
		done.Wait()
		if b := r.check(ds[:], errs[:]); b != "" {
			broken = append(broken, fmt.Sprintf("trial %d: %s", i, b))
		}
		for _, d := range ds {
			d.Release()
		}
	}
	return broken
}

// check describes what one burst broke, or returns "".
func (r *capRouter) check(ds []*enginepick.Dispatch, errs []error) string {
	held := map[state.EngineID]uint64{}
	for g, d := range ds {
		if d == nil {
			if !errors.Is(errs[g], policy.ErrAdmissionRejected) || bucket.StatusCode(errs[g]) != http.StatusServiceUnavailable {
				return fmt.Sprintf("goroutine %d: %v (status %d)", g, errs[g], bucket.StatusCode(errs[g]))
			}
			continue
		}
		for _, e := range d.Selection.Engines() {
			held[e.ID()]++
		}
	}
	for stage, ids := range r.engines {
		for _, id := range ids {
			if n := r.inflight.Count(id); n != held[id] || n > r.caps[stage] {
				return fmt.Sprintf("%s engine %s: %d dispatches held, %d in flight, cap %d", stage, id, held[id], n, r.caps[stage])
			}
		}
	}
	return ""
}

func TestInFlightCapHoldsUnderConcurrency(t *testing.T) {
	t.Parallel()
	plain2 := map[state.Stage][]state.EngineID{state.StagePlain: {"a", "b"}}
	plainCap := map[state.Stage]uint64{state.StagePlain: 4}
	cacheAware := func(cfg policy.Config, src kvindex.Source, _ affinity.Store) (policy.Policy, error) {
		return policy.NewCacheAware(cfg, policy.CacheAwareOptions{Source: src, MinMatchedTokens: 16})
	}
	leastLoad := func(cfg policy.Config, _ kvindex.Source, _ affinity.Store) (policy.Policy, error) {
		return policy.NewLeastLoad(cfg)
	}
	powerOfTwo := func(cfg policy.Config, _ kvindex.Source, _ affinity.Store) (policy.Policy, error) {
		return policy.NewPowerOfN(cfg, 2)
	}
	tests := []struct {
		name    string
		mk      capPolicy
		engines map[state.Stage][]state.EngineID
		caps    map[state.Stage]uint64
		limits  bool // admission.Limits as configured, not yieldingLimits
	}{
		// The reported reproduction: admission.Limits as configured, one engine.
		{"least_load/limits", leastLoad, map[state.Stage][]state.EngineID{state.StagePlain: {"a"}}, plainCap, true},
		{"least_load", leastLoad, plain2, plainCap, false},
		{"round_robin", func(cfg policy.Config, _ kvindex.Source, _ affinity.Store) (policy.Policy, error) {
			return policy.NewRoundRobin(cfg)
		}, plain2, plainCap, false},
		{"random", func(cfg policy.Config, _ kvindex.Source, _ affinity.Store) (policy.Policy, error) {
			return policy.NewRandom(cfg)
		}, plain2, plainCap, false},
		{"power_of_two", powerOfTwo, plain2, plainCap, false},
		{"cache_aware", cacheAware, plain2, plainCap, false},
		{"session_aware", func(cfg policy.Config, _ kvindex.Source, store affinity.Store) (policy.Policy, error) {
			return policy.NewSessionAware(cfg, policy.SessionAwareOptions{Store: store})
		}, plain2, plainCap, false},
		{"sticky", func(cfg policy.Config, _ kvindex.Source, store affinity.Store) (policy.Policy, error) {
			return policy.NewSticky(cfg, policy.StickyOptions{Store: store, Fallback: label.LeastLoad})
		}, plain2, plainCap, false},
		// PD: one leg's cap is the tighter; when the decode leg loses the race, the pair gives its
		// prefill leg back.
		{"pd/least_load", leastLoad, map[state.Stage][]state.EngineID{state.StagePrefill: {"p1", "p2"}, state.StageDecode: {"d1", "d2"}},
			map[state.Stage]uint64{state.StagePrefill: 4, state.StageDecode: 2}, false},
		{"pd/power_of_two", powerOfTwo, map[state.Stage][]state.EngineID{state.StagePrefill: {"p1", "p2"}, state.StageDecode: {"d1", "d2"}},
			map[state.Stage]uint64{state.StagePrefill: 2, state.StageDecode: 3}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			r := newCapRouter(t, tt.mk, tt.engines, tt.caps, !tt.limits)
			broken := r.trials()
			assert.Empty(t, broken, "%d of %d trials broke the cap", len(broken), capTrials())
		})
	}
}

// checkerFunc adapts a function to admission.Checker.
type checkerFunc func(state.Engine, admission.Metrics) (admission.Verdict, error)

func (f checkerFunc) Check(e state.Engine, m admission.Metrics) (admission.Verdict, error) {
	return f(e, m)
}

// overtaking is admission.Limits with an in-flight cap of 1 whose first admission is overtaken:
// right after the check, another dispatch (held by the test) takes the admitted engine to its
// cap, as a concurrent selection would.
func overtaking(inflight *loadmon.InFlight, held *[]*loadmon.Guard, overtaken *state.EngineID) admission.Checker {
	limits := admission.Limits{MaxInFlightRequests: admission.Cap(1)}
	var once sync.Once
	return checkerFunc(func(e state.Engine, m admission.Metrics) (admission.Verdict, error) {
		v, err := limits.Check(e, m)
		if v.Admit {
			once.Do(func() {
				*overtaken = e.ID()
				*held = append(*held, inflight.Acquire(e.ID(), -1, 0))
			})
		}
		return v, err
	})
}

// A selection whose engine was taken to its in-flight cap between the check and the acquire
// selects again and gets the other engine; a PD pair whose decode leg lost gives its prefill leg
// back.
func TestSelectOvertakenAtTheCapSelectsAgain(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		engines map[state.Stage][]state.EngineID
		stage   state.Stage // whose first admission is overtaken
	}{
		{"plain", map[state.Stage][]state.EngineID{state.StagePlain: {"a", "b"}}, state.StagePlain},
		{"pd/decode", map[state.Stage][]state.EngineID{state.StagePrefill: {"p1"}, state.StageDecode: {"d1", "d2"}}, state.StageDecode},
		{"pd/prefill", map[state.Stage][]state.EngineID{state.StagePrefill: {"p1", "p2"}, state.StageDecode: {"d1"}}, state.StagePrefill},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var held []*loadmon.Guard
			var overtaken state.EngineID
			inflight := loadmon.NewInFlight(nil)
			r := newCheckedRouter(t, inflight, tt.engines, func(stage state.Stage) admission.Checker {
				if stage == tt.stage {
					return overtaking(inflight, &held, &overtaken)
				}
				return admission.Limits{MaxInFlightRequests: admission.Cap(1)}
			})
			d, err := r.Select(context.Background(), &bucket.Request{Model: "m"})
			require.NoError(t, err)
			require.Len(t, held, 1, "the first admission was overtaken")
			want := map[state.EngineID]uint64{overtaken: 1} // the overtaking dispatch
			for _, e := range d.Selection.Engines() {
				assert.NotEqual(t, overtaken, e.ID(), "the engine at its cap is not selected")
				want[e.ID()]++
			}
			for _, ids := range tt.engines {
				for _, id := range ids {
					assert.Equal(t, want[id], inflight.Count(id), "in flight on %s", id)
				}
			}
			d.Release()
			held[0].Release()
			for _, ids := range tt.engines {
				for _, id := range ids {
					assert.Zero(t, inflight.Count(id), "%s released", id)
				}
			}
		})
	}
}

// A selection that keeps finding its engine at the in-flight cap stops after 4 runs of the bucket
// loop with the rejection admission would have given (503), and holds nothing.
func TestSelectOvertakenEveryTimeIsAnAdmissionRejection(t *testing.T) {
	t.Parallel()
	var calls atomic.Int64
	zeroCap := checkerFunc(func(state.Engine, admission.Metrics) (admission.Verdict, error) {
		calls.Add(1)
		return admission.Verdict{Admit: true, InFlightCap: 0, HasInFlightCap: true}, nil // never acquirable
	})
	inflight := loadmon.NewInFlight(nil)
	engines := map[state.Stage][]state.EngineID{state.StagePrefill: {"p"}, state.StageDecode: {"d"}}
	r := newCheckedRouter(t, inflight, engines, func(stage state.Stage) admission.Checker {
		if stage == state.StageDecode {
			return zeroCap
		}
		return admission.Limits{}
	})
	d, err := r.Select(context.Background(), &bucket.Request{Model: "m"})
	require.Nil(t, d)
	var ex *bucket.ExhaustedError
	require.ErrorAs(t, err, &ex)
	require.Len(t, ex.Rejections, 1)
	rej := ex.Rejections[0]
	assert.Equal(t, [4]any{state.EngineID("d"), admission.LimitInFlightRequests, uint64(0), uint64(0)},
		[4]any{rej.Engine.ID(), rej.Limit, rej.Observed, rej.Cap})
	var se *bucket.StageError
	require.ErrorAs(t, ex.Last, &se)
	assert.Equal(t, [2]any{"pd", state.StageDecode}, [2]any{se.Bucket, se.Stage})
	assert.Equal(t, http.StatusServiceUnavailable, bucket.StatusCode(err))
	assert.Equal(t, label.FailAdmissionRejected, enginepick.FailureReason(err))
	assert.Equal(t, int64(4), calls.Load(), "the bucket loop ran 4 times")
	assert.Zero(t, inflight.Count("p"), "the prefill leg was given back")
	assert.Zero(t, inflight.Count("d"))
	n, _ := inflight.DispatchedSince("d", -1, time.Time{})
	assert.Zero(t, n, "nothing recorded on the decode engine")
}

// newCheckedRouter is one model ("m") with one bucket whose groups run least-load with the
// checker check returns for their stage.
func newCheckedRouter(t *testing.T, inflight *loadmon.InFlight, engines map[state.Stage][]state.EngineID, check func(state.Stage) admission.Checker) *enginepick.Router {
	t.Helper()
	load := loadmon.NewTable()
	reg := &state.StaticRegistry{}
	groups := map[state.Stage]*bucket.EngineGroup{}
	for stage, ids := range engines {
		for _, id := range ids {
			require.NoError(t, reg.Add(state.NewStaticEngine(id, "m", stage)))
		}
		p, err := policy.NewLeastLoad(policy.Config{Load: load, InFlight: inflight, Admission: check(stage)})
		require.NoError(t, err)
		groups[stage], err = bucket.NewEngineGroup(p, nil)
		require.NoError(t, err)
	}
	var b *bucket.Bucket
	var err error
	if g, ok := groups[state.StagePlain]; ok {
		b, err = bucket.NewPlainBucket(bucket.Spec{ID: "all"}, g)
	} else {
		b, err = bucket.NewPDBucket(bucket.Spec{ID: "pd"}, groups[state.StagePrefill], groups[state.StageDecode])
	}
	require.NoError(t, err)
	res, err := bucket.NewResolver([]*bucket.Bucket{b}, bucket.ResolverOptions{})
	require.NoError(t, err)
	r, err := enginepick.NewRouter(enginepick.Options{Registry: reg, InFlight: inflight, Load: load,
		Resolvers: map[state.ModelID]*bucket.Resolver{"m": res}})
	require.NoError(t, err)
	return r
}
