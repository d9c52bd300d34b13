package loadmon_test

import (
	"errors"
	"fmt"
	"time"

	"github.com/enginepick/enginepick/loadmon"
)

// An engine with two DP ranks. Its reports are rejected until the host declares the ranks with
// Expect (an engine never declared has one rank), its load stays unknown until every rank has
// reported, and it becomes unknown again — never zero — when the oldest report goes stale.
func ExampleTable() {
	now := time.Date(2025, 1, 1, 12, 0, 0, 0, time.UTC)
	load := loadmon.NewTable(loadmon.WithClock(func() time.Time { return now }))
	const engine = "http://10.0.0.1:30000"

	err := load.Report(loadmon.Report{Engine: engine, DPRank: 1, WaitingRequests: 2})
	fmt.Println("rank 1 before Expect:", errors.Is(err, loadmon.ErrRankOutOfRange))

	if err := load.Expect(engine, 2); err != nil { // from discovery: the engine runs dp_size = 2
		fmt.Println("expect:", err)
		return
	}
	if err := load.Report(loadmon.Report{Engine: engine, DPRank: 0, RunningRequests: 10, WaitingRequests: 1}); err != nil {
		fmt.Println("report:", err)
		return
	}
	_, known := load.Snapshot().Load(engine)
	fmt.Println("rank 0 only, known:", known)

	now = now.Add(2 * time.Second)
	if err := load.Report(loadmon.Report{Engine: engine, DPRank: 1, RunningRequests: 7, WaitingRequests: 2}); err != nil {
		fmt.Println("report:", err)
		return
	}
	if l, ok := load.Snapshot().Load(engine); ok {
		fmt.Println("both ranks:", l.Ranks, "ranks,", l.RunningRequests, "running,", l.WaitingRequests, "waiting")
	}

	// Rank 0's report is now 2 s old; at 5 s (DefaultFreshness) the whole engine is unknown.
	now = now.Add(3*time.Second + time.Millisecond)
	_, known = load.Snapshot().Load(engine)
	fmt.Println("rank 0 stale, known:", known)
	// Output:
	// rank 1 before Expect: true
	// rank 0 only, known: false
	// both ranks: 2 ranks, 17 running, 3 waiting
	// rank 0 stale, known: false
}

// In-flight counters are the router's own view of an engine: a guard is acquired at dispatch and
// released when the response ends. Release is idempotent, and a guard taken before the engine was
// removed never drives the re-added engine's fresh counter negative.
func ExampleInFlight() {
	inflight := loadmon.NewInFlight(nil)
	const engine = "http://10.0.0.1:30000"

	g1, g2 := inflight.Acquire(engine, -1, 0), inflight.Acquire(engine, -1, 0)
	fmt.Println("dispatched:", inflight.Count(engine))
	g1.Release()
	g1.Release() // a second Release does nothing
	fmt.Println("after one response:", inflight.Count(engine))

	inflight.Remove(engine) // the host removed the engine; g2's request is still streaming
	g3 := inflight.Acquire(engine, -1, 0)
	g2.Release() // releases into the detached counter
	fmt.Println("re-added engine:", inflight.Count(engine))
	g3.Release()
	fmt.Println("idle:", inflight.Count(engine))
	// Output:
	// dispatched: 2
	// after one response: 1
	// re-added engine: 1
	// idle: 0
}
