package kvindex_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/enginepick/enginepick/kvindex"
)

// Example walks through the index's life: KV events from two engines, an approximate placement
// for a third, a match, a removal that leaves a hole, expiry, a memoized lookup through a Source,
// and a refused event.
func Example() {
	h, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: 4})
	if err != nil {
		panic(err)
	}
	clock := time.Unix(0, 0) // an injected clock: expiry is exact and nothing sleeps
	idx, err := kvindex.NewIndex(h, kvindex.Options{Now: func() time.Time { return clock }, ApproxTTL: 10 * time.Second})
	if err != nil {
		panic(err)
	}
	// The cache-aware policy asks through a Source, and records its placements through it.
	src, err := kvindex.NewLocalSource(idx)
	if err != nil {
		panic(err)
	}
	prompt := []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13} // three full blocks and one token

	// Engine a (DP rank 0) stores blocks 1–3 under its own hashes; engine b stores block 1, then
	// block 2 chained to it through its parent hash.
	must(idx.Store(kvindex.StoreEvent{Engine: "http://a", BlockHashes: []uint64{0xa1, 0xa2, 0xa3},
		TokenIDs: prompt[:12], Tier: kvindex.TierDevice}))
	must(idx.Store(kvindex.StoreEvent{Engine: "http://b", BlockHashes: []uint64{0xb1},
		TokenIDs: prompt[:4], Tier: kvindex.TierHost}))
	must(idx.Store(kvindex.StoreEvent{Engine: "http://b", HasParent: true, ParentHash: 0xb1,
		BlockHashes: []uint64{0xb2}, TokenIDs: prompt[4:8], Tier: kvindex.TierHost}))
	// Engine c publishes no events: the router records where it sent the prompt, for 10 s.
	must(src.Place("http://c", 0, kvindex.Query{TokenIDs: prompt}, nil))
	keys := h.Keys(prompt)

	show := func(label string) {
		m := idx.Match(keys)
		fmt.Printf("%s (%d query blocks):", label, m.QueryBlocks)
		for _, e := range m.Engines {
			fmt.Printf(" %s=%d", e.Engine, e.Blocks)
		}
		fmt.Println()
	}
	show("after events")

	// a drops block 2 from every tier: its contiguous prefix stops at the hole.
	must(idx.Remove("http://a", 0, []uint64{0xa2}, 0)) // 0: from every tier
	clock = clock.Add(10 * time.Second)                // c's placement expires
	show("after removal and expiry")

	// A request's lookups are memoized: one per Source.
	memo := new(kvindex.Memo)
	for range 2 { // two picks of one request: one lookup
		r, err := memo.Lookup(context.Background(), src, kvindex.Query{TokenIDs: prompt})
		must(err)
		fmt.Println(r.Outcome, r.Engines, "blocks of", r.BlockTokens, "tokens")
	}
	r, _ := src.Lookup(context.Background(), kvindex.Query{TokenIDs: prompt[:3]})
	fmt.Println("short prompt:", r.Outcome, r.QueryBlocks)

	// Refused events are typed errors and change nothing.
	err = idx.Store(kvindex.StoreEvent{Engine: "http://b", HasParent: true, ParentHash: 0xdead,
		BlockHashes: []uint64{0xb3}, TokenIDs: prompt[8:12], Tier: kvindex.TierDevice})
	fmt.Println(errors.Is(err, kvindex.ErrUnknownParent))
	err = idx.Remove("http://z", 0, []uint64{1}, 0)
	fmt.Println(errors.Is(err, kvindex.ErrUnknownEngine))
	// Output:
	// after events (3 query blocks): http://a=3 http://c=3 http://b=2
	// after removal and expiry (3 query blocks): http://b=2 http://a=1
	// hit [{http://b 2} {http://a 1}] blocks of 4 tokens
	// hit [{http://b 2} {http://a 1}] blocks of 4 tokens
	// short prompt: miss 0
	// true
	// true
}

func must(err error) {
	if err != nil {
		panic(err)
	}
}
