//go:build unix

package metrics_test

import (
	"syscall"
	"time"
)

// processCPU returns the process's user + system CPU time so far. On the shared machine the
// benchmarks run on, CPU time per operation moves far less with the load than wall time does,
// since time spent waiting for a core is not counted (docs/performance.md).
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
