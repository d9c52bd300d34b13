package kvindex

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/internal/kvbridge"
	"github.com/enginepick/enginepick/state"
)

const testBlock = 4

// prompt returns blocks of testBlock tokens; block i of pattern p is [p*100+i*4, …+3].
func prompt(pattern, blocks int) []uint32 {
	var toks []uint32
	for i := range blocks {
		for j := range testBlock {
			toks = append(toks, uint32(pattern*100000+i*testBlock+j))
		}
	}
	return toks
}

// hashes returns fake engine hashes base+1 … base+n.
func hashes(base uint64, n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = base + uint64(i) + 1
	}
	return out
}

type fixture struct {
	t     *testing.T
	x     *Index
	h     Hasher
	clock time.Time
}

func newFixture(t *testing.T, opts Options) *fixture {
	t.Helper()
	h, err := NewHasher(HasherConfig{BlockTokens: testBlock})
	require.NoError(t, err)
	f := &fixture{t: t, h: h, clock: time.Unix(10_000, 0)}
	if opts.Now == nil {
		opts.Now = func() time.Time { return f.clock }
	}
	f.x, err = NewIndex(h, opts)
	require.NoError(t, err)
	return f
}

// source returns a LocalSource over the fixture's index.
func (f *fixture) source() *LocalSource {
	f.t.Helper()
	src, err := NewLocalSource(f.x)
	require.NoError(f.t, err)
	return src
}

// store stores blocks [from, from+n) of pattern's prompt for engine/rank with hashes base+from+1….
func (f *fixture) store(engine state.EngineID, rank, pattern, from, n int, base uint64, tier Tier) {
	f.t.Helper()
	require.NoError(f.t, f.x.Store(f.event(engine, rank, pattern, from, n, base, tier)))
	require.NoError(f.t, checkInvariants(f.x))
}

func (f *fixture) event(engine state.EngineID, rank, pattern, from, n int, base uint64, tier Tier) StoreEvent {
	toks := prompt(pattern, from+n)
	ev := StoreEvent{Engine: engine, DPRank: rank, Tier: tier,
		BlockHashes: hashes(base+uint64(from), n), TokenIDs: toks[from*testBlock:]}
	if from > 0 {
		ev.HasParent, ev.ParentHash = true, base+uint64(from)
	}
	return ev
}

func (f *fixture) match(pattern, blocks int) map[state.EngineID]int {
	f.t.Helper()
	m := f.x.Match(f.h.Keys(prompt(pattern, blocks)))
	require.Equal(f.t, blocks, m.QueryBlocks)
	out := map[state.EngineID]int{}
	for _, e := range m.Engines {
		out[e.Engine] = e.Blocks
	}
	return out
}

// dump renders the index's logical state canonically, to check that refused operations change
// nothing.
func dump(x *Index) string {
	x.mu.RLock()
	defer x.mu.RUnlock()
	var lines []string
	for n := uint32(1); int(n) < x.nodes.len(); n++ {
		nd := x.node(n)
		if !nd.has(flagLive) {
			continue
		}
		var es []string
		for p := int(nd.hold); p < int(nd.hold)+nd.nHold(); p++ {
			h := x.holders[entryHolder(x.hold(p).e)]
			es = append(es, fmt.Sprintf("%s/%d:%#x:%#x", x.engines[h.engine].id, h.rank, uint8(x.hold(p).e), x.hold(p).aux))
		}
		sort.Strings(es)
		lines = append(lines, fmt.Sprintf("%#x<-%#x %v", nd.key, x.node(nd.parent).key, es))
	}
	for hid, h := range x.holders {
		if !h.live {
			continue
		}
		var bs []string
		x.eachBinding(uint32(hid), func(k uint64, n uint32) { bs = append(bs, fmt.Sprintf("%#x>%#x", k, x.node(n).key)) })
		sort.Strings(bs)
		lines = append(lines, fmt.Sprintf("holder %s/%d %v %v approx=%d", x.engines[h.engine].id, h.rank, bs, h.tiers, h.approx))
	}
	sort.Strings(lines)
	return strings.Join(lines, "\n") + fmt.Sprintf("\napprox=%d live=%d", x.approxCount, x.live)
}

func TestNewIndexValidatesOptions(t *testing.T) {
	t.Parallel()
	h, err := NewHasher(HasherConfig{BlockTokens: 16})
	require.NoError(t, err)
	cases := []struct {
		name string
		h    Hasher
		opts Options
	}{
		{"zero hasher", Hasher{}, Options{}},
		{"negative MaxBlocks", h, Options{MaxBlocks: -1}},
		{"negative MaxApproxBlocks", h, Options{MaxApproxBlocks: -1}},
		{"negative ApproxTTL", h, Options{ApproxTTL: -time.Second}},
		{"negative ExpectedBlocks", h, Options{ExpectedBlocks: -1}},
		{"ExpectedBlocks above MaxBlocks", h, Options{MaxBlocks: 100, ExpectedBlocks: 101}},
		{"ExpectedBlocks above the default MaxBlocks", h, Options{ExpectedBlocks: defaultMaxBlocks + 1}},
		{"negative ExpectedHolderBlocks", h, Options{ExpectedHolderBlocks: -1}},
		{"ExpectedHolderBlocks above MaxBlocks", h, Options{MaxBlocks: 100, ExpectedHolderBlocks: 101}},
	}
	for _, c := range cases {
		_, err := NewIndex(c.h, c.opts)
		assert.ErrorIs(t, err, state.ErrInvalidConfiguration, c.name)
	}
	x, err := NewIndex(h, Options{})
	require.NoError(t, err, "the zero Options are the defaults")
	assert.Equal(t, defaultMaxBlocks, x.maxBlocks)
	assert.Equal(t, defaultMaxApproxBlocks, x.maxApprox)
	assert.Equal(t, defaultApproxTTL, x.ttl)
	assert.Equal(t, h, x.Hasher())
	assert.Zero(t, len(x.byKey.slots), "no ExpectedBlocks: the key table starts empty")
	assert.Zero(t, x.holderBits)
	_, err = NewIndex(h, Options{MaxBlocks: 100, ExpectedBlocks: 100, ExpectedHolderBlocks: 100})
	assert.NoError(t, err, "the expected counts may equal MaxBlocks")
}

// TestExpectedBlocksSizesTablesOnce checks Options.ExpectedBlocks and ExpectedHolderBlocks: the
// key table is allocated at NewIndex for the expected blocks at most three-quarters full, and
// keeps its array while that many blocks arrive and while they all go again; a holder's binding
// table is allocated at its expected size by its first Store and keeps it the same way; Clear
// releases it and the next Store allocates it at the expected size again. The zero Options keep
// the tables growing from small.
func TestExpectedBlocksSizesTablesOnce(t *testing.T) {
	t.Parallel()
	h, err := NewHasher(HasherConfig{BlockTokens: 1})
	require.NoError(t, err)
	const blocks, holderBlocks = 3000, 1000
	x, err := NewIndex(h, Options{ExpectedBlocks: blocks, ExpectedHolderBlocks: holderBlocks})
	require.NoError(t, err)
	require.Len(t, x.byKey.slots, 4096, "3,000 keys at most 3/4 full need 4,096 slots")
	keyTable := &x.byKey.slots[0]
	// Three engines store 1,000 blocks each, as 10 chains of 100; engine i's chains are distinct.
	store := func(e string, chain int) {
		toks := make([]uint32, 100)
		hashes := make([]uint64, 100)
		for j := range toks {
			toks[j] = uint32(chain*1000 + j)
			hashes[j] = uint64(chain*1000 + j + 1)
		}
		require.NoError(t, x.Store(StoreEvent{Engine: state.EngineID(e), BlockHashes: hashes, TokenIDs: toks, Tier: TierDevice}))
	}
	var bindTables []*uint64
	for i, e := range []string{"a", "b", "c"} {
		for c := range 10 {
			store(e, i*10+c)
			if c == 0 {
				hid, _ := x.lookupHolder(state.EngineID(e), 0)
				require.Len(t, x.holders[hid].bindings.slots, 2048, "1,000 bindings at most 3/4 full need 2,048 slots")
				bindTables = append(bindTables, &x.holders[hid].bindings.slots[0])
			}
		}
	}
	require.Equal(t, blocks, x.Stats().Blocks)
	assert.Same(t, keyTable, &x.byKey.slots[0], "the key table was not reallocated")
	for i, e := range []string{"a", "b", "c"} {
		hid, _ := x.lookupHolder(state.EngineID(e), 0)
		assert.Same(t, bindTables[i], &x.holders[hid].bindings.slots[0], "holder %s's binding table was not reallocated", e)
	}
	// Every block of a and b goes, by Remove: neither table shrinks.
	for i, e := range []string{"a", "b"} {
		for c := range 10 {
			hashes := make([]uint64, 100)
			for j := range hashes {
				hashes[j] = uint64((i*10+c)*1000 + j + 1)
			}
			require.NoError(t, x.Remove(state.EngineID(e), 0, hashes, 0))
		}
		hid, _ := x.lookupHolder(state.EngineID(e), 0)
		assert.Same(t, bindTables[i], &x.holders[hid].bindings.slots[0], "holder %s's emptied binding table keeps its array", e)
	}
	require.Equal(t, holderBlocks, x.Stats().Blocks)
	assert.Same(t, keyTable, &x.byKey.slots[0], "the key table keeps its array below its expected size")
	// Clear releases c's table; its next Store allocates it at the expected size.
	require.NoError(t, x.Clear("c", 0))
	hid, _ := x.lookupHolder("c", 0)
	assert.Empty(t, x.holders[hid].bindings.slots)
	store("c", 20)
	assert.Len(t, x.holders[hid].bindings.slots, 2048)
	require.NoError(t, checkInvariants(x))

	// Without the options the tables grow from small and shrink again.
	y, err := NewIndex(h, Options{})
	require.NoError(t, err)
	require.NoError(t, y.Store(StoreEvent{Engine: "a", BlockHashes: []uint64{1}, TokenIDs: []uint32{1}, Tier: TierDevice}))
	assert.Len(t, y.byKey.slots, 1<<nodeTableMinBits)
	hid, _ = y.lookupHolder("a", 0)
	assert.Len(t, y.holders[hid].bindings.slots, 1<<bindTableMinBits)
}

// The scenarios of SGLang's tree tests (sgl-project/sglang
// `experimental/sgl-router/src/state/kv_events/tree.rs`).
func TestIndexScenarios(t *testing.T) {
	t.Parallel()

	t.Run("single_insert_and_match", func(t *testing.T) {
		t.Parallel()
		f := newFixture(t, Options{})
		f.store("a", 0, 1, 0, 4, 0, TierDevice)
		assert.Equal(t, map[state.EngineID]int{"a": 4}, f.match(1, 4))
		assert.Equal(t, map[state.EngineID]int{"a": 4}, f.match(1, 6), "a longer query matches the held prefix")
		assert.Equal(t, map[state.EngineID]int{"a": 2}, f.match(1, 2))
		assert.Empty(t, f.match(2, 4), "another prompt misses")
		assert.Equal(t, 4, f.x.Stats().Blocks)
	})

	t.Run("prefix_depths_answers_every_engine_at_its_own_depth", func(t *testing.T) {
		t.Parallel()
		f := newFixture(t, Options{})
		f.store("a", 0, 1, 0, 2, 0, TierDevice)
		f.store("b", 0, 1, 0, 5, 100, TierDevice)
		f.store("c", 0, 1, 0, 3, 200, TierHost)
		assert.Equal(t, map[state.EngineID]int{"a": 2, "b": 5, "c": 3}, f.match(1, 8))
		m := f.x.Match(f.h.Keys(prompt(1, 8)))
		assert.Equal(t, []EngineMatch{{"b", 5}, {"c", 3}, {"a", 2}}, m.Engines, "deepest first")
		assert.Equal(t, 5, m.Blocks("b"))
		assert.Equal(t, 0, m.Blocks("z"))
	})

	t.Run("ties_order_by_engine_id_in_both_insert_orders", func(t *testing.T) {
		t.Parallel()
		for _, order := range [][]state.EngineID{{"b", "a"}, {"a", "b"}} {
			f := newFixture(t, Options{})
			for i, e := range order {
				f.store(e, 0, 1, 0, 3, uint64(i)*100, TierDevice)
			}
			m := f.x.Match(f.h.Keys(prompt(1, 3)))
			assert.Equal(t, []EngineMatch{{"a", 3}, {"b", 3}}, m.Engines, "insert order %v", order)
		}
	})

	t.Run("continuation_insert_chains_via_parent_hash", func(t *testing.T) {
		t.Parallel()
		f := newFixture(t, Options{})
		f.store("a", 0, 1, 0, 2, 0, TierDevice)
		f.store("a", 0, 1, 2, 3, 0, TierDevice)
		assert.Equal(t, map[state.EngineID]int{"a": 5}, f.match(1, 5))
		assert.Equal(t, 5, f.x.Stats().Blocks)
	})

	t.Run("remove_specific_blocks_leaves_a_hole_that_stops_the_count", func(t *testing.T) {
		t.Parallel()
		f := newFixture(t, Options{})
		f.store("a", 0, 1, 0, 5, 0, TierDevice)
		f.store("b", 0, 1, 0, 5, 100, TierDevice)
		require.NoError(t, f.x.Remove("a", 0, []uint64{3}, 0))
		require.NoError(t, checkInvariants(f.x))
		assert.Equal(t, map[state.EngineID]int{"a": 2, "b": 5}, f.match(1, 5))
		require.NoError(t, f.x.Remove("b", 0, []uint64{105}, allTiers))
		assert.Equal(t, map[state.EngineID]int{"a": 2, "b": 4}, f.match(1, 5))
		assert.Equal(t, 5, f.x.Stats().Blocks, "block 5 is still held by a")
		require.NoError(t, f.x.Remove("a", 0, []uint64{5, 4}, 0))
		assert.Equal(t, 4, f.x.Stats().Blocks, "block 5 left; block 4 is held by b")
		require.NoError(t, checkInvariants(f.x))
	})

	t.Run("clear_drops_exclusive_branches_keeps_shared_nodes", func(t *testing.T) {
		t.Parallel()
		f := newFixture(t, Options{})
		f.store("a", 0, 1, 0, 3, 0, TierDevice)
		f.store("b", 0, 1, 0, 2, 100, TierDevice)
		f.store("a", 0, 2, 0, 2, 1000, TierDevice)
		require.NoError(t, f.x.Clear("a", 0))
		require.NoError(t, checkInvariants(f.x))
		assert.Equal(t, map[state.EngineID]int{"b": 2}, f.match(1, 3))
		assert.Empty(t, f.match(2, 2))
		assert.Equal(t, 2, f.x.Stats().Blocks)
		assert.Equal(t, EngineStats{Ranks: 1}, f.x.Stats().Engines()["a"], "a cleared engine stays known")
		err := f.x.Remove("a", 0, []uint64{1}, 0)
		assert.ErrorIs(t, err, ErrUnknownHash, "after Clear the engine is known but holds nothing")
	})

	t.Run("device_eviction_after_host_backup_keeps_the_engine_as_host_owner", func(t *testing.T) {
		t.Parallel()
		f := newFixture(t, Options{})
		f.store("a", 0, 1, 0, 2, 0, TierDevice)
		f.store("a", 0, 1, 0, 2, 0, TierHost)
		assert.Equal(t, EngineStats{Ranks: 1, DeviceBlocks: 2, HostBlocks: 2}, f.x.Stats().Engines()["a"])
		require.NoError(t, f.x.Remove("a", 0, []uint64{1, 2}, TierDevice))
		assert.Equal(t, map[state.EngineID]int{"a": 2}, f.match(1, 2), "matching is tier-blind")
		assert.Equal(t, EngineStats{Ranks: 1, HostBlocks: 2}, f.x.Stats().Engines()["a"])
		require.NoError(t, f.x.Remove("a", 0, []uint64{1, 2}, TierHost))
		assert.Empty(t, f.match(1, 2))
		assert.Zero(t, f.x.Stats().Blocks)
	})

	t.Run("tiers_are_tracked_per_engine_and_disk_external_are_independent", func(t *testing.T) {
		t.Parallel()
		f := newFixture(t, Options{})
		f.store("a", 0, 1, 0, 2, 0, TierDisk)
		f.store("b", 0, 1, 0, 2, 100, TierExternal)
		f.store("b", 0, 1, 0, 2, 100, TierDisk|TierHost)
		require.NoError(t, f.x.Remove("a", 0, []uint64{2}, TierExternal))
		require.NoError(t, f.x.Remove("b", 0, []uint64{102}, TierDisk))
		s := f.x.Stats()
		assert.Equal(t, EngineStats{Ranks: 1, DiskBlocks: 2}, s.Engines()["a"], "removing a tier a does not hold is a no-op")
		assert.Equal(t, EngineStats{Ranks: 1, HostBlocks: 2, DiskBlocks: 1, ExternalBlocks: 2}, s.Engines()["b"])
	})

	t.Run("dp_ranks_fold_by_maximum", func(t *testing.T) {
		t.Parallel()
		f := newFixture(t, Options{})
		f.store("a", 0, 1, 0, 2, 0, TierDevice)
		f.store("a", 3, 1, 0, 4, 100, TierDevice)
		f.store("a", 1, 1, 0, 1, 200, TierDevice)
		assert.Equal(t, map[state.EngineID]int{"a": 4}, f.match(1, 6))
		assert.Equal(t, 3, f.x.Stats().Engines()["a"].Ranks)
		require.NoError(t, f.x.Clear("a", 3))
		assert.Equal(t, map[state.EngineID]int{"a": 2}, f.match(1, 6))
	})

	t.Run("aliases_keep_the_block_until_every_hash_is_removed", func(t *testing.T) {
		t.Parallel()
		f := newFixture(t, Options{})
		f.store("a", 0, 1, 0, 2, 0, TierDevice)
		f.store("a", 0, 1, 0, 2, 50, TierDevice) // the same blocks under hashes 51, 52
		require.NoError(t, f.x.Remove("a", 0, []uint64{2}, 0))
		assert.Equal(t, map[state.EngineID]int{"a": 2}, f.match(1, 2), "alias 52 still holds block 2")
		require.ErrorIs(t, f.x.Store(StoreEvent{Engine: "a", HasParent: true, ParentHash: 2,
			BlockHashes: []uint64{9}, TokenIDs: prompt(1, 3)[8:], Tier: TierDevice}), ErrUnknownParent,
			"hash 2 was removed")
		require.NoError(t, f.x.Store(StoreEvent{Engine: "a", HasParent: true, ParentHash: 52,
			BlockHashes: []uint64{9}, TokenIDs: prompt(1, 3)[8:], Tier: TierDevice}),
			"a child can hang under either alias")
		require.NoError(t, f.x.Store(StoreEvent{Engine: "a", HasParent: true, ParentHash: 52,
			BlockHashes: []uint64{9}, TokenIDs: prompt(1, 3)[8:], Tier: TierHost}),
			"re-storing hash 9 at the same block adds the tier")
		assert.Equal(t, EngineStats{Ranks: 1, DeviceBlocks: 4, HostBlocks: 1}, f.x.Stats().Engines()["a"])
		require.NoError(t, f.x.Remove("a", 0, []uint64{52}, 0))
		assert.Equal(t, map[state.EngineID]int{"a": 1}, f.match(1, 3), "block 2 is a hole now; block 3 stays")
		assert.Equal(t, 3, f.x.Stats().Blocks)
		require.NoError(t, checkInvariants(f.x))
	})

	t.Run("remove_engine_forgets_every_rank", func(t *testing.T) {
		t.Parallel()
		f := newFixture(t, Options{})
		f.store("a", 0, 1, 0, 2, 0, TierDevice)
		f.store("a", 1, 1, 0, 3, 0, TierDevice)
		f.store("b", 0, 1, 0, 1, 0, TierDevice)
		require.NoError(t, f.x.RemoveEngine("a"))
		require.NoError(t, checkInvariants(f.x))
		assert.Equal(t, map[state.EngineID]int{"b": 1}, f.match(1, 3))
		assert.Equal(t, 1, f.x.Stats().Blocks)
		assert.ErrorIs(t, f.x.RemoveEngine("a"), ErrUnknownEngine)
		assert.ErrorIs(t, f.x.Clear("a", 0), ErrUnknownEngine)
		f.store("a", 0, 1, 0, 2, 0, TierDevice)
		assert.Equal(t, map[state.EngineID]int{"a": 2, "b": 1}, f.match(1, 3), "a removed engine can come back")
	})

	t.Run("empty_and_short_queries", func(t *testing.T) {
		t.Parallel()
		f := newFixture(t, Options{})
		f.store("a", 0, 1, 0, 2, 0, TierDevice)
		for _, toks := range [][]uint32{nil, {}, {1, 2, 3}} {
			keys := f.h.Keys(toks)
			assert.Empty(t, keys, "tokens %v", toks)
			m := f.x.Match(keys)
			assert.Empty(t, m.Engines)
			assert.Zero(t, m.QueryBlocks)
		}
	})
}

func TestEmptyStoreIsANoOp(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{})
	require.NoError(t, f.x.Store(StoreEvent{Engine: "a", Tier: TierDevice}), "an empty store is a no-op")
	assert.Nil(t, f.x.Stats().Engines(), "and does not register the engine")
	assert.ErrorIs(t, f.x.Remove("a", 0, nil, 0), ErrUnknownEngine)
}

// storeRestored (kvbridge.StoreRestored) reports, in prompt order, the blocks the holder already
// held under the same hash with the tiers it held them in; new blocks, another holder's blocks and
// aliases are not reported, and a refused event leaves the slice as it was.
func TestStoreRestored(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{})
	f.store("a", 0, 1, 0, 2, 0, TierDevice) // blocks 0, 1 of prompt 1, hashes 1, 2
	f.store("a", 0, 1, 1, 1, 0, TierHost)   // block 1 in host memory too
	f.store("b", 0, 1, 0, 3, 0, TierDevice)
	prefix := []kvbridge.Restored{{Block: 9, Tiers: uint8(TierDisk)}}
	cases := []struct {
		name string
		ev   StoreEvent
		want []kvbridge.Restored
	}{
		{"the same blocks and one new", f.event("a", 0, 1, 0, 3, 0, TierDevice),
			[]kvbridge.Restored{{Block: 0, Tiers: uint8(TierDevice)}, {Block: 1, Tiers: uint8(TierDevice | TierHost)}}},
		{"in another tier", f.event("a", 0, 1, 1, 1, 0, TierDisk), []kvbridge.Restored{{Block: 0, Tiers: uint8(TierDevice | TierHost)}}},
		{"another rank", f.event("a", 1, 1, 0, 2, 0, TierDevice), nil},
		{"an alias", f.event("a", 0, 1, 0, 1, 100, TierDevice), nil},
	}
	for _, tc := range cases {
		got, err := kvbridge.StoreRestored(f.x, tc.ev, nil)
		require.NoError(t, err, tc.name)
		assert.Equal(t, tc.want, got, tc.name)
		require.NoError(t, checkInvariants(f.x))
	}
	got, err := kvbridge.StoreRestored(f.x, f.event("a", 0, 1, 0, 1, 0, TierDevice), prefix)
	require.NoError(t, err)
	assert.Equal(t, []kvbridge.Restored{prefix[0], {Block: 0, Tiers: uint8(TierDevice)}}, got, "appended")

	before := dump(f.x)
	bad := f.event("a", 0, 1, 0, 2, 0, TierDevice)
	bad.TokenIDs = append(prompt(1, 1), prompt(2, 2)[testBlock:]...) // block 0 restored, hash 2 held for another block
	got, err = kvbridge.StoreRestored(f.x, bad, prefix[:1:1])
	assert.ErrorIs(t, err, ErrDuplicateHash)
	assert.Equal(t, prefix, got, "unchanged on an error")
	assert.Equal(t, before, dump(f.x))
}

// TestRefusedOperationsChangeNothing checks every typed error and that the index is unchanged.
func TestRefusedOperationsChangeNothing(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{})
	f.store("a", 0, 1, 0, 3, 0, TierDevice)
	f.store("b", 0, 1, 0, 2, 100, TierHost)
	require.NoError(t, f.x.Assume("c", f.h.Keys(prompt(2, 2)), 0))
	ok := f.event("a", 0, 1, 3, 2, 0, TierDevice) // a valid continuation of a's chain
	require.NoError(t, f.x.Store(ok), "sanity: the template is valid")
	require.NoError(t, f.x.Remove("a", 0, []uint64{4, 5}, 0))
	before := dump(f.x)

	mod := func(fn func(ev *StoreEvent)) StoreEvent {
		ev := ok
		ev.BlockHashes = slices.Clone(ok.BlockHashes)
		ev.TokenIDs = slices.Clone(ok.TokenIDs)
		fn(&ev)
		return ev
	}
	keys := f.h.Keys(prompt(1, 3))
	cases := []struct {
		name  string
		op    func() error
		want  error
		rule  string
		hashe []uint64
	}{
		{"store negative rank", func() error { return f.x.Store(mod(func(ev *StoreEvent) { ev.DPRank = -1 })) }, ErrInvalidRank, "ranks are >= 0", nil},
		{"store no tier", func() error { return f.x.Store(mod(func(ev *StoreEvent) { ev.Tier = 0 })) }, ErrInvalidTier, "a store names its medium", nil},
		{"store unknown tier bit", func() error { return f.x.Store(mod(func(ev *StoreEvent) { ev.Tier = 0x10 })) }, ErrInvalidTier, "four tiers", nil},
		{"store one token short", func() error {
			return f.x.Store(mod(func(ev *StoreEvent) { ev.TokenIDs = ev.TokenIDs[:len(ev.TokenIDs)-1] }))
		}, ErrBlockSizeMismatch, "tokens = blocks × block size", nil},
		{"store one block too many tokens", func() error {
			return f.x.Store(mod(func(ev *StoreEvent) { ev.TokenIDs = append(ev.TokenIDs, 1, 2, 3, 4) }))
		}, ErrBlockSizeMismatch, "the engine's block size differs", nil},
		{"store tokens without hashes", func() error {
			return f.x.Store(mod(func(ev *StoreEvent) { ev.BlockHashes = nil }))
		}, ErrBlockSizeMismatch, "tokens need blocks", nil},
		{"store duplicate hash in event", func() error {
			return f.x.Store(mod(func(ev *StoreEvent) { ev.BlockHashes[1] = ev.BlockHashes[0] }))
		}, ErrDuplicateHash, "one hash per block", []uint64{4}},
		{"store hash held for another block", func() error {
			return f.x.Store(mod(func(ev *StoreEvent) { ev.BlockHashes[1] = 2 }))
		}, ErrDuplicateHash, "hash 2 already names block 2", []uint64{2}},
		{"store self-referencing parent", func() error {
			return f.x.Store(mod(func(ev *StoreEvent) { ev.ParentHash = ev.BlockHashes[1] }))
		}, ErrCyclicChain, "the parent cannot be one of the stored blocks", []uint64{5}},
		{"store unknown parent", func() error { return f.x.Store(mod(func(ev *StoreEvent) { ev.ParentHash = 77 })) }, ErrUnknownParent, "parents resolve per holder", []uint64{77}},
		{"store parent of another engine", func() error {
			return f.x.Store(mod(func(ev *StoreEvent) { ev.Engine = "b"; ev.ParentHash = 3 }))
		}, ErrUnknownParent, "hash 3 is a's, not b's", []uint64{3}},
		{"store parent of another rank", func() error { return f.x.Store(mod(func(ev *StoreEvent) { ev.DPRank = 1 })) }, ErrUnknownParent, "ranks are separate holders", []uint64{3}},
		{"store parent for a new engine", func() error { return f.x.Store(mod(func(ev *StoreEvent) { ev.Engine = "new" })) }, ErrUnknownParent, "a new engine holds nothing", []uint64{3}},
		{"store empty engine", func() error { return f.x.Store(mod(func(ev *StoreEvent) { ev.Engine = ""; ev.HasParent = false })) }, ErrInvalidEngine, "every engine has an ID", nil},
		{"store empty engine without blocks", func() error {
			return f.x.Store(mod(func(ev *StoreEvent) { ev.Engine = ""; ev.BlockHashes, ev.TokenIDs = nil, nil }))
		}, ErrInvalidEngine, "refused even where an empty event is a no-op", nil},
		{"remove empty engine", func() error { return f.x.Remove("", 0, []uint64{1}, 0) }, ErrInvalidEngine, "", nil},
		{"clear empty engine", func() error { return f.x.Clear("", 0) }, ErrInvalidEngine, "", nil},
		{"remove empty engine entirely", func() error { return f.x.RemoveEngine("") }, ErrInvalidEngine, "", nil},
		{"assume empty engine", func() error { return f.x.Assume("", keys, 0) }, ErrInvalidEngine, "", nil},
		{"assume empty engine without keys", func() error { return f.x.Assume("", nil, 0) }, ErrInvalidEngine, "refused even where empty keys is a no-op", nil},
		{"remove negative rank", func() error { return f.x.Remove("a", -1, []uint64{1}, 0) }, ErrInvalidRank, "", nil},
		{"remove unknown tier", func() error { return f.x.Remove("a", 0, []uint64{1}, 0x80) }, ErrInvalidTier, "", nil},
		{"remove unknown engine", func() error { return f.x.Remove("zz", 0, []uint64{1}, 0) }, ErrUnknownEngine, "", nil},
		{"remove unknown rank", func() error { return f.x.Remove("a", 7, []uint64{1}, 0) }, ErrUnknownEngine, "", nil},
		{"remove unknown hashes", func() error { return f.x.Remove("a", 0, []uint64{1, 99, 2, 98}, 0) }, ErrUnknownHash, "all or nothing; every unknown hash listed", []uint64{99, 98}},
		{"remove removed hash", func() error { return f.x.Remove("a", 0, []uint64{4}, 0) }, ErrUnknownHash, "", []uint64{4}},
		{"clear negative rank", func() error { return f.x.Clear("a", -2) }, ErrInvalidRank, "", nil},
		{"clear unknown engine", func() error { return f.x.Clear("zz", 0) }, ErrUnknownEngine, "", nil},
		{"remove unknown engine entirely", func() error { return f.x.RemoveEngine("zz") }, ErrUnknownEngine, "", nil},
		{"assume repeated key", func() error { return f.x.Assume("c", []uint64{keys[0], keys[1], keys[0]}, 0) }, ErrCyclicChain, "", []uint64{keys[0]}},
		{"assume keys out of order", func() error { return f.x.Assume("c", []uint64{keys[1], keys[2]}, 0) }, ErrKeyConflict, "keys[1] hangs under keys[0], not the root", []uint64{keys[1]}},
		{"assume negative ttl", func() error { return f.x.Assume("c", keys, -time.Second) }, state.ErrInvalidConfiguration, "", nil},
	}
	for _, c := range cases {
		err := c.op()
		require.ErrorIs(t, err, c.want, "%s (%s)", c.name, c.rule)
		var ee *EventError
		if errors.As(err, &ee) {
			assert.Equal(t, c.hashe, ee.Hashes, "%s: offending hashes", c.name)
			assert.NotEmpty(t, ee.Error())
		} else {
			assert.ErrorIs(t, c.want, state.ErrInvalidConfiguration, "%s: only configuration errors are not EventErrors", c.name)
		}
		require.Equal(t, before, dump(f.x), "%s changed the index", c.name)
		require.NoError(t, checkInvariants(f.x), c.name)
	}
}

// TestEmptyEngineIsNeverIndexed checks that an event for the empty engine ID leaves no trace: no
// block, no engine in Stats, nothing a Match returns, even when the event is otherwise valid.
func TestEmptyEngineIsNeverIndexed(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{})
	err := f.x.Store(f.event("", 0, 1, 0, 3, 0, TierDevice))
	require.ErrorIs(t, err, ErrInvalidEngine, "Store(Engine: \"\")")
	var ee *EventError
	require.ErrorAs(t, err, &ee)
	assert.Equal(t, "store", ee.Op)
	require.ErrorIs(t, f.x.Assume("", f.h.Keys(prompt(1, 3)), 0), ErrInvalidEngine, "Assume(\"\")")
	assert.Zero(t, f.x.Stats().Blocks, "no block indexed")
	assert.Nil(t, f.x.Stats().Engines(), "no engine registered")
	assert.Empty(t, f.match(1, 3), "Match finds no holder")
	require.NoError(t, checkInvariants(f.x))
}

// TestBlockSizeMismatchStatesCounts checks that a refused Store says how many tokens it carried,
// for how many blocks, and what the index expected.
func TestBlockSizeMismatchStatesCounts(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{}) // 4-token blocks
	cases := []struct {
		name           string
		tokens, blocks int
		msg            string
	}{
		{"one token short", 7, 2, `kvindex: store engine "a" rank 0: block size mismatch: 7 tokens for 2 blocks, want 8 (2 blocks × 4 tokens per block)`},
		{"one block too many tokens", 12, 2, `kvindex: store engine "a" rank 0: block size mismatch: 12 tokens for 2 blocks, want 8 (2 blocks × 4 tokens per block)`},
		{"engine block size is twice the index's", 16, 2, `kvindex: store engine "a" rank 0: block size mismatch: 16 tokens for 2 blocks, want 8 (2 blocks × 4 tokens per block)`},
		{"tokens without hashes", 4, 0, `kvindex: store engine "a" rank 0: block size mismatch: 4 tokens for 0 blocks, want 0 (0 blocks × 4 tokens per block)`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ev := StoreEvent{Engine: "a", Tier: TierDevice, BlockHashes: hashes(0, c.blocks),
				TokenIDs: make([]uint32, c.tokens)}
			err := f.x.Store(ev)
			require.ErrorIs(t, err, ErrBlockSizeMismatch, "Store(%d tokens, %d blocks)", c.tokens, c.blocks)
			var bse *BlockSizeError
			require.ErrorAs(t, err, &bse)
			assert.Equal(t, BlockSizeError{Tokens: c.tokens, Blocks: c.blocks, BlockTokens: testBlock}, *bse)
			assert.Equal(t, c.msg, err.Error(), "the message states the counts")
		})
	}
	assert.Zero(t, f.x.Stats().Blocks, "nothing stored")
}

func TestKeyConflictIsRefused(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{})
	f.store("a", 0, 1, 0, 2, 0, TierDevice)
	keys := f.h.Keys(prompt(1, 2))
	// Forge a collision: a node for a key the next Store will compute, under another parent.
	other := f.h.Keys(prompt(2, 3))
	f.store("c", 0, 2, 0, 1, 500, TierDevice)
	next := f.h.appendFrom(nil, keys[1], prompt(1, 3)[8:])
	f.x.mu.Lock()
	n, _, _ := f.x.byKey.get(other[0])
	f.x.byKey.remove(other[0], n)
	f.x.node(n).key = next[0]
	f.x.byKey.insert(next[0], n)
	f.x.summarize(n)
	f.x.mu.Unlock()
	before := dump(f.x)
	err := f.x.Store(StoreEvent{Engine: "a", HasParent: true, ParentHash: 2, BlockHashes: []uint64{3},
		TokenIDs: prompt(1, 3)[8:], Tier: TierDevice})
	require.ErrorIs(t, err, ErrKeyConflict)
	assert.Equal(t, before, dump(f.x))
}

// TestMatchGallopsPastCrowdedBlocks covers the binary-search intersection: one engine still
// matching against a block that many engines hold, after a hole removed the others.
func TestMatchGallopsPastCrowdedBlocks(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{})
	for i := range 20 {
		f.store(state.EngineID(fmt.Sprintf("e%02d", i)), 0, 1, 0, 4, 0, TierDevice)
	}
	for i := 1; i < 20; i++ {
		require.NoError(t, f.x.Remove(state.EngineID(fmt.Sprintf("e%02d", i)), 0, []uint64{2}, 0))
	}
	got := f.match(1, 4)
	want := map[state.EngineID]int{"e00": 4}
	for i := 1; i < 20; i++ {
		want[state.EngineID(fmt.Sprintf("e%02d", i))] = 1
	}
	assert.Equal(t, want, got)
	// An engine with an expired approximate entry at the crowded block also stops there.
	require.NoError(t, f.x.Assume("late", f.h.Keys(prompt(1, 4)), time.Second))
	assert.Equal(t, 4, f.match(1, 4)["late"])
	f.clock = f.clock.Add(time.Second)
	assert.Zero(t, f.match(1, 4)["late"], "expired at exactly its expiry")
}

func TestEvictionKeepsPrefixesAndFollowsRecency(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{MaxBlocks: 6})
	f.store("a", 0, 1, 0, 3, 0, TierDevice)   // blocks 1-3 of prompt 1
	f.store("b", 0, 2, 0, 3, 100, TierDevice) // blocks 1-3 of prompt 2
	assert.Equal(t, 6, f.x.Stats().Blocks)
	f.store("c", 0, 3, 0, 2, 200, TierDevice) // two more: evict a's two deepest leaves
	s := f.x.Stats()
	assert.Equal(t, 6, s.Blocks)
	assert.Equal(t, uint64(2), s.EvictedBlocks)
	assert.Equal(t, map[state.EngineID]int{"a": 1}, f.match(1, 3), "the least recently stored leaves go first, deepest up")
	assert.ErrorIs(t, f.x.Remove("a", 0, []uint64{3}, 0), ErrUnknownHash, "an evicted block's hash is forgotten")
	require.NoError(t, f.x.Remove("a", 0, []uint64{1}, 0))

	// A Match gives prompt 2's leaf a second chance: prompt 3 goes first.
	f.match(2, 3)
	f.store("d", 0, 4, 0, 2, 300, TierDevice)
	assert.Equal(t, map[state.EngineID]int{"b": 3}, f.match(2, 3), "matched blocks survive")
	assert.Equal(t, map[state.EngineID]int{"c": 1}, f.match(3, 2), "the unmatched prompt lost its leaf")
	require.NoError(t, checkInvariants(f.x))
}

func TestEvictionOfSharedLeafRemovesEveryHolder(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{MaxBlocks: 2})
	f.store("a", 0, 1, 0, 2, 0, TierDevice)
	f.store("b", 1, 1, 0, 2, 100, TierHost)
	f.store("c", 0, 1, 0, 2, 200, TierDisk)
	// Approximate entries are records beside the tree (approx.go): not blocks, never evicted.
	require.NoError(t, f.x.Assume("d", f.h.Keys(prompt(1, 2)), 0))
	f.store("a", 0, 2, 0, 1, 10, TierDevice)
	assert.Equal(t, map[state.EngineID]int{"a": 1, "b": 1, "c": 1, "d": 2}, f.match(1, 2))
	s := f.x.Stats()
	assert.Equal(t, 2, s.Blocks)
	assert.Equal(t, 2, s.ApproximateBlocks, "eviction leaves approximate entries")
	assert.Equal(t, EngineStats{Ranks: 1, HostBlocks: 1}, s.Engines()["b"])
	assert.Equal(t, EngineStats{Ranks: 1, DiskBlocks: 1}, s.Engines()["c"])
	require.NoError(t, checkInvariants(f.x))
}

// TestEvictionWalk drives random operations through a tiny block cap. The model cannot predict
// evictions, so each step checks the invariants and compares Match with a brute-force walk over
// the index's own entries.
func TestEvictionWalk(t *testing.T) {
	t.Parallel()
	for seed := range uint64(4) {
		rng := rand.New(rand.NewPCG(seed, 99))
		f := newFixture(t, Options{MaxBlocks: 12, MaxApproxBlocks: 10})
		for step := range 800 {
			e := state.EngineID(fmt.Sprintf("e%d", rng.IntN(5)))
			pattern, n := rng.IntN(4), 1+rng.IntN(5)
			switch rng.IntN(6) {
			case 0, 1:
				err := f.x.Store(f.event(e, rng.IntN(2), pattern, 0, n, uint64(pattern)*1000, TierDevice))
				require.NoError(t, err)
			case 2:
				from := rng.IntN(n)
				err := f.x.Store(f.event(e, rng.IntN(2), pattern, from, n-from, uint64(pattern)*1000, TierHost))
				if err != nil {
					require.ErrorIs(t, err, ErrUnknownParent)
				}
			case 3:
				err := f.x.Remove(e, rng.IntN(2), hashes(uint64(pattern)*1000, n), 0)
				if err != nil && !errors.Is(err, ErrUnknownHash) {
					require.ErrorIs(t, err, ErrUnknownEngine)
				}
			case 4:
				require.NoError(t, f.x.Assume(e, f.h.Keys(prompt(pattern, n)), time.Duration(1+rng.IntN(3))*time.Second))
			case 5:
				f.clock = f.clock.Add(time.Duration(rng.IntN(800)) * time.Millisecond)
				if rng.IntN(2) == 0 {
					f.x.Expire(f.clock)
				}
			}
			require.NoError(t, checkInvariants(f.x), "seed %d step %d", seed, step)
			require.LessOrEqual(t, f.x.Stats().ApproximateBlocks, 10)
			for p := range 4 {
				keys := f.h.Keys(prompt(p, 5))
				require.Equal(t, bruteMatch(f.x, keys, f.clock.UnixNano()), f.x.Match(keys).Engines, "seed %d step %d", seed, step)
			}
		}
	}
}

// bruteMatch answers a Match from the index's entries without the fast paths.
func bruteMatch(x *Index, keys []uint64, now int64) []EngineMatch {
	x.mu.RLock()
	defer x.mu.RUnlock()
	best := map[state.EngineID]int{}
	for hid, h := range x.holders {
		if !h.live {
			continue
		}
		depth := 0
		prev, inTree := uint32(0), true
		for d, k := range keys {
			n, _, ok := x.byKey.get(k)
			inTree = inTree && ok && x.node(n).parent == prev
			real := false
			if inTree {
				lo, hi := x.findHolder(n, uint32(hid))
				real = lo < hi
			}
			// Or any live record of the holder with this key at this depth.
			placed := false
			for id := 1; id < len(x.places) && !real && !placed; id++ {
				p := &x.places[id]
				j := d - int(p.depth)
				placed = p.live && p.holder == uint32(hid) && p.expiry > now && j >= 0 && j < len(p.keys) && p.keys[j] == k
			}
			if !real && !placed {
				break
			}
			depth++
			prev = n
		}
		id := x.engines[h.engine].id
		if depth > best[id] {
			best[id] = depth
		}
	}
	var out []EngineMatch
	for id, d := range best {
		if d == 0 {
			continue
		}
		out = append(out, EngineMatch{id, d})
	}
	slices.SortFunc(out, func(a, b EngineMatch) int {
		if a.Blocks != b.Blocks {
			return b.Blocks - a.Blocks
		}
		return strings.Compare(string(a.Engine), string(b.Engine))
	})
	return out
}

func TestMatchIntoDoesNotAllocate(t *testing.T) {
	f := newFixture(t, Options{})
	for i := range 8 {
		f.store(state.EngineID(fmt.Sprintf("e%d", i)), i%2, 1, 0, 2+i, uint64(i)*100, TierDevice)
	}
	require.NoError(t, f.x.Assume("approx", f.h.Keys(prompt(1, 3)), 0))
	keys := f.h.Keys(prompt(1, 12))
	var m matches
	f.x.matchInto(keys, &m)
	allocs := testing.AllocsPerRun(100, func() { f.x.matchInto(keys, &m) })
	assert.Zero(t, allocs)
	assert.Len(t, m.Engines, 9)
}
