package kvindex

import (
	"fmt"
	"time"

	"github.com/enginepick/enginepick/state"
)

// approxChain schedules the expiry of the approximate entries one Assume recorded: nodes[i] is
// the block at depth depth+i of the prompt, held by holder until expiry. One heap entry per call
// rather than per block: a route-time placement records about a hundred blocks per pick, and
// keeping a heap entry for each cost more than creating the blocks (docs/performance.md,
// "policy"). An entry of the chain goes stale when its holding is refreshed, superseded, cleared
// or evicted (the holding no longer has this expiry); stale entries are skipped when the chain
// is drained and dropped when the heap is compacted. The chain owns its nodes slice.
type approxChain struct {
	expiry int64 // Unix nanoseconds
	holder uint32
	depth  uint32 // depth of nodes[0] in its prompt
	nodes  []uint32
}

// before orders the heap: earliest expiry first, then deepest last block first so that pruning
// never leaves a hole in an assumed prefix (on equal expiry the deepest blocks are evicted first,
// as in ai-dynamo/dynamo `lib/kv-router/src/approx.rs`; docs/design.md §11), then last node and
// holder for determinism. drainApprox keeps the same order block by block across the chains it
// drains together.
func (a *approxChain) before(b *approxChain) bool {
	da, db := a.depth+uint32(len(a.nodes))-1, b.depth+uint32(len(b.nodes))-1
	switch {
	case a.expiry != b.expiry:
		return a.expiry < b.expiry
	case da != db:
		return da > db
	case a.nodes[len(a.nodes)-1] != b.nodes[len(b.nodes)-1]:
		return a.nodes[len(a.nodes)-1] < b.nodes[len(b.nodes)-1]
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
	x.byKey.reserve(len(keys)) // resolveChain's slots stay valid for the inserts (nodewrite.go)
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
	chain := x.chainNodes(len(keys))
	prev := parent
	for i, n := range x.nodeBuf {
		if n == 0 {
			n = x.newNodeAt(keys[i], prev, int(x.keySlots[i]))
		}
		x.sumSlot = int(x.keySlots[i])
		lo, hi := x.findHolder(n, hid)
		switch {
		case lo == hi:
			x.insertHolding(n, hi, hid, uint8(TierDevice)|approxBit, uint64(expiry))
			h.approx++
			x.approxCount++
			x.node(n).meta |= flagApprox
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
		}
		x.touch(n)
		chain = append(chain, n)
		prev = n
	}
	x.sumSlot = -1
	// Blocks the holder holds really are in the chain too; their entries are not approximate,
	// so draining skips them.
	x.pushApprox(approxChain{expiry: expiry, holder: hid, depth: uint32(held), nodes: chain})
	if x.approxCount > x.maxApprox {
		x.pruneApprox(int(float64(x.maxApprox) * ApproxPruneFraction))
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
	x.draining = x.draining[:0]
	for len(x.heap) > 0 && x.heap[0].expiry <= now {
		x.draining = append(x.draining, x.popApprox())
	}
	return x.drainApprox(-1)
}

// pruneApprox drops approximate entries, earliest expiry first and deepest block first within
// an expiry, until at most target remain.
func (x *Index) pruneApprox(target int) {
	for x.approxCount > target && len(x.heap) > 0 {
		x.draining = x.draining[:0]
		e := x.heap[0].expiry
		for len(x.heap) > 0 && x.heap[0].expiry == e {
			x.draining = append(x.draining, x.popApprox())
		}
		x.drainApprox(x.approxCount - target)
	}
}

// drainApprox drops the live entries of the chains in x.draining (popped from the heap), at most
// limit of them (limit < 0: all), earliest expiry first, deepest block first within an expiry, then
// lowest node and holder: the order of approxChain.before applied block by block, so that
// dropping never leaves a holder an approximate block below one it no longer holds. What is left
// of each chain (a prefix, since each loses its deepest blocks first) goes back on the heap. It
// returns the number of entries dropped.
func (x *Index) drainApprox(limit int) int {
	cs := x.draining
	dropped := 0
	if len(cs) == 1 { // the common case: one Assume's chain, deepest block first
		c := &cs[0]
		x.warmSink += x.touchChain(c.nodes)
		k := len(c.nodes)
		for ; k > 0 && dropped != limit; k-- {
			if p, ok := x.approxAt(c.nodes[k-1], c.holder, c.expiry); ok {
				x.dropApprox(c.nodes[k-1], p)
				dropped++
			}
		}
		x.finishChain(c, k)
		return dropped
	}
	left := x.drainLeft[:0]
	for i := range cs {
		left = append(left, len(cs[i].nodes))
	}
	for dropped != limit {
		best := -1
		for i := range cs {
			if left[i] == 0 {
				continue
			}
			if best < 0 || x.drainsBefore(&cs[i], left[i], &cs[best], left[best]) {
				best = i
			}
		}
		if best < 0 {
			break
		}
		c := &cs[best]
		left[best]--
		n := c.nodes[left[best]]
		if p, ok := x.approxAt(n, c.holder, c.expiry); ok {
			x.dropApprox(n, p)
			dropped++
		}
	}
	for i := range cs {
		x.finishChain(&cs[i], left[i])
	}
	x.drainLeft = left
	return dropped
}

// touchChain reads the node and the key-table home slot of every block of a chain about to be
// drained, so that dropping them (reading the holding run, removing the key with its backward
// shift) finds them in the cache: the loads are independent, so their cache misses overlap.
func (x *Index) touchChain(ns []uint32) uint32 {
	if len(x.byKey.slots) == 0 {
		return 0
	}
	var sink uint32
	for _, n := range ns {
		if int(n) < x.nodes.len() {
			nd := x.node(n)
			sink += x.byKey.slots[x.byKey.home(nd.key)].node + nd.hold
		}
	}
	return sink
}

// drainsBefore reports whether the next block of chain a (its block k-1) drops before the next
// block of chain b (its block l-1).
func (x *Index) drainsBefore(a *approxChain, k int, b *approxChain, l int) bool {
	da, db := a.depth+uint32(k-1), b.depth+uint32(l-1)
	switch {
	case a.expiry != b.expiry:
		return a.expiry < b.expiry
	case da != db:
		return da > db
	case a.nodes[k-1] != b.nodes[l-1]:
		return a.nodes[k-1] < b.nodes[l-1]
	}
	return a.holder < b.holder
}

// finishChain puts back the first k blocks of drained chain c, or recycles its nodes slice when
// k is 0.
func (x *Index) finishChain(c *approxChain, k int) {
	if k > 0 {
		c.nodes = c.nodes[:k]
		x.pushApprox(*c)
		return
	}
	x.recycleChain(c.nodes)
}

// chainNodes returns an empty slice for a chain of n blocks, reusing a drained chain's.
func (x *Index) chainNodes(n int) []uint32 {
	for i := len(x.chainPool) - 1; i >= 0 && i >= len(x.chainPool)-4; i-- {
		if s := x.chainPool[i]; cap(s) >= n {
			x.chainPool[i] = x.chainPool[len(x.chainPool)-1]
			x.chainPool = x.chainPool[:len(x.chainPool)-1]
			return s[:0]
		}
	}
	return make([]uint32, 0, n)
}

// recycleChain keeps a drained chain's nodes slice for reuse, up to chainPoolMax of them.
func (x *Index) recycleChain(s []uint32) {
	if len(x.chainPool) < chainPoolMax && cap(s) > 0 {
		x.chainPool = append(x.chainPool, s[:0])
	}
}

const chainPoolMax = 64

// approxAt returns the slab position of holder hid's live approximate entry at node n with the
// given expiry, if any: a chain's entry that has not gone stale.
func (x *Index) approxAt(n, hid uint32, expiry int64) (int, bool) {
	if int(n) >= x.nodes.len() || !x.node(n).has(flagLive) {
		return 0, false
	}
	lo, hi := x.findHolder(n, hid)
	if lo < hi && x.hold(lo).e&approxEntryBit != 0 && int64(x.hold(lo).aux) == expiry {
		return lo, true
	}
	return 0, false
}

// dropApprox removes the approximate entry at slab position p of node n.
func (x *Index) dropApprox(n uint32, p int) {
	h := &x.holders[entryHolder(x.hold(p).e)]
	h.approx--
	x.approxCount--
	x.deleteHolding(n, p) // summarizes n, unless prune frees it next
	x.recomputeApproxFlag(n)
	x.prune(n)
}

func (x *Index) pushApprox(c approxChain) {
	x.heapBlocks += len(c.nodes)
	x.heap = append(x.heap, c)
	i := len(x.heap) - 1
	for i > 0 {
		p := (i - 1) / 2
		if !x.heap[i].before(&x.heap[p]) {
			break
		}
		x.heap[i], x.heap[p] = x.heap[p], x.heap[i]
		i = p
	}
}

func (x *Index) popApprox() approxChain {
	top := x.heap[0]
	last := len(x.heap) - 1
	x.heap[0] = x.heap[last]
	x.heap[last] = approxChain{}
	x.heap = x.heap[:last]
	x.siftDown(0)
	x.heapBlocks -= len(top.nodes)
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
		if r := l + 1; r < n && x.heap[r].before(&x.heap[l]) {
			m = r
		}
		if !x.heap[m].before(&x.heap[i]) {
			return
		}
		x.heap[i], x.heap[m] = x.heap[m], x.heap[i]
		i = m
	}
}

// compactHeap drops stale entries once the chains' blocks outnumber live entries twice, so
// refreshes and supersessions cannot grow the heap without bound: each chain keeps the runs of
// its blocks whose entries are live, each run becoming a chain of its own.
func (x *Index) compactHeap() {
	if x.heapBlocks <= 2*x.approxCount+64 {
		return
	}
	old := x.heap
	x.heap, x.heapBlocks = x.heapSpare[:0], 0
	for i := range old {
		c := &old[i]
		var first []uint32 // the first live run reuses c.nodes
		for j := 0; j < len(c.nodes); {
			if _, ok := x.approxAt(c.nodes[j], c.holder, c.expiry); !ok {
				j++
				continue
			}
			k := j + 1
			for k < len(c.nodes) {
				if _, ok := x.approxAt(c.nodes[k], c.holder, c.expiry); !ok {
					break
				}
				k++
			}
			run := approxChain{expiry: c.expiry, holder: c.holder, depth: c.depth + uint32(j)}
			if first == nil {
				first = c.nodes[:k-j]
				copy(first, c.nodes[j:k])
				run.nodes = first
			} else {
				run.nodes = append(x.chainNodes(k-j), c.nodes[j:k]...)
			}
			x.heap = append(x.heap, run)
			x.heapBlocks += k - j
			j = k
		}
		if first == nil {
			x.recycleChain(c.nodes)
		}
	}
	clear(old)
	x.heapSpare = old[:0]
	for i := len(x.heap)/2 - 1; i >= 0; i-- {
		x.siftDown(i)
	}
}
