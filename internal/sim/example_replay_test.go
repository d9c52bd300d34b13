package sim_test

import (
	"context"
	"fmt"
	"time"

	"github.com/enginepick/enginepick/internal/sim"
)

// ExampleReplay replays a hand-built trace of three two-turn conversations on two engines: each
// second turn repeats its conversation's 3,072-token first prompt and adds 512 tokens.
// Round-robin sends every second turn to the other engine, where nothing is cached but the shared
// first block; cache_aware sends it back to the engine that holds its conversation. (At this load
// both engines are idle at every arrival, so the first turns, which share only one 512-token block,
// less than the fifth of their prompt the hit gate asks for, are spread over the engines by the
// fallback's random tie-break.)
func ExampleReplay() {
	tr := &sim.Trace{Name: "three-conversations"}
	for turn := range 2 {
		for conv := range 3 {
			ids := []uint64{0} // a shared system-prompt block
			for b := range 5 + turn {
				ids = append(ids, uint64(100*conv+b+1))
			}
			tr.Requests = append(tr.Requests, sim.Request{
				Index:        len(tr.Requests),
				Arrival:      time.Duration(len(tr.Requests)) * time.Second,
				InputTokens:  len(ids) * sim.MooncakeBlockTokens,
				OutputTokens: 16,
				HashIDs:      ids,
			})
		}
	}
	rep, err := sim.Replay(context.Background(), sim.Config{
		Trace:    tr,
		Fleet:    sim.Fleet{Plain: 2},
		Policies: []string{sim.NameRoundRobin, sim.NameCacheAware},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("infinite cache: %.1f %%\n", 100*rep.InfiniteCacheHitRate)
	for _, r := range rep.Results {
		fmt.Printf("%-11s hit %4.1f %%  TTFT p50 %.3f s  requests per engine %v\n",
			r.Policy, 100*r.HitRate, r.TTFT.P50, r.EngineRequests)
	}
	// Output:
	// infinite cache: 51.3 %
	// round_robin hit 10.3 %  TTFT p50 0.129 s  requests per engine [3 3]
	// cache_aware hit 48.7 %  TTFT p50 0.022 s  requests per engine [4 2]
}
