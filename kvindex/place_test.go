package kvindex

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// docs/design.md §9.10: Place records the whole prompt for the engine from the keys the lookup
// already computed; a real event supersedes the entries; they expire otherwise.
func TestLocalSourcePlaceRecordsThePromptFromTheLookupsKeys(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{})
	src := f.source()
	tok := prompt(1, 6)
	q := Query{TokenIDs: tok}
	res, err := src.Lookup(context.Background(), q)
	require.NoError(t, err)
	require.Equal(t, OutcomeMiss, res.Outcome)
	require.Empty(t, res.keys, "nobody holds the first block: the lookup hashed it alone and keeps no key, Place hashes the prompt")

	require.NoError(t, src.Place("http://a", 0, q, &res))
	got, err := src.Lookup(context.Background(), q)
	require.NoError(t, err)
	assert.Equal(t, []EngineMatch{{Engine: "http://a", Blocks: 6}}, got.Engines)
	require.NoError(t, checkInvariants(f.x))

	// The engine confirms the first four blocks; the two others stay approximate and expire.
	f.store("http://a", 0, 1, 0, 4, 0, TierDevice)
	f.clock = f.clock.Add(defaultApproxTTL + time.Second)
	got, err = src.Lookup(context.Background(), q)
	require.NoError(t, err)
	assert.Equal(t, []EngineMatch{{Engine: "http://a", Blocks: 4}}, got.Engines, "real blocks never expire")
	require.NoError(t, checkInvariants(f.x))
}

func TestLocalSourcePlaceEdgeCases(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{})
	src := f.source()
	other, err := NewLocalSource(f.x)
	require.NoError(t, err)
	tok := prompt(2, 3)
	q := Query{TokenIDs: tok}

	// A result of another source, of no source, or of a different prompt: q is hashed again.
	foreign, err := other.Lookup(context.Background(), Query{TokenIDs: prompt(3, 5)})
	require.NoError(t, err)
	for name, r := range map[string]*Result{"nil": nil, "other source and prompt": &foreign, "zero": {}} {
		f2 := newFixture(t, Options{})
		s2, err := NewLocalSource(f2.x)
		require.NoError(t, err)
		require.NoError(t, s2.Place("http://b", 0, q, r), name)
		assert.Equal(t, 3, f2.x.Match(f2.h.Keys(tok)).Blocks("http://b"), name)
	}

	// Nothing is recorded when the result says the engine holds every block already.
	f.store("http://a", 0, 2, 0, 3, 0, TierDevice)
	res, err := src.Lookup(context.Background(), q)
	require.NoError(t, err)
	require.NoError(t, src.Place("http://a", 0, q, &res))
	assert.Zero(t, f.x.Stats().ApproximateBlocks)

	// A prompt shorter than a block records nothing; an empty engine is refused.
	require.NoError(t, src.Place("http://a", 0, Query{TokenIDs: tok[:testBlock-1]}, nil))
	assert.ErrorIs(t, src.Place("", 0, q, &res), ErrInvalidEngine)
}

// Reusing the lookup's keys saves hashing the prompt again: when the walk hashed every block
// (another engine holds the whole prompt), Place with the result allocates less than without it.
func TestLocalSourcePlaceReusesTheLookupsKeys(t *testing.T) {
	f := newFixture(t, Options{})
	src := f.source()
	f.store("http://b", 0, 4, 0, 8, 0, TierDevice)
	tok := prompt(4, 8)
	q := Query{TokenIDs: tok}
	res, err := src.Lookup(context.Background(), q)
	require.NoError(t, err)
	require.Len(t, res.keys, 8)
	require.NoError(t, src.Place("http://a", 0, q, &res)) // the holding entries exist from here on
	with := testing.AllocsPerRun(50, func() { _ = src.Place("http://a", 0, q, &res) })
	without := testing.AllocsPerRun(50, func() { _ = src.Place("http://a", 0, q, nil) })
	assert.Less(t, with, without, "with the lookup's keys %v allocations, hashing again %v", with, without)
}

// When the engine holds a prefix through real events, Place records only the blocks after it;
// when the prefix is gone by then, it records the whole prompt.
func TestLocalSourcePlaceSkipsARealPrefix(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{})
	src := f.source()
	f.store("http://a", 0, 7, 0, 4, 0, TierDevice)
	q := Query{TokenIDs: prompt(7, 10)}
	res, err := src.Lookup(context.Background(), q)
	require.NoError(t, err)
	require.Equal(t, 4, res.Blocks("http://a"))
	require.NoError(t, src.Place("http://a", 0, q, &res))
	assert.Equal(t, 6, f.x.Stats().ApproximateBlocks, "blocks 5–10 only")
	assert.Equal(t, 10, f.x.Match(f.h.Keys(q.TokenIDs)).Blocks("http://a"))
	require.NoError(t, checkInvariants(f.x))

	g := newFixture(t, Options{})
	gs, err := NewLocalSource(g.x)
	require.NoError(t, err)
	g.store("http://a", 0, 7, 0, 4, 0, TierDevice)
	res, err = gs.Lookup(context.Background(), q)
	require.NoError(t, err)
	require.NoError(t, g.x.Clear("http://a", 0)) // the engine dropped its cache meanwhile
	require.NoError(t, gs.Place("http://a", 0, q, &res))
	assert.Equal(t, 10, g.x.Stats().ApproximateBlocks, "no real prefix left: every block")
	assert.Equal(t, 10, g.x.Match(g.h.Keys(q.TokenIDs)).Blocks("http://a"))
	require.NoError(t, checkInvariants(g.x))
}

// The keys a hit's result keeps for Place are its own: later lookups through the same source (and
// its pooled scratch) hash into other buffers.
func TestLocalSourceResultKeepsItsKeys(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{})
	f.store("http://a", 0, 1, 0, 6, 0, TierDevice)
	f.store("http://a", 0, 2, 0, 6, 100, TierDevice)
	src := f.source()
	first, err := src.Lookup(context.Background(), Query{TokenIDs: prompt(1, 6)})
	require.NoError(t, err)
	want := f.h.Keys(prompt(1, 6))
	require.Equal(t, want, first.keys)
	for range 3 {
		_, err := src.Lookup(context.Background(), Query{TokenIDs: prompt(2, 6)})
		require.NoError(t, err)
	}
	assert.Equal(t, want, first.keys)
}

// A lookup with lent buffers answers exactly as one without, allocates nothing once they have
// grown, hands Place the same keys, and leaves nothing of the caller's memory in the source: a
// later lookup without buffers does not write into them.
func TestLocalSourceLookupBuffers(t *testing.T) {
	f := newFixture(t, Options{})
	src := f.source()
	f.store("http://b", 1, 4, 0, 8, 0, TierDevice)
	f.store("http://a", 0, 4, 0, 5, 100, TierDevice)
	ctx := context.Background()
	tok := prompt(4, 8)
	want, err := src.Lookup(ctx, Query{TokenIDs: tok})
	require.NoError(t, err)
	require.Equal(t, OutcomeHit, want.Outcome)

	var b LookupBuffers
	q := Query{TokenIDs: tok, Buffers: &b}
	got, err := src.Lookup(ctx, q)
	require.NoError(t, err)
	assert.Equal(t, want.Outcome, got.Outcome)
	assert.Equal(t, want.Engines, got.Engines)
	assert.Equal(t, []int{1, 0}, got.DPRanks)
	assert.Equal(t, want.DPRanks, got.DPRanks)
	assert.Equal(t, want.QueryBlocks, got.QueryBlocks)
	assert.Equal(t, want.keys, got.keys)
	assert.Same(t, &b.engines[0], &got.Engines[0], "the result is built in the lent buffers")
	assert.Same(t, &b.keys[:1][0], &got.keys[0])
	if !raceEnabled {
		allocs := testing.AllocsPerRun(100, func() { got, _ = src.Lookup(ctx, q) })
		assert.Zero(t, allocs)
	}

	keys := append([]uint64(nil), got.keys...)
	other := prompt(7, 3)
	_, err = src.Lookup(ctx, Query{TokenIDs: other}) // no buffers: must not reuse b's memory
	require.NoError(t, err)
	assert.Equal(t, keys, b.keys[:len(keys)], "a later lookup without buffers wrote into the lent ones")

	require.NoError(t, src.Place("http://c", 0, q, &got))
	m := f.x.Match(f.h.Keys(tok))
	assert.Equal(t, 8, m.Blocks("http://c"))

	// A miss through lent buffers is a miss, with no engines.
	miss, err := src.Lookup(ctx, Query{TokenIDs: prompt(9, 3), Buffers: &b})
	require.NoError(t, err)
	assert.Equal(t, OutcomeMiss, miss.Outcome)
	assert.Nil(t, miss.Engines)
	assert.Nil(t, miss.DPRanks)
}

// A Memo shares its result between callers, so it must not build it in one caller's buffers.
func TestMemoIgnoresLookupBuffers(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{})
	src := f.source()
	f.store("http://a", 0, 4, 0, 8, 0, TierDevice)
	var b LookupBuffers
	res, err := new(Memo).Lookup(context.Background(), src, Query{TokenIDs: prompt(4, 8), Buffers: &b})
	require.NoError(t, err)
	require.Equal(t, []EngineMatch{{Engine: "http://a", Blocks: 8}}, res.Engines)
	assert.Nil(t, b.engines)
	assert.Nil(t, b.keys)
}
