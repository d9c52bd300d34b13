package bucket

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// GroupPicker picks one engine for one stage of a request. *EngineGroup implements it; hosts and
// tests may wrap or fake it. req.Stage and req.BucketID are set by the calling bucket.
type GroupPicker interface {
	Pick(ctx context.Context, registry state.Registry, req *policy.Request) (policy.Pick, error)
}

// EngineGroup owns a membership and the policy attached to it (docs/design.md
// §4). Each pick resolves the registry's live engines for the request's model, keeps the healthy
// ones of the request's stage that are members, sorts them by ID, and asks the policy; the pick it
// returns must be one of those exact Engine values.
//
// An EngineGroup is immutable and safe for concurrent use.
type EngineGroup struct {
	policy  policy.Policy
	members map[state.EngineID]struct{} // nil: every engine
	// cache holds the last filtered, ID-sorted candidates (health excepted) of a
	// state.VersionedRegistry; it is replaced as a whole, never mutated.
	// One slot per stage, because a group may serve prefill and decode.
	cache [3]atomic.Pointer[groupCache]
}

type groupCache struct {
	registry state.Registry
	model    state.ModelID
	stage    state.Stage
	version  uint64
	sorted   []state.Engine
}

var _ GroupPicker = (*EngineGroup)(nil)

// ErrNoCompatibleEngine: a PD bucket's decode group has healthy engines, but none is compatible
// with the prefill engine just picked (docs/design.md §3). It wraps policy.ErrNoCandidates, so the
// bucket loop advances to the next bucket as for any missing candidate.
var ErrNoCompatibleEngine = fmt.Errorf("bucket: no engine compatible with the prefill pick: %w", policy.ErrNoCandidates)

// NewEngineGroup attaches p to a membership. members == nil means every healthy engine of the
// model and stage; an empty, non-nil slice means none (every pick returns policy.ErrNoCandidates
// without calling p). Duplicate IDs are allowed and count once. A nil policy or an empty member
// ID is an error wrapping policy.ErrInvalidConfiguration.
func NewEngineGroup(p policy.Policy, members []state.EngineID) (*EngineGroup, error) {
	if p == nil {
		return nil, fmt.Errorf("bucket: engine group: nil policy: %w", policy.ErrInvalidConfiguration)
	}
	g := &EngineGroup{policy: p}
	if members != nil {
		g.members = make(map[state.EngineID]struct{}, len(members))
		for _, id := range members {
			if id == "" {
				return nil, fmt.Errorf("bucket: engine group: empty member ID: %w", policy.ErrInvalidConfiguration)
			}
			g.members[id] = struct{}{}
		}
	}
	return g, nil
}

// Policy returns the attached policy.
func (g *EngineGroup) Policy() policy.Policy { return g.policy }

// stageSupporter is a policy, or a group, with the optional SupportsStage method (policy.Policy).
type stageSupporter interface {
	SupportsStage(s state.Stage) bool
}

// SupportsStage reports whether the attached policy can serve stage s (its optional SupportsStage
// method, policy.Policy).
func (g *EngineGroup) SupportsStage(s state.Stage) bool {
	if ss, ok := g.policy.(stageSupporter); ok {
		return ss.SupportsStage(s)
	}
	return true
}

// candidateBuf recycles candidate slices so that filtering stays off the heap.
var candidateBuf = sync.Pool{New: func() any { s := make([]state.Engine, 0, 64); return &s }}

// Pick implements GroupPicker. It returns policy.ErrNoCandidates when no engine qualifies (the
// policy is not called), *policy.OutsideCandidatesError when the policy returns anything but one
// of the exact candidates, and otherwise the policy's result unchanged. A nil registry is an error
// wrapping policy.ErrInvalidConfiguration.
//
// The candidate slice handed to the policy is only valid during the call.
func (g *EngineGroup) Pick(ctx context.Context, registry state.Registry, req *policy.Request) (policy.Pick, error) {
	return g.pick(ctx, registry, req, "", false)
}

// pick is Pick; with compat, the candidates are further restricted to the engines whose PD
// compatibility label (state.PDCompatibilityOf) equals label, and the policy sees only those:
// ErrNoCompatibleEngine when healthy candidates exist but none carries the label.
func (g *EngineGroup) pick(ctx context.Context, registry state.Registry, req *policy.Request, label string, compat bool) (policy.Pick, error) {
	if registry == nil {
		return policy.Pick{}, fmt.Errorf("bucket: engine group: nil registry: %w", policy.ErrInvalidConfiguration)
	}
	if g.members != nil && len(g.members) == 0 {
		return policy.Pick{}, policy.ErrNoCandidates
	}
	bp := candidateBuf.Get().(*[]state.Engine)
	cands := (*bp)[:0]
	defer func() {
		clear(cands)
		*bp = cands[:0]
		candidateBuf.Put(bp)
	}()
	if vr, ok := registry.(state.VersionedRegistry); ok {
		// The registry promises a new version for any change but health: filter and sort once
		// per version, then only re-check health. The version is read before the engines, so a
		// concurrent change can only make the cache stale-marked, never wrong-marked.
		v := vr.EnginesVersion(req.Model)
		slot := &g.cache[int(req.Stage)%len(g.cache)]
		c := slot.Load()
		if c == nil || c.registry != registry || c.model != req.Model || c.stage != req.Stage || c.version != v {
			c = &groupCache{registry: registry, model: req.Model, stage: req.Stage, version: v,
				sorted: g.filter(nil, registry.Engines(req.Model), req, false)}
			slot.Store(c)
		}
		for _, e := range c.sorted {
			if e.Healthy() {
				cands = append(cands, e)
			}
		}
	} else {
		cands = g.filter(cands, registry.Engines(req.Model), req, true)
	}
	if len(cands) == 0 {
		return policy.Pick{}, policy.ErrNoCandidates
	}
	if compat {
		kept := cands[:0]
		for _, e := range cands {
			if state.PDCompatibilityOf(e) == label {
				kept = append(kept, e)
			}
		}
		clear(cands[len(kept):])
		if cands = kept; len(cands) == 0 {
			return policy.Pick{}, ErrNoCompatibleEngine
		}
	}
	pk, err := g.policy.Pick(ctx, cands, req)
	if err != nil {
		return policy.Pick{}, err
	}
	for _, c := range cands {
		if c == pk.Engine {
			return pk, nil
		}
	}
	var id state.EngineID
	if pk.Engine != nil {
		id = pk.Engine.ID()
	}
	return policy.Pick{}, &policy.OutsideCandidatesError{Engine: id}
}

// Engines appends to dst the healthy engines of the model that the bucket's group of stage s may
// pick (docs/design.md §4), sorted by ID: for an *EngineGroup its members, for a host's own
// GroupPicker every engine of the model and stage. PD compatibility is not applied. A stage the
// bucket has no group for, or a nil registry, appends nothing. A Router's saturation detector
// reads it (docs/design.md §17).
func (b *Bucket) Engines(registry state.Registry, model state.ModelID, s state.Stage, dst []state.Engine) []state.Engine {
	var g GroupPicker
	switch s {
	case state.StagePlain:
		g = b.plain
	case state.StagePrefill:
		g = b.prefill
	case state.StageDecode:
		g = b.decode
	}
	if g == nil || registry == nil {
		return dst
	}
	eg, ok := g.(*EngineGroup)
	if !ok {
		eg = &everyEngine
	} else if eg.members != nil && len(eg.members) == 0 {
		return dst
	}
	return eg.filter(dst, registry.Engines(model), &policy.Request{Model: model, Stage: s}, true)
}

// everyEngine filters for a host's GroupPicker: no membership.
var everyEngine EngineGroup

// filter appends to dst the engines of the request's model and stage that are members (and
// healthy, when health is true), sorted by ID.
func (g *EngineGroup) filter(dst, engines []state.Engine, req *policy.Request, health bool) []state.Engine {
	start := len(dst)
	for _, e := range engines {
		if e == nil || e.Model() != req.Model || e.Stage() != req.Stage || (health && !e.Healthy()) {
			continue
		}
		if g.members != nil {
			if _, ok := g.members[e.ID()]; !ok {
				continue
			}
		}
		dst = append(dst, e)
	}
	byID := func(a, b state.Engine) int { return cmp.Compare(a.ID(), b.ID()) }
	if !slices.IsSortedFunc(dst[start:], byID) {
		slices.SortFunc(dst[start:], byID)
	}
	return dst
}
