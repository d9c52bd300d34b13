package kvindex

import (
	"fmt"
	"math/bits"
	"sort"
	"time"

	"github.com/enginepick/enginepick/state"
)

// Approximate entries (docs/design.md §11) are kept beside the tree, as placements: one record
// per placement (per run of blocks the holder does not hold through a real event) holding the
// blocks' chained keys, the depth of the first one in its prompt, the holder and one expiry.
// Recording one costs a copy of its keys and a few table operations, whatever its length; expiry
// drops a whole record at once; the tree keeps real entries only, so a route-time placement
// creates no tree node (docs/design-notes.md, "Placements as records").
//
// The records keep three invariants, which checkInvariants verifies:
//
//   - disjoint: a holder's records share no key (a newer placement takes the keys it covers
//     from the older records, so each (holder, key) has the expiry of the latest placement);
//   - approximate only: no record holds a key its holder holds through a real entry (a real
//     Store takes the stored keys from the records, and assume records only the other keys);
//   - therefore, along a prompt, a holder's record that covers the block at depth d > 0 and
//     does not start there covers the block at d − 1 as well: a match that finds the holder's
//     real entries ending at depth d needs only the records that start at the key of depth d.
//
// Records are found by their first key (Index.starts, a list per key, behind a bitmap filter,
// Index.startBits, that answers most probes, which miss). Because keys are
// chained, a record whose first key is the query's key at depth d agrees with the query from d
// for as long as their keys are equal, and no further.
type placement struct {
	keys   []uint64 // the blocks' keys; keys[0] is at depth depth of its prompt. Owned.
	expiry int64    // Unix nanoseconds
	holder uint32
	depth  uint32
	next   uint32 // the next and previous records with the same first key; 0: none
	prev   uint32
	gen    uint32 // bumped when the record is dropped, so that its heap entry goes stale
	live   bool
}

// placeRef is a heap entry: record id while its generation is gen.
type placeRef struct {
	expiry int64
	id     uint32
	gen    uint32
}

// assume records the router's own placement (LocalSource.Place; docs/design.md §11, after
// Dynamo's approximate mode): engine's DP rank rank is taken to hold keys, a prompt's chained keys
// from the index's Hasher (starting at the prompt's first block), until ttl from now. ttl 0 means
// Options.ApproxTTL; negative returns an error wrapping state.ErrInvalidConfiguration. Empty keys
// is a no-op (but an empty engine is still refused).
//
// Placing a block again sets its expiry to the new one. A block the holder already holds through
// a real event is left real. A later real Store of the block by (engine, rank) turns the entry
// into a real one that never expires. Before adding, assume drops entries already expired; after
// adding, when the index holds more than Options.MaxApproxBlocks approximate entries it prunes to
// 0.8 of the cap, earliest expiry first and, within an expiry, deepest block first. Approximate
// entries are not tree blocks: they do not count against MaxBlocks and are never evicted by it
// (Stats.Blocks does not count them).
//
// The hint held: when held > 0 and (engine, rank) holds the block of keys[held-1] through a real
// entry, the blocks before it are real too and are neither refreshed nor looked up: only
// keys[held:] are recorded, at depth held. LocalSource.Place passes the depth its lookup found the
// engine to hold. own reports that keys were computed by the index's Hasher from one prompt
// (LocalSource.Place): a chain of 64-bit keys repeats a key only by a hash collision, which the
// index accepts everywhere (docs/design.md §11, "Hashing"), so the repeated-key check is skipped.
//
// Cost: O(len(keys)) for a copy of keys and one probe per key of the start filter (a bitmap over
// the records' first keys), plus one key-table lookup of keys[0] and, when the engine holds
// blocks through real events, about log2(len(keys)) more to find where they end (one per key when
// a holey block lies along keys). It does not walk the tree.
//
// Errors (an *EventError with Op "assume"; the index is unchanged): ErrInvalidEngine (engine is
// empty), ErrInvalidRank, ErrCyclicChain (a key repeats), ErrKeyConflict (keys[0] is a block of
// the index that is not a prompt's first block: keys is not one prompt's chain from this Hasher),
// ErrTooManyHolders (the engine would be holder number 2^24).
func (x *Index) assume(engine state.EngineID, rank int, keys []uint64, held int, ttl time.Duration, own bool) error {
	if ttl < 0 {
		return fmt.Errorf("kvindex: Assume: ttl %v, must be >= 0: %w", ttl, state.ErrInvalidConfiguration)
	}
	if ttl == 0 {
		ttl = x.ttl
	}
	fail := func(err error, hs ...uint64) error {
		return &EventError{Op: "assume", Engine: engine, DPRank: rank, Hashes: hs, Err: err}
	}
	if engine == "" {
		return fail(ErrInvalidEngine)
	}
	if rank < 0 {
		return fail(ErrInvalidRank)
	}
	x.wmu.Lock()
	defer x.wmu.Unlock()
	x.mu.Lock()
	defer x.mu.Unlock()
	if len(keys) == 0 {
		return nil
	}
	parent := uint32(0) // the node keys[0] hangs under
	if held > 0 && held <= len(keys) {
		if pn, ok := x.realHeldBy(engine, rank, keys[held-1]); ok {
			parent, keys = pn, keys[held:]
		} else {
			held = 0
		}
	} else {
		held = 0
	}
	if len(keys) == 0 {
		return nil
	}
	if !own {
		if dup, ok := x.firstDuplicate(keys); ok {
			return fail(ErrCyclicChain, dup)
		}
	}
	n0, _, inTree := x.byKey.get(keys[0])
	if inTree && x.node(n0).parent != parent {
		return fail(ErrKeyConflict, keys[0])
	}
	if _, ok := x.lookupHolder(engine, rank); !ok && !x.canAddHolder() {
		return fail(ErrTooManyHolders, keys[0])
	}
	now := x.now().UnixNano()
	x.expireUntil(now)
	expiry := now + int64(ttl)
	if expiry < now { // overflow: never expires in practice
		expiry = 1<<63 - 1
	}
	hid := x.holderFor(engine, rank)
	// Record every run of keys the holder does not hold really.
	switch {
	case !inTree || x.holders[hid].tiers == [4]int{}:
		x.place(hid, uint32(held), keys, expiry) // it holds not even keys[0] really
	case !x.mayHoldReal(hid, keys):
		// Its real blocks along keys form a prefix (index.go, "holes"): find where it ends by
		// bisection, a few lookups rather than one per block it holds (a placement of a
		// conversation's next turn while the last one is still approximate).
		r := sort.Search(len(keys), func(i int) bool { return !x.realAt(hid, keys[i]) })
		if r < len(keys) {
			x.place(hid, uint32(held+r), keys[r:], expiry)
		}
	default:
		for i := 0; i < len(keys); {
			if x.realAt(hid, keys[i]) {
				i++
				continue
			}
			j := i + 1
			for j < len(keys) && !x.realAt(hid, keys[j]) {
				j++
			}
			x.place(hid, uint32(held+i), keys[i:j], expiry)
			i = j
		}
	}
	if x.approxCount > x.maxApprox {
		x.pruneApprox(int(float64(x.maxApprox) * approxPruneFraction))
	}
	x.compactPlaceHeap()
	return nil
}

// realAt reports whether holder hid holds the block of key through a real entry (the tree has
// no other kind).
func (x *Index) realAt(hid uint32, key uint64) bool {
	h := &x.holders[hid]
	if h.tiers == [4]int{} {
		return false
	}
	n, _, ok := x.byKey.get(key)
	if !ok {
		return false
	}
	lo, hi := x.findHolder(n, hid)
	return lo < hi
}

// mayHoldReal reports whether holder hid's real entries along keys, a chain under a block it
// holds really (or the root), may fail to form a prefix of it. A holder's real entries along a
// prompt form a prefix except below a holey block (index.go, "holes"), so they may only when one
// of keys[:len-1] is holey.
func (x *Index) mayHoldReal(hid uint32, keys []uint64) bool {
	if x.holders[hid].tiers == [4]int{} || x.holey.len() == 0 {
		return false
	}
	for _, k := range keys[:len(keys)-1] {
		if _, ok := x.holey.get(k); ok {
			return true
		}
	}
	return false
}

// place records that holder hid holds keys, the first at depth depth, until expiry: it first
// takes the keys from the holder's older records (disjoint), then adds one record.
func (x *Index) place(hid, depth uint32, keys []uint64, expiry int64) {
	if x.holders[hid].approx > 0 {
		x.takeFromRecords(hid, keys)
	}
	id := x.newPlacement()
	p := &x.places[id]
	p.keys = append(x.placeKeys(len(keys)), keys...)
	p.expiry, p.holder, p.depth, p.live = expiry, hid, depth, true
	x.linkStart(id)
	x.pushPlace(placeRef{expiry: expiry, id: id, gen: p.gen})
	x.holders[hid].approx += len(keys)
	x.approxCount += len(keys)
}

// takeFromRecords removes keys, a run of one prompt's chained keys, from holder hid's records:
// by the invariants, a record of hid holding one of them starts at the first one it holds, and
// holds the run's keys from there for as long as they are equal.
func (x *Index) takeFromRecords(hid uint32, keys []uint64) {
	for i := 0; i < len(keys); i++ {
		id := x.recordAt(hid, keys[i])
		if id == 0 {
			continue
		}
		p := &x.places[id]
		a := commonPrefix(p.keys, keys[i:])
		x.trimHead(id, a)
		i += a - 1
	}
}

// recordAt returns the live or expired record of holder hid whose first key is key, or 0.
func (x *Index) recordAt(hid uint32, key uint64) uint32 {
	if x.approxCount == 0 || !x.mayStart(key) {
		return 0
	}
	id, _ := x.starts.get(key)
	for id != 0 {
		p := &x.places[id]
		if p.holder == hid {
			return id
		}
		id = p.next
	}
	return 0
}

// commonPrefix returns how many leading elements a and b share.
func commonPrefix(a, b []uint64) int {
	n := min(len(a), len(b))
	for i := range n {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

// newPlacement returns a free record id.
func (x *Index) newPlacement() uint32 {
	if k := len(x.freePlaces); k > 0 {
		id := x.freePlaces[k-1]
		x.freePlaces = x.freePlaces[:k-1]
		return id
	}
	if len(x.places) == 0 {
		x.places = append(x.places, placement{}) // id 0 means none
	}
	x.places = append(x.places, placement{})
	return uint32(len(x.places) - 1)
}

// linkStart adds record id to the list of its first key.
func (x *Index) linkStart(id uint32) {
	p := &x.places[id]
	head, _ := x.starts.get(p.keys[0])
	p.prev, p.next = 0, head
	if head != 0 {
		x.places[head].prev = id
	}
	x.starts.put(p.keys[0], id)
	// Kept at most an eighth full: most probes are misses (takeFromRecords probes every placed
	// key), and a miss in a linear-probing table reads the whole run after its slot, about 8
	// slots at three-quarters full and 1.1 at an eighth.
	if n := x.starts.len(); 8*n > len(x.starts.keys) {
		x.starts.resize(max(16*n, startsMinSlots))
	}
	if len(x.startBits) < x.placeLive {
		x.rebuildStartBits()
	} else {
		b := x.startBit(p.keys[0])
		x.startBits[b>>6] |= 1 << (b & 63)
	}
}

// The start filter (Index.startBits) has a bit per key hash, set for the first key of every
// record and left set when the record goes until the next rebuild: a clear bit says that no record
// starts at a key, which is the answer to nearly every probe of takeFromRecords and Match, read
// from a bitmap of 64 bits per record (8 KiB for 1,000 records) rather than from the start table
// (about 100 bytes per record at an eighth full). It is rebuilt, from the live records, when they
// outgrow it and when the records dropped since the last rebuild outnumber the live ones (so at
// most about 1 in 32 of its bits is stale).

// startBit returns key's bit in the start filter.
func (x *Index) startBit(key uint64) uint64 { return (key * fib) >> (64 - x.startBitsLog) }

// mayStart reports whether a record may start at key: false means none does.
func (x *Index) mayStart(key uint64) bool {
	if len(x.startBits) == 0 {
		return false
	}
	b := x.startBit(key)
	return x.startBits[b>>6]&(1<<(b&63)) != 0
}

// rebuildStartBits sizes the start filter for the live records, 64 to 128 bits each (at least
// 64 words), and sets the bit of every live record's first key.
func (x *Index) rebuildStartBits() {
	words := 64
	for words < x.placeLive {
		words *= 2
	}
	if len(x.startBits) == words {
		clear(x.startBits)
	} else {
		x.startBits = make([]uint64, words)
		x.startBitsLog = uint(bits.TrailingZeros(uint(words))) + 6
	}
	for id := 1; id < len(x.places); id++ {
		if p := &x.places[id]; p.live {
			b := x.startBit(p.keys[0])
			x.startBits[b>>6] |= 1 << (b & 63)
		}
	}
	x.startStale = 0
}

const startsMinSlots = 64

// unlinkStart removes record id from the list of its first key. Its start-filter bit stays set
// until a rebuild.
func (x *Index) unlinkStart(id uint32) {
	if x.startStale++; x.startStale > max(x.placeLive, 64) {
		defer x.rebuildStartBits() // after the unlink: the record may be leaving
	}
	p := &x.places[id]
	if p.next != 0 {
		x.places[p.next].prev = p.prev
	}
	switch {
	case p.prev != 0:
		x.places[p.prev].next = p.next
	case p.next != 0:
		x.starts.put(p.keys[0], p.next)
	default:
		x.starts.del(p.keys[0])
	}
	p.next, p.prev = 0, 0
}

// trimHead drops the first k blocks of record id (all of it when k ≥ its length).
func (x *Index) trimHead(id uint32, k int) {
	p := &x.places[id]
	if k >= len(p.keys) {
		x.dropPlacement(id)
		return
	}
	if k <= 0 {
		return
	}
	x.unlinkStart(id)
	x.holders[p.holder].approx -= k
	x.approxCount -= k
	p.keys = p.keys[k:]
	p.depth += uint32(k)
	x.linkStart(id)
}

// trimTail drops the last k blocks of record id (all of it when k ≥ its length).
func (x *Index) trimTail(id uint32, k int) {
	p := &x.places[id]
	if k >= len(p.keys) {
		x.dropPlacement(id)
		return
	}
	x.holders[p.holder].approx -= k
	x.approxCount -= k
	p.keys = p.keys[:len(p.keys)-k]
}

// dropPlacement removes record id; its heap entry goes stale.
func (x *Index) dropPlacement(id uint32) {
	x.unlinkStart(id)
	p := &x.places[id]
	x.holders[p.holder].approx -= len(p.keys)
	x.approxCount -= len(p.keys)
	x.recycleKeys(p.keys)
	gen := p.gen + 1
	*p = placement{gen: gen}
	x.freePlaces = append(x.freePlaces, id)
	x.placeLive--
}

// placeKeys returns an empty slice for n keys, reusing a dropped record's.
func (x *Index) placeKeys(n int) []uint64 {
	x.placeLive++
	for i := len(x.keyPool) - 1; i >= 0 && i >= len(x.keyPool)-4; i-- {
		if s := x.keyPool[i]; cap(s) >= n {
			x.keyPool[i] = x.keyPool[len(x.keyPool)-1]
			x.keyPool = x.keyPool[:len(x.keyPool)-1]
			return s[:0]
		}
	}
	return make([]uint64, 0, n)
}

// recycleKeys keeps a dropped record's keys slice for reuse, up to keyPoolMax of them.
func (x *Index) recycleKeys(s []uint64) {
	if len(x.keyPool) < keyPoolMax && cap(s) > 0 {
		x.keyPool = append(x.keyPool, s[:0])
	}
}

const keyPoolMax = 64

// clearPlacements drops every record of holder hid. Cost: O(records in the index).
func (x *Index) clearPlacements(hid uint32) {
	if x.holders[hid].approx == 0 {
		return
	}
	for id := 1; id < len(x.places); id++ {
		if p := &x.places[id]; p.live && p.holder == hid {
			x.dropPlacement(uint32(id))
		}
	}
}

// realHeldBy returns the node of key when (engine, rank) holds it through a real (event) entry.
// Callers hold x.mu.
func (x *Index) realHeldBy(engine state.EngineID, rank int, key uint64) (uint32, bool) {
	hid, ok := x.lookupHolder(engine, rank)
	if !ok {
		return 0, false
	}
	n, _, ok := x.byKey.get(key)
	if !ok || n == 0 {
		return 0, false
	}
	if lo, hi := x.findHolder(n, hid); lo < hi {
		return n, true
	}
	return 0, false
}

// supersedeByStore takes the keys a real Store of holder hid just recorded (keys, in prompt
// order) from the holder's records: the entries become real (docs/design.md §11). Called under
// x.mu.
func (x *Index) supersedeByStore(hid uint32, keys []uint64) {
	if x.holders[hid].approx > 0 {
		x.takeFromRecords(hid, keys)
	}
}

// expire drops every approximate entry whose expiry is at or before now and returns how many it
// dropped. Match already ignores such entries, and assume expires due entries before adding, so
// this only reclaims memory sooner (tests). Cost: O(expired records × log records).
func (x *Index) expire(now time.Time) int {
	x.wmu.Lock()
	defer x.wmu.Unlock()
	x.mu.Lock()
	defer x.mu.Unlock()
	n := x.expireUntil(now.UnixNano())
	x.compactPlaceHeap()
	return n
}

// expireUntil drops every record whose expiry is at or before now, whole.
func (x *Index) expireUntil(now int64) int {
	dropped := 0
	for len(x.pheap) > 0 && x.pheap[0].expiry <= now {
		r := x.popPlace()
		if p := &x.places[r.id]; p.live && p.gen == r.gen {
			dropped += len(p.keys)
			x.dropPlacement(r.id)
		}
	}
	return dropped
}

// pruneApprox drops approximate entries, earliest expiry first and deepest block first within
// an expiry (the deepest blocks of all the records sharing that expiry, whatever the holder;
// ties by holder, then record), until at most target remain. Pruning never leaves a hole in an
// assumed prefix: within one expiry, a block goes only after every deeper block of its record.
func (x *Index) pruneApprox(target int) {
	for x.approxCount > target && len(x.pheap) > 0 {
		e := x.pheap[0].expiry
		ids := x.pdrain[:0]
		for len(x.pheap) > 0 && x.pheap[0].expiry == e {
			r := x.popPlace()
			if p := &x.places[r.id]; p.live && p.gen == r.gen {
				ids = append(ids, r.id)
			}
		}
		for x.approxCount > target {
			best := -1
			for i, id := range ids {
				if id == 0 {
					continue
				}
				if best < 0 || x.prunesBefore(id, ids[best]) {
					best = i
				}
			}
			if best < 0 {
				break
			}
			id := ids[best]
			p := &x.places[id]
			if len(ids) == 1 {
				x.trimTail(id, x.approxCount-target) // one record: deepest first is its tail
			} else {
				x.trimTail(id, 1)
			}
			if !p.live {
				ids[best] = 0
			}
		}
		for _, id := range ids {
			if id != 0 {
				x.pushPlace(placeRef{expiry: e, id: id, gen: x.places[id].gen})
			}
		}
		x.pdrain = ids[:0]
	}
}

// prunesBefore reports whether record a's last block goes before record b's (same expiry):
// deeper first, then lower holder, then lower record id.
func (x *Index) prunesBefore(a, b uint32) bool {
	pa, pb := &x.places[a], &x.places[b]
	da, db := pa.depth+uint32(len(pa.keys)), pb.depth+uint32(len(pb.keys))
	switch {
	case da != db:
		return da > db
	case pa.holder != pb.holder:
		return pa.holder < pb.holder
	}
	return a < b
}

func (x *Index) pushPlace(r placeRef) {
	x.pheap = append(x.pheap, r)
	i := len(x.pheap) - 1
	for i > 0 {
		p := (i - 1) / 2
		if x.pheap[i].expiry >= x.pheap[p].expiry {
			break
		}
		x.pheap[i], x.pheap[p] = x.pheap[p], x.pheap[i]
		i = p
	}
}

func (x *Index) popPlace() placeRef {
	top := x.pheap[0]
	last := len(x.pheap) - 1
	x.pheap[0] = x.pheap[last]
	x.pheap = x.pheap[:last]
	x.siftDownPlace(0)
	return top
}

func (x *Index) siftDownPlace(i int) {
	n := len(x.pheap)
	for {
		l := 2*i + 1
		if l >= n {
			return
		}
		m := l
		if r := l + 1; r < n && x.pheap[r].expiry < x.pheap[l].expiry {
			m = r
		}
		if x.pheap[m].expiry >= x.pheap[i].expiry {
			return
		}
		x.pheap[i], x.pheap[m] = x.pheap[m], x.pheap[i]
		i = m
	}
}

// compactPlaceHeap drops the heap entries of dropped records once they outnumber the live
// records, so that supersessions and clears cannot grow the heap without bound.
func (x *Index) compactPlaceHeap() {
	if len(x.pheap) <= 2*x.placeLive+64 {
		return
	}
	h := x.pheap[:0]
	for _, r := range x.pheap {
		if p := &x.places[r.id]; p.live && p.gen == r.gen {
			h = append(h, r)
		}
	}
	x.pheap = h
	for i := len(h)/2 - 1; i >= 0; i-- {
		x.siftDownPlace(i)
	}
}

// placedDepth extends holder hid's match from depth d, where its real entries along keys end,
// through its live records and any real entries after them, and returns the depth reached.
func (x *Index) placedDepth(hid uint32, keys []uint64, d int, now int64) int {
	for d < len(keys) {
		id := x.recordAt(hid, keys[d])
		if id == 0 {
			return d
		}
		p := &x.places[id]
		if p.expiry <= now {
			return d
		}
		d += commonPrefix(p.keys, keys[d:])
		// Real entries resume after the record only below a holey block (index.go, "holes").
		if d < len(keys) && x.holey.len() > 0 {
			if _, ok := x.holey.get(keys[d-1]); ok {
				for d < len(keys) && x.realAt(hid, keys[d]) {
					d++
				}
			}
		}
	}
	return d
}

// matchPlacements folds the holders' records into m after the tree search: a holder found in
// the tree (m.hs, its real depth in m.hdepth) continues through a record that starts where its
// real entries end; a holder without a real entry at the first block matches through a record
// that starts there.
func (x *Index) matchPlacements(keys []uint64, now int64, m *matches, inTree bool) {
	if x.approxCount == 0 {
		return
	}
	if inTree {
		lastD, placed := -1, false // holders often share a depth: probe it once
		for i, h := range m.hs {
			d := int(m.hdepth[i])
			if d >= len(keys) {
				continue
			}
			if d != lastD {
				lastD, placed = d, x.placedAt(keys[d])
			}
			if !placed {
				continue
			}
			if e := x.placedDepth(h, keys, d, now); e > d {
				x.record(m, h, e)
			}
		}
	}
	id, _ := x.starts.get(keys[0])
	for id != 0 {
		p := &x.places[id]
		next := p.next
		if p.expiry > now && !(inTree && int(p.holder) < len(m.bit) && m.bit[p.holder] != 0) {
			x.record(m, p.holder, x.placedDepth(p.holder, keys, 0, now))
		}
		id = next
	}
}

// placedAt reports whether a record starts at key.
func (x *Index) placedAt(key uint64) bool {
	if x.approxCount == 0 || !x.mayStart(key) {
		return false
	}
	_, ok := x.starts.get(key)
	return ok
}
