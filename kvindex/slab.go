package kvindex

import (
	"math/bits"
	"slices"
	"unsafe"
)

// slab is a growable array addressed by index, kept as fixed pages so that growing it never
// copies what it holds: the index's node and holding slabs reach hundreds of megabytes, and
// growing them as one slice would copy the whole slab into fresh memory at every step. Page 0
// grows like a slice until it is
// full, so a small index stays small; every later page has slabPageLen entries, except that a
// run longer than a page (spanPages) gets one allocation shared by as many page slots as it
// covers. Entries of a full page never move; page 0 moves while it grows, as a slice would. The zero
// slab is empty. Not safe for concurrent mutation; concurrent reads are safe.
type slab[T any] struct {
	// pages[i] holds entries [i<<slabPageBits, …); its slice runs to the end of its allocation,
	// so a run inside it is one sub-slice.
	pages [][]T
	n     int // entries in use: [0, n)
	// spare is the rest of the last batch of pages allocated together (newPage), not yet in use.
	spare []T
}

const (
	slabPageBits = 15
	slabPageLen  = 1 << slabPageBits
	slabPageMask = slabPageLen - 1
)

// at returns the address of entry i < len().
func (s *slab[T]) at(i int) *T { return &s.pages[i>>slabPageBits][i&slabPageMask] }

// span returns entries [i, i+k) as one slice; they must lie in one allocation (extend returned
// them together, or they lie in one page).
func (s *slab[T]) span(i, k int) []T {
	o := i & slabPageMask
	return s.pages[i>>slabPageBits][o : o+k : o+k]
}

// fits reports whether k more entries, added one at a time, lie in the slab's current page:
// extend then writes only entries past len() and changes no page (page 0, which grows like a
// slice and moves, never fits).
func (s *slab[T]) fits(k int) bool {
	if k == 0 {
		return true
	}
	o := s.n & slabPageMask
	return s.n >= slabPageLen && o != 0 && o+k <= slabPageLen
}

// len returns the number of entries.
func (s *slab[T]) len() int { return s.n }

// extend appends k zero entries, contiguous in memory, and returns the first one's index. k must
// be a power of two and len() a multiple of min(k, slabPageLen), so that a run of at most a page
// never straddles two pages (the holding runs are allocated so: allocRun).
func (s *slab[T]) extend(k int) int {
	i := s.n
	switch {
	case i < slabPageLen && i+k <= slabPageLen: // page 0, still growing like a slice
		if len(s.pages) == 0 {
			s.pages = append(s.pages, nil)
		}
		p := s.pages[0]
		p = slices.Grow(p, k)[:i+k]
		clear(p[i:])
		s.pages[0] = p
	case k <= slabPageLen:
		if i&slabPageMask == 0 {
			s.pages = append(s.pages, s.newPage())
		}
	default: // a run of several pages, page-aligned: one allocation, a page slot per page it covers
		big := make([]T, k)
		for j := 0; j < k; j += slabPageLen {
			s.pages = append(s.pages, big[j:])
		}
	}
	s.n += k
	return i
}

// alignFor extends the slab to the next multiple of min(k, slabPageLen), as aligned runs of
// decreasing size, and calls fn with each (off, log2 of its length). allocRun puts them on its
// free lists, so nothing is lost.
func (s *slab[T]) alignFor(k int, fn func(off int, class uint32)) {
	a := min(k, slabPageLen)
	for s.n&(a-1) != 0 {
		c := uint32(bits.TrailingZeros(uint(s.n)))
		fn(s.extend(1<<c), c)
	}
}

// A slab's pages after the first are allocated in batches of slabBatchMinBytes, or an eighth of
// the slab when that is more, up to slabBatchMaxBytes (and never more pages than the slab
// already has, so a small slab at most doubles, as a slice would). Huge-page advice covers the 2
// MiB regions a batch overlaps (adviseHuge), but a region shared with a neighbour that was
// touched first stays in 4 KiB pages, so a large index gains from large batches, which leave
// fewer such edges. The last batch's unused tail is address space the heap counts and nothing
// touches; an eighth of the slab bounds it, so a small index does not pay for a large batch.
const (
	slabBatchMinBytes = 2 * hugePage
	slabBatchMaxBytes = 8 * hugePage
)

// newPage returns a fresh page after page 0, from the current batch (above), advised to be
// backed by huge pages before anything touches them: the first write to fresh memory costs less
// per byte in huge pages (docs/performance.md, "Pre-sizing, and the cost of fresh memory"), the
// node and holding slabs are half of a large index's memory, and huge pages spare the random
// node reads of an ingest TLB misses.
func (s *slab[T]) newPage() []T {
	if len(s.spare) == 0 {
		s.spare = makeTable[T](s.batchPages() * slabPageLen)
	}
	p := s.spare
	s.spare = s.spare[slabPageLen:]
	return p
}

// batchPages returns how many pages newPage allocates together next (slabBatchMinBytes above).
func (s *slab[T]) batchPages() int {
	var z T
	pageBytes := int(unsafe.Sizeof(z)) * slabPageLen
	lo, hi := max(1, slabBatchMinBytes/pageBytes), max(1, slabBatchMaxBytes/pageBytes)
	return min(len(s.pages), max(lo, min(hi, len(s.pages)/8)))
}
