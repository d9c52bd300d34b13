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

// bindTable agrees with a map of (tag, node) slot values through inserts (from the slot a probe
// ended at, after other inserts, or from the home slot), removals with backward shifts, growth
// and shrinking.
func TestBindTableAgreesWithMap(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(3, 4))
	var tb bindTable
	want := map[uint64]int{} // slot value → count
	var live []uint64
	probeEnd := func(tag uint32) int { // where a probe for an absent tag ends
		if len(tb.slots) == 0 {
			return -1
		}
		mask := len(tb.slots) - 1
		i := tb.home(tag)
		for tb.slots[i] != 0 {
			i = (i + 1) & mask
		}
		return i
	}
	for step := range 20000 {
		switch {
		case len(live) > 0 && rng.IntN(3) == 0:
			j := rng.IntN(len(live))
			v := live[j]
			require.True(t, tb.remove(uint32(v>>32), uint32(v)), "step %d", step)
			live[j] = live[len(live)-1]
			live = live[:len(live)-1]
			want[v]--
		default:
			k := 1 + rng.IntN(8)
			tb.reserve(k)
			tags, from := make([]uint32, k), make([]int, k)
			for i := range k {
				tags[i] = uint32(rng.Uint64())
				if rng.IntN(4) == 0 {
					tags[i] = tags[0] // same home slot as another insert of the batch
				}
				from[i] = probeEnd(tags[i])
				if rng.IntN(5) == 0 {
					from[i] = -1
				}
			}
			for i := range k {
				n := uint32(1 + rng.IntN(1<<20))
				tb.insertAt(tags[i], n, from[i])
				v := uint64(tags[i])<<32 | uint64(n)
				live = append(live, v)
				want[v]++
			}
		}
		if step%1000 == 0 || step == 19999 {
			got := map[uint64]int{}
			for _, s := range tb.slots {
				if s != 0 {
					got[s]++
				}
			}
			for v, c := range want {
				if c == 0 {
					delete(want, v)
				}
			}
			require.Equal(t, want, got, "step %d", step)
			require.Equal(t, len(live), tb.len())
			for _, v := range live { // every value is reachable from its home slot
				mask := len(tb.slots) - 1
				i := tb.home(uint32(v >> 32))
				for tb.slots[i] != v {
					require.NotZero(t, tb.slots[i], "step %d: %#x unreachable", step, v)
					i = (i + 1) & mask
				}
			}
		}
	}
	assert.False(t, tb.remove(1, 1))
}
