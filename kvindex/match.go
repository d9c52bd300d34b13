package kvindex

import (
	"math"
	"slices"
	"unsafe"

	"github.com/enginepick/enginepick/state"
)

// EngineMatch is one engine's answer to a query: it holds the query's first Blocks blocks
// contiguously, on at least one of its DP ranks and in at least one tier.
type EngineMatch struct {
	// Engine is the holder, compared byte for byte with the group's engine IDs.
	Engine state.EngineID
	// Blocks is the number of leading query blocks held, in [1, query blocks]. Multiply by the
	// block size for tokens (docs/design.md §9.1 for the proportional conversion when the
	// prompt has a trailing partial block).
	Blocks int
}

// Matches is the result of a Match: every engine that holds at least the query's first block,
// with how many leading blocks it holds. Reuse one Matches across MatchInto calls to match without
// allocating; a Matches must not be used by two calls at once. The zero value is ready to use.
type Matches struct {
	// Engines lists each engine with Blocks ≥ 1, deepest first, ties by engine ID ascending. An
	// engine absent from the list holds not even the first block (a confirmed miss for it). It is
	// overwritten by the next MatchInto into the same Matches.
	Engines []EngineMatch
	// QueryBlocks is the number of keys matched against (the query's full blocks).
	QueryBlocks int

	active []uint32 // holder IDs still matching, ascending
	spare  []uint32
	pos    []int32   // engine slot → 1 + position in best, 0 when absent
	best   []uint32  // per engine found: its deepest count
	slots  []uint32  // per engine found: its slot
	order  []uint64  // sort keys: (MaxUint32 − blocks) << 32 | engine order
	walk   matchWalk // the walk in progress, kept here so that it does not escape to the heap
}

// Blocks returns engine's matched block count, or 0 when it holds not even the first block.
func (m *Matches) Blocks(engine state.EngineID) int {
	for _, e := range m.Engines {
		if e.Engine == engine {
			return e.Blocks
		}
	}
	return 0
}

// Match returns, for every engine, the number of leading blocks of keys it holds contiguously,
// folded over its DP ranks by maximum (docs/design.md §11; a hole stops a
// holder's count). keys are a prompt's chained keys from the index's Hasher; empty keys is a valid
// query with an empty result. Approximate entries whose expiry has passed (by Options.Now) are not
// counted. Match allocates its result; MatchInto does not.
func (x *Index) Match(keys []uint64) *Matches {
	m := new(Matches)
	x.MatchInto(keys, m)
	return m
}

// maxQueryBlocks bounds a query so that block counts fit the sort keys; keys beyond it are
// ignored.
const maxQueryBlocks = 1<<31 - 1

// MatchInto is Match writing into m, which it resets first. With a reused m it allocates nothing
// once m's buffers have grown to the index's size. It takes the index's read lock for the walk,
// so any number of MatchInto calls (on different Matches) run in parallel. Cost: one table probe
// per matched block; a block whose holder entries equal its parent's costs one byte comparison
// of the two runs, any other block a merge of the still-matching holders with its own (a binary
// search per holder when few remain against many); then a sort of the engines found.
func (x *Index) MatchInto(keys []uint64, m *Matches) {
	if len(keys) > maxQueryBlocks {
		keys = keys[:maxQueryBlocks]
	}
	w := x.beginMatch(len(keys), m)
	if w == nil {
		return
	}
	defer x.mu.RUnlock()
	for d, k := range keys {
		if !w.step(d, k) {
			break
		}
	}
	w.finish()
}

// MatchTokensInto is MatchInto for a prompt's token IDs: it hashes them with the index's Hasher,
// one block at a time during the walk, and stops hashing where the walk stops, so the blocks past
// the deepest held prefix are never hashed. m.QueryBlocks is still the prompt's full block count.
// The result equals MatchInto(x.Hasher().Keys(tokens), m).
func (x *Index) MatchTokensInto(tokens []uint32, m *Matches) {
	x.matchTokens(tokens, m, nil)
}

// matchTokens is MatchTokensInto that also appends every key it computed (a prefix of the
// prompt's chain, one block past the deepest held prefix) to *keys when keys is not nil.
func (x *Index) matchTokens(tokens []uint32, m *Matches, keys *[]uint64) {
	h := x.hasher
	b := h.blockTokens
	w := x.beginMatch(min(len(tokens)/b, maxQueryBlocks), m)
	if w == nil {
		return
	}
	defer x.mu.RUnlock()
	k := h.root
	for d := range m.QueryBlocks {
		k = h.next(k, tokens[d*b:(d+1)*b])
		if keys != nil {
			*keys = append(*keys, k)
		}
		if !w.step(d, k) {
			break
		}
	}
	w.finish()
}

// matchWalk is one Match in progress: the holders still matching and the depth reached.
type matchWalk struct {
	x       *Index
	m       *Matches
	now     int64
	active  []uint32
	spare   []uint32
	same    bool // active is exactly the distinct holders of prev, none of them expired
	prev    uint32
	matched int
}

// beginMatch resets m for a query of blocks blocks and, unless it is empty (nil is returned),
// takes the read lock, which the caller releases after finish.
func (x *Index) beginMatch(blocks int, m *Matches) *matchWalk {
	m.Engines = m.Engines[:0]
	m.slots = m.slots[:0]
	m.best = m.best[:0]
	m.QueryBlocks = blocks
	if blocks == 0 {
		return nil
	}
	x.mu.RLock()
	if cap(m.pos) < len(x.engines) {
		m.pos = make([]int32, len(x.engines), cap(x.engines))
	}
	m.pos = m.pos[:len(x.engines)]
	w := &m.walk
	*w = matchWalk{x: x, m: m, now: int64(-1 << 63), active: m.active[:0], spare: m.spare[:0]}
	if x.approxCount > 0 {
		w.now = x.now().UnixNano()
	}
	return w
}

// step advances the walk to depth d, whose key is k, and reports whether it may go on.
func (w *matchWalk) step(d int, k uint64) bool {
	x := w.x
	n, ok := x.byKey.get(k)
	if !ok {
		return false
	}
	nd := &x.nodes[n]
	if nd.parent != w.prev {
		return false
	}
	if w.same && nd.meta&flagApprox == 0 && x.sameRun(n, w.prev) {
		// Same holder entries as the parent: nobody drops out here.
	} else {
		w.spare, w.same = x.intersect(n, d, w.active, w.spare[:0], w.now, w.m)
		w.active, w.spare = w.spare, w.active
	}
	if len(w.active) == 0 {
		return false
	}
	x.markRef(n)
	w.matched = d + 1
	w.prev = n
	return true
}

// finish records the holders still matching and orders the result.
func (w *matchWalk) finish() {
	x, m, active, spare, matched := w.x, w.m, w.active, w.spare, w.matched
	for _, h := range active {
		x.record(m, h, matched)
	}
	m.active, m.spare = active[:0], spare[:0]
	// Deepest first, ties by engine ID: sort integer keys, since the engines' order by ID is
	// maintained by the writers.
	// Holders were recorded as they dropped out, shallowest first: walking backwards hands the
	// sort an almost sorted input.
	m.order = m.order[:0]
	for i := len(m.slots) - 1; i >= 0; i-- {
		e := m.slots[i]
		m.pos[e] = 0
		m.order = append(m.order, uint64(math.MaxUint32-m.best[i])<<32|uint64(x.engines[e].order))
	}
	slices.Sort(m.order)
	for _, k := range m.order {
		e := x.byID[uint32(k)]
		m.Engines = append(m.Engines, EngineMatch{Engine: x.engines[e].id, Blocks: int(math.MaxUint32 - uint32(k>>32))})
	}
}

// intersect computes the holders of active that still hold node n (at query depth d), appending
// them to out; holders that drop out are recorded with depth d. At depth 0 every live holder of n
// starts. It reports whether out equals n's complete set of distinct holders.
func (x *Index) intersect(n uint32, d int, active, out []uint32, now int64, m *Matches) ([]uint32, bool) {
	nd := &x.nodes[n]
	lo, hi := int(nd.hold), int(nd.hold)+nd.nHold()
	if d > 0 && hi-lo > 8*len(active) {
		// Few holders left against a crowded block: binary-search each one.
		for _, h := range active {
			a, b := lo, hi
			for a < b {
				mid := int(uint(a+b) >> 1)
				if x.hHolder[mid] < h {
					a = mid + 1
				} else {
					b = mid
				}
			}
			if x.holdsLive(a, hi, h, now) {
				out = append(out, h)
			} else {
				x.record(m, h, d)
			}
		}
		return out, false
	}
	distinct := 0
	i := 0
	for p := lo; p < hi; {
		h := x.hHolder[p]
		live := x.holdsLive(p, hi, h, now)
		for p < hi && x.hHolder[p] == h {
			p++
		}
		distinct++
		if !live {
			continue
		}
		if d == 0 {
			out = append(out, h)
			continue
		}
		for i < len(active) && active[i] < h {
			x.record(m, active[i], d)
			i++
		}
		if i < len(active) && active[i] == h {
			out = append(out, h)
			i++
		}
	}
	for ; i < len(active); i++ {
		x.record(m, active[i], d)
	}
	return out, len(out) == distinct
}

// sameRun reports whether nodes a and b carry the same holder IDs in the same order, which implies
// the same holder set. It compares the runs as bytes (vectorised memequal), so a block shared by
// 64 engines costs one 256-byte comparison rather than a merge.
func (x *Index) sameRun(a, b uint32) bool {
	na, nb := &x.nodes[a], &x.nodes[b]
	k := na.nHold()
	if k != nb.nHold() {
		return false
	}
	ra := x.hHolder[na.hold : int(na.hold)+k]
	rb := x.hHolder[nb.hold : int(nb.hold)+k]
	return string(unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(ra))), 4*k)) ==
		string(unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(rb))), 4*k))
}

// holdsLive reports whether the entries from slab position p (before hi) include holder h with a
// real entry or an unexpired approximate one.
func (x *Index) holdsLive(p, hi int, h uint32, now int64) bool {
	for ; p < hi && x.hHolder[p] == h; p++ {
		if x.hTiers[p]&approxBit == 0 || int64(x.hAux[p]) > now {
			return true
		}
	}
	return false
}

// record folds holder h's contiguous depth into its engine's result (maximum over DP ranks).
func (x *Index) record(m *Matches, h uint32, depth int) {
	if depth == 0 {
		return
	}
	e := x.holders[h].engine
	if p := m.pos[e]; p != 0 {
		m.best[p-1] = max(m.best[p-1], uint32(depth))
		return
	}
	m.best = append(m.best, uint32(depth))
	m.slots = append(m.slots, e)
	m.pos[e] = int32(len(m.slots))
}
