// Package cputime reads the CPU clocks the repository's benchmarks report: the process's CPU time,
// the calling thread's CPU time and the process's minor page faults. On a shared machine CPU time
// moves far less with the load than wall time, since time spent waiting for a core is not counted
// (docs/performance.md, "How these figures were measured"). Where a clock is not available the
// functions return 0, and the figures built on them read 0.
package cputime
