package bucket

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"sync"

	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// GroupPicker picks one engine for one stage of a request. *EngineGroup implements it; hosts and
// tests may wrap or fake it. req.Stage and req.BucketID are set by the calling bucket.
type GroupPicker interface {
	Pick(ctx context.Context, registry state.Registry, req *policy.Request) (policy.Pick, error)
}

// EngineGroup owns a membership and the policy attached to it (seeds/POLICY_DESIGN.md principle
// 3). Each pick resolves the registry's live engines for the request's model, keeps the healthy
// ones of the request's stage that are members, sorts them by ID, and asks the policy; the pick it
// returns must be one of those exact Engine values.
//
// An EngineGroup is immutable and safe for concurrent use.
type EngineGroup struct {
	policy  policy.Policy
	members map[state.EngineID]struct{} // nil: every engine
}

var _ GroupPicker = (*EngineGroup)(nil)

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

// SupportsStage reports whether the attached policy can serve stage s (policy.StageSupporter).
func (g *EngineGroup) SupportsStage(s state.Stage) bool {
	if ss, ok := g.policy.(policy.StageSupporter); ok {
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
	for _, e := range registry.Engines(req.Model) {
		if e == nil || e.Model() != req.Model || e.Stage() != req.Stage || !e.Healthy() {
			continue
		}
		if g.members != nil {
			if _, ok := g.members[e.ID()]; !ok {
				continue
			}
		}
		cands = append(cands, e)
	}
	if len(cands) == 0 {
		return policy.Pick{}, policy.ErrNoCandidates
	}
	byID := func(a, b state.Engine) int { return cmp.Compare(a.ID(), b.ID()) }
	if !slices.IsSortedFunc(cands, byID) {
		slices.SortFunc(cands, byID)
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
