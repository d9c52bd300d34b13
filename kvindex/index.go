package kvindex

import (
	"cmp"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/enginepick/enginepick/internal/kvbridge"
	"github.com/enginepick/enginepick/state"
)

// Defaults for Options fields left zero (each field states its value). The approximate-entry
// values are Dynamo's PruneConfig (ai-dynamo/dynamo `lib/kv-router/src/approx.rs`: TTL 120 s, at
// most 2^20 = 1,048,576 blocks, pruned to 0.8 of that; docs/design.md §11).
const (
	defaultMaxBlocks         = 1 << 22
	defaultApproxTTL         = 120 * time.Second
	defaultMaxApproxBlocks   = 1 << 20
	defaultWriterYieldBlocks = 4096
	// approxPruneFraction is the fraction of MaxApproxBlocks an over-cap index prunes back to,
	// earliest expiry first and, within one expiry, deepest block first.
	approxPruneFraction = 0.8
)

// maxHold is the most holding entries one node can carry (24 bits of node.meta); maxNodes the
// most nodes (uint32 indexes, 0 reserved for the root); maxHolders the most (engine, DP rank)
// holders (24 bits of a holding entry).
const (
	maxHold    = 1<<24 - 1
	maxNodes   = 1<<32 - 2
	maxHolders = 1<<24 - 1
)

// Options configures an Index. The zero value is the documented default for every field.
type Options struct {
	// MaxBlocks caps the number of blocks (tree nodes) the index keeps. When a write pushes the
	// count above it, the least recently used leaves are evicted, for every holder at once, until
	// it fits; interior blocks are never evicted, so every kept block's prefix stays in the tree.
	// Approximate entries (LocalSource.Place) are not blocks: they are kept beside the tree, capped by
	// MaxApproxBlocks, and neither count against MaxBlocks nor are evicted by it.
	// Recency is the last Store of the block, with a second chance for a block that a
	// Match has found as some engine's deepest block since (CLOCK). While one Store is being
	// applied the count may exceed the cap by that event's own new blocks; the cap holds again
	// when Store returns. 0 means 4,194,304 blocks (2^22: 64 Mi tokens at 16 tokens per block);
	// negative or above 2^32−2 is an error.
	// The package documentation ("Sizing MaxBlocks") says how to size it.
	MaxBlocks int
	// ExpectedBlocks is how many blocks the index is expected to hold when full: the fleet's
	// distinct blocks, at most MaxBlocks (package documentation, "Sizing MaxBlocks"). NewIndex then
	// allocates the key → block table for that many blocks (the least power of two of slots at
	// least 4/3 of it, 16 bytes a slot: 21 to 43 bytes per expected block, from the start), and
	// the table never shrinks below it, so filling the index never grows and rehashes it. 0 means
	// the table starts small and doubles as blocks arrive; negative or above MaxBlocks (after its
	// default) is an error.
	ExpectedBlocks int
	// ExpectedHolderBlocks is how many blocks one holder, an (engine, DP rank), is expected to hold:
	// its KV capacity in blocks over every tier it reports (for an engine with DP, one rank's
	// share). Each holder's engine-hash table is then allocated at that size when the holder first
	// stores a block (8-byte slots, 11 to 21 bytes per expected block), and never shrinks below
	// it; Clear releases it, and the holder's next Store allocates it again. 0 means the table
	// starts small and doubles; negative or above MaxBlocks (after its default) is an error.
	ExpectedHolderBlocks int
	// MaxApproxBlocks caps the approximate entries (LocalSource.Place), counted per (block, engine). Above
	// it, entries are pruned to 0.8 of the cap. 0 means 1,048,576 (2^20);
	// negative is an error.
	MaxApproxBlocks int
	// ApproxTTL is the lifetime of an approximate entry (LocalSource.Place). 0 means 120 s;
	// negative is an error.
	ApproxTTL time.Duration
	// Now is the clock for approximate-entry expiry. nil means time.Now. Tests inject a fixed
	// clock; the index never sleeps and starts no goroutine.
	Now func() time.Time
	// WriterYieldBlocks is how many blocks Stores add between two yields of the writer's
	// processor (runtime.Gosched, after a Store, outside every lock), so that lookups waiting
	// for a processor run first. With an idle processor a yield costs nothing; when lookups keep
	// every processor busy, a smaller value keeps more lookups and ingests fewer blocks per
	// second (docs/performance.md, "A writer that yields to readers", has the trade-off). Only
	// Stores count and yield; Clear and RemoveEngine let readers in between their chunks instead.
	// 0 means 4,096; negative never yields.
	WriterYieldBlocks int
}

// Index is the prefix index: a radix tree over chained block keys recording, per block, which
// engines (and which of their DP ranks) hold it and in which storage tiers. It stores ownership,
// never KV tensors (docs/design.md §11).
//
// Because keys are chained (Hasher), a key names a whole prefix, so the tree is kept as one node
// per key with a parent link, found through a key → node table, rather than as child maps.
// Engines are addressed by their own block hashes (opaque IDs, docs/design.md §11), which the
// index maps to nodes per (engine, DP rank) to resolve parents and removals. A Match finds each
// engine's deepest held block with a handful of table probes rather than one per block
// (match.go), because a holder's entries along a prompt are prefix-closed except at blocks the
// index keeps in a small "holey" set.
//
// Concurrency: every method is safe for concurrent use. Match takes a read lock, and matches
// run in parallel with each other. Writes (Store, Remove, Clear, RemoveEngine, placements) are
// serialised by a writer mutex, which gives "one writer per engine" ordering for free as long as
// each engine's events are applied in order by their caller; a Store hashes and validates its
// event without blocking readers and takes the read-excluding lock only to apply it, in chunks
// of at most storeChunk blocks. doc.go records the choice, with figures.
type Index struct {
	// placeHook, when set, is told each placement of a LocalSource over the index
	// (kvbridge.SetPlaceHook).
	placeHook atomic.Pointer[func(engine state.EngineID, rank int, keys []uint64, held int)]

	wmu   sync.Mutex   // serialises writers
	mu    sync.RWMutex // readers share it; a writer holds it while it changes what readers read
	trust trustSet     // engines whose entries Sources must not trust (trust.go); not guarded by mu
	// Stores yield the processor every yieldBlocks blocks (Options.WriterYieldBlocks; 0: never);
	// sinceYield counts the blocks since the last yield (guarded by wmu). yield is
	// runtime.Gosched but in tests.
	yieldBlocks, sinceYield int
	yield                   func()

	hasher    Hasher
	maxBlocks int
	maxApprox int
	// holderBits is the log2 size of a holder's binding table when it first binds
	// (Options.ExpectedHolderBlocks; 0: it starts small).
	holderBits uint
	ttl        time.Duration
	now        func() time.Time

	nodes     slab[node] // node 0 is the root sentinel; 0 also means "no node"
	refBits   []uint64   // CLOCK reference bit per node; Match sets bits atomically
	byKey     nodeTable  // block key → node
	freeNodes []uint32
	live      int // live nodes, root excluded
	evicted   uint64
	// The LRU list (node.prev, node.next) links the eviction candidates, least recently used
	// first. A chain stored in one event sits contiguously in it, so moving the chain to the tail
	// costs cache misses only at its two ends.
	lruHead uint32
	lruTail uint32

	// Holding entries, in runs of 1<<class slots per node, kept sorted by holder ID.
	holds slab[holding]
	hFree [25][]uint32 // free runs per class

	// holey maps the key of every block where some holder's held prefix may have a hole to its
	// node ("holes" below).
	holey    table
	clearing bool // clearHolders is dropping every entry of its holders: no hole can result
	// hiddenHolders counts the holders Match leaves out (holder.hidden) while clearHolders
	// drops their entries.
	hiddenHolders int
	// During a Remove, holes are decided when it is done (pending), so that removing a chain
	// root first, in one event, leaves no holey block behind.
	deferHoles bool
	pending    []pendingHole
	// During a Remove or a Clear, deleteHolding leaves the holder summaries of the nodes it
	// empties to settleSums (deferSums), which skips the nodes freed by then.
	deferSums  bool
	sumPending []uint32
	// hintNode and hintPos name where a Store just put its holder's first entry at a block, so
	// that the next block's linkChild finds the parent's entry without a search. Valid only
	// during a Store's apply loop (hintNode 0 otherwise).
	hintNode uint32
	hintPos  int

	holders     []holder
	freeHolders []uint32
	engines     []engineSlot
	freeEngines []uint32
	engineByID  map[state.EngineID]uint32
	byID        []uint32 // live engine slots sorted by ID; byID[engines[e].order] == e

	// Approximate entries, as records beside the tree (approx.go).
	places       []placement // record id → record; id 0 is unused
	freePlaces   []uint32
	placeLive    int        // live records
	starts       table      // first key → id of the first record of its list
	startBits    []uint64   // the start filter over the records' first keys (approx.go)
	startBitsLog uint       // log2 of the filter's bits
	startStale   int        // records unlinked since the filter was rebuilt
	pheap        []placeRef // expiry order; entries of dropped records are stale
	pdrain       []uint32   // pruneApprox's scratch
	keyPool      [][]uint64 // dropped records' keys slices, for reuse
	approxCount  int        // approximate entries: the records' blocks

	// wideSearch makes Match use its general search for any number of holders (tests only).
	wideSearch bool

	// Writer scratch, reused under the writer mutex.
	seen     u64Set
	warmSink uint32
	keyBuf   []uint64
	nodeBuf  []uint32
	known    []bool
	slotBuf  []int32 // Store: each block's binding insert position (bindTable.insertAt)
	keySlots []int32 // resolveChain: where each key's probe ended (nodeTable.lookupSlot)
	built    []bool  // Store: which blocks of the chunk prebuild built
	prebuilt int     // Store chunks whose new blocks prebuild built (for tests)
	// growHook, when set (tests only), runs after a Store has built the grown key table and
	// before it takes the lock to install it.
	growHook func()
	sumSlot  int // Store: the key-table slot of the block being applied, or -1 (orSumAt)

	// clearHolders' own state, beside its clearing and hiddenHolders above.
	clearBuf   []uint32    // RemoveEngine's holders
	clearNodes []clearNode // clearHolders' entries to drop (clearWarm), from clearAt on
	clearAt    int
	pruneFrom  uint32         // clearHolders: where a cascade of freed nodes goes on (pruneUpTo)
	clearChunk int            // clearChunk; tests set fewer
	clearHook  func(work int) // tests: runs after each chunk of clearHolders, without mu
}

// node is one block. It holds no pointers, so the node slab costs the garbage collector nothing.
// Readers read key, parent, hold and meta; prev and next (the LRU list) are the writers' alone,
// so a Store may update them without excluding readers (they are separate words).
type node struct {
	key      uint64
	parent   uint32
	children uint32
	hold     uint32 // first slot of the node's holding run
	meta     uint32 // nHold (24 bits) | class (5 bits) | flags (3 bits)
	prev     uint32 // LRU list
	next     uint32
}

const (
	nHoldMask  = 1<<24 - 1
	classShift = 24
	classMask  = 31 << classShift
	flagLive   = 1 << 29
	flagHoley  = 1 << 30 // the node is in Index.holey
)

func (n *node) nHold() int        { return int(n.meta & nHoldMask) }
func (n *node) class() uint32     { return (n.meta & classMask) >> classShift }
func (n *node) has(f uint32) bool { return n.meta&f != 0 }
func (n *node) holey() bool       { return n.meta&flagHoley != 0 }

// holding is one holding entry, always a real (event) one (approximate entries are records,
// approx.go): e is holder<<8 | tier byte (Tier bits), aux the engine's block hash, kids, on a
// holder's first entry at a node, how many children of that node the holder holds (exact unless
// the node is holey). One 16-byte struct rather than three arrays, so that inserting an entry
// moves one array and reading one touches one cache line.
type holding struct {
	e    uint32
	kids uint32
	aux  uint64
}

// Holding entry layout.
func entryHolder(e uint32) uint32        { return e >> 8 }
func mkEntry(hid uint32, t uint8) uint32 { return hid<<8 | uint32(t) }

// holder is one (engine, DP rank).
// pendingHole is a block a holder dropped during a Remove while it still held kids of its
// children.
type pendingHole struct{ n, hid, kids uint32 }

type holder struct {
	engine uint32
	rank   int
	live   bool
	// hidden: clearHolders is dropping the holder's entries a chunk at a time; Match leaves the
	// holder out until they are all gone (guarded by mu).
	hidden   bool
	bindings bindTable // engine block hash → node (bindtable.go)
	tiers    [4]int
	approx   int
}

// clearNode is one binding clearHolders drops: the block's node and its hash's tag (bindTag).
type clearNode struct{ n, tag uint32 }

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
		return nil, fmt.Errorf("kvindex: Options.MaxBlocks: %d, must be in [0, %d]: %w", opts.MaxBlocks, uint64(maxNodes), state.ErrInvalidConfiguration)
	case opts.ExpectedBlocks < 0 || opts.ExpectedBlocks > cmp.Or(opts.MaxBlocks, defaultMaxBlocks):
		return nil, fmt.Errorf("kvindex: Options.ExpectedBlocks: %d, must be in [0, MaxBlocks = %d]: %w",
			opts.ExpectedBlocks, cmp.Or(opts.MaxBlocks, defaultMaxBlocks), state.ErrInvalidConfiguration)
	case opts.ExpectedHolderBlocks < 0 || opts.ExpectedHolderBlocks > cmp.Or(opts.MaxBlocks, defaultMaxBlocks):
		return nil, fmt.Errorf("kvindex: Options.ExpectedHolderBlocks: %d, must be in [0, MaxBlocks = %d]: %w",
			opts.ExpectedHolderBlocks, cmp.Or(opts.MaxBlocks, defaultMaxBlocks), state.ErrInvalidConfiguration)
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
		refBits:    make([]uint64, 1),
		engineByID: make(map[state.EngineID]uint32),
		sumSlot:    -1,
		clearChunk: clearChunk,
		yield:      runtime.Gosched,
	}
	switch {
	case opts.WriterYieldBlocks == 0:
		x.yieldBlocks = defaultWriterYieldBlocks
	case opts.WriterYieldBlocks > 0:
		x.yieldBlocks = opts.WriterYieldBlocks
	}
	x.nodes.extend(1) // the root sentinel
	if opts.ExpectedBlocks > 0 {
		b := max(tableBitsFor(opts.ExpectedBlocks), nodeTableMinBits)
		x.byKey.floor = b
		x.byKey.resize(b)
		x.refBits = make([]uint64, 1, opts.ExpectedBlocks>>6+1)
	}
	if opts.ExpectedHolderBlocks > 0 {
		x.holderBits = max(tableBitsFor(opts.ExpectedHolderBlocks), bindTableMinBits)
	}
	if x.maxBlocks == 0 {
		x.maxBlocks = defaultMaxBlocks
	}
	if x.maxApprox == 0 {
		x.maxApprox = defaultMaxApproxBlocks
	}
	if x.ttl == 0 {
		x.ttl = defaultApproxTTL
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
	// Adapter is the LoRA adapter the blocks were computed under (vLLM lora_name); empty means the
	// base model. A run without a parent is keyed from the adapter's root (Hasher), so that only
	// a query for the same adapter (Query.Adapter) matches it; a run with a parent continues the
	// parent's chain, which already carries its adapter.
	Adapter string
}

// storeChunk is the most blocks a Store applies under one hold of the read-excluding lock, so a
// Match waits for at most about this many blocks' publication (doc.go, "Concurrency"). A chunk's
// new blocks are built before the hold (prebuild), so a full chunk holds the lock for a fraction
// of a millisecond. Each hold parks the readers that arrive during it and each park costs a
// wake-up, so fewer, longer holds keep more lookups (docs/performance.md, "Readers beside a
// writer, and a control").
const storeChunk = 2048

// Store records that ev.Engine's DP rank ev.DPRank holds ev's blocks in ev.Tier, attaching the first
// block under the parent the engine named (docs/design.md §11; Stored in
// ai-dynamo/dynamo `lib/kv-router/src/radix_tree.rs`). Storing a block the holder already holds
// under the same hash adds the tier; storing it under a second
// hash (an alias, as multimodal placeholders produce) adds a second entry, and the holder keeps
// the block until every alias is removed. A real event supersedes an approximate entry
// (LocalSource.Place) of the same (engine, rank) at that block: the entry becomes real and no
// longer expires.
//
// Store hashes and validates the whole event before it changes anything, without blocking
// Match; it then applies the blocks in prompt order, storeChunk at a time, so a concurrent Match
// may see the first blocks of an event before the last ones (never a later block without the
// earlier ones), and evicts under MaxBlocks once the event is applied. Every
// Options.WriterYieldBlocks blocks, a Store yields its processor before it returns.
//
// Errors (an *EventError; the index is unchanged): ErrInvalidEngine (ev.Engine is empty, even for
// an event with no blocks), ErrInvalidRank, ErrInvalidTier, ErrBlockSizeMismatch (its Err is a
// *BlockSizeError with the counts), ErrDuplicateHash (a hash twice in the event, or already held by this
// holder for another block), ErrCyclicChain (ParentHash among BlockHashes), ErrUnknownParent,
// ErrKeyConflict, ErrTooManyHolders (also when the event's (engine, rank) would be holder number
// 2^24). Cost: O(blocks) plus any eviction the cap requires.
func (x *Index) Store(ev StoreEvent) error {
	return x.storeYield(&ev, nil)
}

// storeRestored is Store that also appends to restored each block of ev that ev's holder already
// held under the same hash (kvbridge.StoreRestored states the contract). vLLM stores a block
// again when it keeps a second copy of it (its block pool does not deduplicate a block computed
// while an identical one is cached: vllm-project/vllm vllm/v1/core/block_pool.py), so an event
// consumer counts copies with it (docs/design.md §13.1).
func (x *Index) storeRestored(ev StoreEvent, restored []kvbridge.Restored) ([]kvbridge.Restored, error) {
	n := len(restored)
	if err := x.storeYield(&ev, &restored); err != nil {
		return restored[:n], err
	}
	return restored, nil
}

// storeYield runs store under wmu and yields the processor every Options.WriterYieldBlocks
// blocks.
func (x *Index) storeYield(ev *StoreEvent, restored *[]kvbridge.Restored) error {
	x.wmu.Lock()
	err := x.store(ev, restored)
	yield := false
	if x.yieldBlocks > 0 {
		x.sinceYield += len(ev.BlockHashes)
		if x.sinceYield >= x.yieldBlocks {
			x.sinceYield, yield = 0, true
		}
	}
	x.wmu.Unlock()
	if yield {
		x.yield()
	}
	return err
}

// store runs under wmu. Until it takes mu it only reads, which is safe beside readers. When
// restored is not nil it appends the blocks the holder already held under the same hash to it
// (storeRestored); the caller drops them on an error.
func (x *Index) store(ev *StoreEvent, restored *[]kvbridge.Restored) error {
	fail := func(err error, hashes ...uint64) error {
		return &EventError{Op: "store", Engine: ev.Engine, DPRank: ev.DPRank, Hashes: hashes, Err: err}
	}
	if ev.Engine == "" {
		return fail(ErrInvalidEngine)
	}
	if ev.DPRank < 0 {
		return fail(ErrInvalidRank)
	}
	if ev.Tier == 0 || ev.Tier&^allTiers != 0 {
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
	if !hok && !x.canAddHolder() {
		return fail(ErrTooManyHolders, ev.BlockHashes[0])
	}
	parent, parentKey := uint32(0), x.hasher.rootFor(ev.Adapter)
	if ev.HasParent {
		p, ok := uint32(0), false
		if hok {
			p, ok, _ = x.binding(hid, ev.ParentHash)
		}
		if !ok {
			return fail(ErrUnknownParent, ev.ParentHash)
		}
		parent, parentKey = p, x.node(p).key
	}
	x.keyBuf = x.hasher.appendFrom(x.keyBuf[:0], parentKey, ev.TokenIDs)
	// Room for every block's key now, so that the slots resolveChain finds stay valid for the
	// inserts (nodewrite.go). The grown table is built beside readers (only writers change the
	// table, and wmu excludes them), and readers are excluded only to install it.
	if g, ok := x.byKey.grown(nb); ok {
		if x.growHook != nil {
			x.growHook()
		}
		x.mu.Lock()
		x.byKey = g
		x.mu.Unlock()
	}
	if i, ok := x.resolveChain(parent, x.keyBuf); !ok {
		return fail(ErrKeyConflict, ev.BlockHashes[i])
	}
	x.known, x.slotBuf = x.known[:0], x.slotBuf[:0]
	if hok {
		// Room for every block's binding now, so that the insert positions found below stay
		// valid until the bindings are made.
		x.holders[hid].bindings.reserve(nb)
		x.warmSink += x.holders[hid].bindings.touch(ev.BlockHashes)
	}
	for i, n := range x.nodeBuf {
		known, slot := false, -1
		if hok {
			m, ok, at := x.binding(hid, ev.BlockHashes[i])
			if ok && m != n {
				return fail(ErrDuplicateHash, ev.BlockHashes[i])
			}
			known, slot = ok, at
			if ok && restored != nil {
				t := uint8(x.hold(x.realEntry(n, hid, ev.BlockHashes[i])).e)
				*restored = append(*restored, kvbridge.Restored{Block: i, Tiers: t})
			}
		}
		x.slotBuf = append(x.slotBuf, int32(slot))
		if n != 0 && x.node(n).nHold() >= maxHold {
			return fail(ErrTooManyHolders, ev.BlockHashes[i])
		}
		x.known = append(x.known, known)
	}

	// Valid: apply, a chunk at a time, excluding readers only while the chunk changes what they
	// read. Reading each existing block's holding run first brings it into the cache, so that the
	// locked part mostly hits it; the bindings and the LRU list are the writers' alone and are
	// updated after the lock is released.
	x.warm(x.nodeBuf, x.keySlots)
	prev := parent
	for from := 0; from < nb; from += storeChunk {
		to := min(nb, from+storeChunk)
		// The chunk's new blocks are built before the lock: a node no key-table slot names is
		// out of readers' reach, so only publishing it needs them excluded (prebuild).
		built := hok && x.prebuild(ev, hid, from, to, prev)
		x.mu.Lock()
		if !hok {
			hid, hok = x.holderFor(ev.Engine, ev.DPRank), true
		}
		for i := from; i < to; i++ {
			n := x.nodeBuf[i]
			if built && x.built[i-from] {
				x.publish(n, hid, uint8(ev.Tier), int(x.keySlots[i]))
			} else {
				if n == 0 {
					n = x.newNodeAt(x.keyBuf[i], prev, int(x.keySlots[i]))
					x.nodeBuf[i] = n
				}
				x.sumSlot = int(x.keySlots[i])
				x.hintPos = x.storeHolding(n, hid, ev.BlockHashes[i], uint8(ev.Tier), x.known[i])
			}
			x.hintNode = n
			prev = n
		}
		x.hintNode, x.sumSlot = 0, -1
		// Room in the reference bits for the next chunk's new nodes, so that its prebuild need
		// not take the lock to grow them (readers read the slice).
		for len(x.refBits) <= (x.nodes.len()+storeChunk)>>6 {
			x.refBits = append(x.refBits, 0)
		}
		// The chunk's blocks are real now: they leave the holder's records (approx.go) before
		// readers can see them both ways.
		x.supersedeByStore(hid, x.keyBuf[from:to])
		x.mu.Unlock()
		b := &x.holders[hid].bindings
		for i := from; i < to; i++ {
			if !x.known[i] {
				b.insertAt(bindTag(ev.BlockHashes[i]), x.nodeBuf[i], int(x.slotBuf[i]))
			}
			x.touch(x.nodeBuf[i])
		}
	}
	if x.live > x.maxBlocks {
		x.mu.Lock()
		x.evict()
		x.mu.Unlock()
	}
	return nil
}

// prebuild writes, before a Store chunk [from, to) takes the lock, the node and the one holding
// entry (holder hid's, in ev's tier, under the block's hash) of each of the chunk's new blocks,
// and records them in x.nodeBuf and x.built; publish then makes each one visible under the lock.
// Readers cannot reach these nodes until then: they find nodes only through the key table, and
// the node indexes and holding runs come from the free lists (freed under an earlier hold, which
// no reader outlived) or from the slabs' tails. It builds nothing, and reports false, when the
// lock would be needed anyway to grow what readers read: the first page of either slab, which
// grows like a slice, a new slab page, or the reference bits. Called under wmu only.
func (x *Index) prebuild(ev *StoreEvent, hid uint32, from, to int, prev uint32) bool {
	k := 0
	for _, n := range x.nodeBuf[from:to] {
		if n == 0 {
			k++
		}
	}
	needN, needH := max(0, k-len(x.freeNodes)), max(0, k-len(x.hFree[0]))
	if k == 0 || !x.nodes.fits(needN) || !x.holds.fits(needH) || len(x.refBits) <= (x.nodes.len()+needN)>>6 {
		return false
	}
	x.prebuilt++
	x.built = slices.Grow(x.built[:0], to-from)[:to-from]
	t := uint8(ev.Tier)
	for i := from; i < to; i++ {
		n := x.nodeBuf[i]
		x.built[i-from] = n == 0
		if n == 0 {
			n = x.allocNode()
			off := x.allocRun(0)
			*x.node(n) = node{key: x.keyBuf[i], parent: prev, hold: off, meta: flagLive | 1}
			*x.hold(int(off)) = holding{e: mkEntry(hid, t), aux: ev.BlockHashes[i]}
			x.nodeBuf[i] = n
		}
		prev = n
	}
	return true
}

// publish makes node n, built by prebuild with holder hid's entry in tier t, part of the tree
// under the lock: its parent counts it, its key enters the key table at or after slot (where
// resolveChain's probe ended) with the holder's summary bit, and the holder's entry at the parent
// counts it as a child. It does what newNodeAt and storeHolding do for a new block, less the
// writes prebuild made.
func (x *Index) publish(n, hid uint32, t uint8, slot int) {
	nd := x.node(n)
	if nd.parent != 0 {
		x.node(nd.parent).children++
	}
	x.clearRef(n)
	x.byKey.orSumAt(x.byKey.insertFrom(nd.key, n, slot), nd.key, holderBit(hid))
	x.live++
	x.addTiers(&x.holders[hid], 0, t)
	x.linkChild(n, hid)
	x.hintPos = int(nd.hold)
}

// warm reads the holding run of every existing node of ns and the key-table slot of every key
// (slots, where resolveChain's probes ended: the summary to update, or where the new key goes),
// so that applying a Store under the lock finds them in the cache: the loads are independent, so
// their misses overlap.
func (x *Index) warm(ns []uint32, slots []int32) {
	var sink uint32
	for i, n := range ns {
		if n != 0 {
			sink += x.hold(int(x.node(n).hold)).e
		}
		sink += x.byKey.slots[slots[i]].sum
	}
	x.warmSink += sink // keeps the loads from being optimised away
}

// canAddHolder reports whether one more holder fits the 24-bit holder IDs.
func (x *Index) canAddHolder() bool {
	return len(x.freeHolders) > 0 || len(x.holders) < maxHolders
}

// resolveChain fills x.nodeBuf with the existing node of each key (0 for a new one), and
// x.keySlots with the key-table slot where each key's probe ended (nodeTable.lookupSlot), checking
// that each existing node hangs under the previous key's node (parent for the first). It returns
// the index of the first inconsistent key and false when the chain conflicts with the tree or
// repeats a new key.
func (x *Index) resolveChain(parent uint32, keys []uint64) (int, bool) {
	x.nodeBuf = x.nodeBuf[:0]
	// Find every key's node first: the probes are independent, so their cache misses overlap.
	x.warmSink += touchNodeSlots(&x.byKey, keys)
	x.keySlots = x.keySlots[:0]
	for _, k := range keys {
		n, i := x.byKey.lookupSlot(k)
		x.nodeBuf = append(x.nodeBuf, n)
		x.keySlots = append(x.keySlots, int32(i))
	}
	x.seen.clearFor(len(keys))
	prev := parent
	for i, n := range x.nodeBuf {
		if n != 0 {
			if (i > 0 && prev == 0) || x.node(n).parent != prev {
				return i, false
			}
		} else if !x.seen.add(keys[i]) {
			return i, false
		}
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
		if !x.seen.add(v) {
			return v, true
		}
	}
	return 0, false
}

// storeHolding records holder hid's hash at node n in tier t (validated by the caller); known
// reports whether the holder already binds hash (to n). The caller binds hash to n when it was
// not known. It returns the slab position of the holder's first entry at n.
func (x *Index) storeHolding(n, hid uint32, hash uint64, t uint8, known bool) int {
	h := &x.holders[hid]
	lo, hi := x.findHolder(n, hid)
	if known {
		for p := lo; p < hi; p++ {
			if x.hold(p).aux == hash {
				x.addTiers(h, uint8(x.hold(p).e), t)
				x.hold(p).e |= uint32(t)
				return lo
			}
		}
	}
	old := x.node(n).hold
	x.insertHolding(n, hi, hid, t, hash)
	x.addTiers(h, 0, t)
	return lo + int(x.node(n).hold) - int(old) // the run may have moved
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
// tiers (vLLM/SGLang BlockRemoved). tiers 0 (or all four Tier bits) removes every tier, as an event without a
// medium does (docs/design.md §11). A block left with no tier for any alias is dropped for
// that holder; a block no holder keeps and with no children leaves the tree, and so does each
// ancestor that is left empty. A hash named twice is removed once.
//
// Removing a block the holder still holds blocks below (a hole in its prefix) also records the
// block as holey, which costs every later Match of a prompt through it a few table probes until
// the block has no children left (match.go); engines evict their deepest blocks first, so this
// is rare.
//
// Errors (an *EventError; the index is unchanged): ErrInvalidEngine (engine is empty),
// ErrInvalidRank, ErrInvalidTier, ErrUnknownEngine (the (engine, rank) holds nothing and never did, or was removed), ErrUnknownHash (listing every
// hash the holder does not hold; this includes blocks the index evicted under MaxBlocks).
func (x *Index) Remove(engine state.EngineID, rank int, hashes []uint64, tiers Tier) error {
	x.wmu.Lock()
	defer x.wmu.Unlock()
	fail := func(err error, hs ...uint64) error {
		return &EventError{Op: "remove", Engine: engine, DPRank: rank, Hashes: hs, Err: err}
	}
	if engine == "" {
		return fail(ErrInvalidEngine)
	}
	if rank < 0 {
		return fail(ErrInvalidRank)
	}
	if tiers&^allTiers != 0 {
		return fail(ErrInvalidTier)
	}
	if tiers == 0 {
		tiers = allTiers
	}
	hid, ok := x.lookupHolder(engine, rank)
	if !ok {
		return fail(ErrUnknownEngine)
	}
	h := &x.holders[hid]
	var unknown []uint64
	x.nodeBuf = x.nodeBuf[:0]
	for _, hash := range hashes {
		n, ok, _ := x.binding(hid, hash)
		if !ok {
			unknown = append(unknown, hash)
		}
		x.nodeBuf = append(x.nodeBuf, n)
	}
	if len(unknown) > 0 {
		return fail(ErrUnknownHash, unknown...)
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	x.deferHoles = true
	defer x.settleHoles()
	x.deferSums = true // nodes freed here are not reused before Remove returns
	defer x.settleSums()
	for i, hash := range hashes {
		// A hash named twice finds its entry gone (or its node freed: no entries) the second
		// time; nodes freed here are not reused before Remove returns.
		n := x.nodeBuf[i]
		lo, hi := x.findHolder(n, hid)
		for p := lo; p < hi; p++ {
			if x.hold(p).aux != hash {
				continue
			}
			drop := uint8(x.hold(p).e) & uint8(tiers)
			x.subTiers(h, drop)
			x.hold(p).e &^= uint32(drop)
			if uint8(x.hold(p).e) == 0 {
				x.deleteHolding(n, p)
				h.bindings.remove(bindTag(hash), n)
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
// ErrInvalidEngine (engine is empty), ErrInvalidRank, ErrUnknownEngine. Cost: O(blocks the holder held + approximate entries in the index),
// in chunks that let readers in between; Match leaves the rank out from the first chunk on, so it
// never sees the rank partly cleared, and a lookup waits for at most one chunk
// (docs/performance.md, "Clearing an engine beside readers"). Other writers wait for the whole
// clear.
func (x *Index) Clear(engine state.EngineID, rank int) error {
	if engine == "" {
		return &EventError{Op: "clear", Engine: engine, DPRank: rank, Err: ErrInvalidEngine}
	}
	if rank < 0 {
		return &EventError{Op: "clear", Engine: engine, DPRank: rank, Err: ErrInvalidRank}
	}
	x.wmu.Lock()
	defer x.wmu.Unlock()
	hid, ok := x.lookupHolder(engine, rank)
	if !ok {
		return &EventError{Op: "clear", Engine: engine, DPRank: rank, Err: ErrUnknownEngine}
	}
	x.clearHolders([]uint32{hid}, nil)
	return nil
}

// RemoveEngine forgets engine entirely: every DP rank, every block, real and approximate. Call it
// when the engine leaves the registry. Errors (an *EventError; the index is unchanged):
// ErrInvalidEngine when engine is empty, ErrUnknownEngine when the engine is not in the index.
// Cost as Clear, for every rank.
func (x *Index) RemoveEngine(engine state.EngineID) error {
	if engine == "" {
		return &EventError{Op: "remove engine", Engine: engine, Err: ErrInvalidEngine}
	}
	x.wmu.Lock()
	defer x.wmu.Unlock()
	e, ok := x.engineByID[engine]
	if !ok {
		return &EventError{Op: "remove engine", Engine: engine, Err: ErrUnknownEngine}
	}
	x.clearBuf = x.clearBuf[:0]
	for _, rh := range x.engines[e].ranks {
		x.clearBuf = append(x.clearBuf, rh.holder)
	}
	x.clearHolders(x.clearBuf, func() {
		for _, rh := range x.engines[e].ranks {
			x.holders[rh.holder] = holder{}
			x.freeHolders = append(x.freeHolders, rh.holder)
		}
		pos := x.engines[e].order
		x.byID = slices.Delete(x.byID, int(pos), int(pos)+1)
		x.renumber(int(pos))
		x.engines[e] = engineSlot{}
		x.freeEngines = append(x.freeEngines, e)
		delete(x.engineByID, engine)
	})
	return nil
}

// clearChunk is the work clearHolders does per hold of the read-excluding lock: entries dropped
// plus nodes freed, about a millisecond of work (docs/performance.md, "Clearing an engine beside
// readers").
const clearChunk = 1024

// clearHolders drops every entry, real and approximate, of the holders hids, and then runs done
// (if not nil) under the read-excluding lock. Called under wmu, without mu. The holders are hidden
// from Match first (holder.hidden), so readers see them either whole or not at all; the entries
// then go a chunk at a time (clearChunk), releasing the lock between chunks. No hole can result
// (every block a holder held goes), so it skips the hole bookkeeping for the holders.
func (x *Index) clearHolders(hids []uint32, done func()) {
	x.mu.Lock()
	for _, hid := range hids {
		x.holders[hid].hidden = true
		x.hiddenHolders++
		x.clearPlacements(hid)
	}
	x.mu.Unlock()
	for _, hid := range hids {
		slots := x.holders[hid].bindings.slots
		next := 0 // the next binding slot clearWarm reads
		for next < len(slots) || x.clearAt < len(x.clearNodes) || x.pruneFrom != 0 {
			if x.clearAt == len(x.clearNodes) {
				next = x.clearWarm(hid, slots, next)
			}
			x.mu.Lock()
			x.clearing, x.deferSums = true, true
			work := 0
			for work < x.clearChunk && (x.pruneFrom != 0 || x.clearAt < len(x.clearNodes)) {
				if x.pruneFrom != 0 {
					// A cascade cut short: its nodes must go before the next entry does, which
					// might free its ancestors.
					work += x.pruneUpTo(x.clearChunk - work)
					continue
				}
				c := x.clearNodes[x.clearAt]
				x.clearAt++
				lo, hi := x.findHolder(c.n, hid)
				for p := lo; p < hi; p++ {
					if bindTag(x.hold(p).aux) == c.tag {
						x.deleteHolding(c.n, p)
						x.pruneFrom = c.n
						break
					}
				}
				work++
			}
			x.settleSums()
			x.clearing = false
			x.mu.Unlock()
			if x.clearHook != nil {
				x.clearHook(work)
			}
		}
	}
	x.mu.Lock()
	for _, hid := range hids {
		h := &x.holders[hid]
		h.bindings.reset()
		h.tiers = [4]int{}
		h.hidden = false
		x.hiddenHolders--
	}
	if done != nil {
		done()
	}
	x.mu.Unlock()
}

// pruneUpTo frees x.pruneFrom and its ancestors as prune does, but at most budget of them,
// leaving in x.pruneFrom the node to go on from (0 when the cascade ended), and returns how many
// it freed. Dropping a holder's entries in the order of
// its bindings frees most nodes late, in cascades: a block's node goes only with the last of its
// descendants, and on the production-scale workload the last 2 % of one engine's entries freed
// over 200,000 nodes. Between chunks a node of the cascade may be left with neither entries nor
// children, still in the key table, and the node where the cut fell may keep its holder summary
// (deleteHolding leaves a node it empties to prune): readers can reach it, and what keeps Match
// right is that the summary names only holders being cleared, which Match leaves out
// (holder.hidden). Nothing else changes before the cascade resumes (wmu).
func (x *Index) pruneUpTo(budget int) int {
	freed := 0
	n := x.pruneFrom
	for n != 0 && freed < budget {
		nd := x.node(n)
		if nd.nHold() > 0 || nd.children > 0 {
			if nd.children == 0 && !x.inLRU(n) {
				x.lruPushHead(n)
			}
			n = 0
			break
		}
		p := nd.parent
		x.freeNode(n)
		freed++
		n = p
	}
	x.pruneFrom = n
	return freed
}

// clearWarm collects into x.clearNodes the bindings of holder hid from binding slot from on, up to
// clearChunk of them, and returns the slot after the last one. It reads, beside the readers, each
// one's node, holding run and key-table slot, so that dropping them under the lock mostly hits the
// cache: the loads of different bindings are independent, so their misses overlap.
func (x *Index) clearWarm(hid uint32, slots []uint64, from int) int {
	x.clearNodes, x.clearAt = x.clearNodes[:0], 0
	var sink uint32
	i := from
	for ; i < len(slots) && len(x.clearNodes) < x.clearChunk; i++ {
		s := slots[i]
		if s == 0 {
			continue
		}
		n := uint32(s)
		x.clearNodes = append(x.clearNodes, clearNode{n: n, tag: uint32(s >> 32)})
		nd := x.node(n)
		sink += x.hold(int(nd.hold)).e + x.byKey.slots[x.byKey.home(nd.key)].sum
	}
	x.warmSink += sink
	return i
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

// holderFor returns the holder ID of (engine, rank), creating the engine and holder if needed
// (the caller checked canAddHolder). Called under mu.
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
	x.holders[hid] = holder{engine: e, rank: rank, live: true, bindings: bindTable{floor: x.holderBits}}
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

// newNodeAt creates the node for key under parent, inserting key into the key table from slot
// from (nodeTable.insertFrom; -1 probes from its home slot). The caller touches it (LRU).
func (x *Index) newNodeAt(key uint64, parent uint32, from int) uint32 {
	n := x.allocNode()
	if int(n>>6) >= len(x.refBits) {
		x.refBits = append(x.refBits, 0)
	}
	if parent != 0 {
		x.node(parent).children++
	}
	*x.node(n) = node{key: key, parent: parent, meta: flagLive}
	x.clearRef(n)
	x.byKey.insertFrom(key, n, from)
	x.live++
	return n
}

// allocNode returns a node index for a new node: the last one freed, else the next of the slab.
func (x *Index) allocNode() uint32 {
	if k := len(x.freeNodes); k > 0 {
		n := x.freeNodes[k-1]
		x.freeNodes = x.freeNodes[:k-1]
		return n
	}
	return uint32(x.nodes.extend(1))
}

// freeNode removes an empty, childless node from the tree.
func (x *Index) freeNode(n uint32) {
	nd := x.node(n)
	if x.inLRU(n) {
		x.lruUnlink(n)
	}
	x.byKey.remove(nd.key, n)
	if p := nd.parent; p != 0 {
		pn := x.node(p)
		pn.children--
		if pn.children == 0 && pn.holey() {
			x.unmarkHoley(p)
		}
	}
	*nd = node{}
	x.live--
	x.freeNodes = append(x.freeNodes, n)
}

// prune frees n and then each ancestor while they hold nothing and have no children, and makes
// sure the surviving ancestor is an eviction candidate if it became a leaf.
func (x *Index) prune(n uint32) {
	for n != 0 {
		nd := x.node(n)
		if nd.nHold() > 0 || nd.children > 0 {
			if nd.children == 0 && !x.inLRU(n) {
				x.lruPushHead(n)
			}
			return
		}
		p := nd.parent
		x.freeNode(n)
		n = p
	}
}

// touch marks n as just used.
func (x *Index) touch(n uint32) {
	if x.lruTail == n {
		return
	}
	if x.inLRU(n) {
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

// markRef records that a Match found n as some engine's deepest block. Called under the read
// lock, concurrently.
func (x *Index) markRef(n uint32) {
	w := &x.refBits[n>>6]
	if atomic.LoadUint64(w)&(1<<(n&63)) == 0 {
		atomic.OrUint64(w, 1<<(n&63))
	}
}

// evict removes least recently used leaves until the index fits MaxBlocks. Interior nodes met at
// the head leave the list (they rejoin it at the head when their last child goes); a leaf with
// its reference bit set gets a second chance at the tail.
func (x *Index) evict() {
	warmed := 0 // LRU-head nodes left that warmEviction has read ahead for
	for x.live > x.maxBlocks {
		n := x.lruHead
		if n == 0 {
			return
		}
		if warmed == 0 {
			warmed = x.warmEviction(min(x.live-x.maxBlocks, evictWarmBatch))
		}
		warmed--
		nd := x.node(n)
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

// evictWarmBatch is how many eviction candidates warmEviction reads ahead at a time.
const evictWarmBatch = 256

// warmEviction reads, for the next k nodes evict will meet (the leaves at the head of the LRU
// list, each followed by the ancestors that its eviction leaves childless), the key-table home
// slot of each node's key and the binding-table home slot of each of its entries' engine hashes,
// which evictNode is about to probe: the loads are independent, so their cache misses overlap,
// where evicting one leaf after another would wait for two misses at a time. It returns how many
// nodes it walked.
func (x *Index) warmEviction(k int) int {
	var sink uint64
	walked := 0
	for n := x.lruHead; n != 0 && walked < k; n = x.node(n).next {
		if x.node(n).children > 0 {
			walked++ // an interior node leaves the list
			continue
		}
		// Evicting leaf m makes its parent a leaf when m was its only child, and pushes it to
		// the head of the list: it goes next. A chain goes from its leaf up.
		for m := n; m != 0 && walked < k; {
			walked++
			nd := x.node(m)
			sink += uint64(x.byKey.slots[x.byKey.home(nd.key)].node)
			for _, h := range x.holds.span(int(nd.hold), nd.nHold()) {
				if b := &x.holders[entryHolder(h.e)].bindings; len(b.slots) > 0 {
					sink += b.slots[b.home(bindTag(h.aux))]
				}
			}
			if m = nd.parent; m != 0 && x.node(m).children != 1 {
				break
			}
		}
	}
	x.warmSink += uint32(sink)
	return max(walked, 1)
}

// evictNode drops every entry of leaf n, for every holder, and prunes upwards.
func (x *Index) evictNode(n uint32) {
	nd := x.node(n)
	last := ^uint32(0)
	for p := int(nd.hold) + nd.nHold() - 1; p >= int(nd.hold); p-- {
		hid := entryHolder(x.hold(p).e)
		h := &x.holders[hid]
		x.subTiers(h, uint8(x.hold(p).e))
		h.bindings.remove(bindTag(x.hold(p).aux), n)
		if hid != last {
			x.unlinkChild(n, hid) // a leaf: no hole can result
			last = hid
		}
	}
	x.freeRun(nd.hold, nd.class())
	nd.meta &^= nHoldMask | classMask
	x.evicted++
	x.prune(n)
}

// ---- the LRU list ----

// inLRU reports whether n is in the LRU list: the head, or any node with a predecessor.
func (x *Index) inLRU(n uint32) bool { return x.lruHead == n || x.node(n).prev != 0 }

func (x *Index) lruUnlink(n uint32) {
	nd := x.node(n)
	if nd.prev != 0 {
		x.node(nd.prev).next = nd.next
	} else {
		x.lruHead = nd.next
	}
	if nd.next != 0 {
		x.node(nd.next).prev = nd.prev
	} else {
		x.lruTail = nd.prev
	}
	nd.prev, nd.next = 0, 0
}

func (x *Index) lruPushTail(n uint32) {
	nd := x.node(n)
	nd.prev, nd.next = x.lruTail, 0
	if x.lruTail != 0 {
		x.node(x.lruTail).next = n
	} else {
		x.lruHead = n
	}
	x.lruTail = n
}

// lruPushHead links n as the next eviction candidate: a node that just became a leaf again was
// pushed out of the list at its head, so it is among the oldest.
func (x *Index) lruPushHead(n uint32) {
	nd := x.node(n)
	nd.prev, nd.next = 0, x.lruHead
	if x.lruHead != 0 {
		x.node(x.lruHead).prev = n
	} else {
		x.lruTail = n
	}
	x.lruHead = n
}

// grow returns s extended by n zero elements, growing its capacity as append does.
// node returns node n's address, stable while the index lives.
func (x *Index) node(n uint32) *node { return x.nodes.at(int(n)) }

// hold returns the holding entry at slab position p.
func (x *Index) hold(p int) *holding { return x.holds.at(p) }

// ---- holding runs ----

// findHolder returns the slab range of holder hid's entries at node n.
func (x *Index) findHolder(n, hid uint32) (int, int) {
	nd := x.node(n)
	lo, hi := int(nd.hold), int(nd.hold)+nd.nHold()
	// Binary search for the first entry >= hid.
	for lo < hi {
		mid := int(uint(lo+hi) >> 1)
		if entryHolder(x.hold(mid).e) < hid {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	end := lo
	last := int(nd.hold) + nd.nHold()
	for end < last && entryHolder(x.hold(end).e) == hid {
		end++
	}
	return lo, end
}

// insertHolding inserts holder hid's entry at slab position pos of node n's run, growing the run
// if full. pos is the end of hid's entries there; when it has none, the holder now holds n.
func (x *Index) insertHolding(n uint32, pos int, hid uint32, t uint8, aux uint64) {
	nd := x.node(n)
	k := nd.nHold()
	first := pos == int(nd.hold) || entryHolder(x.hold(pos-1).e) != hid
	if k == 0 {
		nd.hold = x.allocRun(0)
		nd.meta &^= classMask
		pos = int(nd.hold)
	} else if k == 1<<nd.class() {
		c := nd.class() + 1
		off := x.allocRun(c)
		nd = x.node(n)
		rel := pos - int(nd.hold)
		x.moveRun(nd.hold, off, k)
		x.freeRun(nd.hold, nd.class())
		nd.hold = off
		nd.meta = nd.meta&^classMask | c<<classShift
		pos = int(off) + rel
	}
	r, o := x.holds.span(int(nd.hold), 1<<nd.class()), pos-int(nd.hold)
	copy(r[o+1:k+1], r[o:k])
	*x.hold(pos) = holding{e: mkEntry(hid, t), aux: aux}
	nd.meta++
	x.byKey.orSumAt(x.sumSlot, nd.key, holderBit(hid))
	if first {
		x.linkChild(n, hid)
	}
}

// deleteHolding removes the entry at slab position pos of node n's run, shrinking the run when it
// is a quarter full. When it was the holder's last entry there, the holder no longer holds n.
func (x *Index) deleteHolding(n uint32, pos int) {
	nd := x.node(n)
	hid := entryHolder(x.hold(pos).e)
	k := nd.nHold()
	end := int(nd.hold) + k
	groupStart := pos == int(nd.hold) || entryHolder(x.hold(pos-1).e) != hid
	groupEnds := pos+1 == end || entryHolder(x.hold(pos+1).e) != hid
	kids := x.hold(pos).kids
	if groupStart && groupEnds && kids > 0 && !nd.holey() && !x.clearing {
		// The holder keeps blocks below one it no longer holds.
		if x.deferHoles {
			x.pending = append(x.pending, pendingHole{n, hid, kids})
		} else {
			x.markHoley(n)
		}
	}
	r, o := x.holds.span(int(nd.hold), k), pos-int(nd.hold)
	copy(r[o:k-1], r[o+1:k])
	if groupStart && !groupEnds {
		x.hold(pos).kids = kids // the holder's next entry there carries its child count now
	}
	nd.meta--
	k--
	c := nd.class()
	switch {
	case k == 0:
		x.freeRun(nd.hold, c)
		nd.meta &^= classMask
	case c >= 2 && k <= 1<<(c-2):
		off := x.allocRun(c - 1)
		nd = x.node(n)
		x.moveRun(nd.hold, off, k)
		x.freeRun(nd.hold, c)
		nd.hold = off
		nd.meta = nd.meta&^classMask | (c-1)<<classShift
	}
	if k > 0 || nd.children > 0 {
		if x.deferSums {
			x.sumPending = append(x.sumPending, n)
		} else {
			x.summarize(n)
		}
	} // else every caller prunes n next, which frees it and its key-table slot
	if groupStart && groupEnds {
		x.unlinkChild(n, hid)
	}
}

// settleSums recomputes the holder summaries deleteHolding deferred, of the nodes still in the
// tree: a Remove of a chain root first, or a Clear, frees most of the nodes it empties before it
// ends, and their summaries were a key-table probe each for nothing (BenchmarkEvents/store+remove).
// Called under mu before it is released, so readers never see a stale summary.
func (x *Index) settleSums() {
	for _, n := range x.sumPending {
		if x.node(n).has(flagLive) {
			x.summarize(n)
		}
	}
	x.sumPending = x.sumPending[:0]
	x.deferSums = false
}

// summarize recomputes node n's holder summary in the key table (nodeTable, holderBit) from its
// holding run.
func (x *Index) summarize(n uint32) {
	nd := x.node(n)
	sum := uint32(0)
	if k := nd.nHold(); k > 0 {
		for _, h := range x.holds.span(int(nd.hold), k) {
			sum |= holderBit(entryHolder(h.e))
		}
	}
	x.byKey.setSum(nd.key, sum)
}

func (x *Index) allocRun(c uint32) uint32 {
	if k := len(x.hFree[c]); k > 0 {
		off := x.hFree[c][k-1]
		x.hFree[c] = x.hFree[c][:k-1]
		return off
	}
	// A fresh run starts at a multiple of its size (or of a page), so it lies in one page of the
	// slab; the entries skipped to get there become free runs of smaller classes.
	x.holds.alignFor(1<<c, func(off int, class uint32) { x.freeRun(uint32(off), class) })
	return uint32(x.holds.extend(1 << c))
}

func (x *Index) freeRun(off, c uint32) { x.hFree[c] = append(x.hFree[c], off) }

func (x *Index) moveRun(from, to uint32, k int) {
	copy(x.holds.span(int(to), k), x.holds.span(int(from), k))
}

// ---- holes ----
//
// A Match finds a holder's deepest block by probing a few depths (match.go), which is exact only
// if, along the prompt, the holder's entries form a prefix: held at depth d+1 implies held at
// depth d. The tree holds real entries only (approximate ones are records beside it, approx.go,
// which Match folds in afterwards), so that fails only at a hole: h holds block c but not its
// parent p. The index keeps every such p in the holey set (Index.holey, flagHoley), and Match caps
// each holder's search at the first holey block of the prompt where the holder has no entry. To
// mark without scanning children, each holder's first entry at a node counts the node's children
// the holder holds (holding.kids); the count is kept exactly while the node is not holey, and reset
// when a holey node's last child goes, which is also when it leaves the set. Holes do not arise
// from events applied in order by engines that evict their deepest blocks first: a real event
// attaches under a block its holder holds. They arise from removing a block the holder still
// holds children of, or from an event re-establishing a hole's parent. The set shrinks as its
// blocks lose their children.

// linkChild records that holder hid now holds c (its first entry there).
func (x *Index) linkChild(c, hid uint32) {
	p := x.node(c).parent
	if p == 0 || x.node(p).holey() {
		return
	}
	var lo, hi int
	if x.hintNode == p && entryHolder(x.hold(x.hintPos).e) == hid {
		lo, hi = x.hintPos, x.hintPos+1 // Store just placed the parent's entry
	} else {
		lo, hi = x.findHolder(p, hid)
	}
	if lo == hi {
		x.markHoley(p) // a hole
		return
	}
	x.hold(lo).kids++
}

// unlinkChild records that holder hid no longer holds c.
func (x *Index) unlinkChild(c, hid uint32) {
	p := x.node(c).parent
	if p == 0 || x.node(p).holey() {
		return
	}
	if lo, hi := x.findHolder(p, hid); lo < hi {
		if x.hold(lo).kids > 0 {
			x.hold(lo).kids--
		}
		return
	}
	for i := len(x.pending) - 1; i >= 0; i-- { // most recent first: a chain removed root first
		if ph := &x.pending[i]; ph.n == p && ph.hid == hid && ph.kids > 0 {
			ph.kids--
			return
		}
	}
}

// settleHoles marks the blocks a Remove left holders holding children of.
func (x *Index) settleHoles() {
	for _, ph := range x.pending {
		if ph.kids > 0 && x.node(ph.n).has(flagLive) {
			x.markHoley(ph.n)
		}
	}
	x.pending = x.pending[:0]
	x.deferHoles = false
}

func (x *Index) markHoley(n uint32) {
	nd := x.node(n)
	if nd.holey() {
		return
	}
	nd.meta |= flagHoley
	x.holey.put(nd.key, n)
}

// unmarkHoley takes childless node n out of the holey set; its holders hold no children.
func (x *Index) unmarkHoley(n uint32) {
	nd := x.node(n)
	nd.meta &^= flagHoley
	x.holey.del(nd.key)
	for p := int(nd.hold); p < int(nd.hold)+nd.nHold(); p++ {
		x.hold(p).kids = 0
	}
}
