package policy

import (
	"cmp"
	"context"
	"fmt"
	"math/bits"

	"github.com/enginepick/enginepick/internal/flowbridge"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/internal/lora"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

// defaultChoices is NewPowerOfN's default sample size (docs/design.md §7; the experimental SGLang
// router's --power-of-n-choices default).
const defaultChoices = 2

// pressureScan finds the least pressured of the engines offered to it in one linear pass, under
// the coverage rule: it tracks the best engine on each basis (loadmon.Basis) up to the best basis
// every engine offered so far has, and reports the one on that basis. Only a strict improvement
// displaces an incumbent; a complete tie keeps the first offered, or, when rand is set, is broken
// uniformly at random among the tied engines (reservoir sampling: the j-th tied engine replaces
// the incumbent with probability 1/j), which needs no allocation.
//
// The caller observes each engine into next() and then offers it: the scan keeps observations in
// place, one per distinct incumbent, and copies none.
type pressureScan struct {
	stage state.Stage
	rand  func(n int) int // nil: ties keep the first offered
	total int             // engines to be offered; the last offer updates only the final basis
	n     int
	basis loadmon.Basis // the best basis every offered engine has
	best  [loadmon.BasisNative + 1]scanBest
	// obs holds the incumbents' observations (at most three distinct) and the one being offered.
	obs  [loadmon.BasisNative + 2]loadmon.Observation
	free int // the slot of obs next returns
}

// scanBest is a pressureScan's incumbent on one basis.
type scanBest struct {
	i    int // the engine's index
	ties int // engines tied with the incumbent so far, the incumbent included
	slot int // its observation in pressureScan.obs
}

// next returns where to observe the next engine offered: a slot no incumbent uses.
func (s *pressureScan) next() *loadmon.Observation { return &s.obs[s.free] }

// offer offers engine i, whose observation the caller wrote to next().
func (s *pressureScan) offer(i int) {
	o := &s.obs[s.free]
	if s.n == 0 {
		s.n, s.basis = 1, o.Basis()
		for b := range s.basis + 1 {
			s.best[b] = scanBest{i: i, ties: 1, slot: s.free}
		}
		s.free++
		return
	}
	s.n++
	s.basis = min(s.basis, o.Basis())
	lo := 0 // the lowest basis kept up: every one until the last offer settles the basis
	if s.n == s.total {
		lo = int(s.basis)
	}
	took := false
	for b := int(s.basis); b >= lo; b-- { // the richest basis first, in-flight last
		t := &s.best[b]
		inc := &s.obs[t.slot]
		var c int
		if b == int(loadmon.BasisInFlight) {
			c = cmp.Compare(inFlight(o), inFlight(inc)) // ComparePressure on the in-flight basis
		} else {
			c = loadmon.ComparePressure(s.stage, o, inc, loadmon.Basis(b))
		}
		switch {
		case c < 0:
			*t, took = scanBest{i: i, ties: 1, slot: s.free}, true
		case c == 0 && s.rand != nil:
			if t.ties++; s.rand(t.ties) == 0 {
				t.i, t.slot, took = i, s.free, true
			}
		}
	}
	if took {
		var used uint
		for b := range s.basis + 1 {
			used |= 1 << s.best[b].slot
		}
		s.free = bits.TrailingZeros(^used)
	}
}

// result returns the winner's index and observation.
func (s *pressureScan) result() (int, *loadmon.Observation) {
	t := &s.best[s.basis]
	return t.i, &s.obs[t.slot]
}

// powerOfN is the policy NewPowerOfN returns.
type powerOfN struct {
	cfg    Config
	n      int
	reason string
}

var _ Policy = (*powerOfN)(nil)

// NewPowerOfN returns a policy that samples n distinct candidates uniformly and picks the one with
// the lowest stage pressure (loadmon.ComparePressure, counting the dispatches since each engine's
// report); a complete tie keeps the first sampled. When n covers the candidates it takes the exact
// minimum, breaking complete ties uniformly at random (docs/design.md §7). Admission is called
// once, on the winner; a rejection is returned as *AdmissionRejectedError, never resampled or
// replaced. Picks carry power_of_two when n = 2, otherwise power_of_n. n < 1 or a nil
// required Config handle is an error wrapping ErrInvalidConfiguration.
func NewPowerOfN(cfg Config, n int) (Policy, error) {
	if n < 1 {
		return nil, fmt.Errorf("policy: power_of_n: choices %d, must be >= 1: %w", n, ErrInvalidConfiguration)
	}
	if err := cfg.validate("power_of_n"); err != nil {
		return nil, err
	}
	reason := label.ReasonPowerOfN
	if n == 2 {
		reason = label.ReasonPowerOfTwo
	}
	return &powerOfN{cfg: cfg, n: n, reason: reason}, nil
}

// Pick implements Policy. No candidates → ErrNoCandidates without calling admission. One snapshot
// is captured per pick and its record of the winner reaches admission. Allocation-free for groups
// of up to 256 candidates.
func (p *powerOfN) Pick(ctx context.Context, engines []state.Engine, req *Request) (Pick, error) {
	i, o, err := sampleLeastPressured(&p.cfg, p.cfg.Load.Snapshot(), engines, req, p.n)
	if err != nil {
		return Pick{}, err
	}
	ic, err := p.cfg.admit(flowbridge.PrefillHold(ctx), engines[i], o)
	if err != nil {
		return Pick{}, err
	}
	return Pick{Engine: engines[i], Reason: p.reason}.withRank(&o).withCap(ic), nil
}

// sampleLeastPressured returns the least pressured of k distinct uniformly sampled engines, or of
// all engines (exact minimum, complete ties broken uniformly at random) when k >= len(engines).
func sampleLeastPressured(cfg *Config, snap loadmon.Snapshot, engines []state.Engine, req *Request, k int) (int, loadmon.Observation, error) {
	n := len(engines)
	if n == 0 {
		return 0, loadmon.Observation{}, ErrNoCandidates
	}
	s := pressureScan{stage: stageOf(req), total: min(k, n)}
	if k >= n {
		s.rand = cfg.Rand
		for i, e := range engines {
			*s.next() = cfg.observe(snap, e, req)
			s.offer(i)
		}
	} else {
		var small [4]uint64
		seen := small[:]
		if n > 256 {
			seen = make([]uint64, (n+63)/64)
		}
		for misses := 0; s.n < k; {
			j := cfg.Rand(n)
			for seen[j/64]&(1<<(j%64)) != 0 {
				// A duplicate is redrawn. After maxRedraws duplicates in a row (a degenerate
				// source; with a uniform one this needs k close to n and bad luck) the next
				// free index is taken instead, so the loop always ends.
				if misses++; misses <= maxRedraws {
					j = cfg.Rand(n)
				} else {
					j = (j + 1) % n
				}
			}
			misses = 0
			seen[j/64] |= 1 << (j % 64)
			*s.next() = cfg.observe(snap, engines[j], req)
			s.offer(j)
		}
	}
	i, o := s.result()
	return i, *o, nil
}

// maxRedraws bounds consecutive duplicate draws in sampleLeastPressured.
const maxRedraws = 64

func stageOf(req *Request) state.Stage {
	if req == nil {
		return state.StagePlain
	}
	return req.Stage
}

// adapterClass is the engine's residency of the observation's LoRA adapter (lora.Class):
// false for a base-model request, or when the engine's residency is unknown.
func adapterClass(o *loadmon.Observation) (int, bool) {
	if o.Adapter == "" || o.Load == nil || o.Load.LoRA == nil {
		return 0, false
	}
	l := o.Load.LoRA
	return lora.Class(o.Adapter, l.Running, l.Waiting, l.MaxAdapters)
}

// compareAdapter orders two observations for one request by their residency of its LoRA adapter,
// the better first (negative when a is better); 0 for a base-model request or an unknown
// residency (docs/design.md §18).
func compareAdapter(a, b *loadmon.Observation) int {
	ca, ok := adapterClass(a)
	if !ok {
		return 0
	}
	cb, ok := adapterClass(b)
	if !ok {
		return 0
	}
	return cmp.Compare(cb, ca)
}

// slotWait reports whether the observation's adapter request would wait for an adapter slot on
// its engine: the engine's residency is known, the adapter does not run there and no slot is
// free (lora.Waiting or lora.Full). vLLM keeps such a request waiting until every request of one
// of the running adapters has finished (docs/design.md §18).
func slotWait(o *loadmon.Observation) bool {
	c, ok := adapterClass(o)
	return ok && c <= lora.Waiting
}

// evicts reports whether sending the observation's adapter request to its engine would make it
// wait for a slot and evict an adapter in use: the engine's residency is known, the adapter is
// neither running nor waiting there and every slot is taken (lora.Full).
func evicts(o *loadmon.Observation) bool {
	c, ok := adapterClass(o)
	return ok && c == lora.Full
}

// adapterOf is req's LoRA adapter, "" (the base model) for a nil request.
func adapterOf(req *Request) string {
	if req == nil {
		return ""
	}
	return req.Adapter
}

// leastLoad is the policy NewLeastLoad returns.
type leastLoad struct {
	cfg Config
}

var _ Policy = (*leastLoad)(nil)

// NewLeastLoad returns a policy that picks the least loaded candidate (docs/design.md §8). When
// every candidate has a fresh report, an engine's load is waiting + running requests + the
// dispatches this router made after that report; otherwise every candidate is scored by in-flight
// requests alone (this router's, plus its peers' when router replicas share them, docs/design.md
// §6). For a request for a LoRA adapter, an engine where it would wait for an adapter slot scores
// one more, and ties on reported load go to the engine with the better residency of the adapter
// (docs/design.md §18); then ties go to the fewer in-flight requests, and complete ties are broken
// uniformly at random. Admission is checked once, on the winner; a rejection is returned, never
// replaced. It returns an error wrapping ErrInvalidConfiguration when a required Config handle is
// nil.
func NewLeastLoad(cfg Config) (Policy, error) {
	if err := cfg.validate(label.LeastLoad); err != nil {
		return nil, err
	}
	return &leastLoad{cfg: cfg}, nil
}

// Pick implements Policy. No candidates → ErrNoCandidates without calling admission.
func (p *leastLoad) Pick(ctx context.Context, engines []state.Engine, req *Request) (Pick, error) {
	if len(engines) == 0 {
		return Pick{}, ErrNoCandidates
	}
	snap := p.cfg.Load.Snapshot()
	allFresh := true
	var bestR, bestL, tieR, tieL int
	var scoreR uint64
	var obsR, obsL loadmon.Observation
	for i, e := range engines {
		o := p.cfg.observe(snap, e, req)
		allFresh = allFresh && o.Load != nil
		if allFresh {
			l := o.Figures() // the named rank's own figures when the engine has several
			score := satAdd(satAdd(l.WaitingRequests, l.RunningRequests), o.Dispatched)
			if slotWait(&o) {
				score = satAdd(score, 1) // the request would wait for an adapter slot (docs/design.md §18)
			}
			c := 0
			if i > 0 {
				c = cmp.Compare(score, scoreR)
				if c == 0 {
					c = compareAdapter(&o, &obsR)
				}
				if c == 0 {
					c = cmp.Compare(inFlight(&o), inFlight(&obsR))
				}
			}
			switch {
			case i == 0 || c < 0:
				bestR, scoreR, obsR, tieR = i, score, o, 1
			case c == 0:
				if tieR++; p.cfg.Rand(tieR) == 0 {
					bestR, obsR = i, o
				}
			}
		}
		switch {
		case i == 0 || inFlight(&o) < inFlight(&obsL):
			bestL, obsL, tieL = i, o, 1
		case inFlight(&o) == inFlight(&obsL):
			if tieL++; p.cfg.Rand(tieL) == 0 {
				bestL, obsL = i, o
			}
		}
	}
	best, obs := bestL, obsL
	if allFresh {
		best, obs = bestR, obsR
	}
	ic, err := p.cfg.admit(flowbridge.PrefillHold(ctx), engines[best], obs)
	if err != nil {
		return Pick{}, err
	}
	return Pick{Engine: engines[best], Reason: label.ReasonLeastLoad}.withRank(&obs).withCap(ic), nil
}

// inFlight returns the in-flight requests the pressure comparisons read: this router's and its
// peers' (loadmon.Observation.PeerInFlight).
func inFlight(o *loadmon.Observation) uint64 { return satAdd(o.InFlight, o.PeerInFlight) }

func satAdd(a, b uint64) uint64 {
	if s := a + b; s >= a {
		return s
	}
	return ^uint64(0)
}
