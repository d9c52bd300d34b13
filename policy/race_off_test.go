//go:build !race

package policy_test

// raceEnabled reports whether the race detector instruments this build.
const raceEnabled = false
