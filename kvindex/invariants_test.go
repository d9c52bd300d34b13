package kvindex

import (
	"fmt"
	"slices"
)

// checkInvariants verifies every internal structure of x against a full recount and returns the
// first violation. Tests call it after each step of a random walk.
func checkInvariants(x *Index) error {
	x.mu.RLock()
	defer x.mu.RUnlock()

	live := 0
	children := make(map[uint32]uint32)
	for n := uint32(1); int(n) < x.nodes.len(); n++ {
		nd := x.node(n)
		if !nd.has(flagLive) {
			continue
		}
		live++
		got, sum, ok := x.byKey.get(nd.key)
		if !ok || got != n {
			return fmt.Errorf("node %d key %#x maps to %d, %v", n, nd.key, got, ok)
		}
		want := uint32(0)
		for p := int(nd.hold); p < int(nd.hold)+nd.nHold(); p++ {
			want |= holderBit(entryHolder(x.hold(p).e))
		}
		if sum != want {
			return fmt.Errorf("node %d holder summary %#x, entries say %#x", n, sum, want)
		}
		if nd.parent != 0 {
			if !x.node(nd.parent).has(flagLive) {
				return fmt.Errorf("node %d has dead parent %d", n, nd.parent)
			}
			children[nd.parent]++
		}
		if k := nd.nHold(); k > 1<<nd.class() {
			return fmt.Errorf("node %d holds %d entries in a class-%d run", n, k, nd.class())
		}
		lo, hi := int(nd.hold), int(nd.hold)+nd.nHold()
		if !slices.IsSortedFunc(x.holds.span(lo, hi-lo), func(a, b holding) int { return int(entryHolder(a.e)) - int(entryHolder(b.e)) }) {
			return fmt.Errorf("node %d holders not sorted: %v", n, x.holds.span(lo, hi-lo))
		}
		for p := lo; p < hi; p++ {
			hid := entryHolder(x.hold(p).e)
			h := &x.holders[hid]
			if !h.live {
				return fmt.Errorf("node %d entry %d names dead holder %d", n, p, hid)
			}
			// Real entries only: approximate ones are records beside the tree (approx.go).
			if t := uint8(x.hold(p).e); t == 0 || Tier(t)&^allTiers != 0 {
				return fmt.Errorf("node %d entry %d has tiers %#x", n, p, t)
			}
			if m, ok, _ := x.binding(hid, x.hold(p).aux); !ok || m != n {
				return fmt.Errorf("node %d entry hash %#x: binding %d, %v", n, x.hold(p).aux, m, ok)
			}
		}
	}
	if live != x.live {
		return fmt.Errorf("live count %d, recount %d", x.live, live)
	}
	if x.byKey.len() != live {
		return fmt.Errorf("key table has %d entries for %d nodes", x.byKey.len(), live)
	}
	// A table sized by Options.ExpectedBlocks or ExpectedHolderBlocks never shrinks below it.
	if x.byKey.bits < x.byKey.floor || len(x.byKey.slots) > 0 && len(x.byKey.slots) != 1<<x.byKey.bits {
		return fmt.Errorf("key table of 2^%d slots (%d), floor 2^%d", x.byKey.bits, len(x.byKey.slots), x.byKey.floor)
	}
	if err := checkQueue(x); err != nil {
		return err
	}
	if err := checkSlabs(x); err != nil {
		return err
	}
	for n := uint32(1); int(n) < x.nodes.len(); n++ {
		nd := x.node(n)
		if !nd.has(flagLive) {
			continue
		}
		if nd.children != children[n] {
			return fmt.Errorf("node %d children %d, recount %d", n, nd.children, children[n])
		}
		if nd.nHold() == 0 && nd.children == 0 {
			return fmt.Errorf("node %d is empty and childless", n)
		}
		if nd.children == 0 && !x.inLRU(n) {
			return fmt.Errorf("leaf %d is not an eviction candidate", n)
		}
	}
	if live > x.maxBlocks {
		return fmt.Errorf("%d blocks over the cap %d", live, x.maxBlocks)
	}
	if err := checkHoles(x); err != nil {
		return err
	}

	approx := 0
	for hid := range x.holders {
		h := &x.holders[hid]
		if !h.live {
			continue
		}
		var tiers [4]int
		var bad error
		bound := 0
		x.eachBinding(uint32(hid), func(hash uint64, n uint32) {
			bound++
			if bad != nil {
				return
			}
			lo, hi := x.findHolder(n, uint32(hid))
			for p := lo; p < hi; p++ {
				if x.hold(p).aux == hash {
					for i := range tiers {
						if x.hold(p).e&(1<<i) != 0 {
							tiers[i]++
						}
					}
					return
				}
			}
			bad = fmt.Errorf("holder %d binding %#x → node %d has no entry", hid, hash, n)
		})
		if bad != nil {
			return bad
		}
		if b := &h.bindings; b.floor != x.holderBits || len(b.slots) > 0 && (b.bits < b.floor || len(b.slots) != 1<<b.bits) {
			return fmt.Errorf("holder %d binding table of 2^%d slots (%d), floor 2^%d, index's 2^%d", hid, b.bits, len(b.slots), b.floor, x.holderBits)
		}
		if bound != h.bindings.len() {
			return fmt.Errorf("holder %d has %d bindings, %d of them name an entry", hid, h.bindings.len(), bound)
		}
		if tiers != h.tiers {
			return fmt.Errorf("holder %d tier counts %v, recount %v", hid, h.tiers, tiers)
		}
		approx += h.approx
	}
	if err := checkPlacements(x, approx); err != nil {
		return err
	}
	for e, slot := range x.engines {
		if !slot.live {
			continue
		}
		if got, ok := x.engineByID[slot.id]; !ok || got != uint32(e) {
			return fmt.Errorf("engine slot %d (%q) not in the ID map", e, slot.id)
		}
	}
	return nil
}

// checkSlabs verifies that nothing in the node and holding slabs leaks or is owned twice: every
// node index after the root is either live or on the free list, once; every holding slot lies in
// exactly one run, the run of a live node that holds something or a free run of its class; and
// the reference bits cover every node.
func checkSlabs(x *Index) error {
	free := make(map[uint32]bool, len(x.freeNodes))
	for _, n := range x.freeNodes {
		switch {
		case n == 0 || int(n) >= x.nodes.len():
			return fmt.Errorf("free node %d out of [1, %d)", n, x.nodes.len())
		case free[n]:
			return fmt.Errorf("node %d is on the free list twice", n)
		case x.node(n).has(flagLive):
			return fmt.Errorf("node %d is live and on the free list", n)
		}
		free[n] = true
	}
	for n := uint32(1); int(n) < x.nodes.len(); n++ {
		if !x.node(n).has(flagLive) && !free[n] {
			return fmt.Errorf("node %d is neither live nor free (leaked)", n)
		}
	}
	if len(x.refBits) <= (x.nodes.len()-1)>>6 {
		return fmt.Errorf("%d reference-bit words for %d nodes", len(x.refBits), x.nodes.len())
	}
	owner := make([]uint32, x.holds.len()) // slot → 1 + node, or maxNodes+1 when free
	claim := func(off, size int, who uint32) error {
		if off < 0 || off+size > len(owner) {
			return fmt.Errorf("run [%d, %d) of %d outside the holding slab (%d)", off, off+size, who, len(owner))
		}
		for p := off; p < off+size; p++ {
			if owner[p] != 0 {
				return fmt.Errorf("holding slot %d in two runs (%d and %d; %d is free)", p, owner[p], who, uint32(maxNodes+1))
			}
			owner[p] = who
		}
		return nil
	}
	for n := uint32(1); int(n) < x.nodes.len(); n++ {
		if nd := x.node(n); nd.has(flagLive) && nd.nHold() > 0 {
			if err := claim(int(nd.hold), 1<<nd.class(), 1+n); err != nil {
				return err
			}
		}
	}
	for c := range x.hFree {
		for _, off := range x.hFree[c] {
			if err := claim(int(off), 1<<c, maxNodes+1); err != nil {
				return err
			}
		}
	}
	for p, o := range owner {
		if o == 0 {
			return fmt.Errorf("holding slot %d is in no run (leaked)", p)
		}
	}
	return nil
}

// checkQueue verifies the LRU list: well linked from head to tail, exactly the nodes inLRU
// reports, all live.
func checkQueue(x *Index) error {
	inLRU := map[uint32]bool{}
	prev := uint32(0)
	for n := x.lruHead; n != 0; n = x.node(n).next {
		if inLRU[n] {
			return fmt.Errorf("LRU cycle at %d", n)
		}
		inLRU[n] = true
		if x.node(n).prev != prev || !x.node(n).has(flagLive) {
			return fmt.Errorf("LRU link broken at %d", n)
		}
		prev = n
	}
	if prev != x.lruTail {
		return fmt.Errorf("LRU tail %d, walk ends at %d", x.lruTail, prev)
	}
	for n := uint32(1); int(n) < x.nodes.len(); n++ {
		if x.inLRU(n) != inLRU[n] {
			return fmt.Errorf("node %d: inLRU disagrees with the list", n)
		}
		if nd := x.node(n); !inLRU[n] && (nd.prev != 0 || nd.next != 0) {
			return fmt.Errorf("node %d is not in the LRU list but has links %d, %d", n, nd.prev, nd.next)
		}
	}
	return nil
}

// checkHoles verifies the prefix rule Match relies on (index.go, "holes"): the holey set is
// exactly the nodes with flagHoley, each with children; every (holder, block) pair whose
// holder's prefix may break at the parent (cases (1)–(3)) has a holey parent; and a holder's
// child count (holding.kids) at a block that is not holey equals its held children there.
func checkHoles(x *Index) error {
	flagged := 0
	kids := map[[2]uint32]uint32{} // (parent, holder) → held children
	for n := uint32(1); int(n) < x.nodes.len(); n++ {
		nd := x.node(n)
		if !nd.has(flagLive) {
			continue
		}
		if nd.holey() {
			flagged++
			if got, ok := x.holey.get(nd.key); !ok || got != n {
				return fmt.Errorf("holey node %d not in the holey set (%d, %v)", n, got, ok)
			}
			if nd.children == 0 {
				return fmt.Errorf("holey node %d has no children", n)
			}
		}
		p := nd.parent
		if p == 0 {
			continue
		}
		for _, hid := range holdersAt(x, n) {
			kids[[2]uint32{p, hid}]++
			if x.node(p).holey() {
				continue
			}
			if plo, phi := x.findHolder(p, hid); plo == phi {
				return fmt.Errorf("holder %d holds node %d but not its parent %d, which is not holey", hid, n, p)
			}
		}
	}
	if flagged != x.holey.len() {
		return fmt.Errorf("%d holey nodes, holey set has %d", flagged, x.holey.len())
	}
	for n := uint32(1); int(n) < x.nodes.len(); n++ {
		nd := x.node(n)
		if !nd.has(flagLive) || nd.holey() {
			continue
		}
		for _, hid := range holdersAt(x, n) {
			lo, _ := x.findHolder(n, hid)
			if want := kids[[2]uint32{n, hid}]; x.hold(lo).kids != want {
				return fmt.Errorf("node %d holder %d child count %d, recount %d", n, hid, x.hold(lo).kids, want)
			}
		}
	}
	return nil
}

// holdersAt returns the distinct holders with an entry at n.
func holdersAt(x *Index, n uint32) []uint32 {
	nd := x.node(n)
	var out []uint32
	for p := int(nd.hold); p < int(nd.hold)+nd.nHold(); p++ {
		if h := entryHolder(x.hold(p).e); len(out) == 0 || out[len(out)-1] != h {
			out = append(out, h)
		}
	}
	return out
}

// checkPlacements verifies the approximate entries' records (approx.go) against a recount: the
// counts, the first-key lists, the heap, and the invariants Match relies on: a holder's records
// are disjoint and hold no block the holder holds through a real entry.
func checkPlacements(x *Index, holdersApprox int) error {
	total, live := 0, 0
	perHolder := map[uint32]int{}
	held := map[[2]uint64]uint32{} // (holder, key) → record
	for id := 1; id < len(x.places); id++ {
		p := &x.places[id]
		if !p.live {
			if len(p.keys) != 0 || p.next != 0 || p.prev != 0 {
				return fmt.Errorf("dropped record %d keeps keys or links", id)
			}
			continue
		}
		live++
		if len(p.keys) == 0 {
			return fmt.Errorf("record %d is empty", id)
		}
		if int(p.holder) >= len(x.holders) || !x.holders[p.holder].live {
			return fmt.Errorf("record %d names dead holder %d", id, p.holder)
		}
		total += len(p.keys)
		perHolder[p.holder] += len(p.keys)
		for _, k := range p.keys {
			hk := [2]uint64{uint64(p.holder), k}
			if other, dup := held[hk]; dup {
				return fmt.Errorf("holder %d's records %d and %d share key %#x", p.holder, other, id, k)
			}
			held[hk] = uint32(id)
			if n, _, ok := x.byKey.get(k); ok {
				if lo, hi := x.findHolder(n, p.holder); lo < hi {
					return fmt.Errorf("record %d of holder %d holds key %#x, which the holder holds really", id, p.holder, k)
				}
			}
		}
		if !x.mayStart(p.keys[0]) {
			return fmt.Errorf("record %d's first key %#x is not in the start filter", id, p.keys[0])
		}
		// Listed under its first key.
		head, ok := x.starts.get(p.keys[0])
		if !ok {
			return fmt.Errorf("record %d's first key %#x is not in the start table", id, p.keys[0])
		}
		found := false
		for q, prev := head, uint32(0); q != 0; prev, q = q, x.places[q].next {
			if x.places[q].prev != prev {
				return fmt.Errorf("start list of %#x: record %d's prev %d, want %d", p.keys[0], q, x.places[q].prev, prev)
			}
			if !x.places[q].live || x.places[q].keys[0] != p.keys[0] {
				return fmt.Errorf("start list of %#x lists record %d, which does not start there", p.keys[0], q)
			}
			found = found || q == uint32(id)
		}
		if !found {
			return fmt.Errorf("record %d is not in its first key's list", id)
		}
		refs := 0
		for _, r := range x.pheap {
			if r.id == uint32(id) && r.gen == p.gen {
				refs++
				if r.expiry != p.expiry {
					return fmt.Errorf("record %d expires at %d, its heap entry says %d", id, p.expiry, r.expiry)
				}
			}
		}
		if refs != 1 {
			return fmt.Errorf("record %d has %d heap entries", id, refs)
		}
	}
	starts := map[uint64]bool{}
	for id := 1; id < len(x.places); id++ {
		if p := &x.places[id]; p.live {
			starts[p.keys[0]] = true
		}
	}
	if x.starts.len() != len(starts) {
		return fmt.Errorf("start table has %d keys, the records start at %d", x.starts.len(), len(starts))
	}
	if live != x.placeLive {
		return fmt.Errorf("%d live records, placeLive says %d", live, x.placeLive)
	}
	if total != x.approxCount || holdersApprox != total {
		return fmt.Errorf("approximate count %d, holders say %d, records hold %d", x.approxCount, holdersApprox, total)
	}
	for hid := range x.holders {
		if x.holders[hid].approx != perHolder[uint32(hid)] {
			return fmt.Errorf("holder %d approximate count %d, its records hold %d", hid, x.holders[hid].approx, perHolder[uint32(hid)])
		}
	}
	for i := 1; i < len(x.pheap); i++ {
		if x.pheap[i].expiry < x.pheap[(i-1)/2].expiry {
			return fmt.Errorf("heap order broken at %d", i)
		}
	}
	return nil
}
