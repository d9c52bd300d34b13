//go:build race

package metrics_test

// raceEnabled reports whether the race detector instruments this build; its instrumentation moves
// values to the heap and sync.Pool drops items under it, so exact allocation comparisons skip.
const raceEnabled = true
