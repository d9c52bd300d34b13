package metrics

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/config"
	"github.com/enginepick/enginepick/flowcontrol"
	"github.com/enginepick/enginepick/internal/flowbridge"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/internal/peersync/redispeer"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// defaultNamespace prefixes every metric name.
const defaultNamespace = "enginepick"

// overlapBlockBuckets are the buckets of the diverted and forfeited prefix histograms, in blocks:
// powers of two up to 8192, as the experimental SGLang router's OVERLAP_BLOCK_BUCKETS (about 16
// to 512K tokens at 16 to 64 tokens per block).
var overlapBlockBuckets = []float64{1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192}

// selectionSecondsBuckets are the buckets of the selection latency histogram: 1 µs to about
// 16 ms, ×4 per bucket (a local pick is microseconds; a remote prefix lookup up to its 100 ms
// deadline lands in +Inf).
var selectionSecondsBuckets = prometheus.ExponentialBuckets(1e-6, 4, 8)

// requestSecondsBuckets are the buckets of the TTFT and end-to-end histograms: 10 ms to about
// 330 s, ×2 per bucket.
var requestSecondsBuckets = prometheus.ExponentialBuckets(0.01, 2, 16)

// defaultSelectTimingEvery is how many selections share one observation of
// selection_duration_seconds by default: the Router times one Router.Select in 8, at random, so
// that timing costs a cheap pick little; selections_total and selection_failures_total still
// count every selection.
const defaultSelectTimingEvery = 8

// Options configures New. The zero value is the default.
type Options struct {
	// Namespace prefixes every metric name; empty means "enginepick".
	Namespace string
	// SelectTimingEvery is N: selection_duration_seconds observes one Router.Select in N, chosen
	// at random (enginepick.SelectTimingSampler), so its _count is about 1/N of the selections.
	// 1 times every selection; 0 means 8; negative is an error.
	SelectTimingEvery int
}

// observer is the Observer New returns.
type observer struct {
	decisions        *prometheus.CounterVec
	selections       *prometheus.CounterVec
	selectFailures   *prometheus.CounterVec
	selectSeconds    *prometheus.HistogramVec
	cacheDecisions   *prometheus.CounterVec
	diverted         *prometheus.HistogramVec
	forfeited        *prometheus.HistogramVec
	gateRejections   *prometheus.CounterVec
	guardOverrides   *prometheus.CounterVec
	admissionRejects *prometheus.CounterVec
	ttft             *prometheus.HistogramVec
	e2e              *prometheus.HistogramVec
	dispatchFailures *prometheus.CounterVec
	promptTokens     *prometheus.CounterVec
	cachedTokens     *prometheus.CounterVec
	outputTokens     *prometheus.CounterVec
	timeEvery        int // one Router.Select in timeEvery is timed (SelectTimingSampler)
	state            *stateCollector
	flow             *flowMetrics

	mu      sync.Mutex                                    // serializes writers of models and engines
	models  atomic.Pointer[map[state.ModelID]*modelObs]   // copy on write
	engines sync.Map                                      // engineKey → *engineObs
	buckets atomic.Pointer[map[*bucket.Bucket]*bucketObs] // by the bucket itself, set by AttachRouter
}

// modelObs holds one model's pre-resolved series.
type modelObs struct {
	selectSeconds prometheus.Observer
	failures      map[string]prometheus.Counter // by failure reason
	buckets       map[string]prometheus.Counter // selections by bucket
	dispatchFail  map[string]prometheus.Counter // by failure reason
	cache         atomic.Pointer[cacheObs]      // nil until the model has a cache-aware group
}

// bucketObs holds the series a successful selection from one bucket updates.
type bucketObs struct {
	selectSeconds prometheus.Observer
	selections    prometheus.Counter
}

// cacheObs holds one model's cache-aware series.
type cacheObs struct {
	decisions [len(label.Decisions)]prometheus.Counter // by cache decision, in label.Decisions order
	diverted  prometheus.Observer
	forfeited prometheus.Observer
	gate      prometheus.Counter
	guard     prometheus.Counter
}

var limitLabels = [...]string{admission.LimitRunningRequests, admission.LimitWaitingRequests, admission.LimitKVTokens,
	admission.LimitPendingPrefillTokens, admission.LimitInFlightRequests, flowbridge.LimitPrefilling, flowbridge.LimitTopBandSlot}

// limitOther labels rejections by a custom admission.Checker's limit, whose names are not bounded.
const limitOther = "other"

var (
	_ enginepick.Observer   = (*observer)(nil)
	_ config.RouterAttacher = (*observer)(nil)
	_ policy.CacheObserver  = (*observer)(nil)
	_ interface {
		BorrowCacheDecision(*policy.CacheDecision)
	} = (*observer)(nil)
	_ enginepick.SelectTimingSampler = (*observer)(nil)
	_ interface {
		ObserveReplicas(*redispeer.Peer) // config.New's
	} = (*observer)(nil)
	_ flowcontrol.Observer = (*observer)(nil)
)

// New creates the metric families, registers them on reg and returns an enginepick.Observer that
// exports a Router's decisions, dispatch outcomes and shared state as Prometheus metrics
// (docs/design.md §15). Pass it to config.New with config.WithObserver; one observer serves one
// Router. It also implements policy.CacheObserver (the cache-aware decisions),
// config.RouterAttacher (the Router's shared state, read at each scrape; attaching a second Router
// is an error), enginepick.SelectTimingSampler (Options.SelectTimingEvery) and
// flowcontrol.Observer (flow control's queue, which config.New connects; a host building its
// Controller sets flowcontrol.Config.Observer to it). Safe for concurrent use.
//
// Errors: a nil reg or a negative opts.SelectTimingEvery (wrapping
// state.ErrInvalidConfiguration), or reg's registration error (a family already registered, say),
// wrapped.
func New(reg prometheus.Registerer, opts Options) (enginepick.Observer, error) {
	if reg == nil {
		return nil, fmt.Errorf("metrics: nil Registerer: %w", state.ErrInvalidConfiguration)
	}
	if opts.SelectTimingEvery < 0 {
		return nil, fmt.Errorf("metrics: Options.SelectTimingEvery %d is negative (1 times every selection, 0 means %d): %w",
			opts.SelectTimingEvery, defaultSelectTimingEvery, state.ErrInvalidConfiguration)
	}
	timeEvery := opts.SelectTimingEvery
	if timeEvery == 0 {
		timeEvery = defaultSelectTimingEvery
	}
	ns := opts.Namespace
	if ns == "" {
		ns = defaultNamespace
	}
	counter := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: name, Help: help}, labels)
	}
	histogram := func(name, help string, buckets []float64, labels ...string) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: name, Help: help, Buckets: buckets}, labels)
	}
	p := &observer{timeEvery: timeEvery,
		decisions: counter("decisions_total",
			"Picks that selected an engine, by model, bucket, stage, policy and reason label (a pick of a PD attempt whose other stage failed included).",
			"model_id", "bucket", "stage", "policy", "reason"),
		selections: counter("selections_total",
			"Router.Select calls that returned a complete selection, by model and bucket.", "model_id", "bucket"),
		selectFailures: counter("selection_failures_total",
			"Router.Select calls that failed, by model (empty for an unknown model) and reason.", "model_id", "reason"),
		selectSeconds: histogram("selection_duration_seconds",
			"Time Router.Select took, successful or not, by model, for a random sample of selections (one in Options.SelectTimingEvery, 8 by default); selections_total and selection_failures_total count them all.",
			selectionSecondsBuckets, "model_id"),
		cacheDecisions: counter("cache_aware_decisions_total",
			"Cache-aware picks that selected an engine, by decision label (cache_hit, cache_miss, cache_worker_queued, all_queued, cost_diverted); they sum to the cache_aware picks of decisions_total.",
			"model_id", "decision"),
		diverted: histogram("diverted_overlap_blocks",
			"Prefix depth, in blocks, of the deepest holder the queue gate diverted away from on a cache_worker_queued decision.",
			overlapBlockBuckets, "model_id"),
		forfeited: histogram("partially_diverted_overlap_blocks",
			"Prefix, in blocks, given up by a partial diversion: a cache_hit whose winner holds fewer blocks than the deepest holder the queue gate set aside.",
			overlapBlockBuckets, "model_id"),
		gateRejections: counter("queue_gate_rejections_total",
			"Prefix holders the cache-aware queue gate set aside, over picks that selected an engine.", "model_id"),
		guardOverrides: counter("pressure_guard_overrides_total",
			"Times the cache-aware pressure guard replaced a holder with a less pressured one.", "model_id"),
		admissionRejects: counter("admission_rejections_total",
			"Admission rejections met by policies, by model, stage and limit (prefilling and top_band_slot for flow control's holds, other for a custom checker's limit).",
			"model_id", "stage", "limit"),
		ttft: histogram("ttft_seconds",
			"Time to first token of dispatches the host reported with Dispatch.Done, by dispatched engine, stage and policy.",
			requestSecondsBuckets, "model_id", "engine", "stage", "policy"),
		e2e: histogram("request_duration_seconds",
			"Time from selection to Dispatch.Done, by dispatched engine, stage and policy.",
			requestSecondsBuckets, "model_id", "engine", "stage", "policy"),
		dispatchFailures: counter("dispatch_failures_total",
			"Dispatches the host reported failed with Dispatch.Done, by model and reason.", "model_id", "reason"),
		promptTokens: counter("prompt_tokens_total",
			"Prompt tokens of dispatches reported with Dispatch.Done, by plain or prefill engine and whether the engine reported cached tokens.",
			"model_id", "engine", "cached_reported"),
		cachedTokens: counter("cached_prompt_tokens_total",
			"Prompt tokens engines reported serving from their prefix cache; divide by prompt_tokens_total{cached_reported=\"true\"} for the engines' hit rate.",
			"model_id", "engine"),
		outputTokens: counter("output_tokens_total",
			"Output tokens of dispatches reported with Dispatch.Done, by decode or plain engine.", "model_id", "engine"),
	}
	p.state = newStateCollector(ns)
	p.flow = newFlowMetrics(ns)
	p.models.Store(&map[state.ModelID]*modelObs{})
	for _, c := range []prometheus.Collector{p.decisions, p.selections, p.selectFailures, p.selectSeconds, p.cacheDecisions,
		p.diverted, p.forfeited, p.gateRejections, p.guardOverrides, p.admissionRejects, p.ttft, p.e2e, p.dispatchFailures,
		p.promptTokens, p.cachedTokens, p.outputTokens, p.state, p.flow.queued, p.flow.wait, p.flow.requests} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("metrics: register: %w", err)
		}
	}
	return p, nil
}

// model returns the model's series, creating them on first use.
func (p *observer) model(m state.ModelID) *modelObs {
	if mo := (*p.models.Load())[m]; mo != nil {
		return mo
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	old := *p.models.Load()
	if mo := old[m]; mo != nil {
		return mo
	}
	id := string(m)
	mo := &modelObs{
		selectSeconds: p.selectSeconds.WithLabelValues(id),
		failures:      map[string]prometheus.Counter{},
		buckets:       map[string]prometheus.Counter{},
		dispatchFail:  map[string]prometheus.Counter{},
	}
	for _, r := range label.Failures {
		mo.failures[r] = p.selectFailures.WithLabelValues(id, r)
		mo.dispatchFail[r] = p.dispatchFailures.WithLabelValues(id, r)
	}
	next := make(map[state.ModelID]*modelObs, len(old)+1)
	for k, v := range old {
		next[k] = v
	}
	next[m] = mo
	p.models.Store(&next)
	return mo
}

// cacheModel returns the model's cache-aware series, creating them on first use.
func (p *observer) cacheModel(m state.ModelID) *cacheObs {
	mo := p.model(m)
	if co := mo.cache.Load(); co != nil {
		return co
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	mo = (*p.models.Load())[m] // the current version: addBucket may have replaced it
	if co := mo.cache.Load(); co != nil {
		return co
	}
	id := string(m)
	co := &cacheObs{diverted: p.diverted.WithLabelValues(id), forfeited: p.forfeited.WithLabelValues(id),
		gate: p.gateRejections.WithLabelValues(id), guard: p.guardOverrides.WithLabelValues(id)}
	for i, d := range label.Decisions {
		co.decisions[i] = p.cacheDecisions.WithLabelValues(id, d)
	}
	mo.cache.Store(co)
	return co
}

// addBucket pre-resolves a bucket's selection counter (copy on write of the model's series).
func (p *observer) addBucket(m state.ModelID, bucketID string) {
	p.model(m)
	p.mu.Lock()
	defer p.mu.Unlock()
	mo := (*p.models.Load())[m]
	if _, ok := mo.buckets[bucketID]; ok {
		return
	}
	next := &modelObs{selectSeconds: mo.selectSeconds, failures: mo.failures, dispatchFail: mo.dispatchFail}
	next.cache.Store(mo.cache.Load())
	next.buckets = make(map[string]prometheus.Counter, len(mo.buckets)+1)
	for k, v := range mo.buckets {
		next.buckets[k] = v
	}
	next.buckets[bucketID] = p.selections.WithLabelValues(string(m), bucketID)
	models := *p.models.Load()
	nm := make(map[state.ModelID]*modelObs, len(models))
	for k, v := range models {
		nm[k] = v
	}
	nm[m] = next
	p.models.Store(&nm)
}

// groupObs counts one group's picks with pre-resolved series.
type groupObs struct {
	p       *observer
	labels  [4]string // model, bucket, stage, policy
	reasons atomic.Pointer[[]reasonCounter]
	limits  [len(limitLabels) + 1]prometheus.Counter // limitLabels order, then limitOther
	mu      sync.Mutex
}

type reasonCounter struct {
	reason string
	c      prometheus.Counter
}

// ObserveGroup implements enginepick.Observer: it pre-resolves the group's series (each reason its
// policy produces, each admission limit) and the model's and bucket's.
func (p *observer) ObserveGroup(g enginepick.GroupInfo) enginepick.PickObserver {
	p.addBucket(g.Model, g.Bucket)
	if g.Policy == label.CacheAware {
		p.cacheModel(g.Model)
	}
	o := &groupObs{p: p, labels: [4]string{string(g.Model), g.Bucket, g.Stage.String(), g.Policy}}
	rs := make([]reasonCounter, 0, 4)
	for _, r := range label.Reasons[g.Policy] {
		rs = append(rs, reasonCounter{r, p.decisions.WithLabelValues(o.labels[0], o.labels[1], o.labels[2], o.labels[3], r)})
	}
	o.reasons.Store(&rs)
	for i, l := range limitLabels {
		o.limits[i] = p.admissionRejects.WithLabelValues(o.labels[0], o.labels[2], l)
	}
	o.limits[len(limitLabels)] = p.admissionRejects.WithLabelValues(o.labels[0], o.labels[2], limitOther)
	return o
}

// ObservePick implements enginepick.PickObserver.
func (o *groupObs) ObservePick(pk policy.Pick, err error) {
	if err == nil {
		o.reason(pk.Reason).Inc()
		return
	}
	o.rejections(err)
}

// reason returns the counter of a reason label, adding it on first use.
func (o *groupObs) reason(r string) prometheus.Counter {
	for _, rc := range *o.reasons.Load() {
		if rc.reason == r {
			return rc.c
		}
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	old := *o.reasons.Load()
	for _, rc := range old {
		if rc.reason == r {
			return rc.c
		}
	}
	c := o.p.decisions.WithLabelValues(o.labels[0], o.labels[1], o.labels[2], o.labels[3], r)
	next := append(append(make([]reasonCounter, 0, len(old)+1), old...), reasonCounter{r, c})
	o.reasons.Store(&next)
	return c
}

// rejections counts every admission rejection in a policy error.
func (o *groupObs) rejections(err error) {
	switch e := err.(type) {
	case *policy.AdmissionRejectedError:
		o.limitCounter(e.Limit).Inc()
	case *policy.NoAdmissibleEngineError:
		for _, r := range e.Rejections {
			o.limitCounter(r.Limit).Inc()
		}
	case interface{ Unwrap() error }:
		if inner := e.Unwrap(); inner != nil {
			o.rejections(inner)
		}
	}
}

func (o *groupObs) limitCounter(limit string) prometheus.Counter {
	for i, l := range limitLabels {
		if l == limit {
			return o.limits[i]
		}
	}
	return o.limits[len(limitLabels)]
}

// ObserveSelect implements enginepick.Observer.
func (p *observer) ObserveSelect(e enginepick.SelectEvent) {
	if e.Selection != nil {
		if bs := p.buckets.Load(); bs != nil {
			if bo := (*bs)[e.Selection.Bucket]; bo != nil {
				if e.Timed {
					bo.selectSeconds.Observe(e.Duration.Seconds())
				}
				bo.selections.Inc()
				return
			}
		}
	}
	mo := p.model(e.Model)
	if e.Timed {
		mo.selectSeconds.Observe(e.Duration.Seconds())
	}
	if e.Selection != nil {
		if c := mo.buckets[e.Selection.Bucket.ID()]; c != nil {
			c.Inc()
		} else {
			p.selections.WithLabelValues(string(e.Model), e.Selection.Bucket.ID()).Inc()
		}
		return
	}
	if c := mo.failures[e.Reason]; c != nil {
		c.Inc()
	}
}

// SelectTimingEvery implements enginepick.SelectTimingSampler: Options.SelectTimingEvery, or
// defaultSelectTimingEvery.
func (p *observer) SelectTimingEvery() int { return p.timeEvery }

// BorrowCacheDecision is the borrowing form of ObserveCacheDecision (policy.CacheObserver): the
// decision is read during the call and nothing of it is kept, so a cache-aware pick passes its
// own record without a copy.
func (p *observer) BorrowCacheDecision(d *policy.CacheDecision) { p.ObserveCacheDecision(d) }

// ObserveCacheDecision implements policy.CacheObserver.
func (p *observer) ObserveCacheDecision(d *policy.CacheDecision) {
	mo := p.cacheModel(d.Model)
	for i, l := range label.Decisions {
		if l == d.Decision {
			mo.decisions[i].Inc()
			break
		}
	}
	if d.Decision == label.DecisionCacheWorkerQueued {
		mo.diverted.Observe(float64(d.DivertedBlocks))
	}
	if d.ForfeitedBlocks > 0 {
		mo.forfeited.Observe(float64(d.ForfeitedBlocks))
	}
	if d.GateRejected > 0 {
		mo.gate.Add(float64(d.GateRejected))
	}
	if d.GuardOverrides > 0 {
		mo.guard.Add(float64(d.GuardOverrides))
	}
}

// engineKey identifies one dispatched engine's outcome series.
type engineKey struct {
	model  state.ModelID
	engine state.EngineID
	stage  state.Stage
	policy string
}

type engineObs struct {
	ttft, e2e                 prometheus.Observer
	promptCached, promptPlain prometheus.Counter // cached_reported true / false
	cached, output            prometheus.Counter
}

func (p *observer) engine(k engineKey) *engineObs {
	if v, ok := p.engines.Load(k); ok {
		return v.(*engineObs)
	}
	m, e, s := string(k.model), string(k.engine), k.stage.String()
	o := &engineObs{
		ttft:         p.ttft.WithLabelValues(m, e, s, k.policy),
		e2e:          p.e2e.WithLabelValues(m, e, s, k.policy),
		promptCached: p.promptTokens.WithLabelValues(m, e, "true"),
		promptPlain:  p.promptTokens.WithLabelValues(m, e, "false"),
		cached:       p.cachedTokens.WithLabelValues(m, e),
		output:       p.outputTokens.WithLabelValues(m, e),
	}
	v, _ := p.engines.LoadOrStore(k, o)
	return v.(*engineObs)
}

// ObserveDone implements enginepick.Observer: the end-to-end histogram for every dispatched
// engine; on success the TTFT histogram for every dispatched engine when the host reported it;
// prompt and cached tokens on the plain or prefill engine, output tokens on the plain or decode
// engine; a failure by reason.
func (p *observer) ObserveDone(e enginepick.DoneEvent) {
	o := &e.Outcome
	for i, de := range e.Engines[:e.N] {
		eo := p.engine(engineKey{e.Model, de.ID, de.Stage, de.Policy})
		eo.e2e.Observe(e.Duration.Seconds())
		if o.Err == nil && o.TTFT > 0 {
			eo.ttft.Observe(o.TTFT.Seconds())
		}
		if i == 0 && o.PromptTokens > 0 {
			if o.CachedTokensReported {
				eo.promptCached.Add(float64(o.PromptTokens))
				eo.cached.Add(float64(o.CachedTokens))
			} else {
				eo.promptPlain.Add(float64(o.PromptTokens))
			}
		}
		if i == e.N-1 && o.OutputTokens > 0 {
			eo.output.Add(float64(o.OutputTokens))
		}
	}
	if o.Err != nil {
		if c := p.model(e.Model).dispatchFail[e.Reason]; c != nil {
			c.Inc()
		}
	}
}

// ObserveReplicas is called by config.New with the sharing of a replicas block: its counters are
// read at each scrape (replica_* metrics).
func (p *observer) ObserveReplicas(peer *redispeer.Peer) { p.state.replicas.Store(peer) }

// AttachRouter implements config.RouterAttacher: the Router's shared state (KV-block index,
// in-flight counters, load reports, load polls) is read at each scrape. Attaching a second Router
// is an error.
func (p *observer) AttachRouter(r *config.Router) error {
	if !p.state.router.CompareAndSwap(nil, r) {
		return fmt.Errorf("metrics: this Prometheus already observes a Router: %w", state.ErrInvalidConfiguration)
	}
	// Pre-resolve each bucket's series, keyed by the bucket itself, so that a successful
	// selection costs one pointer-keyed lookup.
	bs := map[*bucket.Bucket]*bucketObs{}
	for _, m := range r.Models() {
		res, ok := r.Resolver(m)
		if !ok {
			continue
		}
		for _, b := range res.Buckets() {
			bs[b] = &bucketObs{selectSeconds: p.selectSeconds.WithLabelValues(string(m)), selections: p.selections.WithLabelValues(string(m), b.ID())}
		}
	}
	p.buckets.Store(&bs)
	if fc := r.Config().FlowControl; fc != nil {
		p.flow.nameFlows(fc.FlowWeights)
	}
	return nil
}
