// Package loadbridge gives the module's own packages the loadmon.InFlight operations that are not
// part of loadmon's API: the hook that reports this router's dispatch changes, and the peer
// component that counts other router replicas' dispatches in pressure comparisons
// (docs/design.md §6, "Router replicas").
//
// Package loadmon sets the functions when it is initialised, so they are never nil once loadmon is
// imported. This package cannot name loadmon's types (loadmon imports it): f is always a
// *loadmon.InFlight; anything else panics.
package loadbridge

import (
	"time"

	"github.com/enginepick/enginepick/state"
)

// Op is the kind of a dispatch Change.
type Op uint8

const (
	// OpStart is a dispatch counted (Acquire, or a TryAcquire that succeeded).
	OpStart Op = iota + 1
	// OpPrefillEnd is the dispatch's first token (Guard.FirstToken): its prefill tokens no longer
	// count as in-flight prefill.
	OpPrefillEnd
	// OpEnd is the dispatch released (Guard.Release); Tokens are the prefill tokens still counted
	// as in-flight prefill until then (0 when its first token came before).
	OpEnd
)

// Change is one change to a router's in-flight dispatches to one engine.
type Change struct {
	Op Op
	// ID numbers the dispatch from 1, in the order the InFlight counted them; its changes share it.
	ID     uint64
	Engine state.EngineID
	// Rank is the DP rank the dispatch named; negative for none.
	Rank int
	// Tokens are the dispatch's prefill tokens (OpStart, OpPrefillEnd) or those still in-flight
	// prefill at its end (OpEnd).
	Tokens uint64
	// At is the dispatch time in unix nanoseconds (OpStart; 0 otherwise).
	At int64
}

var (
	// Prefilling returns the prefill tokens of f's dispatches to the engine that have no first
	// token yet, or 0 until some dispatch of f has reported a first token (unknown).
	Prefilling func(f any, engine state.EngineID) uint64

	// InFlightPrefill is Prefilling plus the prefill tokens of the other router replicas'
	// dispatches to the engine that have no first token yet, as their shared changes reached f
	// (ApplyPeer); 0 until some dispatch, f's or a peer's, has reported a first token (unknown).
	InFlightPrefill func(f any, engine state.EngineID) uint64

	// SetHook makes f call fn, synchronously, after each change to its dispatches; nil removes
	// the hook. fn must be safe for concurrent use and must not block. Changes of one dispatch
	// reach fn in order.
	SetHook func(f any, fn func(Change))

	// ApplyPeer counts another replica's dispatch change in f's peer component: OpStart adds a
	// dispatch in flight with its prefill tokens and records its time and tokens for the
	// dispatches since a report; OpPrefillEnd subtracts Tokens from the in-flight prefill; OpEnd
	// subtracts the dispatch and Tokens. The peer component counts in Observe's Dispatched and
	// DispatchedTokens and in the in-flight prefill of EstimatePendingPrefillTokens, never in
	// Count, admission caps or TryAcquire. The caller keeps the changes consistent (an end only
	// after its start, once); the counters saturate at zero.
	ApplyPeer func(f any, c Change)

	// InFlightAt returns f's dispatches to the engine, and the other router replicas' as their
	// shared changes reached f, that were in flight at t: in flight now, less those dispatched at
	// or after t, plus those released at or after t, each counted over its 64 most recent (a
	// burst of more since t than that makes the figure too high, or too low).
	InFlightAt func(f any, engine state.EngineID, t time.Time) uint64

	// SetReplicas records on f this router's place among the router replicas whose dispatches
	// f counts: rank in [0, replicas), the same for no two replicas that know each other. A count
	// below 2 (the default), or a rank outside [0, replicas), records a router alone. Cache-aware picks read it to prefer this
	// replica's home engines (docs/design.md §6, "Router replicas").
	SetReplicas func(f any, rank, replicas int)

	// Replicas returns what SetReplicas last recorded on f: (0, 1) for a router alone.
	Replicas func(f any) (rank, replicas int)
)
