package kvindex

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestTableAgreesWithMap drives the open-addressing table and a Go map with the same random
// puts and deletes, over small key spaces (long probe runs, wrap-around, backward shifts) and
// large ones (growth and shrinking), key 0 included.
func TestTableAgreesWithMap(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name  string
		keys  uint64
		steps int
	}{{"dense", 40, 20_000}, {"sparse", 1 << 40, 20_000}, {"grow-shrink", 5000, 60_000}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			rng := rand.New(rand.NewPCG(c.keys, 3))
			var tb table
			ref := map[uint64]uint32{}
			for step := range c.steps {
				k := rng.Uint64N(c.keys)
				if c.name == "dense" {
					k *= 0x100000000 // collide in the low bits too
				}
				grow := c.name != "grow-shrink" || (step/10_000)%2 == 0
				if rng.IntN(3) == 0 || !grow {
					_, had := ref[k]
					require.Equal(t, had, tb.del(k), "del(%#x) at step %d", k, step)
					delete(ref, k)
				} else {
					v := uint32(rng.IntN(1000) + 1)
					tb.put(k, v)
					ref[k] = v
				}
				if step%997 == 0 {
					require.Equal(t, len(ref), tb.len())
					for rk, rv := range ref {
						got, ok := tb.get(rk)
						require.True(t, ok, "get(%#x) at step %d", rk, step)
						require.Equal(t, rv, got)
					}
					seen := 0
					tb.each(func(k uint64, v uint32) {
						require.Equal(t, ref[k], v)
						seen++
					})
					require.Equal(t, len(ref), seen)
				}
				_, ok := tb.get(k + 1)
				_, want := ref[k+1]
				require.Equal(t, want, ok)
			}
		})
	}
}

func TestTableClearForReusesArrays(t *testing.T) {
	t.Parallel()
	var tb table
	tb.clearFor(100)
	for k := range uint64(100) {
		tb.put(k, 1)
	}
	require.Equal(t, 100, tb.len())
	before := &tb.keys[0]
	tb.clearFor(60)
	require.Zero(t, tb.len())
	require.Same(t, before, &tb.keys[0], "a table not much larger than needed is cleared in place")
	_, ok := tb.get(5)
	require.False(t, ok)
	tb.clearFor(10_000)
	require.GreaterOrEqual(t, 3*len(tb.keys), 4*10_000)
}

// TestU64SetFindsDuplicates checks the scratch set against a map: every value reported absent
// exactly once, 0 included, across reuses of different sizes.
func TestU64SetFindsDuplicates(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(5, 5))
	var s u64Set
	for _, n := range []int{0, 1, 16, 17, 1000, 3, 5000} {
		s.clearFor(n)
		ref := map[uint64]bool{}
		for range n {
			v := rng.Uint64N(uint64(n)+1) * 0x100000000 // collide in the low bits, 0 included
			require.Equal(t, !ref[v], s.add(v), "add(%#x), n=%d", v, n)
			ref[v] = true
		}
	}
}

// TestU64SetSizedForEachEvent checks that the set is sized for the event at hand, not for the
// largest one before it, and reuses its array: a set left at a long event's size would cost a
// cache miss per add, and reallocating it after every long event would fault fresh memory in.
func TestU64SetSizedForEachEvent(t *testing.T) {
	var s u64Set
	s.clearFor(5000)
	first := &s.keys[:1][0]
	for _, n := range []int{750, 5000, 3, 0, 750} {
		allocs := testing.AllocsPerRun(10, func() { s.clearFor(n) })
		require.Zero(t, allocs, "n=%d", n)
		require.LessOrEqual(t, len(s.keys), max(16, 4*n), "n=%d", n)
		require.GreaterOrEqual(t, len(s.keys), 2*n, "n=%d", n)
		require.Same(t, first, &s.keys[:1][0], "n=%d: the array is reused", n)
		require.True(t, s.add(7))
		require.False(t, s.add(7))
	}
}
