package policy

import (
	"context"
	"sync/atomic"

	"github.com/enginepick/enginepick/internal/flowbridge"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/state"
)

// roundRobin is the policy NewRoundRobin returns.
type roundRobin struct {
	cfg    Config
	cursor atomic.Uint64
}

var _ Policy = (*roundRobin)(nil)

// NewRoundRobin returns a policy that rotates over the candidates with one cursor, starting at the
// first (docs/design.md §7.2). The cursor counts picks, so index = picks mod len(candidates): a
// change in membership shifts the rotation. Admission is checked once, on the engine the cursor
// lands on; a rejection is returned, never replaced. No candidates → ErrNoCandidates, and the
// cursor does not move. It returns an error wrapping ErrInvalidConfiguration when a required
// Config handle is nil.
func NewRoundRobin(cfg Config) (Policy, error) {
	if err := cfg.validate(label.RoundRobin); err != nil {
		return nil, err
	}
	return &roundRobin{cfg: cfg}, nil
}

// Pick implements Policy. No candidates → ErrNoCandidates, and the cursor does not move.
func (p *roundRobin) Pick(ctx context.Context, engines []state.Engine, req *Request) (Pick, error) {
	if len(engines) == 0 {
		return Pick{}, ErrNoCandidates
	}
	i := (p.cursor.Add(1) - 1) % uint64(len(engines))
	return p.cfg.pickChecked(flowbridge.PrefillHold(ctx), engines[i], label.ReasonRoundRobin, stageOf(req))
}

// random is the policy NewRandom returns.
type random struct {
	cfg Config
}

var _ Policy = (*random)(nil)

// NewRandom returns a policy that chooses uniformly among the candidates with the Config's random
// source, then checks admission once on that engine. It returns an error wrapping
// ErrInvalidConfiguration when a required Config handle is nil.
func NewRandom(cfg Config) (Policy, error) {
	if err := cfg.validate(label.Random); err != nil {
		return nil, err
	}
	return &random{cfg: cfg}, nil
}

// Pick implements Policy. No candidates → ErrNoCandidates.
func (p *random) Pick(ctx context.Context, engines []state.Engine, req *Request) (Pick, error) {
	if len(engines) == 0 {
		return Pick{}, ErrNoCandidates
	}
	return p.cfg.pickChecked(flowbridge.PrefillHold(ctx), engines[p.cfg.Rand(len(engines))], label.ReasonRandom, stageOf(req))
}
