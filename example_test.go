package enginepick_test

import (
	"context"
	"fmt"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// The router of docs/guide.md §3 (newRouter), run with hand-written load reports: a
// request that fits the bucket goes to the less pressured engine, and one whose output budget does
// not fit any bucket is refused with 400.
func Example() {
	load, inflight := loadmon.NewTable(), loadmon.NewInFlight(nil)
	reg := &state.StaticRegistry{}
	_ = reg.Add(state.NewStaticEngine("http://10.0.0.1:30000", "llama-8b", state.StagePlain))
	_ = reg.Add(state.NewStaticEngine("http://10.0.0.2:30000", "llama-8b", state.StagePlain))

	p2, _ := policy.NewPowerOfN(policy.Config{Load: load, InFlight: inflight,
		Admission: admission.Limits{MaxWaitingRequests: admission.Cap(8)}}, 2)
	all, _ := bucket.NewEngineGroup(p2, nil)
	short, _ := bucket.NewPlainBucket(bucket.Spec{ID: "short", MaxContextTokens: 32768}, all)
	resolver, _ := bucket.NewResolver([]*bucket.Bucket{short}, bucket.ResolverOptions{})
	router, _ := enginepick.NewRouter(enginepick.Options{Registry: reg, Load: load, InFlight: inflight,
		Resolvers: map[state.ModelID]*bucket.Resolver{"llama-8b": resolver}})

	// Engine 1 reports a prefill queue; engine 2 is idle. With native fields on both, power-of-two
	// (which samples both of two engines) ranks them by pending prefill work.
	_ = load.Report(loadmon.Report{Engine: "http://10.0.0.1:30000", RunningRequests: 12, WaitingRequests: 3,
		KVCapacityTokens: 440_000, Native: &loadmon.NativeLoad{MaxRunningRequests: 256, WaitingUncachedTokens: 9000}})
	_ = load.Report(loadmon.Report{Engine: "http://10.0.0.2:30000", RunningRequests: 4,
		KVCapacityTokens: 440_000, Native: &loadmon.NativeLoad{MaxRunningRequests: 256}})

	promptTokens := make([]uint32, 1000)
	for _, maxTokens := range []int64{500, 40000} {
		peak, _ := bucket.ExpectedPeak(int64(len(promptTokens)), maxTokens)
		d, err := router.Select(context.Background(), &bucket.Request{Model: "llama-8b", TokenIDs: promptTokens,
			Signals: bucket.Signals{InputTokens: int64(len(promptTokens)), ExpectedPeakTokens: peak, HasExpectedPeak: true}})
		if err != nil {
			fmt.Println(bucket.StatusCode(err), err)
			continue
		}
		fmt.Println(d.Selection.Bucket.ID(), d.Selection.Plain.Engine.ID(), d.Selection.Plain.Reason)
		d.Release()
	}
	// Output:
	// short http://10.0.0.2:30000 power_of_two
	// 400 bucket: input 1000 tokens (peak 41000): no matching bucket
}

// docs/guide.md's cache-aware example (§3): one engine publishes the blocks of a 2,048-token prompt, and
// the next request with that prefix goes to it.
func Example_cacheAware() {
	load, inflight := loadmon.NewTable(), loadmon.NewInFlight(nil)
	reg := &state.StaticRegistry{}
	for _, id := range []state.EngineID{"http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.0.3:30000"} {
		_ = reg.Add(state.NewStaticEngine(id, "llama-8b", state.StagePlain))
	}
	hasher, _ := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: 16})
	index, _ := kvindex.NewIndex(hasher, kvindex.Options{})
	source, _ := kvindex.NewLocalSource(index)
	cache, _ := policy.NewCacheAware(policy.Config{Load: load, InFlight: inflight},
		policy.CacheAwareOptions{Source: source, EngineQueueLimit: admission.Cap(8)})
	group, _ := bucket.NewEngineGroup(cache, nil)
	all, _ := bucket.NewPlainBucket(bucket.Spec{ID: "all"}, group)
	resolver, _ := bucket.NewResolver([]*bucket.Bucket{all}, bucket.ResolverOptions{})
	router, _ := enginepick.NewRouter(enginepick.Options{Registry: reg, Load: load, InFlight: inflight,
		Resolvers: map[state.ModelID]*bucket.Resolver{"llama-8b": resolver}})

	conversation := make([]uint32, 2048)
	for i := range conversation {
		conversation[i] = uint32(1000 + i)
	}
	engineHashes := make([]uint64, len(conversation)/16) // the engine's own block hashes: opaque IDs
	for i := range engineHashes {
		engineHashes[i] = uint64(0xabc000 + i)
	}
	err := index.Store(kvindex.StoreEvent{Engine: "http://10.0.0.2:30000", BlockHashes: engineHashes,
		TokenIDs: conversation, Tier: kvindex.TierDevice})
	fmt.Println("store:", err)

	nextTurn := append(append([]uint32(nil), conversation...), 7, 8, 9)
	d, err := router.Select(context.Background(), &bucket.Request{Model: "llama-8b", TokenIDs: nextTurn,
		Signals: bucket.Signals{InputTokens: int64(len(nextTurn))}})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(d.Selection.Plain.Engine.ID(), d.Selection.Plain.Reason)
	d.Release()
	// Output:
	// store: <nil>
	// http://10.0.0.2:30000 cache_candidate
}
