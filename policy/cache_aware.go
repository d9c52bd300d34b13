package policy

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/enginepick/enginepick/internal/flowbridge"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/internal/loadbridge"
	"github.com/enginepick/enginepick/internal/lora"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

// Cache-aware defaults (docs/design.md §9.1, §9.2, §9.6 and §9.7;
// the experimental SGLang router's defaults).
const (
	defaultCandidateMinEngines        = 8
	defaultCandidateRatio             = 0.05
	defaultCandidateMaxEngines        = 32
	defaultSwitchMarginTokens         = 1024
	defaultPressureAbsThresholdTokens = 1024
	defaultPressureRelThreshold       = 1.5
	defaultMinLoadChoices             = 2
	// defaultCostMarginTokens and defaultRecomputeFactor are the cost comparison's thresholds
	// (docs/design.md §9.11): an alternative replaces the chosen engine only when it saves more
	// than 1,024 tokens of prefill work and more than twice the prefill it adds by recomputing
	// a prefix the chosen engine holds, the factor weighed by the share of busy engines
	// (docs/design-notes.md "Cost comparison").
	defaultCostMarginTokens = 1024
	defaultRecomputeFactor  = 2.0
)

// Prefill pressure sources of a cache-aware decision (docs/design.md §9.8): CacheDecision.PressureSource.
const (
	pressureSourceQueueTime   = "estimated_prefill_queue_ms"
	pressureSourceNativeQueue = "native_queue_tokens"
	// pressureSourceEstimatedQueue: the guard compared pending prefill tokens, estimated from
	// reported waiting requests for the holders without native figures (as vLLM's /metrics gives;
	// docs/design.md §9.7).
	pressureSourceEstimatedQueue = "estimated_queue_tokens"
	pressureSourceRouterLocal    = "router_local"
)

// CacheDecision is the audit of one cache-aware pick that selected an engine. It does not affect
// selection; it is what a metrics backend records.
type CacheDecision struct {
	// Model and BucketID scope the decision.
	Model    state.ModelID
	BucketID string
	// Decision is the label of the cache_aware_decisions_total metric (docs/design.md §9.8):
	// cache_hit when a prefix holder was selected (reason cache_candidate, including after an
	// all-queued re-admission, or saturation_pin); cost_diverted when the cost comparison sent
	// the request to a non-holder (docs/design.md §9.11); for a fallback pick (reason
	// no_cache_candidate), cache_miss when no holder was gate-rejected or holders reached
	// admission, all_queued when the fleet was all queued (not spelled cache_hit_*, so that a
	// hit-rate query does not absorb a saturated fleet), otherwise cache_worker_queued.
	Decision string
	// Reason is the pick's reason label.
	Reason string
	// DivertedBlocks is the prefix, in blocks, that the decision gave up: for
	// cache_worker_queued the deepest prefix the queue gate set aside
	// (sgl_router_diverted_overlap_blocks), for cost_diverted the blocks of the holder the
	// cost comparison passed over minus those of the engine it chose (docs/design.md §9.11); 0
	// otherwise.
	DivertedBlocks int
	// ForfeitedBlocks is the prefix, in blocks, that a partial diversion gave up: on a
	// cache_hit whose winner holds fewer blocks than the deepest holder the queue gate set
	// aside, that holder's blocks minus the winner's; 0 otherwise. A hit-rate panel cannot see
	// these diversions (docs/design.md §9.8, §15).
	ForfeitedBlocks int
	// Evaluated counts the candidates that reached hard admission; GateRejected those the queue
	// gate removed (disjoint).
	Evaluated    int
	GateRejected int
	// FleetAllQueued reports whether every group engine had a fresh sample at or over the limit.
	FleetAllQueued bool
	// GuardCompared and GuardOverrides count pressure-guard pair comparisons and overrides.
	GuardCompared  int
	GuardOverrides int
	// CostOverride reports whether the cost comparison (docs/design.md §9.11) replaced the engine
	// the other rules chose: with another holder (cache_hit), a non-holder
	// (cost_diverted) or, on a miss, a cheaper engine than the power-of-k sample's.
	CostOverride bool
	// PressureSource is what the pressure guard compared: "estimated_prefill_queue_ms",
	// "native_queue_tokens", "estimated_queue_tokens" (estimated from reported waiting
	// requests), or "router_local" (router-local in-flight figures only).
	PressureSource string
	// Lookup is how the prefix lookup ended (kvindex outcome).
	Lookup kvindex.Outcome
}

// CacheObserver receives every CacheDecision. It is called on the pick path, synchronously: keep
// it cheap and non-blocking. Implementations must be safe for concurrent use. d is the observer's
// own copy, which it may keep.
//
// An observer that also has the method BorrowCacheDecision(d *CacheDecision) is called through it
// instead, with the pick's reused record rather than a copy: d is valid only until the call
// returns.
type CacheObserver interface {
	ObserveCacheDecision(d *CacheDecision)
}

// cacheDecisionBorrower is a CacheObserver that reads each decision during the call only (see
// CacheObserver).
type cacheDecisionBorrower interface {
	CacheObserver
	BorrowCacheDecision(d *CacheDecision)
}

// CacheAwareOptions configures NewCacheAware. The zero value of every field is its documented
// default; pointer fields distinguish "unset" from an explicit zero.
type CacheAwareOptions struct {
	// Source answers prefix lookups (local index or remote indexer). Required.
	Source kvindex.Source
	// MinMatchedTokens is the hit gate: an engine's matched prefix must reach this many tokens
	// to count as a hit; a shorter match is a miss for every rule, the cost comparison included
	// (docs/design.md §9.1). 0 means the default gate, a fifth of the prompt: ⌈input tokens ÷ 5⌉.
	MinMatchedTokens uint64
	// MinMatchRatio optionally also requires matched ÷ input tokens ≥ this ratio. 0 means unset;
	// otherwise it must be in (0, 1].
	MinMatchRatio float64
	// CandidateMinEngines, CandidateRatio and CandidateMaxEngines bound how many prefix holders
	// reach the queue gate and admission: limit = min(n, max, max(min, ceil(ratio × n))) for a
	// group of n engines, applied before admission. Zero means 8, 0.05 and 32. min must be
	// ≤ max; ratio in [0, 1].
	CandidateMinEngines int
	CandidateRatio      float64
	CandidateMaxEngines int
	// SwitchMarginTokens is the near-tie window: a holder with at most this many more uncached
	// tokens than the best may win on pressure. Nil means 1,024;
	// an explicit 0 disables switching.
	SwitchMarginTokens *uint64
	// DisablePressureGuard turns the pressure guard off: the least uncached holder always wins.
	DisablePressureGuard bool
	// PressureAbsThresholdTokens and PressureRelThreshold define "materially more pressured" on
	// waiting uncached tokens: A − B > abs AND A > B × rel. Zero means 1024 tokens and 1.5; rel
	// must be finite and > 1.
	PressureAbsThresholdTokens uint64
	PressureRelThreshold       float64
	// PressureAbsThreshold, when > 0, compares estimated prefill queue times instead when both
	// engines have one: A − B > abs AND A > B × rel. 0 means unset; negative is invalid.
	PressureAbsThreshold time.Duration
	// EngineQueueLimit is the soft queue gate: a prefix holder whose fresh waiting-request count,
	// with the dispatches since the report, is ≥ the limit is diverted (unknown passes while its
	// in-flight count is below the limit: the gate fails open). Nil leaves the gate on running
	// slots (once a holder has a full round queued for its running slots, engines without a free
	// slot are set aside) and, for a request for a LoRA adapter, on engines where the adapter
	// would wait for a slot (docs/design.md §18); 0 is invalid (docs/design.md §9.3).
	EngineQueueLimit *uint64
	// SaturationQueueFloor pins a gate-rejected holder when no group engine has a fresh queue
	// strictly below the floor (unknown is not idle). Nil disables; requires EngineQueueLimit and
	// must be in [1, limit].
	SaturationQueueFloor *uint64
	// DisableRoutePlacements turns route-time placements off (docs/design.md §9.10). By default,
	// when Source implements kvindex.Placer (a kvindex.LocalSource does), every pick that selected
	// an engine records the prompt's blocks for it as approximate entries, so that requests
	// arriving before the engine has prefilled the prompt and published BlockStored see the
	// placement; the engine's real events supersede them and unconfirmed ones expire after the
	// index's ApproxTTL. A PD prefill pick is recorded even if its decode pick then fails.
	DisableRoutePlacements bool
	// DisableCostComparison turns the cost comparison off (docs/design.md §9.11): the holder the
	// upstream rules choose always wins, a miss goes to the power-of-k sample's winner, and a
	// request whose holders admission rejected fails rather than go to an idle engine. Off,
	// every engine holding a shared prefix above MinMatchedTokens (a long system prompt) keeps
	// absorbing the traffic however long its queue.
	DisableCostComparison bool
	// CostMarginTokens is the saving, in tokens of prefill work, that an alternative must exceed
	// to replace the chosen engine in the cost comparison, and, for a request for a LoRA adapter,
	// how much more than the cheapest engine an engine of a better residency class may cost and
	// still take it (docs/design.md §18). Nil means 1,024; 0 is allowed.
	CostMarginTokens *uint64
	// RecomputeFactor is how many times the extra prefill an alternative causes (its uncached
	// tokens minus the chosen engine's) its saving must also exceed when every engine the
	// comparison priced has pending prefill work; it is weighed by the share of those engines
	// that do, so on an otherwise idle fleet only CostMarginTokens applies (docs/design.md
	// §9.11). 0 means 2; otherwise it must be finite and > 0.
	RecomputeFactor float64
	// MinLoadChoices is k of the miss fallback's power-of-k, which it uses while another router
	// sends to the group unseen (docs/design.md §9.9); otherwise, and with k ≥ group size, it
	// takes the least pressured engine. 0 means 2.
	MinLoadChoices int
	// Observer receives one CacheDecision per pick that selected an engine. Nil means none.
	Observer CacheObserver
	// Logger receives the sampled "queue gate is inert" warning. Nil means zap.NewNop().
	Logger *zap.Logger
}

// cacheAware is the cache-aware policy (NewCacheAware).
type cacheAware struct {
	cfg  Config
	opts CacheAwareOptions

	placer     kvindex.Placer        // nil: no route-time placements
	borrower   cacheDecisionBorrower // opts.Observer when it borrows decisions; nil otherwise
	margin     uint64
	costMargin uint64
	// alwaysScan turns off the cost comparison's shortcut (cheaper) and costScanHook runs before
	// each scan of the group: tests only (export_test.go).
	alwaysScan   bool
	costScanHook func()
	shareGate    bool   // MinMatchedTokens was unset: the gate is a fifth of the prompt
	queueCap     uint64 // 0 = gate off
	floor        uint64 // 0 = off
	blind        atomic.Uint64
	picks        atomic.Uint64 // picks so far: where each pick's tie order starts (tieOrder)
	log          *zap.Logger
	// scratch pools a pick's lookup result and decision record (*pickScratch), so that a pick
	// allocates nothing for them.
	scratch sync.Pool
}

// pickScratch is one pick's working memory: the lookup result, the buffers lent to the source
// for it when the pick makes its own lookup (no Memo), and the decision record (an observer
// gets a copy, or borrows it: cacheDecisionBorrower), and the pick's candidate lists and lookup
// view. It is pooled so that a pick neither allocates nor zeroes this memory.
type pickScratch struct {
	res  kvindex.Result
	bufs kvindex.LookupBuffers
	d    CacheDecision
	view lookupBuf
	// Candidate lists, each at most as long as the lookup result: the holders candidates
	// scans, the ones it keeps, and the queue gate's and admission's parts of those.
	all, cands, gated, admitted []cacheCandidate
}

var (
	_ Policy         = (*cacheAware)(nil)
	_ stageSupporter = (*cacheAware)(nil)
)

// inertWarnSample is the sampling of the "queue gate is inert" warning: one in 64
// (docs/design.md §9.3).
const inertWarnSample = 64

// NewCacheAware returns the cache-aware policy. It sends a plain or prefill request to an engine that already holds its prompt prefix,
// without hot-spotting and without bypassing admission (docs/design.md §9). Per pick:
//
//  1. Look up prefix ownership (memoized per request through Request.Memo), then capture one load
//     snapshot.
//  2. Keep group engines whose matched tokens pass the hit gate; rank by uncached tokens, then ID;
//     keep the first limit (candidate bounds) — before any admission.
//  3. Soft queue gate: holders with a fresh waiting count (with the dispatches since the report)
//     ≥ EngineQueueLimit, and, for a request for a LoRA adapter, holders where it would wait for
//     an adapter slot, are set aside. If that empties the set and every group engine has a fresh
//     sample at or over the limit, or is set aside for the adapter (and no saturation floor is
//     set), they are re-admitted.
//  4. Hard admission on every remaining holder, once each.
//  5. Winner: the least uncached admitted holder; a holder within SwitchMarginTokens of it replaces
//     it when the incumbent is materially more pressured and every evaluated holder has a fresh
//     report (the pressure guard). Reason cache_candidate.
//  6. No admitted holder: with a saturation floor, gate-rejected holders and no fresh group queue
//     below the floor, the least pressured gate-rejected holder that passes admission is pinned
//     (saturation_pin). Otherwise, if admission rejected any holder, an idle group engine takes
//     the request, else the cheapest group engine admission admits (no_cache_candidate; neither
//     with DisableCostComparison), else the pick fails with *NoAdmissibleEngineError naming every
//     rejected engine: a hard rejection never bypasses admission. For a request flow control
//     holds off engines still prefilling a dispatch of the router (below its top band), those
//     engines are rejected too (docs/design.md §17).
//  7. Miss: power-of-k over the group's unqueued engines (all engines when none is unqueued), then
//     one admission check on its pick (no_cache_candidate; rejection → *AdmissionRejectedError).
//
// Decode groups are rejected (its SupportsStage; a decode pick returns ErrInvalidConfiguration).
// The policy reads reported load (ReadsReportedLoad) when the queue gate is on.
//
// NewCacheAware fills defaults and validates every option (docs/design.md §9 and §14). Errors: an
// *OptionError naming the invalid option, or an error wrapping ErrInvalidConfiguration for a nil
// Config handle.
//
// Pick errors: ErrInvalidConfiguration on a decode request; ErrNoCandidates for no engines (no
// lookup is made); ErrInvalidSignal when req.TokenIDs is set and its length is not
// req.InputTokens, or when the source rejects the query; *NoAdmissibleEngineError when admission
// rejected every evaluated holder and every other group engine; *AdmissionRejectedError when the
// miss fallback's pick is rejected; a checker error.
func NewCacheAware(cfg Config, opts CacheAwareOptions) (Policy, error) {
	if err := cfg.validate(label.CacheAware); err != nil {
		return nil, err
	}
	if opts.Source == nil {
		return nil, optionErr(label.CacheAware, "Source", state.ErrMissingField, "required")
	}
	p, err := opts.resolve()
	if err != nil {
		return nil, err
	}
	p.cfg = cfg
	return p, nil
}

// resolve fills the options' defaults, validates them and returns the policy without its Config.
// Every rule on the options is here, once: NewCacheAware and the configuration's cache_aware block
// both apply it.
func (opts CacheAwareOptions) resolve() (*cacheAware, error) {
	bad := func(field string, v any, rule string) error {
		return optionErr(label.CacheAware, field, state.ErrOutOfRange, "%v: %s", v, rule)
	}
	shareGate := opts.MinMatchedTokens == 0
	if r := opts.MinMatchRatio; r != 0 && !(r > 0 && r <= 1) {
		return nil, bad("MinMatchRatio", r, "must be in (0, 1]")
	}
	if opts.CandidateMinEngines == 0 {
		opts.CandidateMinEngines = defaultCandidateMinEngines
	}
	if opts.CandidateMaxEngines == 0 {
		opts.CandidateMaxEngines = defaultCandidateMaxEngines
	}
	if opts.CandidateRatio == 0 {
		opts.CandidateRatio = defaultCandidateRatio
	}
	if opts.CandidateMinEngines < 1 {
		return nil, bad("CandidateMinEngines", opts.CandidateMinEngines, "must be >= 1")
	}
	if opts.CandidateMaxEngines < opts.CandidateMinEngines {
		return nil, bad("CandidateMaxEngines", opts.CandidateMaxEngines, "must be >= CandidateMinEngines")
	}
	if r := opts.CandidateRatio; !(r >= 0 && r <= 1) {
		return nil, bad("CandidateRatio", r, "must be in [0, 1]")
	}
	margin := uint64(defaultSwitchMarginTokens)
	if opts.SwitchMarginTokens != nil {
		margin = *opts.SwitchMarginTokens
	}
	if opts.PressureAbsThresholdTokens == 0 {
		opts.PressureAbsThresholdTokens = defaultPressureAbsThresholdTokens
	}
	if opts.PressureRelThreshold == 0 {
		opts.PressureRelThreshold = defaultPressureRelThreshold
	}
	if r := opts.PressureRelThreshold; !(r > 1) || math.IsInf(r, 1) {
		return nil, bad("PressureRelThreshold", r, "must be finite and > 1")
	}
	if opts.PressureAbsThreshold < 0 {
		return nil, bad("PressureAbsThreshold", opts.PressureAbsThreshold, "must be >= 0")
	}
	var queueCap, floor uint64
	if opts.EngineQueueLimit != nil {
		if *opts.EngineQueueLimit == 0 {
			return nil, bad("EngineQueueLimit", 0, "must be >= 1")
		}
		queueCap = *opts.EngineQueueLimit
	}
	if opts.SaturationQueueFloor != nil {
		f := *opts.SaturationQueueFloor
		if queueCap == 0 {
			return nil, optionErr(label.CacheAware, "SaturationQueueFloor", state.ErrConflict, "%v: requires EngineQueueLimit", f)
		}
		if f == 0 || f > queueCap {
			return nil, bad("SaturationQueueFloor", f, fmt.Sprintf("must be in [1, %d]", queueCap))
		}
		floor = f
	}
	if opts.MinLoadChoices == 0 {
		opts.MinLoadChoices = defaultMinLoadChoices
	}
	if opts.MinLoadChoices < 1 {
		return nil, bad("MinLoadChoices", opts.MinLoadChoices, "must be >= 1")
	}
	log := opts.Logger
	if log == nil {
		log = zap.NewNop()
	}
	costMargin := uint64(defaultCostMarginTokens)
	if opts.CostMarginTokens != nil {
		costMargin = *opts.CostMarginTokens
	}
	if opts.RecomputeFactor == 0 {
		opts.RecomputeFactor = defaultRecomputeFactor
	}
	if r := opts.RecomputeFactor; !(r > 0) || math.IsInf(r, 1) {
		return nil, bad("RecomputeFactor", r, "must be finite and > 0")
	}
	var placer kvindex.Placer
	if !opts.DisableRoutePlacements {
		placer, _ = opts.Source.(kvindex.Placer)
	}
	borrower, _ := opts.Observer.(cacheDecisionBorrower)
	return &cacheAware{opts: opts, placer: placer, borrower: borrower, margin: margin, costMargin: costMargin, shareGate: shareGate, queueCap: queueCap, floor: floor, log: log}, nil
}

// SupportsStage reports whether the policy serves stage s: plain and prefill only.
func (p *cacheAware) SupportsStage(s state.Stage) bool {
	return s == state.StagePlain || s == state.StagePrefill
}

// cacheCandidate is one prefix holder inside the group.
type cacheCandidate struct {
	idx      int // index in the candidates slice
	blocks   int
	uncached uint64
	obs      loadmon.Observation
	cap      inFlightCap // set when admitted
}

// Pick implements Policy (NewCacheAware).
func (p *cacheAware) Pick(ctx context.Context, engines []state.Engine, req *Request) (Pick, error) {
	if req == nil {
		return Pick{}, fmt.Errorf("policy: cache_aware: nil request: %w", ErrInvalidSignal)
	}
	if !p.SupportsStage(req.Stage) {
		return Pick{}, fmt.Errorf("policy: cache_aware: stage %s: %w", req.Stage, ErrInvalidConfiguration)
	}
	if req.TokenIDs != nil && uint64(len(req.TokenIDs)) != req.InputTokens {
		return Pick{}, fmt.Errorf("policy: cache_aware: input tokens %d but %d token IDs: %w",
			req.InputTokens, len(req.TokenIDs), ErrInvalidSignal)
	}
	if len(engines) == 0 {
		return Pick{}, ErrNoCandidates
	}
	sc, _ := p.scratch.Get().(*pickScratch)
	if sc == nil {
		sc = new(pickScratch)
	}
	defer p.release(sc)
	var bufs *kvindex.LookupBuffers
	if req.Memo == nil {
		// The result stays inside this pick (placement included), so its memory can be lent
		// and taken back; a Memo's result is shared and is not built in it.
		bufs = &sc.bufs
	}
	res := &sc.res
	var err error
	*res, err = p.lookup(ctx, req, bufs)
	if err != nil {
		return Pick{}, err
	}
	snap := p.cfg.Load.Snapshot() // after any remote I/O (docs/design.md §10)

	// Room for every holder in each list, so that no append below reallocates.
	n := len(res.Engines)
	sc.all, sc.cands = slices.Grow(sc.all[:0], n), slices.Grow(sc.cands[:0], n)
	sc.gated, sc.admitted = slices.Grow(sc.gated[:0], n), slices.Grow(sc.admitted[:0], n)
	v := newLookupView(&sc.view, engines, req, res, p.hitGate(req))
	v.tie = tieOrder{start: int((p.picks.Add(1) - 1) % uint64(len(engines))), n: len(engines)}
	cands := p.candidates(sc.cands, sc.all, engines, req, res, &v, snap)

	d := &sc.d
	*d = CacheDecision{Model: req.Model, BucketID: req.BucketID, Lookup: res.Outcome, PressureSource: pressureSourceRouterLocal}
	if p.queueCap != 0 {
		// Both answers are known once one engine is fresh and one is not queued (often the
		// first engine), so the scan stops there: O(1) per pick on a healthy fleet rather than a
		// load lookup per group engine (docs/performance.md, BenchmarkCacheAwareQueueGate).
		// A candidate's observation already carries its engine's load from this snapshot, in
		// the cache: a fresh, unqueued candidate answers both before any table lookup (the
		// answers do not depend on the order in which engines are read).
		d.FleetAllQueued = true
		anyFresh := false
		for i := range cands {
			if l := cands[i].obs.Load; l != nil && l.LeastRankWaitingRequests() < p.queueCap {
				anyFresh, d.FleetAllQueued = true, false
				break
			}
		}
		for _, e := range engines {
			if anyFresh && !d.FleetAllQueued {
				break
			}
			l, ok := snap.Load(e.ID())
			anyFresh = anyFresh || ok
			if !ok || l.LeastRankWaitingRequests() < p.queueCap {
				d.FleetAllQueued = false
			}
		}
		if !anyFresh && p.blind.Add(1)%inertWarnSample == 1 {
			if ce := p.log.Check(zap.WarnLevel, "engine queue limit is set but no engine of the group has a fresh load sample, so the queue gate is inert; check that engines publish load reports"); ce != nil {
				ce.Write(zap.String("model", string(req.Model)), zap.String("bucket", req.BucketID),
					zap.Uint64("engine_queue_limit", p.queueCap), zap.Int("engines", len(engines)))
			}
		}
	}

	// Queue gate: partition in place, evaluated first, keeping rank order in both parts. Without
	// EngineQueueLimit it acts on running slots once a holder has a full round queued (slots > 0;
	// docs/design.md §9.3), and then also keeps the miss fallback and the cost comparison off
	// engines without a free slot.
	var slots uint64
	if p.queueCap == 0 {
		slots = divertSlots(cands)
	}
	gate := p.gating(req) || slots > 0
	evaluated, gated := cands, cands[:0:0]
	bestGatedBlocks := 0
	readmitted := false
	if gate {
		gated = sc.gated
		kept := cands[:0]
		for _, c := range cands {
			if p.queued(&c.obs, slots) {
				gated = append(gated, c)
				bestGatedBlocks = max(bestGatedBlocks, c.blocks)
			} else {
				kept = append(kept, c)
			}
		}
		evaluated = kept
		if len(evaluated) == 0 && len(gated) > 0 && p.floor == 0 &&
			(d.FleetAllQueued || (req.Adapter != "" || slots > 0) && p.allQueued(engines, req, snap, slots)) {
			evaluated = append(evaluated, gated...) // all-queued re-admission
			readmitted = true
		}
	}
	d.Evaluated, d.GateRejected = len(evaluated), len(gated)

	// Hard admission on every evaluated holder.
	var rejections []*AdmissionRejectedError
	admitted := sc.admitted
	held := flowbridge.PrefillHold(ctx)
	for _, c := range evaluated {
		ic, err := p.admit(held, engines[c.idx], c.obs)
		var rej *AdmissionRejectedError
		switch {
		case err == nil:
			c.cap = ic
			admitted = append(admitted, c)
		case asRejection(err, &rej):
			rejections = append(rejections, rej)
		default:
			return Pick{}, err
		}
	}

	if len(admitted) > 0 {
		w := p.winner(admitted, evaluated, req, v.tie, d)
		forfeit := func(blocks int) {
			if !readmitted && bestGatedBlocks > blocks {
				d.ForfeitedBlocks = bestGatedBlocks - blocks
			}
		}
		if !p.opts.DisableCostComparison {
			alt, err := p.cheaper(engines, req, res, v.credit, snap, w, admitted, evaluated, gate, held, slots, v.tie)
			if err != nil {
				return Pick{}, err
			}
			if alt.idx >= 0 {
				d.CostOverride = true
				if alt.holder {
					forfeit(alt.blocks)
					return p.finish(engines[alt.idx], &alt.obs, alt.cap, label.ReasonCacheCandidate, label.DecisionCacheHit, alt.uncached, req, res, d), nil
				}
				d.DivertedBlocks = w.blocks - alt.blocks
				return p.finish(engines[alt.idx], &alt.obs, alt.cap, label.ReasonCostDiverted, label.DecisionCostDiverted, alt.uncached, req, res, d), nil
			}
		}
		forfeit(w.blocks)
		return p.finish(engines[w.idx], &w.obs, w.cap, label.ReasonCacheCandidate, label.DecisionCacheHit, w.uncached, req, res, d), nil
	}

	if p.floor != 0 && len(gated) > 0 && !p.anyBelowFloor(engines, snap) {
		// Saturation pin: least pressured gate-rejected holder that passes hard admission, ties
		// by engine ID (candidate indexes follow the ID-sorted engines).
		basis := coverage(gated)
		pool := slices.Clone(gated)
		slices.SortFunc(pool, func(a, b cacheCandidate) int { return a.idx - b.idx })
		for len(pool) > 0 {
			best := 0
			for i := 1; i < len(pool); i++ {
				if loadmon.ComparePressure(req.Stage, &pool[i].obs, &pool[best].obs, basis) < 0 {
					best = i
				}
			}
			c := pool[best]
			ic, err := p.cfg.admit(held, engines[c.idx], c.obs)
			if err == nil {
				return p.finish(engines[c.idx], &c.obs, ic, label.ReasonSaturationPin, label.DecisionCacheHit, c.uncached, req, res, d), nil
			}
			var rej *AdmissionRejectedError
			if !asRejection(err, &rej) {
				return Pick{}, err
			}
			rejections = append(rejections, rej)
			pool = slices.Delete(pool, best, best+1)
		}
	}
	if len(rejections) > 0 {
		// Admission rejected the holders: an idle engine recomputes the prompt rather than let
		// it wait for them, as recomputing there delays nobody (docs/design.md §9.11).
		if i, o, ok := p.idle(engines, req, snap, v.matched, v.tie); ok {
			if ic, err := p.cfg.admit(held, engines[i], o); err == nil {
				return p.finish(engines[i], &o, ic, label.ReasonNoCacheCandidate, label.DecisionCacheMiss, req.InputTokens-v.matched[i], req, res, d), nil
			}
		}
		// Otherwise the cheapest engine with room takes it: a request waits only when no engine
		// of the group has room, and its rejections then name every engine (docs/design.md §9.11).
		i, o, ic, err := p.cheapestAdmitted(engines, req, v.credit, snap, held, &rejections)
		if err != nil {
			return Pick{}, err
		}
		if i >= 0 {
			return p.finish(engines[i], &o, ic, label.ReasonNoCacheCandidate, label.DecisionCacheMiss, req.InputTokens-v.matched[i], req, res, d), nil
		}
		return Pick{}, &NoAdmissibleEngineError{Rejections: rejections}
	}

	// Miss: power-of-k over the unqueued tier, then one admission check.
	i, o, err := p.fallback(engines, req, snap, gate, slots)
	if err != nil {
		return Pick{}, err
	}
	if !p.opts.DisableCostComparison && o.Basis() != loadmon.BasisInFlight {
		// Cost comparison (docs/design.md §9.11): the sample's winner against the cheapest
		// engine of the same tier.
		matched := v.credit
		var load fleetLoad
		j, jc, jo, covered := p.cheapest(engines, req, matched, snap, nil, gate, slots, v.tie, &load)
		if covered && j < 0 { // every engine is queued (or has no slot for the adapter): the tier is the whole group
			load = fleetLoad{}
			j, jc, jo, covered = p.cheapest(engines, req, matched, snap, nil, false, 0, v.tie, &load)
		}
		ui, uj := req.InputTokens-matched[i], uint64(0)
		if j >= 0 {
			uj = req.InputTokens - matched[j]
		}
		cost := p.prefillCost(&o, ui, req)
		if k, ko, ok := p.resident(engines, req, matched, snap, i, &o, cost, slots); ok {
			i, o = k, ko
			d.CostOverride = true
		} else if covered && j >= 0 && j != i && p.materiallyCheaper(cost, jc, ui, uj, load) {
			i, o = j, jo
			d.CostOverride = true
		}
	}
	ic, err := p.admit(held, engines[i], o)
	if err != nil {
		var rej *AdmissionRejectedError
		if !asRejection(err, &rej) {
			return Pick{}, err
		}
		// Another engine with room takes it: a request waits only when no engine of the group
		// has room (docs/design.md §9.11).
		rejections = append(rejections, rej)
		j, jo, jc, err := p.cheapestAdmitted(engines, req, v.credit, snap, held, &rejections)
		if err != nil {
			return Pick{}, err
		}
		if j < 0 {
			return Pick{}, &NoAdmissibleEngineError{Rejections: rejections}
		}
		i, o, ic = j, jo, jc
	}
	decision := cacheAwareFallbackDecision(d.GateRejected, d.Evaluated, d.FleetAllQueued)
	if decision == label.DecisionCacheWorkerQueued {
		d.DivertedBlocks = bestGatedBlocks
	}
	return p.finish(engines[i], &o, ic, label.ReasonNoCacheCandidate, decision, req.InputTokens-v.matched[i], req, res, d), nil
}

// release returns a pick's scratch to the pool, dropping what it refers to.
func (p *cacheAware) release(sc *pickScratch) {
	sc.res = kvindex.Result{}
	p.scratch.Put(sc)
}

// cacheAwareFallbackDecision maps a cache-aware pick that did not select a prefix holder to its
// decision label (docs/design.md §9.8):
// nothing gate-rejected → cache_miss; the fleet all queued → all_queued (asked before capacity,
// so a saturated fleet is never read as healthy); holders reached hard admission → cache_miss
// (a capacity problem, not the gate); otherwise → cache_worker_queued.
func cacheAwareFallbackDecision(gateRejected, evaluated int, fleetAllQueued bool) string {
	switch {
	case gateRejected == 0:
		return label.DecisionCacheMiss
	case fleetAllQueued:
		return label.DecisionAllQueued
	case evaluated > 0:
		return label.DecisionCacheMiss
	}
	return label.DecisionCacheWorkerQueued
}

func (p *cacheAware) finish(e state.Engine, o *loadmon.Observation, ic inFlightCap, reason, decision string, uncached uint64, req *Request, res *kvindex.Result, d *CacheDecision) Pick {
	if p.placer != nil && len(req.TokenIDs) > 0 {
		// Route-time placement (docs/design.md §9.10): a hint, so a failure is only logged. A
		// pick that names a DP rank places the prompt on that rank (docs/design.md §11).
		rank := 0
		if o.HasDPRank {
			rank = o.DPRank
		}
		if err := p.placer.Place(e.ID(), rank, kvindex.Query{TokenIDs: req.TokenIDs, Adapter: req.Adapter}, res); err != nil {
			if ce := p.log.Check(zap.DebugLevel, "route-time placement not recorded"); ce != nil {
				ce.Write(zap.String("engine", string(e.ID())), zap.Error(err))
			}
		}
	}
	if p.opts.Observer != nil {
		d.Reason, d.Decision = reason, decision
		if p.borrower != nil {
			p.borrower.BorrowCacheDecision(d)
		} else {
			dd := *d // the observer may keep its copy; d is the pick's pooled scratch
			p.opts.Observer.ObserveCacheDecision(&dd)
		}
	}
	return Pick{Engine: e, Reason: reason, PrefillTokens: max(uncached, 1)}.withRank(o).withCap(ic)
}

// costOrder orders two engines the cost comparison priced: by cost a and b (prefillCost plus the
// engines' away handicaps awayA and awayB, homes), then a home engine first, then by stage
// pressure (loadmon.ComparePressure over both engines' fresh reports; the cost comparison prices
// only engines that have them). Negative when the first comes first, 0 on a complete tie.
func (p *cacheAware) costOrder(a, b, awayA, awayB uint64, oa, ob *loadmon.Observation, req *Request) int {
	if c := cmp.Compare(a, b); c != 0 {
		return c
	}
	if c := cmp.Compare(awayA, awayB); c != 0 {
		return c
	}
	return loadmon.ComparePressure(req.Stage, oa, ob, loadmon.BasisNative)
}

// costAlt is the outcome of the cost comparison: idx < 0 keeps the seed's winner.
type costAlt struct {
	idx      int
	holder   bool
	blocks   int
	uncached uint64
	obs      loadmon.Observation
	cap      inFlightCap // the in-flight cap it was admitted under
}

// prefillCost is the work a request would wait for and cause on an engine, in prompt tokens:
// its pending prefill tokens (pendingPrefill) plus the request's uncached tokens there
// (docs/design.md §9.11).
func (p *cacheAware) prefillCost(o *loadmon.Observation, uncached uint64, req *Request) uint64 {
	return satAdd(p.pendingPrefill(o, req), uncached)
}

// pendingPrefill is the prompt tokens a request waits behind on the engine
// (loadmon.Observation.EstimatePendingPrefillTokens): the reported waiting uncached tokens of a
// native report, else the reported waiting requests × the mean prefill tokens of this router's
// recent dispatches there (the request's input tokens when it has recorded none); plus the prefill
// tokens dispatched since the report. 0 when the load is unknown.
func (p *cacheAware) pendingPrefill(o *loadmon.Observation, req *Request) uint64 {
	pending, _ := o.EstimatePendingPrefillTokens(p.cfg.InFlight, req.InputTokens)
	return pending
}

// fleetLoad counts, over the engines a cost comparison priced, how many have pending prefill
// work (docs/design.md §9.11): the share of busy engines scales the recompute factor.
type fleetLoad struct {
	busy, priced int
}

// add counts an engine whose pending prefill tokens are pending.
func (l *fleetLoad) add(pending uint64) {
	l.priced++
	if pending > 0 {
		l.busy++
	}
}

// materiallyCheaper reports whether moving the request from an engine costing from (where it
// would prefill fromUncached tokens) to one costing to (toUncached tokens) is worth it: the saving
// exceeds CostMarginTokens and RecomputeFactor × (busy ÷ priced engines) times the extra prefill
// the move causes (docs/design.md §9.11). Extra prefill delays the requests that queue behind it,
// so it weighs in proportion to the share of engines that have a queue: nothing on an idle fleet,
// the whole factor when every engine is busy.
func (p *cacheAware) materiallyCheaper(from, to, fromUncached, toUncached uint64, load fleetLoad) bool {
	if from <= to || from-to <= p.costMargin {
		return false
	}
	if toUncached <= fromUncached || load.busy == 0 {
		return true
	}
	factor := p.opts.RecomputeFactor * float64(load.busy) / float64(load.priced)
	return float64(from-to) > factor*float64(toUncached-fromUncached)
}

// lookupView maps a lookup result onto the group, once per pick: for each of res.Engines its
// index among the engines (−1 outside the group), and per engine index the prompt tokens the
// engine would serve from its prefix cache, whatever the hit gate (servedTokens, §9.1), and the
// same with 0 below the hit gate (credit).
type lookupView struct {
	idx     []int
	matched []uint64
	credit  []uint64 // matched, 0 where below the hit gate: what the cost comparison credits
	gate    uint64   // the hit gate for the request (hitGate)
	tie     tieOrder // the pick's order of engines that every rule leaves tied
}

// tieOrder orders the engines of a group that every rule of a pick leaves tied: by index, from
// start, wrapping around. Each pick starts one engine later than the one before, so that
// equal engines (idle holders of a shared prefix, say) take turns rather than the lowest IDs
// taking all (docs/design.md §9.6).
type tieOrder struct{ start, n int }

// compare returns c, or, when c is 0 (a tie), a negative number when engine index a comes
// before b in the order, positive when after.
func (t tieOrder) compare(c, a, b int) int {
	if c != 0 || t.n == 0 {
		return c
	}
	return (a-t.start+t.n)%t.n - (b-t.start+t.n)%t.n
}

// lookupBuf backs a lookupView in the pick's scratch; its slices grow to the largest group and
// result seen, so a view costs no allocation, whatever the group's size.
type lookupBuf struct {
	idx     []int
	matched []uint64
	credit  []uint64
	ids     []state.EngineID
}

func newLookupView(buf *lookupBuf, engines []state.Engine, req *Request, res *kvindex.Result, gate uint64) lookupView {
	v := lookupView{gate: gate}
	buf.matched = slices.Grow(buf.matched[:0], len(engines))[:len(engines)]
	buf.credit = slices.Grow(buf.credit[:0], len(engines))[:len(engines)]
	v.matched, v.credit = buf.matched, buf.credit
	clear(v.matched)
	clear(v.credit)
	if res.Outcome != kvindex.OutcomeHit || res.QueryBlocks == 0 {
		return v
	}
	buf.idx = slices.Grow(buf.idx[:0], len(res.Engines))[:len(res.Engines)]
	v.idx = buf.idx
	// The group's IDs (sorted: groups hand policies their engines by ID), read once, so that the
	// binary search of each holder costs one string comparison per step and no interface call:
	// this runs for every engine of every cache-aware lookup result (docs/performance.md,
	// "kvindex at production scale").
	buf.ids = slices.Grow(buf.ids[:0], len(engines))[:len(engines)]
	ids := buf.ids
	for i, e := range engines {
		ids[i] = e.ID()
	}
	for j, m := range res.Engines {
		i, ok := slices.BinarySearch(ids, m.Engine)
		if !ok || m.Blocks <= 0 {
			v.idx[j] = -1
			continue
		}
		v.idx[j] = i
		v.matched[i] = servedTokens(req.InputTokens, min(m.Blocks, res.QueryBlocks), res.BlockTokens)
		if v.matched[i] >= gate {
			v.credit[i] = v.matched[i]
		}
	}
	return v
}

// cheapest scans the group's engines, skipping the holders in skip and, when gated, the engines
// the queue gate sets aside, and returns the index, cost and observation of the cheapest (on equal
// cost: costOrder, then the pick's turn, tie; idx −1 when every engine is skipped; with router replicas, a home
// engine unless another is cheaper by more than CostMarginTokens: homes), counting every scanned engine in
// load; an engine with no slot for the request's LoRA adapter (evicts) is counted but never
// chosen. covered is false, and idx −1, when some scanned engine has no fresh report (the coverage
// rule).
func (p *cacheAware) cheapest(engines []state.Engine, req *Request, matched []uint64, snap loadmon.Snapshot, skip []cacheCandidate, gated bool, slots uint64, tie tieOrder, load *fleetLoad) (idx int, cost uint64, obs loadmon.Observation, covered bool) {
	idx = -1
	h := p.homes()
	var key uint64 // cost plus the engine's away handicap: what the scan minimises
	for i, e := range engines {
		if holdsIn(skip, i) {
			continue
		}
		o := p.cfg.observe(snap, e, req)
		if gated && p.queued(&o, slots) {
			continue
		}
		if o.Basis() == loadmon.BasisInFlight {
			return -1, 0, loadmon.Observation{}, false
		}
		pending := p.pendingPrefill(&o, req)
		load.add(pending)
		if evicts(&o) {
			continue // no slot for the request's adapter (docs/design.md §18)
		}
		c := satAdd(pending, req.InputTokens-matched[i])
		if k := satAdd(c, h.away(i)); idx < 0 || tie.compare(p.costOrder(k, key, h.away(i), h.away(idx), &o, &obs, req), i, idx) < 0 {
			idx, cost, obs, key = i, c, o, k
		}
	}
	return idx, cost, obs, true
}

// cheaper applies the cost comparison (docs/design.md §9.11) to the seed's winner w: every other
// admitted holder and the cheapest engine outside the evaluated holders are priced by
// prefillCost, and the cheapest replaces w when materially cheaper; a non-holder must then pass
// admission (once; for a held request, admit), else w stays. For a request for a LoRA adapter, the residency rule (resident)
// comes first; an engine with no slot for the adapter (evicts) is never the replacement
// (docs/design.md §18). It applies only when every evaluated holder and every engine it
// scans has a fresh report (the coverage rule); otherwise w stays.
func (p *cacheAware) cheaper(engines []state.Engine, req *Request, res *kvindex.Result, matched []uint64, snap loadmon.Snapshot,
	w cacheCandidate, admitted, evaluated []cacheCandidate, gated, held bool, slots uint64, tie tieOrder) (costAlt, error) {
	none := costAlt{idx: -1}
	if coverage(evaluated) == loadmon.BasisInFlight {
		return none, nil
	}
	wCost := p.prefillCost(&w.obs, w.uncached, req)
	if j, jo, ok := p.resident(engines, req, matched, snap, w.idx, &w.obs, wCost, slots); ok {
		if c, ok := candidateAt(admitted, j); ok {
			return costAlt{idx: j, holder: true, blocks: c.blocks, uncached: c.uncached, obs: c.obs, cap: c.cap}, nil
		}
		if !holdsIn(evaluated, j) { // not a holder admission rejected
			alt := costAlt{idx: j, blocks: heldBlocks(res, engines[j].ID()), uncached: req.InputTokens - matched[j], obs: jo}
			ic, err := p.admit(held, engines[j], jo)
			var rej *AdmissionRejectedError
			switch {
			case err == nil:
				alt.cap = ic
				return alt, nil
			case !asRejection(err, &rej):
				return none, err
			}
		}
	}
	best, bestCost := none, wCost
	for _, c := range admitted {
		if evicts(&c.obs) {
			continue // no slot for the request's adapter (docs/design.md §18)
		}
		cc := p.prefillCost(&c.obs, c.uncached, req)
		if cc < bestCost || best.idx >= 0 && tie.compare(p.costOrder(cc, bestCost, 0, 0, &c.obs, &best.obs, req), c.idx, best.idx) < 0 {
			best, bestCost = costAlt{idx: c.idx, holder: true, blocks: c.blocks, uncached: c.uncached, obs: c.obs, cap: c.cap}, cc
		}
	}
	if best.idx < 0 && !p.alwaysScan {
		// No engine outside the evaluated holders can be materially cheaper than w when even
		// its uncached tokens alone (a lower bound of its cost: prefillCost adds its pending
		// prefill) keep w within the cost margin: the scan below could then only end with w
		// (so could an uncovered scan), and it is skipped. On a hit with a deep match that
		// saves observing every other engine of the group (docs/performance.md, "Fewer engines
		// observed").
		most := uint64(0)
		for i, m := range matched {
			if m > most && !holdsIn(evaluated, i) {
				most = m
			}
		}
		if satAdd(req.InputTokens-most, p.costMargin) >= wCost {
			return none, nil
		}
	}
	if p.costScanHook != nil {
		p.costScanHook()
	}
	var load fleetLoad
	for i := range evaluated {
		load.add(p.pendingPrefill(&evaluated[i].obs, req))
	}
	nIdx, nCost, nObs, covered := p.cheapest(engines, req, matched, snap, evaluated, gated, slots, tie, &load)
	if !covered {
		return none, nil
	}
	if nIdx >= 0 && nCost < bestCost {
		best, bestCost = costAlt{idx: nIdx, blocks: heldBlocks(res, engines[nIdx].ID()), uncached: req.InputTokens - matched[nIdx], obs: nObs}, nCost
	}
	if best.idx < 0 || !p.materiallyCheaper(wCost, bestCost, w.uncached, best.uncached, load) {
		return none, nil
	}
	if !best.holder {
		ic, err := p.admit(held, engines[best.idx], best.obs)
		var rej *AdmissionRejectedError
		switch {
		case err == nil:
			best.cap = ic
		case asRejection(err, &rej):
			return none, nil
		default:
			return none, err
		}
	}
	return best, nil
}

func holdsIn(cs []cacheCandidate, idx int) bool {
	for i := range cs {
		if cs[i].idx == idx {
			return true
		}
	}
	return false
}

// candidates lists the group engines that hold a prefix passing the hit gate, ranked by uncached
// tokens (the source returns deepest first, ties by ID) and cut to the candidate limit. When more
// holders than the limit lie within the switch margin of the least uncached one, the cut keeps the
// least pressured of them (loadmon.ComparePressure under the coverage rule over those holders, the
// deeper first, then the pick's turn, v.tie) rather than the lowest IDs (docs/design.md §9.2).
func (p *cacheAware) candidates(dst, all []cacheCandidate, engines []state.Engine, req *Request, res *kvindex.Result, v *lookupView, snap loadmon.Snapshot) []cacheCandidate {
	if res.Outcome != kvindex.OutcomeHit || res.QueryBlocks == 0 {
		return dst
	}
	gate := v.gate
	n := len(engines)
	limit := min(n, p.opts.CandidateMaxEngines, max(p.opts.CandidateMinEngines, int(math.Ceil(p.opts.CandidateRatio*float64(n)))))
	all = all[:0]
	window := 0 // holders within the switch margin of the least uncached: a prefix of all
	for j, m := range res.Engines {
		if len(all) >= limit && window < len(all) {
			break // the cut is full and, ranked by depth, nothing later can enter the margin window
		}
		idx := v.idx[j]
		if idx < 0 {
			continue
		}
		blocks := min(m.Blocks, res.QueryBlocks)
		matched := v.matched[idx]
		if matched < gate {
			continue
		}
		c := cacheCandidate{idx: idx, blocks: blocks, uncached: req.InputTokens - matched}
		inWindow := len(all) == 0 || c.uncached <= all[0].uncached+p.margin
		if !inWindow && window >= limit {
			break
		}
		if inWindow {
			window++
		}
		if res.DPRanks != nil {
			// The rank holding the deepest prefix serves the hit; the gate and the pressure
			// comparisons read its own figures (docs/design.md §6).
			c.obs = loadmon.ObserveRank(snap, p.cfg.InFlight, engines[idx].ID(), res.DPRanks[j])
			c.obs.Adapter = req.Adapter
		} else {
			c.obs = p.cfg.observe(snap, engines[idx], req)
		}
		all = append(all, c)
	}
	if window <= limit {
		return append(dst, all[:min(len(all), limit)]...)
	}
	// More holders within the margin than the limit: keep the limit least pressured of them, by
	// repeated linear scans (never a sort: the comparison is not a total order), in rank order.
	w := all[:window]
	basis := coverage(w)
	var tbuf [64]bool
	var taken []bool
	if window > len(tbuf) {
		taken = make([]bool, window)
	} else {
		taken = tbuf[:window]
	}
	for range limit {
		best := -1
		for i := range w {
			if taken[i] {
				continue
			}
			if best < 0 || v.tie.compare(cmp.Or(loadmon.ComparePressure(req.Stage, &w[i].obs, &w[best].obs, basis), cmp.Compare(w[i].uncached, w[best].uncached)), w[i].idx, w[best].idx) < 0 {
				best = i
			}
		}
		taken[best] = true
	}
	for i := range w {
		if taken[i] {
			dst = append(dst, w[i])
		}
	}
	return dst
}

// hitGate is the fewest matched prompt tokens that count as a hit for req (docs/design.md §9.1):
// MinMatchedTokens, or a fifth of the prompt when it is unset, and at least MinMatchRatio of the
// prompt.
func (p *cacheAware) hitGate(req *Request) uint64 {
	gate := p.opts.MinMatchedTokens
	if p.shareGate {
		gate = (req.InputTokens + 4) / 5
	}
	if r := p.opts.MinMatchRatio; r > 0 {
		gate = max(gate, uint64(math.Ceil(r*float64(req.InputTokens))))
	}
	return gate
}

// servedTokens returns the tokens of an input-token prompt that an engine holding its first
// blocks blocks of blockTokens tokens serves from its prefix cache (docs/design.md §9.1): whole
// blocks only, and none from the block holding the last prompt token, which the engine computes
// again for its logits: min(blocks, ⌊(input − 1) ÷ blockTokens⌋) × blockTokens. 0 for an empty
// prompt or an unknown block size.
func servedTokens(input uint64, blocks, blockTokens int) uint64 {
	if input == 0 || blocks <= 0 || blockTokens <= 0 {
		return 0
	}
	bt := uint64(blockTokens)
	return min(uint64(blocks), (input-1)/bt) * bt
}

// heldBlocks returns the leading blocks of the query that res says engine holds, 0 when it holds
// none.
func heldBlocks(res *kvindex.Result, engine state.EngineID) int {
	for _, m := range res.Engines {
		if m.Engine == engine {
			return max(min(m.Blocks, res.QueryBlocks), 0)
		}
	}
	return 0
}

// winner chooses among admitted holders (ranked by uncached tokens, then ID) within the switch
// margin of the least uncached one (docs/design.md §9.6, §9.7):
//   - holders with as many uncached tokens as the incumbent are ordered by stage pressure
//     (loadmon.ComparePressure under the coverage rule over the evaluated holders), then by the
//     pick's turn (tie);
//     for a base-model request with router replicas and fresh reports, a home engine and another
//     by pending prefill tokens, the other's handicapped by CostMarginTokens (homes);
//   - a holder with more uncached tokens (still within the margin) replaces the incumbent when
//     every evaluated holder has a fresh report and the guard is on, if the incumbent is
//     materially more pressured (the pressure guard, on pending prefill tokens estimated from
//     waiting requests for holders without native figures); when some holder's load is unknown,
//     if it has fewer router-local in-flight requests.
func (p *cacheAware) winner(admitted, evaluated []cacheCandidate, req *Request, tie tieOrder, d *CacheDecision) cacheCandidate {
	best := admitted[0]
	stage := req.Stage
	basis := coverage(evaluated)
	comparable := !p.opts.DisablePressureGuard && basis != loadmon.BasisInFlight
	switch {
	case comparable && basis == loadmon.BasisReported:
		d.PressureSource = pressureSourceEstimatedQueue
	case comparable && p.opts.PressureAbsThreshold > 0:
		d.PressureSource = pressureSourceQueueTime
	case comparable:
		d.PressureSource = pressureSourceNativeQueue
	}
	least := best.uncached
	h := p.homes()
	for _, c := range admitted[1:] {
		if c.uncached > least+p.margin {
			break // ranked by uncached tokens: the rest are outside the near-tie window too
		}
		switch {
		case c.uncached == best.uncached && basis != loadmon.BasisInFlight && req.Adapter == "" && h.away(c.idx) != h.away(best.idx):
			// A home engine and another (homes): pending prefill tokens, the other engine's
			// handicapped by CostMarginTokens.
			if satAdd(p.pendingPrefill(&c.obs, req), h.away(c.idx)) < satAdd(p.pendingPrefill(&best.obs, req), h.away(best.idx)) {
				best = c
			}
		case c.uncached == best.uncached:
			if tie.compare(loadmon.ComparePressure(stage, &c.obs, &best.obs, basis), c.idx, best.idx) < 0 {
				best = c
			}
		case comparable:
			d.GuardCompared++
			if p.materiallyMorePressured(&best.obs, &c.obs, req) {
				best = c
				d.GuardOverrides++
			}
		case basis == loadmon.BasisInFlight:
			if loadmon.ComparePressure(stage, &c.obs, &best.obs, basis) < 0 {
				best = c
			}
		}
	}
	return best
}

// materiallyMorePressured reports whether a is materially more pressured than b
// (docs/design.md §9.7), counting the prefill work dispatched since each report: on estimated
// prefill queue times when both have one and a threshold is set, else on pending prefill tokens
// (pendingPrefill).
func (p *cacheAware) materiallyMorePressured(a, b *loadmon.Observation, req *Request) bool {
	rel := p.opts.PressureRelThreshold
	if p.opts.PressureAbsThreshold > 0 {
		if da, ok := a.PendingPrefillTime(); ok {
			if db, ok := b.PendingPrefillTime(); ok {
				return da-db > p.opts.PressureAbsThreshold && float64(da) > float64(db)*rel
			}
		}
	}
	ua, ub := p.pendingPrefill(a, req), p.pendingPrefill(b, req)
	return ua > ub && ua-ub > p.opts.PressureAbsThresholdTokens && float64(ua) > float64(ub)*rel
}

// queued reports whether the soft queue gate sets the engine aside: the request's LoRA adapter
// would wait for a slot there (slotWait, docs/design.md §18), or, with EngineQueueLimit set, its
// fresh waiting count, with the dispatches since the report, is at or over the limit, or, without
// a fresh report, its router-local in-flight count is. Unknown load fails open only while this
// router has fewer requests in flight there than the limit: it is never taken for idle
// (docs/design.md §9.3). Without a limit, once some holder has a full round queued for its
// running slots (slots > 0, divertSlots): it has no free running slot (slotsFull). The figures
// are the named rank's own when the engine has several (docs/design.md §6).
func (p *cacheAware) queued(o *loadmon.Observation, slots uint64) bool {
	if slotWait(o) {
		return true
	}
	if p.queueCap == 0 {
		return slots > 0 && slotsFull(o, slots)
	}
	if w, ok := o.WaitingRequests(); ok {
		return w >= p.queueCap
	}
	return o.InFlight >= p.queueCap
}

// slotsFull reports whether this router's in-flight requests to the engine (to the named rank,
// when the observation names one) fill its running slots (loadmon.EngineLoad.RunningSlots), or
// slots when it shows none: a request sent there would wait for a running one to end.
func slotsFull(o *loadmon.Observation, slots uint64) bool {
	if l := o.Figures(); l != nil && l.RunningSlots > 0 {
		slots = l.RunningSlots
	}
	return inFlightThere(o) >= slots
}

// inFlightThere returns this router's in-flight requests to the observed engine, or to its named
// rank when the observation names one.
func inFlightThere(o *loadmon.Observation) uint64 {
	if o.HasDPRank {
		return o.RankInFlight
	}
	return o.InFlight
}

// divertSlots returns, when some holder has a full round queued for its running slots
// (loadmon.EngineLoad.RunningSlots: this router's requests there reach twice them, or exceed
// them while its reports show them, which they do only while requests wait), the most running
// slots of any holder; 0 otherwise (docs/design.md §9.3).
func divertSlots(cands []cacheCandidate) uint64 {
	var slots uint64
	queued := false
	for i := range cands {
		o := &cands[i].obs
		if l := o.Figures(); l != nil && l.RunningSlots > 0 {
			slots = max(slots, l.RunningSlots)
			n := inFlightThere(o)
			queued = queued || n/2 >= l.RunningSlots || !l.Native && n > l.RunningSlots
		}
	}
	if !queued {
		return 0
	}
	return slots
}

// anyBelowFloor reports whether some group engine has a fresh queue strictly below the saturation
// floor; an unknown queue is not idle.
func (p *cacheAware) anyBelowFloor(engines []state.Engine, snap loadmon.Snapshot) bool {
	for _, e := range engines {
		if l, ok := snap.Load(e.ID()); ok && l.LeastRankWaitingRequests() < p.floor {
			return true
		}
	}
	return false
}

// fallback returns the least pressured engine of the tier, or, while another router sends to the
// group unseen (othersDispatch), the least pressured of MinLoadChoices sampled from it. The tier
// is the unqueued engines (every engine when gate is false or nothing is unqueued), narrowed, with
// router replicas, to its home engines when there are at least two (homes), then, for a
// base-model request, to those without in-flight prefill when some are (inFlightPrefill).
func (p *cacheAware) fallback(engines []state.Engine, req *Request, snap loadmon.Snapshot, gate bool, slots uint64) (int, loadmon.Observation, error) {
	h := p.homes()
	var tbuf [64]int
	tier := tbuf[:0]
	for i, e := range engines {
		if gate {
			if o := p.cfg.observe(snap, e, req); p.queued(&o, slots) {
				continue
			}
		}
		tier = append(tier, i)
	}
	if len(tier) == 0 {
		for i := range engines {
			tier = append(tier, i)
		}
	}
	if h.on() {
		var hbuf [64]int
		home := hbuf[:0]
		for _, i := range tier {
			if h.away(i) == 0 {
				home = append(home, i)
			}
		}
		if len(home) >= 2 {
			tier = home
		}
	}
	// For a request for a LoRA adapter, the engines' residency of it decides first
	// (docs/design.md §18).
	if req.Adapter == "" {
		// A miss prefills its whole prompt wherever it goes; behind a prefill in flight, which
		// a report up to an interval old may not show, its first token waits for that prefill.
		var kbuf [64]int
		kept := kbuf[:0]
		for _, i := range tier {
			if p.inFlightPrefill(engines[i]) == 0 {
				kept = append(kept, i)
			}
		}
		if len(kept) > 0 {
			tier = kept
		}
	}
	k := p.opts.MinLoadChoices
	if k < len(tier) && !othersDispatch(snap, p.cfg.InFlight, engines) {
		k = len(engines) // the exact minimum: no other router sends here unseen
	}
	if len(tier) == len(engines) {
		return sampleLeastPressured(&p.cfg, snap, engines, req, k)
	}
	var sbuf [64]state.Engine // stays on the stack for groups of up to 64 engines
	sub := sbuf[:0]
	for _, i := range tier {
		sub = append(sub, engines[i])
	}
	j, o, err := sampleLeastPressured(&p.cfg, snap, sub, req, k)
	return tier[j], o, err
}

// othersDispatch reports whether the group's fresh reports show requests that no dispatch known
// here explains: more than a quarter of the running and waiting requests they report are not in
// flight from this router or its sharing peers at the report (the latest of the engine's DP
// ranks' reports). Then another router sends to these engines unseen, and every router taking the
// least pressured engine would send its requests to the same one until the next report; the
// better of MinLoadChoices sampled spreads them (docs/design.md §9.9).
func othersDispatch(snap loadmon.Snapshot, inflight *loadmon.InFlight, engines []state.Engine) bool {
	var reported, unexplained uint64
	for _, e := range engines {
		l, ok := snap.Load(e.ID())
		if !ok {
			continue
		}
		at := l.ReportedAt
		for _, rl := range l.RankLoads {
			if rl.ReportedAt.After(at) {
				at = rl.ReportedAt
			}
		}
		var known uint64
		if inflight != nil {
			known = loadbridge.InFlightAt(inflight, e.ID(), at)
		}
		r := satAdd(l.RunningRequests, l.WaitingRequests)
		reported = satAdd(reported, r)
		unexplained = satAdd(unexplained, r-min(r, known))
	}
	return unexplained > reported/4
}

// inFlightPrefill returns the prefill tokens of the dispatches to e, this router's and its
// peers', whose first token has not arrived (docs/design.md §6); 0 until the host reports first
// tokens (Dispatch.FirstToken).
func (p *cacheAware) inFlightPrefill(e state.Engine) uint64 {
	return loadbridge.InFlightPrefill(p.cfg.InFlight, e.ID())
}

// idle returns the idle group engine with the fewest uncached tokens (on a tie, a home engine, then
// the pick's turn, tie; with router replicas, a home engine unless another has more than
// CostMarginTokens fewer: homes): one with nothing in flight from this router or its peers, no
// dispatch since the report and, when its load is known, no running or waiting request reported. ok is false when no engine is idle, and
// with the cost comparison off.
func (p *cacheAware) idle(engines []state.Engine, req *Request, snap loadmon.Snapshot, matched []uint64, tie tieOrder) (idx int, obs loadmon.Observation, ok bool) {
	idx = -1
	if p.opts.DisableCostComparison {
		return idx, obs, false
	}
	h := p.homes()
	var key uint64 // uncached tokens plus the engine's away handicap: what the scan minimises
	for i, e := range engines {
		o := p.cfg.observe(snap, e, req)
		if o.InFlight > 0 || o.PeerInFlight > 0 || o.Dispatched > 0 || (o.Load != nil && o.Load.RunningRequests+o.Load.WaitingRequests > 0) {
			continue
		}
		if k := satAdd(req.InputTokens-matched[i], h.away(i)); idx < 0 || tie.compare(cmp.Or(cmp.Compare(k, key), cmp.Compare(h.away(i), h.away(idx))), i, idx) < 0 {
			idx, obs, key = i, o, k
		}
	}
	return idx, obs, idx >= 0
}

// cheapestAdmitted returns the group engine of least prefillCost (uncached tokens from matched;
// with router replicas, plus its away handicap: homes) that admit admits, outside the engines of
// *rejections, for a request whose holders were rejected (docs/design.md §9.11). Engines with no
// slot for the request's LoRA adapter (evicts) come last, complete ties by ID. Each rejection is
// appended to *rejections. idx is −1 when every engine is rejected, and with the cost comparison
// off; err is a checker error.
func (p *cacheAware) cheapestAdmitted(engines []state.Engine, req *Request, matched []uint64, snap loadmon.Snapshot, held bool, rejections *[]*AdmissionRejectedError) (idx int, obs loadmon.Observation, ic inFlightCap, err error) {
	if p.opts.DisableCostComparison {
		return -1, obs, ic, nil
	}
	type priced struct {
		idx   int
		evict bool
		key   uint64
		obs   loadmon.Observation
	}
	var buf [16]priced
	all := buf[:0]
	h := p.homes()
next:
	for i, e := range engines {
		for _, r := range *rejections {
			if r.Engine != nil && r.Engine.ID() == e.ID() {
				continue next
			}
		}
		o := p.cfg.observe(snap, e, req)
		all = append(all, priced{idx: i, evict: evicts(&o), key: satAdd(p.prefillCost(&o, req.InputTokens-matched[i], req), h.away(i)), obs: o})
	}
	slices.SortFunc(all, func(a, b priced) int {
		return cmp.Or(cmpBool(a.evict, b.evict), cmp.Compare(a.key, b.key), cmp.Compare(a.idx, b.idx))
	})
	for _, c := range all {
		ic, err := p.admit(held, engines[c.idx], c.obs)
		var rej *AdmissionRejectedError
		switch {
		case err == nil:
			return c.idx, c.obs, ic, nil
		case !asRejection(err, &rej):
			return -1, obs, ic, err
		}
		*rejections = append(*rejections, rej)
	}
	return -1, obs, ic, nil
}

// homes is a pick's view of the router replicas that share their dispatches with this router
// (docs/design.md §6, "Router replicas"; loadbridge.Replicas): with n > 1 replicas, the group
// engines whose index (in ID order) is rank mod n are this replica's home engines. Replicas that
// route within the delay of their shared decisions see the same view and would all choose the
// engine that looks best in it; preferring their own home engines among engines within
// CostMarginTokens of each other, they choose different ones. A router alone (n ≤ 1) has no
// preference.
type homes struct {
	rank, n int
	margin  uint64
}

func (p *cacheAware) homes() homes {
	rank, n := loadbridge.Replicas(p.cfg.InFlight)
	return homes{rank: rank, n: n, margin: p.costMargin}
}

// on reports whether the router has peers.
func (h homes) on() bool { return h.n > 1 }

// away is the handicap of the engine at index i of the group: 0 for a home engine or a router
// alone, else CostMarginTokens.
func (h homes) away(i int) uint64 {
	if h.n <= 1 || i%h.n == h.rank {
		return 0
	}
	return h.margin
}

// coverage returns the best basis every candidate of cs has (the coverage rule, docs/design.md
// §6); loadmon.BasisInFlight for none.
func coverage(cs []cacheCandidate) loadmon.Basis {
	if len(cs) == 0 {
		return loadmon.BasisInFlight
	}
	b := loadmon.BasisNative
	for i := range cs {
		b = min(b, cs[i].obs.Basis())
	}
	return b
}

func asRejection(err error, out **AdmissionRejectedError) bool {
	r, ok := err.(*AdmissionRejectedError)
	if ok {
		*out = r
	}
	return ok
}

// lookup asks the source (through the request's memo when present), lending it bufs (nil: none).
func (p *cacheAware) lookup(ctx context.Context, req *Request, bufs *kvindex.LookupBuffers) (kvindex.Result, error) {
	q := kvindex.Query{TokenIDs: req.TokenIDs, Adapter: req.Adapter, Buffers: bufs}
	if req.Memo != nil {
		return req.Memo.Lookup(ctx, p.opts.Source, q)
	}
	return p.opts.Source.Lookup(ctx, q)
}

// gating reports whether the queue gate runs for req: with EngineQueueLimit set, and for a
// request for a LoRA adapter, which no engine where it would wait for a slot should take while
// another can start it (queued).
func (p *cacheAware) gating(req *Request) bool {
	return p.queueCap != 0 || req.Adapter != ""
}

// allQueued reports whether the gate sets every group engine aside for req (queued).
func (p *cacheAware) allQueued(engines []state.Engine, req *Request, snap loadmon.Snapshot, slots uint64) bool {
	for _, e := range engines {
		if o := p.cfg.observe(snap, e, req); !p.queued(&o, slots) {
			return false
		}
	}
	return true
}

// candidateAt returns the candidate of cs for engine index idx.
func candidateAt(cs []cacheCandidate, idx int) (cacheCandidate, bool) {
	for i := range cs {
		if cs[i].idx == idx {
			return cs[i], true
		}
	}
	return cacheCandidate{}, false
}

// resident applies the cost comparison's residency rule (docs/design.md §18) to w, the engine
// at index wi that the rules before it chose for a request for a LoRA adapter, costing wCost
// (prefillCost): among the group's engines the queue gate does not set aside (queued) that cost at
// most CostMarginTokens more than the cheapest of them and w, it returns the cheapest of the best
// residency class, when that class is better than w's (lora.Class). It returns false for a
// base-model request, when w runs the adapter or its residency is unknown, when some engine it
// prices has no fresh report (the coverage rule), or when no engine qualifies. Ties keep the
// lowest index.
func (p *cacheAware) resident(engines []state.Engine, req *Request, matched []uint64, snap loadmon.Snapshot, wi int, w *loadmon.Observation, wCost uint64, slots uint64) (int, loadmon.Observation, bool) {
	cw, ok := adapterClass(w)
	if !ok || cw == lora.Running {
		return -1, loadmon.Observation{}, false
	}
	least := wCost
	// The cheapest engine of each class better than w's.
	var best [lora.Running + 1]struct {
		idx  int
		cost uint64
		obs  loadmon.Observation
	}
	for c := range best {
		best[c].idx = -1
	}
	for i, e := range engines {
		if i == wi {
			continue
		}
		o := p.cfg.observe(snap, e, req)
		if p.queued(&o, slots) {
			continue
		}
		if o.Basis() == loadmon.BasisInFlight {
			return -1, loadmon.Observation{}, false
		}
		cost := p.prefillCost(&o, req.InputTokens-matched[i], req)
		least = min(least, cost)
		if c, ok := adapterClass(&o); ok && c > cw && (best[c].idx < 0 || cost < best[c].cost) {
			best[c].idx, best[c].cost, best[c].obs = i, cost, o
		}
	}
	for c := lora.Running; c > cw; c-- {
		if b := &best[c]; b.idx >= 0 && b.cost <= satAdd(least, p.costMargin) {
			return b.idx, b.obs, true
		}
	}
	return -1, loadmon.Observation{}, false
}

// cmpBool orders false before true.
func cmpBool(a, b bool) int {
	switch {
	case a == b:
		return 0
	case a:
		return 1
	}
	return -1
}

// admit is Config.admit, except that, for a request flow control holds off engines still
// prefilling a dispatch of the router (held; docs/design.md §17), such an engine is rejected
// first, and an engine is admitted below its in-flight cap's last slot (flowbridge.HeldCap), as
// the Router holds such a request.
func (p *cacheAware) admit(held bool, e state.Engine, o loadmon.Observation) (inFlightCap, error) {
	if held {
		if n := loadbridge.Prefilling(p.cfg.InFlight, e.ID()); n > 0 {
			return inFlightCap{}, &AdmissionRejectedError{Engine: e, Limit: flowbridge.LimitPrefilling, Observed: n}
		}
	}
	return p.cfg.admit(held, e, o)
}
