package enginepick_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/flowcontrol"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

const stressCap = 2

// TestFlowControlStress runs clients of every band against the capped flowFleet while dispatches
// end in every way, load reports arrive and an engine leaves and returns, with random
// cancellations and deadlines. Every Select ends once, with a dispatch or a typed error; no
// engine ever has more than its cap in flight; every dispatch is released (no counter is left
// above zero). A second phase, with no deadlines, checks that no waiting request is forgotten: a
// queue that is woken only by dispatch ends drains to the last request.
func TestFlowControlStress(t *testing.T) {
	t.Parallel()
	fc := mustController(t, flowcontrol.Config{MaxQueued: 24, QueueThreshold: 6, Bands: []flowcontrol.Band{
		{Priority: -1, Sheddable: true}, {Priority: 0, TTL: 20 * time.Millisecond}, {Priority: 1, MaxQueued: 8}}})
	f := newFlowFleet(t, fc, stressCap)
	clients, per := 24, 150
	if testing.Short() || raceEnabled {
		per = 60
	}
	var served, failed, overCap atomic.Int64
	var codesMu sync.Mutex
	codes := map[int]int{}
	stop := make(chan struct{})
	var background sync.WaitGroup
	background.Add(2)
	go func() { // engine churn: s2 leaves and returns
		defer background.Done()
		for {
			select {
			case <-stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
			f.reg.Remove("s2")
			f.router.RemoveEngine("s2")
			time.Sleep(time.Millisecond)
			assert.NoError(t, f.reg.Add(state.NewStaticEngine("s2", "m", state.StagePlain)))
		}
	}()
	go func() { // load reports, sometimes saturating the detector
		defer background.Done()
		rng := rand.New(rand.NewPCG(1, 2))
		for {
			select {
			case <-stop:
				for _, id := range []state.EngineID{"s1", "s2", "l1", "p1", "d1"} {
					assert.NoError(t, f.load.Report(loadmon.Report{Engine: id}))
				}
				return
			case <-time.After(500 * time.Microsecond):
			}
			id := []state.EngineID{"s1", "s2", "l1", "p1", "d1"}[rng.IntN(5)]
			assert.NoError(t, f.load.Report(loadmon.Report{Engine: id, WaitingRequests: rng.Uint64N(9)}))
		}
	}()
	var wg sync.WaitGroup
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(c), 7))
			for range per {
				var req *bucket.Request
				switch rng.IntN(3) {
				case 0:
					req = shortReq()
				case 1:
					req = longReq()
				default:
					req = &bucket.Request{Model: "pd", Signals: bucket.Signals{InputTokens: 10}}
				}
				req.Priority = rng.IntN(3) - 1
				req.Flow = fmt.Sprint("tenant-", rng.IntN(3))
				ctx, cancel := context.WithTimeout(context.Background(), time.Duration(rng.IntN(20_000))*time.Microsecond+time.Millisecond)
				if rng.IntN(4) == 0 {
					go cancel() // a client that leaves at once
				}
				d, err := f.router.Select(ctx, req)
				cancel()
				if err != nil {
					failed.Add(1)
					code := bucket.StatusCode(err)
					codesMu.Lock()
					codes[code]++
					codesMu.Unlock()
					var rej *flowcontrol.RejectedError
					var ex *bucket.ExhaustedError
					typed := errors.As(err, &rej) || errors.Is(err, flowcontrol.ErrTimeout) || errors.Is(err, context.Canceled) ||
						errors.Is(err, context.DeadlineExceeded) || errors.As(err, &ex)
					assert.True(t, typed, "untyped error %v", err)
					assert.Contains(t, []int{429, 499, 503, 504}, code, "%v", err)
					continue
				}
				served.Add(1)
				for _, e := range d.Selection.Engines() {
					if f.inflight.Count(e.ID()) > stressCap {
						overCap.Add(1)
					}
				}
				time.Sleep(time.Duration(rng.IntN(300)) * time.Microsecond)
				switch rng.IntN(3) {
				case 0:
					d.Release()
				case 1:
					d.Done(enginepick.Outcome{})
				default:
					d.ReleaseStage(state.StagePrefill)
					d.ReleaseStage(state.StageDecode)
					d.Release()
				}
			}
		}()
	}
	wg.Wait()
	close(stop)
	background.Wait()
	assert.Equal(t, int64(clients*per), served.Load()+failed.Load(), "every Select ended once")
	assert.Zero(t, overCap.Load(), "an engine above its in-flight cap")
	for _, id := range []state.EngineID{"s1", "s2", "l1", "p1", "d1"} {
		assert.Zero(t, f.inflight.Count(id), "engine %s: a dispatch was not released", id)
	}
	t.Logf("served %d, failed %d, statuses %v", served.Load(), failed.Load(), codes)
	require.Positive(t, served.Load())

	// Phase 2: no deadline, no TTL, no reports: 32 clients queue for 4 slots; each dispatch end
	// must wake the next request, to the last.
	g := newFlowFleet(t, mustController(t, flowcontrol.Config{Bands: []flowcontrol.Band{{Priority: 0}, {Priority: 1}}}), stressCap)
	done := make(chan struct{})
	var phase2 atomic.Int64
	var wg2 sync.WaitGroup
	for c := range 32 {
		wg2.Add(1)
		go func() {
			defer wg2.Done()
			for i := range 10 {
				req := shortReq()
				req.Priority, req.Flow = (c+i)%2, fmt.Sprint(c%3)
				d, err := g.router.Select(context.Background(), req)
				if !assert.NoError(t, err) {
					return
				}
				phase2.Add(1)
				if g.inflight.Count(engineOf(d)) > stressCap {
					overCap.Add(1)
				}
				d.Release()
			}
		}()
	}
	go func() { wg2.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatalf("a waiting request was never woken: %d of 320 served", phase2.Load())
	}
	assert.Equal(t, int64(320), phase2.Load())
	assert.Zero(t, overCap.Load())
	assert.Zero(t, g.inflight.Count("s1")+g.inflight.Count("s2"))
}
