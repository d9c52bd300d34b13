package flowcontrol_test

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/flowcontrol"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

const benchWaiting = 10_000

// benchRouter is a Router with flow control over one engine with an in-flight cap of 1, and the
// dispatch that holds the engine.
func benchRouter(b *testing.B) (*enginepick.Router, *flowcontrol.Controller, *enginepick.Dispatch) {
	b.Helper()
	fc, err := flowcontrol.New(flowcontrol.Config{MaxQueued: benchWaiting})
	if err != nil {
		b.Fatal(err)
	}
	reg, err := state.NewStaticRegistry(state.NewStaticEngine("e", model, state.StagePlain))
	if err != nil {
		b.Fatal(err)
	}
	load, inflight := loadmon.NewTable(), loadmon.NewInFlight(nil)
	p, err := policy.NewLeastLoad(policy.Config{Load: load, InFlight: inflight, Admission: admission.Limits{MaxInFlightRequests: admission.Cap(1)}})
	if err != nil {
		b.Fatal(err)
	}
	g, err := bucket.NewEngineGroup(p, nil)
	if err != nil {
		b.Fatal(err)
	}
	bk, err := bucket.NewPlainBucket(bucket.Spec{ID: "all"}, g)
	if err != nil {
		b.Fatal(err)
	}
	res, err := bucket.NewResolver([]*bucket.Bucket{bk}, bucket.ResolverOptions{})
	if err != nil {
		b.Fatal(err)
	}
	r, err := enginepick.NewRouter(enginepick.Options{Registry: reg, Load: load, InFlight: inflight,
		Resolvers: map[state.ModelID]*bucket.Resolver{model: res}, FlowControl: fc})
	if err != nil {
		b.Fatal(err)
	}
	d, err := r.Select(context.Background(), benchReq(0))
	if err != nil {
		b.Fatal(err)
	}
	return r, fc, d
}

func benchReq(i int) *bucket.Request {
	return &bucket.Request{Model: model, Signals: bucket.Signals{InputTokens: 1000}, Flow: string(rune('a' + i%16))}
}

func waitQueued(fc *flowcontrol.Controller, n int) {
	for flowcontrol.Queued(fc, model) != n {
		time.Sleep(100 * time.Microsecond)
	}
}

// BenchmarkQueued measures 10,000 Router.Selects waiting on a saturated engine (16 flows): the
// memory each waiting request allocates on arrival (its refused selection included) and keeps
// while it waits (the heap, not its goroutine's stack).
func BenchmarkQueued(b *testing.B) {
	var allocs, bytes, retained uint64
	for range b.N {
		b.StopTimer()
		r, fc, held := benchRouter(b)
		ctx, cancel := context.WithCancel(context.Background())
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range benchWaiting {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				if _, err := r.Select(ctx, benchReq(i)); err == nil {
					b.Error("served while the engine is held")
				}
			}()
		}
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		b.StartTimer()
		close(start)
		waitQueued(fc, benchWaiting)
		b.StopTimer()
		runtime.GC()
		runtime.ReadMemStats(&after)
		allocs += after.Mallocs - before.Mallocs
		bytes += after.TotalAlloc - before.TotalAlloc
		retained += after.HeapAlloc - before.HeapAlloc
		cancel()
		wg.Wait()
		held.Release()
	}
	n := float64(b.N * benchWaiting)
	b.ReportMetric(float64(allocs)/n, "allocs/request")
	b.ReportMetric(float64(bytes)/n, "B/request")
	b.ReportMetric(float64(retained)/n, "retained-B/request")
}

// BenchmarkWake measures one dispatch end with 100 and 10,000 requests waiting: Dispatch.Release
// wakes the queue, the first request's selection succeeds and its Select returns, the next
// request's selection is refused. The served client queues again at the tail, so as many keep
// waiting. The cost does not grow with the queue.
func BenchmarkWake(b *testing.B) {
	for _, n := range []int{100, benchWaiting} {
		b.Run(fmt.Sprintf("waiting=%d", n), func(b *testing.B) { benchWake(b, n) })
	}
}

func benchWake(b *testing.B, waiting int) {
	r, fc, held := benchRouter(b)
	ctx, cancel := context.WithCancel(context.Background())
	dispatches := make(chan *enginepick.Dispatch, waiting)
	var wg sync.WaitGroup
	for i := range waiting {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				d, err := r.Select(ctx, benchReq(i))
				if err != nil {
					return
				}
				dispatches <- d
			}
		}()
	}
	waitQueued(fc, waiting)
	b.ResetTimer()
	for range b.N {
		held.Release()
		held = <-dispatches
	}
	b.StopTimer()
	cancel()
	held.Release()
	wg.Wait()
	close(dispatches)
	for d := range dispatches {
		d.Release()
	}
}
