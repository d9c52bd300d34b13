package kvindex

import "math/bits"

// table is an open-addressing hash map from uint64 to a non-zero uint32, with linear probing and
// backward-shift deletion (no tombstones). Keys and values sit in two pointer-free arrays, so a
// table of a million entries costs the garbage collector nothing to scan and about 12 bytes per
// slot. The key 0 marks an empty slot; a real key 0 is kept in zeroVal. The zero table is empty
// and ready to use. Not safe for concurrent mutation; concurrent get calls are safe.
//
// It keeps the holey set (Index.holey), keyed by well-mixed block keys: a multiply-shift slot
// choice and a one-array probe are several times cheaper than a general map on the Match path
// (see bench_test.go). The index's two hottest maps have their own one-array layouts:
// nodeTable (block key → node) and bindTable (engine hash → node).
type table struct {
	keys    []uint64
	vals    []uint32 // vals[i] == 0 iff keys[i] is empty
	n       int      // entries in keys/vals, not counting zeroVal
	zeroVal uint32   // value of key 0, or 0 when absent
}

const (
	tableMinSlots    = 8
	tableShrinkSlots = 1024
	fib              = 0x9E3779B97F4A7C15 // 2^64 / golden ratio, odd
)

// slot maps k to its home slot: the high half of (k × fib) × len, which spreads keys over any
// table length. Tables double when three-quarters full (so they stay between three-eighths and
// three-quarters full), which rehashes each entry half as often as growing by 1.5× would.
func (t *table) slot(k uint64) int {
	hi, _ := bits.Mul64(k*fib, uint64(len(t.keys)))
	return int(hi)
}

func (t *table) next(i int) int {
	if i++; i == len(t.keys) {
		return 0
	}
	return i
}

// len returns the number of entries.
func (t *table) len() int {
	if t.zeroVal != 0 {
		return t.n + 1
	}
	return t.n
}

// get returns the value of k.
func (t *table) get(k uint64) (uint32, bool) {
	if k == 0 {
		return t.zeroVal, t.zeroVal != 0
	}
	if len(t.keys) == 0 {
		return 0, false
	}
	for i := t.slot(k); ; i = t.next(i) {
		switch t.keys[i] {
		case k:
			return t.vals[i], true
		case 0:
			return 0, false
		}
	}
}

// put sets k's value to v, which must not be 0.
func (t *table) put(k uint64, v uint32) {
	if k == 0 {
		t.zeroVal = v
		return
	}
	if 4*(t.n+1) > 3*len(t.keys) {
		t.resize(max(2*len(t.keys), tableMinSlots))
	}
	for i := t.slot(k); ; i = t.next(i) {
		switch t.keys[i] {
		case k:
			t.vals[i] = v
			return
		case 0:
			t.keys[i], t.vals[i] = k, v
			t.n++
			return
		}
	}
}

// add inserts k with value v (not 0) unless k is present; it returns the present value and true
// in that case, leaving it unchanged. One probe sequence serves both the test and the insert.
func (t *table) add(k uint64, v uint32) (uint32, bool) {
	if k == 0 {
		if t.zeroVal != 0 {
			return t.zeroVal, true
		}
		t.zeroVal = v
		return 0, false
	}
	if 4*(t.n+1) > 3*len(t.keys) {
		t.resize(max(2*len(t.keys), tableMinSlots))
	}
	for i := t.slot(k); ; i = t.next(i) {
		switch t.keys[i] {
		case k:
			return t.vals[i], true
		case 0:
			t.keys[i], t.vals[i] = k, v
			t.n++
			return 0, false
		}
	}
}

// del removes k and reports whether it was present. A table larger than tableShrinkSlots halves
// when it falls below one-sixteenth full, so a holder that drops most of its blocks gives the
// memory back, while a small table that fills and empties with every event never reallocates.
func (t *table) del(k uint64) bool {
	if k == 0 {
		had := t.zeroVal != 0
		t.zeroVal = 0
		return had
	}
	if len(t.keys) == 0 {
		return false
	}
	i := t.slot(k)
	for {
		switch t.keys[i] {
		case k:
			t.deleteAt(i)
			t.n--
			if len(t.keys) > tableShrinkSlots && 16*t.n < len(t.keys) {
				t.resize(len(t.keys) / 2)
			}
			return true
		case 0:
			return false
		}
		i = t.next(i)
	}
}

// deleteAt empties slot i and shifts later members of the probe run back, so lookups never need
// tombstones.
func (t *table) deleteAt(i int) {
	j := i
	for {
		j = t.next(j)
		if t.keys[j] == 0 {
			break
		}
		home := t.slot(t.keys[j])
		// Move j into the hole at i unless j's home lies cyclically in (i, j].
		if (j > i && (home <= i || home > j)) || (j < i && home <= i && home > j) {
			t.keys[i], t.vals[i] = t.keys[j], t.vals[j]
			i = j
		}
	}
	t.keys[i], t.vals[i] = 0, 0
}

// resize rehashes into slots slots (at least tableMinSlots).
func (t *table) resize(slots int) {
	oldKeys, oldVals := t.keys, t.vals
	t.keys = make([]uint64, slots)
	t.vals = make([]uint32, slots)
	for j, k := range oldKeys {
		if k == 0 {
			continue
		}
		i := t.slot(k)
		for t.keys[i] != 0 {
			i = t.next(i)
		}
		t.keys[i], t.vals[i] = k, oldVals[j]
	}
}

// clearFor empties t and sizes its arrays for about n entries, reusing them when they are not
// much larger than needed, so a scratch table costs no allocation per use.
func (t *table) clearFor(n int) {
	want := max(tableMinSlots, (4*n+2)/3+1)
	if len(t.keys) < want || len(t.keys) > 8*want {
		t.keys = make([]uint64, want)
		t.vals = make([]uint32, want)
	} else {
		clear(t.keys)
		clear(t.vals)
	}
	t.n, t.zeroVal = 0, 0
}

// each calls fn for every entry, in no particular order. fn must not modify t.
func (t *table) each(fn func(k uint64, v uint32)) {
	if t.zeroVal != 0 {
		fn(0, t.zeroVal)
	}
	for i, k := range t.keys {
		if k != 0 {
			fn(k, t.vals[i])
		}
	}
}

// u64Set is a scratch set of uint64 for duplicate checks within one event: open addressing with
// linear probing, sized once per use by clearFor (at most half full), never resized or deleted
// from, so add is a handful of instructions. The zero u64Set must be cleared before use.
type u64Set struct {
	keys  []uint64 // 0 marks an empty slot; the value 0 is kept in zero
	shift uint
	zero  bool
}

// clearFor empties s and sizes it for n values (n ≥ 0): the least power of two above 2n slots,
// at least 16 (2 to 4 slots per value from n = 4 up). The set is sized for each event, so that it
// stays small enough for the L1 cache even after a longer event grew the array's capacity (a set
// kept at the capacity of the longest event would cost a cache miss per add).
// The array keeps the capacity of the longest event so far (at most max(16, 4n) slots of 8 bytes
// for that event's n) and is reallocated only when an event needs more.
func (s *u64Set) clearFor(n int) {
	want := max(16, 1<<bits.Len(uint(2*n)))
	if cap(s.keys) < want {
		s.keys = make([]uint64, want)
	} else {
		s.keys = s.keys[:want]
		clear(s.keys)
	}
	s.shift = uint(64 - bits.TrailingZeros(uint(want)))
	s.zero = false
}

// add inserts v and reports whether it was absent.
func (s *u64Set) add(v uint64) bool {
	if v == 0 {
		had := s.zero
		s.zero = true
		return !had
	}
	mask := len(s.keys) - 1
	for i := int((v * fib) >> s.shift); ; i = (i + 1) & mask {
		switch s.keys[i] {
		case 0:
			s.keys[i] = v
			return true
		case v:
			return false
		}
	}
}
