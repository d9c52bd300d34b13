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
	for n := uint32(1); int(n) < len(x.nodes); n++ {
		nd := &x.nodes[n]
		if !nd.has(flagLive) {
			continue
		}
		live++
		if got, ok := x.byKey.get(nd.key); !ok || got != n {
			return fmt.Errorf("node %d key %#x maps to %d, %v", n, nd.key, got, ok)
		}
		if nd.parent != 0 {
			if !x.nodes[nd.parent].has(flagLive) {
				return fmt.Errorf("node %d has dead parent %d", n, nd.parent)
			}
			children[nd.parent]++
		}
		if k := nd.nHold(); k > 1<<nd.class() {
			return fmt.Errorf("node %d holds %d entries in a class-%d run", n, k, nd.class())
		}
		lo, hi := int(nd.hold), int(nd.hold)+nd.nHold()
		if !slices.IsSorted(x.hHolder[lo:hi]) {
			return fmt.Errorf("node %d holders not sorted: %v", n, x.hHolder[lo:hi])
		}
		hasApprox := false
		for p := lo; p < hi; p++ {
			h := &x.holders[x.hHolder[p]]
			if !h.live {
				return fmt.Errorf("node %d entry %d names dead holder %d", n, p, x.hHolder[p])
			}
			if x.hTiers[p]&approxBit != 0 {
				hasApprox = true
				if p+1 < hi && x.hHolder[p+1] == x.hHolder[p] || p > lo && x.hHolder[p-1] == x.hHolder[p] {
					return fmt.Errorf("node %d: approximate entry of holder %d is not alone", n, x.hHolder[p])
				}
				continue
			}
			if x.hTiers[p] == 0 || Tier(x.hTiers[p])&^AllTiers != 0 {
				return fmt.Errorf("node %d entry %d has tiers %#x", n, p, x.hTiers[p])
			}
			if m, ok := h.bindings.get(x.hAux[p]); !ok || m != n {
				return fmt.Errorf("node %d entry hash %#x: binding %d, %v", n, x.hAux[p], m, ok)
			}
		}
		if hasApprox != nd.has(flagApprox) {
			return fmt.Errorf("node %d approximate flag %v, entries say %v", n, nd.has(flagApprox), hasApprox)
		}
	}
	if live != x.live {
		return fmt.Errorf("live count %d, recount %d", x.live, live)
	}
	if x.byKey.len() != live {
		return fmt.Errorf("key table has %d entries for %d nodes", x.byKey.len(), live)
	}
	inLRU := make(map[uint32]bool)
	prev := uint32(0)
	for n := x.lruHead; n != 0; n = x.nodes[n].next {
		if inLRU[n] {
			return fmt.Errorf("LRU cycle at %d", n)
		}
		inLRU[n] = true
		if x.nodes[n].prev != prev || !x.nodes[n].has(flagInLRU) {
			return fmt.Errorf("LRU link broken at %d", n)
		}
		prev = n
	}
	if prev != x.lruTail {
		return fmt.Errorf("LRU tail %d, walk ends at %d", x.lruTail, prev)
	}
	for n := uint32(1); int(n) < len(x.nodes); n++ {
		nd := &x.nodes[n]
		if !nd.has(flagLive) {
			continue
		}
		if nd.children != children[n] {
			return fmt.Errorf("node %d children %d, recount %d", n, nd.children, children[n])
		}
		if nd.nHold() == 0 && nd.children == 0 {
			return fmt.Errorf("node %d is empty and childless", n)
		}
		if nd.children == 0 && !inLRU[n] {
			return fmt.Errorf("leaf %d is not an eviction candidate", n)
		}
		if nd.has(flagInLRU) != inLRU[n] {
			return fmt.Errorf("node %d LRU flag disagrees with the list", n)
		}
	}
	if live > x.maxBlocks {
		return fmt.Errorf("%d blocks over the cap %d", live, x.maxBlocks)
	}

	approx := 0
	for hid := range x.holders {
		h := &x.holders[hid]
		if !h.live {
			continue
		}
		var tiers [4]int
		var bad error
		h.bindings.each(func(hash uint64, n uint32) {
			if bad != nil {
				return
			}
			lo, hi := x.findHolder(n, uint32(hid))
			for p := lo; p < hi; p++ {
				if x.hTiers[p]&approxBit == 0 && x.hAux[p] == hash {
					for i := range tiers {
						if x.hTiers[p]&(1<<i) != 0 {
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
		if tiers != h.tiers {
			return fmt.Errorf("holder %d tier counts %v, recount %v", hid, h.tiers, tiers)
		}
		approx += h.approx
	}
	recount := 0
	for n := uint32(1); int(n) < len(x.nodes); n++ {
		nd := &x.nodes[n]
		for p := int(nd.hold); nd.has(flagLive) && p < int(nd.hold)+nd.nHold(); p++ {
			if x.hTiers[p]&approxBit != 0 {
				recount++
				if !heapHas(x, approxEntry{expiry: int64(x.hAux[p]), node: n, holder: x.hHolder[p]}) {
					return fmt.Errorf("approximate entry node %d holder %d has no heap entry", n, x.hHolder[p])
				}
			}
		}
	}
	if approx != x.approxCount || recount != approx {
		return fmt.Errorf("approximate count %d, holders say %d, recount %d", x.approxCount, approx, recount)
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

func heapHas(x *Index, want approxEntry) bool {
	for _, e := range x.heap {
		if e.expiry == want.expiry && e.node == want.node && e.holder == want.holder {
			return true
		}
	}
	return false
}
