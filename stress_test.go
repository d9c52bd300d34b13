package enginepick_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
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
	"github.com/enginepick/enginepick/internal/kvbridge"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// stressFlag lengthens (or shortens) TestStressRouter: go test -run TestStressRouter . -enginepick.stress=5m
var stressFlag = flag.Duration("enginepick.stress", 0,
	"duration of TestStressRouter (0: 2 s with -short, 10 s under -race, 30 s otherwise)")

func stressDuration() time.Duration {
	switch {
	case *stressFlag > 0:
		return *stressFlag
	case testing.Short():
		return 2 * time.Second
	case raceEnabled:
		return 10 * time.Second
	}
	return 30 * time.Second
}

// The stress fleet: two models, each with a bounded bucket tried first and an unbounded one after
// it, so that exhaustion of the first spills into the second and exhaustion of both is a 503.
//
//	model "chat": bucket "short" (≤ 256 tokens) c0..c3, session-aware (power-of-two for new sessions);
//	              bucket "long" (unbounded)     c4..c7, cache-aware (queue gate 6)
//	model "pd":   bucket "pd-a" (≤ 512 tokens)  prefill pa0 (x), pa1 (y), cache-aware with a
//	                                            saturation floor; decode da0 (x), da1 (y), da2 (x), load-based
//	              bucket "pd-b" (unbounded)     prefill pb0, pb1 sticky (round-robin fallback); decode db0, db1 power-of-two
//
// Letters in parentheses are PD compatibility labels. c1, c5, pa1 and da2 have two DP ranks.
// Every group admits with in-flight cap 3 and waiting cap 8. The session-aware and sticky groups
// share one affinity.MemoryStore on the injected clock, whose bindings expire after
// stressIdleTimeout without a hit.
type stressSlot struct {
	id     state.EngineID
	model  state.ModelID
	stage  state.Stage
	bucket string
	label  string
	ranks  int
}

var stressSlots = []stressSlot{
	{"c0", "chat", state.StagePlain, "short", "", 1},
	{"c1", "chat", state.StagePlain, "short", "", 2},
	{"c2", "chat", state.StagePlain, "short", "", 1},
	{"c3", "chat", state.StagePlain, "short", "", 1},
	{"c4", "chat", state.StagePlain, "long", "", 1},
	{"c5", "chat", state.StagePlain, "long", "", 2},
	{"c6", "chat", state.StagePlain, "long", "", 1},
	{"c7", "chat", state.StagePlain, "long", "", 1},
	{"pa0", "pd", state.StagePrefill, "pd-a", "x", 1},
	{"pa1", "pd", state.StagePrefill, "pd-a", "y", 2},
	{"da0", "pd", state.StageDecode, "pd-a", "x", 1},
	{"da1", "pd", state.StageDecode, "pd-a", "y", 1},
	{"da2", "pd", state.StageDecode, "pd-a", "x", 2},
	{"pb0", "pd", state.StagePrefill, "pd-b", "", 1},
	{"pb1", "pd", state.StagePrefill, "pd-b", "", 1},
	{"db0", "pd", state.StageDecode, "pd-b", "", 1},
	{"db1", "pd", state.StageDecode, "pd-b", "", 1},
}

const (
	stressInFlightCap = 3
	stressWaitingCap  = 8
	stressBlockTokens = 16
	stressFreshness   = 5 * time.Second
	stressRing        = 1 << 14
	stressMaxBlocks   = 256
	stressPickers     = 8
	stressMaxHeld     = 3
	stressIdleTimeout = 3 * time.Second
	stressKeys        = 24
)

// stressEngine is one incarnation of a slot: removing a slot and adding it again builds a new
// value with the same ID, so that a pick of a stale value is detectable. acq and rel count the
// dispatches the test holds on this incarnation: acq is incremented after Select returned (the
// router's counter already includes it) and rel before Release (the router's counter still
// includes it), so acq − rel never exceeds the router's count for the incarnation.
type stressEngine struct {
	slot    int
	inc     uint32
	spec    *stressSlot
	healthy atomic.Bool
	acq     atomic.Int64
	rel     atomic.Int64
}

func (e *stressEngine) ID() state.EngineID      { return e.spec.id }
func (e *stressEngine) Model() state.ModelID    { return e.spec.model }
func (e *stressEngine) Stage() state.Stage      { return e.spec.stage }
func (e *stressEngine) Healthy() bool           { return e.healthy.Load() }
func (e *stressEngine) PDCompatibility() string { return e.spec.label }
func (e *stressEngine) String() string          { return fmt.Sprintf("%s#%d", e.spec.id, e.inc) }

var _ state.PDCompatible = (*stressEngine)(nil)

// worldState is what the test knows of the system after one mutation: which incarnation of each
// slot is registered, which are healthy, and which have a fresh, complete load report at or over
// the waiting cap. States are immutable once published.
type worldState struct {
	seq     uint64
	live    [32]uint32 // incarnation registered per slot; 0 when absent
	healthy uint64     // slots whose registered incarnation is healthy
	overCap uint64     // slots whose load is known with waiting >= stressWaitingCap
}

type rankReport struct {
	set     bool
	waiting uint64
	at      time.Time
}

// stress is the shared harness.
type stress struct {
	t        *testing.T
	reg      *state.StaticRegistry
	load     *loadmon.Table
	inflight *loadmon.InFlight
	index    *kvindex.Index
	router   *enginepick.Router
	affinity *affinity.MemoryStore
	clock    atomic.Int64 // unix nanoseconds of the injected clock
	members  map[string]map[state.Stage]map[state.EngineID]bool
	specs    map[string]bucket.Spec

	// The mutation log: ring[seq % stressRing] holds state seq. A mutation publishes its state
	// (seq+1) BEFORE applying it, so while Select runs the system is somewhere between the state
	// before the first seq read and the state at the second.
	seq  atomic.Uint64
	ring [stressRing]atomic.Pointer[worldState]
	cur  []atomic.Pointer[stressEngine] // latest incarnation per slot (registered or not)
	all  sync.Map                       // every incarnation ever built: *stressEngine → true

	failures atomic.Int64
	stats    struct {
		picks, pd, exhausted, events, bound, swept, canceled, windowSkipped, inflightChecked, inflightTight atomic.Int64
	}
}

func (s *stress) now() time.Time { return time.Unix(0, s.clock.Load()) }

// failf reports an invariant violation; after 20 it stays quiet so that the log stays readable.
func (s *stress) failf(format string, args ...any) {
	if s.failures.Add(1) <= 20 {
		s.t.Errorf(format, args...)
	}
}

func must[T any](t *testing.T) func(v T, err error) T {
	return func(v T, err error) T {
		t.Helper()
		require.NoError(t, err)
		return v
	}
}

func newStress(t *testing.T) *stress {
	s := &stress{t: t, reg: &state.StaticRegistry{}, cur: make([]atomic.Pointer[stressEngine], len(stressSlots))}
	s.clock.Store(time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	s.load = loadmon.NewTable(loadmon.WithClock(s.now), loadmon.WithFreshness(stressFreshness))
	s.inflight = loadmon.NewInFlight(s.now)
	h := must[kvindex.Hasher](t)(kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: stressBlockTokens, Seed: 3}))
	s.index = must[*kvindex.Index](t)(kvindex.NewIndex(h, kvindex.Options{MaxBlocks: stressMaxBlocks, Now: s.now}))
	src := must[*kvindex.LocalSource](t)(kvindex.NewLocalSource(s.index))
	s.affinity = must[*affinity.MemoryStore](t)(affinity.NewMemoryStore(affinity.Options{IdleTimeout: stressIdleTimeout, Now: s.now}))

	limits := admission.Limits{MaxInFlightRequests: admission.Cap(stressInFlightCap), MaxWaitingRequests: admission.Cap(stressWaitingCap)}
	cfg := policy.Config{Load: s.load, InFlight: s.inflight, Admission: limits}
	s.members = map[string]map[state.Stage]map[state.EngineID]bool{}
	group := func(p policy.Policy, err error) func(bucketID string, stage state.Stage) *bucket.EngineGroup {
		require.NoError(t, err)
		return func(bucketID string, stage state.Stage) *bucket.EngineGroup {
			var ids []state.EngineID
			if s.members[bucketID] == nil {
				s.members[bucketID] = map[state.Stage]map[state.EngineID]bool{}
			}
			s.members[bucketID][stage] = map[state.EngineID]bool{}
			for _, sl := range stressSlots {
				if sl.bucket == bucketID && sl.stage == stage {
					ids = append(ids, sl.id)
					s.members[bucketID][stage][sl.id] = true
				}
			}
			return must[*bucket.EngineGroup](t)(bucket.NewEngineGroup(p, ids))
		}
	}
	cacheOpts := func(floor *uint64) policy.CacheAwareOptions {
		return policy.CacheAwareOptions{Source: src, MinMatchedTokens: stressBlockTokens,
			EngineQueueLimit: admission.Cap(6), SaturationQueueFloor: floor}
	}
	s.specs = map[string]bucket.Spec{
		"short": {ID: "short", MaxInputTokens: 256},
		"long":  {ID: "long"},
		"pd-a":  {ID: "pd-a", MaxInputTokens: 512},
		"pd-b":  {ID: "pd-b"},
	}
	mb := must[*bucket.Bucket](t)
	short := mb(bucket.NewPlainBucket(s.specs["short"], group(policy.NewSessionAware(cfg, policy.SessionAwareOptions{Store: s.affinity}))("short", state.StagePlain)))
	long := mb(bucket.NewPlainBucket(s.specs["long"], group(policy.NewCacheAware(cfg, cacheOpts(nil)))("long", state.StagePlain)))
	pdA := mb(bucket.NewPDBucket(s.specs["pd-a"],
		group(policy.NewCacheAware(cfg, cacheOpts(admission.Cap(2))))("pd-a", state.StagePrefill),
		group(policy.NewLeastLoad(cfg))("pd-a", state.StageDecode)))
	pdB := mb(bucket.NewPDBucket(s.specs["pd-b"],
		group(policy.NewSticky(cfg, policy.StickyOptions{Store: s.affinity}))("pd-b", state.StagePrefill),
		group(policy.NewPowerOfN(cfg, 2))("pd-b", state.StageDecode)))
	mr := must[*bucket.Resolver](t)
	s.router = must[*enginepick.Router](t)(enginepick.NewRouter(enginepick.Options{
		Registry: s.reg, InFlight: s.inflight, Load: s.load, Index: s.index,
		Resolvers: map[state.ModelID]*bucket.Resolver{
			"chat": mr(bucket.NewResolver([]*bucket.Bucket{short, long}, bucket.ResolverOptions{})),
			"pd":   mr(bucket.NewResolver([]*bucket.Bucket{pdA, pdB}, bucket.ResolverOptions{})),
		},
	}))

	// Every slot starts registered, healthy, with no load report.
	st := &worldState{}
	for i := range stressSlots {
		e := s.newIncarnation(i)
		require.NoError(t, s.load.Expect(e.ID(), e.spec.ranks))
		require.NoError(t, s.reg.Add(e))
		st.live[i] = e.inc
		st.healthy |= 1 << i
	}
	s.ring[0].Store(st)
	return s
}

func (s *stress) newIncarnation(slot int) *stressEngine {
	inc := uint32(1)
	if old := s.cur[slot].Load(); old != nil {
		inc = old.inc + 1
	}
	e := &stressEngine{slot: slot, inc: inc, spec: &stressSlots[slot]}
	e.healthy.Store(true)
	s.cur[slot].Store(e)
	s.all.Store(e, true)
	return e
}

// mutate is the only writer of registry membership, health, load reports and the clock. Each
// step publishes the state it is about to create, then applies it.
func (s *stress) mutate(ctx context.Context, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 1))
	reports := make([][2]rankReport, len(stressSlots))
	st := *s.ring[0].Load()
	overCap := func(now time.Time) uint64 {
		var m uint64
		for i, sl := range stressSlots {
			var waiting uint64
			known := true
			for r := range sl.ranks {
				rep := reports[i][r]
				if !rep.set || now.Sub(rep.at) > stressFreshness {
					known = false
					break
				}
				waiting += rep.waiting
			}
			if known && waiting >= stressWaitingCap {
				m |= 1 << i
			}
		}
		return m
	}
	publish := func(next worldState) {
		next.seq = st.seq + 1
		st = next
		s.ring[next.seq%stressRing].Store(&next)
		s.seq.Store(next.seq)
	}
	for ctx.Err() == nil {
		slot := rng.IntN(len(stressSlots))
		e := s.cur[slot].Load()
		registered := st.live[slot] == e.inc
		next := st
		switch op := rng.IntN(100); {
		case op < 45 && registered: // a load report of one DP rank
			rank := rng.IntN(e.spec.ranks)
			waiting := uint64(rng.IntN(stressWaitingCap + 2))
			if e.spec.ranks > 1 {
				waiting /= 2
			}
			reports[slot][rank] = rankReport{set: true, waiting: waiting, at: s.now()}
			next.overCap = overCap(s.now())
			publish(next)
			if err := s.load.Report(loadmon.Report{Engine: e.ID(), DPRank: rank, WaitingRequests: waiting,
				RunningRequests: uint64(rng.IntN(16))}); err != nil {
				s.failf("load report of %v rank %d: %v", e, rank, err)
			}
		case op < 60: // time passes: reports age, some go stale
			at := s.now().Add(time.Duration(rng.IntN(1500)) * time.Millisecond)
			next.overCap = overCap(at)
			publish(next)
			s.clock.Store(at.UnixNano())
			s.stats.swept.Add(int64(s.affinity.Sweep()))
		case registered && ((op < 66 && e.healthy.Load()) || (op < 80 && !e.healthy.Load())): // health flips
			healthy := !e.healthy.Load()
			next.healthy ^= 1 << slot
			publish(next)
			e.healthy.Store(healthy)
		case op >= 80 && op < 84 && registered: // the host removes the engine
			next.live[slot] = 0
			next.healthy &^= 1 << slot
			reports[slot] = [2]rankReport{}
			next.overCap = overCap(s.now())
			publish(next)
			s.reg.Remove(e.ID())
			s.router.RemoveEngine(e.ID())
			if _, err := s.affinity.InvalidateEngine(ctx, e.ID()); err != nil {
				s.failf("invalidate the bindings of %v: %v", e, err)
			}
		case op >= 84 && !registered: // and adds it back as a new value
			n := s.newIncarnation(slot)
			next.live[slot] = n.inc
			next.healthy |= 1 << slot
			publish(next)
			if err := s.load.Expect(n.ID(), n.spec.ranks); err != nil {
				s.failf("expect %v: %v", n, err)
			}
			if err := s.reg.Add(n); err != nil {
				s.failf("re-add %v: %v", n, err)
			}
		default:
			continue
		}
		runtime.Gosched()
	}
}

// prompts are shared prefixes: requests and KV events draw from the same families, so that the
// cache-aware groups see hits, misses, evictions and untrusted holders.
type stressPrompts struct {
	tokens [][]uint32 // per family, 40 blocks
	keys   [][]uint64
}

func newStressPrompts(h kvindex.Hasher) *stressPrompts {
	p := &stressPrompts{}
	rng := rand.New(rand.NewPCG(7, 7))
	for range 12 {
		toks := make([]uint32, 40*stressBlockTokens)
		for i := range toks {
			toks[i] = rng.Uint32() % 50000
		}
		p.tokens = append(p.tokens, toks)
		p.keys = append(p.keys, h.Keys(toks))
	}
	return p
}

// streamEvents applies KV events of every slot (registered or not: a removed engine's events may
// still be in flight) to the index: stores, removals, clears and trust changes. Every refusal
// must be a typed *kvindex.EventError.
func (s *stress) streamEvents(ctx context.Context, seed uint64, p *stressPrompts) {
	rng := rand.New(rand.NewPCG(seed, 2))
	hashes := make([]uint64, 0, 40)
	for ctx.Err() == nil {
		sl := &stressSlots[rng.IntN(len(stressSlots))]
		rank := rng.IntN(sl.ranks)
		f := rng.IntN(len(p.tokens))
		n := 1 + rng.IntN(len(p.keys[f]))
		salt := uint64(len(sl.id))<<56 | uint64(sl.id[len(sl.id)-1])<<48 // per engine, opaque
		hashes = hashes[:0]
		for _, k := range p.keys[f][:n] {
			hashes = append(hashes, k^salt)
		}
		var err error
		switch op := rng.IntN(100); {
		case op < 60:
			err = s.index.Store(kvindex.StoreEvent{Engine: sl.id, DPRank: rank, BlockHashes: hashes,
				TokenIDs: p.tokens[f][:n*stressBlockTokens], Tier: kvindex.TierDevice})
		case op < 85:
			from := rng.IntN(n)
			err = s.index.Remove(sl.id, rank, hashes[from:], 0)
		case op < 90:
			err = s.index.Clear(sl.id, rank)
		case op < 95:
			err = kvbridge.MarkUntrusted(s.index, sl.id, rank)
		default:
			err = kvbridge.MarkTrusted(s.index, sl.id, rank)
		}
		s.stats.events.Add(1)
		var ee *kvindex.EventError
		if err != nil && !errors.As(err, &ee) {
			s.failf("index refused an event with an untyped error: %v", err)
		}
		runtime.Gosched()
	}
}

type held struct {
	d       *enginepick.Dispatch
	engines []*stressEngine
}

// pick runs one picker until ctx ends, holding up to stressMaxHeld dispatches at a time.
func (s *stress) pick(ctx context.Context, seed uint64, p *stressPrompts) {
	rng := rand.New(rand.NewPCG(seed, 3))
	var hold []held
	release := func(i int) {
		h := hold[i]
		for _, e := range h.engines {
			e.rel.Add(1)
		}
		h.d.Release()
		hold = append(hold[:i], hold[i+1:]...)
	}
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	var acq0 [32]int64
	var cur0 [32]*stressEngine
	for ctx.Err() == nil {
		runtime.Gosched() // a fair share for the mutator and the event stream
		if len(hold) == stressMaxHeld || (len(hold) > 0 && rng.IntN(3) == 0) {
			release(rng.IntN(len(hold)))
			continue
		}
		req := &bucket.Request{Model: "chat"}
		if rng.IntN(2) == 0 {
			req.Model = "pd"
		}
		f := rng.IntN(len(p.tokens))
		n := 1 + rng.IntN(len(p.tokens[f])-1)
		req.TokenIDs = p.tokens[f][:n]
		req.InputTokens = int64(n)
		if rng.IntN(4) == 0 {
			req.ExpectedPeakTokens, req.HasExpectedPeak = int64(n+rng.IntN(256)), true
		}
		switch k := rng.IntN(2 * stressKeys); {
		case k < stressKeys/2:
			req.SessionKey = fmt.Sprintf("session-%d", k)
		case k < stressKeys:
			req.RoutingKey = fmt.Sprintf("route-%d", k)
		}
		selCtx := context.Background()
		if rng.IntN(50) == 0 { // the client is already gone
			selCtx = canceled
		}

		for i := range stressSlots {
			cur0[i] = s.cur[i].Load()
			acq0[i] = cur0[i].acq.Load()
		}
		s0 := s.seq.Load()
		d, err := s.router.Select(selCtx, req)
		s1 := s.seq.Load()
		if err != nil {
			var ex *bucket.ExhaustedError
			switch {
			case selCtx == canceled && errors.Is(err, context.Canceled):
				s.stats.canceled.Add(1)
			case errors.As(err, &ex):
				s.stats.exhausted.Add(1)
			default:
				s.failf("Select(%s, %d tokens): unexpected error %v", req.Model, n, err)
			}
			continue
		}
		if selCtx == canceled {
			s.failf("Select with a canceled context succeeded: %+v", d.Selection)
		}
		h := held{d: d}
		for _, pk := range []policy.Pick{d.Selection.Plain, d.Selection.Prefill, d.Selection.Decode} {
			if pk.Engine == nil {
				continue
			}
			e, ok := pk.Engine.(*stressEngine)
			if !ok {
				s.failf("picked %T %v, not a registry value", pk.Engine, pk.Engine)
				continue
			}
			e.acq.Add(1)
			h.engines = append(h.engines, e)
		}
		hold = append(hold, h)
		s.checkSelection(req, d.Selection, h.engines, s0, s1, &cur0, &acq0)
	}
	for len(hold) > 0 {
		release(len(hold) - 1)
	}
}

// checkSelection checks one successful selection against the mutation log.
func (s *stress) checkSelection(req *bucket.Request, sel bucket.Selection, engines []*stressEngine, s0, s1 uint64, cur0 *[32]*stressEngine, acq0 *[32]int64) {
	s.stats.picks.Add(1)
	if sel.Bucket == nil {
		s.failf("selection without a bucket: %+v", sel)
		return
	}
	bid := sel.Bucket.ID()
	spec := s.specs[bid]
	if req.InputTokens < int64(spec.MinInputTokens) || (spec.MaxInputTokens != 0 && req.InputTokens > int64(spec.MaxInputTokens)) {
		s.failf("bucket %q chosen for %d input tokens, outside its range", bid, req.InputTokens)
	}
	wantStages, picks := []state.Stage{state.StagePlain}, []policy.Pick{sel.Plain}
	if sel.IsPD() {
		s.stats.pd.Add(1)
		wantStages, picks = []state.Stage{state.StagePrefill, state.StageDecode}, []policy.Pick{sel.Prefill, sel.Decode}
	}
	if len(engines) != len(wantStages) {
		s.failf("bucket %q: %d engines selected, want %d", bid, len(engines), len(wantStages))
		return
	}
	if sel.IsPD() && engines[0].spec.label != engines[1].spec.label {
		s.failf("PD pair %v + %v: labels %q and %q are not compatible", engines[0], engines[1], engines[0].spec.label, engines[1].spec.label)
	}

	// The window of states the system went through during Select.
	lo := max(s0, 1) - 1
	window := make([]*worldState, 0, 8)
	for k := lo; k <= s1; k++ {
		st := s.ring[k%stressRing].Load()
		if st == nil || st.seq != k {
			s.stats.windowSkipped.Add(1) // the ring wrapped while this pick was descheduled
			return
		}
		window = append(window, st)
	}
	for i, e := range engines {
		s.checkBindings(req, bid, wantStages[i], picks[i])
		if e.spec.model != req.Model || e.spec.stage != wantStages[i] || !s.members[bid][wantStages[i]][e.spec.id] {
			s.failf("bucket %q stage %s picked %v (model %s, stage %s, bucket %s): not one of its candidates",
				bid, wantStages[i], e, e.spec.model, e.spec.stage, e.spec.bucket)
		}
		var registered, healthy, admissible, throughout = false, false, false, true
		bit := uint64(1) << e.slot
		for _, st := range window {
			live := st.live[e.slot] == e.inc
			registered = registered || live
			throughout = throughout && live
			healthy = healthy || (live && st.healthy&bit != 0)
			admissible = admissible || st.overCap&bit == 0
		}
		if !registered {
			s.failf("picked %v, which was not registered at any point during the selection (states %d..%d)", e, lo, s1)
		}
		if !healthy {
			s.failf("picked %v, which was unhealthy throughout the selection (states %d..%d)", e, lo, s1)
		}
		if !admissible {
			s.failf("picked %v, whose fresh waiting count was at or over the cap %d throughout the selection (states %d..%d)",
				e, stressWaitingCap, lo, s1)
		}
		// In-flight: the dispatches held on this incarnation from before the selection to after it
		// are a lower bound of the router's count when admission read it. Only meaningful while
		// the incarnation stayed registered (removal detaches its counter).
		if throughout && cur0[e.slot] == e {
			s.stats.inflightChecked.Add(1)
			lb := acq0[e.slot] - e.rel.Load()
			if lb == stressInFlightCap-1 {
				s.stats.inflightTight.Add(1)
			}
			if lb >= stressInFlightCap {
				s.failf("picked %v with at least %d dispatches in flight throughout the selection (cap %d)", e, lb, stressInFlightCap)
			}
		}
	}
}

// affinityGroups names the groups that bind, per store namespace.
var affinityGroups = map[string]struct {
	bucket string
	stage  state.Stage
}{
	"session": {"short", state.StagePlain},
	"sticky":  {"pd-b", state.StagePrefill},
}

// checkBindings checks the affinity scopes of one pick: a binding exists only in the scope of a
// group that binds, it names a member of that group, and a pick whose reason says it reused or
// made a binding is counted.
func (s *stress) checkBindings(req *bucket.Request, bid string, stage state.Stage, pk policy.Pick) {
	for ns, key := range map[string]string{"session": req.SessionKey, "sticky": req.RoutingKey} {
		if key == "" {
			continue
		}
		scope := affinity.Scope{Namespace: ns, Model: req.Model, BucketID: bid, Stage: stage, Key: key}
		id, ok, err := s.affinity.Lookup(context.Background(), scope)
		if err != nil {
			s.failf("lookup %+v: %v", scope, err)
			continue
		}
		g := affinityGroups[ns]
		if !ok {
			continue
		}
		if g.bucket != bid || g.stage != stage {
			s.failf("binding %+v → %s in a group that does not bind", scope, id)
		} else if !s.members[bid][stage][id] {
			s.failf("binding %+v → %s names an engine outside the group", scope, id)
		}
	}
	switch pk.Reason {
	case label.ReasonSessionPrimary, label.ReasonAssigned, label.ReasonStickyPrimary, label.ReasonStickyAssigned:
		s.stats.bound.Add(1)
	}
}

// TestStressRouter runs 8 pickers through the Router across plain and PD buckets while KV events
// stream into the index, load reports arrive and go stale under an injected clock, engines flap
// health and are removed (Router.RemoveEngine) and re-added as new values. Every selection is
// checked against the log of states the system went through while it ran: each engine was a
// registered, healthy member of the selected bucket's group for its stage at some point; its
// fresh waiting count was below the cap at some point; its in-flight dispatches were below the
// cap (by a lower bound the test holds); PD pairs come from one bucket with equal compatibility
// labels; the bucket accepts the input length. Failures are exhaustion (503) or a canceled
// client, nothing else. At the end every guard is released and every in-flight counter is zero.
// Duration: -enginepick.stress, else 2 s with -short, 10 s under -race, 30 s otherwise.
func TestStressRouter(t *testing.T) {
	s := newStress(t)
	prompts := newStressPrompts(s.index.Hasher())
	ctx, cancel := context.WithTimeout(context.Background(), stressDuration())
	defer cancel()
	var wg sync.WaitGroup
	wg.Go(func() { s.mutate(ctx, 1) })
	wg.Go(func() { s.streamEvents(ctx, 2, prompts) })
	for i := range stressPickers {
		wg.Go(func() { s.pick(ctx, uint64(100+i), prompts) })
	}
	wg.Wait()

	st := &s.stats
	t.Logf("picks %d (PD %d, affinity-bound %d), exhausted %d, canceled %d, KV events %d, bindings swept %d, states %d, window skipped %d, in-flight checks %d (at cap-1: %d)",
		st.picks.Load(), st.pd.Load(), st.bound.Load(), st.exhausted.Load(), st.canceled.Load(), st.events.Load(), st.swept.Load(), s.seq.Load(),
		st.windowSkipped.Load(), st.inflightChecked.Load(), st.inflightTight.Load())

	// Every guard released: each incarnation's dispatches were all released, and the router's
	// counters are back to zero for every engine ID.
	s.all.Range(func(k, _ any) bool {
		e := k.(*stressEngine)
		assert.Equal(t, e.acq.Load(), e.rel.Load(), "dispatches acquired and released on %v", e)
		return true
	})
	for _, sl := range stressSlots {
		assert.Zero(t, s.inflight.Count(sl.id), "in-flight of %s after every guard was released", sl.id)
	}
	stats := s.index.Stats()
	assert.LessOrEqual(t, stats.Blocks, stressMaxBlocks, "index blocks under its cap")

	// The run did what it claims: picks of both kinds, exhaustion, checked windows.
	assert.Positive(t, st.picks.Load()-st.pd.Load(), "plain selections")
	assert.Positive(t, st.pd.Load(), "PD selections")
	assert.Positive(t, st.exhausted.Load(), "exhausted selections (503)")
	assert.Positive(t, st.inflightTight.Load(), "selections checked one below the in-flight cap")
	assert.Less(t, st.windowSkipped.Load(), st.picks.Load()/2+1, "selections whose window fell out of the ring")
	assert.Positive(t, stats.EvictedBlocks, "index evictions under the cap")
	assert.Positive(t, st.bound.Load(), "selections that reused or made an affinity binding")
	assert.Positive(t, st.swept.Load(), "affinity bindings expired and swept")
}
