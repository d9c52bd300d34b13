// Package kvindex is enginepick's KV-cache prefix index: it hashes token IDs into chained 64-bit
// block keys (Hasher), keeps a radix tree of which engines hold which blocks, per DP rank and
// storage tier (Index), applies KV events (Store, Remove, Clear) and engine removal, bounds its
// memory with LRU eviction of leaves, records approximate, router-predicted placements with a TTL
// for engines that publish no events (Assume), and answers prefix lookups through the Source
// interface, from this process's Index (LocalSource) or a remote indexer (RemoteSource), looked
// up at most once per request (Memo) (docs/design.md §10 and §11).
//
// It is not a KV cache: it records ownership, never tensors. It does not subscribe to publishers
// or decode engine event wire formats (vLLM's and SGLang's msgpack KV events over ZMQ): package
// kvindex/kvevents does, mapping each engine's medium string to a Tier and feeding the decoded
// events through Store, Remove and Clear, and marking an engine untrusted (MarkUntrusted) while
// its event stream is out of step (docs/design.md §13.1).
// It never reproduces an engine's own block hashes, which it keeps only as opaque IDs for parent
// links and removals; and it does not choose engines: the cache-aware policy reads per-engine
// match depths from a Source and decides. Its memory bound is a block cap, not a byte budget.
//
// # Keys and blocks
//
// A block is BlockTokens consecutive tokens of a prompt; only full blocks have keys. Key i depends
// on key i−1 and block i's tokens (hash.go states the exact function), so equal keys mean equal
// prefixes and the tree needs one node per key with a parent link: Match walks a query's keys
// through a key → node table. Counts returned by Match and Source are in blocks; multiply by
// Result.BlockTokens for tokens.
//
// # Concurrency: one RWMutex
//
// The Index is guarded by a single sync.RWMutex. Match takes the read lock, so any number of
// matches run in parallel; its only shared write is the CLOCK reference bit of each matched
// block, an atomic OR skipped when the bit is already set, so matches of a hot prefix do not
// bounce cache lines. Every write (one event, Assume, Expire) takes the write lock for its own
// duration, so a match waits for at most one event's application, and one caller per engine
// applying that engine's events in order gets per-engine ordering.
//
// The alternatives lose here. Sharding by a chain's first block (SGLang's experimental tree
// uses 32 shards, sgl-project/sglang `experimental/sgl-router/src/state/kv_events/tree.rs`) helps
// only if prompts start differently, and on the Mooncake conversation trace every request starts
// with the same block (docs/traces.md). Sharding by engine cannot serve a Match, which reads every
// engine. Copy-on-write would copy the whole table (tens of megabytes at a million blocks) per
// event, and a persistent tree would add pointer chasing to every step of every Match. Writes are
// not the bottleneck: one core applies millions of block events per second, orders of magnitude
// above what a fleet publishes. docs/performance.md has the measurements behind these claims
// (hashing, matching, parallel matching with and without a writer, event rates, memory per block)
// and the commands that reproduce them.
package kvindex
