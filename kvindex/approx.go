package kvindex

import (
	"fmt"
	"time"

	"github.com/enginepick/enginepick/state"
)

// approxEntry schedules the expiry of one approximate entry. Entries go stale when their holding
// is refreshed, superseded, cleared or evicted; stale entries are skipped when popped and dropped
// when the heap is compacted.
type approxEntry struct {
	expiry int64 // Unix nanoseconds
	node   uint32
	holder uint32
	depth  uint32 // block position in the Assume call
}

// before orders the heap: earliest expiry first, then deepest block first so that pruning never
// leaves a hole in an assumed prefix (on equal expiry the deepest blocks are
// evicted first, as in ai-dynamo/dynamo `lib/kv-router/src/approx.rs`; docs/design.md §11), then node and holder for determinism.
func (a approxEntry) before(b approxEntry) bool {
	switch {
	case a.expiry != b.expiry:
		return a.expiry < b.expiry
	case a.depth != b.depth:
		return a.depth > b.depth
	case a.node != b.node:
		return a.node < b.node
	}
	return a.holder < b.holder
}

// Assume records the router's own placement for an engine that publishes no KV events
// (docs/design.md §11, after Dynamo's approximate mode): engine's DP rank 0 is taken
// to hold keys, a prompt's chained keys from the index's Hasher (starting at the prompt's first
// block), until ttl from now. ttl 0 means Options.ApproxTTL; negative returns an error wrapping
// state.ErrInvalidConfiguration. Empty keys is a no-op (but an empty engine is still refused).
//
// Assuming a block again refreshes its expiry to the new one. A block the holder already holds
// through a real event is left real. A later real Store of the block by (engine, rank 0) turns the
// entry into a real one that never expires. Before adding, Assume drops entries already expired;
// after adding, when the index holds more than Options.MaxApproxBlocks approximate entries it
// prunes to ApproxPruneFraction of the cap, earliest expiry first and, within an expiry, deepest
// block first; then MaxBlocks applies as for Store.
//
// Errors (an *EventError with Op "assume"; the index is unchanged): ErrInvalidEngine (engine is
// empty), ErrCyclicChain (a key repeats), ErrKeyConflict (a key is in the index under a different
// parent: keys is not one prompt's chain from this Hasher), ErrTooManyHolders.
func (x *Index) Assume(engine state.EngineID, keys []uint64, ttl time.Duration) error {
	return x.assume(engine, 0, keys, 0, ttl)
}

// AssumeRank is Assume for the engine's DP rank rank: the placement of a pick that named the rank
// (policy.Pick.DPRank), so that a later match finds the prefix on that rank and a real Store by
// (engine, rank) turns the entries real (docs/design.md §11). A negative rank returns an
// *EventError wrapping ErrInvalidRank.
func (x *Index) AssumeRank(engine state.EngineID, rank int, keys []uint64, ttl time.Duration) error {
	return x.assume(engine, rank, keys, 0, ttl)
}

// assume is AssumeRank with a hint: when held > 0 and (engine, rank) holds the block of
// keys[held-1] through a real entry, the blocks before it are real too (a real holding is
// prefix-closed, index.go) and are neither refreshed nor walked: only keys[held:] are recorded,
// chained under that block. Otherwise it is Assume over every key. LocalSource.Place passes the
// depth its lookup found the engine to hold.
func (x *Index) assume(engine state.EngineID, rank int, keys []uint64, held int, ttl time.Duration) error {
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
	parent := uint32(0)
	if held > 0 && held <= len(keys) {
		if pn, ok := x.realHeldBy(engine, rank, keys[held-1]); ok {
			parent, keys = pn, keys[held:] // a real parent never expires: expireUntil keeps it
		} else {
			held = 0
		}
	} else {
		held = 0
	}
	if len(keys) == 0 {
		return nil
	}
	if dup, ok := x.firstDuplicate(keys); ok {
		return fail(ErrCyclicChain, dup)
	}
	now := x.now().UnixNano()
	x.expireUntil(now)
	if i, ok := x.resolveChain(parent, keys); !ok {
		return fail(ErrKeyConflict, keys[i])
	}
	for i, n := range x.nodeBuf {
		if n != 0 && x.node(n).nHold() >= maxHold {
			return fail(ErrTooManyHolders, keys[i])
		}
	}
	if _, ok := x.lookupHolder(engine, rank); !ok && !x.canAddHolder() {
		return fail(ErrTooManyHolders, keys[0])
	}
	expiry := now + int64(ttl)
	if expiry < now { // overflow: never expires in practice
		expiry = 1<<63 - 1
	}
	hid := x.holderFor(engine, rank)
	h := &x.holders[hid]
	prev := parent
	for i, n := range x.nodeBuf {
		if n == 0 {
			n = x.newNode(keys[i], prev)
		}
		lo, hi := x.findHolder(n, hid)
		switch {
		case lo == hi:
			x.insertHolding(n, hi, hid, uint8(TierDevice)|approxBit, uint64(expiry))
			h.approx++
			x.approxCount++
			x.node(n).meta |= flagApprox
			x.pushApprox(approxEntry{expiry: expiry, node: n, holder: hid, depth: uint32(held + i)})
		case x.hold(lo).e&approxEntryBit != 0:
			if int64(x.hold(lo).aux) > expiry && !x.node(n).holey() {
				// A shorter TTL: a child of n the holder holds, other than the chain's next
				// block (refreshed to the same expiry next), may now outlive n (hole case (3),
				// index.go).
				others := x.hold(lo).kids
				if i+1 < len(keys) && x.nodeBuf[i+1] != 0 {
					if a, b := x.findHolder(x.nodeBuf[i+1], hid); a < b {
						others--
					}
				}
				if others > 0 {
					x.markHoley(n)
				}
			}
			x.hold(lo).aux = uint64(expiry)
			x.pushApprox(approxEntry{expiry: expiry, node: n, holder: hid, depth: uint32(held + i)})
		}
		x.touch(n)
		prev = n
	}
	if x.approxCount > x.maxApprox {
		target := int(float64(x.maxApprox) * ApproxPruneFraction)
		for x.approxCount > target && len(x.heap) > 0 {
			e := x.popApprox()
			if p, ok := x.approxAt(e); ok {
				x.dropApprox(e.node, p)
			}
		}
	}
	x.compactHeap()
	x.evict()
	return nil
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
	lo, hi := x.findHolder(n, hid)
	for p := lo; p < hi; p++ {
		if x.hold(p).e&approxEntryBit == 0 {
			return n, true
		}
	}
	return 0, false
}

// Expire drops every approximate entry whose expiry is at or before now and returns how many it
// dropped. Match already ignores such entries, so Expire only reclaims memory; call it
// periodically (for example from the host's maintenance loop) or rely on Assume, which expires
// due entries before adding. Cost: O(expired × log entries).
func (x *Index) Expire(now time.Time) int {
	x.wmu.Lock()
	defer x.wmu.Unlock()
	x.mu.Lock()
	defer x.mu.Unlock()
	n := x.expireUntil(now.UnixNano())
	x.compactHeap()
	return n
}

func (x *Index) expireUntil(now int64) int {
	dropped := 0
	for len(x.heap) > 0 && x.heap[0].expiry <= now {
		e := x.popApprox()
		if p, ok := x.approxAt(e); ok {
			x.dropApprox(e.node, p)
			dropped++
		}
	}
	return dropped
}

// approxAt returns the slab position of the live approximate entry e describes, if any.
func (x *Index) approxAt(e approxEntry) (int, bool) {
	if int(e.node) >= x.nodes.len() || !x.node(e.node).has(flagLive) {
		return 0, false
	}
	lo, hi := x.findHolder(e.node, e.holder)
	if lo < hi && x.hold(lo).e&approxEntryBit != 0 && int64(x.hold(lo).aux) == e.expiry {
		return lo, true
	}
	return 0, false
}

// dropApprox removes the approximate entry at slab position p of node n.
func (x *Index) dropApprox(n uint32, p int) {
	h := &x.holders[entryHolder(x.hold(p).e)]
	h.approx--
	x.approxCount--
	x.deleteHolding(n, p)
	x.refreshApproxFlag(n)
	x.prune(n)
}

func (x *Index) pushApprox(e approxEntry) {
	x.heap = append(x.heap, e)
	i := len(x.heap) - 1
	for i > 0 {
		p := (i - 1) / 2
		if !x.heap[i].before(x.heap[p]) {
			break
		}
		x.heap[i], x.heap[p] = x.heap[p], x.heap[i]
		i = p
	}
}

func (x *Index) popApprox() approxEntry {
	top := x.heap[0]
	last := len(x.heap) - 1
	x.heap[0] = x.heap[last]
	x.heap = x.heap[:last]
	x.siftDown(0)
	return top
}

func (x *Index) siftDown(i int) {
	n := len(x.heap)
	for {
		l := 2*i + 1
		if l >= n {
			return
		}
		m := l
		if r := l + 1; r < n && x.heap[r].before(x.heap[l]) {
			m = r
		}
		if !x.heap[m].before(x.heap[i]) {
			return
		}
		x.heap[i], x.heap[m] = x.heap[m], x.heap[i]
		i = m
	}
}

// compactHeap drops stale entries once they outnumber live ones, so refreshes and supersessions
// cannot grow the heap without bound.
func (x *Index) compactHeap() {
	if len(x.heap) <= 2*x.approxCount+64 {
		return
	}
	live := x.heap[:0]
	for _, e := range x.heap {
		if _, ok := x.approxAt(e); ok {
			live = append(live, e)
		}
	}
	clear(x.heap[len(live):])
	x.heap = live
	for i := len(x.heap)/2 - 1; i >= 0; i-- {
		x.siftDown(i)
	}
}
