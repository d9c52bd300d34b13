//go:build unix

package cputime

import (
	"syscall"
	"time"
)

// Process returns the process's user + system CPU time so far (getrusage), 0 on error.
func Process() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// MinorFaults returns the process's minor page faults so far (pages first touched, among others),
// 0 on error.
func MinorFaults() int64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return int64(ru.Minflt) // int32 on some 32-bit platforms
}
