package loadmon

import (
	"cmp"
	"math/bits"

	"github.com/enginepick/enginepick/state"
)

// Observation is one candidate engine's load as a pick sees it: the engine's reported load from
// the pick's Snapshot (nil when unknown) and its router-local in-flight count (always known).
type Observation struct {
	// Load is the engine's fresh, complete load from the snapshot; nil when unknown (never a
	// zero load). Shared and immutable.
	Load *EngineLoad
	// InFlight is this router's in-flight requests to the engine.
	InFlight uint64
}

// Observe builds the Observation of one engine from a snapshot and the in-flight counters.
// A nil InFlight counts 0 in flight.
func Observe(snap Snapshot, inflight *InFlight, engine state.EngineID) Observation {
	o := Observation{}
	if l, ok := snap.Load(engine); ok {
		o.Load = l
	}
	if inflight != nil {
		o.InFlight = inflight.Count(engine)
	}
	return o
}

// HasNative reports whether the observation carries a fresh, complete native report with valid
// capacity: the condition for comparing it on reported pressure (docs/design.md §6).
func (o *Observation) HasNative() bool { return o.Load != nil && o.Load.Native }

// ComparePressure compares the stage pressure of two candidates: negative when a is less
// pressured, positive when b is, zero on a complete tie. The rules are docs/design.md §6
// (pressure comparisons):
//
//   - reported is false: router-local in-flight only. Callers pass false when ANY candidate of the
//     compared set lacks a fresh, complete native report (the coverage rule), so every engine of
//     the set is compared on the same key.
//   - plain and prefill: estimated prefill queue time when both engines have it, then waiting
//     uncached tokens, waiting requests, running requests; then in-flight.
//   - decode: waiting requests, running requests, KV usage fraction (compared exactly by 128-bit
//     cross-multiplication), used KV tokens; then in-flight.
//
// The result is not a total order over a set (engines with and without a queue estimate are
// compared on different keys): use it in linear scans, never to sort.
func ComparePressure(stage state.Stage, a, b *Observation, reported bool) int {
	if reported && a.HasNative() && b.HasNative() {
		if c := compareReported(stage, a.Load, b.Load); c != 0 {
			return c
		}
	}
	return cmp.Compare(a.InFlight, b.InFlight)
}

func compareReported(stage state.Stage, a, b *EngineLoad) int {
	if stage == state.StageDecode {
		if c := cmp.Compare(a.WaitingRequests, b.WaitingRequests); c != 0 {
			return c
		}
		if c := cmp.Compare(a.RunningRequests, b.RunningRequests); c != 0 {
			return c
		}
		if c := compareFraction(a.UsedKVTokens, a.KVCapacityTokens, b.UsedKVTokens, b.KVCapacityTokens); c != 0 {
			return c
		}
		return cmp.Compare(a.UsedKVTokens, b.UsedKVTokens)
	}
	if a.HasPrefillRate && b.HasPrefillRate {
		if c := cmp.Compare(a.EstimatedPrefillQueue, b.EstimatedPrefillQueue); c != 0 {
			return c
		}
	}
	if c := cmp.Compare(a.WaitingUncachedTokens, b.WaitingUncachedTokens); c != 0 {
		return c
	}
	if c := cmp.Compare(a.WaitingRequests, b.WaitingRequests); c != 0 {
		return c
	}
	return cmp.Compare(a.RunningRequests, b.RunningRequests)
}

// compareFraction compares ua/ca with ub/cb exactly (ua×cb vs ub×ca in 128 bits). A zero capacity
// makes the fractions incomparable (0).
func compareFraction(ua, ca, ub, cb uint64) int {
	if ca == 0 || cb == 0 {
		return 0
	}
	ahi, alo := bits.Mul64(ua, cb)
	bhi, blo := bits.Mul64(ub, ca)
	if c := cmp.Compare(ahi, bhi); c != 0 {
		return c
	}
	return cmp.Compare(alo, blo)
}
