package bucket_test

import (
	"context"
	"sync"

	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

var ctx = context.Background()

// fakePolicy records each call and picks by a rule.
type fakePolicy struct {
	mu     sync.Mutex
	calls  int
	seen   [][]state.EngineID
	reqs   []policy.Request
	choose func(engines []state.Engine, req *policy.Request) (policy.Pick, error)
}

// first returns a policy that picks the first candidate.
func first() *fakePolicy {
	return &fakePolicy{choose: func(es []state.Engine, _ *policy.Request) (policy.Pick, error) {
		return policy.Pick{Engine: es[0], Reason: "first"}, nil
	}}
}

// failing returns a policy that fails with err.
func failing(err error) *fakePolicy {
	return &fakePolicy{choose: func([]state.Engine, *policy.Request) (policy.Pick, error) { return policy.Pick{}, err }}
}

// rejecting returns a policy that admission-rejects its first candidate with limit.
func rejecting(limit string) *fakePolicy {
	return &fakePolicy{choose: func(es []state.Engine, _ *policy.Request) (policy.Pick, error) {
		return policy.Pick{}, &policy.AdmissionRejectedError{Engine: es[0], Limit: limit, Observed: 1, Cap: 1}
	}}
}

func (p *fakePolicy) Pick(_ context.Context, es []state.Engine, req *policy.Request) (policy.Pick, error) {
	p.mu.Lock()
	p.calls++
	ids := make([]state.EngineID, len(es))
	for i, e := range es {
		ids[i] = e.ID()
	}
	p.seen = append(p.seen, ids)
	p.reqs = append(p.reqs, *req)
	p.mu.Unlock()
	return p.choose(es, req)
}

func (p *fakePolicy) Calls() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.calls
}

func group(p policy.Policy, members ...state.EngineID) *bucket.EngineGroup {
	g, err := bucket.NewEngineGroup(p, members)
	if err != nil {
		panic(err)
	}
	return g
}

func allGroup(p policy.Policy) *bucket.EngineGroup {
	g, err := bucket.NewEngineGroup(p, nil)
	if err != nil {
		panic(err)
	}
	return g
}

func plainBucket(spec bucket.Spec, g bucket.GroupPicker) *bucket.Bucket {
	b, err := bucket.NewPlainBucket(spec, g)
	if err != nil {
		panic(err)
	}
	return b
}

func pdBucket(spec bucket.Spec, p, d bucket.GroupPicker) *bucket.Bucket {
	b, err := bucket.NewPDBucket(spec, p, d)
	if err != nil {
		panic(err)
	}
	return b
}

func registry(es ...state.Engine) *state.StaticRegistry {
	r, err := state.NewStaticRegistry(es...)
	if err != nil {
		panic(err)
	}
	return r
}

func eng(id state.EngineID, stage state.Stage) *state.StaticEngine {
	return state.NewStaticEngine(id, "m", stage)
}

func ids(bs []*bucket.Bucket) []string {
	out := make([]string, len(bs))
	for i, b := range bs {
		out[i] = b.ID()
	}
	return out
}
