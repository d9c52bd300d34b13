// Package label holds the metric label values the routing packages emit and package metrics
// declares its series with: the policies' configuration names, their pick reasons, the
// cache-aware decisions and the failure reasons of a selection (docs/design.md §15). The values
// are API: dashboards and alerts read them, so they never change.
package label

// Configuration names of the built-in policies (docs/design.md §14.2); power_of_two is power_of_n
// with N = 2.
const (
	RoundRobin   = "round_robin"
	Random       = "random"
	PowerOfTwo   = "power_of_two"
	PowerOfN     = "power_of_n"
	LeastLoad    = "least_load"
	CacheAware   = "cache_aware"
	SessionAware = "session_aware"
	Sticky       = "sticky"
)

// Pick reasons (policy.Pick.Reason).
const (
	ReasonRoundRobin = "round_robin"
	ReasonRandom     = "random"
	ReasonPowerOfTwo = "power_of_two"
	ReasonPowerOfN   = "power_of_n"
	ReasonLeastLoad  = "least_load"
	// Cache-aware (docs/design.md §9).
	ReasonCacheCandidate   = "cache_candidate"
	ReasonSaturationPin    = "saturation_pin"
	ReasonNoCacheCandidate = "no_cache_candidate"
	ReasonCostDiverted     = "cost_diverted"
	// Session-aware (docs/design.md §12.2).
	ReasonSessionPrimary = "session_primary"
	ReasonAssigned       = "assigned"
	ReasonNoSession      = "no_session"
	// Sticky (docs/design.md §12.3).
	ReasonStickyPrimary     = "sticky_primary"
	ReasonStickyAssigned    = "sticky_assigned"
	ReasonNoRoutingKey      = "no_routing_key"
	ReasonRendezvous        = "rendezvous"
	ReasonRendezvousBounded = "rendezvous_bounded"
	// Both affinity policies, when their store failed and they fall back.
	ReasonAffinityUnavailable = "affinity_unavailable"
)

// Cache-aware decisions (policy.CacheDecision.Decision; docs/design.md §9.8), exactly one per
// cache-aware pick that selected an engine.
const (
	DecisionCacheHit          = "cache_hit"
	DecisionCacheMiss         = "cache_miss"
	DecisionCacheWorkerQueued = "cache_worker_queued"
	DecisionAllQueued         = "all_queued"
	DecisionCostDiverted      = "cost_diverted"
)

// Decisions lists every cache-aware decision; package metrics counts only these, so a decision
// outside them would break the sum of docs/design.md §15.3.
var Decisions = [...]string{DecisionCacheHit, DecisionCacheMiss, DecisionCacheWorkerQueued, DecisionAllQueued, DecisionCostDiverted}

// Failure reasons of a selection or a dispatch (enginepick.FailureReason).
const (
	FailNoMatchingBucket     = "no_matching_bucket"
	FailUnknownModel         = "unknown_model"
	FailAdmissionRejected    = "admission_rejected"
	FailFlowRejected         = "flow_rejected"
	FailFlowTimeout          = "flow_timeout"
	FailNoCandidates         = "no_candidates"
	FailInvalidSignal        = "invalid_signal"
	FailInvalidConfiguration = "invalid_configuration"
	FailOutsideCandidates    = "outside_candidates"
	FailCanceled             = "canceled"
	FailDeadlineExceeded     = "deadline_exceeded"
	FailError                = "error"
)

// Reasons of a flow-control rejection (flowcontrol.RejectedError.Reason; docs/design.md §17).
const (
	FlowQueueFull = "queue_full"
	FlowDisplaced = "displaced"
	FlowSheddable = "sheddable"
)

// Ends of a flow-control wait other than a rejection (flowcontrol.Event.Outcome).
const (
	FlowServed   = "served"
	FlowFailed   = "failed"
	FlowExpired  = "expired"
	FlowCanceled = "canceled"
)

// FlowOutcomes lists every flowcontrol.Event.Outcome of a request that left the queue or was
// refused.
var FlowOutcomes = [...]string{FlowServed, FlowFailed, FlowQueueFull, FlowDisplaced, FlowSheddable, FlowExpired, FlowCanceled}

// Failures lists every failure reason.
var Failures = []string{FailNoMatchingBucket, FailUnknownModel, FailAdmissionRejected, FailFlowRejected, FailFlowTimeout,
	FailNoCandidates, FailInvalidSignal, FailInvalidConfiguration, FailOutsideCandidates, FailCanceled, FailDeadlineExceeded, FailError}

// Reasons maps each built-in policy's configuration name to the pick reasons it produces, for
// the series package metrics declares up front.
var Reasons = map[string][]string{
	RoundRobin:   {ReasonRoundRobin},
	Random:       {ReasonRandom},
	PowerOfTwo:   {ReasonPowerOfTwo},
	PowerOfN:     {ReasonPowerOfN, ReasonPowerOfTwo},
	LeastLoad:    {ReasonLeastLoad},
	CacheAware:   {ReasonCacheCandidate, ReasonSaturationPin, ReasonNoCacheCandidate, ReasonCostDiverted},
	SessionAware: {ReasonSessionPrimary, ReasonAssigned, ReasonNoSession, ReasonAffinityUnavailable},
	Sticky: {ReasonStickyPrimary, ReasonStickyAssigned, ReasonNoRoutingKey, ReasonRendezvous, ReasonRendezvousBounded,
		ReasonAffinityUnavailable},
}
