//go:build linux

package kvindex

import (
	"syscall"
	"unsafe"
)

// adviseHuge asks Linux to back the size bytes at p with transparent huge pages (madvise
// MADV_HUGEPAGE) before anything touches them. The advice covers every 2 MiB region the array
// overlaps (hugeRange), not only the regions inside it: an array's first and last regions are
// shared with its neighbours in the Go heap, and advising only the interior left about a
// quarter of a production-scale index in 4 KiB pages, whose first touch cost about 4.5 times as
// much per byte on the virtual machine of docs/performance.md ("Pre-sizing, and the cost of
// fresh memory"). A neighbour in a shared region may get a huge page too; that is what a kernel
// whose policy is "always" does for the whole heap. A region already partly in 4 KiB pages keeps
// them. The advice outlives the array: memory the heap later puts in an advised region is faulted
// in as huge pages too, and under the kernel's default defrag setting ("madvise") such a fault may
// reclaim and compact memory synchronously. Where the kernel's policy is "never", or the call
// fails, nothing changes: it is advice, and its error is ignored.
func adviseHuge(p unsafe.Pointer, size uintptr) {
	start, end := hugeRange(uintptr(p), size)
	if end <= start {
		return
	}
	// The range reaches outside the array, so it is passed as addresses, not as a slice: Go's
	// pointer checks (-race) reject a pointer into a neighbour.
	_, _, _ = syscall.Syscall(syscall.SYS_MADVISE, start, end-start, syscall.MADV_HUGEPAGE)
}
