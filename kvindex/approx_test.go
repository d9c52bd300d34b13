package kvindex

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/state"
)

func TestAssumeExpiresByTheInjectedClock(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{})
	keys := f.h.Keys(prompt(1, 3))
	require.NoError(t, f.x.Assume("a", keys, 0))
	require.NoError(t, f.x.Assume("b", keys[:2], 10*time.Second))
	assert.Equal(t, map[state.EngineID]int{"a": 3, "b": 2}, f.match(1, 3))

	f.clock = f.clock.Add(10*time.Second - time.Nanosecond)
	assert.Equal(t, map[state.EngineID]int{"a": 3, "b": 2}, f.match(1, 3), "alive until its expiry")
	f.clock = f.clock.Add(time.Nanosecond)
	assert.Equal(t, map[state.EngineID]int{"a": 3}, f.match(1, 3), "Match ignores an entry at its expiry")
	assert.Equal(t, 5, f.x.Stats().ApproximateBlocks, "ignored, not yet dropped")
	assert.Equal(t, 2, f.x.Expire(f.clock))
	assert.Equal(t, 3, f.x.Stats().ApproximateBlocks)

	f.clock = f.clock.Add(defaultApproxTTL)
	assert.Empty(t, f.match(1, 3), "the default TTL is 120 s")
	assert.Equal(t, 3, f.x.Expire(f.clock))
	assert.Zero(t, f.x.Stats().Blocks, "expired entries leave the tree")
	assert.Zero(t, f.x.Expire(f.clock))
	require.NoError(t, checkInvariants(f.x))
}

func TestAssumeRefreshesAndDropsDueEntries(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{ApproxTTL: 5 * time.Second})
	keys := f.h.Keys(prompt(1, 2))
	require.NoError(t, f.x.Assume("a", keys, 0))
	f.clock = f.clock.Add(4 * time.Second)
	require.NoError(t, f.x.Assume("a", keys[:1], 0), "re-assuming block 1 refreshes it")
	f.clock = f.clock.Add(2 * time.Second)
	assert.Equal(t, map[state.EngineID]int{"a": 1}, f.match(1, 2), "block 2 expired, block 1 was refreshed")
	require.NoError(t, f.x.Assume("b", f.h.Keys(prompt(2, 1)), 0))
	assert.Equal(t, 2, f.x.Stats().ApproximateBlocks, "Assume dropped a's expired block 2 first")
	require.NoError(t, checkInvariants(f.x))
}

func TestRealEventSupersedesAssume(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{})
	require.NoError(t, f.x.Assume("a", f.h.Keys(prompt(1, 3)), time.Second))
	f.store("a", 0, 1, 0, 2, 0, TierHost)
	s := f.x.Stats()
	assert.Equal(t, EngineStats{Ranks: 1, HostBlocks: 2, ApproximateBlocks: 1}, s.Engines()["a"])
	f.clock = f.clock.Add(time.Hour)
	assert.Equal(t, map[state.EngineID]int{"a": 2}, f.match(1, 3), "the real blocks never expire")
	assert.Equal(t, 1, f.x.Expire(f.clock))
	require.NoError(t, checkInvariants(f.x))

	// Another rank's event does not supersede rank 0's assumption; Match folds both.
	require.NoError(t, f.x.Assume("b", f.h.Keys(prompt(2, 2)), time.Second))
	f.store("b", 1, 2, 0, 1, 100, TierDevice)
	assert.Equal(t, 2, f.x.Stats().Engines()["b"].ApproximateBlocks)
	assert.Equal(t, map[state.EngineID]int{"b": 2}, f.match(2, 2))

	// Assuming blocks already held for real leaves them real.
	require.NoError(t, f.x.Assume("a", f.h.Keys(prompt(1, 3)), time.Second))
	assert.Equal(t, 1, f.x.Stats().Engines()["a"].ApproximateBlocks, "only block 3 is approximate")
	f.clock = f.clock.Add(time.Hour)
	assert.Equal(t, map[state.EngineID]int{"a": 2}, f.match(1, 3))
}

func TestAssumeCapPrunesDeepestFirst(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{MaxApproxBlocks: 10})
	require.NoError(t, f.x.Assume("a", f.h.Keys(prompt(1, 6)), time.Minute))
	f.clock = f.clock.Add(time.Second)
	require.NoError(t, f.x.Assume("b", f.h.Keys(prompt(2, 6)), time.Minute))
	// 12 > 10: prune to 8, earliest expiry first (a's), deepest first within it.
	s := f.x.Stats()
	assert.Equal(t, 8, s.ApproximateBlocks, "pruned to 80%% of the cap")
	assert.Equal(t, map[state.EngineID]int{"a": 2}, f.match(1, 6), "a keeps its first two blocks: no hole")
	assert.Equal(t, map[state.EngineID]int{"b": 6}, f.match(2, 6))
	require.NoError(t, checkInvariants(f.x))
}

func TestClearAndRemoveEngineDropApproximateEntries(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{})
	require.NoError(t, f.x.Assume("a", f.h.Keys(prompt(1, 3)), 0))
	f.store("a", 0, 2, 0, 2, 0, TierDevice)
	require.NoError(t, f.x.Clear("a", 0))
	assert.Zero(t, f.x.Stats().Blocks)
	require.NoError(t, f.x.Assume("a", f.h.Keys(prompt(1, 3)), 0))
	require.NoError(t, f.x.Assume("b", f.h.Keys(prompt(1, 1)), 0))
	require.NoError(t, f.x.RemoveEngine("a"))
	assert.Equal(t, map[state.EngineID]int{"b": 1}, f.match(1, 3))
	assert.Equal(t, 1, f.x.Stats().ApproximateBlocks)
	require.NoError(t, checkInvariants(f.x))
	// Stale heap entries of the removed engine are harmless.
	f.clock = f.clock.Add(time.Hour)
	assert.Equal(t, 1, f.x.Expire(f.clock))
	require.NoError(t, checkInvariants(f.x))
}

func TestHeapCompactionBoundsStaleEntries(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{})
	keys := f.h.Keys(prompt(1, 4))
	for range 200 {
		f.clock = f.clock.Add(time.Millisecond)
		require.NoError(t, f.x.Assume("a", keys, 0))
	}
	f.x.mu.RLock()
	heap, records := len(f.x.pheap), f.x.placeLive
	f.x.mu.RUnlock()
	assert.Equal(t, 1, records, "each refresh took every key from the previous record")
	assert.LessOrEqual(t, heap, 2*records+64+1, "refreshes leave stale heap entries that compaction drops")
	require.NoError(t, checkInvariants(f.x))
}

// Two Assume calls of one engine at one instant share an expiry and a prefix: pruning drops
// their blocks deepest first across both chains, so the engine keeps the shared prefix on both
// prompts and no block becomes holey (dropping one chain wholly first would drop the shared
// blocks under the other chain's deeper ones).
func TestAssumeCapPrunesDeepestFirstAcrossCalls(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{MaxApproxBlocks: 10})
	other := append(prompt(1, 4), prompt(7, 2)...)
	require.NoError(t, f.x.Assume("a", f.h.Keys(prompt(1, 6)), time.Minute))
	require.NoError(t, f.x.Assume("a", f.h.Keys(other), time.Minute))
	require.Equal(t, 8, f.x.Stats().ApproximateBlocks)
	f.clock = f.clock.Add(time.Second)
	require.NoError(t, f.x.Assume("b", f.h.Keys(prompt(2, 4)), time.Minute))
	// 12 > 10: prune to 8, a's four deepest blocks (depths 5, 5, 4, 4).
	assert.Equal(t, 8, f.x.Stats().ApproximateBlocks)
	assert.Equal(t, map[state.EngineID]int{"a": 4}, f.match(1, 6))
	m := f.x.Match(f.h.Keys(other))
	require.Len(t, m.Engines, 1)
	assert.Equal(t, 4, m.Engines[0].Blocks)
	assert.Zero(t, f.x.holey.len(), "no hole was left")
	require.NoError(t, checkInvariants(f.x))
	// Both chains expire together, deepest first again.
	f.clock = f.clock.Add(time.Minute - time.Millisecond)
	assert.Equal(t, 4, f.x.Expire(f.clock))
	assert.Equal(t, 4, f.x.Stats().ApproximateBlocks, "b's entries expire a second later")
	require.NoError(t, checkInvariants(f.x))
}

// A real Store takes the stored blocks from the holder's record, chunk by chunk, as an engine
// that prefills a placed prompt in chunks publishes them: they become real and never expire,
// the rest stays approximate.
func TestStoreInChunksTakesBlocksFromTheRecord(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{})
	require.NoError(t, f.x.Assume("a", f.h.Keys(prompt(1, 6)), time.Minute))
	assert.Equal(t, Stats{ApproximateBlocks: 6, Ranks: []RankStats{{Engine: "a", ApproximateBlocks: 6}}}, f.x.Stats(),
		"approximate entries are not tree blocks")
	assert.Equal(t, map[state.EngineID]int{"a": 6}, f.match(1, 6))
	f.store("a", 0, 1, 0, 2, 0, TierDevice)
	assert.Equal(t, 4, f.x.Stats().ApproximateBlocks)
	f.store("a", 0, 1, 2, 2, 0, TierDevice)
	assert.Equal(t, 2, f.x.Stats().ApproximateBlocks)
	assert.Equal(t, map[state.EngineID]int{"a": 6}, f.match(1, 6), "real blocks, then the record's rest")
	f.clock = f.clock.Add(time.Hour)
	assert.Equal(t, map[state.EngineID]int{"a": 4}, f.match(1, 6), "the real blocks never expire")
	assert.Equal(t, 2, f.x.Expire(f.clock))
	require.NoError(t, checkInvariants(f.x))
}

// A record can fill a hole in a holder's real blocks: the match continues through it and on
// through the real blocks below the hole.
func TestRecordFillsARealHole(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{})
	f.store("a", 0, 1, 0, 4, 0, TierDevice)
	require.NoError(t, f.x.Remove("a", 0, []uint64{2}, 0)) // block 1
	assert.Equal(t, map[state.EngineID]int{"a": 1}, f.match(1, 4))
	require.NoError(t, f.x.Assume("a", f.h.Keys(prompt(1, 4)), time.Second))
	assert.Equal(t, 1, f.x.Stats().ApproximateBlocks, "only the block the holder does not hold really")
	assert.Equal(t, map[state.EngineID]int{"a": 4}, f.match(1, 4))
	var m matches
	f.x.matchLinearInto(f.h.Keys(prompt(1, 4)), &m)
	assert.Equal(t, []EngineMatch{{"a", 4}}, m.Engines, "the linear walk agrees")
	f.clock = f.clock.Add(2 * time.Second)
	assert.Equal(t, map[state.EngineID]int{"a": 1}, f.match(1, 4))
	require.NoError(t, checkInvariants(f.x))
}

// Each block has the expiry of its latest Assume, even a shorter one: the newer record takes
// the blocks from the older, which keeps only the blocks the newer one does not cover.
func TestLaterAssumeWithShorterTTLWins(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{})
	require.NoError(t, f.x.Assume("a", f.h.Keys(prompt(1, 4)), 10*time.Second))
	require.NoError(t, f.x.Assume("a", f.h.Keys(prompt(1, 2)), time.Second))
	assert.Equal(t, 4, f.x.Stats().ApproximateBlocks)
	f.clock = f.clock.Add(2 * time.Second)
	assert.Empty(t, f.match(1, 4), "blocks 0 and 1 expired; 2 and 3 live below a hole count nothing")
	assert.Equal(t, 2, f.x.Expire(f.clock))
	require.NoError(t, f.x.Assume("a", f.h.Keys(prompt(1, 1)), 10*time.Second))
	assert.Equal(t, map[state.EngineID]int{"a": 1}, f.match(1, 4), "block 1 is still missing")
	require.NoError(t, checkInvariants(f.x))
}

// MaxBlocks neither counts nor evicts approximate entries; MaxApproxBlocks bounds them.
func TestPlacementsAreNotEvictedUnderMaxBlocks(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{MaxBlocks: 2})
	require.NoError(t, f.x.Assume("a", f.h.Keys(prompt(1, 6)), 0))
	f.store("b", 0, 2, 0, 2, 0, TierDevice)
	f.store("b", 0, 3, 0, 2, 100, TierDevice)
	s := f.x.Stats()
	assert.Equal(t, 2, s.Blocks)
	assert.Equal(t, uint64(2), s.EvictedBlocks, "b's older prompt went")
	assert.Equal(t, map[state.EngineID]int{"a": 6}, f.match(1, 6))
	require.NoError(t, checkInvariants(f.x))
}

// A Store longer than one apply chunk takes the blocks from the record chunk by chunk, so that
// readers never see a block both real and in a record (approx.go's invariants).
func TestLongStoreTakesBlocksFromTheRecordPerChunk(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{})
	n := storeChunk + 88
	require.NoError(t, f.x.Assume("a", f.h.Keys(prompt(1, n+4)), time.Minute))
	f.store("a", 0, 1, 0, n, 0, TierDevice)
	assert.Equal(t, 4, f.x.Stats().ApproximateBlocks)
	assert.Equal(t, map[state.EngineID]int{"a": n + 4}, f.match(1, n+4))
	f.clock = f.clock.Add(time.Hour)
	assert.Equal(t, map[state.EngineID]int{"a": n}, f.match(1, n+4))
	require.NoError(t, checkInvariants(f.x))
}
