//go:build !race

package metrics_test

// raceEnabled reports whether the race detector instruments this build.
const raceEnabled = false
