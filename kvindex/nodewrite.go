package kvindex

// The key → node table's write-path helpers for Store (the layout is nodetable.go's). A Store
// probes every key of its event while validating it (resolveChain); these let the apply step
// reuse where each probe ended instead of probing again: inserting a new block's key from the
// empty slot its lookup stopped at, and adding a holder's summary bit at the slot its lookup
// found: one probe less per stored block.

// reserve grows the table, if needed, so that k more keys fit without a resize: slot positions
// found before the inserts stay valid until a key is removed. Store grows its table with grown
// instead, beside readers.
func (t *nodeTable) reserve(k int) {
	if g, ok := t.grown(k); ok {
		*t = g
	}
}

// grown returns a copy of the table at the least size at which k more keys fit under the load
// limit (3/4), and whether it had to grow; t is only read, so that Store can rehash a large
// table beside readers (they only read it too) and exclude them just to install the copy, rather
// than for the whole rehash, which for a table of millions of slots takes hundreds of
// milliseconds, most of it the first touch of the new array's memory.
// The copy's slot positions are its own.
func (t *nodeTable) grown(k int) (nodeTable, bool) {
	b := max(t.bits, nodeTableMinBits)
	for 4*(t.n+k) > 3<<b {
		b++
	}
	if b == t.bits {
		return nodeTable{}, false
	}
	return nodeTable{slots: t.rehash(b), bits: b, n: t.n, floor: t.floor}, true
}

// lookupSlot returns the node of key k and the slot holding it, or 0 and the empty slot where
// k's probe ended; the slot is -1 when the table is empty.
func (t *nodeTable) lookupSlot(k uint64) (uint32, int) {
	if len(t.slots) == 0 {
		return 0, -1
	}
	mask := len(t.slots) - 1
	for i := t.home(k); ; i = (i + 1) & mask {
		s := &t.slots[i]
		if s.node == 0 {
			return 0, i
		}
		if s.key == k {
			return s.node, i
		}
	}
}

// insertFrom adds node n under key k, which must not be in the table, probing from slot from:
// where lookupSlot's probe for k ended, with no resize and no removal since (reserve), or -1
// to probe from k's home slot. It returns the slot used.
func (t *nodeTable) insertFrom(k uint64, n uint32, from int) int {
	if from < 0 {
		t.insert(k, n)
		return -1
	}
	mask := len(t.slots) - 1
	i := from
	for t.slots[i].node != 0 {
		i = (i + 1) & mask
	}
	t.slots[i] = nodeSlot{key: k, node: n}
	t.n++
	return i
}

// orSumAt adds bits to the holder summary of key k, looking at slot i first (a position an
// earlier probe found, possibly moved since: it is checked) and probing when k is not there.
func (t *nodeTable) orSumAt(i int, k uint64, bits uint32) {
	if i >= 0 && i < len(t.slots) && t.slots[i].node != 0 && t.slots[i].key == k {
		t.slots[i].sum |= bits
		return
	}
	t.orSum(k, bits)
}

// tableBitsFor returns the log2 size of a table that holds n entries at most three-quarters full,
// the load both key tables grow at.
func tableBitsFor(n int) uint {
	b := uint(0)
	for 4*n > 3<<b {
		b++
	}
	return b
}
