package enginepick

import (
	"context"
	"errors"
	"time"

	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/flowcontrol"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// Observer receives what a Router decides and what became of its dispatches, for metrics
// (docs/design.md §15). The Prometheus implementation is package metrics; hosts without
// Prometheus implement their own or pass none.
//
// Every method is called synchronously on the request path: keep it cheap and non-blocking, and
// safe for concurrent use. Label values the Router hands over are bounded: configured model,
// bucket and engine IDs, policy names, reason labels; never a per-request value.
//
// Optional capabilities, detected once when the Router is built: an Observer that also implements
// policy.CacheObserver receives every cache-aware decision (docs/design.md §9.8) from the policies
// package config builds; one that implements config.RouterAttacher is attached to the Router
// config.New built, to read its shared state when scraped; one that implements
// SelectTimingSampler has only a sample of selections timed; one that implements
// flowcontrol.Observer receives the events of the flow control config.New builds.
type Observer interface {
	// ObserveGroup is called once per engine group by config.New, before the Router serves a
	// request (a host that builds its groups itself calls it, and wraps the group's policy,
	// itself). The returned PickObserver (nil for none) receives every pick of that group's policy.
	ObserveGroup(g GroupInfo) PickObserver
	// ObserveSelect is called once per Router.Select, successful or not. The event is passed by
	// value so that reporting allocates nothing; e.Selection is valid only during the call.
	ObserveSelect(e SelectEvent)
	// ObserveDone is called once per Dispatch.Done (not for Release).
	ObserveDone(e DoneEvent)
}

// SelectTimingSampler is an optional interface of an Observer that needs the duration of only a
// sample of selections, for a latency distribution: NewRouter asks once, and the Router then reads the
// clock at the start of one Router.Select in SelectTimingEvery, chosen at random, and reports the
// others with SelectEvent.Timed false. Every selection is still reported. An Observer without it
// has every selection timed.
type SelectTimingSampler interface {
	// SelectTimingEvery returns N ≥ 1: one selection in N, on average, is timed; 1 times every
	// selection. A value below 1 counts as 1.
	SelectTimingEvery() int
}

// GroupInfo identifies one engine group: its model, bucket, stage and the configuration name of
// its policy type (round_robin … cache_aware, or a type the host registered).
type GroupInfo struct {
	Model  state.ModelID
	Bucket string
	Stage  state.Stage
	Policy string
}

// PickObserver receives every pick of one group's policy: the pick when err is nil, else the
// policy's error (its admission rejections are reachable with errors.As). A pick of a PD attempt
// whose other stage then failed is still a pick. The group does not call its policy, and so its
// PickObserver, when it has no candidate.
type PickObserver interface {
	ObservePick(pk policy.Pick, err error)
}

// SelectEvent is one Router.Select.
type SelectEvent struct {
	// Model is the requested model when the Router serves it; empty for an unknown model, so
	// that a label never carries a client-chosen value.
	Model state.ModelID
	// Selection is the complete selection on success, nil on failure.
	Selection *bucket.Selection
	// Err is Select's error, nil on success; Reason is FailureReason(Err).
	Err    error
	Reason string
	// Duration is the time Select took, on the Router's clock, when Timed; 0 otherwise.
	Duration time.Duration
	// Timed says whether Duration was measured: always, unless the Observer implements
	// SelectTimingSampler and this selection was not in the sample.
	Timed bool
}

// Outcome is what became of a dispatch, as the host learned it, in the spirit of grpc-go's
// balancer.DoneInfo. The zero Outcome is a success about which nothing else is known.
type Outcome struct {
	// Err is the dispatch's failure (transport error, engine error status, client gone); nil for
	// success.
	Err error
	// TTFT is the time from dispatch to the first output token; 0 means unknown (no token).
	TTFT time.Duration
	// PromptTokens and OutputTokens are the request's prompt and generated tokens, as the engine
	// reported them; 0 means unknown or none.
	PromptTokens uint64
	OutputTokens uint64
	// CachedTokens is the prompt tokens the engine reported it served from its prefix cache
	// (OpenAI usage.prompt_tokens_details.cached_tokens); meaningful only when
	// CachedTokensReported.
	CachedTokens         uint64
	CachedTokensReported bool
}

// DoneEvent is one Dispatch.Done.
type DoneEvent struct {
	// Model and Bucket are the selection's model and bucket ID.
	Model  state.ModelID
	Bucket string
	// Engines are the dispatched engines: Engines[0] is the plain or the prefill engine,
	// Engines[1] the decode engine of a PD dispatch; N is 1 or 2.
	Engines [2]DispatchedEngine
	N       int
	// Outcome is what the host reported; Reason is FailureReason(Outcome.Err), empty on success.
	Outcome Outcome
	Reason  string
	// Duration is the time from the end of Select to Done, on the Router's clock.
	Duration time.Duration
}

// DispatchedEngine is one engine of a dispatch with the group policy that chose it.
type DispatchedEngine struct {
	ID     state.EngineID
	Stage  state.Stage
	Policy string
	Reason string
}

// FailureReason maps an error of Router.Select, or of a dispatch, to a bounded label: "" for nil;
// flow_rejected for a *flowcontrol.RejectedError (429) and flow_timeout for
// flowcontrol.ErrTimeout (503), whatever refusal they wrap; canceled and deadline_exceeded for
// context errors; no_matching_bucket, unknown_model, invalid_signal, invalid_configuration and
// outside_candidates for those errors; admission_rejected when the bucket loop ended with at least
// one admission rejection and no_candidates when it ended without; error for anything else
// (docs/design.md §15).
func FailureReason(err error) string {
	var rejected *flowcontrol.RejectedError
	switch {
	case err == nil:
		return ""
	case errors.As(err, &rejected):
		return label.FailFlowRejected
	case errors.Is(err, flowcontrol.ErrTimeout):
		return label.FailFlowTimeout
	case errors.Is(err, context.Canceled):
		return label.FailCanceled
	case errors.Is(err, context.DeadlineExceeded):
		return label.FailDeadlineExceeded
	case errors.Is(err, bucket.ErrNoMatchingBucket):
		return label.FailNoMatchingBucket
	case errors.Is(err, bucket.ErrUnknownModel):
		return label.FailUnknownModel
	case errors.Is(err, policy.ErrInvalidSignal):
		return label.FailInvalidSignal
	case errors.Is(err, policy.ErrInvalidConfiguration):
		return label.FailInvalidConfiguration
	case errors.Is(err, policy.ErrOutsideCandidates):
		return label.FailOutsideCandidates
	case errors.Is(err, policy.ErrAdmissionRejected):
		return label.FailAdmissionRejected
	case errors.Is(err, policy.ErrNoCandidates):
		return label.FailNoCandidates
	}
	var ex *bucket.ExhaustedError
	if errors.As(err, &ex) {
		if len(ex.Rejections) > 0 {
			return label.FailAdmissionRejected
		}
		return label.FailNoCandidates
	}
	return label.FailError
}
