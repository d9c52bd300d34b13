package bucket_test

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// A resolver orders the buckets a request fits: smallest input capacity first (min of the input
// bound and the context capacity; unbounded last), then rank, then ID. A bucket's context
// capacity must hold the expected peak (input + output budget) when the host knows it.
func ExampleResolver_Resolve() {
	rr, err := policy.NewRoundRobin(policy.Config{Load: loadmon.NewTable(), InFlight: loadmon.NewInFlight(nil)})
	if err != nil {
		fmt.Println(err)
		return
	}
	all, err := bucket.NewEngineGroup(rr, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	var buckets []*bucket.Bucket
	for _, spec := range []bucket.Spec{
		{ID: "long", MaxContextTokens: 131_072},
		{ID: "short", MaxInputTokens: 4096, MaxContextTokens: 8192},
		{ID: "short-overflow", MaxInputTokens: 4096, MaxContextTokens: 8192, Rank: 1},
	} {
		b, err := bucket.NewPlainBucket(spec, all)
		if err != nil {
			fmt.Println(err)
			return
		}
		buckets = append(buckets, b)
	}
	resolver, err := bucket.NewResolver(buckets, bucket.ResolverOptions{})
	if err != nil {
		fmt.Println(err)
		return
	}

	for _, r := range []struct {
		name        string
		input, peak int64
	}{
		{"2k prompt, 1k output", 2000, 3000},
		{"2k prompt, 16k output", 2000, 18_000},
		{"200k prompt, 1k output", 200_000, 201_000},
		{"peak below input", 2000, 1000},
	} {
		got, err := resolver.Resolve(bucket.Signals{InputTokens: r.input, ExpectedPeakTokens: r.peak, HasExpectedPeak: true})
		if err != nil {
			fmt.Printf("%-22s -> invalid signal: %v\n", r.name, errors.Is(err, policy.ErrInvalidSignal))
			continue
		}
		ids := make([]string, len(got))
		for i, b := range got {
			ids[i] = b.ID()
		}
		fmt.Printf("%-22s -> [%s]\n", r.name, strings.Join(ids, " "))
	}
	// Output:
	// 2k prompt, 1k output   -> [short short-overflow long]
	// 2k prompt, 16k output  -> [long]
	// 200k prompt, 1k output -> []
	// peak below input       -> invalid signal: true
}

// The bucket loop, without the root Router: a PD bucket picks its prefill and its decode engine
// from its own two groups. A stage with no healthy engine makes the bucket fail as a whole, and the
// loop moves on to the next bucket, where both stages are picked again.
func ExampleSelect() {
	reg, err := state.NewStaticRegistry(
		state.NewStaticEngine("http://p0:30000", "llama-8b", state.StagePrefill),
		state.NewStaticEngine("http://d0:30000", "llama-8b", state.StageDecode),
		state.NewStaticEngine("http://p1:30000", "llama-8b", state.StagePrefill),
		state.NewStaticEngine("http://d1:30000", "llama-8b", state.StageDecode),
	)
	if err != nil {
		fmt.Println(err)
		return
	}
	rr, err := policy.NewRoundRobin(policy.Config{Load: loadmon.NewTable(), InFlight: loadmon.NewInFlight(nil)})
	if err != nil {
		fmt.Println(err)
		return
	}
	group := func(members ...state.EngineID) *bucket.EngineGroup {
		g, err := bucket.NewEngineGroup(rr, members)
		if err != nil {
			panic(err) // constant members: cannot fail
		}
		return g
	}
	first, err := bucket.NewPDBucket(bucket.Spec{ID: "pool-0"}, group("http://p0:30000"), group("http://d0:30000"))
	if err != nil {
		fmt.Println(err)
		return
	}
	second, err := bucket.NewPDBucket(bucket.Spec{ID: "pool-1", Rank: 1}, group("http://p1:30000"), group("http://d1:30000"))
	if err != nil {
		fmt.Println(err)
		return
	}
	resolver, err := bucket.NewResolver([]*bucket.Bucket{first, second}, bucket.ResolverOptions{})
	if err != nil {
		fmt.Println(err)
		return
	}
	req := &bucket.Request{Model: "llama-8b", Signals: bucket.Signals{InputTokens: 3000}}

	show := func() {
		sel, err := bucket.Select(context.Background(), resolver, reg, req)
		if err != nil {
			fmt.Println(bucket.StatusCode(err), errors.Is(err, policy.ErrNoCandidates))
			return
		}
		fmt.Println(sel.Bucket.ID(), sel.Prefill.Engine.ID(), sel.Decode.Engine.ID())
	}
	show()
	d0, _ := reg.Engine("http://d0:30000")
	d0.(*state.StaticEngine).SetHealthy(false) // pool-0 has no decode engine: its prefill is not kept
	show()
	d1, _ := reg.Engine("http://d1:30000")
	d1.(*state.StaticEngine).SetHealthy(false) // no bucket can complete a pair
	show()
	// Output:
	// pool-0 http://p0:30000 http://d0:30000
	// pool-1 http://p1:30000 http://d1:30000
	// 503 true
}
