package policy

import (
	"context"
	"sync/atomic"

	"github.com/enginepick/enginepick/state"
)

// RoundRobin rotates over the candidates with one cursor per instance (docs/design.md §7.2). The cursor counts picks, so
// index = picks mod len(candidates): a change in membership shifts the rotation. Admission is
// checked once, on the engine the cursor lands on; a rejection is returned, never replaced.
type RoundRobin struct {
	cfg    Config
	cursor atomic.Uint64
}

var _ Policy = (*RoundRobin)(nil)

// NewRoundRobin returns a round-robin policy whose cursor starts at the first candidate. It
// returns an error wrapping ErrInvalidConfiguration when a required Config handle is nil.
func NewRoundRobin(cfg Config) (*RoundRobin, error) {
	if err := cfg.validate(NameRoundRobin); err != nil {
		return nil, err
	}
	return &RoundRobin{cfg: cfg}, nil
}

// Pick implements Policy. No candidates → ErrNoCandidates, and the cursor does not move.
func (p *RoundRobin) Pick(_ context.Context, engines []state.Engine, req *Request) (Pick, error) {
	if len(engines) == 0 {
		return Pick{}, ErrNoCandidates
	}
	i := (p.cursor.Add(1) - 1) % uint64(len(engines))
	return p.cfg.pickChecked(engines[i], ReasonRoundRobin, stageOf(req))
}

// Random chooses uniformly among the candidates with the Config's random source, then checks
// admission once on that engine.
type Random struct {
	cfg Config
}

var _ Policy = (*Random)(nil)

// NewRandom returns a uniform random policy. It returns an error wrapping
// ErrInvalidConfiguration when a required Config handle is nil.
func NewRandom(cfg Config) (*Random, error) {
	if err := cfg.validate(NameRandom); err != nil {
		return nil, err
	}
	return &Random{cfg: cfg}, nil
}

// Pick implements Policy. No candidates → ErrNoCandidates.
func (p *Random) Pick(_ context.Context, engines []state.Engine, req *Request) (Pick, error) {
	if len(engines) == 0 {
		return Pick{}, ErrNoCandidates
	}
	return p.cfg.pickChecked(engines[p.cfg.Rand(len(engines))], ReasonRandom, stageOf(req))
}
