package policy_test

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// approxTTL is the lifetime of a route-time placement: kvindex.Options.ApproxTTL's default.
const approxTTL = 120 * time.Second

// recorder is an admission.Checker that records every call and answers with a fixed verdict.
type recorder struct {
	mu      sync.Mutex
	calls   []state.EngineID
	metrics []admission.Metrics
	reject  map[state.EngineID]string // engine → limit name
	err     error
}

func (r *recorder) Check(e state.Engine, m admission.Metrics) (admission.Verdict, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, e.ID())
	r.metrics = append(r.metrics, m)
	if r.err != nil {
		return admission.Verdict{}, r.err
	}
	if limit, ok := r.reject[e.ID()]; ok {
		return admission.Verdict{Limit: limit, Observed: 1, Cap: 1}, nil
	}
	return admission.Verdict{Admit: true}, nil
}

func (r *recorder) Calls() []state.EngineID {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]state.EngineID(nil), r.calls...)
}

// script is a deterministic Rand: it returns the queued values in order (each taken mod n), then
// zeros.
type script struct {
	mu   sync.Mutex
	vals []int
	hook func(call int)
	n    int
}

func (s *script) IntN(n int) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.n++
	if s.hook != nil {
		s.hook(s.n)
	}
	if len(s.vals) == 0 {
		return 0
	}
	v := s.vals[0]
	s.vals = s.vals[1:]
	return v % n
}

type clock struct{ ns atomic.Int64 }

func newClock() *clock {
	c := &clock{}
	c.ns.Store(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	return c
}
func (c *clock) Now() time.Time          { return time.Unix(0, c.ns.Load()).UTC() }
func (c *clock) Advance(d time.Duration) { c.ns.Add(int64(d)) }

// env bundles the shared state a test's policies use.
type env struct {
	clk      *clock
	load     *loadmon.Table
	inflight *loadmon.InFlight
	check    *recorder
	rnd      *script
}

func newEnv() *env {
	clk := newClock()
	return &env{
		clk:      clk,
		load:     loadmon.NewTable(loadmon.WithClock(clk.Now)),
		inflight: loadmon.NewInFlight(clk.Now),
		check:    &recorder{},
		rnd:      &script{},
	}
}

func (e *env) cfg() policy.Config {
	return policy.Config{Load: e.load, InFlight: e.inflight, Admission: e.check, Rand: e.rnd.IntN}
}

// native reports a fresh, complete native load for the engine.
func (e *env) native(id state.EngineID, l loadmon.Report) {
	l.Engine = id
	if l.KVCapacityTokens == 0 {
		l.KVCapacityTokens = 1 << 20
	}
	if l.Native == nil {
		l.Native = &loadmon.NativeLoad{MaxRunningRequests: 256}
	} else if l.Native.MaxRunningRequests == 0 {
		l.Native.MaxRunningRequests = 256
	}
	if err := e.load.Report(l); err != nil {
		panic(err)
	}
}

func engines(stage state.Stage, ids ...state.EngineID) []state.Engine {
	out := make([]state.Engine, len(ids))
	for i, id := range ids {
		out[i] = state.NewStaticEngine(id, "m", stage)
	}
	return out
}

func manyEngines(n int) []state.Engine {
	out := make([]state.Engine, n)
	for i := range out {
		out[i] = state.NewStaticEngine(state.EngineID(fmt.Sprintf("http://e%03d", i)), "m", state.StagePlain)
	}
	return out
}
