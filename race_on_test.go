//go:build race

package enginepick_test

// raceEnabled reports whether this test binary was built with -race.
const raceEnabled = true
