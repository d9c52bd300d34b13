// Package affinitysuite holds the acceptance scenarios of the store-backed affinity policies
// (policy.NewSessionAware and policy.NewSticky with a Store), written once and run against every
// affinity.Store of the module: the memory store (package policy's tests) and Redis, standalone
// and clustered (package redisstore's tests). The scenarios are those of the session-aware policy
// of sgl-project/sglang `experimental/sgl-router/tests/component/policies_reorg_session_aware.rs`,
// named the same, plus store failure and replica agreement (docs/design.md §12).
package affinitysuite

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/affinity/affinitytest"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

var bg = context.Background()

// Variant is one store-backed affinity policy under test.
type Variant struct {
	Name string
	// Build returns the policy over store, with the fallback taking the exact minimum over up
	// to `choices` candidates when it samples (SessionAware's power-of-N), or its own rule.
	Build func(cfg policy.Config, store affinity.Store, choices int, failOpen bool) (policy.Policy, error)
	// SetKey puts key into the request field the policy reads.
	SetKey func(r *policy.Request, key string)
	// Namespace is the policy's affinity namespace.
	Namespace string
	// Labels.
	Primary, Assigned, NoKey string
}

// Variants returns SessionAware and Sticky (store mode, least_load fallback, which like
// power-of-N picks the least pressured engine here).
func Variants() []Variant {
	return []Variant{
		{
			Name: label.SessionAware,
			Build: func(cfg policy.Config, st affinity.Store, choices int, failOpen bool) (policy.Policy, error) {
				return policy.NewSessionAware(cfg, policy.SessionAwareOptions{Store: st, Choices: choices, FallbackOnUnavailable: failOpen})
			},
			SetKey:    func(r *policy.Request, k string) { r.SessionKey = k },
			Namespace: "session",
			Primary:   label.ReasonSessionPrimary, Assigned: label.ReasonAssigned, NoKey: label.ReasonNoSession,
		},
		{
			Name: label.Sticky,
			Build: func(cfg policy.Config, st affinity.Store, _ int, failOpen bool) (policy.Policy, error) {
				return policy.NewSticky(cfg, policy.StickyOptions{Store: st, Fallback: label.LeastLoad, FallbackOnUnavailable: failOpen})
			},
			SetKey:    func(r *policy.Request, k string) { r.RoutingKey = k },
			Namespace: "sticky",
			Primary:   label.ReasonStickyPrimary, Assigned: label.ReasonStickyAssigned, NoKey: label.ReasonNoRoutingKey,
		},
	}
}

// recorder is an admission.Checker recording every call; it rejects engines listed in reject.
type recorder struct {
	mu      sync.Mutex
	calls   []state.Engine
	metrics []admission.Metrics
	reject  map[state.EngineID]bool
}

func (r *recorder) Check(e state.Engine, m admission.Metrics) (admission.Verdict, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, e)
	r.metrics = append(r.metrics, m)
	if r.reject[e.ID()] {
		return admission.Verdict{Limit: "full", Observed: 1, Cap: 1}, nil
	}
	return admission.Verdict{Admit: true}, nil
}

func (r *recorder) ids() []state.EngineID {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]state.EngineID, len(r.calls))
	for i, e := range r.calls {
		out[i] = e.ID()
	}
	return out
}

func (r *recorder) setReject(ids ...state.EngineID) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.reject = map[state.EngineID]bool{}
	for _, id := range ids {
		r.reject[id] = true
	}
}

func (r *recorder) reset() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls, r.metrics = nil, nil
}

// spy counts the store calls that reach the wrapped store; before, when set, runs first (a
// concurrent replica's write), and fail makes every call fail as an unreachable backend would.
type spy struct {
	affinity.Store
	lookups, binds, replaces atomic.Int64
	before                   func(op string, s affinity.Scope)
	fail                     map[string]bool
}

var errDown = errors.New("connection refused")

func (s *spy) hook(op string, sc affinity.Scope) error {
	if s.before != nil {
		s.before(op, sc)
	}
	if s.fail[op] {
		return &affinity.UnavailableError{Op: op, Err: errDown}
	}
	return nil
}

func (s *spy) Lookup(ctx context.Context, sc affinity.Scope) (state.EngineID, bool, error) {
	s.lookups.Add(1)
	if err := s.hook("lookup", sc); err != nil {
		return "", false, err
	}
	return s.Store.Lookup(ctx, sc)
}

func (s *spy) Bind(ctx context.Context, sc affinity.Scope, e state.EngineID) (state.EngineID, error) {
	s.binds.Add(1)
	if err := s.hook("bind", sc); err != nil {
		return "", err
	}
	return s.Store.Bind(ctx, sc, e)
}

func (s *spy) Replace(ctx context.Context, sc affinity.Scope, want, e state.EngineID) (state.EngineID, error) {
	s.replaces.Add(1)
	if err := s.hook("replace", sc); err != nil {
		return "", err
	}
	return s.Store.Replace(ctx, sc, want, e)
}

func (s *spy) writes() int64 { return s.binds.Load() + s.replaces.Load() }
func (s *spy) calls() int64  { return s.lookups.Load() + s.writes() }

// env is one scenario's shared state: clock, load table, in-flight counters, admission recorder
// and the store (behind a spy).
type env struct {
	t        *testing.T
	v        Variant
	clk      *affinitytest.Clock
	load     *loadmon.Table
	inflight *loadmon.InFlight
	check    *recorder
	store    *spy
}

func (e *env) cfg() policy.Config {
	return policy.Config{Load: e.load, InFlight: e.inflight, Admission: e.check, Rand: func(n int) int { return 0 }}
}

func (e *env) policy(choices int) policy.Policy {
	e.t.Helper()
	p, err := e.v.Build(e.cfg(), e.store, choices, false)
	require.NoError(e.t, err)
	return p
}

// report publishes a fresh native report with the given waiting work for each engine.
func (e *env) report(id state.EngineID, waiting uint64, running uint64) {
	e.t.Helper()
	require.NoError(e.t, e.load.Report(loadmon.Report{
		Engine: id, WaitingRequests: waiting, RunningRequests: running, KVCapacityTokens: 1 << 20,
		Native: &loadmon.NativeLoad{MaxRunningRequests: 256, WaitingUncachedTokens: waiting * 1000},
	}))
}

// steer makes target the least loaded of engines: every other engine has 50 waiting requests.
func (e *env) steer(engines []state.Engine, target state.EngineID) {
	for _, c := range engines {
		if c.ID() == target {
			e.report(c.ID(), 0, 0)
		} else {
			e.report(c.ID(), 50, 50)
		}
	}
}

func (e *env) req(key string) *policy.Request {
	r := &policy.Request{Model: "m", BucketID: "b", Stage: state.StagePlain}
	e.v.SetKey(r, key)
	return r
}

func (e *env) scope(key string) affinity.Scope {
	return affinity.Scope{Namespace: e.v.Namespace, Model: "m", BucketID: "b", Stage: state.StagePlain, Key: key}
}

func (e *env) bound(key string) (state.EngineID, bool) {
	e.t.Helper()
	id, ok, err := e.store.Store.Lookup(bg, e.scope(key))
	require.NoError(e.t, err)
	return id, ok
}

func engines(ids ...state.EngineID) []state.Engine {
	out := make([]state.Engine, len(ids))
	for i, id := range ids {
		out[i] = state.NewStaticEngine(id, "m", state.StagePlain)
	}
	return out
}

type scenario struct {
	name string
	run  func(t *testing.T, e *env)
}

// Run runs every scenario for every variant, each on a new store from newStore (10 s idle
// timeout) sharing its clock with the load table and the in-flight counters.
func Run(t *testing.T, newStore affinitytest.Factory) {
	t.Helper()
	for _, v := range Variants() {
		t.Run(v.Name, func(t *testing.T) {
			t.Parallel()
			for _, sc := range scenarios {
				t.Run(sc.name, func(t *testing.T) {
					t.Parallel()
					clk := affinitytest.NewClock()
					e := &env{t: t, v: v, clk: clk, check: &recorder{},
						load:     loadmon.NewTable(loadmon.WithClock(clk.Now)),
						inflight: loadmon.NewInFlight(clk.Now),
						store:    &spy{Store: newStore(t, clk.Now, 10*time.Second)}}
					sc.run(t, e)
				})
			}
		})
	}
}

var scenarios = []scenario{
	{"new_sessions_choose_lower_pressure_then_reuse_binding", func(t *testing.T, e *env) {
		p := e.policy(0)
		c := engines("a", "b")
		e.steer(c, "b")
		pk, err := p.Pick(bg, c, e.req("s"))
		require.NoError(t, err)
		assert.Same(t, c[1], pk.Engine, "the new session goes to the lower-pressure engine")
		assert.Equal(t, e.v.Assigned, pk.Reason)
		e.steer(c, "a") // b becomes the busy one
		for i := range 5 {
			pk, err := p.Pick(bg, c, e.req("s"))
			require.NoError(t, err)
			assert.Same(t, c[1], pk.Engine, "reuse %d regardless of pressure", i)
			assert.Equal(t, e.v.Primary, pk.Reason)
		}
		assert.Equal(t, []state.EngineID{"b", "b", "b", "b", "b", "b"}, e.check.ids(), "admission once per pick, on the returned engine")
		assert.Equal(t, int64(1), e.store.writes(), "one binding written")
	}},
	{"missing_and_empty_keys_use_admitted_power_of_n_without_binding", func(t *testing.T, e *env) {
		p := e.policy(0)
		c := engines("a", "b")
		e.steer(c, "b")
		for _, r := range []*policy.Request{nil, e.req("")} {
			pk, err := p.Pick(bg, c, r)
			require.NoError(t, err)
			assert.Same(t, c[1], pk.Engine, "the lower-pressure engine")
			assert.Equal(t, e.v.NoKey, pk.Reason)
		}
		assert.Equal(t, []state.EngineID{"b", "b"}, e.check.ids(), "this policy's admission checks the fallback's pick")
		e.check.setReject("b")
		_, err := p.Pick(bg, c, e.req(""))
		var rej *policy.AdmissionRejectedError
		require.ErrorAs(t, err, &rej)
		assert.Equal(t, state.EngineID("b"), rej.Engine.ID())
		assert.Zero(t, e.store.calls(), "no key: the store is never touched")
	}},
	{"rejected_new_and_existing_sessions_never_rebind_or_try_another_engine", func(t *testing.T, e *env) {
		p := e.policy(0)
		c := engines("a", "b")
		e.steer(c, "b")
		e.check.setReject("b")
		_, err := p.Pick(bg, c, e.req("new"))
		var rej *policy.AdmissionRejectedError
		require.ErrorAs(t, err, &rej)
		assert.Equal(t, state.EngineID("b"), rej.Engine.ID())
		assert.Equal(t, []state.EngineID{"b"}, e.check.ids(), "no other engine is tried")
		_, ok := e.bound("new")
		assert.False(t, ok, "a rejected new session is not bound")
		assert.Zero(t, e.store.writes())

		_, err = e.store.Store.Bind(bg, e.scope("old"), "a")
		require.NoError(t, err)
		e.check.reset()
		e.check.setReject("a")
		_, err = p.Pick(bg, c, e.req("old"))
		require.ErrorAs(t, err, &rej)
		assert.Equal(t, state.EngineID("a"), rej.Engine.ID())
		assert.Equal(t, []state.EngineID{"a"}, e.check.ids(), "the idle b is not tried")
		id, ok := e.bound("old")
		assert.True(t, ok)
		assert.Equal(t, state.EngineID("a"), id, "the binding is kept")
		assert.Zero(t, e.store.writes())
	}},
	{"removed_binding_is_replaced_only_after_admission", func(t *testing.T, e *env) {
		p := e.policy(0)
		c := engines("a", "b")
		e.steer(c, "b")
		_, err := e.store.Store.Bind(bg, e.scope("s"), "gone")
		require.NoError(t, err)
		e.check.setReject("b")
		_, err = p.Pick(bg, c, e.req("s"))
		require.ErrorIs(t, err, policy.ErrAdmissionRejected)
		id, _ := e.bound("s")
		assert.Equal(t, state.EngineID("gone"), id, "a rejected replacement leaves the old binding")
		assert.Zero(t, e.store.writes())
		e.check.setReject()
		pk, err := p.Pick(bg, c, e.req("s"))
		require.NoError(t, err)
		assert.Same(t, c[1], pk.Engine)
		assert.Equal(t, e.v.Assigned, pk.Reason)
		id, _ = e.bound("s")
		assert.Equal(t, state.EngineID("b"), id, "replaced after admission")
		assert.Equal(t, int64(1), e.store.replaces.Load(), "a dead binding is replaced, not first-bound")
	}},
	{"bindings_are_scoped_by_model_bucket_role_and_session", func(t *testing.T, e *env) {
		p := e.policy(8)
		c := engines("e0", "e1", "e2", "e3", "e4", "e5")
		reqs := make([]*policy.Request, 6)
		for i := range reqs {
			reqs[i] = e.req("s")
		}
		reqs[0].Model, reqs[1].Model = "m1", "m2"
		reqs[2].BucketID = "b2"
		reqs[3].Stage = state.StagePrefill
		reqs[4].Stage = state.StageDecode
		e.v.SetKey(reqs[5], "s2")
		for i, r := range reqs {
			e.steer(c, c[i].ID())
			pk, err := p.Pick(bg, c, r)
			require.NoError(t, err)
			assert.Same(t, c[i], pk.Engine, "scope %d is new", i)
			assert.Equal(t, e.v.Assigned, pk.Reason, "scope %d", i)
		}
		e.steer(c, "e5")
		for i, r := range reqs {
			pk, err := p.Pick(bg, c, r)
			require.NoError(t, err)
			assert.Same(t, c[i], pk.Engine, "scope %d keeps its own binding", i)
			assert.Equal(t, e.v.Primary, pk.Reason)
		}
		assert.Equal(t, int64(6), e.store.writes(), "six distinct bindings")
	}},
	{"embedded_delimiters_do_not_alias_scopes", func(t *testing.T, e *env) {
		p := e.policy(8)
		c := engines("x", "y", "z")
		reqs := []*policy.Request{e.req("k"), e.req("k"), e.req("0:k")}
		reqs[0].Model, reqs[0].BucketID = "a\x00b", "c"
		reqs[1].Model, reqs[1].BucketID = "a", "\x00bc"
		reqs[2].Model, reqs[2].BucketID = "a", "1:"
		for i, r := range reqs {
			e.steer(c, c[i].ID())
			pk, err := p.Pick(bg, c, r)
			require.NoError(t, err)
			assert.Same(t, c[i], pk.Engine)
			assert.Equal(t, e.v.Assigned, pk.Reason, "request %d must not alias an earlier scope", i)
		}
	}},
	{"same_id_replacement_returns_the_live_candidate_instance", func(t *testing.T, e *env) {
		p := e.policy(0)
		old := engines("a", "b")
		e.steer(old, "a")
		_, err := p.Pick(bg, old, e.req("s"))
		require.NoError(t, err)
		fresh := []state.Engine{state.NewStaticEngine("a", "m", state.StagePlain), old[1]}
		e.check.reset()
		pk, err := p.Pick(bg, fresh, e.req("s"))
		require.NoError(t, err)
		assert.Same(t, fresh[0], pk.Engine, "the live candidate value, not the value that was bound")
		assert.NotSame(t, old[0], pk.Engine)
		assert.Equal(t, e.v.Primary, pk.Reason)
		require.Len(t, e.check.calls, 1)
		assert.Same(t, fresh[0], e.check.calls[0], "admission sees the live value")
	}},
	{"empty_candidates_skip_admission_and_invalid_signals_never_bind", func(t *testing.T, e *env) {
		p := e.policy(0)
		_, err := p.Pick(bg, nil, e.req("s"))
		assert.ErrorIs(t, err, policy.ErrNoCandidates)
		c := engines("a", "b")
		long := e.req(strings.Repeat("k", affinity.MaxKeyBytes+1))
		_, err = p.Pick(bg, c, long)
		assert.ErrorIs(t, err, policy.ErrInvalidSignal)
		assert.ErrorIs(t, err, affinity.ErrInvalidKey)
		badStage := e.req("s")
		badStage.Stage = 7
		_, err = p.Pick(bg, c, badStage)
		assert.ErrorIs(t, err, policy.ErrInvalidSignal)
		assert.Empty(t, e.check.ids(), "admission is not called")
		assert.Zero(t, e.store.calls(), "the store is not touched")
		edge := e.req(strings.Repeat("k", affinity.MaxKeyBytes))
		pk, err := p.Pick(bg, c, edge)
		require.NoError(t, err, "a key of exactly 4 KiB is accepted")
		assert.Equal(t, e.v.Assigned, pk.Reason)
	}},
	{"admission_receives_fresh_load_on_assignment_and_reuse", func(t *testing.T, e *env) {
		p := e.policy(0)
		c := engines("a")
		e.report("a", 1, 3)
		_, err := p.Pick(bg, c, e.req("s"))
		require.NoError(t, err)
		e.report("a", 4, 7)
		g := e.inflight.Acquire("a", -1, 0)
		defer g.Release()
		_, err = p.Pick(bg, c, e.req("s"))
		require.NoError(t, err)
		require.Len(t, e.check.metrics, 2)
		assert.Equal(t, admission.Metrics{RunningRequests: admission.Known(3), WaitingRequests: admission.Known(1),
			KVTokens: admission.Known(0), PendingPrefillTokens: admission.Known(1000)}, e.check.metrics[0], "assignment")
		assert.Equal(t, admission.Metrics{RunningRequests: admission.Known(7), WaitingRequests: admission.Known(4),
			KVTokens: admission.Known(0), PendingPrefillTokens: admission.Known(4000), InFlightRequests: 1}, e.check.metrics[1], "reuse reads the new report")
	}},
	{"shared_store_refreshes_active_sessions_and_expires_idle_ones", func(t *testing.T, e *env) {
		p := e.policy(0)
		c := engines("a", "b")
		e.steer(c, "a")
		pk, err := p.Pick(bg, c, e.req("hot"))
		require.NoError(t, err)
		require.Same(t, c[0], pk.Engine)
		e.steer(c, "b")
		pk, err = p.Pick(bg, c, e.req("cold"))
		require.NoError(t, err)
		require.Same(t, c[1], pk.Engine)
		e.clk.Advance(8 * time.Second)
		e.steer(c, "b")
		pk, err = p.Pick(bg, c, e.req("hot"))
		require.NoError(t, err)
		assert.Same(t, c[0], pk.Engine)
		assert.Equal(t, e.v.Primary, pk.Reason, "hit at 8 s")
		e.clk.Advance(8 * time.Second)
		if sw, ok := e.store.Store.(affinitytest.Sweeper); ok {
			sw.Sweep()
		}
		e.steer(c, "a")
		pk, err = p.Pick(bg, c, e.req("cold"))
		require.NoError(t, err)
		assert.Same(t, c[0], pk.Engine, "cold expired at 10 s: bound anew")
		assert.Equal(t, e.v.Assigned, pk.Reason)
		e.steer(c, "b")
		pk, err = p.Pick(bg, c, e.req("hot"))
		require.NoError(t, err)
		assert.Same(t, c[0], pk.Engine, "hot, hit at 8 s, lives until 18 s")
		assert.Equal(t, e.v.Primary, pk.Reason)
	}},
	{"concurrent_assignment_winner_is_checked_and_preserved_on_rejection", func(t *testing.T, e *env) {
		p := e.policy(0)
		c := engines("a", "b")
		e.steer(c, "a")
		// Another replica binds the session to b between this pick's lookup and its bind.
		e.store.before = func(op string, s affinity.Scope) {
			if op == "bind" {
				_, err := e.store.Store.Bind(bg, s, "b")
				require.NoError(t, err)
			}
		}
		pk, err := p.Pick(bg, c, e.req("s1"))
		require.NoError(t, err)
		assert.Same(t, c[1], pk.Engine, "the concurrent winner is returned")
		assert.Equal(t, e.v.Primary, pk.Reason)
		assert.Equal(t, []state.EngineID{"a", "b"}, e.check.ids(), "the winner b is checked before it is returned")

		e.check.reset()
		e.check.setReject("b")
		_, err = p.Pick(bg, c, e.req("s2"))
		var rej *policy.AdmissionRejectedError
		require.ErrorAs(t, err, &rej)
		assert.Equal(t, state.EngineID("b"), rej.Engine.ID(), "the error names the winner")
		assert.Equal(t, []state.EngineID{"a", "b"}, e.check.ids())
		id, _ := e.bound("s2")
		assert.Equal(t, state.EngineID("b"), id, "the winner's binding is kept")
	}},
	{"concurrent_winner_outside_the_group_is_replaced_with_bounded_retry", func(t *testing.T, e *env) {
		p := e.policy(0)
		c := engines("a", "b")
		e.steer(c, "a")
		// Another replica, with another view of the fleet, binds the session to an engine
		// outside this group once.
		once := true
		e.store.before = func(op string, s affinity.Scope) {
			if op == "bind" && once {
				once = false
				_, err := e.store.Store.Bind(bg, s, "elsewhere")
				require.NoError(t, err)
			}
		}
		pk, err := p.Pick(bg, c, e.req("s"))
		require.NoError(t, err)
		assert.Same(t, c[0], pk.Engine)
		assert.Equal(t, e.v.Assigned, pk.Reason)
		id, _ := e.bound("s")
		assert.Equal(t, state.EngineID("a"), id, "the outside binding was replaced")

		// A writer that keeps rebinding elsewhere: after 3 replaces the admitted pick is
		// returned, unbound.
		n := 0
		e.store.before = func(op string, s affinity.Scope) {
			if op == "lookup" {
				return
			}
			next := state.EngineID(fmt.Sprintf("elsewhere-%d", n))
			n++
			cur, ok, err := e.store.Store.Lookup(bg, s)
			require.NoError(t, err)
			if ok {
				_, err = e.store.Store.Replace(bg, s, cur, next)
			} else {
				_, err = e.store.Store.Bind(bg, s, next)
			}
			require.NoError(t, err)
		}
		before := e.store.writes()
		pk, err = p.Pick(bg, c, e.req("t"))
		require.NoError(t, err)
		assert.Same(t, c[0], pk.Engine)
		assert.Equal(t, int64(4), e.store.writes()-before, "one bind and 3 replaces, then give up")
	}},
	{"store_unavailable_is_a_typed_error_or_an_unbound_fallback", func(t *testing.T, e *env) {
		c := engines("a", "b")
		e.steer(c, "b")
		for _, op := range []string{"lookup", "bind"} {
			e.store.fail = map[string]bool{op: true}
			p := e.policy(0)
			_, err := p.Pick(bg, c, e.req("s-"+op))
			assert.ErrorIs(t, err, affinity.ErrUnavailable, "%s fails: the host sees a typed error", op)
			assert.ErrorIs(t, err, errDown)
			var ue *affinity.UnavailableError
			require.ErrorAs(t, err, &ue)
			assert.Equal(t, op, ue.Op)

			fo, berr := e.v.Build(e.cfg(), e.store, 0, true)
			require.NoError(t, berr)
			e.check.reset()
			pk, err := fo.Pick(bg, c, e.req("s-"+op))
			require.NoError(t, err, "FallbackOnUnavailable")
			assert.Same(t, c[1], pk.Engine)
			assert.Equal(t, label.ReasonAffinityUnavailable, pk.Reason)
			assert.Equal(t, []state.EngineID{"b"}, e.check.ids(), "the fallback's pick is admitted once")
		}
		e.store.fail = nil
		_, ok := e.bound("s-lookup")
		assert.False(t, ok)
		_, ok = e.bound("s-bind")
		assert.False(t, ok)
	}},
	{"two_replicas_sharing_a_store_agree_on_every_session", func(t *testing.T, e *env) {
		c := engines("a", "b", "c", "d")
		// Each replica has its own load view (and in-flight counters): alone, they would
		// choose differently.
		replicas := make([]policy.Policy, 2)
		for i := range replicas {
			load := loadmon.NewTable(loadmon.WithClock(e.clk.Now))
			for j, eng := range c {
				w := uint64(10 * ((j + 2*i) % 4))
				require.NoError(t, load.Report(loadmon.Report{Engine: eng.ID(), WaitingRequests: w, KVCapacityTokens: 1 << 20,
					Native: &loadmon.NativeLoad{MaxRunningRequests: 256, WaitingUncachedTokens: w * 1000}}))
			}
			var err error
			replicas[i], err = e.v.Build(policy.Config{Load: load, InFlight: loadmon.NewInFlight(e.clk.Now)}, e.store, 4, false)
			require.NoError(t, err)
		}
		// Sequential first touches: replica 0 binds sessions 0-9 to its favourite a, replica 1
		// binds 10-19 to its favourite c.
		for k := range 20 {
			pk, err := replicas[k/10].Pick(bg, c, e.req(fmt.Sprintf("conv-%d", k)))
			require.NoError(t, err)
			require.Equal(t, []state.EngineID{"a", "c"}[k/10], pk.Engine.ID(), "session %d", k)
		}
		const sessions = 200
		got := make([][2]state.EngineID, sessions)
		var wg sync.WaitGroup
		for r, p := range replicas {
			wg.Go(func() {
				for k := range sessions {
					k := (k + r*sessions/2) % sessions // the replicas start at different sessions
					pk, err := p.Pick(bg, c, e.req(fmt.Sprintf("conv-%d", k)))
					if err != nil {
						t.Error(err)
						return
					}
					got[k][r] = pk.Engine.ID()
				}
			})
		}
		wg.Wait()
		for k := range sessions {
			assert.Equal(t, got[k][0], got[k][1], "session %d", k)
		}
		for k := range 20 {
			assert.Equal(t, []state.EngineID{"a", "c"}[k/10], got[k][0], "session %d keeps its first engine on both replicas", k)
		}
	}},
}
