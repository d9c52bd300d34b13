package cputime

import (
	"time"

	"golang.org/x/sys/unix"
)

// Thread returns the calling thread's CPU time (CLOCK_THREAD_CPUTIME_ID, nanosecond resolution),
// 0 on error. It does not advance while the thread waits for a core, so a per-query figure taken
// with it is far less sensitive to other processes on a shared machine than wall time. The
// caller locks its goroutine to the thread (runtime.LockOSThread).
func Thread() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts); err != nil {
		return 0
	}
	return time.Duration(ts.Nano())
}
