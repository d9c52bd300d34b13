package kvindex

// nodeTable maps a block key to its node and to a summary of the node's holders: open addressing
// with linear probing and backward-shift deletion over one array of 16-byte slots {key, node,
// summary}, where node 0 (the root sentinel, never stored) marks an empty slot.
//
// The slot carries the whole key, so a probe is verified without reading the node, and the
// summary (see holderBit) says which holders have an entry at the node, so that Match's search
// learns a probed block's holders from the slot alone: one cache miss (and one TLB miss) per
// probe instead of three (slot, node, holding run). The writers keep the summary exact:
// insertHolding adds the new entry's bit, deleteHolding recomputes it from the run
// (Index.summarize); checkInvariants verifies it.
//
// Sizes are powers of two and the home slot is the top bits of key × fib, so resizing and
// backward shifts never read a node. A slot costs 8 B more than a tag-and-node layout that must
// read the node to verify a key.
//
// The zero nodeTable is empty and ready to use; it is not safe for concurrent mutation, and
// concurrent get calls are safe.
type nodeTable struct {
	slots []nodeSlot
	bits  uint // log2(len(slots)); 0 when empty
	n     int
	// floor is the least log2 size the table shrinks to: Options.ExpectedBlocks sized
	// (0: no floor beyond the shrink rule's own).
	floor uint
}

type nodeSlot struct {
	key  uint64
	node uint32 // 0: empty
	sum  uint32 // holder summary (holderBit)
}

const nodeTableMinBits = 6

// summaryInexact is the holder-summary bit that sends a reader to the node: the node has an
// entry of a holder without its own bit (ID ≥ 31).
const summaryInexact = 1 << 31

// holderBit is the summary bit of an entry of holder hid: holders 0–30 have their own bit; every
// other holder sets summaryInexact. A summary without summaryInexact lists exactly the holders
// of the node. (The tree holds real entries only; approximate ones are records, approx.go.)
func holderBit(hid uint32) uint32 {
	if hid >= 31 {
		return summaryInexact
	}
	return 1 << hid
}

func (t *nodeTable) home(k uint64) int { return homeIn(k, t.bits) }

// homeIn is key k's home slot in a table of 2^bits slots: the top bits of k × fib.
func homeIn(k uint64, bits uint) int { return int((k * fib) >> (64 - bits)) }

// get returns the node of key k and its holder summary.
func (t *nodeTable) get(k uint64) (node, sum uint32, ok bool) {
	if t.n == 0 {
		return 0, 0, false
	}
	mask := len(t.slots) - 1
	for i := t.home(k); ; i = (i + 1) & mask {
		s := &t.slots[i]
		if s.node == 0 {
			return 0, 0, false
		}
		if s.key == k {
			return s.node, s.sum, true
		}
	}
}

// find returns the slot of key k, or −1.
func (t *nodeTable) find(k uint64) int {
	if t.n == 0 {
		return -1
	}
	mask := len(t.slots) - 1
	for i := t.home(k); ; i = (i + 1) & mask {
		s := &t.slots[i]
		if s.node == 0 {
			return -1
		}
		if s.key == k {
			return i
		}
	}
}

// setSum sets the holder summary of key k, when present.
func (t *nodeTable) setSum(k uint64, sum uint32) {
	if i := t.find(k); i >= 0 {
		t.slots[i].sum = sum
	}
}

// orSum adds bits to the holder summary of key k, when present.
func (t *nodeTable) orSum(k uint64, bits uint32) {
	if i := t.find(k); i >= 0 {
		t.slots[i].sum |= bits
	}
}

// insert adds node n under key k, which must not be in the table, with an empty summary.
func (t *nodeTable) insert(k uint64, n uint32) {
	if 4*(t.n+1) > 3*len(t.slots) {
		t.resize(max(t.bits+1, nodeTableMinBits))
	}
	mask := len(t.slots) - 1
	i := t.home(k)
	for t.slots[i].node != 0 {
		i = (i + 1) & mask
	}
	t.slots[i] = nodeSlot{key: k, node: n}
	t.n++
}

// remove deletes key k, whose node is n, and reports whether it was present.
func (t *nodeTable) remove(k uint64, n uint32) bool {
	i := t.find(k)
	if i < 0 || t.slots[i].node != n {
		return false
	}
	t.deleteAt(i)
	t.n--
	if t.bits > max(nodeTableMinBits+4, t.floor) && 16*t.n < len(t.slots) {
		t.resize(t.bits - 1)
	}
	return true
}

// fillsHole reports whether the member at slot j, whose home slot is home, moves into the hole at
// slot i when a linear-probing table deletes without tombstones: it does unless home lies
// cyclically in (i, j]. Both key tables (nodeTable, bindTable) delete this way.
func fillsHole(i, j, home int) bool {
	return (j > i && (home <= i || home > j)) || (j < i && home <= i && home > j)
}

// deleteAt empties slot i and shifts later members of the probe run back (no tombstones).
func (t *nodeTable) deleteAt(i int) {
	mask := len(t.slots) - 1
	j := i
	for {
		j = (j + 1) & mask
		s := t.slots[j]
		if s.node == 0 {
			break
		}
		home := t.home(s.key)
		if fillsHole(i, j, home) {
			t.slots[i] = s
			i = j
		}
	}
	t.slots[i] = nodeSlot{}
}

func (t *nodeTable) resize(bits uint) {
	t.slots, t.bits = t.rehash(bits), bits
}

// rehash returns a new slot array of 2^bits slots holding t's entries; t is only read.
func (t *nodeTable) rehash(bits uint) []nodeSlot {
	slots := makeTable[nodeSlot](1 << bits)
	mask := len(slots) - 1
	for _, s := range t.slots {
		if s.node == 0 {
			continue
		}
		i := homeIn(s.key, bits)
		for slots[i].node != 0 {
			i = (i + 1) & mask
		}
		slots[i] = s
	}
	return slots
}

// len returns the number of entries.
func (t *nodeTable) len() int { return t.n }
