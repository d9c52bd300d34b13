package enginepick_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// The four selection defects of docs/design-notes.md "Selection defects", each reproduced through
// Router.Select as a host sees it. Every test failed before its fix with the figure its comment
// gives.

// plainRouter is one model ("m") with one plain bucket over the given engines and one policy,
// built by mk from the shared state.
type plainRouter struct {
	router   *enginepick.Router
	load     *loadmon.Table
	inflight *loadmon.InFlight
	index    *kvindex.Index
	source   *kvindex.LocalSource
}

func newPlainRouter(t *testing.T, ids []state.EngineID, mk func(cfg policy.Config, src kvindex.Source) (policy.Policy, error)) *plainRouter {
	t.Helper()
	r := &plainRouter{load: loadmon.NewTable(), inflight: loadmon.NewInFlight(nil)}
	h, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: 16})
	require.NoError(t, err)
	r.index, err = kvindex.NewIndex(h, kvindex.Options{})
	require.NoError(t, err)
	r.source, err = kvindex.NewLocalSource(r.index)
	require.NoError(t, err)
	reg := &state.StaticRegistry{}
	for _, id := range ids {
		require.NoError(t, reg.Add(state.NewStaticEngine(id, "m", state.StagePlain)))
	}
	// A seeded source keeps the random tie-breaks and samples reproducible.
	var mu sync.Mutex
	rnd := rand.New(rand.NewPCG(1, 2))
	intN := func(n int) int {
		mu.Lock()
		defer mu.Unlock()
		return rnd.IntN(n)
	}
	p, err := mk(policy.Config{Load: r.load, InFlight: r.inflight, Rand: intN}, r.source)
	require.NoError(t, err)
	g, err := bucket.NewEngineGroup(p, nil)
	require.NoError(t, err)
	b, err := bucket.NewPlainBucket(bucket.Spec{ID: "all"}, g)
	require.NoError(t, err)
	res, err := bucket.NewResolver([]*bucket.Bucket{b}, bucket.ResolverOptions{})
	require.NoError(t, err)
	r.router, err = enginepick.NewRouter(enginepick.Options{Registry: reg, InFlight: r.inflight, Load: r.load,
		Index: r.index, Resolvers: map[state.ModelID]*bucket.Resolver{"m": res}})
	require.NoError(t, err)
	return r
}

// selectHeld runs n selections of the prompts next(i) returns, keeping every dispatch open, and
// counts the picks per engine. The caller releases nothing: the test ends with the router.
func (r *plainRouter) selectHeld(t *testing.T, n int, next func(i int) []uint32) map[state.EngineID]int {
	t.Helper()
	got := map[state.EngineID]int{}
	for i := range n {
		tok := next(i)
		d, err := r.router.Select(context.Background(), &bucket.Request{Model: "m", TokenIDs: tok,
			Signals: bucket.Signals{InputTokens: int64(len(tok))}})
		require.NoError(t, err, "select %d", i)
		got[d.Selection.Plain.Engine.ID()]++
	}
	return got
}

// selectReleased runs n selections, each released before the next.
func (r *plainRouter) selectReleased(t *testing.T, n int, next func(i int) []uint32) map[state.EngineID]int {
	t.Helper()
	got := map[state.EngineID]int{}
	for i := range n {
		tok := next(i)
		d, err := r.router.Select(context.Background(), &bucket.Request{Model: "m", TokenIDs: tok,
			Signals: bucket.Signals{InputTokens: int64(len(tok))}})
		require.NoError(t, err, "select %d", i)
		got[d.Selection.Plain.Engine.ID()]++
		d.Release()
	}
	return got
}

// tokens returns n distinct-by-seed token IDs.
func tokens(n int, seed uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = seed<<20 | uint32(i)
	}
	return out
}

// storeAll publishes the whole prompt as held by engine, as its KV events would.
func (r *plainRouter) storeAll(t *testing.T, engine state.EngineID, tok []uint32) {
	t.Helper()
	hashes := make([]uint64, len(tok)/16)
	for i := range hashes {
		hashes[i] = uint64(i + 1)
	}
	require.NoError(t, r.index.Store(kvindex.StoreEvent{Engine: engine, BlockHashes: hashes, TokenIDs: tok[:len(hashes)*16],
		Tier: kvindex.TierDevice}))
}

func nativeReport(id state.EngineID, waiting, uncached uint64) loadmon.Report {
	return loadmon.Report{Engine: id, WaitingRequests: waiting, KVCapacityTokens: 1 << 20,
		Native: &loadmon.NativeLoad{MaxRunningRequests: 256, WaitingUncachedTokens: uncached}}
}

func cacheAwareWith(opts policy.CacheAwareOptions) func(policy.Config, kvindex.Source) (policy.Policy, error) {
	return func(cfg policy.Config, src kvindex.Source) (policy.Policy, error) {
		o := opts
		o.Source = src
		return policy.NewCacheAware(cfg, o)
	}
}

// Defect a: equal prefix holders went to the lowest ID. Engines a and b both hold the same
// 2,048-token prompt, default CacheAware, no load reports: 10 selections held open went a=10, b=0.
// Holders within the switch margin are ordered by pressure under the coverage rule (router-local
// in-flight here), ID last.
func TestDefectEqualHoldersAreSpreadByPressure(t *testing.T) {
	t.Parallel()
	r := newPlainRouter(t, []state.EngineID{"a", "b"}, cacheAwareWith(policy.CacheAwareOptions{}))
	tok := tokens(2048, 7)
	r.storeAll(t, "a", tok)
	r.storeAll(t, "b", tok)
	got := r.selectHeld(t, 10, func(int) []uint32 { return tok })
	assert.InDelta(t, 5, got["a"], 1, "picks %v", got)
	assert.InDelta(t, 5, got["b"], 1, "picks %v", got)
}

// Defect a, candidate-bound cut: with 16 equal holders and a candidate limit of 8, the cut kept the
// eight lowest IDs, so engines i..p never served the prefix. Ordered by in-flight, ID last, 32
// selections held open reach all 16, two each.
func TestDefectCandidateCutOrdersEqualHoldersByPressure(t *testing.T) {
	t.Parallel()
	ids := make([]state.EngineID, 16)
	for i := range ids {
		ids[i] = state.EngineID(fmt.Sprintf("e%02d", i))
	}
	r := newPlainRouter(t, ids, cacheAwareWith(policy.CacheAwareOptions{}))
	tok := tokens(2048, 8)
	for _, id := range ids {
		r.storeAll(t, id, tok)
	}
	got := r.selectHeld(t, 32, func(int) []uint32 { return tok })
	for _, id := range ids {
		assert.Equal(t, 2, got[id], "engine %s; picks %v", id, got)
	}
}

// Defect b: an engine without a fresh report was the whole unqueued tier. a never reports, b reports
// 1 waiting, EngineQueueLimit 1: 50 cold selections held open went a=50. Unknown load passes the
// gate only while the engine's router-local in-flight count is below the limit.
func TestDefectUnknownLoadIsNotAnIdleTier(t *testing.T) {
	t.Parallel()
	r := newPlainRouter(t, []state.EngineID{"a", "b"}, cacheAwareWith(policy.CacheAwareOptions{EngineQueueLimit: admission.Cap(1)}))
	require.NoError(t, r.load.Report(loadmon.Report{Engine: "b", WaitingRequests: 1}))
	got := r.selectHeld(t, 50, func(i int) []uint32 { return tokens(512, uint32(100+i)) })
	assert.LessOrEqual(t, got["a"], 30, "picks %v", got)
	assert.Positive(t, got["b"], "picks %v", got)
}

// Defect c: a burst between two reports all went to the engine that looked idle in the last one.
// a reports 0 waiting / 0 uncached tokens, b 1 / 512 (native); 32 selections of 1,024-token prompts
// held open before the next report went a=32 under power-of-two and under the cache-aware miss
// fallback. Pressure comparisons add the dispatches made since each engine's report.
func TestDefectBurstBetweenReportsIsSpread(t *testing.T) {
	t.Parallel()
	for name, mk := range map[string]func(policy.Config, kvindex.Source) (policy.Policy, error){
		"power_of_two": func(cfg policy.Config, _ kvindex.Source) (policy.Policy, error) { return policy.NewPowerOfN(cfg, 2) },
		"cache_aware":  cacheAwareWith(policy.CacheAwareOptions{}),
	} {
		t.Run(name+"/2_engines", func(t *testing.T) {
			t.Parallel()
			r := newPlainRouter(t, []state.EngineID{"a", "b"}, mk)
			require.NoError(t, r.load.Report(nativeReport("a", 0, 0)))
			require.NoError(t, r.load.Report(nativeReport("b", 1, 512)))
			got := r.selectHeld(t, 32, func(i int) []uint32 { return tokens(1024, uint32(200+i)) })
			assert.LessOrEqual(t, got["a"], 24, "picks %v", got)
		})
		t.Run(name+"/8_engines", func(t *testing.T) {
			t.Parallel()
			ids := make([]state.EngineID, 8)
			for i := range ids {
				ids[i] = state.EngineID(fmt.Sprintf("e%d", i))
			}
			r := newPlainRouter(t, ids, mk)
			require.NoError(t, r.load.Report(nativeReport(ids[0], 0, 0)))
			for _, id := range ids[1:] {
				require.NoError(t, r.load.Report(nativeReport(id, 1, 512)))
			}
			got := r.selectHeld(t, 32, func(i int) []uint32 { return tokens(1024, uint32(300+i)) })
			for _, id := range ids {
				assert.LessOrEqual(t, got[id], 2*32/len(ids), "engine %s; picks %v", id, got)
			}
		})
	}
}

// Defect d: exact ties went to the first ID. Three engines, no reports, 30 sequential select +
// release: a=30 under LeastLoad, under PowerOfN whose N covers the group, and under the cache-aware
// fallback when its k covers the group. Exact ties are broken uniformly at random.
func TestDefectExactTiesAreBrokenAtRandom(t *testing.T) {
	t.Parallel()
	for name, mk := range map[string]func(policy.Config, kvindex.Source) (policy.Policy, error){
		"least_load":              func(cfg policy.Config, _ kvindex.Source) (policy.Policy, error) { return policy.NewLeastLoad(cfg) },
		"power_of_3":              func(cfg policy.Config, _ kvindex.Source) (policy.Policy, error) { return policy.NewPowerOfN(cfg, 3) },
		"power_of_8":              func(cfg policy.Config, _ kvindex.Source) (policy.Policy, error) { return policy.NewPowerOfN(cfg, 8) },
		"cache_aware_fallback_k3": cacheAwareWith(policy.CacheAwareOptions{MinLoadChoices: 3}),
		"cache_aware_fallback":    cacheAwareWith(policy.CacheAwareOptions{}),
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			r := newPlainRouter(t, []state.EngineID{"a", "b", "c"}, mk)
			got := r.selectReleased(t, 30, func(i int) []uint32 { return tokens(512, uint32(400+i)) })
			for _, id := range []state.EngineID{"a", "b", "c"} {
				assert.GreaterOrEqual(t, got[id], 5, "engine %s; picks %v", id, got)
			}
		})
	}
}
