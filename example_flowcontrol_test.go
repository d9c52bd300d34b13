package enginepick_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/flowcontrol"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// Flow control (docs/design.md §17) on one engine under an in-flight cap of 2, with an
// interactive band (priority 1), the default band and a sheddable band (priority −1). A
// default-band request leaves the engine's last slot to the interactive band, so the second one
// waits in the Router while an interactive request is served at once; it goes when both end. A
// sheddable request is rejected at once with 429 while the fleet is saturated.
func Example_flowControl() {
	load, inflight := loadmon.NewTable(), loadmon.NewInFlight(nil)
	reg := &state.StaticRegistry{}
	_ = reg.Add(state.NewStaticEngine("http://10.0.0.1:8000", "llama-8b", state.StagePlain))
	rr, _ := policy.NewRoundRobin(policy.Config{Load: load, InFlight: inflight,
		Admission: admission.Limits{MaxInFlightRequests: admission.Cap(2)}})
	group, _ := bucket.NewEngineGroup(rr, nil)
	all, _ := bucket.NewPlainBucket(bucket.Spec{ID: "all"}, group)
	resolver, _ := bucket.NewResolver([]*bucket.Bucket{all}, bucket.ResolverOptions{})
	fc, _ := flowcontrol.New(flowcontrol.Config{Bands: []flowcontrol.Band{
		{Priority: 1}, {Priority: 0}, {Priority: -1, Sheddable: true}}})
	router, _ := enginepick.NewRouter(enginepick.Options{Registry: reg, Load: load, InFlight: inflight,
		Resolvers: map[state.ModelID]*bucket.Resolver{"llama-8b": resolver}, FlowControl: fc})

	ctx := context.Background()
	req := func(priority int, flow string) *bucket.Request {
		return &bucket.Request{Model: "llama-8b", Priority: priority, Flow: flow, Signals: bucket.Signals{InputTokens: 900}}
	}
	first, _ := router.Select(ctx, req(0, "tenant-a"))
	fmt.Println("default band:", first.Selection.Plain.Engine.ID())

	waiting := make(chan *enginepick.Dispatch)
	go func() {
		d, _ := router.Select(ctx, req(0, "tenant-b")) // waits: the last slot is the interactive band's
		waiting <- d
	}()
	top, _ := router.Select(ctx, req(1, "tenant-c"))
	fmt.Println("interactive band:", top.Selection.Plain.Engine.ID())

	_, err := router.Select(ctx, req(-1, "batch"))
	var rej *flowcontrol.RejectedError
	if errors.As(err, &rej) {
		fmt.Println("sheddable band:", bucket.StatusCode(err), rej.Reason) // and rej.RetryAfter for Retry-After
	}

	first.Release()
	top.Release()
	second := <-waiting
	fmt.Println("the waiting request:", second.Selection.Plain.Engine.ID())
	second.Release()
	// Output:
	// default band: http://10.0.0.1:8000
	// interactive band: http://10.0.0.1:8000
	// sheddable band: 429 sheddable
	// the waiting request: http://10.0.0.1:8000
}
