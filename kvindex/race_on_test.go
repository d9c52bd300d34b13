//go:build race

package kvindex

// raceEnabled reports whether the race detector instruments this build; under it sync.Pool drops
// items at random, so allocation counts of pooled paths are checked without it.
const raceEnabled = true
