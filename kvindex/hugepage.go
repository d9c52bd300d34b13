package kvindex

import "unsafe"

// hugePage is the size of an x86-64 or arm64 transparent huge page.
const hugePage = 2 << 20

// hugeRange returns the 2 MiB-aligned range [start, end) that covers the size bytes at address
// p, or an empty range for an array smaller than two huge pages, which is not worth advising.
func hugeRange(p, size uintptr) (start, end uintptr) {
	if size < 2*hugePage {
		return 0, 0
	}
	return p &^ (hugePage - 1), (p + size + hugePage - 1) &^ (hugePage - 1)
}

// makeTable returns make([]T, n) for a table's slot array, advising the kernel to back it with
// transparent huge pages when it is large (adviseHuge). A growing table's new array is fresh
// memory written all over at once, whose first touch costs less per byte in huge pages, and huge
// pages spare a table's random probes most TLB misses (docs/performance.md, "Pre-sizing, and the
// cost of fresh memory").
func makeTable[T any](n int) []T {
	s := make([]T, n)
	if n > 0 {
		var z T
		adviseHuge(unsafe.Pointer(&s[0]), uintptr(n)*unsafe.Sizeof(z))
	}
	return s
}
