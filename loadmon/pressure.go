package loadmon

import (
	"cmp"
	"fmt"
	"math"
	"math/bits"
	"time"

	"github.com/enginepick/enginepick/internal/lora"
	"github.com/enginepick/enginepick/state"
)

// Observation is one candidate engine's load as a pick sees it: the engine's reported load from
// the pick's Snapshot (nil when unknown), its router-local in-flight count (always known) and the
// dispatches this router made after the report, which the report cannot reflect yet.
//
// An observation may name one of the engine's DP ranks (HasDPRank): then RankLoad is that rank's
// own load, and the queue gate and the pressure comparisons read it (Figures) rather than the sum
// over ranks, while admission keeps reading the engine's Load (docs/design.md §6).
type Observation struct {
	// Load is the engine's fresh, complete load from the snapshot, summed over its DP ranks; nil
	// when unknown (never a zero load). Shared and immutable. Admission reads it.
	Load *EngineLoad
	// InFlight is this router's in-flight requests to the engine.
	InFlight uint64
	// PeerInFlight is other router replicas' requests in flight to the engine, as their shared
	// dispatches reached this router (docs/design.md §6, "Router replicas"); 0 without sharing.
	// The pressure comparisons add it to InFlight in their last key; admission never reads it.
	PeerInFlight uint64
	// Dispatched and DispatchedTokens are the dispatches this router made at or after
	// Figures().ReportedAt, and the prefill tokens they brought (InFlight.DispatchedSince): to the
	// engine, or, when the observation names a rank, to that rank. Both are 0 when Load is nil.
	// With router replicas sharing their decisions, they include the peers' dispatches since
	// the report (docs/design.md §6).
	Dispatched       uint64
	DispatchedTokens uint64
	// prefilled is the prefill tokens of this router's dispatches there (to the named rank, when
	// the observation names one) whose prefill ended at or after Figures().ReportedAt, as the host
	// reported first tokens (InFlight's Guard.FirstToken): work a native report still counts as
	// pending. 0 when Load is nil.
	prefilled uint64
	// DPRank is the DP rank the observation names, valid when HasDPRank. A rank is named only for
	// an engine with several ranks whose load is known.
	DPRank    int
	HasDPRank bool
	// RankLoad is the named rank's own load (Load.RankLoads[DPRank]); nil unless HasDPRank.
	RankLoad *EngineLoad
	// RankInFlight is this router's in-flight requests to the named rank (dispatches that named
	// it); 0 unless HasDPRank.
	RankInFlight uint64
	// Adapter is the LoRA adapter of the request being placed (vLLM lora_name); empty means the
	// base model. The Observe functions leave it empty; a policy sets it, and ComparePressure
	// then weighs the engine's adapter residency (Load.LoRA; docs/design.md §18).
	Adapter string
}

// Figures returns the load the queue gate and the pressure comparisons read: the named rank's own
// load when the observation names a rank, else the engine's (nil when unknown).
func (o *Observation) Figures() *EngineLoad {
	if o.RankLoad != nil {
		return o.RankLoad
	}
	return o.Load
}

// Observe builds the Observation of one engine from a snapshot and the in-flight counters.
// A nil InFlight counts 0 in flight and no dispatch since the report.
func Observe(snap Snapshot, inflight *InFlight, engine state.EngineID) Observation {
	o := Observation{}
	if l, ok := snap.Load(engine); ok {
		o.Load = l
	}
	if inflight != nil {
		c := inflight.lookup(engine) // one map lookup for both figures
		o.InFlight = c.count()
		p := inflight.peer(engine, -1)
		o.PeerInFlight = p.count()
		if o.Load != nil {
			o.Dispatched, o.DispatchedTokens = c.since(o.Load.ReportedAt)
			o.prefilled = c.endedSince(o.Load.ReportedAt)
			o.addPeers(p)
		}
	}
	return o
}

// ObserveRank is Observe naming the engine's DP rank rank: RankLoad is the rank's own load, and
// the dispatches since the report are those that named the rank since the rank's report. When the
// engine's load is unknown, the engine has one rank, or rank is out of range, it is Observe: no
// rank is named.
func ObserveRank(snap Snapshot, inflight *InFlight, engine state.EngineID, rank int) Observation {
	o := Observe(snap, inflight, engine)
	if o.Load == nil || rank < 0 || rank >= len(o.Load.RankLoads) {
		return o // no rank to name, as in withRank, without a second copy of o
	}
	return withRank(o, inflight, engine, rank)
}

// withRank returns the engine's observation o naming rank (ObserveRank).
func withRank(o Observation, inflight *InFlight, engine state.EngineID, rank int) Observation {
	if o.Load == nil {
		return o
	}
	rl, ok := o.Load.rank(rank)
	if !ok {
		return o
	}
	o.DPRank, o.HasDPRank, o.RankLoad = rank, true, rl
	o.Dispatched, o.DispatchedTokens, o.RankInFlight, o.prefilled = 0, 0, 0, 0
	if inflight != nil {
		o.Dispatched, o.DispatchedTokens = inflight.DispatchedSince(engine, rank, rl.ReportedAt)
		o.prefilled = (*inflight.ranks.Load())[rankKey{engine, rank}].endedSince(rl.ReportedAt)
		o.addPeers(inflight.peer(engine, rank))
		o.RankInFlight = inflight.rankCount(engine, rank)
	}
	return o
}

// ObserveLeastPressured is Observe naming the engine's least pressured DP rank, for an engine with
// several ranks whose load is known (otherwise it is Observe and names no rank). Ranks are compared
// by ComparePressure's reported keys for stage on their own figures, on the best basis every rank
// has (BasisNative when every rank is native, else BasisReported); then fewer router-local
// in-flight requests to the rank; then the lower rank (docs/design.md §6). It allocates nothing.
func ObserveLeastPressured(snap Snapshot, inflight *InFlight, stage state.Stage, engine state.EngineID) Observation {
	o := Observe(snap, inflight, engine)
	if o.Load == nil || len(o.Load.RankLoads) < 2 {
		return o
	}
	basis := BasisNative
	for _, rl := range o.Load.RankLoads {
		if !rl.Native {
			basis = BasisReported
		}
	}
	best := withRank(o, inflight, engine, 0)
	for r := 1; r < len(o.Load.RankLoads); r++ {
		c := withRank(o, inflight, engine, r)
		if compareRanks(stage, &c, &best, basis) < 0 {
			best = c
		}
	}
	return best
}

// compareRanks orders two observations of one engine naming different ranks (ObserveLeastPressured).
func compareRanks(stage state.Stage, a, b *Observation, basis Basis) int {
	if c := compareReported(stage, a, b, basis); c != 0 {
		return c
	}
	if c := cmp.Compare(a.RankInFlight, b.RankInFlight); c != 0 {
		return c
	}
	return cmp.Compare(a.DPRank, b.DPRank)
}

// WaitingRequests returns the reported waiting requests (Figures: the named rank's, else the
// engine's) plus the dispatches since the report, and false when the load is unknown.
func (o *Observation) WaitingRequests() (uint64, bool) {
	l := o.Figures()
	if l == nil {
		return 0, false
	}
	return satAdd(l.WaitingRequests, o.Dispatched), true
}

// PendingPrefillTokens returns the prompt tokens a new request would wait behind on a plain or
// prefill engine: the reported waiting uncached tokens plus the prefill tokens dispatched since the
// report, less the prefill tokens of this router's dispatches there whose first token arrived
// since the report (Guard.FirstToken), at least 0. It returns false without a fresh, complete
// native report with valid capacity.
func (o *Observation) PendingPrefillTokens() (uint64, bool) {
	if !o.hasNative() {
		return 0, false
	}
	p := satAdd(o.Figures().WaitingUncachedTokens, o.DispatchedTokens)
	return p - min(p, o.prefilled), true
}

// EstimatePendingPrefillTokens returns the prompt tokens a new request would wait behind, as the
// cost comparison and the pressure guard price it (docs/design.md §9.7, §9.11): PendingPrefillTokens
// with a native report; with any other fresh report, the reported waiting requests × the mean
// prefill tokens of the 64 most recent dispatches inflight recorded to the engine (to the named
// rank when the observation names one), plus the prefill tokens dispatched since the report, or,
// when larger and once the host reports first tokens (Guard.FirstToken), the prefill tokens of
// the dispatches inflight holds there whose first token has not arrived: a basic report counts a
// request being prefilled as running, not waiting. The mean is what a request routed there
// typically brings to prefill; perRequest stands for it when inflight is nil or no recorded
// dispatch brought any. It returns false when the load is unknown.
func (o *Observation) EstimatePendingPrefillTokens(inflight *InFlight, perRequest uint64) (uint64, bool) {
	l := o.Figures()
	switch {
	case l == nil:
		return 0, false
	case l.Native:
		return o.PendingPrefillTokens()
	}
	var c *counter
	if inflight != nil {
		if o.HasDPRank {
			c = (*inflight.ranks.Load())[rankKey{l.Engine, o.DPRank}]
		} else {
			c = inflight.lookup(l.Engine)
		}
	}
	mean := c.meanTokens()
	if mean == 0 {
		mean = perRequest
	}
	hi, queued := bits.Mul64(l.WaitingRequests, mean)
	if hi != 0 {
		queued = math.MaxUint64
	}
	pending := satAdd(queued, o.DispatchedTokens)
	if inflight != nil && inflight.firstTokens.Load() {
		var prefilling uint64
		if c != nil {
			prefilling = c.prefilling.Load()
		}
		rank := -1
		if o.HasDPRank {
			rank = o.DPRank
		}
		if p := inflight.peer(l.Engine, rank); p != nil {
			prefilling = satAdd(prefilling, p.prefilling.Load())
		}
		pending = max(pending, prefilling)
	}
	return pending, true
}

// addPeers adds the peer dispatches since the report (Figures().ReportedAt) to Dispatched and
// DispatchedTokens; p nil adds nothing.
func (o *Observation) addPeers(p *counter) {
	if p == nil {
		return
	}
	n, tok := p.peerSince(o.Figures().ReportedAt)
	o.Dispatched, o.DispatchedTokens = satAdd(o.Dispatched, n), satAdd(o.DispatchedTokens, tok)
}

// PendingPrefillTime returns PendingPrefillTokens divided by the engine's measured prefill
// throughput: the reported EstimatedPrefillQueue plus the time of the tokens dispatched since the
// report, less the time of those whose prefill ended since (PendingPrefillTokens), at least 0. It
// returns false unless the report is native and has a prefill rate (HasPrefillRate).
func (o *Observation) PendingPrefillTime() (time.Duration, bool) {
	if !o.hasNative() {
		return 0, false
	}
	l := o.Figures()
	if !l.HasPrefillRate {
		return 0, false
	}
	d := satAddDuration(l.EstimatedPrefillQueue, l.tokensTime(o.DispatchedTokens))
	return d - min(d, l.tokensTime(o.prefilled)), true
}

// tokensTime returns how long the engine takes to prefill tokens uncached tokens at its measured
// rate (PrefillTokensPerSecond); 0 without a rate. It saturates at the largest Duration.
func (l *EngineLoad) tokensTime(tokens uint64) time.Duration {
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

// hasNative reports whether the observation carries a fresh, complete native report with valid
// capacity (Figures: the named rank's, else the engine's): the condition for comparing it on
// native figures (docs/design.md §6).
func (o *Observation) hasNative() bool {
	l := o.Figures()
	return l != nil && l.Native
}

// Basis is the figures a pressure comparison reads, from the fewest to the most. Under the
// coverage rule (docs/design.md §6) a compared set of engines is compared on the best basis every
// engine of the set has (the least of their Basis values), so that every engine is ranked on the
// same keys.
type Basis uint8

const (
	// BasisInFlight compares in-flight requests only (this router's and its peers'): some engine
	// of the set has no fresh, complete report.
	BasisInFlight Basis = iota
	// BasisReported compares reported running and waiting requests (waiting plus the dispatches
	// since the report) and, for decode, KV usage, then in-flight: what every fresh report
	// carries, vLLM's /metrics included.
	BasisReported
	// BasisNative adds, for plain and prefill, the native figures in front: the estimated prefill
	// queue time and the waiting uncached tokens (plus the prefill tokens dispatched since).
	BasisNative
)

// String returns "in_flight", "reported" or "native".
func (b Basis) String() string {
	switch b {
	case BasisInFlight:
		return "in_flight"
	case BasisReported:
		return "reported"
	case BasisNative:
		return "native"
	}
	return fmt.Sprintf("Basis(%d)", uint8(b))
}

// Basis returns the best basis the observation supports: BasisNative with a native report
// (fresh, complete, with valid capacity), BasisReported with any other fresh, complete report, BasisInFlight when its load is
// unknown.
func (o *Observation) Basis() Basis {
	switch l := o.Figures(); {
	case l == nil:
		return BasisInFlight
	case l.Native:
		return BasisNative
	}
	return BasisReported
}

// ComparePressure compares the stage pressure of two candidates: negative when a is less
// pressured, positive when b is, zero on a complete tie. The rules are docs/design.md §6
// (pressure comparisons). basis is the compared set's basis (the least Basis of its engines: the
// coverage rule, so that every engine of the set is compared on the same keys); the comparison
// never reads more than a and b both have, whatever basis says.
//
//   - BasisNative, plain and prefill: estimated prefill queue time when both engines have it, then
//     waiting uncached tokens; then the reported keys below.
//   - BasisReported (and after the native keys): plain and prefill: waiting requests, running
//     requests; decode: waiting requests, running requests, KV usage fraction (compared exactly by
//     128-bit cross-multiplication), used KV tokens.
//   - Every basis ends with in-flight requests (InFlight + PeerInFlight); BasisInFlight compares
//     only those.
//
// Reported waiting figures include the dispatches made since each engine's report
// (Observation.Dispatched and DispatchedTokens): the queue time and waiting uncached tokens add
// the dispatched prefill tokens, the waiting requests add the dispatch count (docs/design.md §6),
// so a burst between two reports does not all go to the engine that looked idle in the last one.
//
// An observation that names a DP rank is compared on that rank's own figures (Observation.Figures).
//
// For a request for a LoRA adapter (both observations' Adapter, the same and non-empty), the
// engines' residency of the adapter comes first (docs/design.md §18, after llm-d's LoRA affinity
// scorer): an engine where the adapter would wait for a slot (lora.Class Waiting or Full) counts
// the request as one more waiting request, since vLLM keeps it waiting until a slot frees; and of
// two engines of different classes (running the adapter, then a free adapter slot, then its
// requests waiting, then full), the better wins when its waiting requests, so counted, are no
// more than the other's. Otherwise the keys above decide. An engine whose residency is unknown
// (no LoRA report, or no slot count and the adapter absent) is not compared on it; neither is any
// engine on the in-flight basis.
//
// The result is not a total order over a set (engines with and without a queue estimate are
// compared on different keys): use it in linear scans, never to sort.
func ComparePressure(stage state.Stage, a, b *Observation, basis Basis) int {
	if basis = min(basis, a.Basis(), b.Basis()); basis > BasisInFlight {
		if c := compareReported(stage, a, b, basis); c != 0 {
			return c
		}
	}
	return cmp.Compare(satAdd(a.InFlight, a.PeerInFlight), satAdd(b.InFlight, b.PeerInFlight))
}

// compareReported compares the reported figures of two observations whose load is known, the
// native keys first when basis is BasisNative.
func compareReported(stage state.Stage, oa, ob *Observation, basis Basis) int {
	a, b := oa.Figures(), ob.Figures()
	wa, _ := oa.WaitingRequests()
	wb, _ := ob.WaitingRequests()
	if c := compareAdapter(oa, ob, wa, wb); c != 0 {
		return c
	}
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
	if basis == BasisNative {
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
	}
	if c := cmp.Compare(wa, wb); c != 0 {
		return c
	}
	return cmp.Compare(a.RunningRequests, b.RunningRequests)
}

// adapterClass is the engine's residency of o.Adapter (lora.Class), false when unknown:
// no fresh report, or one without LoRA residency.
func (o *Observation) adapterClass() (int, bool) {
	if o.Load == nil || o.Load.LoRA == nil {
		return 0, false
	}
	l := o.Load.LoRA
	return lora.Class(o.Adapter, l.Running, l.Waiting, l.MaxAdapters)
}

// compareAdapter orders two observations for a request for a LoRA adapter by the engines'
// residency of it, wa and wb being their waiting requests with the dispatches since the report:
// negative when a's class is better and its waiting requests, plus one where the adapter would
// wait for a slot, are no more than b's so counted; positive the other way round; 0 when neither
// holds, for a base-model request, different adapters, or when either residency is unknown
// (ComparePressure). When neither holds, the better class has more waiting requests, so
// counted, and the usual keys decide.
func compareAdapter(a, b *Observation, wa, wb uint64) int {
	if a.Adapter == "" || a.Adapter != b.Adapter {
		return 0
	}
	ca, ok := a.adapterClass()
	if !ok {
		return 0
	}
	cb, ok := b.adapterClass()
	if !ok || ca == cb {
		return 0
	}
	if ca <= lora.Waiting {
		wa = satAdd(wa, 1)
	}
	if cb <= lora.Waiting {
		wb = satAdd(wb, 1)
	}
	switch {
	case ca > cb && wa <= wb:
		return -1
	case cb > ca && wb <= wa:
		return 1
	}
	return 0
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
