//go:build !race

package kvindex

// raceEnabled reports whether the race detector instruments this build.
const raceEnabled = false
