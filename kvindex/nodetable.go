package kvindex

// nodeTable maps a block key to its node: open addressing with linear probing and backward-shift
// deletion over one array of 8-byte slots, tag<<32 | node, where the tag is the top 32 bits of
// key × fib and node 0 (the root sentinel, never stored) marks an empty slot. The key itself lives
// only in the node, so a lookup costs one cache miss for the slot and one for the node it names,
// which the caller reads anyway; a tag match whose node has another key (a 2^-32 chance per
// probed slot) just probes on. Sizes are powers of two and the home slot is the tag's top bits,
// so resizing and backward shifts never read a node. A table of 5.66 M nodes takes 64 MiB.
//
// It replaces the generic table (separate key and value arrays, two cache misses per probe) on
// the lookup path every Match and every stored block takes (docs/performance.md, "kvindex at
// production scale"). The zero nodeTable is empty and ready to use; it is not safe for concurrent
// mutation, and concurrent get calls are safe.
type nodeTable struct {
	slots []uint64
	bits  uint // log2(len(slots)); 0 when empty
	n     int
}

const nodeTableMinBits = 6

func fibTag(k uint64) uint32 { return uint32((k * fib) >> 32) }

func (t *nodeTable) home(tag uint32) int { return int(tag >> (32 - t.bits)) }

// get returns the node of key k, reading nodes to confirm tag matches.
func (t *nodeTable) get(k uint64, nodes *slab[node]) (uint32, bool) {
	if t.n == 0 {
		return 0, false
	}
	tag := fibTag(k)
	mask := len(t.slots) - 1
	for i := t.home(tag); ; i = (i + 1) & mask {
		s := t.slots[i]
		if s == 0 {
			return 0, false
		}
		if uint32(s>>32) == tag {
			if n := uint32(s); nodes.at(int(n)).key == k {
				return n, true
			}
		}
	}
}

// insert adds node n under key k, which must not be in the table.
func (t *nodeTable) insert(k uint64, n uint32) {
	if 4*(t.n+1) > 3*len(t.slots) {
		t.resize(max(t.bits+1, nodeTableMinBits))
	}
	tag := fibTag(k)
	mask := len(t.slots) - 1
	i := t.home(tag)
	for t.slots[i] != 0 {
		i = (i + 1) & mask
	}
	t.slots[i] = uint64(tag)<<32 | uint64(n)
	t.n++
}

// remove deletes key k, whose node is n, and reports whether it was present.
func (t *nodeTable) remove(k uint64, n uint32) bool {
	if t.n == 0 {
		return false
	}
	want := uint64(fibTag(k))<<32 | uint64(n)
	mask := len(t.slots) - 1
	for i := t.home(uint32(want >> 32)); ; i = (i + 1) & mask {
		switch t.slots[i] {
		case want:
			t.deleteAt(i)
			t.n--
			if t.bits > nodeTableMinBits+4 && 16*t.n < len(t.slots) {
				t.resize(t.bits - 1)
			}
			return true
		case 0:
			return false
		}
	}
}

// deleteAt empties slot i and shifts later members of the probe run back (no tombstones).
func (t *nodeTable) deleteAt(i int) {
	mask := len(t.slots) - 1
	j := i
	for {
		j = (j + 1) & mask
		s := t.slots[j]
		if s == 0 {
			break
		}
		home := t.home(uint32(s >> 32))
		// Move j into the hole at i unless j's home lies cyclically in (i, j].
		if (j > i && (home <= i || home > j)) || (j < i && home <= i && home > j) {
			t.slots[i] = s
			i = j
		}
	}
	t.slots[i] = 0
}

func (t *nodeTable) resize(bits uint) {
	old := t.slots
	t.slots = make([]uint64, 1<<bits)
	t.bits = bits
	mask := len(t.slots) - 1
	for _, s := range old {
		if s == 0 {
			continue
		}
		i := t.home(uint32(s >> 32))
		for t.slots[i] != 0 {
			i = (i + 1) & mask
		}
		t.slots[i] = s
	}
}

// len returns the number of entries.
func (t *nodeTable) len() int { return t.n }
