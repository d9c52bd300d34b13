// Package kvindex is enginepick's KV-cache prefix index: which engines hold which prefix blocks.
//
// Start with NewHasher (the engines' block size in tokens), NewIndex and NewLocalSource, and give
// the source to policy.NewCacheAware; feed the index with package kvindex/kvevents, which
// subscribes to the engines' KV events. Size Options.MaxBlocks to the fleet ("Sizing MaxBlocks",
// below). A host with a shared prefix indexer uses NewRemoteSource instead.
//
// The index hashes token IDs into chained 64-bit block keys (Hasher), keeps a radix tree of which
// engines hold which blocks, per DP rank and storage tier (Index), applies KV events (Store,
// Remove, Clear) and engine removal, bounds its memory with LRU eviction of leaves, records
// approximate, router-predicted placements with a TTL for engines that publish no events
// (LocalSource.Place), and answers prefix lookups through the Source interface, from this process's Index
// (LocalSource) or a remote indexer (RemoteSource), looked up at most once per request (Memo)
// (docs/design.md §10 and §11).
//
// It is not a KV cache: it records ownership, never tensors. It does not subscribe to publishers
// or decode engine event wire formats (vLLM's and SGLang's msgpack KV events over ZMQ): package
// kvindex/kvevents does, mapping each engine's medium string to a Tier and feeding the decoded
// events through Store, Remove and Clear, and marking an engine untrusted (Stats.Untrusted) while
// its event stream is out of step (docs/design.md §13.1).
// It never reproduces an engine's own block hashes, which it keeps only as opaque IDs for parent
// links and removals; and it does not choose engines: the cache-aware policy reads per-engine
// match depths from a Source and decides. Its memory bound is a block cap, not a byte budget.
//
// # Sizing MaxBlocks
//
// Options.MaxBlocks (kv.max_blocks in a configuration) should cover the distinct blocks the fleet
// holds: at most the sum over engines of KV capacity in tokens ÷ BlockTokens, over every tier the
// engines report (device, and host or disk when they offload), less what engines share. The index
// takes about 66 bytes per block plus 35 per (block, engine) pair (the fit of BenchmarkMemory,
// docs/performance.md). For example, 16 engines of 2,000,000 KV tokens with 16-token blocks hold
// at most 2,000,000 blocks and pairs, 202 MB, which the default of 4,194,304 blocks covers
// twice; with host offload of 4 times the device capacity, set 10,485,760: about 1 GB at worst.
//
// To allocate up front, set Options.ExpectedBlocks (kv.expected_blocks) to the blocks the full
// fleet holds and Options.ExpectedHolderBlocks (kv.expected_holder_blocks) to one holder's KV
// capacity in blocks (one DP rank's, with DP ranks): 2,000,000 expected blocks take a 64 MiB key
// table, 125,000 expected holder blocks a 2 MiB table per holder. Too high costs the difference
// for good; too low, the tables grow.
//
// On Linux the index asks the kernel to back its arrays of 4 MiB or more with transparent huge
// pages (MADV_HUGEPAGE), whose first touch costs less per byte than 4 KiB pages'. Under the
// madvise policy, resident memory may then exceed the heap by partly used 2 MiB regions;
// GODEBUG=disablethp=1 turns the advice off.
//
// # Keys and blocks
//
// A block is BlockTokens consecutive tokens of a prompt; only full blocks have keys. Key i depends
// on key i−1 and block i's tokens (hash.go states the exact function), so equal keys mean equal
// prefixes and the tree needs one node per key with a parent link, found through a key → node
// table. Counts returned by Match and Source are in blocks; multiply by Result.BlockTokens for
// tokens.
//
// # Matching without a walk
//
// A query's chained keys name every prefix of it, and a holder's entries along a prompt form a
// prefix (held at depth d+1 implies held at depth d) except at blocks the index records as holey
// (index.go, "holes": a holder dropped a block it still holds children of). So Match does not
// walk the prompt block by block: it
// probes a few depths in rounds (an 8-ary, then 4-ary, search per group of holders still at the
// same interval), issuing every probe of a round before using any so that their cache misses
// overlap, and caps each holder at the first holey block of the prompt it is not live at: a
// 512-block lookup takes a few dozen probes instead of up to 512, and finding its holders costs
// less than hashing the prompt. Approximate entries (placements) are not in the tree: they are records
// beside it, one per placement, found by their first key, and Match extends each holder's depth through
// the record that starts where its real blocks end (approx.go).
//
// # Concurrency
//
// Readers share a sync.RWMutex's read lock, so any number of matches run in parallel; their only
// shared write is the CLOCK reference bit of the deepest block each found, an atomic OR skipped
// when the bit is already set. Writers are serialised by a separate mutex, which gives one caller
// per engine, applying that engine's events in order, per-engine ordering. A Store hashes its
// tokens, resolves its chain and validates the whole event holding only the writer mutex, since
// readers do not change what it reads; it builds the nodes and holding entries of the event's new
// blocks before taking the read-excluding lock too, since no reader can reach a node the key table
// does not name yet (Index.prebuild); it takes the lock only to publish and apply the event, at
// most storeChunk blocks at a time, and updates what readers never read (the engine-hash bindings,
// the LRU links) after releasing it. A match therefore waits for at most one chunk's
// application, and sees an event's blocks in prompt order. Clear and RemoveEngine hide the
// holders they clear from Match at once and then drop their entries in chunks of clearChunk, with
// readers let in between (Index.clearHolders). Other writes (Remove, placements) hold the lock
// for their own duration.
//
// The alternatives lose here. Sharding by a chain's first block (SGLang's experimental tree
// uses 32 shards, sgl-project/sglang `experimental/sgl-router/src/state/kv_events/tree.rs`) helps
// only if prompts start differently, and on the Mooncake conversation trace every request starts
// with the same block (docs/traces.md). Sharding by engine cannot serve a Match, which reads every
// engine. Copy-on-write would copy the whole table (tens of megabytes at a million blocks) per
// event, and a persistent tree would add pointer chasing to every probe. docs/performance.md
// ("kvindex at production scale") has the costs (hashing, lookup, the complete cache-aware
// decision, ingest, memory per (block, engine), lookups beside a writer) and the commands that
// measure them.
package kvindex
