package sim

import (
	"cmp"
	"container/heap"
	"context"
	"errors"
	"fmt"
	"math/bits"
	"math/rand/v2"
	"net/http"
	"time"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/flowcontrol"
	"github.com/enginepick/enginepick/internal/peersync"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

// simModel is the model name the simulated engines serve.
const simModel state.ModelID = "llama-3.1-8b"

// simEpoch is the wall-clock instant of virtual time 0. Any fixed instant would do; it never
// appears in a report.
var simEpoch = time.Date(2025, time.January, 1, 0, 0, 0, 0, time.UTC)

// progressEvery is how many finished requests a run accumulates before it reports progress.
const progressEvery = 256

// run is one policy's replay: its fleet, router, state handles and event queue. Everything in it
// is touched by one goroutine.
type run struct {
	rc    *resolved
	name  string
	ctx   context.Context
	model state.ModelID // the model of every request: simModel, or Routing's

	now    time.Duration
	events eventQueue
	seq    uint64

	replicas []*replica     // router replicas; request k goes to replicas[k % len]
	shared   [][]byte       // batches in transit between replicas (evShare); nil: a free slot
	freeMsg  []int32        // free slots of shared
	affinity affinity.Store // shared by every replica
	indexes  []*kvindex.Index

	front   []*engine // plain or prefill engines, by ID
	decode  []*engine // PD decode engines, by ID
	all     []*engine // front then decode; engine.idx indexes it
	byID    map[state.EngineID]*engine
	reqs    []reqState
	pending int // requests neither finished nor dropped

	progress  func(int)
	unflushed int
	err       error // the first error of a flow-control callback (fail)

	// Outcomes.
	rejected   int
	shed       int
	unroutable int
	finished   int
	promptTok  int64
	cachedTok  int64
	outputTok  int64
	ttft       []float64
	e2e        []float64
	lastFinish time.Duration
	backlog    int           // requests arrived (not refused) that have not had their first token
	backlogAll backlogWindow // samples over the whole arrival span
	backlogEnd backlogWindow // samples over its last OverloadWindow fraction
	flows      []flowStats   // per rc.flows key; nil when the requests name no tenant or band

	// Buffers.
	scratch []byte
	bufs    [32][][]uint32 // free token buffers by power-of-two capacity class
	breq    bucket.Request
}

func (r *run) clock() time.Time { return simEpoch.Add(r.now) }

// replica is one independent router: its own Router, load table, in-flight counters, prefix index
// (with its own approximate entries) and policy instances. Every engine reports its load to every
// replica's table and publishes its KV events to every replica's index.
type replica struct {
	load     *loadmon.Table
	inflight *loadmon.InFlight
	index    *kvindex.Index
	router   *enginepick.Router
	trackers []requestTracker        // policies that follow their requests' lifecycle
	routed   int                     // requests this replica routed (selected an engine for)
	share    *peersync.Core          // nil unless Config.ShareRouters with several replicas
	fc       *flowcontrol.Controller // nil without Config.FlowControl
}

// simulate runs policy i of rc and returns its result.
func simulate(ctx context.Context, rc *resolved, i int, progress func(int)) (PolicyResult, error) {
	r, err := newRun(ctx, rc, i, progress)
	if err != nil {
		return PolicyResult{}, err
	}
	if err := r.loop(); err != nil {
		return PolicyResult{}, err
	}
	if r.unflushed > 0 {
		r.progress(r.unflushed)
	}
	if rc.inspect != nil {
		if err := rc.inspect(r); err != nil {
			return PolicyResult{}, err
		}
	}
	return r.result(), nil
}

func newRun(ctx context.Context, rc *resolved, i int, progress func(int)) (*run, error) {
	r := &run{rc: rc, name: rc.names[i], ctx: ctx, progress: progress}
	r.model = simModel
	if rc.routing != nil {
		r.model = rc.routing.model
	}
	for range rc.Routers {
		x, err := rc.routing.newIndex(rc.Model.BlockTokens, r.clock)
		if err != nil {
			return nil, err
		}
		r.indexes = append(r.indexes, x)
	}

	reg := &state.StaticRegistry{}
	r.byID = map[state.EngineID]*engine{}
	addEngine := func(id state.EngineID, stage state.Stage) (*engine, error) {
		e := &engine{r: r, idx: int32(len(r.all)), id: id, stage: stage, m: &rc.Model,
			static: state.NewStaticEngine(id, r.model, stage)}
		idx := r.indexes
		if stage == state.StageDecode {
			idx = nil // decode engines receive KV by transfer and publish no prefix blocks
		} else if len(rc.adapters) > 0 {
			e.waitingFor = make([]int32, len(rc.adapters))
		}
		e.cache = newKVCache(id, &rc.Model, idx, rc.adapters, rc.inspect != nil)
		if err := reg.Add(e.static); err != nil {
			return nil, err
		}
		r.all = append(r.all, e)
		r.byID[id] = e
		return e, nil
	}
	addEngines := func(n int, prefix string, stage state.Stage) ([]*engine, error) {
		width := len(fmt.Sprint(n - 1))
		out := make([]*engine, n)
		for k := range n {
			e, err := addEngine(state.EngineID(fmt.Sprintf("sim://%s-%0*d", prefix, width, k)), stage)
			if err != nil {
				return nil, err
			}
			out[k] = e
		}
		return out, nil
	}
	var err error
	switch {
	case rc.routing != nil:
		// The file's engines in its order, plain and prefill ones first, then decode ones.
		for _, decode := range []bool{false, true} {
			for _, ec := range rc.routing.engines {
				if (ec.Stage == "decode") != decode {
					continue
				}
				st, err := state.ParseStage(cmp.Or(ec.Stage, "plain"))
				if err != nil {
					return nil, err // Validate checked it
				}
				e, err := addEngine(state.EngineID(ec.ID), st)
				if err != nil {
					return nil, err
				}
				if decode {
					r.decode = append(r.decode, e)
				} else {
					r.front = append(r.front, e)
				}
			}
		}
	case rc.Fleet.IsPD():
		if r.front, err = addEngines(rc.Fleet.Prefill, "prefill", state.StagePrefill); err != nil {
			return nil, err
		}
		if r.decode, err = addEngines(rc.Fleet.Decode, "decode", state.StageDecode); err != nil {
			return nil, err
		}
	default:
		if r.front, err = addEngines(rc.Fleet.Plain, "engine", state.StagePlain); err != nil {
			return nil, err
		}
	}
	if r.affinity, err = affinity.NewMemoryStore(rc.routing.affinityOptions(r.clock)); err != nil {
		return nil, err
	}
	for k := range rc.Routers {
		rep, err := r.newReplica(reg, k, rc.factories[i])
		if err != nil {
			return nil, err
		}
		r.replicas = append(r.replicas, rep)
	}

	r.reqs = make([]reqState, len(rc.requests))
	for k := range r.reqs {
		tr := &rc.requests[k]
		adapter := int32(-1)
		if tr.Adapter != "" {
			adapter = rc.adapterIDs[tr.Adapter]
		}
		r.reqs[k] = reqState{pos: int32(k), tr: tr, adapter: adapter, input: len(rc.systemPrompt) + tr.InputTokens,
			output: max(tr.OutputTokens, 1), arrival: time.Duration(float64(tr.Arrival) / rc.Speed),
			replica: r.replicas[k%len(r.replicas)]}
	}
	r.pending = len(r.reqs)
	r.ttft = make([]float64, 0, len(r.reqs))
	r.e2e = make([]float64, 0, len(r.reqs))
	if rc.flows != nil {
		r.flows = make([]flowStats, len(rc.flows.keys))
	}
	return r, nil
}

// newReplica builds router replica k over the run's engines: its own load table, in-flight
// counters and policy instances, the run's k-th index, and a random source seeded with
// PCG(Seed, Seed+k), so that one replica replays exactly as a run without replicas.
func (r *run) newReplica(reg state.Registry, k int, factory PolicyFactory) (*replica, error) {
	rc := r.rc
	rep := &replica{load: rc.routing.newLoadTable(r.clock), inflight: loadmon.NewInFlight(r.clock),
		index: r.indexes[k]}
	rng := rand.New(rand.NewPCG(rc.Seed, rc.Seed+uint64(k)))
	if rc.ShareRouters && rc.Routers > 1 {
		var err error
		rep.share, err = peersync.New(peersync.Config{ID: fmt.Sprint(k), InFlight: rep.inflight, Index: rep.index,
			Known: func(e state.EngineID) bool { return r.byID[e] != nil }, Lease: time.Duration(1<<63 - 1)})
		if err != nil {
			return nil, err
		}
	}
	if rc.routing != nil {
		var err error
		if rep.router, err = rc.routing.newRouter(r, reg, rep, rng.IntN); err != nil {
			return nil, err
		}
		return rep, nil
	}
	env := PolicyEnv{Load: rep.load, InFlight: rep.inflight, Index: rep.index, Rand: rng.IntN,
		Admission: rc.Admission, Now: r.clock, Affinity: r.affinity, run: r}

	group := func(f PolicyFactory, stage state.Stage) (*bucket.EngineGroup, error) {
		p, err := f(env, stage)
		if err != nil {
			return nil, err
		}
		if p == nil {
			return nil, fmt.Errorf("sim: policy factory returned a nil policy for stage %s: %w", stage, state.ErrInvalidConfiguration)
		}
		if t, ok := p.(requestTracker); ok {
			rep.trackers = append(rep.trackers, t)
		}
		return bucket.NewEngineGroup(p, nil)
	}
	spec := bucket.Spec{ID: "default", MaxContextTokens: uint64(rc.Model.MaxContextTokens)}
	var b *bucket.Bucket
	if rc.Fleet.IsPD() {
		pg, err := group(factory, state.StagePrefill)
		if err != nil {
			return nil, err
		}
		dg, err := group(powerOfTwo, state.StageDecode)
		if err != nil {
			return nil, err
		}
		if b, err = bucket.NewPDBucket(spec, pg, dg); err != nil {
			return nil, err
		}
	} else {
		g, err := group(factory, state.StagePlain)
		if err != nil {
			return nil, err
		}
		if b, err = bucket.NewPlainBucket(spec, g); err != nil {
			return nil, err
		}
	}
	res, err := bucket.NewResolver([]*bucket.Bucket{b}, bucket.ResolverOptions{})
	if err != nil {
		return nil, err
	}
	if rc.flowControl != nil {
		if rep.fc, err = r.newController(); err != nil {
			return nil, err
		}
	}
	rep.router, err = enginepick.NewRouter(enginepick.Options{Registry: reg, InFlight: rep.inflight, Load: rep.load,
		Resolvers: map[state.ModelID]*bucket.Resolver{simModel: res}, FlowControl: rep.fc})
	if err != nil {
		return nil, err
	}
	return rep, nil
}

// loop runs the event queue dry.
func (r *run) loop() error {
	r.schedule(0, evTick, 0, 0)
	r.schedule(r.reqs[0].arrival, evArrival, 0, 0)
	flow := r.rc.flowControlled()
	for n := 0; r.events.Len() > 0; n++ {
		if n&0xfff == 0 {
			if err := r.ctx.Err(); err != nil {
				return err
			}
		}
		ev := heap.Pop(&r.events).(event)
		r.now = ev.at
		var err error
		switch ev.kind {
		case evTick:
			err = r.tick()
		case evArrival:
			err = r.arrive(int(ev.arg))
		case evStep:
			err = r.all[ev.arg].onStep(ev.ver)
		case evTransfer:
			err = r.transferred(&r.reqs[ev.arg])
		case evShare:
			err = r.deliver(ev.arg, int(ev.ver))
		}
		if err == nil && flow {
			err = r.drive()
		}
		if err != nil {
			return err
		}
		r.share()
	}
	if r.pending != 0 {
		return fmt.Errorf("sim: %d requests never finished (simulator bug)", r.pending)
	}
	return nil
}

// share sends each sharing replica's pending decisions to the others, Config.ShareDelay from now.
func (r *run) share() {
	for k, rep := range r.replicas {
		if rep.share == nil || !rep.share.Pending() {
			continue
		}
		var slot int32
		if n := len(r.freeMsg); n > 0 {
			slot, r.freeMsg = r.freeMsg[n-1], r.freeMsg[:n-1]
		} else {
			slot = int32(len(r.shared))
			r.shared = append(r.shared, nil)
		}
		r.shared[slot] = rep.share.Flush(false)
		r.schedule(r.now+r.rc.ShareDelay, evShare, slot, uint64(k))
	}
}

// deliver folds shared batch slot of replica from into every other replica's view.
func (r *run) deliver(slot int32, from int) error {
	msg := r.shared[slot]
	r.shared[slot] = nil
	r.freeMsg = append(r.freeMsg, slot)
	for k, rep := range r.replicas {
		if k == from {
			continue
		}
		if err := rep.share.Receive(msg, r.clock()); err != nil {
			return fmt.Errorf("sim: shared batch of replica %d: %w", from, err)
		}
	}
	return nil
}

// tick makes every engine report its load and samples the backlog, then schedules the next tick
// while work remains.
func (r *run) tick() error {
	r.sampleBacklog()
	for _, e := range r.all {
		if err := e.report(); err != nil {
			return fmt.Errorf("sim: load report of %q: %w", e.id, err)
		}
	}
	if r.pending > 0 {
		r.schedule(r.now+r.rc.ReportInterval, evTick, 0, 0)
	}
	return nil
}

// arrive routes request k through the library's Router and hands it to the selected engine.
func (r *run) arrive(k int) error {
	if k+1 < len(r.reqs) {
		r.schedule(r.reqs[k+1].arrival, evArrival, int32(k+1), 0)
	}
	if r.flows != nil && k == len(r.reqs)-1 {
		r.measureService()
	}
	q := &r.reqs[k]
	n := q.input
	q.tokens = q.tr.AppendTokenIDs(append(r.tokenBuf(n), r.rc.systemPrompt...))
	key := q.tr.SessionKey()
	req := &r.breq
	if q.replica.fc != nil {
		req = new(bucket.Request) // the router holds it while the request waits
	}
	*req = bucket.Request{
		Model:      r.model,
		TokenIDs:   q.tokens,
		SessionKey: key,
		RoutingKey: key,
		Signals: bucket.Signals{InputTokens: int64(n), ExpectedPeakTokens: int64(n + q.tr.OutputTokens),
			HasExpectedPeak: true},
		Priority: q.tr.Priority,
		Flow:     q.tr.Tenant,
		Adapter:  q.tr.Adapter,
	}
	r.backlog++ // until its first token, or its selection fails
	if q.replica.fc != nil {
		r.selectFlow(q, req)
		return r.err
	}
	d, err := q.replica.router.Select(r.ctx, req)
	r.breq = bucket.Request{}
	return r.routed(q, d, err)
}

// routed hands request q to the engine its selection chose, or counts the error that ended it.
func (r *run) routed(q *reqState, d *enginepick.Dispatch, err error) error {
	rep := q.replica
	for _, t := range rep.trackers {
		if err == nil {
			t.bind(q.pos)
		} else {
			t.discard()
		}
	}
	if err == nil {
		rep.routed++
	}
	if err != nil {
		switch bucket.StatusCode(err) {
		case http.StatusServiceUnavailable:
			r.rejected++
		case http.StatusTooManyRequests:
			r.shed++
		case http.StatusBadRequest:
			r.unroutable++
		default:
			return fmt.Errorf("sim: routing request %d: %w", q.pos, err)
		}
		r.backlog--
		r.putTokenBuf(q.tokens)
		q.tokens = nil
		r.drop()
		return nil
	}
	q.dispatch = d
	sel := &d.Selection
	if sel.IsPD() {
		q.front, q.decode = r.byID[sel.Prefill.Engine.ID()], r.byID[sel.Decode.Engine.ID()]
	} else {
		q.front = r.byID[sel.Plain.Engine.ID()]
	}
	if q.front == nil || (sel.IsPD() && q.decode == nil) {
		return errors.New("sim: router selected an engine outside the fleet")
	}
	root := uint64(engineHashSeed)
	if q.adapter >= 0 {
		root = r.rc.adapterRoots[q.adapter]
	}
	q.hashes, r.scratch = appendEngineHashes(q.hashes[:0], r.scratch, q.tokens, r.rc.Model.BlockTokens, root)
	if r.rc.inspect != nil {
		keys, err := r.indexKeys(q)
		if err != nil {
			return err
		}
		q.keys = keys
	}
	return q.front.enqueue(q)
}

// indexKeys returns the kvindex keys of q's prompt blocks, chained from its adapter's root (for an
// index whose Hasher has no namespace, an adapter's root is that of a Hasher namespaced by the
// adapter: kvindex.Hasher).
func (r *run) indexKeys(q *reqState) ([]uint64, error) {
	h := r.indexes[0].Hasher()
	if q.adapter >= 0 {
		var err error
		if h, err = kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: h.BlockTokens(), Namespace: q.tr.Adapter}); err != nil {
			return nil, err
		}
	}
	return h.AppendKeys(nil, q.tokens), nil
}

// observeAdmission accounts a request's cache hit when its front engine admits it.
func (r *run) observeAdmission(q *reqState) {
	r.promptTok += int64(q.input)
	r.cachedTok += int64(q.cached)
}

// promptDone handles a request whose prompt its front engine has fully prefilled.
func (r *run) promptDone(q *reqState) error {
	r.putTokenBuf(q.tokens)
	q.tokens = nil
	e := q.front
	if q.decode == nil {
		r.firstToken(q)
		if q.output <= 1 {
			q.generated = 1
			return r.finish(q)
		}
		return e.startDecoding(q)
	}
	e.holding++
	return q.decode.enqueueDecode(q)
}

// transferred handles a PD request whose KV reached its decode engine: the prefill engine frees
// the request's KV and the decode engine delivers the first token.
func (r *run) transferred(q *reqState) error {
	p, d := q.front, q.decode
	p.releaseFront(q)
	p.holding--
	if err := p.poke(); err != nil {
		return err
	}
	d.transferring--
	r.firstToken(q)
	if q.output <= 1 {
		q.generated = 1
		return r.finish(q)
	}
	return d.startDecoding(q)
}

// firstToken records that q's first token exists now, takes it out of the backlog and tells its
// replica's trackers.
func (r *run) firstToken(q *reqState) {
	q.firstToken = r.now
	r.backlog--
	q.dispatch.FirstToken()
	for _, t := range q.replica.trackers {
		t.firstToken(q.pos)
	}
}

// finish ends a request that produced its last token.
func (r *run) finish(q *reqState) error {
	if q.finished {
		return fmt.Errorf("sim: request %d finished twice (simulator bug)", q.pos)
	}
	q.finished = true
	if q.decode == nil {
		q.front.releaseFront(q)
	} else {
		q.decode.cache.unreserve(q.decPrivate)
		q.decPrivate = 0
	}
	q.dispatch.Release()
	q.dispatch = nil
	for _, t := range q.replica.trackers {
		t.finished(q.pos)
	}
	r.finished++
	r.outputTok += int64(q.output)
	ttft, e2e := (q.firstToken - q.arrival).Seconds(), (r.now - q.arrival).Seconds()
	measured := q.arrival >= r.rc.Warmup
	if measured {
		r.ttft = append(r.ttft, ttft)
		r.e2e = append(r.e2e, e2e)
	}
	if r.flows != nil {
		r.recordFlow(q, measured, ttft, e2e)
	}
	r.lastFinish = max(r.lastFinish, r.now)
	r.drop()
	if q.decode != nil {
		return q.decode.admitDecode()
	}
	return nil
}

// drop counts a request as done (finished or refused) for progress and termination.
func (r *run) drop() {
	r.pending--
	r.unflushed++
	if r.unflushed >= progressEvery {
		r.progress(r.unflushed)
		r.unflushed = 0
	}
}

// tokenBuf returns an empty buffer with capacity for n token IDs, reusing a freed one.
func (r *run) tokenBuf(n int) []uint32 {
	class := bits.Len(uint(max(n, 1) - 1))
	if free := r.bufs[class]; len(free) > 0 {
		b := free[len(free)-1]
		r.bufs[class] = free[:len(free)-1]
		return b[:0]
	}
	return make([]uint32, 0, 1<<class)
}

func (r *run) putTokenBuf(b []uint32) {
	if cap(b) == 0 {
		return
	}
	class := bits.Len(uint(cap(b) - 1))
	if 1<<class != cap(b) || class >= len(r.bufs) {
		return
	}
	r.bufs[class] = append(r.bufs[class], b)
}
