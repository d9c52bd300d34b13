package policy

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"

	"github.com/cespare/xxhash/v2"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/internal/flowbridge"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

// Policy chooses one engine from the candidates of one engine group.
//
// engines are the group's exact candidates, healthy, of the request's model and stage, sorted by
// ID; the slice is shared and must not be modified. The returned Pick's Engine must be one of
// those exact values (interface equality); the group rejects anything else as
// *OutsideCandidatesError.
//
// Errors: ErrNoCandidates (no engine is eligible, or a policy-specific miss with nothing to fall
// back to: the bucket loop tries the next bucket), *AdmissionRejectedError and
// *NoAdmissibleEngineError (admission rejected the chosen engine or every candidate the algorithm
// evaluated: next bucket), ErrInvalidSignal and ErrInvalidConfiguration (stop routing), or an
// error from the admission Checker or a prefix source (stop routing).
//
// Implementations are safe for concurrent use; one instance serves every request of its group.
//
// Optional methods, detected at construction:
//
//   - SupportsStage(s state.Stage) bool: a policy (or a Builder) that cannot serve every stage
//     has it, so that a bucket or the configuration rejects the attachment (cache-aware on
//     decode, docs/design.md §4). Without it, a policy serves every stage.
//   - ReadsReportedLoad() bool: true when the policy's picks read engine-reported load beyond its
//     admission caps (the cache-aware queue gate); config.New then warns when no engine of the
//     model has a fresh report, which leaves such a rule inert (docs/design.md §15).
type Policy interface {
	Pick(ctx context.Context, engines []state.Engine, req *Request) (Pick, error)
}

// stageSupporter is a Policy or Builder with the optional SupportsStage method.
type stageSupporter interface {
	SupportsStage(s state.Stage) bool
}

// Request is the routing facts of one pick. It carries no HTTP body, no headers, no state handles
// and no load observations (docs/design.md §1). The bucket fills Stage and BucketID for
// each group it calls; everything else passes through from the host.
type Request struct {
	// Model is the requested model.
	Model state.ModelID
	// Stage is the role of the group being picked for.
	Stage state.Stage
	// BucketID is the bucket whose group is picking.
	BucketID string
	// InputTokens is the prompt length in tokens.
	InputTokens uint64
	// ExpectedPeakTokens is the expected peak sequence length (input plus output budget), in
	// tokens; meaningful only when HasExpectedPeak. Unknown is not 0.
	ExpectedPeakTokens uint64
	HasExpectedPeak    bool
	// TokenIDs is the tokenized prompt, or nil when the host did not tokenize. Cache-aware
	// policies need it; others ignore it. When set, its length must equal InputTokens (a
	// cache-aware pick returns ErrInvalidSignal otherwise). Must not be modified during the pick.
	TokenIDs []uint32
	// SessionKey and RoutingKey are the session and sticky-routing keys; empty means none.
	SessionKey string
	RoutingKey string
	// Memo memoizes prefix lookups for this request across buckets, stages and concurrent picks
	// (one lookup per kvindex.Source per request). Nil means every cache-aware pick looks up its
	// source itself.
	Memo *kvindex.Memo
	// Adapter is the LoRA adapter the request asks for (vLLM lora_name); empty means the base
	// model. Cache-aware lookups match only the adapter's blocks (kvindex.Query.Adapter), and
	// load-aware picks prefer an engine running the adapter, then one with a free adapter slot,
	// while it has no more waiting requests (dispatches since its load report included, a slot
	// wait as one more) than the other (loadmon.ComparePressure, docs/design.md §18).
	Adapter string
}

// Pick is a policy's choice: the engine and a reason label for metrics and tracing.
type Pick struct {
	// Engine is one of the exact candidate values handed to the policy.
	Engine state.Engine
	// Reason is a bounded label of why the engine was chosen (docs/design.md §15). The built-in
	// policies use round_robin, random, power_of_two, power_of_n, least_load; cache-aware
	// cache_candidate, saturation_pin, no_cache_candidate, cost_diverted; session-aware
	// session_primary, assigned, no_session; sticky sticky_primary, sticky_assigned,
	// no_routing_key, rendezvous, rendezvous_bounded; both affinity policies
	// affinity_unavailable.
	Reason string
	// PrefillTokens is the policy's estimate of the prompt tokens the engine will prefill for
	// this request: the input tokens minus those it would serve from the prefix it was seen to
	// hold, whole blocks short of the block holding the last prompt token, which engines compute
	// again (docs/design.md §9.1); at least 1. 0 means the policy made no estimate: the host
	// counts the whole input. The Router passes it to loadmon.InFlight.TryAcquire (docs/design.md §6).
	PrefillTokens uint64
	// InFlightCap is the in-flight cap admission held the engine to, valid when HasInFlightCap
	// (admission.Verdict.InFlightCap; false: no in-flight cap, as with admission.Limits{}). The
	// check read a count that concurrent selections may have raised since, so the dispatch must
	// be counted with loadmon.InFlight.TryAcquire under this cap, a failed acquire being a
	// rejection: a configured cap is a promise, checked and acquired atomically. Router.Select
	// does this; a host that runs bucket.Select itself must too (docs/design.md §5).
	InFlightCap uint64
	// DPRank is the engine's data-parallel rank the request should be served on, valid when
	// HasDPRank. It is named only for an engine with several DP ranks whose ranks report load
	// separately (loadmon.EngineLoad.RankLoads): for a cache hit, the rank holding the deepest
	// prefix; otherwise the least pressured rank. HasDPRank is false when the engine has one rank
	// or nothing is known of its ranks: the engine then places the request itself. The host passes
	// the rank to the engine the way the engine accepts it (docs/design.md §6, "DP-rank-aware
	// picks").
	DPRank    int
	HasDPRank bool
	// HasInFlightCap reports whether InFlightCap is set; false means no in-flight cap.
	HasInFlightCap bool
}

// withRank returns p naming o's DP rank, when o names one.
func (p Pick) withRank(o *loadmon.Observation) Pick {
	if o.HasDPRank {
		p.DPRank, p.HasDPRank = o.DPRank, true
	}
	return p
}

// inFlightCap is the in-flight cap an admission verdict held an engine to (Pick.InFlightCap).
type inFlightCap struct {
	n   uint64
	set bool
}

// withCap returns p carrying the in-flight cap c.
func (p Pick) withCap(c inFlightCap) Pick {
	p.InFlightCap, p.HasInFlightCap = c.n, c.set
	return p
}

var (
	// ErrNoCandidates: the group has no eligible engine, or the policy found nothing to choose.
	// The bucket loop advances to the next bucket.
	ErrNoCandidates = errors.New("no candidates")

	// ErrAdmissionRejected is matched (errors.Is) by *AdmissionRejectedError and
	// *NoAdmissibleEngineError.
	ErrAdmissionRejected = errors.New("admission rejected")

	// ErrOutsideCandidates is matched by *OutsideCandidatesError.
	ErrOutsideCandidates = errors.New("pick outside candidates")

	// ErrInvalidSignal is state.ErrInvalidSignal: an unroutable request fact. Routing stops.
	ErrInvalidSignal = state.ErrInvalidSignal

	// ErrInvalidConfiguration is state.ErrInvalidConfiguration: a policy or bucket that cannot
	// work as configured. Constructors return it; at pick time routing stops.
	ErrInvalidConfiguration = state.ErrInvalidConfiguration
)

// AdmissionRejectedError reports that admission rejected the engine a policy chose. The policy
// does not try another engine; the bucket loop tries the next bucket.
type AdmissionRejectedError struct {
	// Engine is the rejected engine.
	Engine state.Engine
	// Limit is the first failing cap (an admission.Limit… name).
	Limit string
	// Observed and Cap are the engine's metric and the configured cap.
	Observed uint64
	Cap      uint64
}

// Error implements error.
func (e *AdmissionRejectedError) Error() string {
	return fmt.Sprintf("policy: engine %q rejected by admission: %s (observed %d, cap %d)",
		engineID(e.Engine), e.Limit, e.Observed, e.Cap)
}

// Is matches ErrAdmissionRejected.
func (e *AdmissionRejectedError) Is(target error) bool { return target == ErrAdmissionRejected }

// NoAdmissibleEngineError reports that a policy evaluated several engines and admission rejected
// every one. Unwrap returns each *AdmissionRejectedError, so errors.As finds them.
type NoAdmissibleEngineError struct {
	Rejections []*AdmissionRejectedError
}

// Error implements error.
func (e *NoAdmissibleEngineError) Error() string {
	var b strings.Builder
	b.WriteString("policy: no admissible engine: ")
	for i, r := range e.Rejections {
		if i > 0 {
			b.WriteString("; ")
		}
		fmt.Fprintf(&b, "%q %s (observed %d, cap %d)", engineID(r.Engine), r.Limit, r.Observed, r.Cap)
	}
	return b.String()
}

// Is matches ErrAdmissionRejected.
func (e *NoAdmissibleEngineError) Is(target error) bool { return target == ErrAdmissionRejected }

// Unwrap returns every rejection.
func (e *NoAdmissibleEngineError) Unwrap() []error {
	out := make([]error, len(e.Rejections))
	for i, r := range e.Rejections {
		out[i] = r
	}
	return out
}

// OutsideCandidatesError reports a pick that is not one of the exact candidate values, including
// a different value with a candidate's ID. Routing stops with an internal error.
type OutsideCandidatesError struct {
	Engine state.EngineID
}

// Error implements error.
func (e *OutsideCandidatesError) Error() string {
	return fmt.Sprintf("policy: picked engine %q is not one of the candidates", e.Engine)
}

// Is matches ErrOutsideCandidates.
func (e *OutsideCandidatesError) Is(target error) bool { return target == ErrOutsideCandidates }

func engineID(e state.Engine) state.EngineID {
	if e == nil {
		return ""
	}
	return e.ID()
}

// Config is what every concrete policy receives at construction: the shared state handles it
// reads and its admission checker.
type Config struct {
	// Load is the engine-reported load table. Required: admission caps on reported metrics and the
	// load-aware comparisons read it.
	Load *loadmon.Table
	// InFlight is the router-local in-flight counters. Required.
	InFlight *loadmon.InFlight
	// Admission checks the engine a policy is about to return. Nil means admission.Limits{}, which
	// admits everything.
	Admission admission.Checker
	// Rand returns a uniform integer in [0, n). Nil means math/rand/v2's IntN. Tests inject a
	// scripted source; it must be safe for concurrent use.
	Rand func(n int) int
}

// validate fills defaults and checks the required handles.
func (c *Config) validate(policy string) error {
	if c.Load == nil {
		return fmt.Errorf("policy: %s: Config.Load is nil: %w", policy, ErrInvalidConfiguration)
	}
	if c.InFlight == nil {
		return fmt.Errorf("policy: %s: Config.InFlight is nil: %w", policy, ErrInvalidConfiguration)
	}
	if c.Admission == nil {
		c.Admission = admission.Limits{}
	}
	if c.Rand == nil {
		c.Rand = rand.IntN
	}
	return nil
}

// observe reads one engine's observation for req from the pick's snapshot, naming its least
// pressured DP rank for req's stage when the engine has several ranks reporting (docs/design.md
// §6), and carrying req's LoRA adapter for the pressure comparisons (docs/design.md §18).
func (c *Config) observe(snap loadmon.Snapshot, e state.Engine, req *Request) loadmon.Observation {
	o := loadmon.ObserveLeastPressured(snap, c.InFlight, stageOf(req), e.ID())
	o.Adapter = adapterOf(req)
	return o
}

// admit runs the checker once on the engine with the observation the pick already captured. It
// returns the in-flight cap the engine was admitted under, or an *AdmissionRejectedError, or the
// checker's own error wrapped. For a request below flow control's top band (held:
// flowbridge.PrefillHold), an engine under an in-flight cap is admitted only below the cap's last
// slot, which is the top band's (flowbridge.HeldCap, docs/design.md §17), as the Router holds it.
func (c *Config) admit(held bool, e state.Engine, o loadmon.Observation) (inFlightCap, error) {
	v, err := c.Admission.Check(e, admission.Observe(o))
	if err != nil {
		return inFlightCap{}, fmt.Errorf("policy: admission check of %q: %w", e.ID(), err)
	}
	if !v.Admit {
		return inFlightCap{}, &AdmissionRejectedError{Engine: e, Limit: v.Limit, Observed: v.Observed, Cap: v.Cap}
	}
	if held && v.HasInFlightCap && o.InFlight >= flowbridge.HeldCap(v.InFlightCap) {
		return inFlightCap{}, &AdmissionRejectedError{Engine: e, Limit: flowbridge.LimitTopBandSlot, Observed: o.InFlight, Cap: v.InFlightCap}
	}
	return inFlightCap{v.InFlightCap, v.HasInFlightCap}, nil
}

// pickKeyed is pickChecked for an affinity key (a session or routing key): on an engine with
// several DP ranks whose load is known it names the key's rank (keyRank) instead of the least
// pressured one, so that every request of the key reaches the same rank, whose prefix cache is its
// own. Admission checks the engine as for any pick (its caps read the engine's figures, summed over
// its ranks). An empty key, or an engine of one rank, is pickChecked (docs/design.md §12, "DP
// ranks").
func (c *Config) pickKeyed(held bool, e state.Engine, key, reason string, stage state.Stage) (Pick, error) {
	if key == "" {
		return c.pickChecked(held, e, reason, stage)
	}
	snap := c.Load.Snapshot()
	l, ok := snap.Load(e.ID())
	if !ok || len(l.RankLoads) < 2 {
		return c.pickChecked(held, e, reason, stage)
	}
	o := loadmon.ObserveRank(snap, c.InFlight, e.ID(), keyRank(key, len(l.RankLoads)))
	ic, err := c.admit(held, e, o)
	if err != nil {
		return Pick{}, err
	}
	return Pick{Engine: e, Reason: reason}.withRank(&o).withCap(ic), nil
}

// keyRank is the key's DP rank among ranks 0 … n−1: rendezvous (highest random weight) hashing
// of the key over the ranks, so that a change in the number of ranks moves only the keys of the
// ranks added or removed. It allocates nothing.
func keyRank(key string, n int) int {
	seed := xxhash.Sum64String(key)
	best, bestW := 0, uint64(0)
	for r := range n {
		if w := fmix64(seed ^ (uint64(r)+1)*0x9e3779b97f4a7c15); r == 0 || w > bestW {
			best, bestW = r, w
		}
	}
	return best
}

// pickChecked returns the engine after one admission check on a fresh snapshot, naming its least
// pressured DP rank for stage when it has several.
func (c *Config) pickChecked(held bool, e state.Engine, reason string, stage state.Stage) (Pick, error) {
	o := loadmon.ObserveLeastPressured(c.Load.Snapshot(), c.InFlight, stage, e.ID())
	ic, err := c.admit(held, e, o)
	if err != nil {
		return Pick{}, err
	}
	return Pick{Engine: e, Reason: reason}.withRank(&o).withCap(ic), nil
}
