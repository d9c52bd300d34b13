//go:build linux

package kvindex

import (
	"syscall"
	"unsafe"
)

// adviseHuge asks Linux to back the 2 MiB-aligned part of the size bytes at p with transparent
// huge pages (madvise MADV_HUGEPAGE) before anything touches them. Where the kernel's policy is
// "never", or the call fails, nothing changes: it is advice, and its error is ignored.
func adviseHuge(p unsafe.Pointer, size uintptr) {
	if size < 2*hugePage {
		return
	}
	start := (uintptr(p) + hugePage - 1) &^ (hugePage - 1)
	end := (uintptr(p) + size) &^ (hugePage - 1)
	if end <= start {
		return
	}
	_ = syscall.Madvise(unsafe.Slice((*byte)(unsafe.Add(p, start-uintptr(p))), end-start), syscall.MADV_HUGEPAGE)
}
