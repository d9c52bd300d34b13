package policy_test

import (
	"context"
	"fmt"
	"time"

	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// A session's first request goes to the less loaded engine and is bound there; later requests
// reuse the binding even when that engine becomes the busier one; a request without a session key
// binds nothing.
func ExampleNewSessionAware() {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	clock := func() time.Time { return now }
	load := loadmon.NewTable(loadmon.WithClock(clock))
	report := func(id state.EngineID, waiting uint64) {
		_ = load.Report(loadmon.Report{Engine: id, WaitingRequests: waiting, KVCapacityTokens: 1 << 20,
			Native: &loadmon.NativeLoad{MaxRunningRequests: 256, WaitingUncachedTokens: waiting * 1000}})
	}
	store, _ := affinity.NewMemoryStore(affinity.Options{Now: clock}) // the caller would also run store.Run(ctx)
	p, _ := policy.NewSessionAware(policy.Config{Load: load, InFlight: loadmon.NewInFlight(clock)},
		policy.SessionAwareOptions{Store: store})
	engines := []state.Engine{
		state.NewStaticEngine("http://a:8000", "llama", state.StagePlain),
		state.NewStaticEngine("http://b:8000", "llama", state.StagePlain),
	}
	ctx := context.Background()
	pick := func(session string) {
		pk, err := p.Pick(ctx, engines, &policy.Request{Model: "llama", BucketID: "default", SessionKey: session})
		fmt.Println(pk.Engine.ID(), pk.Reason, err)
	}

	report("http://a:8000", 9)
	report("http://b:8000", 0)
	pick("conv-42")
	report("http://b:8000", 50) // b is now the busier engine
	pick("conv-42")
	pick("")
	// Output:
	// http://b:8000 assigned <nil>
	// http://b:8000 session_primary <nil>
	// http://a:8000 no_session <nil>
}

// Stateless sticky routing: every router replica maps a routing key to the same engine, with no
// shared store.
func ExampleNewSticky_rendezvous() {
	cfg := policy.Config{Load: loadmon.NewTable(), InFlight: loadmon.NewInFlight(nil)}
	replica1, _ := policy.NewSticky(cfg, policy.StickyOptions{Rendezvous: true})
	replica2, _ := policy.NewSticky(cfg, policy.StickyOptions{Rendezvous: true, LoadFactor: 1.25})
	var engines []state.Engine
	for _, id := range []state.EngineID{"http://a:8000", "http://b:8000", "http://c:8000", "http://d:8000"} {
		engines = append(engines, state.NewStaticEngine(id, "llama", state.StagePlain))
	}
	for _, key := range []string{"tenant-1", "tenant-2", "tenant-3"} {
		p1, _ := replica1.Pick(context.Background(), engines, &policy.Request{RoutingKey: key})
		p2, _ := replica2.Pick(context.Background(), engines, &policy.Request{RoutingKey: key})
		fmt.Println(key, p1.Engine.ID(), p1.Engine.ID() == p2.Engine.ID(), p1.Reason)
	}
	// Output:
	// tenant-1 http://b:8000 true rendezvous
	// tenant-2 http://d:8000 true rendezvous
	// tenant-3 http://c:8000 true rendezvous
}
