package kvindex_test

import (
	"syscall"
	"time"
	"unsafe"
)

// threadCPU returns the calling thread's CPU time (CLOCK_THREAD_CPUTIME_ID), which does not
// advance while the thread waits for a core, so a per-query figure taken with it is far less
// sensitive to other processes on a shared machine than wall time. The caller locks its
// goroutine to the thread (runtime.LockOSThread).
func threadCPU() time.Duration {
	const clockThreadCPUTimeID = 3
	var ts syscall.Timespec
	if _, _, errno := syscall.Syscall(syscall.SYS_CLOCK_GETTIME, clockThreadCPUTimeID, uintptr(unsafe.Pointer(&ts)), 0); errno != 0 {
		return 0
	}
	return time.Duration(ts.Nano())
}
