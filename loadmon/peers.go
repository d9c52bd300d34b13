package loadmon

import (
	"math"
	"time"

	"github.com/enginepick/enginepick/internal/loadbridge"
	"github.com/enginepick/enginepick/state"
)

// Other router replicas' dispatches (docs/design.md §6, "Router replicas"): package
// internal/peersync reaches them through package loadbridge.
func init() {
	loadbridge.SetHook = func(f any, fn func(loadbridge.Change)) {
		if fn == nil {
			f.(*InFlight).hook.Store(nil)
			return
		}
		f.(*InFlight).hook.Store(&fn)
	}
	loadbridge.ApplyPeer = func(f any, c loadbridge.Change) { f.(*InFlight).applyPeer(c) }
	loadbridge.Prefilling = func(f any, engine state.EngineID) uint64 { return f.(*InFlight).prefilling(engine) }
	loadbridge.InFlightPrefill = func(f any, engine state.EngineID) uint64 {
		fl := f.(*InFlight)
		if !fl.firstTokens.Load() {
			return 0
		}
		var peer uint64
		if p := fl.peer(engine, -1); p != nil {
			peer = p.prefilling.Load()
		}
		return satAdd(fl.prefilling(engine), peer)
	}
	loadbridge.InFlightAt = func(f any, engine state.EngineID, t time.Time) uint64 {
		fl := f.(*InFlight)
		return satAdd(fl.lookup(engine).inFlightAt(t, false), fl.peer(engine, -1).inFlightAt(t, true))
	}
	loadbridge.SetReplicas = func(f any, rank, replicas int) {
		var v uint64
		if replicas > 1 && rank >= 0 && rank < replicas && uint64(replicas) <= math.MaxUint32 {
			v = uint64(rank)<<32 | uint64(replicas)
		}
		f.(*InFlight).replicas.Store(v)
	}
	loadbridge.Replicas = func(f any) (int, int) {
		v := f.(*InFlight).replicas.Load()
		if v == 0 {
			return 0, 1
		}
		return int(v >> 32), int(uint32(v))
	}
}

// applyPeer counts another replica's dispatch change (loadbridge.ApplyPeer).
func (f *InFlight) applyPeer(c loadbridge.Change) {
	cs := []*counter{f.peerCounter(c.Engine, -1)}
	if c.Rank >= 0 {
		cs = append(cs, f.peerCounter(c.Engine, c.Rank))
	}
	if c.Op == loadbridge.OpEnd {
		cs[0].releases.record(0, f.now().UnixNano())
	}
	for _, p := range cs {
		switch c.Op {
		case loadbridge.OpStart:
			p.n.Add(1)
			p.stamp(c.Tokens, c.At)
		case loadbridge.OpPrefillEnd:
			p.unprefill(c.Tokens)
		case loadbridge.OpEnd:
			p.unprefill(c.Tokens)
			p.n.Add(-1)
		}
	}
	if c.Op == loadbridge.OpPrefillEnd && !f.firstTokens.Load() {
		f.firstTokens.Store(true) // peers report first tokens: count in-flight prefill
	}
}

// unprefill subtracts tokens from the in-flight prefill, saturating at zero.
func (c *counter) unprefill(tokens uint64) {
	for {
		v := c.prefilling.Load()
		if c.prefilling.CompareAndSwap(v, v-min(v, tokens)) {
			return
		}
	}
}

// peerCounter returns the peer counter of the engine (rank < 0) or of its DP rank, creating it.
func (f *InFlight) peerCounter(engine state.EngineID, rank int) *counter {
	k := rankKey{engine, rank}
	if c := (*f.peerRanks.Load())[k]; c != nil {
		return c
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	old := *f.peerRanks.Load()
	if c := old[k]; c != nil {
		return c
	}
	c := &counter{}
	next := make(map[rankKey]*counter, len(old)+1)
	for k, v := range old {
		next[k] = v
	}
	next[k] = c
	f.peerRanks.Store(&next)
	return c
}

// peer returns the peer counter of the engine (rank < 0) or of its DP rank; nil for none.
func (f *InFlight) peer(engine state.EngineID, rank int) *counter {
	if f == nil {
		return nil
	}
	return (*f.peerRanks.Load())[rankKey{engine, max(rank, -1)}]
}

// peerSince counts the peer dispatches recorded at or after t and their prefill tokens, over the
// whole ring: peers' changes arrive out of their dispatch order. 0 for a nil counter.
func (c *counter) peerSince(t time.Time) (requests, prefillTokens uint64) {
	if c == nil {
		return 0, 0
	}
	since := t.UnixNano()
	r := &c.dispatches
	for i := range min(r.head.Load(), dispatchRing) {
		if r.at[i].Load() >= since {
			requests++
			prefillTokens = satAdd(prefillTokens, r.tokens[i].Load())
		}
	}
	return requests, prefillTokens
}

// removePeers detaches the engine's peer counters. Callers hold f.mu.
func (f *InFlight) removePeers(engine state.EngineID) {
	old := *f.peerRanks.Load()
	next := make(map[rankKey]*counter, len(old))
	for k, v := range old {
		if k.engine != engine {
			next[k] = v
		}
	}
	if len(next) != len(old) {
		f.peerRanks.Store(&next)
	}
}
