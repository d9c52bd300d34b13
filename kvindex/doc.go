// Package kvindex is enginepick's KV-cache prefix index: it hashes token IDs into chained 64-bit
// block keys (Hasher), keeps a radix tree of which engines hold which blocks, per DP rank and
// storage tier (Index), applies KV events (Store, Remove, Clear) and engine removal, bounds its
// memory with LRU eviction of leaves, records approximate, router-predicted placements with a TTL
// for engines that publish no events (Assume), and answers prefix lookups through the Source
// interface, from this process's Index (LocalSource) or a remote indexer (RemoteSource), looked
// up at most once per request (Memo) (ARCHITECTURE.md §2, kvindex; seeds/POLICY_DESIGN.md,
// "Cache state").
//
// It is not a KV cache: it records ownership, never tensors. It does not decode engine event wire
// formats or subscribe to publishers (package kvindex/kvevents does, and maps an engine's medium
// string to a Tier); it never reproduces an engine's own block hashes, which it keeps only as
// opaque IDs for parent links and removals; and it does not choose engines: the cache-aware
// policy reads per-engine match depths from a Source and decides. Its memory bound is a block
// cap, not a byte budget.
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
// uses 32 shards; research/sgl-router.md §2.4) helps only if prompts start differently, and on
// the Mooncake conversation trace every request starts with the same block
// (research/dynamo-traces-events.md §2.1: "prefix-depth-1 sharding puts all of this trace on one
// shard"). Sharding by engine cannot serve a Match, which reads every engine. Copy-on-write would
// copy about 86 MB per event at a million blocks, and a persistent tree would add pointer chasing
// to every step of every Match. Writes are not the bottleneck: one core applies about 10 M block
// events per second (below), orders of magnitude above what a fleet publishes.
//
// Figures (go test -bench 'Match512|MatchParallel' on the 2-core development machine, shared
// with other work, best of five; the 64-engine × 10,000-block tree of bench_test.go, 512-block
// query held completely by one engine):
//
//	Match, one goroutine                        8.4 µs/op, 0 allocs
//	Match, two goroutines (RunParallel)         4.9 µs/op (1.7× the throughput)
//	Match, two goroutines, a writer storing     7.9 µs/op while the writer applied
//	  and removing 32-block events alongside     1.6 M blocks/s
//	Match, two goroutines, sync.Mutex instead   8.9 µs/op (no read parallelism: 1.8× worse)
//
// # Performance
//
// The targets came from a reference Go index (328 µs to hash 8,192 tokens, ~990 µs for a
// 512-block lookup, 0.78 M block-adds/s, 734 bytes per (block, engine)). Measured with
// go test -run x -bench . -benchmem ./kvindex/ (Go 1.26, 2.3 GHz Xeon, 2 cores shared with other
// work; best of five runs):
//
//	hash 8,192 tokens (512 blocks)        6.9 µs, 4.7 GB/s, 0 allocs  target ≤ 6.5 µs (48×)
//	Match 512 blocks, 64 engines × 10 k   8.4 µs, 0 allocs            target ≤ 20 µs
//	Match, Mooncake trace in 16 engines   7.9 µs, 0 allocs
//	store+remove events, one core         9.7 M blocks/s, 0 allocs    target ≥ 7.8 M blocks/s
//	store with eviction at 128 Ki blocks  2.3 M blocks/s              (cache-miss bound)
//	memory, 1 M blocks, 1 holder each     86 B per (block, holder)    target ≤ 100
//	memory, 1 M blocks, 4 holders each    47 B per (block, holder)
//
// Hashing is bound by xxhash itself: one XXH64 of a 64-byte block costs about 12 ns here, which
// is 6.3 µs for 512 blocks before any chaining (BenchmarkHashAlternatives/content-only).
package kvindex
