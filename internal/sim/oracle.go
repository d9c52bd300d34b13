package sim

import (
	"context"
	"fmt"

	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// Names of the oracle baselines (see Oracle).
const (
	// NameOracle is the oracle that minimises the request's own predicted TTFT.
	NameOracle = "oracle"
	// NameOracleWork is the oracle that also charges the prefill a pick causes a second time, for
	// the requests that will queue behind it.
	NameOracleWork = "oracle_work"
)

// ReasonOracle labels an Oracle pick: the lowest predicted cost.
const ReasonOracle = "oracle_min_cost"

// Oracle is a measuring stick, not a router: a replay baseline that reads the simulated engines
// themselves instead of what a router can know. For every candidate engine it knows the exact
// cache contents, the prompts queued and in prefill, and the step in progress, and it predicts the
// request's TTFT there as
//
//	wait(e) + own(e)
//
// where wait(e) is the engine's pending prefill time (the rest of the step in progress, the rest
// of every prompt in prefill and every queued prompt's uncached part, each priced by the engine
// model with its attention term; a decode run in progress adds the rest of its current step, since
// the engine gives prefill priority at every step boundary), and own(e) the request's own prefill
// time on e with the prompt blocks e will hold when it gets there: those in its cache now or in a
// prompt queued or in prefill before it. It picks the engine minimising
//
//	wait(e) + (1 + WorkWeight) · own(e)
//
// so WorkWeight 0 (NameOracle) is the greedy minimum of the request's predicted TTFT, and
// WorkWeight 1 (NameOracleWork) also charges the prefill the pick adds to the fleet once more, for
// the requests that will wait behind it. Exact ties are broken uniformly at random.
//
// It is not an upper bound in the strict sense (a greedy rule is not an optimal schedule, and the
// prediction ignores KV-capacity stalls and later arrivals), but it is what a router with perfect,
// instantaneous knowledge of every engine picks by the same cost, so it bounds what better
// information could buy over the library's policies on the same engine model
// (docs/performance.md "Capacity and its ceiling"). It only runs inside a replay (PolicyEnv from
// Replay); the admission checker runs once on its pick.
type Oracle struct {
	peerBase
	r          *run
	workWeight float64
	name       string
	hashes     []uint64
	scratch    []byte
}

var _ policy.Policy = (*Oracle)(nil)

// NewOracle returns the oracle over the replay behind env with the given work weight (≥ 0). An env
// not built by a replay, or a negative weight, is an error wrapping state.ErrInvalidConfiguration.
func NewOracle(env PolicyEnv, name string, workWeight float64) (*Oracle, error) {
	if env.run == nil {
		return nil, fmt.Errorf("sim: %s: needs the PolicyEnv of a replay: %w", name, state.ErrInvalidConfiguration)
	}
	if !(workWeight >= 0) {
		return nil, fmt.Errorf("sim: %s: work weight %v must be >= 0: %w", name, workWeight, state.ErrInvalidConfiguration)
	}
	base, err := newPeerBase(name, env)
	if err != nil {
		return nil, err
	}
	return &Oracle{peerBase: base, r: env.run, workWeight: workWeight, name: name}, nil
}

// Pick implements policy.Policy. No candidates → policy.ErrNoCandidates; a candidate outside the
// simulated fleet is an error.
func (o *Oracle) Pick(_ context.Context, engines []state.Engine, req *policy.Request) (policy.Pick, error) {
	if len(engines) == 0 {
		return policy.Pick{}, policy.ErrNoCandidates
	}
	input := 0
	var tokens []uint32
	root := uint64(engineHashSeed)
	if req != nil {
		input, tokens = int(req.InputTokens), req.TokenIDs
		if a, ok := o.r.rc.adapterIDs[req.Adapter]; ok && req.Adapter != "" {
			root = o.r.rc.adapterRoots[a]
		}
	}
	B := o.r.rc.Model.BlockTokens
	o.hashes, o.scratch = appendEngineHashes(o.hashes[:0], o.scratch, tokens, B, root)
	t := tieBreak{rand: o.env.Rand, best: -1}
	bestCost := 0.0
	for i, se := range engines {
		e := o.r.byID[se.ID()]
		if e == nil {
			return policy.Pick{}, fmt.Errorf("sim: %s: engine %q is not simulated", o.name, se.ID())
		}
		cached := e.predictedCachedBlocks(o.hashes, input) * B
		own := e.m.prefillSeconds(input-cached, cached)
		cost := e.pendingPrefillSeconds() + (1+o.workWeight)*own
		t.offer(i, t.best < 0 || cost < bestCost, cost == bestCost)
		if t.best == i {
			bestCost = cost
		}
	}
	winner := engines[t.best]
	if err := o.admit(winner); err != nil {
		return policy.Pick{}, err
	}
	return policy.Pick{Engine: winner, Reason: ReasonOracle, PrefillTokens: uint64(max(input, 1))}, nil
}

// pendingPrefillSeconds returns how long the engine will prefill before it reaches a prompt
// queued now: the rest of the step in progress, then the uncached rest of every prompt in
// prefill and in the queue (see Oracle).
func (e *engine) pendingPrefillSeconds() float64 {
	s := 0.0
	switch e.kind {
	case segPrefill:
		s += (e.segEnd - e.r.now).Seconds()
	case segDecode:
		// The engine plans again at the end of the step in progress.
		k := e.stepsCovering(e.r.now - e.segStart)
		if k == 0 {
			k = 1
		}
		s += max((e.segStart + e.decodeTime(min(k, e.steps)) - e.r.now).Seconds(), 0)
	}
	for _, q := range e.prefilling {
		done := q.prefilled
		if e.kind == segPrefill {
			for _, it := range e.batch {
				if it.q == q {
					done += it.tokens
				}
			}
		}
		if rest := q.work - done; rest > 0 {
			s += e.m.prefillSeconds(rest, q.cached+done)
		}
	}
	for _, q := range e.waiting[e.waitHead:] {
		s += e.m.prefillSeconds(q.estUncached, q.input-q.estUncached)
	}
	return s
}

// predictedCachedBlocks returns how many leading blocks of a prompt with engine hashes hashes and
// input tokens the engine will serve from cache if it is queued now: the deeper of its cache's
// match and the longest common prefix with a prompt queued or in prefill there, keeping the last
// prompt token to recompute.
func (e *engine) predictedCachedBlocks(hashes []uint64, input int) int {
	if input <= 0 {
		return 0
	}
	n := e.cache.match(hashes)
	common := func(q *reqState) {
		k := 0
		for k < len(hashes) && k < len(q.hashes) && hashes[k] == q.hashes[k] {
			k++
		}
		n = max(n, k)
	}
	for _, q := range e.prefilling {
		common(q)
	}
	for _, q := range e.waiting[e.waitHead:] {
		common(q)
	}
	return min(n, (input-1)/e.m.BlockTokens)
}
