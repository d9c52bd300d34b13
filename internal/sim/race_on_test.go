//go:build race

package sim

// raceEnabled reports whether the race detector instruments this build. The long replay tests
// whose replays run on one goroutine skip under it; .ci/run runs them without -race.
const raceEnabled = true
