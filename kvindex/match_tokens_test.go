package kvindex

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/state"
)

// matchTokensInto must give exactly matchInto's answer on the prompt's keys, for prompts that
// share prefixes with held chains, diverge at every depth, or carry a partial trailing block.
func TestMatchTokensIntoEqualsMatchIntoOnKeys(t *testing.T) {
	t.Parallel()
	h, err := NewHasher(HasherConfig{BlockTokens: 4, Seed: 7})
	require.NoError(t, err)
	x, err := NewIndex(h, Options{})
	require.NoError(t, err)
	rng := rand.New(rand.NewPCG(1, 2))
	base := make([]uint32, 4*40)
	for i := range base {
		base[i] = rng.Uint32N(50)
	}
	next := uint64(1)
	for e := range 6 {
		for c := range 5 {
			blocks := 1 + rng.IntN(40)
			tokens := append([]uint32(nil), base[:4*blocks]...)
			if c%2 == 1 { // a branch of its own after a random depth
				for i := 4 * rng.IntN(blocks); i < len(tokens); i++ {
					tokens[i] = 1000 + uint32(e*100+c)
				}
			}
			hs := make([]uint64, blocks)
			for i := range hs {
				hs[i] = next
				next++
			}
			require.NoError(t, x.Store(StoreEvent{Engine: state.EngineID(fmt.Sprintf("e%d", e)), DPRank: c % 2,
				BlockHashes: hs, TokenIDs: tokens, Tier: TierDevice}))
		}
	}
	var a, b matches
	for trial := range 500 {
		n := rng.IntN(len(base) + 7)
		q := append([]uint32(nil), base[:min(n, len(base))]...)
		for len(q) < n {
			q = append(q, rng.Uint32N(50))
		}
		if trial%3 == 0 && len(q) > 0 {
			q[rng.IntN(len(q))] = 999 // diverge somewhere
		}
		x.matchInto(h.Keys(q), &a)
		x.matchTokensInto(q, &b)
		require.Equal(t, a.QueryBlocks, b.QueryBlocks, "query of %d tokens", len(q))
		require.Equal(t, a.Engines, b.Engines, "query of %d tokens", len(q))
	}
	x.matchTokensInto(nil, &b)
	assert.Zero(t, b.QueryBlocks)
	assert.Empty(t, b.Engines)
}

func TestMatchTokensIntoDoesNotAllocate(t *testing.T) {
	h, _ := NewHasher(HasherConfig{BlockTokens: 16})
	x, _ := NewIndex(h, Options{})
	tokens := make([]uint32, 8192)
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	hs := make([]uint64, 256)
	for i := range hs {
		hs[i] = uint64(i + 1)
	}
	require.NoError(t, x.Store(StoreEvent{Engine: "a", BlockHashes: hs, TokenIDs: tokens[:4096], Tier: TierDevice}))
	var m matches
	x.matchTokensInto(tokens, &m)
	assert.Equal(t, []EngineMatch{{Engine: "a", Blocks: 256}}, m.Engines)
	allocs := testing.AllocsPerRun(100, func() { x.matchTokensInto(tokens, &m) })
	assert.Zero(t, allocs)
}
