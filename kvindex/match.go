package kvindex

import (
	"math"
	"slices"

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

	pos   []int32  // engine slot → 1 + position in best, 0 when absent
	best  []uint32 // per engine found: its deepest count
	slots []uint32 // per engine found: its slot
	order []uint64 // sort keys: (MaxUint32 − blocks) << 32 | engine order

	// The search (see search).
	keys    []uint64 // MatchTokensInto's keys
	hs, hs2 []uint32 // holder IDs, grouped
	gs, gs2 []group
	probes  []probe
	masks   []uint16 // per holder of the round: bit j set when live at its group's probe j
	caps    []int32  // per holder at depth 0: first holey depth where it is not live
}

// group is a set of holders (hs[from:to], ascending) that are all live at depth lo (whose node
// is nlo) and not live at depth hi, where hi may be the query's end.
type group struct {
	lo, hi   int32
	from, to int32
	nlo      uint32
	p0, np   int32 // the round's probes of this group: probes[p0 : p0+np]
}

type probe struct {
	depth int32
	node  uint32
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
// holder's count). keys are a prompt's chained keys from the index's Hasher (other keys give an
// unspecified but well-formed result); empty keys is a valid query with an empty result.
// Approximate entries whose expiry has passed (by Options.Now) are not counted. Match allocates
// its result; MatchInto does not.
func (x *Index) Match(keys []uint64) *Matches {
	m := new(Matches)
	x.MatchInto(keys, m)
	return m
}

// maxQueryBlocks bounds a query so that block counts fit the sort keys; keys beyond it are
// ignored.
const maxQueryBlocks = 1<<31 - 1

// searchFanout is the most depths one round of the search probes per group of holders: a round
// costs the latency of about three dependent cache misses (table slot, node, holding run),
// whatever its number of probes, since they are independent; 8 answers a 512-block prompt in
// three rounds.
const searchFanout = 7

// MatchInto is Match writing into m, which it resets first. With a reused m it allocates nothing
// once m's buffers have grown to the index's size. It takes the index's read lock, so any number
// of MatchInto calls (on different Matches) run in parallel.
//
// Cost: it does not walk the prompt. Because a holder's entries along a prompt form a prefix
// except at holey blocks (index.go, "holes"), it finds each holder's deepest block by probing
// depths: the first block, then rounds that split each group of holders' interval at up to
// searchFanout depths (8-ary search), all probes of a round independent so that their cache
// misses overlap; about 1 + 3 × (distinct depths) rounds for a 512-block prompt. When the index
// has holey blocks it also looks every key up in the (small) holey set and caps each holder at
// the first holey block of the prompt where it is not live. Then a sort of the engines found.
func (x *Index) MatchInto(keys []uint64, m *Matches) {
	if len(keys) > maxQueryBlocks {
		keys = keys[:maxQueryBlocks]
	}
	if !x.beginMatch(len(keys), m) {
		return
	}
	defer x.mu.RUnlock()
	now := x.nowFor()
	if x.startGroups(keys, now, m) {
		x.search(keys, now, m)
	}
	x.finishMatch(m)
}

// MatchTokensInto is MatchInto for a prompt's token IDs: it hashes them with the index's Hasher,
// as far as some engine may hold the prompt: it hashes the first block and stops there when no
// engine holds it; otherwise it gallops, hashing up to depths 64, 512, 4096, … blocks and probing
// there, and stops hashing at the first depth no engine holds (when the index has holey blocks it
// hashes the whole prompt). m.QueryBlocks is still the prompt's full block count. The result
// equals MatchInto(x.Hasher().Keys(tokens), m).
func (x *Index) MatchTokensInto(tokens []uint32, m *Matches) {
	h := x.hasher
	b := h.blockTokens
	n := min(len(tokens)/b, maxQueryBlocks)
	if !x.beginMatch(n, m) {
		return
	}
	defer x.mu.RUnlock()
	now := x.nowFor()
	keys := growKeys(m.keys[:0], n)
	keys = append(keys, h.next(h.root, tokens[:b]))
	m.keys = keys
	n0, _ := x.lookupDepth(keys[0], 0)
	if n0 == 0 {
		x.finishMatch(m)
		return
	}
	if x.holey.len() > 0 {
		keys = h.appendFrom(keys, keys[0], tokens[b:n*b])
		m.keys = keys
		if x.startGroups(keys, now, m) {
			x.search(keys, now, m)
		}
		x.finishMatch(m)
		return
	}
	// Gallop: every holder live at depth 0 starts in one group; at each gallop depth the holders
	// still live there move on, the others keep the interval between the previous gallop depth
	// and this one.
	m.hs = x.liveHolders(n0, now, m.hs[:0])
	m.gs = append(m.gs[:0], group{lo: 0, hi: int32(n), from: 0, to: int32(len(m.hs)), nlo: n0})
	if len(m.hs) == 0 {
		x.finishMatch(m)
		return
	}
	for d := 63; ; d = d*8 + 7 {
		if d >= n-1 {
			keys = h.appendFrom(keys, keys[len(keys)-1], tokens[len(keys)*b:n*b])
			break
		}
		keys = h.appendFrom(keys, keys[len(keys)-1], tokens[len(keys)*b:(d+1)*b])
		if !x.gallopStep(keys, int32(d), now, m) {
			break
		}
	}
	m.keys = keys
	x.search(keys, now, m)
	x.finishMatch(m)
}

// gallopStep probes depth d for the last group of m.gs, whose holders are live at its lo: those
// live at d form a new last group (d, its hi); the others keep (lo, d). It reports whether some
// holder is live at d.
func (x *Index) gallopStep(keys []uint64, d int32, now int64, m *Matches) bool {
	last := &m.gs[len(m.gs)-1]
	n, _ := x.lookupDepth(keys[d], int(d))
	if n == 0 {
		last.hi = d
		return false
	}
	m.probes = append(m.probes[:0], probe{depth: d, node: n})
	last.p0, last.np = 0, 1
	from, to := int(last.from), int(last.to)
	m.masks = slices.Grow(m.masks[:0], len(m.hs))[:len(m.hs)]
	clear(m.masks)
	x.markLive(m, last, now)
	// Stable partition: holders not live at d first (they keep lo), then the live ones.
	m.hs2 = append(m.hs2[:0], m.hs[from:to]...)
	masks := m.masks[from:to]
	out, live := from, 0
	for i, h := range m.hs2 {
		if masks[i] == 0 {
			m.hs[out] = h
			out++
		}
	}
	split := out
	for i, h := range m.hs2 {
		if masks[i] != 0 {
			m.hs[out] = h
			out++
			live++
		}
	}
	if live == 0 {
		last.hi = d
		return false
	}
	if split > from {
		hi := last.hi
		last.hi, last.to = d, int32(split)
		m.gs = append(m.gs, group{lo: d, hi: hi, from: int32(split), to: int32(to), nlo: n})
	} else {
		last.lo, last.nlo = d, n
	}
	return true
}

// beginMatch resets m for a query of blocks blocks and, unless it is empty (false is returned),
// takes the read lock, which the caller releases after finishMatch.
func (x *Index) beginMatch(blocks int, m *Matches) bool {
	m.Engines = m.Engines[:0]
	m.slots = m.slots[:0]
	m.best = m.best[:0]
	m.gs = m.gs[:0]
	m.QueryBlocks = blocks
	if blocks == 0 {
		return false
	}
	x.mu.RLock()
	if cap(m.pos) < len(x.engines) {
		m.pos = make([]int32, len(x.engines), cap(x.engines))
	}
	m.pos = m.pos[:len(x.engines)]
	return true
}

// nowFor returns the clock in Unix ns when approximate entries exist, else the smallest time
// (every approximate entry would be live; there is none).
func (x *Index) nowFor() int64 {
	if x.approxCount > 0 {
		return x.now().UnixNano()
	}
	return math.MinInt64
}

// lookupDepth returns the node of key k if it is at depth d, and whether it is holey.
func (x *Index) lookupDepth(k uint64, d int) (uint32, bool) {
	n, ok := x.byKey.get(k, x.nodes)
	if !ok {
		return 0, false
	}
	dep := x.nodes[n].depth
	if int(dep&depthMask) != min(d, depthMask) {
		return 0, false
	}
	return n, dep&flagHoley != 0
}

// liveHolders appends the distinct holders live at node n to dst.
func (x *Index) liveHolders(n uint32, now int64, dst []uint32) []uint32 {
	nd := &x.nodes[n]
	lo, hi := int(nd.hold), int(nd.hold)+nd.nHold()
	for p := lo; p < hi; {
		h := entryHolder(x.hEntry[p])
		live := x.holdsLive(p, hi, h, now)
		for p < hi && entryHolder(x.hEntry[p]) == h {
			p++
		}
		if live {
			dst = append(dst, h)
		}
	}
	return dst
}

// startGroups finds the holders live at the first block and their search intervals: the query's
// end, or the first holey block of the query where the holder is not live. It reports whether
// any holder is live at the first block.
func (x *Index) startGroups(keys []uint64, now int64, m *Matches) bool {
	n0, _ := x.lookupDepth(keys[0], 0)
	if n0 == 0 {
		return false
	}
	m.hs = x.liveHolders(n0, now, m.hs[:0])
	if len(m.hs) == 0 {
		return false
	}
	end := int32(len(keys))
	if x.holey.len() == 0 {
		m.gs = append(m.gs[:0], group{lo: 0, hi: end, from: 0, to: int32(len(m.hs)), nlo: n0})
		return true
	}
	// Cap each holder at the first holey block where it is not live: below it, the holder's
	// entries along this prompt form a prefix (index.go, "holes").
	m.caps = slices.Grow(m.caps[:0], len(m.hs))[:len(m.hs)]
	for i := range m.caps {
		m.caps[i] = end
	}
	uncapped := len(m.hs)
	for d := 1; d < len(keys) && uncapped > 0; d++ {
		if _, ok := x.holey.get(keys[d]); !ok {
			continue
		}
		n, _ := x.lookupDepth(keys[d], d)
		if n == 0 {
			// Not in the tree at this depth: nothing deeper is either.
			for i := range m.caps {
				m.caps[i] = min(m.caps[i], int32(d))
			}
			break
		}
		for i, h := range m.hs {
			if m.caps[i] == end && !x.liveAt(n, h, now) {
				m.caps[i] = int32(d)
				uncapped--
			}
		}
	}
	// One group per distinct cap, holders ascending within each.
	m.hs2 = append(m.hs2[:0], m.hs...)
	m.hs = m.hs[:0]
	m.gs = m.gs[:0]
	for len(m.hs) < len(m.hs2) {
		c := int32(math.MaxInt32)
		for i := range m.hs2 {
			if m.caps[i] >= 0 {
				c = min(c, m.caps[i])
			}
		}
		from := int32(len(m.hs))
		for i, h := range m.hs2 {
			if m.caps[i] == c {
				m.hs = append(m.hs, h)
				m.caps[i] = -1
			}
		}
		m.gs = append(m.gs, group{lo: 0, hi: c, from: from, to: int32(len(m.hs)), nlo: n0})
	}
	return true
}

// search narrows every group of m.gs until each holder's deepest live block is known (hi = lo+1),
// then records the holders.
func (x *Index) search(keys []uint64, now int64, m *Matches) {
	for {
		// Plan the round: up to searchFanout depths strictly inside each open interval.
		m.probes = m.probes[:0]
		open := false
		for gi := range m.gs {
			g := &m.gs[gi]
			g.p0, g.np = int32(len(m.probes)), 0
			w := g.hi - g.lo
			if w <= 1 {
				continue
			}
			open = true
			k := min(searchFanout, w-1)
			for j := int32(1); j <= k; j++ {
				m.probes = append(m.probes, probe{depth: g.lo + int32(int64(w)*int64(j)/int64(k+1))})
			}
			g.np = k
		}
		if !open {
			break
		}
		// The probes are independent: issue every lookup before using any, so that their cache
		// misses overlap.
		for i := range m.probes {
			p := &m.probes[i]
			p.node, _ = x.lookupDepth(keys[p.depth], int(p.depth))
		}
		m.masks = slices.Grow(m.masks[:0], len(m.hs))[:len(m.hs)]
		clear(m.masks)
		for gi := range m.gs {
			if g := &m.gs[gi]; g.np > 0 {
				x.markLive(m, g, now)
			}
		}
		// Split each group by its holders' deepest live probe, keeping holders ascending.
		m.hs2 = m.hs2[:0]
		m.gs2 = m.gs2[:0]
		for gi := range m.gs {
			g := m.gs[gi]
			if g.np == 0 {
				from := int32(len(m.hs2))
				m.hs2 = append(m.hs2, m.hs[g.from:g.to]...)
				g.from, g.to = from, int32(len(m.hs2))
				m.gs2 = append(m.gs2, g)
				continue
			}
			for b := int32(0); b <= g.np; b++ {
				from := int32(len(m.hs2))
				for i := g.from; i < g.to; i++ {
					if int32(bitsLen16(m.masks[i])) == b {
						m.hs2 = append(m.hs2, m.hs[i])
					}
				}
				if int32(len(m.hs2)) == from {
					continue
				}
				ng := group{lo: g.lo, hi: g.hi, from: from, to: int32(len(m.hs2)), nlo: g.nlo}
				if b > 0 {
					p := m.probes[g.p0+b-1]
					ng.lo, ng.nlo = p.depth, p.node
				}
				if b < g.np {
					ng.hi = m.probes[g.p0+b].depth
				}
				m.gs2 = append(m.gs2, ng)
			}
		}
		m.hs, m.hs2 = m.hs2, m.hs
		m.gs, m.gs2 = m.gs2, m.gs
	}
	for _, g := range m.gs {
		x.markRef(g.nlo)
		for _, h := range m.hs[g.from:g.to] {
			x.record(m, h, int(g.lo)+1)
		}
	}
}

// bitsLen16 is the index of the highest set bit plus one (0 for 0).
func bitsLen16(v uint16) int {
	n := 0
	for v != 0 {
		v >>= 1
		n++
	}
	return n
}

// markLive sets bit j of m.masks[i] for every holder hs[i] of g live at g's probe j.
func (x *Index) markLive(m *Matches, g *group, now int64) {
	hs := m.hs[g.from:g.to]
	masks := m.masks[g.from:g.to]
	for j := range g.np {
		n := m.probes[g.p0+j].node
		if n == 0 {
			continue
		}
		bit := uint16(1) << j
		nd := &x.nodes[n]
		lo, hi := int(nd.hold), int(nd.hold)+nd.nHold()
		if hi-lo > 8*len(hs) {
			// Few holders against a crowded block: binary-search each one.
			for i, h := range hs {
				a, b := lo, hi
				for a < b {
					mid := int(uint(a+b) >> 1)
					if entryHolder(x.hEntry[mid]) < h {
						a = mid + 1
					} else {
						b = mid
					}
				}
				if x.holdsLive(a, hi, h, now) {
					masks[i] |= bit
				}
			}
			continue
		}
		p := lo
		for i, h := range hs {
			for p < hi && entryHolder(x.hEntry[p]) < h {
				p++
			}
			if x.holdsLive(p, hi, h, now) {
				masks[i] |= bit
			}
		}
	}
}

// liveAt reports whether holder h is live at node n.
func (x *Index) liveAt(n, h uint32, now int64) bool {
	lo, hi := x.findHolder(n, h)
	return x.holdsLive(lo, hi, h, now)
}

// holdsLive reports whether the entries from slab position p (before hi) include holder h with a
// real entry or an unexpired approximate one.
func (x *Index) holdsLive(p, hi int, h uint32, now int64) bool {
	for ; p < hi && entryHolder(x.hEntry[p]) == h; p++ {
		if x.hEntry[p]&approxEntryBit == 0 || int64(x.hAux[p]) > now {
			return true
		}
	}
	return false
}

// finishMatch orders the engines recorded.
func (x *Index) finishMatch(m *Matches) {
	// Deepest first, ties by engine ID: sort integer keys, since the engines' order by ID is
	// maintained by the writers.
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

// matchLinearInto is the walk Match used before the probing search: one table probe per block,
// checking each node's parent, merging the still-matching holders with each block's entries. It
// answers exactly what MatchInto answers (tests use it as an oracle, and BenchmarkScale as the
// baseline), and marks nothing for CLOCK.
func (x *Index) matchLinearInto(keys []uint64, m *Matches) {
	if len(keys) > maxQueryBlocks {
		keys = keys[:maxQueryBlocks]
	}
	if !x.beginMatch(len(keys), m) {
		return
	}
	defer x.mu.RUnlock()
	now := x.nowFor()
	active, next := m.hs[:0], m.hs2[:0]
	prev := uint32(0)
	matched := 0
	for d, k := range keys {
		n, ok := x.byKey.get(k, x.nodes)
		if !ok || x.nodes[n].parent != prev {
			break
		}
		next = next[:0]
		if d == 0 {
			next = x.liveHolders(n, now, next)
		} else {
			for _, h := range active {
				if x.liveAt(n, h, now) {
					next = append(next, h)
				} else {
					x.record(m, h, d)
				}
			}
		}
		active, next = next, active
		if len(active) == 0 {
			break
		}
		matched = d + 1
		prev = n
	}
	for _, h := range active {
		x.record(m, h, matched)
	}
	m.hs, m.hs2 = active[:0], next[:0]
	x.finishMatch(m)
}
