package policy

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/internal/flowbridge"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/state"
)

// Affinity store namespaces of the two policies, so that a session key and a routing key with
// equal text never share a binding in one store.
const (
	sessionNamespace = "session"
	stickyNamespace  = "sticky"
)

// maxReconcile bounds how often a pick re-replaces a binding that concurrent writers keep
// pointing outside this group's candidates (docs/design.md §12, "reconcile conflicts with
// bounded retry").
const maxReconcile = 3

// SessionAwareOptions configures SessionAware.
type SessionAwareOptions struct {
	// Store holds the session bindings; share one store among every router replica and every
	// group that should agree. Required.
	Store affinity.Store
	// Choices is N of the power-of-N pick for new, unbound and keyless sessions. 0 means
	// 2; negative is invalid.
	Choices int
	// FallbackOnUnavailable makes a store failure (affinity.ErrUnavailable) degrade to the
	// fallback's admitted pick, unbound, with affinity_unavailable. False (the default)
	// returns the store's *affinity.UnavailableError, which stops the bucket loop (HTTP 500)
	// and which a host can detect with errors.Is to route around, for example by selecting
	// again without the session key.
	FallbackOnUnavailable bool
}

// sessionAware is the policy NewSessionAware returns.
type sessionAware struct {
	core affinityCore
}

var _ Policy = (*sessionAware)(nil)

// NewSessionAware returns a session-aware policy over opts.Store. Errors wrap
// ErrInvalidConfiguration: a nil Store, a negative Choices, or a nil required Config handle.
//
// The policy keeps each session on one engine per (model, bucket, stage) scope
// (docs/design.md §12; sgl-project/sglang
// `experimental/sgl-router/src/policies_reorg/session_aware.rs`). Per pick, with the session key
// from Request.SessionKey:
//
//  1. No candidates → ErrNoCandidates; nothing is read, admission is not called.
//  2. No (empty) session key → power-of-N with admission.Limits{}, then this policy's admission
//     on its pick → no_session. Nothing is bound.
//  3. A key longer than affinity.MaxKeyBytes → an error wrapping affinity.ErrInvalidKey
//     (ErrInvalidSignal); nothing is read or written.
//  4. A live binding to a candidate (the exact candidate value with the bound ID, so an engine
//     re-registered under the same ID is returned as its live value) → admission on it,
//     whatever its pressure → session_primary. A rejection is returned
//     (*AdmissionRejectedError); the binding is kept and no other engine is tried.
//  5. No binding, or one whose engine is not a candidate (removed, unhealthy, outside the
//     group) → power-of-N with admission.Limits{}, then this policy's admission on its pick. A
//     rejection is returned and the binding is left as it was. Admitted → first-bind (no
//     binding) or replace of the dead binding. If the store answers with a concurrent
//     writer's engine that is a candidate, that engine is checked once and returned
//     (session_primary), or its rejection returned with the binding kept; an engine
//     outside the candidates is replaced again, up to 3 times, after which the admitted pick
//     is returned unbound. Otherwise → assigned.
//
// A binding records a placement, not a dispatch: it stays if a later PD group or the dispatch
// fails. The caller owns the store, its idle timeout and its sweeper.
//
// Pick errors: ErrNoCandidates; *AdmissionRejectedError; an error wrapping affinity.ErrInvalidKey
// (ErrInvalidSignal) for an over-long key; an *affinity.UnavailableError (wrapped) when the store
// fails and FallbackOnUnavailable is off; the admission checker's error.
func NewSessionAware(cfg Config, opts SessionAwareOptions) (Policy, error) {
	if err := cfg.validate(label.SessionAware); err != nil {
		return nil, err
	}
	if opts.Store == nil {
		return nil, fmt.Errorf("policy: %s: SessionAwareOptions.Store is nil: %w", label.SessionAware, ErrInvalidConfiguration)
	}
	if opts.Choices < 0 {
		return nil, fmt.Errorf("policy: %s: SessionAwareOptions.Choices %d: must be >= 0: %w", label.SessionAware, opts.Choices, ErrInvalidConfiguration)
	}
	if opts.Choices == 0 {
		opts.Choices = defaultChoices
	}
	fb := cfg
	fb.Admission = admission.Limits{}
	fallback, err := NewPowerOfN(fb, opts.Choices)
	if err != nil {
		return nil, err
	}
	return &sessionAware{core: affinityCore{
		cfg: cfg, store: opts.Store, namespace: sessionNamespace, fallback: fallback,
		failOpen: opts.FallbackOnUnavailable, name: label.SessionAware,
		primary: label.ReasonSessionPrimary, assigned: label.ReasonAssigned, noKey: label.ReasonNoSession,
	}}, nil
}

// Pick implements Policy.
func (p *sessionAware) Pick(ctx context.Context, engines []state.Engine, req *Request) (Pick, error) {
	key := ""
	if req != nil {
		key = req.SessionKey
	}
	return p.core.pick(ctx, engines, req, key)
}

// affinityCore is the store-backed reuse-or-bind algorithm sessionAware and sticky share; they
// differ in namespace, fallback and reason labels.
type affinityCore struct {
	cfg       Config
	store     affinity.Store
	namespace string
	fallback  Policy // built with admission.Limits{}: this policy checks the fallback's pick
	failOpen  bool
	name      string

	primary, assigned, noKey string
}

func (a *affinityCore) pick(ctx context.Context, engines []state.Engine, req *Request, key string) (Pick, error) {
	if len(engines) == 0 {
		return Pick{}, ErrNoCandidates
	}
	if key == "" {
		return a.fallbackPick(ctx, engines, req, "", a.noKey)
	}
	scope := affinity.Scope{Namespace: a.namespace, Key: key}
	if req != nil {
		scope.Model, scope.BucketID, scope.Stage = req.Model, req.BucketID, req.Stage
	}
	if err := scope.Validate(); err != nil {
		return Pick{}, fmt.Errorf("policy: %s: %w", a.name, err)
	}
	bound, ok, err := a.store.Lookup(ctx, scope)
	if err != nil {
		if a.failOpen {
			return a.fallbackPick(ctx, engines, req, key, label.ReasonAffinityUnavailable)
		}
		return Pick{}, fmt.Errorf("policy: %s: %w", a.name, err)
	}
	if ok {
		if e := findCandidate(engines, bound); e != nil {
			return a.cfg.pickKeyed(flowbridge.PrefillHold(ctx), e, key, a.primary, stageOf(req))
		}
	}
	pk, err := a.fallbackPick(ctx, engines, req, key, a.assigned)
	if err != nil {
		return Pick{}, err // a rejection never rewrites the binding
	}
	want := pk.Engine.ID()
	var eff state.EngineID
	if ok {
		eff, err = a.store.Replace(ctx, scope, bound, want)
	} else {
		eff, err = a.store.Bind(ctx, scope, want)
	}
	for attempt := 1; ; attempt++ {
		if err != nil {
			if a.failOpen {
				pk.Reason = label.ReasonAffinityUnavailable
				return pk, nil
			}
			return Pick{}, fmt.Errorf("policy: %s: %w", a.name, err)
		}
		if eff == want {
			return pk, nil
		}
		if w := findCandidate(engines, eff); w != nil {
			// A concurrent writer won with a candidate: check it before returning it.
			return a.cfg.pickKeyed(flowbridge.PrefillHold(ctx), w, key, a.primary, stageOf(req))
		}
		if attempt > maxReconcile {
			return pk, nil
		}
		eff, err = a.store.Replace(ctx, scope, eff, want)
	}
}

// fallbackPick runs the fallback (which admits everything) and then this policy's admission on
// its pick, with a fresh snapshot, naming the key's DP rank when there is a key (pickKeyed), so
// that a new binding starts on the rank its later requests will use.
func (a *affinityCore) fallbackPick(ctx context.Context, engines []state.Engine, req *Request, key, reason string) (Pick, error) {
	pk, err := a.fallback.Pick(ctx, engines, req)
	if err != nil {
		return Pick{}, err
	}
	return a.cfg.pickKeyed(flowbridge.PrefillHold(ctx), pk.Engine, key, reason, stageOf(req))
}

// findCandidate returns the candidate with the ID, or nil. Candidates come sorted by ID (Policy
// contract), so a binary search finds it; an unsorted slice from a direct caller is scanned.
func findCandidate(engines []state.Engine, id state.EngineID) state.Engine {
	i, found := slices.BinarySearchFunc(engines, id, func(e state.Engine, id state.EngineID) int {
		return strings.Compare(string(e.ID()), string(id))
	})
	if found {
		return engines[i]
	}
	for _, e := range engines {
		if e.ID() == id {
			return e
		}
	}
	return nil
}
