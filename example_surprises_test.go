package enginepick_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// scriptedRand returns a random source that yields seq in order, then repeats its last value.
func scriptedRand(seq ...int) func(int) int {
	var i atomic.Int64
	return func(n int) int {
		k := int(i.Add(1) - 1)
		return seq[min(k, len(seq)-1)] % n
	}
}

// Why a request gets a 503 while an engine is idle, and the fix (docs/guide.md §4, "What surprises users").
// Power-of-two samples two of three engines, keeps the less pressured one and checks admission on
// it alone: both sampled engines are at the cap of 8 waiting requests, so with one bucket the
// request fails although engine c is idle. A second bucket over the same engines, with least-load
// and the same caps, is tried next and picks c.
func Example_fallbackBucket() {
	load, inflight := loadmon.NewTable(), loadmon.NewInFlight(nil)
	reg := &state.StaticRegistry{}
	for _, r := range []loadmon.Report{
		{Engine: "http://a:30000", WaitingRequests: 9, KVCapacityTokens: 440_000,
			Native: &loadmon.NativeLoad{MaxRunningRequests: 256, WaitingUncachedTokens: 20_000}},
		{Engine: "http://b:30000", WaitingRequests: 8, KVCapacityTokens: 440_000,
			Native: &loadmon.NativeLoad{MaxRunningRequests: 256, WaitingUncachedTokens: 15_000}},
		{Engine: "http://c:30000", WaitingRequests: 0, KVCapacityTokens: 440_000,
			Native: &loadmon.NativeLoad{MaxRunningRequests: 256}},
	} {
		if err := reg.Add(state.NewStaticEngine(r.Engine, "llama-8b", state.StagePlain)); err != nil {
			fmt.Println(err)
			return
		}
		if err := load.Report(r); err != nil {
			fmt.Println(err)
			return
		}
	}
	route := func(withFallback bool) {
		// Every bucket applies the same cap; power-of-two samples a and b (a scripted random source).
		cfg := policy.Config{Load: load, InFlight: inflight, Rand: scriptedRand(0, 1),
			Admission: admission.Limits{MaxWaitingRequests: admission.Cap(8)}}
		p2, err := policy.NewPowerOfN(cfg, 2)
		if err != nil {
			fmt.Println(err)
			return
		}
		first, err := bucket.NewEngineGroup(p2, nil)
		if err != nil {
			fmt.Println(err)
			return
		}
		primary, err := bucket.NewPlainBucket(bucket.Spec{ID: "power-of-two", MaxContextTokens: 32768}, first)
		if err != nil {
			fmt.Println(err)
			return
		}
		buckets := []*bucket.Bucket{primary}
		if withFallback {
			ll, err := policy.NewLeastLoad(cfg)
			if err != nil {
				fmt.Println(err)
				return
			}
			second, err := bucket.NewEngineGroup(ll, nil) // the same engines: every healthy one
			if err != nil {
				fmt.Println(err)
				return
			}
			fallback, err := bucket.NewPlainBucket(bucket.Spec{ID: "least-load", MaxContextTokens: 32768, Rank: 1}, second)
			if err != nil {
				fmt.Println(err)
				return
			}
			buckets = append(buckets, fallback)
		}
		resolver, err := bucket.NewResolver(buckets, bucket.ResolverOptions{})
		if err != nil {
			fmt.Println(err)
			return
		}
		router, err := enginepick.NewRouter(enginepick.Options{Registry: reg, Load: load, InFlight: inflight,
			Resolvers: map[state.ModelID]*bucket.Resolver{"llama-8b": resolver}})
		if err != nil {
			fmt.Println(err)
			return
		}
		d, err := router.Select(context.Background(), &bucket.Request{Model: "llama-8b",
			Signals: bucket.Signals{InputTokens: 2000}})
		var rejected *policy.AdmissionRejectedError
		if errors.As(err, &rejected) {
			fmt.Println(bucket.StatusCode(err), "after", rejected.Engine.ID(), rejected.Limit)
			return
		}
		if err != nil {
			fmt.Println(err)
			return
		}
		defer d.Release()
		fmt.Println(d.Selection.Bucket.ID(), d.Selection.Plain.Engine.ID(), d.Selection.Plain.Reason)
	}
	route(false)
	route(true)
	// Output:
	// 503 after http://b:30000 max_waiting_requests
	// least-load http://c:30000 least_load
}

// printDecisions is a policy.CacheObserver that prints each decision label.
type printDecisions struct{}

func (printDecisions) ObserveCacheDecision(d *policy.CacheDecision) {
	fmt.Println(" ", d.Reason, d.Decision)
}

// cacheAwareRouter wires a cache-aware plain bucket over three engines and stores a conversation's
// blocks on engine b. It returns the router and the conversation.
func cacheAwareRouter(load *loadmon.Table, opts policy.CacheAwareOptions, conversationTokens int) (*enginepick.Router, []uint32, error) {
	reg := &state.StaticRegistry{}
	for _, id := range []state.EngineID{"http://a:30000", "http://b:30000", "http://c:30000"} {
		if err := reg.Add(state.NewStaticEngine(id, "llama-8b", state.StagePlain)); err != nil {
			return nil, nil, err
		}
	}
	inflight := loadmon.NewInFlight(nil)
	hasher, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: 16})
	if err != nil {
		return nil, nil, err
	}
	index, err := kvindex.NewIndex(hasher, kvindex.Options{})
	if err != nil {
		return nil, nil, err
	}
	opts.Source, err = kvindex.NewLocalSource(index)
	if err != nil {
		return nil, nil, err
	}
	opts.Observer = printDecisions{}
	cache, err := policy.NewCacheAware(policy.Config{Load: load, InFlight: inflight, Rand: scriptedRand(0, 2)}, opts)
	if err != nil {
		return nil, nil, err
	}
	group, err := bucket.NewEngineGroup(cache, nil)
	if err != nil {
		return nil, nil, err
	}
	all, err := bucket.NewPlainBucket(bucket.Spec{ID: "all"}, group)
	if err != nil {
		return nil, nil, err
	}
	resolver, err := bucket.NewResolver([]*bucket.Bucket{all}, bucket.ResolverOptions{})
	if err != nil {
		return nil, nil, err
	}
	router, err := enginepick.NewRouter(enginepick.Options{Registry: reg, Load: load, InFlight: inflight, Index: index,
		Resolvers: map[state.ModelID]*bucket.Resolver{"llama-8b": resolver}})
	if err != nil {
		return nil, nil, err
	}

	conversation := make([]uint32, conversationTokens)
	for i := range conversation {
		conversation[i] = uint32(1000 + i)
	}
	hashes := make([]uint64, conversationTokens/16) // engine b's own block hashes: opaque IDs
	for i := range hashes {
		hashes[i] = uint64(0xb0000 + i)
	}
	err = index.Store(kvindex.StoreEvent{Engine: "http://b:30000", BlockHashes: hashes,
		TokenIDs: conversation[:len(hashes)*16], Tier: kvindex.TierDevice})
	return router, conversation, err
}

// selectNextTurn routes the conversation's next turn and prints the engine.
func selectNextTurn(router *enginepick.Router, conversation []uint32) {
	next := append(append([]uint32(nil), conversation...), 7, 8, 9)
	d, err := router.Select(context.Background(), &bucket.Request{Model: "llama-8b", TokenIDs: next,
		Signals: bucket.Signals{InputTokens: int64(len(next))}})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer d.Release()
	fmt.Println(" ", d.Selection.Plain.Engine.ID())
}

// A conversation of 592 tokens (37 blocks) is cached on engine b. With the default hit gate,
// min(1,024, ⌈595 ÷ 4⌉) = 149 matched tokens for its 595-token next turn, that turn goes to b; with
// MinMatchedTokens set to 1,024 (the experimental router's gate) it is a miss and goes by load
// (the least pressured engine of the group: three idle engines tie, and the scripted random source
// breaks the tie to b).
func Example_cacheAwareMinMatchedTokens() {
	for _, minMatched := range []uint64{0, 1024} { // 0: the default gate
		fmt.Println("MinMatchedTokens", minMatched)
		router, conversation, err := cacheAwareRouter(loadmon.NewTable(),
			policy.CacheAwareOptions{MinMatchedTokens: minMatched}, 592)
		if err != nil {
			fmt.Println(err)
			return
		}
		selectNextTurn(router, conversation)
	}
	// Output:
	// MinMatchedTokens 0
	//   cache_candidate cache_hit
	//   http://b:30000
	// MinMatchedTokens 1024
	//   no_cache_candidate cache_miss
	//   http://b:30000
}

// Without EngineQueueLimit the queue gate acts only on a holder with a full round queued for its
// running slots (b reports none running, so no slots): the engine holding the prefix wins however
// long its queue.
// With EngineQueueLimit set, a holder whose fresh report shows at least that many waiting requests
// is passed over for an unqueued engine (decision cache_worker_queued; a and c tie, and the scripted
// random source breaks the tie to c); a holder without a fresh report passes the gate while this
// router has fewer requests in flight to it than the limit (unknown is not "queued", nor idle).
func Example_cacheAwareQueueGate() {
	for _, c := range []struct {
		name   string
		limit  *uint64
		report bool
	}{
		{"gate off, b has 10 waiting", nil, true},
		{"limit 8, b has 10 waiting", admission.Cap(8), true},
		{"limit 8, no report from b", admission.Cap(8), false},
	} {
		fmt.Println(c.name)
		load := loadmon.NewTable()
		if c.report {
			if err := load.Report(loadmon.Report{Engine: "http://b:30000", WaitingRequests: 10}); err != nil {
				fmt.Println(err)
				return
			}
		}
		router, conversation, err := cacheAwareRouter(load, policy.CacheAwareOptions{EngineQueueLimit: c.limit}, 2048)
		if err != nil {
			fmt.Println(err)
			return
		}
		selectNextTurn(router, conversation)
	}
	// Output:
	// gate off, b has 10 waiting
	//   cache_candidate cache_hit
	//   http://b:30000
	// limit 8, b has 10 waiting
	//   no_cache_candidate cache_worker_queued
	//   http://c:30000
	// limit 8, no report from b
	//   cache_candidate cache_hit
	//   http://b:30000
}
