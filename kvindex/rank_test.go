package kvindex

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/state"
)

// A match names, per engine, the DP rank holding its deepest prefix (the lowest on a tie), so
// that a cache-aware pick sends the request to that rank (docs/design.md §6, §11).
func TestMatchNamesTheDeepestRank(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{})
	f.store("http://a", 0, 1, 0, 2, 0, TierDevice)
	f.store("http://a", 3, 1, 0, 5, 100, TierDevice)
	f.store("http://a", 1, 1, 0, 5, 200, TierHost)
	f.store("http://b", 2, 1, 0, 4, 300, TierDevice)
	m := f.x.Match(f.h.Keys(prompt(1, 6)))
	assert.Equal(t, []EngineMatch{{Engine: "http://a", Blocks: 5}, {Engine: "http://b", Blocks: 4}}, m.Engines)
	assert.Equal(t, []int{1, 2}, m.DPRanks, "a: ranks 1 and 3 hold five blocks, the lower wins; b: rank 2")

	var into matches
	f.x.matchInto(f.h.Keys(prompt(9, 3)), &into)
	assert.Empty(t, into.Engines)
	assert.Empty(t, into.DPRanks, "a reused matches is reset")

	src := f.source()
	res, err := src.Lookup(context.Background(), Query{TokenIDs: prompt(1, 6)})
	require.NoError(t, err)
	assert.Equal(t, []int{1, 2}, res.DPRanks, "a local source's hits name the ranks")
	f.x.markUntrusted("http://a", 1)
	res, err = src.Lookup(context.Background(), Query{TokenIDs: prompt(1, 6)})
	require.NoError(t, err)
	assert.Equal(t, []EngineMatch{{Engine: "http://b", Blocks: 4}}, res.Engines)
	assert.Equal(t, []int{2}, res.DPRanks, "ranks follow their engines through the trust filter")
}

// A placement that names a rank is recorded on that rank, even when another rank of the engine
// already holds the whole prompt; a real Store by that rank confirms it.
func TestPlaceRankRecordsOnTheRank(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{})
	src := f.source()
	f.store("http://a", 0, 1, 0, 4, 0, TierDevice)
	q := Query{TokenIDs: prompt(1, 4)}
	res, err := src.Lookup(context.Background(), q)
	require.NoError(t, err)
	require.Equal(t, []int{0}, res.DPRanks)

	require.NoError(t, src.Place("http://b", 2, q, &res))
	require.NoError(t, src.Place("http://a", 1, q, &res), "rank 0's holding says nothing of rank 1's")
	m := f.x.Match(f.h.Keys(prompt(1, 4)))
	assert.Equal(t, []EngineMatch{{Engine: "http://a", Blocks: 4}, {Engine: "http://b", Blocks: 4}}, m.Engines)
	assert.Equal(t, []int{0, 2}, m.DPRanks)
	require.NoError(t, checkInvariants(f.x))

	// Rank 0 forgets it; rank 1's placement remains and names rank 1.
	require.NoError(t, f.x.Clear("http://a", 0))
	m = f.x.Match(f.h.Keys(prompt(1, 4)))
	assert.Equal(t, []int{1, 2}, m.DPRanks)
	f.store("http://a", 1, 1, 0, 4, 50, TierDevice) // the engine confirms on rank 1
	require.NoError(t, checkInvariants(f.x))
	assert.Equal(t, 4, f.x.Match(f.h.Keys(prompt(1, 4))).Blocks("http://a"))

	err = f.x.AssumeRank("http://a", -1, f.h.Keys(prompt(1, 1)), 0)
	var ee *EventError
	require.ErrorAs(t, err, &ee)
	assert.ErrorIs(t, err, ErrInvalidRank)
}

// Stats.Ranks counts each (engine, DP rank)'s blocks by tier, sorted, with its trust mark; a
// cleared rank stays listed with nothing.
func TestRankStats(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{})
	assert.Nil(t, f.x.Stats().Ranks)
	f.store("http://b", 1, 1, 0, 3, 0, TierDevice)
	f.store("http://a", 2, 2, 0, 2, 100, TierHost)
	f.store("http://b", 0, 3, 0, 4, 200, TierDevice|TierDisk)
	f.store("http://a", 0, 4, 0, 1, 300, TierExternal)
	require.NoError(t, f.x.AssumeRank("http://a", 0, f.h.Keys(prompt(5, 2)), 0))
	require.NoError(t, f.x.markUntrusted("http://b", 1))
	require.NoError(t, f.x.Clear("http://a", 2))
	assert.Equal(t, []RankStats{
		{Engine: "http://a", DPRank: 0, ExternalBlocks: 1, ApproximateBlocks: 2},
		{Engine: "http://a", DPRank: 2},
		{Engine: "http://b", DPRank: 0, DeviceBlocks: 4, DiskBlocks: 4},
		{Engine: "http://b", DPRank: 1, DeviceBlocks: 3, Untrusted: true},
	}, f.x.Stats().Ranks)
	assert.Equal(t, []state.EngineID{"http://b"}, f.x.Stats().Untrusted)
}
