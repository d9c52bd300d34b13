package kvindex

// bindTable maps one holder's engine block hashes to nodes: open addressing with linear probing
// and backward-shift deletion over one array of 8-byte slots, tag<<32 | node, where the tag is
// bindTag of the hash and node 0 (the root sentinel, never bound) marks an empty slot. The hash
// itself is not stored: it is the aux of the holder's real entry at that node, which Index.binding
// reads to confirm a tag match (a 2^-32 chance per probed slot that another hash's tag matches).
//
// One array of 8-byte slots costs one cache miss per probe and per insert, where separate key
// and value arrays (12 bytes a slot) cost two: every stored block looks its hash up and binds
// it, so these probes are a large part of ingest. Sizes are powers of two and the home slot
// is the tag's top bits, so resizing never reads a node. The zero bindTable is empty; it is the
// writers' alone (readers never read it).
type bindTable struct {
	slots []uint64
	bits  uint // log2(len(slots)); 0 when empty
	n     int
	// floor is the least log2 size the table takes once it holds anything, and never shrinks
	// below: Options.ExpectedHolderBlocks sized (0: bindTableMinBits).
	floor uint
}

const bindTableMinBits = 3

// bindTag is the tag of engine hash h: the top 32 bits of h × fib.
func bindTag(h uint64) uint32 { return uint32((h * fib) >> 32) }

func (t *bindTable) home(tag uint32) int { return int(tag >> (32 - t.bits)) }

// len returns the number of bindings.
func (t *bindTable) len() int { return t.n }

// reserve grows the table, if needed, so that k more bindings fit without a resize: insertAt
// positions found before the inserts stay valid.
func (t *bindTable) reserve(k int) {
	b := max(t.bits, bindTableMinBits, t.floor)
	for 4*(t.n+k) > 3<<b {
		b++
	}
	if b != t.bits {
		t.resize(b)
	}
}

// insertAt binds a hash with tag tag to node n, probing from slot from: the position find
// returned for the hash (no resize and no deletion since), or -1 to probe from its home slot.
// The hash must not be bound.
func (t *bindTable) insertAt(tag, n uint32, from int) {
	if from < 0 {
		t.reserve(1)
		from = t.home(tag)
	}
	mask := len(t.slots) - 1
	i := from
	for t.slots[i] != 0 {
		i = (i + 1) & mask
	}
	t.slots[i] = uint64(tag)<<32 | uint64(n)
	t.n++
}

// remove deletes the binding of a hash with tag tag to node n and reports whether it was there.
func (t *bindTable) remove(tag, n uint32) bool {
	if t.n == 0 {
		return false
	}
	want := uint64(tag)<<32 | uint64(n)
	mask := len(t.slots) - 1
	for i := t.home(tag); ; i = (i + 1) & mask {
		switch t.slots[i] {
		case want:
			t.deleteAt(i)
			t.n--
			if t.bits > max(bindTableMinBits+4, t.floor) && 16*t.n < len(t.slots) {
				t.resize(t.bits - 1)
			}
			return true
		case 0:
			return false
		}
	}
}

// deleteAt empties slot i and shifts later members of the probe run back (no tombstones).
func (t *bindTable) deleteAt(i int) {
	mask := len(t.slots) - 1
	j := i
	for {
		j = (j + 1) & mask
		s := t.slots[j]
		if s == 0 {
			break
		}
		home := t.home(uint32(s >> 32))
		if fillsHole(i, j, home) {
			t.slots[i] = s
			i = j
		}
	}
	t.slots[i] = 0
}

func (t *bindTable) resize(bits uint) {
	old := t.slots
	t.slots = makeTable[uint64](1 << bits)
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

// reset empties the table and releases its array; its floor stays, so the next binding
// allocates the table at its expected size again.
func (t *bindTable) reset() { *t = bindTable{floor: t.floor} }

// binding returns the node holder hid binds engine hash to. It also returns the slot where the
// probe ended (the insertion position for insertAt when the hash is not bound), or -1 when the
// table is empty.
func (x *Index) binding(hid uint32, hash uint64) (uint32, bool, int) {
	t := &x.holders[hid].bindings
	if len(t.slots) == 0 {
		return 0, false, -1
	}
	tag := bindTag(hash)
	mask := len(t.slots) - 1
	for i := t.home(tag); ; i = (i + 1) & mask {
		s := t.slots[i]
		if s == 0 {
			return 0, false, i
		}
		if uint32(s>>32) == tag && x.realEntry(uint32(s), hid, hash) >= 0 {
			return uint32(s), true, i
		}
	}
}

// realEntry returns the slab position of holder hid's real entry for engine hash at node n, or
// -1.
func (x *Index) realEntry(n, hid uint32, hash uint64) int {
	lo, hi := x.findHolder(n, hid)
	for p := lo; p < hi; p++ {
		if x.hold(p).aux == hash {
			return p
		}
	}
	return -1
}

// eachBinding calls fn with every (engine hash, node) binding of holder hid, reading each hash
// from the holder's entry at the node. fn may delete holdings but not bindings.
func (x *Index) eachBinding(hid uint32, fn func(hash uint64, n uint32)) {
	for _, s := range x.holders[hid].bindings.slots {
		if s == 0 {
			continue
		}
		n, tag := uint32(s), uint32(s>>32)
		lo, hi := x.findHolder(n, hid)
		for p := lo; p < hi; p++ {
			if h := x.hold(p); bindTag(h.aux) == tag {
				fn(h.aux, n)
				break
			}
		}
	}
}

// touch reads the home slot of every hash, so that the probes that follow find them in the
// cache: the loads are independent, so their cache misses overlap, where a probe loop's
// branches on each loaded slot serialise them. It returns a value that depends on the loads.
func (t *bindTable) touch(hashes []uint64) uint32 {
	if len(t.slots) == 0 {
		return 0
	}
	var sink uint64
	for _, h := range hashes {
		sink += t.slots[t.home(bindTag(h))]
	}
	return uint32(sink)
}

// touchNodeSlots is bindTable.touch for the key → node table.
func touchNodeSlots(t *nodeTable, keys []uint64) uint32 {
	if len(t.slots) == 0 {
		return 0
	}
	var sink uint32
	for _, k := range keys {
		sink += t.slots[t.home(k)].node
	}
	return sink
}
