package loadmon_test

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/loadmon"
)

func TestGuardReleaseIsIdempotent(t *testing.T) {
	t.Parallel()
	f := loadmon.NewInFlight(nil)
	g1 := f.Acquire("e")
	g2 := f.Acquire("e")
	assert.Equal(t, uint64(2), f.Count("e"))
	g1.Release()
	g1.Release()
	assert.Equal(t, uint64(1), f.Count("e"), "a second release of the same guard changes nothing")
	g2.Release()
	assert.Zero(t, f.Count("e"))
	var nilGuard *loadmon.Guard
	nilGuard.Release()
	assert.Zero(t, f.Count("never"))
}

func TestGuardsSurviveEngineRemovalAndReAdd(t *testing.T) {
	t.Parallel()
	f := loadmon.NewInFlight(nil)
	old := f.Acquire("e")
	f.Remove("e")
	assert.Zero(t, f.Count("e"), "a removed engine has no in-flight requests")
	fresh := f.Acquire("e")
	old.Release() // releases into the detached counter, not the re-added engine's
	assert.Equal(t, uint64(1), f.Count("e"))
	fresh.Release()
	assert.Zero(t, f.Count("e"))
}

func TestConcurrentAcquireRelease(t *testing.T) {
	t.Parallel()
	f := loadmon.NewInFlight(nil)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 1000 {
				g := f.Acquire("e")
				_ = f.Count("e")
				_ = f.DispatchesSince("e", time.Time{})
				g.Release()
				g.Release()
			}
		})
	}
	wg.Go(func() {
		for range 100 {
			f.Remove("x")
			f.Acquire("x").Release()
		}
	})
	wg.Wait()
	assert.Zero(t, f.Count("e"))
}

func TestDispatchesSince(t *testing.T) {
	t.Parallel()
	clk := newClock()
	f := loadmon.NewInFlight(clk.Now)
	start := clk.Now()
	for range 3 {
		clk.Advance(time.Millisecond)
		f.Acquire("e").Release() // release does not undo a dispatch
	}
	assert.Equal(t, uint64(3), f.DispatchesSince("e", start))
	assert.Equal(t, uint64(2), f.DispatchesSince("e", start.Add(2*time.Millisecond)), "at or after t")
	assert.Equal(t, uint64(1), f.DispatchesSince("e", clk.Now()), "a dispatch at exactly t counts")
	assert.Zero(t, f.DispatchesSince("e", clk.Now().Add(time.Nanosecond)))
	assert.Zero(t, f.DispatchesSince("other", start))
	for range 100 {
		f.Acquire("e")
	}
	assert.Equal(t, uint64(64), f.DispatchesSince("e", start), "saturates at the ring size")
}

func TestDispatchedSinceSumsPrefillTokens(t *testing.T) {
	t.Parallel()
	clk := newClock()
	f := loadmon.NewInFlight(clk.Now)
	start := clk.Now()
	for i := range 3 {
		clk.Advance(time.Millisecond)
		f.AcquirePrefill("e", uint64(100*(i+1))).Release()
	}
	n, tok := f.DispatchedSince("e", start)
	assert.Equal(t, [2]uint64{3, 600}, [2]uint64{n, tok})
	n, tok = f.DispatchedSince("e", start.Add(2*time.Millisecond))
	assert.Equal(t, [2]uint64{2, 500}, [2]uint64{n, tok}, "at or after t")
	n, tok = f.DispatchedSince("none", start)
	assert.Equal(t, [2]uint64{0, 0}, [2]uint64{n, tok})
	for range 100 {
		f.AcquirePrefill("e", 1)
	}
	n, tok = f.DispatchedSince("e", start)
	assert.Equal(t, [2]uint64{64, 64}, [2]uint64{n, tok}, "the 64 most recent dispatches")
}

func TestAcquireRankAtRecordsTheGivenTime(t *testing.T) {
	t.Parallel()
	clk := newClock()
	f := loadmon.NewInFlight(clk.Now)
	assert.False(t, f.SystemClock(), "a clock was given")
	assert.True(t, loadmon.NewInFlight(nil).SystemClock())

	at := clk.Now().Add(time.Hour) // not the counters' clock reading: the given one is recorded
	g := f.AcquireRankAt("e", 1, 100, at)
	n, tok := f.DispatchedSince("e", at)
	assert.Equal(t, [2]uint64{1, 100}, [2]uint64{n, tok}, "recorded at the given time")
	n, _ = f.DispatchedSince("e", at.Add(time.Nanosecond))
	assert.Zero(t, n, "not later than the given time")
	n, tok = f.DispatchedSinceRank("e", 1, at)
	assert.Equal(t, [2]uint64{1, 100}, [2]uint64{n, tok}, "the rank's dispatch too")
	assert.Equal(t, uint64(1), f.CountRank("e", 1))
	g.Release()
	assert.Zero(t, f.CountRank("e", 1))

	f.AcquireRankAt("z", -1, 0, time.Time{}) // zero: the counters' own clock
	assert.Equal(t, uint64(1), f.DispatchesSince("z", clk.Now()))
	assert.Zero(t, f.DispatchesSince("z", clk.Now().Add(time.Nanosecond)))
}

func TestTryAcquireRankAtCountsOnlyBelowTheLimit(t *testing.T) {
	t.Parallel()
	clk := newClock()
	f := loadmon.NewInFlight(clk.Now)
	at := clk.Now()
	g1, found := f.TryAcquireRankAt("e", 1, 10, 2, at)
	require.NotNil(t, g1)
	assert.Zero(t, found)
	g2, found := f.TryAcquireRankAt("e", -1, 20, 2, time.Time{}) // zero: the counters' own clock
	require.NotNil(t, g2)
	assert.Equal(t, uint64(1), found)

	g3, found := f.TryAcquireRankAt("e", 1, 40, 2, at)
	assert.Nil(t, g3, "the count has reached the limit")
	assert.Equal(t, uint64(2), found)
	assert.Equal(t, uint64(2), f.Count("e"))
	assert.Equal(t, uint64(1), f.CountRank("e", 1), "the refused dispatch counts on no rank")
	n, tok := f.DispatchedSince("e", at)
	assert.Equal(t, [2]uint64{2, 30}, [2]uint64{n, tok}, "and is not recorded as a dispatch")
	n, tok = f.DispatchedSinceRank("e", 1, at)
	assert.Equal(t, [2]uint64{1, 10}, [2]uint64{n, tok})
	g3.Release() // a nil guard

	g1.Release()
	g3, found = f.TryAcquireRankAt("e", 0, 0, 2, at)
	require.NotNil(t, g3, "released below the limit again")
	assert.Equal(t, uint64(1), found)
	assert.Equal(t, uint64(1), f.CountRank("e", 0))

	g, found := f.TryAcquireRankAt("z", -1, 0, 0, at)
	assert.Nil(t, g, "a limit of 0 admits nothing")
	assert.Zero(t, found)
	assert.Zero(t, f.Count("z"))
	assert.Zero(t, f.DispatchesSince("z", at))
}

// Concurrent acquires under a limit never take the count past it, whatever the mix with
// uncapped acquires and releases.
func TestTryAcquireRankAtIsAtomic(t *testing.T) {
	t.Parallel()
	const limit, workers, rounds = 3, 8, 500
	f := loadmon.NewInFlight(nil)
	var wg sync.WaitGroup
	var over atomic.Int64
	for range workers {
		wg.Go(func() {
			for range rounds {
				g, found := f.TryAcquireRankAt("e", 0, 0, limit, time.Time{})
				if g == nil {
					if found < limit {
						over.Add(1) // refused below the limit
					}
					continue
				}
				if n := f.Count("e"); n > limit {
					over.Add(1)
				}
				g.Release()
			}
		})
	}
	wg.Wait()
	assert.Zero(t, over.Load())
	assert.Zero(t, f.Count("e"))
	assert.Zero(t, f.CountRank("e", 0))
}
