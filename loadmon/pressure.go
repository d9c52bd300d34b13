package loadmon

import (
	"cmp"
	"math"
	"math/bits"
	"time"

	"github.com/enginepick/enginepick/state"
)

// Observation is one candidate engine's load as a pick sees it: the engine's reported load from
// the pick's Snapshot (nil when unknown), its router-local in-flight count (always known) and the
// dispatches this router made after the report, which the report cannot reflect yet.
type Observation struct {
	// Load is the engine's fresh, complete load from the snapshot; nil when unknown (never a
	// zero load). Shared and immutable.
	Load *EngineLoad
	// InFlight is this router's in-flight requests to the engine.
	InFlight uint64
	// Dispatched and DispatchedTokens are the dispatches this router made to the engine at or
	// after Load.ReportedAt, and the prefill tokens they brought (InFlight.DispatchedSince). Both
	// are 0 when Load is nil.
	Dispatched       uint64
	DispatchedTokens uint64
}

// Observe builds the Observation of one engine from a snapshot and the in-flight counters.
// A nil InFlight counts 0 in flight and no dispatch since the report.
func Observe(snap Snapshot, inflight *InFlight, engine state.EngineID) Observation {
	o := Observation{}
	if l, ok := snap.Load(engine); ok {
		o.Load = l
	}
	if inflight != nil {
		o.InFlight = inflight.Count(engine)
		if o.Load != nil {
			o.Dispatched, o.DispatchedTokens = inflight.DispatchedSince(engine, o.Load.ReportedAt)
		}
	}
	return o
}

// WaitingRequests returns the reported waiting requests plus the dispatches since the report, and
// false when the load is unknown.
func (o *Observation) WaitingRequests() (uint64, bool) {
	if o.Load == nil {
		return 0, false
	}
	return satAdd(o.Load.WaitingRequests, o.Dispatched), true
}

// PendingPrefillTokens returns the prompt tokens a new request would wait behind on a plain or
// prefill engine: the reported waiting uncached tokens plus the prefill tokens dispatched since the
// report. It returns false without a native report (HasNative).
func (o *Observation) PendingPrefillTokens() (uint64, bool) {
	if !o.HasNative() {
		return 0, false
	}
	return satAdd(o.Load.WaitingUncachedTokens, o.DispatchedTokens), true
}

// PendingPrefillTime returns PendingPrefillTokens divided by the engine's measured prefill
// throughput: the reported EstimatedPrefillQueue plus the time of the tokens dispatched since the
// report. It returns false unless the report is native and has a prefill rate (HasPrefillRate).
func (o *Observation) PendingPrefillTime() (time.Duration, bool) {
	if !o.HasNative() || !o.Load.HasPrefillRate {
		return 0, false
	}
	return satAddDuration(o.Load.EstimatedPrefillQueue, o.Load.TokensTime(o.DispatchedTokens)), true
}

// TokensTime returns how long the engine takes to prefill tokens uncached tokens at its measured
// rate (PrefillTokensPerSecond); 0 without a rate. It saturates at the largest Duration.
func (l *EngineLoad) TokensTime(tokens uint64) time.Duration {
	if !l.HasPrefillRate || l.PrefillTokensPerSecond <= 0 || tokens == 0 {
		return 0
	}
	sec := float64(tokens) / l.PrefillTokensPerSecond
	if sec*float64(time.Second) >= math.MaxInt64 {
		return time.Duration(math.MaxInt64)
	}
	return time.Duration(sec * float64(time.Second))
}

func satAddDuration(a, b time.Duration) time.Duration {
	if s := a + b; s >= a {
		return s
	}
	return time.Duration(math.MaxInt64)
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
// Reported waiting figures include the dispatches made since each engine's report
// (Observation.Dispatched and DispatchedTokens): the queue time and waiting uncached tokens add
// the dispatched prefill tokens, the waiting requests add the dispatch count (docs/design.md §6),
// so a burst between two reports does not all go to the engine that looked idle in the last one.
//
// The result is not a total order over a set (engines with and without a queue estimate are
// compared on different keys): use it in linear scans, never to sort.
func ComparePressure(stage state.Stage, a, b *Observation, reported bool) int {
	if reported && a.HasNative() && b.HasNative() {
		if c := compareReported(stage, a, b); c != 0 {
			return c
		}
	}
	return cmp.Compare(a.InFlight, b.InFlight)
}

func compareReported(stage state.Stage, oa, ob *Observation) int {
	a, b := oa.Load, ob.Load
	wa, _ := oa.WaitingRequests()
	wb, _ := ob.WaitingRequests()
	if stage == state.StageDecode {
		if c := cmp.Compare(wa, wb); c != 0 {
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
	if ta, ok := oa.PendingPrefillTime(); ok {
		if tb, ok := ob.PendingPrefillTime(); ok {
			if c := cmp.Compare(ta, tb); c != 0 {
				return c
			}
		}
	}
	ua, _ := oa.PendingPrefillTokens()
	ub, _ := ob.PendingPrefillTokens()
	if c := cmp.Compare(ua, ub); c != 0 {
		return c
	}
	if c := cmp.Compare(wa, wb); c != 0 {
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
