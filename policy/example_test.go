package policy_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// scripted returns a random source that yields seq in order, then repeats its last value.
func scripted(seq ...int) func(int) int {
	var i atomic.Int64
	return func(n int) int {
		k := int(i.Add(1) - 1)
		return seq[min(k, len(seq)-1)] % n
	}
}

// Power-of-two samples two of the group's engines and keeps the less pressured one. With native
// reports, pressure for a plain engine is its pending prefill work (waiting uncached tokens), not
// only the router's in-flight count. Admission is then checked once, on that engine only: when it
// is full the pick fails, even though a third engine, never sampled, is idle.
func ExampleNewPowerOfN() {
	load, inflight := loadmon.NewTable(), loadmon.NewInFlight(nil)
	native := func(waitingTokens uint64) *loadmon.NativeLoad {
		return &loadmon.NativeLoad{MaxRunningRequests: 256, WaitingUncachedTokens: waitingTokens}
	}
	for _, r := range []loadmon.Report{
		{Engine: "http://a:30000", WaitingRequests: 5, KVCapacityTokens: 440_000, Native: native(12_000)},
		{Engine: "http://b:30000", WaitingRequests: 4, KVCapacityTokens: 440_000, Native: native(3_000)},
		{Engine: "http://c:30000", WaitingRequests: 0, KVCapacityTokens: 440_000, Native: native(0)},
	} {
		if err := load.Report(r); err != nil {
			fmt.Println("report:", err)
			return
		}
	}
	// The candidates a group hands a policy: healthy, of the request's stage, sorted by ID.
	engines := []state.Engine{
		state.NewStaticEngine("http://a:30000", "llama-8b", state.StagePlain),
		state.NewStaticEngine("http://b:30000", "llama-8b", state.StagePlain),
		state.NewStaticEngine("http://c:30000", "llama-8b", state.StagePlain),
	}
	req := &policy.Request{Model: "llama-8b", Stage: state.StagePlain, InputTokens: 2000}

	// The sample is a and b (a scripted random source; the default is math/rand/v2).
	p2, err := policy.NewPowerOfN(policy.Config{Load: load, InFlight: inflight, Rand: scripted(0, 1)}, 2)
	if err != nil {
		fmt.Println(err)
		return
	}
	pick, err := p2.Pick(context.Background(), engines, req)
	fmt.Println(pick.Engine.ID(), pick.Reason, err)

	// The same sample under a cap of 4 waiting requests: b is chosen and rejected, and neither a
	// nor c is tried. The bucket loop moves on to the next bucket, or answers 503.
	capped, err := policy.NewPowerOfN(policy.Config{Load: load, InFlight: inflight, Rand: scripted(0, 1),
		Admission: admission.Limits{MaxWaitingRequests: admission.Cap(4)}}, 2)
	if err != nil {
		fmt.Println(err)
		return
	}
	_, err = capped.Pick(context.Background(), engines, req)
	var rejected *policy.AdmissionRejectedError
	if errors.As(err, &rejected) {
		fmt.Println("rejected:", rejected.Engine.ID(), rejected.Limit, rejected.Observed, ">=", rejected.Cap)
	}
	// Output:
	// http://b:30000 power_of_two <nil>
	// rejected: http://b:30000 max_waiting_requests 4 >= 4
}

// Least-load scores every candidate by waiting + running requests from fresh reports, plus the
// dispatches this router made since each report, so two quick picks do not both land on the engine
// that looked idle in the same report.
func ExampleNewLeastLoad() {
	// A fixed clock keeps the example exact: reports at 12:00:00, dispatches a millisecond later.
	now := time.Date(2025, 1, 1, 12, 0, 0, 0, time.UTC)
	clock := func() time.Time { return now }
	load, inflight := loadmon.NewTable(loadmon.WithClock(clock)), loadmon.NewInFlight(clock)
	for _, r := range []loadmon.Report{
		{Engine: "http://a:30000", RunningRequests: 3, WaitingRequests: 1},
		{Engine: "http://b:30000", RunningRequests: 2},
	} {
		if err := load.Report(r); err != nil {
			fmt.Println("report:", err)
			return
		}
	}
	engines := []state.Engine{
		state.NewStaticEngine("http://a:30000", "llama-8b", state.StagePlain),
		state.NewStaticEngine("http://b:30000", "llama-8b", state.StagePlain),
	}
	ll, err := policy.NewLeastLoad(policy.Config{Load: load, InFlight: inflight})
	if err != nil {
		fmt.Println(err)
		return
	}
	req := &policy.Request{Model: "llama-8b", Stage: state.StagePlain, InputTokens: 500}
	now = now.Add(time.Millisecond)
	for range 4 {
		pick, err := ll.Pick(context.Background(), engines, req)
		if err != nil {
			fmt.Println(err)
			return
		}
		inflight.Acquire(pick.Engine.ID(), -1, 0) // the host dispatches; no response ends in this example
		fmt.Println(pick.Engine.ID(), pick.Reason)
	}
	// Output:
	// http://b:30000 least_load
	// http://b:30000 least_load
	// http://a:30000 least_load
	// http://b:30000 least_load
}
