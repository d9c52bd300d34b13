package kvindex

import (
	"math"
	"math/bits"
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

// matches is a match's result and working memory: every engine that holds at least the query's
// first block, with how many leading blocks it holds. Reuse one across matchInto calls to match
// without allocating; it must not be used by two calls at once. The zero value is ready to use.
type matches struct {
	// Engines lists each engine with Blocks ≥ 1, deepest first, ties by engine ID ascending. An
	// engine absent from the list holds not even the first block (a confirmed miss for it). It is
	// overwritten by the next matchInto into the same matches.
	Engines []EngineMatch
	// DPRanks has one entry per Engines entry: the engine's DP rank holding its Blocks blocks (the
	// lowest such rank when several do). A cache-aware pick names it (docs/design.md §6, §11).
	// Overwritten as Engines is.
	DPRanks []int
	// QueryBlocks is the number of keys matched against (the query's full blocks).
	QueryBlocks int

	pos   []int32  // engine slot → 1 + position in best, 0 when absent
	best  []uint32 // per engine found: its deepest count
	brank []int32  // per engine found: the lowest rank holding best
	slots []uint32 // per engine found: its slot
	order []uint64 // sort keys: (MaxUint32 − blocks) << 32 | engine order

	// The search (see search). A set of holders is a bitmap over hs of w words.
	keys    []uint64 // matchTokensInto's keys
	hs      []uint32 // the holders live at the query's first block, ascending
	hdepth  []int32  // per holder of hs: the depth its real entries reach (search)
	lfol    []uint32 // matchLinearInto: per active holder, the record it follows
	lfol2   []uint32
	hs2     []uint32 // matchLinearInto's scratch
	bit     []int32  // holder ID → 1 + its index in hs, 0 when not in hs
	sink    uint32   // keeps search's warming loads
	gs1     []group1 // search1's groups
	gs12    []group1
	probes1 []probe1
	bitSet  bool // bit holds hs's indexes (cleared by finishMatch)
	w       int
	gs, gs2 []group
	sets    []uint64 // group i's set: sets[i*w : (i+1)*w]
	sets2   []uint64
	probes  []probe
	pmasks  []uint64 // probe j's live holders: pmasks[j*w : (j+1)*w]
	scratch []uint64
}

// group is a set of holders that are all live at depth lo (whose node is nlo) and not live at
// depth hi, where hi may be the query's end.
type group struct {
	lo, hi int32
	nlo    uint32
	p0, np int32 // the round's probes of this group: probes[p0 : p0+np]
}

type probe struct {
	depth int32
	node  uint32
	sum   uint32 // the node's holder summary (nodeTable)
}

// group1 and probe1 are group and probe for search1: one word per set.
type group1 struct {
	lo, hi int32
	nlo    uint32
	p0, np int32
	set    uint64
}

type probe1 struct {
	depth int32
	node  uint32
	sum   uint32
}

// Match returns, for every engine, the number of leading blocks of keys it holds contiguously,
// folded over its DP ranks by maximum (docs/design.md §11; a hole stops a holder's count), as a
// Result: OutcomeHit with Engines (deepest first, ties by engine ID) and DPRanks (the rank
// holding each engine's blocks, the lowest on a tie) when some engine holds the first block,
// OutcomeMiss otherwise; QueryBlocks is len(keys) and BlockTokens the Hasher's. keys are a
// prompt's chained keys from the index's Hasher (other keys give an unspecified but well-formed
// result); empty keys is a valid query, a miss. Approximate entries (records beside the tree,
// approx.go) count like real ones until their expiry by Options.Now. Unlike a LocalSource's
// Lookup, Match reports engines marked untrusted (docs/design.md §13.1). It takes the read lock,
// so any number of Match calls run in parallel, and allocates its result.
//
// Cost: it does not walk the prompt. Because a holder's entries along a prompt form a prefix
// except at holey blocks (index.go, "holes"), it finds each holder's deepest block by probing
// depths: the first block, then rounds that split each group of holders' interval at a few
// depths (k-ary search), all probes of a round independent so that their cache misses overlap;
// about 1 + 2 × (distinct depths) × log₄(blocks) probes. When the index has holey blocks it also
// looks every key up in the (small) holey set and caps each holder at the first holey block of
// the prompt where it is not live. Then, when the index has approximate entries, one probe of
// the records' first-key table per distinct depth the holders reached (and one at the first
// block), extending each holder through the record that starts where its real blocks end
// (approx.go). Then a sort of the engines found.
func (x *Index) Match(keys []uint64) Result {
	var m matches
	x.matchInto(keys, &m)
	r := Result{Outcome: OutcomeMiss, QueryBlocks: m.QueryBlocks, BlockTokens: x.hasher.blockTokens}
	if len(m.Engines) > 0 {
		r.Outcome, r.Engines, r.DPRanks = OutcomeHit, m.Engines, m.DPRanks
	}
	return r
}

// maxQueryBlocks bounds a query so that block counts fit the sort keys; keys beyond it are
// ignored.
const maxQueryBlocks = 1<<31 - 1

// Search fanouts: a round of the search probes up to firstFanout depths of the query's whole
// range, then up to fanout depths inside each group's interval. A probe reads one key-table slot,
// whose holder summary answers it (the node and its holding run only when the summary is not
// exact: nodeTable); the probes of a round are independent, so their cache misses overlap, but
// each probe still costs memory bandwidth and each round a miss's latency. 7 then 3 answers a
// 512-block prompt in four or five rounds of at most a few dozen probes, and is faster than both
// fewer probes in more rounds (binary search) and fewer rounds of more probes.
const (
	firstFanout = 7
	fanout      = 3
)

// matchInto is Match writing into m, which it resets first (see Match for the answer and the
// cost). With a reused m it allocates nothing once m's buffers have grown to the index's size.
func (x *Index) matchInto(keys []uint64, m *matches) {
	if len(keys) > maxQueryBlocks {
		keys = keys[:maxQueryBlocks]
	}
	if !x.beginMatch(len(keys), m) {
		return
	}
	defer x.mu.RUnlock()
	now := x.nowFor()
	inTree := x.startGroups(keys, m)
	if inTree {
		x.search(keys, m)
	}
	x.matchPlacements(keys, now, m, inTree)
	x.finishMatch(m)
}

// matchTokensInto is matchTokensFrom for a base-model prompt (the Hasher's root).
func (x *Index) matchTokensInto(tokens []uint32, m *matches) {
	x.matchTokensFrom(tokens, x.hasher.root, m)
}

// matchTokensFrom is matchInto for a prompt's token IDs chained from root (Hasher.rootFor of the
// prompt's adapter): it hashes the first block with the index's Hasher and stops there when no
// engine holds it (a cold prompt costs one block's hash); otherwise it hashes the whole prompt first and then searches, so that the search's independent
// probes overlap their cache misses (hashing a block and probing it in turn would serialise
// them). m.QueryBlocks is the prompt's full block count. The result equals
// matchInto(the prompt's keys from root, m).
func (x *Index) matchTokensFrom(tokens []uint32, root uint64, m *matches) {
	h := x.hasher
	b := h.blockTokens
	n := min(len(tokens)/b, maxQueryBlocks)
	if !x.beginMatch(n, m) {
		return
	}
	defer x.mu.RUnlock()
	keys := growKeys(m.keys[:0], n)
	keys = append(keys, h.next(root, tokens[:b]))
	if n0, _, _ := x.byKey.get(keys[0]); n0 != 0 || x.placedAt(keys[0]) {
		keys = h.appendFrom(keys, keys[0], tokens[b:n*b])
		now := x.nowFor()
		inTree := x.startGroups(keys, m)
		if inTree {
			x.search(keys, m)
		}
		x.matchPlacements(keys, now, m, inTree)
	}
	m.keys = keys
	x.finishMatch(m)
}

// beginMatch resets m for a query of blocks blocks and, unless it is empty (false is returned),
// takes the read lock, which the caller releases after finishMatch.
func (x *Index) beginMatch(blocks int, m *matches) bool {
	m.Engines = m.Engines[:0]
	m.DPRanks = m.DPRanks[:0]
	m.slots = m.slots[:0]
	m.best = m.best[:0]
	m.brank = m.brank[:0]
	m.gs = m.gs[:0]
	m.sets = m.sets[:0]
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

// liveHolders appends the distinct holders of node n to dst.
func (x *Index) liveHolders(n uint32, dst []uint32) []uint32 {
	nd := x.node(n)
	lo, hi := int(nd.hold), int(nd.hold)+nd.nHold()
	for p := lo; p < hi; p++ {
		if h := entryHolder(x.hold(p).e); p == lo || entryHolder(x.hold(p-1).e) != h {
			dst = append(dst, h)
		}
	}
	return dst
}

// startGroups finds the holders live at the first block (m.hs) and their search intervals: the
// query's end, or the first holey block of the query where the holder is not live. It reports
// whether any holder is live at the first block.
func (x *Index) startGroups(keys []uint64, m *matches) bool {
	n0, sum0, _ := x.byKey.get(keys[0])
	if n0 == 0 {
		return false
	}
	if sum0&summaryInexact == 0 {
		// The summary lists the holders, ascending, every one live.
		m.hs = m.hs[:0]
		for s := sum0; s != 0; s &= s - 1 {
			m.hs = append(m.hs, uint32(bits.TrailingZeros32(s)))
		}
	} else {
		m.hs = x.liveHolders(n0, m.hs[:0])
	}
	if x.hiddenHolders > 0 {
		// Holders being cleared are left out whole (index.go, clearHolders).
		m.hs = slices.DeleteFunc(m.hs, func(h uint32) bool { return x.holders[h].hidden })
	}
	if len(m.hs) == 0 {
		return false
	}
	if len(m.bit) < len(x.holders) {
		m.bit = make([]int32, len(x.holders), cap(x.holders))
	}
	for i, h := range m.hs {
		m.bit[h] = int32(i + 1)
	}
	m.bitSet = true
	m.hdepth = slices.Grow(m.hdepth[:0], len(m.hs))[:len(m.hs)]
	w := (len(m.hs) + 63) / 64
	m.w = w
	m.scratch = slices.Grow(m.scratch[:0], 2*w)[:2*w]
	all := m.scratch[w : 2*w]
	for i := range all {
		all[i] = ^uint64(0)
	}
	if r := len(m.hs) % 64; r != 0 {
		all[w-1] = 1<<r - 1
	}
	end := int32(len(keys))
	if x.holey.len() > 0 {
		// Cap each holder at the first holey block where it is not live: below it, the holder's
		// entries along this prompt form a prefix (index.go, "holes").
		for d := 1; d < len(keys) && !isZero(all); d++ {
			if _, ok := x.holey.get(keys[d]); !ok {
				continue
			}
			n, sum, _ := x.byKey.get(keys[d])
			capped := m.scratch[:w]
			if n == 0 {
				copy(capped, all) // not in the tree at this depth: nothing deeper is either
			} else {
				live := x.liveMask(n, sum, all, m, m.scratch[:w])
				for i := range w {
					capped[i] = all[i] &^ live[i]
				}
			}
			if isZero(capped) {
				continue
			}
			m.gs = append(m.gs, group{lo: 0, hi: int32(d), nlo: n0})
			m.sets = append(m.sets, capped...)
			for i := range w {
				all[i] &^= capped[i]
			}
		}
		if isZero(all) {
			return true
		}
	}
	m.gs = append(m.gs, group{lo: 0, hi: end, nlo: n0})
	m.sets = append(m.sets, all...)
	return true
}

// search narrows every group of m.gs until each holder's deepest live block is known (hi = lo+1),
// then records the holders.
func (x *Index) search(keys []uint64, m *matches) {
	if m.w == 1 && !x.wideSearch {
		x.search1(keys, m)
		return
	}
	w := m.w
	for round := 0; ; round++ {
		// Plan the round: a few depths strictly inside each open interval.
		m.probes = m.probes[:0]
		k := int32(fanout)
		if round == 0 {
			k = firstFanout
		}
		for gi := range m.gs {
			g := &m.gs[gi]
			g.p0, g.np = int32(len(m.probes)), 0
			span := g.hi - g.lo
			if span <= 1 {
				continue
			}
			np := min(k, span-1)
			if round == 0 {
				// The first round's last probe is the interval's last depth, so that holders of
				// the whole range (a repeated prompt) are done at once.
				for j := int32(1); j <= np; j++ {
					m.probes = append(m.probes, probe{depth: g.lo + int32(int64(span-1)*int64(j)/int64(np))})
				}
			} else {
				for j := int32(1); j <= np; j++ {
					m.probes = append(m.probes, probe{depth: g.lo + int32(int64(span)*int64(j)/int64(np+1))})
				}
			}
			g.np = np
		}
		if len(m.probes) == 0 {
			break
		}
		// The probes are independent: issue every lookup before using any, so that their cache
		// misses overlap.
		for i := range m.probes {
			p := &m.probes[i]
			p.node, p.sum, _ = x.byKey.get(keys[p.depth])
		}
		// Then the holding run of every probed block whose summary does not say its holders,
		// before any is used, for the same reason.
		sink := uint32(0)
		for i := range m.probes {
			if n := m.probes[i].node; n != 0 && m.probes[i].sum&summaryInexact != 0 {
				sink += x.hold(int(x.node(n).hold)).e
			}
		}
		m.sink += sink

		m.pmasks = slices.Grow(m.pmasks[:0], len(m.probes)*w)[:len(m.probes)*w]
		for gi := range m.gs {
			g := &m.gs[gi]
			set := m.sets[gi*w : (gi+1)*w]
			for j := g.p0; j < g.p0+g.np; j++ {
				x.liveMask(m.probes[j].node, m.probes[j].sum, set, m, m.pmasks[j*int32(w):(j+1)*int32(w)])
			}
		}
		// Split each group by its holders' deepest live probe.
		m.gs2, m.sets2 = m.gs2[:0], m.sets2[:0]
		for gi := range m.gs {
			g := m.gs[gi]
			rest := m.scratch[:w]
			copy(rest, m.sets[gi*w:(gi+1)*w])
			for j := g.np - 1; j >= 0; j-- {
				live := m.pmasks[(g.p0+j)*int32(w) : (g.p0+j+1)*int32(w)]
				from := len(m.sets2)
				any := uint64(0)
				for i := range w {
					b := rest[i] & live[i]
					m.sets2 = append(m.sets2, b)
					rest[i] &^= b
					any |= b
				}
				if any == 0 {
					m.sets2 = m.sets2[:from]
					continue
				}
				p := m.probes[g.p0+j]
				hi := g.hi
				if j+1 < g.np {
					hi = m.probes[g.p0+j+1].depth
				}
				m.gs2 = append(m.gs2, group{lo: p.depth, hi: hi, nlo: p.node})
			}
			if !isZero(rest) {
				if g.np > 0 {
					g.hi = m.probes[g.p0].depth
				}
				m.gs2 = append(m.gs2, g)
				m.sets2 = append(m.sets2, rest...)
			}
		}
		m.gs, m.gs2 = m.gs2, m.gs
		m.sets, m.sets2 = m.sets2, m.sets
	}
	for gi, g := range m.gs {
		x.markRef(g.nlo)
		for i, word := range m.sets[gi*w : (gi+1)*w] {
			for word != 0 {
				b := bits.TrailingZeros64(word)
				word &= word - 1
				m.hdepth[i*64+b] = g.lo + 1
				x.record(m, m.hs[i*64+b], int(g.lo)+1)
			}
		}
	}
}

// search1 is search for at most 64 holders (one word per set, the common case), with the sets
// and live masks held in the groups and probes themselves.
func (x *Index) search1(keys []uint64, m *matches) {
	gs := m.gs1[:0]
	for gi, g := range m.gs {
		gs = append(gs, group1{lo: g.lo, hi: g.hi, nlo: g.nlo, set: m.sets[gi]})
	}
	k := int32(firstFanout)
	for round := 0; ; round++ {
		probes := m.probes1[:0]
		for gi := range gs {
			g := &gs[gi]
			g.p0, g.np = int32(len(probes)), 0
			span := g.hi - g.lo
			if span <= 1 {
				continue
			}
			np := min(k, span-1)
			for j := int32(1); j <= np; j++ {
				var d int32
				if round == 0 {
					// The first round's last probe is the interval's last depth, so that
					// holders of the whole range (a repeated prompt) are done at once.
					d = g.lo + int32(int64(span-1)*int64(j)/int64(np))
				} else {
					d = g.lo + int32(int64(span)*int64(j)/int64(np+1))
				}
				probes = append(probes, probe1{depth: d})
			}
			g.np = np
		}
		m.probes1 = probes
		if len(probes) == 0 {
			break
		}
		k = fanout
		// Issue every lookup, then every run load, before using any: the probes are
		// independent, so their cache misses overlap.
		for i := range probes {
			p := &probes[i]
			p.node, p.sum, _ = x.byKey.get(keys[p.depth])
		}
		sink := uint32(0)
		for i := range probes {
			if n := probes[i].node; n != 0 && probes[i].sum&summaryInexact != 0 {
				sink += x.hold(int(x.node(n).hold)).e
			}
		}
		m.sink += sink
		// Split each group by its holders' deepest live probe.
		gs2 := m.gs12[:0]
		for _, g := range gs {
			rest := g.set
			for j := g.np - 1; j >= 0 && rest != 0; j-- {
				p := probes[g.p0+j]
				b := rest & x.liveWord(p.node, p.sum, rest, m)
				if b == 0 {
					continue
				}
				rest &^= b
				hi := g.hi
				if j+1 < g.np {
					hi = probes[g.p0+j+1].depth
				}
				gs2 = append(gs2, group1{lo: p.depth, hi: hi, nlo: p.node, set: b})
			}
			if rest != 0 {
				if g.np > 0 {
					g.hi = probes[g.p0].depth
				}
				g.set = rest
				gs2 = append(gs2, g)
			}
		}
		m.gs1, m.gs12 = gs2, gs
		gs = gs2
	}
	for _, g := range gs {
		x.markRef(g.nlo)
		for word := g.set; word != 0; word &= word - 1 {
			b := bits.TrailingZeros64(word)
			m.hdepth[b] = g.lo + 1
			x.record(m, m.hs[b], int(g.lo)+1)
		}
	}
}

// liveWord returns holders live at node n, whose holder summary is sum, as a word over m.hs:
// at least those of set (none when n is 0).
func (x *Index) liveWord(n, sum uint32, set uint64, m *matches) uint64 {
	if n == 0 {
		return 0
	}
	if sum&summaryInexact == 0 {
		return summaryWord(sum, m.bit)
	}
	nd := x.node(n)
	lo, hi := int(nd.hold), int(nd.hold)+nd.nHold()
	if hi-lo > 4*bits.OnesCount64(set) {
		var in, out [1]uint64
		in[0] = set
		return x.liveMask(n, sum, in[:], m, out[:])[0]
	}
	acc := uint64(0)
	bit := m.bit
	for _, e := range x.holds.span(lo, hi-lo) {
		if b := uint32(bit[e.e>>8]) - 1; b < 64 {
			acc |= 1 << b
		}
	}
	return acc
}

// summaryWord returns the holders of an exact holder summary (no summaryInexact) that are in
// m.hs (bit: holder ID → 1 + index in m.hs), as a word over the first 64 of m.hs.
func summaryWord(sum uint32, bit []int32) uint64 {
	acc := uint64(0)
	for s := sum; s != 0; s &= s - 1 {
		if b := uint32(bit[bits.TrailingZeros32(s)]) - 1; b < 64 {
			acc |= 1 << b
		}
	}
	return acc
}

// liveMask writes into dst the holders of set (a bitmap over m.hs) live at node n, whose holder
// summary is sum (none when n is 0), and returns dst.
func (x *Index) liveMask(n, sum uint32, set []uint64, m *matches, dst []uint64) []uint64 {
	for i := range dst {
		dst[i] = 0 // not clear(dst): a call to memclr for a word or two
	}
	if n == 0 {
		return dst
	}
	if sum&summaryInexact == 0 {
		// Exact: the summary names every holder, each live; the node is not read.
		for s := sum; s != 0; s &= s - 1 {
			if i := m.bit[bits.TrailingZeros32(s)] - 1; i >= 0 && set[i>>6]&(1<<(i&63)) != 0 {
				dst[i>>6] |= 1 << (i & 63)
			}
		}
		return dst
	}
	nd := x.node(n)
	lo, hi := int(nd.hold), int(nd.hold)+nd.nHold()
	members := 0
	for _, word := range set {
		members += bits.OnesCount64(word)
	}
	if hi-lo > 4*members {
		// Few holders against a crowded block: binary-search each one.
		for i, word := range set {
			for word != 0 {
				b := bits.TrailingZeros64(word)
				word &= word - 1
				h := m.hs[i*64+b]
				a, z := lo, hi
				for a < z {
					mid := int(uint(a+z) >> 1)
					if entryHolder(x.hold(mid).e) < h {
						a = mid + 1
					} else {
						z = mid
					}
				}
				if x.holdsLive(a, hi, h) {
					dst[i] |= 1 << b
				}
			}
		}
		return dst
	}
	bit := m.bit
	if len(dst) == 1 {
		// Up to 64 holders.
		acc := uint64(0)
		for _, e := range x.holds.span(lo, hi-lo) {
			if b := uint32(bit[e.e>>8]) - 1; b < 64 {
				acc |= 1 << b
			}
		}
		dst[0] = acc & set[0]
		return dst
	}
	for p := lo; p < hi; p++ {
		e := x.hold(p).e
		i := bit[entryHolder(e)] - 1
		if i >= 0 && set[i>>6]&(1<<(i&63)) != 0 {
			dst[i>>6] |= 1 << (i & 63)
		}
	}
	return dst
}

func isZero(s []uint64) bool {
	for _, v := range s {
		if v != 0 {
			return false
		}
	}
	return true
}

// liveAt reports whether holder h has an entry at node n.
func (x *Index) liveAt(n, h uint32) bool {
	lo, hi := x.findHolder(n, h)
	return lo < hi
}

// holdsLive reports whether the entry at slab position p (before hi) is holder h's.
func (x *Index) holdsLive(p, hi int, h uint32) bool {
	return p < hi && entryHolder(x.hold(p).e) == h
}

// finishMatch orders the engines recorded.
func (x *Index) finishMatch(m *matches) {
	if m.bitSet {
		for _, h := range m.hs {
			m.bit[h] = 0
		}
		m.bitSet = false
	}
	// Deepest first, ties by engine ID: sort integer keys, since the engines' order by ID is
	// maintained by the writers.
	m.order = m.order[:0]
	for i := len(m.slots) - 1; i >= 0; i-- {
		e := m.slots[i]
		m.order = append(m.order, uint64(math.MaxUint32-m.best[i])<<32|uint64(x.engines[e].order))
	}
	slices.Sort(m.order)
	for _, k := range m.order {
		e := x.byID[uint32(k)]
		m.Engines = append(m.Engines, EngineMatch{Engine: x.engines[e].id, Blocks: int(math.MaxUint32 - uint32(k>>32))})
		m.DPRanks = append(m.DPRanks, int(m.brank[m.pos[e]-1]))
	}
	for _, e := range m.slots {
		m.pos[e] = 0
	}
}

// record folds holder h's contiguous depth into its engine's result (maximum over DP ranks,
// remembering the lowest rank at that depth).
func (x *Index) record(m *matches, h uint32, depth int) {
	if depth == 0 {
		return
	}
	e, r := x.holders[h].engine, int32(x.holders[h].rank)
	if p := m.pos[e]; p != 0 {
		switch d := uint32(depth); {
		case d > m.best[p-1]:
			m.best[p-1], m.brank[p-1] = d, r
		case d == m.best[p-1] && r < m.brank[p-1]:
			m.brank[p-1] = r
		}
		return
	}
	m.best = append(m.best, uint32(depth))
	m.brank = append(m.brank, r)
	m.slots = append(m.slots, e)
	m.pos[e] = int32(len(m.slots))
}

// matchLinearInto is the walk Match used before the probing search: one table probe per block,
// checking each node's parent, merging the still-matching holders with each block's entries and
// records (each holder follows the records it met, and looks for one starting at every block).
// It answers exactly what matchInto answers (tests use it as an oracle, and BenchmarkScale as
// the baseline), and marks nothing for CLOCK.
func (x *Index) matchLinearInto(keys []uint64, m *matches) {
	if len(keys) > maxQueryBlocks {
		keys = keys[:maxQueryBlocks]
	}
	if !x.beginMatch(len(keys), m) {
		return
	}
	defer x.mu.RUnlock()
	now := x.nowFor()
	active, next := m.hs[:0], m.hs2[:0]
	fol, fol2 := m.lfol[:0], m.lfol2[:0]
	prev, prevIn := uint32(0), true
	matched := 0
	for d, k := range keys {
		n, _, ok := x.byKey.get(k)
		in := ok && prevIn && x.node(n).parent == prev
		next, fol2 = next[:0], fol2[:0]
		if d == 0 {
			if in {
				next = x.liveHolders(n, next)
				if x.hiddenHolders > 0 {
					next = slices.DeleteFunc(next, func(h uint32) bool { return x.holders[h].hidden })
				}
				for range next {
					fol2 = append(fol2, 0)
				}
			}
			for id, _ := x.starts.get(k); id != 0 && x.approxCount > 0; id = x.places[id].next {
				if p := &x.places[id]; p.expiry > now {
					if i := slices.Index(next, p.holder); i >= 0 {
						fol2[i] = id
					} else {
						next, fol2 = append(next, p.holder), append(fol2, id)
					}
				}
			}
		} else {
			for i, h := range active {
				r := fol[i]
				if r != 0 {
					p := &x.places[r]
					if j := d - int(p.depth); !p.live || j < 0 || j >= len(p.keys) || p.keys[j] != k || p.expiry <= now {
						r = 0
					}
				}
				if r == 0 {
					for id, _ := x.starts.get(k); id != 0 && x.approxCount > 0; id = x.places[id].next {
						if p := &x.places[id]; p.holder == h && p.expiry > now {
							r = id
							break
						}
					}
				}
				if r != 0 || (in && x.liveAt(n, h)) {
					next, fol2 = append(next, h), append(fol2, r)
				} else {
					x.record(m, h, d)
				}
			}
		}
		active, next = next, active
		fol, fol2 = fol2, fol
		if len(active) == 0 {
			break
		}
		matched = d + 1
		prev, prevIn = n, in
	}
	for _, h := range active {
		x.record(m, h, matched)
	}
	m.hs, m.hs2 = active[:0], next[:0]
	m.lfol, m.lfol2 = fol[:0], fol2[:0]
	x.finishMatch(m)
}
