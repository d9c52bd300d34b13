package loadmon_test

import (
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/internal/loadbridge"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

func TestGuardReleaseIsIdempotent(t *testing.T) {
	t.Parallel()
	f := loadmon.NewInFlight(nil)
	g1 := f.Acquire("e", -1, 0)
	g2 := f.Acquire("e", -1, 0)
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
	old := f.Acquire("e", -1, 0)
	f.Remove("e")
	assert.Zero(t, f.Count("e"), "a removed engine has no in-flight requests")
	fresh := f.Acquire("e", -1, 0)
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
				g := f.Acquire("e", -1, 0)
				_ = f.Count("e")
				_ = dispatches(f, "e", time.Time{})
				g.Release()
				g.Release()
			}
		})
	}
	wg.Go(func() {
		for range 100 {
			f.Remove("x")
			f.Acquire("x", -1, 0).Release()
		}
	})
	wg.Wait()
	assert.Zero(t, f.Count("e"))
}

func TestDispatchedSinceCountsDispatches(t *testing.T) {
	t.Parallel()
	clk := newClock()
	f := loadmon.NewInFlight(clk.Now)
	start := clk.Now()
	for range 3 {
		clk.Advance(time.Millisecond)
		f.Acquire("e", -1, 0).Release() // release does not undo a dispatch
	}
	assert.Equal(t, uint64(3), dispatches(f, "e", start))
	assert.Equal(t, uint64(2), dispatches(f, "e", start.Add(2*time.Millisecond)), "at or after t")
	assert.Equal(t, uint64(1), dispatches(f, "e", clk.Now()), "a dispatch at exactly t counts")
	assert.Zero(t, dispatches(f, "e", clk.Now().Add(time.Nanosecond)))
	assert.Zero(t, dispatches(f, "other", start))
	for range 100 {
		f.Acquire("e", -1, 0)
	}
	assert.Equal(t, uint64(64), dispatches(f, "e", start), "saturates at the ring size")
}

func TestDispatchedSinceSumsPrefillTokens(t *testing.T) {
	t.Parallel()
	clk := newClock()
	f := loadmon.NewInFlight(clk.Now)
	start := clk.Now()
	for i := range 3 {
		clk.Advance(time.Millisecond)
		f.Acquire("e", -1, uint64(100*(i+1))).Release()
	}
	n, tok := f.DispatchedSince("e", -1, start)
	assert.Equal(t, [2]uint64{3, 600}, [2]uint64{n, tok})
	n, tok = f.DispatchedSince("e", -1, start.Add(2*time.Millisecond))
	assert.Equal(t, [2]uint64{2, 500}, [2]uint64{n, tok}, "at or after t")
	n, tok = f.DispatchedSince("none", -1, start)
	assert.Equal(t, [2]uint64{0, 0}, [2]uint64{n, tok})
	for range 100 {
		f.Acquire("e", -1, 1)
	}
	n, tok = f.DispatchedSince("e", -1, start)
	assert.Equal(t, [2]uint64{64, 64}, [2]uint64{n, tok}, "the 64 most recent dispatches")
}

// TryAcquire records the caller's clock reading when the counters use time.Now (a Router that read
// the clock at dispatch), and reads its own clock otherwise or when given none.
func TestTryAcquireRecordsTheCallersClockReading(t *testing.T) {
	t.Parallel()
	f := loadmon.NewInFlight(nil)
	at := time.Now().Add(time.Hour) // not a reading the counters could make: the given one is recorded
	g, found := f.TryAcquire("e", 1, 100, math.MaxUint64, at)
	require.NotNil(t, g)
	assert.Zero(t, found)
	n, tok := f.DispatchedSince("e", -1, at)
	assert.Equal(t, [2]uint64{1, 100}, [2]uint64{n, tok}, "recorded at the given time")
	n, _ = f.DispatchedSince("e", -1, at.Add(time.Nanosecond))
	assert.Zero(t, n, "not later than the given time")
	n, tok = f.DispatchedSince("e", 1, at)
	assert.Equal(t, [2]uint64{1, 100}, [2]uint64{n, tok}, "the rank's dispatch too")
	assert.Equal(t, uint64(1), f.CountRank("e", 1))
	g.Release()
	assert.Zero(t, f.CountRank("e", 1))

	clk := newClock()
	own := loadmon.NewInFlight(clk.Now)
	own.TryAcquire("z", -1, 0, math.MaxUint64, clk.Now().Add(time.Hour)) // another clock: its own reading
	own.TryAcquire("y", -1, 0, math.MaxUint64, time.Time{})              // zero: the counters' own clock
	for _, id := range []state.EngineID{"z", "y"} {
		assert.Equal(t, uint64(1), dispatches(own, id, clk.Now()), id)
		assert.Zero(t, dispatches(own, id, clk.Now().Add(time.Nanosecond)), id)
	}
}

// dispatches is the number of dispatches to the engine at or after t.
func dispatches(f *loadmon.InFlight, engine state.EngineID, t time.Time) uint64 {
	n, _ := f.DispatchedSince(engine, -1, t)
	return n
}

func TestTryAcquireCountsOnlyBelowTheLimit(t *testing.T) {
	t.Parallel()
	clk := newClock()
	f := loadmon.NewInFlight(clk.Now)
	at := clk.Now()
	g1, found := f.TryAcquire("e", 1, 10, 2, at)
	require.NotNil(t, g1)
	assert.Zero(t, found)
	g2, found := f.TryAcquire("e", -1, 20, 2, time.Time{}) // zero: the counters' own clock
	require.NotNil(t, g2)
	assert.Equal(t, uint64(1), found)

	g3, found := f.TryAcquire("e", 1, 40, 2, at)
	assert.Nil(t, g3, "the count has reached the limit")
	assert.Equal(t, uint64(2), found)
	assert.Equal(t, uint64(2), f.Count("e"))
	assert.Equal(t, uint64(1), f.CountRank("e", 1), "the refused dispatch counts on no rank")
	n, tok := f.DispatchedSince("e", -1, at)
	assert.Equal(t, [2]uint64{2, 30}, [2]uint64{n, tok}, "and is not recorded as a dispatch")
	n, tok = f.DispatchedSince("e", 1, at)
	assert.Equal(t, [2]uint64{1, 10}, [2]uint64{n, tok})
	g3.Release() // a nil guard

	g1.Release()
	g3, found = f.TryAcquire("e", 0, 0, 2, at)
	require.NotNil(t, g3, "released below the limit again")
	assert.Equal(t, uint64(1), found)
	assert.Equal(t, uint64(1), f.CountRank("e", 0))

	g, found := f.TryAcquire("z", -1, 0, 0, at)
	assert.Nil(t, g, "a limit of 0 admits nothing")
	assert.Zero(t, found)
	assert.Zero(t, f.Count("z"))
	assert.Zero(t, dispatches(f, "z", at))
}

// Concurrent acquires under a limit never take the count past it, whatever the mix with
// uncapped acquires and releases.
func TestTryAcquireIsAtomic(t *testing.T) {
	t.Parallel()
	const limit, workers, rounds = 3, 8, 500
	f := loadmon.NewInFlight(nil)
	var wg sync.WaitGroup
	var over atomic.Int64
	for range workers {
		wg.Go(func() {
			for range rounds {
				g, found := f.TryAcquire("e", 0, 0, limit, time.Time{})
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

// prefilling counts the prefill tokens in flight without a first token, once some first token has
// been seen.
func TestPrefillingCountsDispatchesWithoutFirstToken(t *testing.T) {
	t.Parallel()
	f := loadmon.NewInFlight(nil)
	a := f.Acquire("e", -1, 100)
	b := f.Acquire("e", -1, 30)
	assert.Equal(t, uint64(0), loadbridge.Prefilling(f, "e"), "no first token seen: unknown")
	a.FirstToken()
	assert.Equal(t, uint64(30), loadbridge.Prefilling(f, "e"))
	assert.Equal(t, uint64(0), loadbridge.Prefilling(f, "other"))
	b.Release()
	assert.Equal(t, uint64(0), loadbridge.Prefilling(f, "e"))
	a.Release()
}
