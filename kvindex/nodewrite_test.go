package kvindex

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Keys inserted from the slots their lookups ended at, after other inserts filled some of those
// slots, are all found again, each once, and their summaries land on their own slots.
func TestNodeTableInsertFromLookupSlots(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(1, 2))
	for round := range 200 {
		var tb nodeTable
		first := 1 + rng.IntN(20)
		for i := range first {
			tb.insert(rng.Uint64(), uint32(i+1))
		}
		more := 1 + rng.IntN(25)
		tb.reserve(more)
		bits := tb.bits
		keys := make([]uint64, more)
		slots := make([]int, more)
		for i := range keys {
			keys[i] = rng.Uint64()
			n, s := tb.lookupSlot(keys[i])
			require.Zero(t, n)
			slots[i] = s
		}
		for i, k := range keys {
			s := tb.insertFrom(k, uint32(first+i+1), slots[i])
			tb.orSumAt(s, k, 1<<(i%30))
			tb.orSumAt(slots[(i+1)%more], k, 1<<30) // a stale slot: found by probing
		}
		require.Equal(t, bits, tb.bits, "round %d: reserve left room", round)
		assert.Equal(t, first+more, tb.len())
		for i, k := range keys {
			n, sum, ok := tb.get(k)
			require.True(t, ok, "round %d key %d", round, i)
			assert.Equal(t, uint32(first+i+1), n)
			assert.Equal(t, uint32(1<<(i%30)|1<<30), sum)
		}
	}
}
