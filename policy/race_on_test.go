//go:build race

package policy_test

// raceEnabled reports whether the race detector instruments this build; its instrumentation can
// move stack values to the heap, so exact allocation comparisons skip under it.
const raceEnabled = true
