package kvindex

import (
	"slices"
	"sync"
	"sync/atomic"

	"github.com/enginepick/enginepick/state"
)

// trustSet records which engines' entries the index cannot vouch for: an event subscriber marks
// an (engine, DP rank) untrusted when it knows that rank's stream lost events (a sequence gap, a
// dropped batch) and trusted again once the rank has been resynchronised (replayed, or cleared
// and following the stream again). Writes are rare and take mu; readers load the published set
// without a lock.
type trustSet struct {
	mu    sync.Mutex
	ranks map[state.EngineID]map[int]struct{} // untrusted ranks per engine; guarded by mu
	// view is the published set of engines with at least one untrusted rank, immutable once
	// stored; nil when there is none, so the common case costs one atomic load.
	view atomic.Pointer[map[state.EngineID]struct{}]
}

// markUntrusted records that engine's DP rank rank is out of step with the engine: its event
// stream lost events, so the index may hold blocks the engine has dropped. Until every untrusted
// rank of the engine is marked trusted again, LocalSource reports the engine as holding nothing
// (it is left out of every Result), so cache-aware routing does not trust a torn view; load-based
// fallbacks still see it. The index's own entries are untouched, and Match still
// reports them. Marking an already untrusted rank again is a no-op; marks are independent of the
// entries, so they survive Clear and RemoveEngine. The rule and its recovery are described in
// docs/design.md §13.
//
// Errors (an *EventError with Op "mark untrusted"; nothing changes): ErrInvalidEngine for an
// empty engine, ErrInvalidRank for a negative rank. Safe for concurrent use; cost O(untrusted
// engines) to republish the set.
func (x *Index) markUntrusted(engine state.EngineID, rank int) error {
	if err := checkHolder("mark untrusted", engine, rank); err != nil {
		return err
	}
	t := &x.trust
	t.mu.Lock()
	defer t.mu.Unlock()
	rs := t.ranks[engine]
	if _, ok := rs[rank]; ok {
		return nil
	}
	if t.ranks == nil {
		t.ranks = make(map[state.EngineID]map[int]struct{})
	}
	if rs == nil {
		rs = make(map[int]struct{})
		t.ranks[engine] = rs
	}
	rs[rank] = struct{}{}
	t.publish()
	return nil
}

// markTrusted clears the mark markUntrusted set on engine's DP rank rank: the rank has been
// resynchronised. The engine is trusted again once none of its ranks is marked. Marking a rank
// that is not marked is a no-op. Errors as markUntrusted (Op "mark trusted").
func (x *Index) markTrusted(engine state.EngineID, rank int) error {
	if err := checkHolder("mark trusted", engine, rank); err != nil {
		return err
	}
	t := &x.trust
	t.mu.Lock()
	defer t.mu.Unlock()
	rs := t.ranks[engine]
	if _, ok := rs[rank]; !ok {
		return nil
	}
	delete(rs, rank)
	if len(rs) == 0 {
		delete(t.ranks, engine)
	}
	t.publish()
	return nil
}

// untrusted returns the engines with at least one untrusted DP rank, sorted by ID; nil when there
// is none (Stats.Untrusted). Lock-free.
func (x *Index) untrusted() []state.EngineID {
	v := x.trust.view.Load()
	if v == nil {
		return nil
	}
	out := make([]state.EngineID, 0, len(*v))
	for e := range *v {
		out = append(out, e)
	}
	slices.Sort(out)
	return out
}

// publish stores a fresh immutable view of the untrusted engines. Callers hold t.mu.
func (t *trustSet) publish() {
	if len(t.ranks) == 0 {
		t.view.Store(nil)
		return
	}
	v := make(map[state.EngineID]struct{}, len(t.ranks))
	for e := range t.ranks {
		v[e] = struct{}{}
	}
	t.view.Store(&v)
}

// trustedClone returns a new slice holding the entries of in whose engine is trusted, in order;
// nil when none is. With no untrusted engine it is a plain clone.
func (x *Index) trustedClone(in []EngineMatch, ranks []int) ([]EngineMatch, []int) {
	v := x.trust.view.Load()
	if v == nil {
		return slices.Clone(in), slices.Clone(ranks)
	}
	var out []EngineMatch
	var outRanks []int
	for i, e := range in {
		if _, bad := (*v)[e.Engine]; !bad {
			out = append(out, e)
			outRanks = append(outRanks, ranks[i])
		}
	}
	return out, outRanks
}

// trustedAppend appends to out and outRanks the entries of in (and ranks) whose engine is
// trusted, in order, and returns them.
func (x *Index) trustedAppend(out []EngineMatch, outRanks []int, in []EngineMatch, ranks []int) ([]EngineMatch, []int) {
	v := x.trust.view.Load()
	if v == nil {
		return append(out, in...), append(outRanks, ranks...)
	}
	for i, e := range in {
		if _, bad := (*v)[e.Engine]; !bad {
			out = append(out, e)
			outRanks = append(outRanks, ranks[i])
		}
	}
	return out, outRanks
}

func checkHolder(op string, engine state.EngineID, rank int) error {
	if engine == "" {
		return &EventError{Op: op, Engine: engine, DPRank: rank, Err: ErrInvalidEngine}
	}
	if rank < 0 {
		return &EventError{Op: op, Engine: engine, DPRank: rank, Err: ErrInvalidRank}
	}
	return nil
}
