//go:build linux

package kvindex

import (
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"unsafe"
)

// hugeAdvice is false when GODEBUG sets disablethp=1, the Go runtime's switch for a process that
// wants no transparent huge pages in its heap (Go 1.21.6 and later): the index then advises none
// either. Only the environment sets it: the go command refuses disablethp in a go.mod godebug
// line or a //go:debug directive, so the binary's build defaults need not be read.
var hugeAdvice atomic.Bool

func init() { hugeAdvice.Store(!disablesTHP(os.Getenv("GODEBUG"))) }

// disablesTHP reports whether a GODEBUG value turns the runtime's disablethp on, read as the
// runtime reads it (golang/go `src/runtime/runtime1.go`, parsegodebug): comma-separated
// key=value fields, no spaces trimmed, the value a decimal int32 and any non-zero value on, a
// value that does not parse ignored, the last valid setting of the key winning.
func disablesTHP(godebug string) bool {
	off := false
	for kv := range strings.SplitSeq(godebug, ",") {
		if k, v, ok := strings.Cut(kv, "="); ok && k == "disablethp" {
			if n, err := strconv.ParseInt(v, 10, 32); err == nil {
				off = n != 0
			}
		}
	}
	return off
}

// adviseHuge asks Linux to back the size bytes at p with transparent huge pages (madvise
// MADV_HUGEPAGE) before anything touches them. The advice covers every 2 MiB region the array
// overlaps (hugeRange), not only the regions inside it: an array's first and last regions are
// shared with its neighbours in the Go heap, and advising only the interior would leave a large
// share of the index in 4 KiB pages. A neighbour in a shared region may get a huge page too; that is what a kernel
// whose policy is "always" does for the whole heap. A region already partly in 4 KiB pages keeps
// them. The advice outlives the array: memory the heap later puts in an advised region is faulted
// in as huge pages too, and under the kernel's default defrag setting ("madvise") such a fault may
// reclaim and compact memory synchronously. Where the kernel's policy is "never", or the call
// fails, nothing changes: it is advice, and its error is ignored. With GODEBUG=disablethp=1 it
// does nothing (hugeAdvice).
func adviseHuge(p unsafe.Pointer, size uintptr) {
	if !hugeAdvice.Load() {
		return
	}
	start, end := hugeRange(uintptr(p), size)
	if end <= start {
		return
	}
	// The range reaches outside the array, so it is passed as addresses, not as a slice: Go's
	// pointer checks (-race) reject a pointer into a neighbour.
	_, _, _ = syscall.Syscall(syscall.SYS_MADVISE, start, end-start, syscall.MADV_HUGEPAGE)
}
