package kvindex

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/state"
)

// TestConcurrentMatchRacesWriters runs Match on several goroutines while one writer per engine
// stores and removes, another engine comes and goes, and approximate entries are assumed and
// expired. Run with -race; the results must stay well formed and the invariants must hold after.
func TestConcurrentMatchRacesWriters(t *testing.T) {
	t.Parallel()
	var clock atomic.Int64
	clock.Store(time.Unix(5000, 0).UnixNano())
	h, err := NewHasher(HasherConfig{BlockTokens: testBlock})
	require.NoError(t, err)
	x, err := NewIndex(h, Options{MaxBlocks: 200, MaxApproxBlocks: 50, WriterYieldBlocks: 5, Now: func() time.Time { return time.Unix(0, clock.Load()) }})
	require.NoError(t, err)
	x.clearChunk = 3 // Clears and RemoveEngines release the lock between chunks of 3 entries

	const iters = 400
	var writers, readers sync.WaitGroup
	stop := make(chan struct{})
	for e := range 4 {
		writers.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(e), 1))
			id := state.EngineID(fmt.Sprintf("http://w%d", e))
			for i := range iters {
				pattern, n := rng.IntN(6), 1+rng.IntN(8)
				toks := prompt(pattern, n)
				base := uint64(pattern) * 1000
				err := x.Store(StoreEvent{Engine: id, DPRank: i % 2, BlockHashes: hashes(base, n), TokenIDs: toks, Tier: TierDevice})
				assert.NoError(t, err)
				if rng.IntN(2) == 0 {
					_ = x.Remove(id, i%2, hashes(base, rng.IntN(n+1)), 0) // may name evicted blocks
				}
				if rng.IntN(50) == 0 {
					assert.NoError(t, x.Clear(id, i%2))
				}
			}
		})
	}
	writers.Go(func() {
		for i := range iters {
			id := state.EngineID("http://transient")
			_ = x.Store(StoreEvent{Engine: id, BlockHashes: hashes(0, 3), TokenIDs: prompt(i%6, 3), Tier: TierHost})
			if i%3 == 0 {
				assert.NoError(t, x.RemoveEngine(id))
			}
		}
	})
	writers.Go(func() {
		rng := rand.New(rand.NewPCG(9, 9))
		for range iters {
			// Placements for engines without events and for the writers' engines, whose real
			// Stores take blocks from their records and whose Clear and RemoveEngine drop them.
			engine := []state.EngineID{"http://approx0", "http://approx1", "http://w0", "http://w1", "http://transient"}[rng.IntN(5)]
			assert.NoError(t, x.Assume(engine, h.Keys(prompt(rng.IntN(6), 1+rng.IntN(8))), time.Duration(1+rng.IntN(5))*time.Second))
			clock.Add(int64(100 * time.Millisecond))
			if rng.IntN(4) == 0 {
				x.Expire(time.Unix(0, clock.Load()))
			}
			_ = x.Stats()
		}
	})
	var nMatches atomic.Int64
	for r := range 3 {
		readers.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(r), 7))
			var m matches
			// Each reader matches at least minMatches times, even when the writers finish
			// first, so the test always exercises Match.
			const minMatches = 200
			for n := 0; ; n++ {
				if n >= minMatches {
					select {
					case <-stop:
						return
					default:
					}
				}
				toks := prompt(rng.IntN(6), 1+rng.IntN(10))
				keys := h.Keys(toks)
				if n%2 == 0 {
					x.matchInto(keys, &m)
				} else {
					x.matchTokensInto(toks, &m)
				}
				seen := map[state.EngineID]bool{}
				for i, e := range m.Engines {
					assert.True(t, e.Blocks >= 1 && e.Blocks <= len(keys), "blocks %d of %d", e.Blocks, len(keys))
					assert.False(t, seen[e.Engine], "engine %s twice", e.Engine)
					seen[e.Engine] = true
					if i > 0 {
						assert.GreaterOrEqual(t, m.Engines[i-1].Blocks, e.Blocks)
					}
				}
				nMatches.Add(1)
			}
		})
	}
	writers.Wait()
	close(stop)
	readers.Wait()
	require.NoError(t, checkInvariants(x))
	assert.Positive(t, nMatches.Load())
	assert.LessOrEqual(t, x.Stats().Blocks, 200)
}

// TestConcurrentMatchRacesPrebuiltStores runs matches beside writers on an index past its slabs'
// first page, so that the writers' Stores build their new blocks before taking the lock
// (Index.prebuild) and publish them under it, while Removes and Clears free nodes and holding runs
// for later prebuilds to reuse. The race detector checks that no reader touches a block while it
// is built; the answers keep their shape, and the invariants hold at the end.
//
// With a cap 200 blocks above the ballast, eviction runs too (from the ballast's oldest leaf up,
// then the writers' own blocks), and later prebuilds reuse the evicted nodes and runs.
func TestConcurrentMatchRacesPrebuiltStores(t *testing.T) {
	t.Parallel()
	for _, capped := range []bool{false, true} {
		t.Run(fmt.Sprintf("capped=%v", capped), func(t *testing.T) {
			t.Parallel()
			testConcurrentMatchRacesPrebuiltStores(t, capped)
		})
	}
}

func testConcurrentMatchRacesPrebuiltStores(t *testing.T, capped bool) {
	h, err := NewHasher(HasherConfig{BlockTokens: testBlock})
	require.NoError(t, err)
	var opts Options
	if capped {
		opts.MaxBlocks = 2*slabPageLen - 300 + 200
	}
	x, err := NewIndex(h, opts)
	require.NoError(t, err)
	// The ballast leaves both slabs a little short of their third page, so that the writers'
	// Stores also cross into it: a chunk that would need a new page must take the lock first.
	require.NoError(t, x.Store(ballastEvent(h, 2*slabPageLen-300)))
	require.Less(t, x.nodes.len(), 2*slabPageLen)
	require.Less(t, x.holds.len(), 2*slabPageLen)
	before := x.prebuilt

	const iters = 300
	var writers, readers sync.WaitGroup
	stop := make(chan struct{})
	for e := range 2 {
		writers.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(e), 3))
			id := state.EngineID(fmt.Sprintf("http://p%d", e))
			for range iters {
				pattern, n := 1+rng.IntN(20), 1+rng.IntN(40)
				base := uint64(pattern) * 1000
				assert.NoError(t, x.Store(StoreEvent{Engine: id, BlockHashes: hashes(base, n), TokenIDs: prompt(pattern, n), Tier: TierDevice}))
				switch rng.IntN(6) {
				case 0, 1: // the deepest blocks, as engines evict
					k := rng.IntN(n)
					assert.NoError(t, x.Remove(id, 0, hashes(base+uint64(k), n-k), 0))
				case 2: // a block in the middle: a hole
					assert.NoError(t, x.Remove(id, 0, hashes(base+uint64(rng.IntN(n)), 1), 0))
				}
				if rng.IntN(40) == 0 {
					assert.NoError(t, x.Clear(id, 0))
				}
			}
		})
	}
	for r := range 2 {
		readers.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(r), 11))
			var m matches
			for n := 0; ; n++ {
				if n >= 200 {
					select {
					case <-stop:
						return
					default:
					}
				}
				toks := prompt(1+rng.IntN(20), 1+rng.IntN(40))
				x.matchTokensInto(toks, &m)
				for i, e := range m.Engines {
					assert.True(t, e.Blocks >= 1 && e.Blocks <= len(toks)/testBlock, "blocks %d", e.Blocks)
					if i > 0 {
						assert.GreaterOrEqual(t, m.Engines[i-1].Blocks, e.Blocks)
					}
				}
			}
		})
	}
	writers.Wait()
	close(stop)
	readers.Wait()
	require.NoError(t, checkInvariants(x))
	assert.Greater(t, x.prebuilt, before, "the writers' Stores should build new blocks before the lock")
	if capped {
		st := x.Stats()
		assert.Positive(t, st.EvictedBlocks)
		assert.LessOrEqual(t, st.Blocks, opts.MaxBlocks)
		return
	}
	assert.Greater(t, x.nodes.len(), 2*slabPageLen, "the node slab should reach its third page")
	assert.Greater(t, x.holds.len(), 2*slabPageLen, "the holding slab should reach its third page")
}

// TestPrebuiltBlockClearsAReusedNodesReferenceBit: a Store's new block built before the lock
// (Index.prebuild) on a node index freed earlier starts with its CLOCK reference bit clear, as
// newNodeAt's do, so a bit a Match set on the freed block does not give the new one a second
// chance: with the cap one block short, the least recently stored block is the one evicted.
func TestPrebuiltBlockClearsAReusedNodesReferenceBit(t *testing.T) {
	t.Parallel()
	h, err := NewHasher(HasherConfig{BlockTokens: testBlock})
	require.NoError(t, err)
	ballast := ballastEvent(h, slabPageLen+100)
	x, err := NewIndex(h, Options{MaxBlocks: len(ballast.BlockHashes) + 2})
	require.NoError(t, err)
	require.NoError(t, x.Store(ballast))
	const id = state.EngineID("http://e")
	store := func(pattern int) {
		t.Helper()
		require.NoError(t, x.Store(StoreEvent{Engine: id, BlockHashes: hashes(uint64(pattern)*1000, 1), TokenIDs: prompt(pattern, 1), Tier: TierDevice}))
	}
	node := func(pattern int) uint32 {
		n, _, _ := x.byKey.get(h.Keys(prompt(pattern, 1))[0])
		return n
	}
	store(1)
	freed := node(1)
	require.Equal(t, []EngineMatch{{Engine: id, Blocks: 1}}, x.Match(h.Keys(prompt(1, 1))).Engines)
	require.True(t, x.refSet(freed), "the Match marks the block it found")
	require.NoError(t, x.Remove(id, 0, hashes(1000, 1), 0))

	before := x.prebuilt
	store(2) // built before the lock, on the freed node
	require.Equal(t, before+1, x.prebuilt)
	require.Equal(t, freed, node(2), "the new block reuses the freed node")
	assert.False(t, x.refSet(freed), "a reused node's reference bit")
	store(3)
	require.NoError(t, x.Store(ballast)) // the ballast becomes the most recently stored
	store(4)                             // one block over the cap: the least recently stored goes

	assert.Empty(t, x.Match(h.Keys(prompt(2, 1))).Engines, "block 2, stored first, is evicted")
	assert.Equal(t, []EngineMatch{{Engine: id, Blocks: 1}}, x.Match(h.Keys(prompt(3, 1))).Engines)
	require.NoError(t, checkInvariants(x))
}

// A Store that grows the key table rehashes it without excluding readers: a Match run while the
// grown table is being built (growHook) completes, and sees the index as it was before the
// Store; after the Store, matches see the new blocks in the grown table. A rehash under the lock
// would hold every lookup for hundreds of milliseconds at each doubling of a large table
// (docs/performance.md, "kvindex at production scale").
func TestKeyTableGrowsBesideReaders(t *testing.T) {
	t.Parallel()
	h, err := NewHasher(HasherConfig{BlockTokens: testBlock})
	require.NoError(t, err)
	x, err := NewIndex(h, Options{})
	require.NoError(t, err)
	const first, more = 40, 400
	c := newTestChain(h, first+more, 7_000_000)
	keys := c.keys
	engine := state.EngineID("http://a")
	require.NoError(t, x.Store(c.event(engine, 0, 0, first)))
	bits := x.byKey.bits
	grew := 0
	x.growHook = func() {
		grew++
		done := make(chan int, 1) // the Match finishes after the Store when it had to wait
		go func() { done <- x.Match(keys).Blocks(engine) }()
		select {
		case got := <-done:
			assert.Equal(t, first, got, "a Match during the growth sees the index before the Store")
		case <-time.After(10 * time.Second):
			t.Error("a Match waited for the key table's growth")
		}
	}
	require.NoError(t, x.Store(c.event(engine, 0, first, first+more)))
	assert.Equal(t, 1, grew, "the Store grew the key table once")
	assert.Greater(t, x.byKey.bits, bits)
	assert.Equal(t, first+more, x.Match(keys).Blocks(engine))
	require.NoError(t, checkInvariants(x))
}

// Clear and RemoveEngine drop a holder's entries in chunks of clearChunk, releasing the lock
// between chunks, and Match leaves the holders being cleared out whole: a Match run between two
// chunks (clearHook) completes, does not see the cleared engine, and sees the other engines as
// before. A whole holder dropped under one hold of the lock would hold every lookup for the
// whole clear (docs/performance.md, "Clearing an engine beside readers").
func TestClearReleasesTheLockBetweenChunks(t *testing.T) {
	t.Parallel()
	h, err := NewHasher(HasherConfig{BlockTokens: testBlock})
	require.NoError(t, err)
	x, err := NewIndex(h, Options{})
	require.NoError(t, err)
	const long, short = 3000, 1000
	c := newTestChain(h, long, 9_000_000)
	keys := c.keys
	store := func(engine state.EngineID, rank, n int) {
		require.NoError(t, x.Store(c.event(engine, rank, 0, n)))
	}
	a, b := state.EngineID("http://a"), state.EngineID("http://b")
	store(a, 0, long)
	store(a, 1, long)
	store(b, 0, short)
	onlyB := []EngineMatch{{Engine: b, Blocks: short}}
	chunks, work := 0, 0
	between := func(w int) {
		chunks++
		work += w
		assert.LessOrEqual(t, w, clearChunk, "a chunk's entries and freed nodes")
		done := make(chan []EngineMatch, 1) // the Match finishes after the clear when it had to wait
		go func() { done <- x.Match(keys).Engines }()
		select {
		case got := <-done:
			assert.Equal(t, onlyB, got, "a Match between chunks of clearing %s", a)
		case <-time.After(10 * time.Second):
			t.Error("a Match waited for the whole clear")
		}
	}
	x.clearHook = between

	// Each of a's ranks drops its long entries; the second one frees the blocks b does not hold.
	require.NoError(t, x.RemoveEngine(a))
	assert.Equal(t, 2*long+(long-short), work, "work: entries dropped and nodes freed")
	assert.GreaterOrEqual(t, chunks, (2*long+(long-short))/clearChunk)
	assert.Equal(t, onlyB, x.Match(keys).Engines)
	require.NoError(t, checkInvariants(x))

	x.clearHook = nil
	store(a, 0, long)
	x.clearHook = between
	chunks, work = 0, 0
	require.NoError(t, x.Clear(a, 0))
	assert.Equal(t, long+(long-short), work, "work: entries dropped and nodes freed")
	assert.GreaterOrEqual(t, chunks, (long+(long-short))/clearChunk)
	assert.Equal(t, onlyB, x.Match(keys).Engines)
	assert.Equal(t, short, x.Stats().Blocks)
	require.NoError(t, checkInvariants(x))
}

// Stores yield the writer's processor every Options.WriterYieldBlocks blocks, after the Store and
// outside both locks, so that waiting lookups run first (docs/performance.md, "A writer that
// yields to readers"); 0 means defaultWriterYieldBlocks, negative never.
func TestStoreYieldsEveryWriterYieldBlocks(t *testing.T) {
	t.Parallel()
	h, err := NewHasher(HasherConfig{BlockTokens: testBlock})
	require.NoError(t, err)
	c := newTestChain(h, 300, 5_000_000)
	for _, tc := range []struct {
		name   string
		opt    int
		every  int // the effective setting
		yields int // after 10 Stores of 30 blocks
	}{
		{"every 100 blocks", 100, 100, 2}, // after 120 and 240 blocks (the count restarts)
		{"every 30 blocks", 30, 30, 10},
		{"default", 0, defaultWriterYieldBlocks, 0},
		{"never", -1, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			x, err := NewIndex(h, Options{WriterYieldBlocks: tc.opt})
			require.NoError(t, err)
			assert.Equal(t, tc.every, x.yieldBlocks)
			yields := 0
			x.yield = func() {
				yields++
				// Outside both locks: another writer and a reader could run now.
				require.True(t, x.wmu.TryLock(), "the writers' lock is free during the yield")
				x.wmu.Unlock()
				require.True(t, x.mu.TryLock(), "the readers' lock is free during the yield")
				x.mu.Unlock()
			}
			engine := state.EngineID("http://y")
			for i := range 10 {
				require.NoError(t, x.Store(c.event(engine, 0, i*30, (i+1)*30)))
			}
			assert.Equal(t, tc.yields, yields)
			assert.Equal(t, 300, x.Match(c.keys).Blocks(engine))
		})
	}
}

// testChain is a prompt of distinct token IDs and its block keys, for tests that store one long
// chain, in parts or for several engines (testChain.event).
type testChain struct {
	toks []uint32
	keys []uint64
}

// newTestChain returns a chain of blocks blocks of token IDs base, base+1, …, hashed with h.
func newTestChain(h Hasher, blocks int, base uint32) testChain {
	toks := make([]uint32, blocks*h.BlockTokens())
	for i := range toks {
		toks[i] = base + uint32(i)
	}
	return testChain{toks: toks, keys: h.Keys(toks)}
}

// event returns the StoreEvent by which engine's DP rank rank stores blocks [from, to) of the
// chain, under block from−1; the engine's block hashes are engineHash(engine, key, rank).
func (c testChain) event(engine state.EngineID, rank, from, to int) StoreEvent {
	b := len(c.toks) / len(c.keys)
	ev := StoreEvent{Engine: engine, DPRank: rank, TokenIDs: c.toks[from*b : to*b], Tier: TierDevice}
	if from > 0 {
		ev.HasParent, ev.ParentHash = true, engineHash(engine, c.keys[from-1], rank)
	}
	for _, k := range c.keys[from:to] {
		ev.BlockHashes = append(ev.BlockHashes, engineHash(engine, k, rank))
	}
	return ev
}
