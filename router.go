package enginepick

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"math"
	"math/rand/v2"
	"slices"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/flowcontrol"
	"github.com/enginepick/enginepick/internal/flowbridge"
	"github.com/enginepick/enginepick/internal/loadbridge"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// ErrUnknownModel is returned (wrapped) by Router.Select for a model without a resolver; it is
// bucket.ErrUnknownModel, so bucket.StatusCode maps it to 404. There is no fallback to another
// model (docs/design.md §16).
var ErrUnknownModel = bucket.ErrUnknownModel

// Options configures a Router. Registry, Resolvers and InFlight are required.
type Options struct {
	// Registry is the host's live engine registry; authoritative for role and health.
	Registry state.Registry
	// Resolvers maps each served model to its buckets. A model missing here is unknown (404).
	Resolvers map[state.ModelID]*bucket.Resolver
	// InFlight is the router-local in-flight counters: the same value the policies were built
	// with, so that dispatches the Router counts are the load the policies see.
	InFlight *loadmon.InFlight
	// Load is the engine-reported load table the policies read. Optional: when set, RemoveEngine
	// forgets the engine's reports.
	Load *loadmon.Table
	// Index is the KV-block prefix index the cache-aware policies read. Optional: when set,
	// RemoveEngine drops the engine's blocks from it.
	Index *kvindex.Index
	// Logger receives debug logs of selection failures. Nil means zap.NewNop().
	Logger *zap.Logger
	// Observer receives the Router's decisions and dispatch outcomes (for example
	// metrics.New's). Nil means none.
	Observer Observer
	// Now is the clock of the Router's latency measurements. Nil means time.Now.
	Now func() time.Time
	// Models lists the served models in the order Models reports them; every entry must have a
	// resolver and appear once. Nil means the models of Resolvers, sorted by ID.
	Models []state.ModelID
	// PolicyName names the policy type of bucket b's group of stage s, for
	// DispatchedEngine.Policy; NewRouter calls it once per group of every resolver's buckets. Nil
	// means unnamed ("").
	PolicyName func(b *bucket.Bucket, s state.Stage) string
	// AffinityStore is the store the session and sticky policies share. Optional: when set,
	// RemoveEngine invalidates the engine's bindings in it.
	AffinityStore affinity.Store
	// FlowControl, when set, makes Select wait in the Router while the fleet is saturated for the
	// request, instead of failing with 503, and hands freed capacity to the waiting requests by
	// priority band, fair share between flows and arrival (bucket.Request.Priority and Flow,
	// docs/design.md §17). The Router wakes them when a dispatch ends, an engine is removed and,
	// with Load, on every load report (it registers a Table.OnChange callback for the table's
	// lifetime). With two or more bands, a request below the top band leaves the last slot of an
	// in-flight cap of 2 or more to the top band. Nil means no flow control.
	FlowControl *flowcontrol.Controller
}

// Router selects engines for requests of several models and accounts for the dispatches that
// follow. It is safe for concurrent use; its resolver map is fixed at construction. Build it with
// NewRouter from parts built in code, or from a configuration file with package config, which also
// runs the load pollers, KV-event subscribers and health checks a deployment needs.
type Router struct {
	registry  state.Registry
	resolvers map[state.ModelID]*bucket.Resolver
	inflight  *loadmon.InFlight
	load      *loadmon.Table
	index     *kvindex.Index
	log       *zap.Logger
	obs       Observer
	now       func() time.Time
	realClock bool      // now is time.Now: stamp reads the monotonic clock only
	timeEvery uint32    // an observed Select is timed one time in timeEvery (≤ 1: always); SelectTimingSampler
	base      time.Time // the Router's clock at construction: dispatch and selection times are offsets from it (stamp)
	labels    map[*bucket.Bucket]groupLabels
	models    []state.ModelID
	store     affinity.Store
	fc        *flowcontrol.Controller
	staleWake atomic.Bool // a wakeWhenStale timer is pending
}

// groupLabels are the policy names of one bucket's groups, by stage.
type groupLabels [3]string

// NewRouter validates opts and returns a Router. It starts nothing. A nil Registry, nil InFlight,
// nil Resolvers map, a nil resolver in it, or a Models list that is not a permutation of the
// resolvers' models is an error wrapping policy.ErrInvalidConfiguration.
func NewRouter(opts Options) (*Router, error) {
	if opts.Registry == nil {
		return nil, fmt.Errorf("enginepick: Options.Registry is nil: %w", policy.ErrInvalidConfiguration)
	}
	if opts.InFlight == nil {
		return nil, fmt.Errorf("enginepick: Options.InFlight is nil: %w", policy.ErrInvalidConfiguration)
	}
	if opts.Resolvers == nil {
		return nil, fmt.Errorf("enginepick: Options.Resolvers is nil: %w", policy.ErrInvalidConfiguration)
	}
	resolvers := make(map[state.ModelID]*bucket.Resolver, len(opts.Resolvers))
	for m, r := range opts.Resolvers {
		if r == nil {
			return nil, fmt.Errorf("enginepick: resolver of model %q is nil: %w", m, policy.ErrInvalidConfiguration)
		}
		resolvers[m] = r
	}
	log := opts.Logger
	if log == nil {
		log = zap.NewNop()
	}
	models := make([]state.ModelID, 0, len(resolvers))
	for m := range resolvers {
		models = append(models, m)
	}
	slices.Sort(models)
	if opts.Models != nil {
		given := slices.Sorted(slices.Values(opts.Models))
		if !slices.Equal(given, models) {
			return nil, fmt.Errorf("enginepick: Options.Models %v: want each model of Resolvers once: %w", opts.Models, policy.ErrInvalidConfiguration)
		}
		models = slices.Clone(opts.Models)
	}
	r := &Router{registry: opts.Registry, resolvers: resolvers, inflight: opts.InFlight, load: opts.Load, index: opts.Index,
		log: log, obs: opts.Observer, now: opts.Now, realClock: opts.Now == nil, models: models, store: opts.AffinityStore,
		labels: map[*bucket.Bucket]groupLabels{}, fc: opts.FlowControl}
	if fc := r.fc; fc != nil && r.load != nil {
		opts.Load.OnChange(func(state.EngineID) {
			for _, m := range models {
				fc.Notify(m)
			}
		})
	}
	if r.realClock {
		r.now = time.Now
	}
	r.base = r.now()
	if ts, ok := opts.Observer.(SelectTimingSampler); ok {
		r.timeEvery = uint32(max(1, min(int64(ts.SelectTimingEvery()), math.MaxUint32)))
	}
	if opts.PolicyName != nil {
		for _, m := range models {
			for _, b := range resolvers[m].Buckets() {
				var lb groupLabels
				if b.IsPD() {
					lb[state.StagePrefill], lb[state.StageDecode] = opts.PolicyName(b, state.StagePrefill), opts.PolicyName(b, state.StageDecode)
				} else {
					lb[state.StagePlain] = opts.PolicyName(b, state.StagePlain)
				}
				r.labels[b] = lb
			}
		}
	}
	return r, nil
}

// Dispatch is a complete selection whose engines have been counted as in flight. Forward the
// request to the selected engines, then call Done with its outcome (or Release, when there is no
// outcome to report) when the response (or stream) ends, however it ends. The first call of Done or
// Release ends the dispatch; later calls do nothing. Both are safe for concurrent use.
type Dispatch struct {
	// Selection is the bucket's complete choice.
	Selection bucket.Selection
	guards    [2]*loadmon.Guard
	r         *Router
	model     state.ModelID
	start     time.Duration // the Router's stamp when the selection ended
	ended     atomic.Bool
}

// Release ends the dispatch's hold on every selected engine's in-flight counter without reporting
// an outcome. A nil *Dispatch's Release does nothing.
func (d *Dispatch) Release() {
	if d == nil || !d.ended.CompareAndSwap(false, true) {
		return
	}
	for _, g := range d.guards {
		g.Release()
	}
	d.r.notify(d.model)
}

// ReleaseStage releases, ahead of the end of the dispatch, the in-flight guard of one leg of a PD
// dispatch: state.StagePrefill once the prefill leg has ended (its engine no longer works on the
// request while the decode stream goes on), state.StageDecode once the decode leg has. The other
// leg's guard is untouched; Done or Release later ends the dispatch and releases whatever is still
// held (a guard is released once). For a plain dispatch, or another stage, it does nothing. A nil
// *Dispatch's ReleaseStage does nothing. Safe for concurrent use (docs/design.md §6).
func (d *Dispatch) ReleaseStage(stage state.Stage) {
	if d == nil || !d.Selection.IsPD() {
		return
	}
	switch stage {
	case state.StagePrefill:
		d.guards[0].Release()
	case state.StageDecode:
		d.guards[1].Release()
	default:
		return
	}
	d.r.notify(d.model)
}

// FirstToken records that the response's first token has arrived: the selected engines have ended
// the request's prefill (loadmon.Guard.FirstToken). Call it when the first token of a streamed
// response arrives; it is optional. A nil *Dispatch's FirstToken does nothing.
func (d *Dispatch) FirstToken() {
	if d == nil {
		return
	}
	for _, g := range d.guards {
		g.FirstToken()
	}
	if r := d.r; r != nil && r.fc != nil && flowbridge.BelowTop(r.fc, math.MinInt) {
		r.notify(d.model) // a request held by the engine's prefill may go (prefillHold)
	}
}

// Done ends the dispatch as Release does, and reports its outcome to the Router's Observer
// (docs/design.md §15), grpc-go style: the host calls it once the response has ended, with the
// error (nil on success), time to first token and token counts it learned. A nil *Dispatch's
// Done does nothing; so does a Done after Done or Release.
func (d *Dispatch) Done(o Outcome) {
	if d == nil || !d.ended.CompareAndSwap(false, true) {
		return
	}
	for _, g := range d.guards {
		g.Release()
	}
	r := d.r
	r.notify(d.model)
	if r == nil || r.obs == nil {
		return
	}
	ev := DoneEvent{Model: d.model, Bucket: d.Selection.Bucket.ID(), Outcome: o, Reason: FailureReason(o.Err), Duration: r.stamp() - d.start}
	lb := r.labels[d.Selection.Bucket]
	if d.Selection.IsPD() {
		ev.Engines[0] = DispatchedEngine{ID: d.Selection.Prefill.Engine.ID(), Stage: state.StagePrefill, Policy: lb[state.StagePrefill], Reason: d.Selection.Prefill.Reason}
		ev.Engines[1] = DispatchedEngine{ID: d.Selection.Decode.Engine.ID(), Stage: state.StageDecode, Policy: lb[state.StageDecode], Reason: d.Selection.Decode.Reason}
		ev.N = 2
	} else {
		ev.Engines[0] = DispatchedEngine{ID: d.Selection.Plain.Engine.ID(), Stage: state.StagePlain, Policy: lb[state.StagePlain], Reason: d.Selection.Plain.Reason}
		ev.N = 1
	}
	r.obs.ObserveDone(ev)
}

// Select resolves the request's model, runs the bucket loop (bucket.Select) with a prefix-lookup
// memo for the request (a new kvindex.Memo when req.Memo is nil; req is not modified) and, on success,
// acquires one in-flight guard per selected engine: the plain engine, or the prefill and the
// decode engine. The plain or prefill guard records the dispatch's prefill tokens
// (Pick.PrefillTokens, else the input tokens) so that pressure comparisons count them until the
// engine's next load report (docs/design.md §6). Nothing is acquired on failure. With an Observer,
// every Select is reported to it, timed unless the Observer samples the timing
// (SelectTimingSampler).
//
// A pick admitted under an in-flight cap (Pick.HasInFlightCap) is acquired only while its engine
// is below the cap, atomically (loadmon.InFlight.TryAcquire), so that concurrent Selects
// never put more requests in flight on an engine than its cap. When another Select got there
// first, the selection's guards are released and the bucket loop runs again, where the policies
// see the new count; after 4 such runs the error is a *bucket.ExhaustedError holding the
// in-flight *policy.AdmissionRejectedError (503) (docs/design.md §5).
//
// With Options.FlowControl, a request the fleet cannot serve now (every candidate refused by
// admission, or every candidate engine saturated by the detector) waits for its turn and is
// selected again when capacity may have freed (docs/design.md §17); the Observer then sees the
// Select once, when it ends, its duration including the wait.
//
// Errors: a nil req wraps policy.ErrInvalidSignal; ErrUnknownModel (404); otherwise bucket.Select's
// errors (bucket.StatusCode maps them); with flow control also a *flowcontrol.RejectedError (429),
// an error wrapping flowcontrol.ErrTimeout (503) or ctx's error (499, 504), each wrapping the last
// refusal. A nil ctx means context.Background().
func (r *Router) Select(ctx context.Context, req *bucket.Request) (*Dispatch, error) {
	if r.obs == nil {
		return r.selectFlow(ctx, req, nil)
	}
	timed := r.timeEvery <= 1 || rand.Uint32N(r.timeEvery) == 0
	var start time.Duration
	if timed {
		start = r.stamp()
	}
	var at time.Time
	d, err := r.selectFlow(ctx, req, &at)
	var end time.Duration
	if !at.IsZero() {
		end = at.Sub(r.base) // the dispatch's own clock reading (selectOnce)
	} else if timed || d != nil {
		end = r.stamp()
	}
	ev := SelectEvent{Timed: timed}
	if timed {
		ev.Duration = end - start
	}
	if d != nil {
		ev.Model, ev.Selection = d.model, &d.Selection
		d.start = end
	} else {
		ev.Err, ev.Reason = err, FailureReason(err)
		if req != nil {
			if _, ok := r.resolvers[req.Model]; ok {
				ev.Model = req.Model
			}
		}
	}
	r.obs.ObserveSelect(ev)
	return d, err
}

// stamp returns the time elapsed on the Router's clock since it was built. With the default clock
// it reads the monotonic clock alone (time.Since of a monotonic base). An observed Select stamps its
// start only when it is in the timing sample (SelectTimingSampler); its end is the dispatch's own
// clock reading on success (selectOnce), and a stamp only where that reading is missing (a timed
// Select that failed, or a successful one whose Router or in-flight counters have an injected
// clock).
func (r *Router) stamp() time.Duration {
	if r.realClock {
		return time.Since(r.base)
	}
	return r.now().Sub(r.base)
}

// selectOnce selects and acquires the guards, selecting again when an in-flight cap was reached
// first (Select). When at is non-nil and the Router uses time.Now, it reads the clock once at
// dispatch, hands the reading to the in-flight counters (which record it when they use time.Now
// too: InFlight.TryAcquire) and, when the guards were acquired, stores it in *at, so that an
// observed Select times the selection without a clock reading of its own; otherwise *at stays
// zero.
func (r *Router) selectOnce(ctx context.Context, req *bucket.Request, at *time.Time) (*Dispatch, error) {
	if req == nil {
		return nil, fmt.Errorf("enginepick: Select: nil request: %w", policy.ErrInvalidSignal)
	}
	if ctx == nil {
		ctx = context.Background()
	}
	res, ok := r.resolvers[req.Model]
	if !ok {
		return nil, fmt.Errorf("enginepick: model %q: %w", req.Model, ErrUnknownModel)
	}
	if req.Memo == nil {
		// One prefix lookup per source for the whole bucket loop (docs/design.md §10).
		withMemo := *req
		withMemo.Memo = new(kvindex.Memo)
		req = &withMemo
	}
	hold := r.fc != nil && flowbridge.BelowTop(r.fc, req.Priority)
	if hold {
		ctx = flowbridge.WithPrefillHold(ctx) // policies that read it pick around the hold
	}
	var err error
	for attempt := 1; ; attempt++ {
		var sel bucket.Selection
		if sel, err = bucket.Select(ctx, res, r.registry, req); err != nil {
			break
		}
		if hold {
			if lost, stage := r.prefillHold(&sel); lost != nil {
				if attempt == maxSelectAttempts {
					err = &bucket.ExhaustedError{Rejections: []*policy.AdmissionRejectedError{lost},
						Last: &bucket.StageError{Bucket: sel.Bucket.ID(), Stage: stage, Err: lost}}
					break
				}
				continue
			}
		}
		var now time.Time // zero: the in-flight counters read their own clock
		if at != nil && r.realClock {
			now = time.Now()
			*at = now
		}
		var guards [2]*loadmon.Guard
		var lost *policy.AdmissionRejectedError
		stage := state.StagePlain // of the leg that found its engine at the cap, if one did
		if sel.IsPD() {
			stage = state.StagePrefill
			if guards[0], lost = r.acquire(&sel.Prefill, prefillTokens(&sel.Prefill, req), hold, now); lost == nil {
				stage = state.StageDecode
				if guards[1], lost = r.acquire(&sel.Decode, 0, hold, now); lost != nil {
					guards[0].Release() // the pair is not dispatched
				}
			}
		} else {
			guards[0], lost = r.acquire(&sel.Plain, prefillTokens(&sel.Plain, req), hold, now)
		}
		if lost == nil {
			return &Dispatch{Selection: sel, guards: guards, r: r, model: req.Model}, nil
		}
		if at != nil {
			*at = time.Time{} // not a dispatch
		}
		if attempt == maxSelectAttempts {
			err = &bucket.ExhaustedError{Rejections: []*policy.AdmissionRejectedError{lost},
				Last: &bucket.StageError{Bucket: sel.Bucket.ID(), Stage: stage, Err: lost}}
			break
		}
	}
	return nil, err
}

// prefillHold is the rejection of a selection whose plain or prefill engine is still prefilling a
// dispatch of this router (loadbridge.Prefilling: prefill tokens in flight without a first
// token), for a request below flow control's highest band: such a request waits until the engine
// ends its prefills, so that it never queues a prefill ahead of a later request of a higher band
// (docs/design.md §17). It returns nil when the engine has no known prefill in flight.
func (r *Router) prefillHold(sel *bucket.Selection) (*policy.AdmissionRejectedError, state.Stage) {
	p, stage := &sel.Plain, state.StagePlain
	if sel.IsPD() {
		p, stage = &sel.Prefill, state.StagePrefill
	}
	n := loadbridge.Prefilling(r.inflight, p.Engine.ID())
	if n == 0 {
		return nil, stage
	}
	return &policy.AdmissionRejectedError{Engine: p.Engine, Limit: flowbridge.LimitPrefilling, Observed: n}, stage
}

// logFailure logs a failed selection at Debug.
func (r *Router) logFailure(req *bucket.Request, err error) {
	if ce := r.log.Check(zap.DebugLevel, "selection failed"); ce != nil {
		ce.Write(zap.String("model", string(req.Model)), zap.Int64("input_tokens", req.InputTokens),
			zap.Int("status", bucket.StatusCode(err)), zap.Error(err))
	}
}

// errDetectorSaturated is the refusal of an attempt the saturation detector turned away.
var errDetectorSaturated = errors.New("enginepick: the saturation detector finds every candidate engine saturated")

// selectFlow is selectOnce under the Router's flow control (docs/design.md §17), logging the
// failure: each attempt of the request is refused when the detector finds the fleet saturated for
// it, or when selectOnce's *bucket.ExhaustedError holds an admission rejection; the request then
// waits (flowcontrol.Controller.Wait) and the whole selection runs again at its turn. A wait that
// ends without a dispatch returns the Controller's error with the last refusal.
func (r *Router) selectFlow(ctx context.Context, req *bucket.Request, at *time.Time) (*Dispatch, error) {
	res, ok := (*bucket.Resolver)(nil), false
	if req != nil {
		res, ok = r.resolvers[req.Model]
	}
	if r.fc == nil || !ok {
		d, err := r.selectOnce(ctx, req, at)
		if err != nil && ok {
			r.logFailure(req, err)
		}
		return d, err
	}
	if ctx == nil {
		ctx = context.Background()
	}
	// The attempt keeps its own clock reading, copied to *at at the end, so that at does not
	// escape: a Select without flow control allocates nothing for it.
	var local time.Time
	var atLocal *time.Time
	if at != nil {
		atLocal = &local
	}
	a := r.newFlowAttempt(ctx, res, req, atLocal)
	a.wake = true
	d, err := a.result(r.fc.Wait(ctx, a.request(), a.try))
	if at != nil {
		*at = local
	}
	return d, err
}

// saturated reports whether the saturation detector finds the fleet saturated for a request that
// may use buckets: in every bucket, some group (plain, prefill or decode) has engines and the
// detector finds each of them saturated (flowcontrol.Controller.Saturated: an engine without a
// fresh report is not). Without a load table, or without buckets, nothing is saturated. When
// saturated, it also returns how long until the oldest report it relied on goes stale.
func (r *Router) saturated(buckets []*bucket.Bucket, model state.ModelID) (time.Duration, bool) {
	if r.load == nil || len(buckets) == 0 {
		return 0, false
	}
	snap := r.load.Snapshot()
	var oldest time.Time
	var buf [32]state.Engine
	for _, b := range buckets {
		stages := []state.Stage{state.StagePlain}
		if b.IsPD() {
			stages = []state.Stage{state.StagePrefill, state.StageDecode}
		}
		full := false
		for _, s := range stages {
			es := b.Engines(r.registry, model, s, buf[:0])
			full = len(es) > 0
			for _, e := range es {
				l, _ := snap.Load(e.ID())
				if !r.fc.Saturated(l) {
					full = false
					break
				}
				if oldest.IsZero() || l.ReportedAt.Before(oldest) {
					oldest = l.ReportedAt
				}
			}
			clear(es)
			if full {
				break
			}
		}
		if !full {
			return 0, false
		}
	}
	return oldest.Add(r.load.Freshness()).Sub(snap.CapturedAt()) + time.Millisecond, true
}

// wakeWhenStale wakes every model's waiting requests after d, when a report the detector found
// saturated has gone stale: stale load is not saturated, and no report or dispatch end may come to
// say so. One wake is pending at a time; a request refused after it fired arms the next.
func (r *Router) wakeWhenStale(d time.Duration) {
	if !r.staleWake.CompareAndSwap(false, true) {
		return
	}
	time.AfterFunc(d, func() {
		r.staleWake.Store(false)
		for _, m := range r.models {
			r.notify(m)
		}
	})
}

// classOf is a request's flow-control class (flowcontrol.Request.Class): requests with the same
// buckets and affinity keys meet the same saturation.
func classOf(buckets []*bucket.Bucket, req *bucket.Request) uint64 {
	var h maphash.Hash
	seedBuckets(&h, buckets)
	h.WriteByte(1)
	h.WriteString(req.SessionKey)
	h.WriteByte(0)
	h.WriteString(req.RoutingKey)
	return h.Sum64()
}

// seedBuckets seeds h for a flow-control class and writes the buckets' IDs.
func seedBuckets(h *maphash.Hash, buckets []*bucket.Bucket) {
	h.SetSeed(classSeed)
	for _, b := range buckets {
		h.WriteString(b.ID())
		h.WriteByte(0)
	}
}

// refusalClass is the flow-control class of a refusal by admission: requests of the same buckets
// whose selections the same engines rejected meet the same saturation, whatever their prompts and
// affinity keys. It differs from every classOf.
func refusalClass(buckets []*bucket.Bucket, rejections []*policy.AdmissionRejectedError) uint64 {
	var buf [16]state.EngineID
	ids := buf[:0]
	for _, r := range rejections {
		ids = append(ids, r.Engine.ID())
	}
	slices.Sort(ids)
	var h maphash.Hash
	seedBuckets(&h, buckets)
	h.WriteByte(2)
	for i, id := range slices.Compact(ids) {
		if i > 0 {
			h.WriteByte(0)
		}
		h.WriteString(string(id))
	}
	return h.Sum64()
}

var classSeed = maphash.MakeSeed()

// cost is the service a request receives, in tokens: its expected peak (prompt + output budget)
// when known, else its prompt.
func cost(req *bucket.Request) uint64 {
	if req.HasExpectedPeak {
		return uint64(max(req.ExpectedPeakTokens, 0))
	}
	return uint64(max(req.InputTokens, 0))
}

// notify wakes the model's waiting requests, under flow control.
func (r *Router) notify(model state.ModelID) {
	if r != nil && r.fc != nil {
		r.fc.Notify(model)
	}
}

// maxSelectAttempts bounds how often Select runs the bucket loop again after concurrent
// selections took an admitted engine to its in-flight cap first.
const maxSelectAttempts = 4

// acquire counts a pick's dispatch on its engine (and DP rank), under the in-flight cap the pick
// was admitted under if any, less the top band's last slot for a request below it (held:
// flowbridge.HeldCap). When the cap has been reached since the check, it acquires nothing
// and returns the rejection admission would now give (limit flowbridge.LimitTopBandSlot when only
// the top band's slot is left).
func (r *Router) acquire(p *policy.Pick, prefillTokens uint64, held bool, now time.Time) (*loadmon.Guard, *policy.AdmissionRejectedError) {
	id := p.Engine.ID()
	limit := uint64(math.MaxUint64) // no cap
	if p.HasInFlightCap {
		limit = p.InFlightCap
		if held {
			limit = flowbridge.HeldCap(limit) // the last slot is the top band's
		}
	}
	g, n := r.inflight.TryAcquire(id, rankOf(p), prefillTokens, limit, now)
	if g == nil {
		name := admission.LimitInFlightRequests
		if limit < p.InFlightCap && n < p.InFlightCap {
			name = flowbridge.LimitTopBandSlot
		}
		return nil, &policy.AdmissionRejectedError{Engine: p.Engine, Limit: name, Observed: n, Cap: p.InFlightCap}
	}
	return g, nil
}

// rankOf is the DP rank a pick names, −1 when none (loadmon.InFlight.TryAcquire counts the engine
// only).
func rankOf(p *policy.Pick) int {
	if p.HasDPRank {
		return p.DPRank
	}
	return -1
}

// prefillTokens is the prefill work a dispatch brings: the policy's estimate, else the whole input.
func prefillTokens(p *policy.Pick, req *bucket.Request) uint64 {
	if p.PrefillTokens > 0 {
		return p.PrefillTokens
	}
	return uint64(max(req.InputTokens, 0))
}

// RemoveEngine forgets router-side state of an engine the host removed from its registry: its
// load reports (when Options.Load is set), its blocks in the prefix index (when Options.Index is
// set), its affinity bindings (when Options.AffinityStore is set; a remote store is asked without
// a deadline, and its failure is ignored: a binding to an engine that is no candidate never wins,
// docs/design.md §12) and its in-flight counter. Guards of requests still running release safely
// into the detached counter. Removing an engine the router never heard of does nothing.
func (r *Router) RemoveEngine(id state.EngineID) {
	if r.store != nil {
		_, _ = r.store.InvalidateEngine(context.Background(), id)
	}
	if r.load != nil {
		r.load.Forget(id)
	}
	if r.index != nil {
		_ = r.index.RemoveEngine(id) // an engine with no blocks is not an error here
	}
	r.inflight.Remove(id)
	for _, m := range r.models {
		r.notify(m)
	}
}

// Resolver returns the model's resolver, or false for a model the Router does not serve.
func (r *Router) Resolver(model state.ModelID) (*bucket.Resolver, bool) {
	res, ok := r.resolvers[model]
	return res, ok
}

// Registry returns the engine registry the Router selects from.
func (r *Router) Registry() state.Registry { return r.registry }

// Models returns the served models, in Options.Models order (sorted by ID without it). The slice
// is shared; do not modify it.
func (r *Router) Models() []state.ModelID { return r.models }

// LoadTable returns the shared engine-reported load table (Options.Load); nil without one. Hosts
// report load into it (Table.Report) unless a poller does.
func (r *Router) LoadTable() *loadmon.Table { return r.load }

// InFlight returns the router-local in-flight counters.
func (r *Router) InFlight() *loadmon.InFlight { return r.inflight }

// Index returns the shared KV-block index; nil when no policy looks prefixes up locally. Hosts
// apply their engines' KV events to it.
func (r *Router) Index() *kvindex.Index { return r.index }

// AffinityStore returns Options.AffinityStore: the store session_aware and sticky policies share;
// nil when none was given.
func (r *Router) AffinityStore() affinity.Store { return r.store }
