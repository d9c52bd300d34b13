package kvindex

import (
	"cmp"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/enginepick/enginepick/state"
)

// Defaults for Options. The approximate-entry values are Dynamo's PruneConfig
// (ai-dynamo/dynamo `lib/kv-router/src/approx.rs`: TTL 120 s, at most 2^20 =
// 1,048,576 blocks, pruned to 0.8 of that; docs/design.md §11).
const (
	// DefaultMaxBlocks is the default block cap: 4,194,304 blocks, about 64 Mi tokens at 16
	// tokens per block, and roughly 350 MiB at one holder per block (86 bytes per block and
	// holder, BenchmarkMemory).
	DefaultMaxBlocks = 1 << 22
	// DefaultApproxTTL is how long an Assume entry lives unless the call names another TTL.
	DefaultApproxTTL = 120 * time.Second
	// DefaultMaxApproxBlocks caps the number of approximate (block, engine) entries.
	DefaultMaxApproxBlocks = 1 << 20
	// ApproxPruneFraction is the fraction of MaxApproxBlocks an over-cap index prunes back to,
	// earliest expiry first and, within one expiry, deepest block first.
	ApproxPruneFraction = 0.8
)

// maxHold is the most holding entries one node can carry (24 bits of node.meta); maxNodes the
// most nodes (uint32 indexes, 0 reserved for the root).
const (
	maxHold  = 1<<24 - 1
	maxNodes = 1<<32 - 2
)

// Options configures an Index. The zero value is the documented default for every field.
type Options struct {
	// MaxBlocks caps the number of blocks (tree nodes) the index keeps. When a write pushes the
	// count above it, the least recently used leaves are evicted, for every holder at once, until
	// it fits; interior blocks are never evicted, so every kept block's prefix stays in the tree.
	// Recency is the last Store or Assume of the block, with a second chance for a block that a
	// Match has walked since (CLOCK). 0 means DefaultMaxBlocks; negative or above 2^32−2 is an
	// error.
	MaxBlocks int
	// MaxApproxBlocks caps the approximate (Assume) entries, counted per (block, engine). Above
	// it, entries are pruned to ApproxPruneFraction of the cap. 0 means DefaultMaxApproxBlocks;
	// negative is an error.
	MaxApproxBlocks int
	// ApproxTTL is the lifetime of an Assume entry when the call passes a TTL of 0. 0 means
	// DefaultApproxTTL; negative is an error.
	ApproxTTL time.Duration
	// Now is the clock for approximate-entry expiry. nil means time.Now. Tests inject a fixed
	// clock; the index never sleeps and starts no goroutine.
	Now func() time.Time
}

// Index is the prefix index: a radix tree over chained block keys recording, per block, which
// engines (and which of their DP ranks) hold it and in which storage tiers. It stores ownership,
// never KV tensors (docs/design.md §11).
//
// Because keys are chained (Hasher), a key names a whole prefix, so the tree is kept as one node
// per key with a parent link: a Match walks the query's keys through a key → node table and checks
// each node's parent, rather than searching child maps. Engines are addressed by their own block
// hashes (opaque IDs, docs/design.md §11), which the index maps to nodes per
// (engine, DP rank) to resolve parents and removals.
//
// Concurrency: every method is safe for concurrent use. Match and MatchInto take a read lock and
// run in parallel with each other; writes (Store, Remove, Clear, RemoveEngine, Assume, Expire)
// take the write lock and are serialised, which gives "one writer per engine" ordering for free as
// long as each engine's events are applied in order by their caller. doc.go records why one
// RWMutex beats sharding here, with figures.
type Index struct {
	mu    sync.RWMutex
	trust trustSet // engines whose entries Sources must not trust (trust.go); not guarded by mu

	hasher    Hasher
	maxBlocks int
	maxApprox int
	ttl       time.Duration
	now       func() time.Time

	nodes     []node   // nodes[0] is the root sentinel; 0 also means "no node"
	refBits   []uint64 // CLOCK reference bit per node; Match sets bits atomically
	byKey     table    // block key → node
	freeNodes []uint32
	live      int // live nodes, root excluded
	lruHead   uint32
	lruTail   uint32
	evicted   uint64

	// Holding entries, in runs of 1<<class slots per node, kept sorted by holder ID.
	hHolder []uint32
	hTiers  []uint8 // Tier bits | approxBit
	hAux    []uint64
	hFree   [25][]uint32 // free runs per class

	holders     []holder
	freeHolders []uint32
	engines     []engineSlot
	freeEngines []uint32
	engineByID  map[state.EngineID]uint32
	byID        []uint32 // live engine slots sorted by ID; byID[engines[e].order] == e

	heap        []approxEntry
	approxCount int

	// Writer scratch, reused under the write lock.
	seen    table
	keyBuf  []uint64
	nodeBuf []uint32
	known   []bool
}

// node is one block. It holds no pointers, so the node slab costs the garbage collector nothing.
type node struct {
	key      uint64
	parent   uint32
	prev     uint32 // LRU list
	next     uint32
	children uint32
	hold     uint32 // first slot of the node's holding run
	meta     uint32 // nHold (24 bits) | class (5 bits) | flags (3 bits)
}

const (
	nHoldMask  = 1<<24 - 1
	classShift = 24
	classMask  = 31 << classShift
	flagLive   = 1 << 29
	flagInLRU  = 1 << 30
	flagApprox = 1 << 31 // the node has at least one approximate entry
)

func (n *node) nHold() int        { return int(n.meta & nHoldMask) }
func (n *node) class() uint32     { return (n.meta & classMask) >> classShift }
func (n *node) has(f uint32) bool { return n.meta&f != 0 }

// holder is one (engine, DP rank).
type holder struct {
	engine   uint32
	rank     int
	live     bool
	bindings table // engine block hash → node
	tiers    [4]int
	approx   int
}

type engineSlot struct {
	id    state.EngineID
	live  bool
	order uint32 // position of id among the live engines' IDs, ascending
	ranks []rankHolder
}

type rankHolder struct {
	rank   int
	holder uint32
}

// NewIndex returns an empty index whose Store hashes tokens with h. An invalid h (the zero
// Hasher) or a negative Options field returns an error wrapping state.ErrInvalidConfiguration
// that names the field. It starts no goroutine.
func NewIndex(h Hasher, opts Options) (*Index, error) {
	if h.blockTokens <= 0 {
		return nil, fmt.Errorf("kvindex: NewIndex: Hasher.BlockTokens: %d, must be > 0 (use NewHasher): %w",
			h.blockTokens, state.ErrInvalidConfiguration)
	}
	switch {
	case opts.MaxBlocks < 0 || uint64(opts.MaxBlocks) > maxNodes:
		return nil, fmt.Errorf("kvindex: Options.MaxBlocks: %d, must be in [0, %d]: %w", opts.MaxBlocks, maxNodes, state.ErrInvalidConfiguration)
	case opts.MaxApproxBlocks < 0:
		return nil, fmt.Errorf("kvindex: Options.MaxApproxBlocks: %d, must be >= 0: %w", opts.MaxApproxBlocks, state.ErrInvalidConfiguration)
	case opts.ApproxTTL < 0:
		return nil, fmt.Errorf("kvindex: Options.ApproxTTL: %v, must be >= 0: %w", opts.ApproxTTL, state.ErrInvalidConfiguration)
	}
	x := &Index{
		hasher:     h,
		maxBlocks:  opts.MaxBlocks,
		maxApprox:  opts.MaxApproxBlocks,
		ttl:        opts.ApproxTTL,
		now:        opts.Now,
		nodes:      make([]node, 1, 64),
		refBits:    make([]uint64, 1),
		engineByID: make(map[state.EngineID]uint32),
	}
	if x.maxBlocks == 0 {
		x.maxBlocks = DefaultMaxBlocks
	}
	if x.maxApprox == 0 {
		x.maxApprox = DefaultMaxApproxBlocks
	}
	if x.ttl == 0 {
		x.ttl = DefaultApproxTTL
	}
	if x.now == nil {
		x.now = time.Now
	}
	return x, nil
}

// Hasher returns the Hasher the index hashes Store tokens with. Queries for this index must be
// hashed with it.
func (x *Index) Hasher() Hasher { return x.hasher }

// StoreEvent is one engine's report that it now holds a run of consecutive blocks: vLLM and
// SGLang BlockStored (docs/design.md §13), already decoded.
type StoreEvent struct {
	// Engine and DPRank name the holder. Engine must not be empty (ErrInvalidEngine). DPRank is the
	// engine's data-parallel rank (0 when the engine has no DP); negative is an error.
	Engine state.EngineID
	DPRank int
	// ParentHash is the engine's hash of the block just before the first stored block, used only
	// when HasParent is true. It must be a hash this (Engine, DPRank) holds. HasParent false means
	// the run starts at the beginning of a prompt.
	ParentHash uint64
	HasParent  bool
	// BlockHashes are the engine's own hashes of the stored blocks, in prompt order: opaque IDs
	// for later parent links and removals, never compared with the index's keys. Empty makes the
	// event a no-op.
	BlockHashes []uint64
	// TokenIDs are the stored blocks' tokens, exactly len(BlockHashes) × the index's block size.
	// The index computes its own keys from them, chained from the parent block's key.
	TokenIDs []uint32
	// Tier is the medium the blocks were stored in: one or more Tier bits, never 0.
	Tier Tier
}

// Store records that ev.Engine's DP rank ev.DPRank holds ev's blocks in ev.Tier, attaching the first
// block under the parent the engine named (docs/design.md §11; Stored in
// ai-dynamo/dynamo `lib/kv-router/src/radix_tree.rs`). Storing a block the holder already holds under the same
// hash adds the tier; storing it under a second hash (an alias, as multimodal placeholders produce)
// adds a second entry, and the holder keeps the block until every alias is removed. A real event
// supersedes an Assume entry of the same (engine, rank 0) at that block: the entry becomes real
// and no longer expires.
//
// Errors (an *EventError; the index is unchanged): ErrInvalidEngine (ev.Engine is empty, even for
// an event with no blocks), ErrInvalidRank, ErrInvalidTier, ErrBlockSizeMismatch (its Err is a
// *BlockSizeError with the counts), ErrDuplicateHash (a hash twice in the event, or already held by this
// holder for another block), ErrCyclicChain (ParentHash among BlockHashes), ErrUnknownParent,
// ErrKeyConflict, ErrTooManyHolders. Cost: O(blocks) plus any eviction the cap requires.
func (x *Index) Store(ev StoreEvent) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.store(&ev)
}

func (x *Index) store(ev *StoreEvent) error {
	fail := func(err error, hashes ...uint64) error {
		return &EventError{Op: "store", Engine: ev.Engine, DPRank: ev.DPRank, Hashes: hashes, Err: err}
	}
	if ev.Engine == "" {
		return fail(ErrInvalidEngine)
	}
	if ev.DPRank < 0 {
		return fail(ErrInvalidRank)
	}
	if ev.Tier == 0 || ev.Tier&^AllTiers != 0 {
		return fail(ErrInvalidTier)
	}
	nb := len(ev.BlockHashes)
	if len(ev.TokenIDs) != nb*x.hasher.blockTokens {
		return fail(&BlockSizeError{Tokens: len(ev.TokenIDs), Blocks: nb, BlockTokens: x.hasher.blockTokens})
	}
	if nb == 0 {
		return nil
	}
	if dup, ok := x.firstDuplicate(ev.BlockHashes); ok {
		return fail(ErrDuplicateHash, dup)
	}
	if ev.HasParent {
		for _, h := range ev.BlockHashes {
			if h == ev.ParentHash {
				return fail(ErrCyclicChain, h)
			}
		}
	}
	hid, hok := x.lookupHolder(ev.Engine, ev.DPRank)
	parent, parentKey := uint32(0), x.hasher.root
	if ev.HasParent {
		p, ok := uint32(0), false
		if hok {
			p, ok = x.holders[hid].bindings.get(ev.ParentHash)
		}
		if !ok {
			return fail(ErrUnknownParent, ev.ParentHash)
		}
		parent, parentKey = p, x.nodes[p].key
	}
	x.keyBuf = x.hasher.appendFrom(x.keyBuf[:0], parentKey, ev.TokenIDs)
	if i, ok := x.resolveChain(parent, x.keyBuf); !ok {
		return fail(ErrKeyConflict, ev.BlockHashes[i])
	}
	x.known = x.known[:0]
	for i, n := range x.nodeBuf {
		known := false
		if hok {
			m, ok := x.holders[hid].bindings.get(ev.BlockHashes[i])
			if ok && m != n {
				return fail(ErrDuplicateHash, ev.BlockHashes[i])
			}
			known = ok
		}
		if n != 0 && x.nodes[n].nHold() >= maxHold {
			return fail(ErrTooManyHolders, ev.BlockHashes[i])
		}
		x.known = append(x.known, known)
	}

	// Valid: apply.
	if !hok {
		hid = x.holderFor(ev.Engine, ev.DPRank)
	}
	prev := parent
	for i, n := range x.nodeBuf {
		if n == 0 {
			n = x.newNode(x.keyBuf[i], prev)
		}
		x.storeHolding(n, hid, ev.BlockHashes[i], uint8(ev.Tier), x.known[i])
		x.touch(n)
		prev = n
	}
	x.evict()
	return nil
}

// resolveChain fills x.nodeBuf with the existing node of each key (0 for a new one), checking
// that each existing node hangs under the previous key's node (parent for the first). It returns
// the index of the first inconsistent key and false when the chain conflicts with the tree or
// repeats a new key.
func (x *Index) resolveChain(parent uint32, keys []uint64) (int, bool) {
	x.nodeBuf = x.nodeBuf[:0]
	x.seen.clearFor(len(keys))
	prev := parent
	for i, k := range keys {
		n, ok := x.byKey.get(k)
		if ok {
			if (i > 0 && prev == 0) || x.nodes[n].parent != prev {
				return i, false
			}
		} else {
			if _, dup := x.seen.add(k, 1); dup {
				return i, false
			}
		}
		x.nodeBuf = append(x.nodeBuf, n)
		prev = n
	}
	return 0, true
}

// firstDuplicate returns a value that occurs twice in vs.
func (x *Index) firstDuplicate(vs []uint64) (uint64, bool) {
	if len(vs) <= 16 {
		for i := 1; i < len(vs); i++ {
			for _, w := range vs[:i] {
				if vs[i] == w {
					return w, true
				}
			}
		}
		return 0, false
	}
	x.seen.clearFor(len(vs))
	for _, v := range vs {
		if _, dup := x.seen.add(v, 1); dup {
			return v, true
		}
	}
	return 0, false
}

// storeHolding records holder hid's hash at node n in tier t (validated by the caller); known
// reports whether the holder already binds hash (to n).
func (x *Index) storeHolding(n, hid uint32, hash uint64, t uint8, known bool) {
	h := &x.holders[hid]
	lo, hi := x.findHolder(n, hid)
	if known {
		for p := lo; p < hi; p++ {
			if x.hTiers[p]&approxBit == 0 && x.hAux[p] == hash {
				x.addTiers(h, x.hTiers[p], t)
				x.hTiers[p] |= t
				return
			}
		}
	}
	if lo < hi && x.hTiers[lo]&approxBit != 0 {
		// A real event supersedes the router's own placement (docs/design.md
		// §11): the entry becomes real and no longer expires. Its heap entry goes stale.
		x.hTiers[lo], x.hAux[lo] = t, hash
		h.approx--
		x.approxCount--
		x.addTiers(h, 0, t)
		h.bindings.put(hash, n)
		x.refreshApproxFlag(n)
		return
	}
	x.insertHolding(n, hi, hid, t, hash)
	x.addTiers(h, 0, t)
	h.bindings.put(hash, n)
}

// addTiers counts the bits of add that old lacks.
func (x *Index) addTiers(h *holder, old, add uint8) {
	for i := range h.tiers {
		if add&(1<<i) != 0 && old&(1<<i) == 0 {
			h.tiers[i]++
		}
	}
}

func (x *Index) subTiers(h *holder, drop uint8) {
	for i := range h.tiers {
		if drop&(1<<i) != 0 {
			h.tiers[i]--
		}
	}
}

// Remove records that engine's DP rank no longer holds the blocks with the given engine hashes in
// tiers (vLLM/SGLang BlockRemoved). tiers 0 or AllTiers removes every tier, as an event without a
// medium does (docs/design.md §11). A block left with no tier for any alias is dropped for
// that holder; a block no holder keeps and with no children leaves the tree, and so does each
// ancestor that is left empty. A hash named twice is removed once.
//
// Errors (an *EventError; the index is unchanged): ErrInvalidEngine (engine is empty),
// ErrInvalidRank, ErrInvalidTier, ErrUnknownEngine (the (engine, rank) holds nothing and never did, or was removed), ErrUnknownHash (listing every
// hash the holder does not hold; this includes blocks the index evicted under MaxBlocks).
func (x *Index) Remove(engine state.EngineID, rank int, hashes []uint64, tiers Tier) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	fail := func(err error, hs ...uint64) error {
		return &EventError{Op: "remove", Engine: engine, DPRank: rank, Hashes: hs, Err: err}
	}
	if engine == "" {
		return fail(ErrInvalidEngine)
	}
	if rank < 0 {
		return fail(ErrInvalidRank)
	}
	if tiers&^AllTiers != 0 {
		return fail(ErrInvalidTier)
	}
	if tiers == 0 {
		tiers = AllTiers
	}
	hid, ok := x.lookupHolder(engine, rank)
	if !ok {
		return fail(ErrUnknownEngine)
	}
	h := &x.holders[hid]
	var unknown []uint64
	x.nodeBuf = x.nodeBuf[:0]
	for _, hash := range hashes {
		n, ok := h.bindings.get(hash)
		if !ok {
			unknown = append(unknown, hash)
		}
		x.nodeBuf = append(x.nodeBuf, n)
	}
	if len(unknown) > 0 {
		return fail(ErrUnknownHash, unknown...)
	}
	for i, hash := range hashes {
		// A hash named twice finds its entry gone (or its node freed: no entries) the second
		// time; nodes freed here are not reused before Remove returns.
		n := x.nodeBuf[i]
		lo, hi := x.findHolder(n, hid)
		for p := lo; p < hi; p++ {
			if x.hTiers[p]&approxBit != 0 || x.hAux[p] != hash {
				continue
			}
			drop := x.hTiers[p] & uint8(tiers)
			x.subTiers(h, drop)
			x.hTiers[p] &^= drop
			if x.hTiers[p] == 0 {
				x.deleteHolding(n, p)
				h.bindings.del(hash)
				x.prune(n)
			}
			break
		}
	}
	return nil
}

// Clear drops every block engine's DP rank holds, real and approximate, in every tier (vLLM and
// SGLang AllBlocksCleared, scoped to the emitting rank as ai-dynamo/dynamo
// `lib/kv-router/src/protocols.rs` documents; docs/design.md §11). The holder stays known, so a later Remove for it returns
// ErrUnknownHash rather than ErrUnknownEngine. Errors (an *EventError; the index is unchanged):
// ErrInvalidEngine (engine is empty), ErrInvalidRank, ErrUnknownEngine. Cost: O(blocks the holder held + approximate entries in the index).
func (x *Index) Clear(engine state.EngineID, rank int) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	if engine == "" {
		return &EventError{Op: "clear", Engine: engine, DPRank: rank, Err: ErrInvalidEngine}
	}
	if rank < 0 {
		return &EventError{Op: "clear", Engine: engine, DPRank: rank, Err: ErrInvalidRank}
	}
	hid, ok := x.lookupHolder(engine, rank)
	if !ok {
		return &EventError{Op: "clear", Engine: engine, DPRank: rank, Err: ErrUnknownEngine}
	}
	x.clearHolder(hid)
	return nil
}

// RemoveEngine forgets engine entirely: every DP rank, every block, real and approximate. Call it
// when the engine leaves the registry. Errors (an *EventError; the index is unchanged):
// ErrInvalidEngine when engine is empty, ErrUnknownEngine when the engine is not in the index.
// Cost as Clear, for every rank.
func (x *Index) RemoveEngine(engine state.EngineID) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	if engine == "" {
		return &EventError{Op: "remove engine", Engine: engine, Err: ErrInvalidEngine}
	}
	e, ok := x.engineByID[engine]
	if !ok {
		return &EventError{Op: "remove engine", Engine: engine, Err: ErrUnknownEngine}
	}
	for _, rh := range x.engines[e].ranks {
		x.clearHolder(rh.holder)
		x.holders[rh.holder] = holder{}
		x.freeHolders = append(x.freeHolders, rh.holder)
	}
	pos := x.engines[e].order
	x.byID = slices.Delete(x.byID, int(pos), int(pos)+1)
	x.renumber(int(pos))
	x.engines[e] = engineSlot{}
	x.freeEngines = append(x.freeEngines, e)
	delete(x.engineByID, engine)
	return nil
}

// clearHolder drops every entry of holder hid.
func (x *Index) clearHolder(hid uint32) {
	h := &x.holders[hid]
	h.bindings.each(func(hash uint64, n uint32) {
		lo, hi := x.findHolder(n, hid)
		for p := lo; p < hi; p++ {
			if x.hTiers[p]&approxBit == 0 && x.hAux[p] == hash {
				x.deleteHolding(n, p)
				x.prune(n)
				break
			}
		}
	})
	h.bindings.reset()
	h.tiers = [4]int{}
	if h.approx > 0 {
		for _, e := range x.heap {
			if e.holder == hid {
				if p, ok := x.approxAt(e); ok {
					x.dropApprox(e.node, p)
				}
			}
		}
	}
}

// lookupHolder returns the holder ID of (engine, rank) if it exists.
func (x *Index) lookupHolder(id state.EngineID, rank int) (uint32, bool) {
	e, ok := x.engineByID[id]
	if !ok {
		return 0, false
	}
	for _, rh := range x.engines[e].ranks {
		if rh.rank == rank {
			return rh.holder, true
		}
	}
	return 0, false
}

// holderFor returns the holder ID of (engine, rank), creating the engine and holder if needed.
func (x *Index) holderFor(id state.EngineID, rank int) uint32 {
	if hid, ok := x.lookupHolder(id, rank); ok {
		return hid
	}
	e, ok := x.engineByID[id]
	if !ok {
		if n := len(x.freeEngines); n > 0 {
			e = x.freeEngines[n-1]
			x.freeEngines = x.freeEngines[:n-1]
		} else {
			e = uint32(len(x.engines))
			x.engines = append(x.engines, engineSlot{})
		}
		x.engines[e] = engineSlot{id: id, live: true}
		x.engineByID[id] = e
		pos, _ := slices.BinarySearchFunc(x.byID, id, func(slot uint32, id state.EngineID) int {
			return cmp.Compare(x.engines[slot].id, id)
		})
		x.byID = slices.Insert(x.byID, pos, e)
		x.renumber(pos)
	}
	var hid uint32
	if n := len(x.freeHolders); n > 0 {
		hid = x.freeHolders[n-1]
		x.freeHolders = x.freeHolders[:n-1]
	} else {
		hid = uint32(len(x.holders))
		x.holders = append(x.holders, holder{})
	}
	x.holders[hid] = holder{engine: e, rank: rank, live: true}
	x.engines[e].ranks = append(x.engines[e].ranks, rankHolder{rank: rank, holder: hid})
	return hid
}

// renumber refreshes the order of the engines from position pos of byID on. Adding or removing
// an engine costs O(engines); Match then orders ties by integer instead of string comparisons.
func (x *Index) renumber(pos int) {
	for i := pos; i < len(x.byID); i++ {
		x.engines[x.byID[i]].order = uint32(i)
	}
}

// ---- nodes, LRU and eviction ----

// newNode creates the node for key under parent and links it as the most recently used leaf.
func (x *Index) newNode(key uint64, parent uint32) uint32 {
	var n uint32
	if k := len(x.freeNodes); k > 0 {
		n = x.freeNodes[k-1]
		x.freeNodes = x.freeNodes[:k-1]
	} else {
		n = uint32(len(x.nodes))
		x.nodes = append(x.nodes, node{})
		if int(n>>6) >= len(x.refBits) {
			x.refBits = append(x.refBits, 0)
		}
	}
	x.nodes[n] = node{key: key, parent: parent, meta: flagLive}
	x.clearRef(n)
	x.byKey.put(key, n)
	if parent != 0 {
		x.nodes[parent].children++
	}
	x.live++
	x.lruPushTail(n)
	return n
}

// freeNode removes an empty, childless node from the tree.
func (x *Index) freeNode(n uint32) {
	nd := &x.nodes[n]
	if nd.has(flagInLRU) {
		x.lruUnlink(n)
	}
	x.byKey.del(nd.key)
	if p := nd.parent; p != 0 {
		x.nodes[p].children--
	}
	*nd = node{}
	x.live--
	x.freeNodes = append(x.freeNodes, n)
}

// prune frees n and then each ancestor while they hold nothing and have no children, and makes
// sure the surviving ancestor is an eviction candidate if it became a leaf.
func (x *Index) prune(n uint32) {
	for n != 0 {
		nd := &x.nodes[n]
		if nd.nHold() > 0 || nd.children > 0 {
			if nd.children == 0 && !nd.has(flagInLRU) {
				x.lruPushHead(n)
			}
			return
		}
		p := nd.parent
		x.freeNode(n)
		n = p
	}
}

func (x *Index) lruUnlink(n uint32) {
	nd := &x.nodes[n]
	if nd.prev != 0 {
		x.nodes[nd.prev].next = nd.next
	} else {
		x.lruHead = nd.next
	}
	if nd.next != 0 {
		x.nodes[nd.next].prev = nd.prev
	} else {
		x.lruTail = nd.prev
	}
	nd.prev, nd.next = 0, 0
	nd.meta &^= flagInLRU
}

func (x *Index) lruPushTail(n uint32) {
	nd := &x.nodes[n]
	nd.prev, nd.next = x.lruTail, 0
	if x.lruTail != 0 {
		x.nodes[x.lruTail].next = n
	} else {
		x.lruHead = n
	}
	x.lruTail = n
	nd.meta |= flagInLRU
}

// lruPushHead links n as the next eviction candidate: a node that just became a leaf again was
// pushed out of the list at its head, so it is among the oldest.
func (x *Index) lruPushHead(n uint32) {
	nd := &x.nodes[n]
	nd.prev, nd.next = 0, x.lruHead
	if x.lruHead != 0 {
		x.nodes[x.lruHead].prev = n
	} else {
		x.lruTail = n
	}
	x.lruHead = n
	nd.meta |= flagInLRU
}

// touch marks n as just used.
func (x *Index) touch(n uint32) {
	if x.lruTail == n {
		return
	}
	if x.nodes[n].has(flagInLRU) {
		x.lruUnlink(n)
	}
	x.lruPushTail(n)
}

func (x *Index) refSet(n uint32) bool {
	return atomic.LoadUint64(&x.refBits[n>>6])&(1<<(n&63)) != 0
}

func (x *Index) clearRef(n uint32) {
	w := &x.refBits[n>>6]
	if atomic.LoadUint64(w)&(1<<(n&63)) != 0 {
		atomic.AndUint64(w, ^(uint64(1) << (n & 63)))
	}
}

// markRef records that a Match walked n. Called under the read lock, concurrently.
func (x *Index) markRef(n uint32) {
	w := &x.refBits[n>>6]
	if atomic.LoadUint64(w)&(1<<(n&63)) == 0 {
		atomic.OrUint64(w, 1<<(n&63))
	}
}

// evict removes least recently used leaves until the index fits MaxBlocks. Interior nodes met at
// the head leave the list (they rejoin it at the head when their last child goes); a leaf with its
// reference bit set gets a second chance at the tail.
func (x *Index) evict() {
	for x.live > x.maxBlocks {
		n := x.lruHead
		if n == 0 {
			return
		}
		nd := &x.nodes[n]
		switch {
		case nd.children > 0:
			x.lruUnlink(n)
		case x.refSet(n):
			x.clearRef(n)
			x.lruUnlink(n)
			x.lruPushTail(n)
		default:
			x.evictNode(n)
		}
	}
}

// evictNode drops every entry of leaf n, for every holder, and prunes upwards.
func (x *Index) evictNode(n uint32) {
	nd := &x.nodes[n]
	for p := int(nd.hold) + nd.nHold() - 1; p >= int(nd.hold); p-- {
		h := &x.holders[x.hHolder[p]]
		if x.hTiers[p]&approxBit != 0 {
			h.approx--
			x.approxCount--
		} else {
			x.subTiers(h, x.hTiers[p])
			h.bindings.del(x.hAux[p])
		}
	}
	x.freeRun(nd.hold, nd.class())
	nd.meta &^= nHoldMask | classMask | flagApprox
	x.evicted++
	x.prune(n)
}

// ---- holding runs ----

// findHolder returns the slab range of holder hid's entries at node n.
func (x *Index) findHolder(n, hid uint32) (int, int) {
	nd := &x.nodes[n]
	lo, hi := int(nd.hold), int(nd.hold)+nd.nHold()
	// Binary search for the first entry >= hid.
	for lo < hi {
		mid := int(uint(lo+hi) >> 1)
		if x.hHolder[mid] < hid {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	end := lo
	last := int(nd.hold) + nd.nHold()
	for end < last && x.hHolder[end] == hid {
		end++
	}
	return lo, end
}

// insertHolding inserts an entry at slab position pos of node n's run, growing the run if full.
func (x *Index) insertHolding(n uint32, pos int, hid uint32, t uint8, aux uint64) {
	nd := &x.nodes[n]
	k := nd.nHold()
	if k == 0 {
		nd.hold = x.allocRun(0)
		nd.meta &^= classMask
		pos = int(nd.hold)
	} else if k == 1<<nd.class() {
		c := nd.class() + 1
		off := x.allocRun(c)
		nd = &x.nodes[n]
		rel := pos - int(nd.hold)
		x.moveRun(nd.hold, off, k)
		x.freeRun(nd.hold, nd.class())
		nd.hold = off
		nd.meta = nd.meta&^classMask | c<<classShift
		pos = int(off) + rel
	}
	end := int(nd.hold) + k
	copy(x.hHolder[pos+1:end+1], x.hHolder[pos:end])
	copy(x.hTiers[pos+1:end+1], x.hTiers[pos:end])
	copy(x.hAux[pos+1:end+1], x.hAux[pos:end])
	x.hHolder[pos], x.hTiers[pos], x.hAux[pos] = hid, t, aux
	nd.meta++
}

// deleteHolding removes the entry at slab position pos of node n's run, shrinking the run when it
// is a quarter full.
func (x *Index) deleteHolding(n uint32, pos int) {
	nd := &x.nodes[n]
	k := nd.nHold()
	end := int(nd.hold) + k
	copy(x.hHolder[pos:end-1], x.hHolder[pos+1:end])
	copy(x.hTiers[pos:end-1], x.hTiers[pos+1:end])
	copy(x.hAux[pos:end-1], x.hAux[pos+1:end])
	nd.meta--
	k--
	c := nd.class()
	switch {
	case k == 0:
		x.freeRun(nd.hold, c)
		nd.meta &^= classMask
	case c >= 2 && k <= 1<<(c-2):
		off := x.allocRun(c - 1)
		nd = &x.nodes[n]
		x.moveRun(nd.hold, off, k)
		x.freeRun(nd.hold, c)
		nd.hold = off
		nd.meta = nd.meta&^classMask | (c-1)<<classShift
	}
}

func (x *Index) allocRun(c uint32) uint32 {
	if k := len(x.hFree[c]); k > 0 {
		off := x.hFree[c][k-1]
		x.hFree[c] = x.hFree[c][:k-1]
		return off
	}
	off := uint32(len(x.hHolder))
	size := 1 << c
	x.hHolder = append(x.hHolder, make([]uint32, size)...)
	x.hTiers = append(x.hTiers, make([]uint8, size)...)
	x.hAux = append(x.hAux, make([]uint64, size)...)
	return off
}

func (x *Index) freeRun(off, c uint32) { x.hFree[c] = append(x.hFree[c], off) }

func (x *Index) moveRun(from, to uint32, k int) {
	copy(x.hHolder[to:int(to)+k], x.hHolder[from:int(from)+k])
	copy(x.hTiers[to:int(to)+k], x.hTiers[from:int(from)+k])
	copy(x.hAux[to:int(to)+k], x.hAux[from:int(from)+k])
}

// refreshApproxFlag recomputes whether node n carries an approximate entry.
func (x *Index) refreshApproxFlag(n uint32) {
	nd := &x.nodes[n]
	nd.meta &^= flagApprox
	for p := int(nd.hold); p < int(nd.hold)+nd.nHold(); p++ {
		if x.hTiers[p]&approxBit != 0 {
			nd.meta |= flagApprox
			return
		}
	}
}
