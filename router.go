package enginepick

import (
	"context"
	"fmt"

	"go.uber.org/zap"

	"github.com/enginepick/enginepick/bucket"
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
}

// Router selects engines for requests of several models and accounts for the dispatches that
// follow. It is safe for concurrent use; its resolver map is fixed at construction.
type Router struct {
	registry  state.Registry
	resolvers map[state.ModelID]*bucket.Resolver
	inflight  *loadmon.InFlight
	load      *loadmon.Table
	index     *kvindex.Index
	log       *zap.Logger
}

// NewRouter validates opts and returns a Router. A nil Registry, nil InFlight, nil Resolvers map or
// a nil resolver in it is an error wrapping policy.ErrInvalidConfiguration.
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
	return &Router{registry: opts.Registry, resolvers: resolvers, inflight: opts.InFlight, load: opts.Load, index: opts.Index, log: log}, nil
}

// Dispatch is a complete selection whose engines have been counted as in flight. Forward the
// request to the selected engines, then call Release when the response (or stream) ends, however
// it ends. Release is idempotent and safe for concurrent use.
type Dispatch struct {
	// Selection is the bucket's complete choice.
	Selection bucket.Selection
	guards    [2]*loadmon.Guard
}

// Release ends the dispatch's hold on every selected engine's in-flight counter. A nil *Dispatch's
// Release does nothing.
func (d *Dispatch) Release() {
	if d == nil {
		return
	}
	for _, g := range d.guards {
		g.Release()
	}
}

// Select resolves the request's model, runs the bucket loop (bucket.Select) with a prefix-lookup
// memo for the request (a new kvindex.Memo when req.Memo is nil; req is not modified) and, on success,
// acquires one in-flight guard per selected engine: the plain engine, or the prefill and the
// decode engine. The plain or prefill guard records the dispatch's prefill tokens
// (Pick.PrefillTokens, else the input tokens) so that pressure comparisons count them until the
// engine's next load report (docs/design.md §6). Nothing is acquired on failure.
//
// Errors: a nil req wraps policy.ErrInvalidSignal; ErrUnknownModel (404); otherwise bucket.Select's
// errors (bucket.StatusCode maps them). A nil ctx means context.Background().
func (r *Router) Select(ctx context.Context, req *bucket.Request) (*Dispatch, error) {
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
		withMemo.Memo = kvindex.NewMemo()
		req = &withMemo
	}
	sel, err := bucket.Select(ctx, res, r.registry, req)
	if err != nil {
		if ce := r.log.Check(zap.DebugLevel, "selection failed"); ce != nil {
			ce.Write(zap.String("model", string(req.Model)), zap.Int64("input_tokens", req.InputTokens),
				zap.Int("status", bucket.StatusCode(err)), zap.Error(err))
		}
		return nil, err
	}
	d := &Dispatch{Selection: sel}
	if sel.IsPD() {
		d.guards[0] = r.inflight.AcquirePrefill(sel.Prefill.Engine.ID(), prefillTokens(&sel.Prefill, req))
		d.guards[1] = r.inflight.Acquire(sel.Decode.Engine.ID())
	} else {
		d.guards[0] = r.inflight.AcquirePrefill(sel.Plain.Engine.ID(), prefillTokens(&sel.Plain, req))
	}
	return d, nil
}

// prefillTokens is the prefill work a dispatch brings: the policy's estimate, else the whole input.
func prefillTokens(p *policy.Pick, req *bucket.Request) uint64 {
	if p.PrefillTokens > 0 {
		return p.PrefillTokens
	}
	return uint64(max(req.InputTokens, 0))
}

// RemoveEngine forgets router-side state of an engine the host removed from its registry: its load
// reports (when Options.Load is set), its blocks in the prefix index (when Options.Index is set)
// and its in-flight counter. Guards of requests still running release safely into the detached
// counter. Removing an engine the router never heard of does nothing.
func (r *Router) RemoveEngine(id state.EngineID) {
	if r.load != nil {
		r.load.Forget(id)
	}
	if r.index != nil {
		_ = r.index.RemoveEngine(id) // an engine with no blocks is not an error here
	}
	r.inflight.Remove(id)
}
