package kvindex

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/state"
)

// TestSlabKeepsEntriesAcrossPages fills a slab past several pages one entry at a time and checks
// every entry, and that entries of full pages never move when the slab grows.
func TestSlabKeepsEntriesAcrossPages(t *testing.T) {
	var s slab[uint64]
	const n = 3*slabPageLen + 17
	var firstOfPage1 *uint64
	for i := range n {
		require.Equal(t, i, s.extend(1))
		*s.at(i) = uint64(i) + 1
		if i == slabPageLen {
			firstOfPage1 = s.at(i)
		}
	}
	require.Equal(t, n, s.len())
	assert.Len(t, s.pages, 4)
	assert.Same(t, firstOfPage1, s.at(slabPageLen), "a full page's entries never move")
	for i := range n {
		require.Equal(t, uint64(i)+1, *s.at(i), "entry %d", i)
	}
}

// TestSlabRunsStayInOnePage allocates power-of-two runs as allocRun does (aligned, the skipped
// entries handed back as smaller runs) and checks that each run is one contiguous slice, that runs
// never overlap, and that the skipped runs exactly tile the gaps, including a run longer than a
// page.
func TestSlabRunsStayInOnePage(t *testing.T) {
	var s slab[uint32]
	rng := rand.New(rand.NewPCG(1, 2))
	owner := map[int]int{} // entry → run number
	mark := func(off, k, id int) {
		run := s.span(off, k)
		require.Len(t, run, k)
		for j := range run {
			require.Same(t, &run[j], s.at(off+j), "run %d entry %d", id, j)
			_, dup := owner[off+j]
			require.False(t, dup, "entry %d in two runs", off+j)
			owner[off+j] = id
		}
	}
	id := 0
	for range 3000 {
		c := rng.IntN(8)
		if id == 1500 {
			c = slabPageBits + 1 // two pages at once
		}
		s.alignFor(1<<c, func(off int, class uint32) {
			require.Zero(t, off&(1<<class-1), "a skipped run is aligned to its size")
			id++
			mark(off, 1<<class, id)
		})
		id++
		off := s.extend(1 << c)
		require.Zero(t, off&(min(1<<c, slabPageLen)-1), "run of class %d at %d", c, off)
		mark(off, 1<<c, id)
	}
	require.Len(t, owner, s.len(), "every entry belongs to exactly one run")
}

// TestIndexBeyondOnePage stores enough blocks for several holders that the node and holding slabs
// span many pages, with classes growing and shrinking as holders come and go, and checks the
// invariants and every match against a brute-force walk.
func TestIndexBeyondOnePage(t *testing.T) {
	f := newFixture(t, Options{})
	const blocks = 12_000
	engines := []state.EngineID{"a", "b", "c", "d", "e"}
	for i, e := range engines {
		// Engine i holds the first blocks − i·1000 blocks of pattern 1 and all of its own pattern.
		require.NoError(t, f.x.Store(f.event(e, 0, 1, 0, blocks-i*1000, uint64(i)<<32, TierDevice)))
		require.NoError(t, f.x.Store(f.event(e, 0, 10+i, 0, blocks, uint64(i)<<32|1<<31, TierDevice)))
	}
	require.Greater(t, f.x.nodes.len(), 2*slabPageLen)
	require.Greater(t, f.x.holds.len(), 2*slabPageLen)
	require.NoError(t, checkInvariants(f.x))
	// Drop engine b's tail of pattern 1 (shrinking the runs there), then match.
	require.NoError(t, f.x.Remove("b", 0, hashes(1<<32+5000, blocks-1000-5000), 0))
	require.NoError(t, checkInvariants(f.x))
	keys := f.h.Keys(prompt(1, blocks))
	got := f.x.Match(keys)
	assert.Equal(t, bruteMatch(f.x, keys, 0), got.Engines)
	assert.Equal(t, []EngineMatch{{"a", blocks}, {"c", blocks - 2000}, {"d", blocks - 3000}, {"e", blocks - 4000}, {"b", 5000}},
		got.Engines, fmt.Sprint(got.Engines))
}

// TestHugeRangeCoversTheArray checks the huge-page advice's range: every 2 MiB region the array
// overlaps, aligned, and nothing for an array under two huge pages.
func TestHugeRangeCoversTheArray(t *testing.T) {
	const mib = 1 << 20
	for _, c := range []struct{ p, size, start, end uintptr }{
		{p: 8 * mib, size: 4 * mib, start: 8 * mib, end: 12 * mib},             // aligned
		{p: 9 * mib, size: 4 * mib, start: 8 * mib, end: 14 * mib},             // both ends shared
		{p: 8*mib + 8192, size: 16 * mib, start: 8 * mib, end: 26 * mib},       // Go's 8 KiB alignment
		{p: 10*mib - 8192, size: 4*mib + 8192, start: 8 * mib, end: 14 * mib},  // ends on a boundary
		{p: 9 * mib, size: 4*mib - 1, start: 0, end: 0},                        // under two huge pages
		{p: 0x7f20_1000, size: 32 * mib, start: 0x7f20_0000, end: 0x8140_0000}, // across 2 GiB
	} {
		start, end := hugeRange(c.p, c.size)
		require.Equal(t, [2]uintptr{c.start, c.end}, [2]uintptr{start, end}, "p=%#x size=%#x", c.p, c.size)
		if end > start {
			require.LessOrEqual(t, start, c.p)
			require.GreaterOrEqual(t, end, c.p+c.size)
			require.Zero(t, start%hugePage)
			require.Zero(t, end%hugePage)
		}
	}
}

// TestSlabBatchPages checks the batch sizes of the slab's later pages: at most the pages the
// slab has (a small slab at most doubles), at least 4 MiB and otherwise an eighth of the slab,
// at most 16 MiB, whatever the entry size (slabBatchMinBytes).
func TestSlabBatchPages(t *testing.T) {
	type entry32 [4]uint64 // 1 MiB pages
	type entry16 [2]uint64 // 512 KiB pages
	var s32 slab[entry32]
	var s16 slab[entry16]
	for _, c := range []struct{ pages, want32, want16 int }{
		{1, 1, 1}, {2, 2, 2}, {3, 3, 3}, {4, 4, 4}, {8, 4, 8}, {10, 4, 8}, {32, 4, 8},
		{40, 5, 8}, {64, 8, 8}, {100, 12, 12}, {128, 16, 16}, {200, 16, 25}, {256, 16, 32}, {1000, 16, 32},
	} {
		s32.pages = make([][]entry32, c.pages)
		s16.pages = make([][]entry16, c.pages)
		require.Equal(t, c.want32, s32.batchPages(), "32-byte entries, %d pages", c.pages)
		require.Equal(t, c.want16, s16.batchPages(), "16-byte entries, %d pages", c.pages)
	}
}

// TestSlabFitsOnlyWithinAFullSizedPage: fits promises that extending by k, one entry at a time,
// changes no page (prebuild extends the slabs outside the lock, beside readers that read the
// page list): never while page 0 still grows like a slice, never at a page boundary (a new page),
// and exactly when the k entries end within the current page.
func TestSlabFitsOnlyWithinAFullSizedPage(t *testing.T) {
	var s slab[uint64]
	s.extend(1)
	assert.True(t, s.fits(0))
	assert.False(t, s.fits(1), "page 0 grows like a slice and moves")
	for s.len() < slabPageLen {
		s.extend(1)
	}
	assert.False(t, s.fits(1), "at a page boundary the next entry needs a new page")
	s.extend(1)
	for _, k := range []int{1, 2, slabPageLen - 1, slabPageLen} {
		assert.Equal(t, k <= slabPageLen-1, s.fits(k), "k=%d, one entry into page 1", k)
	}
	for _, k := range []int{0, 1, 7, -1} {
		if k < 0 {
			k = slabPageLen - s.len()&slabPageMask // the rest of the page
		}
		require.True(t, s.fits(k), "k=%d", k)
		pages, first, last := len(s.pages), &s.pages[0][0], &s.pages[len(s.pages)-1][0]
		for range k {
			s.extend(1)
		}
		assert.Equal(t, pages, len(s.pages), "k=%d: no new page", k)
		assert.Same(t, first, &s.pages[0][0], "k=%d: page 0 stays", k)
		assert.Same(t, last, &s.pages[len(s.pages)-1][0], "k=%d: the last page stays", k)
	}
	assert.Equal(t, 2*slabPageLen, s.len())
	assert.False(t, s.fits(1), "the page is full")
}
