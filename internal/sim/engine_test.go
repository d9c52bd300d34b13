package sim

import (
	"fmt"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/state"
)

// cacheFixture is one kvCache publishing into its own index, with 4-token blocks.
type cacheFixture struct {
	c      *kvCache
	index  *kvindex.Index
	hasher kvindex.Hasher
}

func newCacheFixture(t *testing.T, capacity int) *cacheFixture {
	t.Helper()
	h, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: 4})
	require.NoError(t, err)
	x, err := kvindex.NewIndex(h, kvindex.Options{})
	require.NoError(t, err)
	m := EngineModel{BlockTokens: 4, KVCapacityTokens: capacity, MaxContextTokens: capacity}
	m.fill()
	return &cacheFixture{c: newKVCache("e", &m, []*kvindex.Index{x}, nil, true), index: x, hasher: h}
}

// tokens returns n token IDs in blocks of 4: block i holds 4 copies of ids[i].
func tokens(ids ...uint32) []uint32 {
	var out []uint32
	for _, id := range ids {
		out = append(out, id, id, id, id)
	}
	return out
}

// admit references the cached prefix of toks, reserves the rest, caches every block as one
// prefill would, and returns the chain the request holds.
func (f *cacheFixture) admit(t *testing.T, toks []uint32) []int32 {
	t.Helper()
	hashes, _ := appendEngineHashes(nil, nil, toks, 4, engineHashSeed)
	keys := f.hasher.Keys(toks)
	c := f.c
	m := c.match(hashes)
	var chain []int32
	for _, h := range hashes[:m] {
		chain = append(chain, c.acquire(h))
	}
	require.NoError(t, c.reserve(len(toks)-4*m))
	for j := m; j < len(hashes); j++ {
		parent := int32(-1)
		if j > 0 {
			parent = chain[j-1]
		}
		chain = append(chain, c.insert(hashes[j], parent, keys[j]))
	}
	if m < len(hashes) {
		var parent uint64
		if m > 0 {
			parent = hashes[m-1]
		}
		require.NoError(t, c.publishStored(-1, parent, m > 0, hashes[m:], toks[4*m:]))
	}
	return chain
}

// held returns how many leading blocks of toks the index says engine "e" holds.
func (f *cacheFixture) held(toks []uint32) int {
	return f.index.Match(f.hasher.Keys(toks)).Blocks("e")
}

func TestKVCacheEvictsLeastRecentLeafFirst(t *testing.T) {
	f := newCacheFixture(t, 24) // six blocks
	a := tokens(1, 2, 3)
	b := tokens(1, 2, 4) // shares two blocks with a
	ca := f.admit(t, a)
	cb := f.admit(t, b)
	assert.Equal(t, 4, f.c.cached, "a and b share their first two blocks")
	assert.Equal(t, 3, f.held(a))
	assert.Equal(t, 3, f.held(b))
	assert.Equal(t, 16, f.c.used())

	f.c.release(ca) // a's leaf becomes evictable; the shared prefix is still b's
	assert.Equal(t, 1, f.c.evictable)
	f.c.release(cb) // b's leaf joins the list; the shared blocks are unreferenced but not leaves
	assert.Equal(t, 4, f.c.evictable)
	assert.Zero(t, f.c.used())

	// Need 12 of 24 tokens with 8 free: one block must go, and it is a's leaf, released first.
	require.True(t, f.c.canReserve(12))
	require.NoError(t, f.c.reserve(12))
	assert.Equal(t, 3, f.c.cached)
	assert.Equal(t, 2, f.held(a), "a lost its leaf")
	assert.Equal(t, 3, f.held(b))

	// Need 8 more with 0 free: b's leaf, then the now-childless shared block, deepest first.
	require.NoError(t, f.c.reserve(8))
	assert.Equal(t, 1, f.c.cached)
	assert.Equal(t, 1, f.held(b))
	assert.Equal(t, f.c.capacity, f.c.private+4*f.c.cached, "full, not over")
	assert.False(t, f.c.canReserve(8), "only one evictable block left")
	assert.LessOrEqual(t, f.c.peak, f.c.capacity)
	assert.Equal(t, f.c.cached, treeSize(f.index.Stats(), "e"))
}

func TestKVCacheReferencedBlocksAreNotEvicted(t *testing.T) {
	f := newCacheFixture(t, 16)
	a := tokens(1, 2, 3)
	chain := f.admit(t, a)
	assert.False(t, f.c.canReserve(8), "a holds 12 of 16 tokens")
	require.True(t, f.c.canReserve(4))
	require.NoError(t, f.c.reserve(4))
	assert.Equal(t, 3, f.held(a))
	f.c.release(chain)
	f.c.unreserve(4)
	require.NoError(t, f.c.reserve(16))
	assert.Zero(t, f.c.cached)
	assert.Zero(t, f.held(a))
	st := f.index.Stats()
	assert.True(t, slices.ContainsFunc(st.Ranks, func(r kvindex.RankStats) bool { return r.Engine == "e" }),
		"the engine stays known to the index with no blocks")
	assert.Zero(t, treeSize(st, "e"))
}

// TestDecodeRunArithmetic checks the analytic decode run against stepping it one step at a time,
// and that a cut lands on the first step boundary at or after the cut time.
func TestDecodeRunArithmetic(t *testing.T) {
	m := DefaultEngineModel()
	for _, tc := range []struct{ kv, batch, steps int }{{0, 1, 1}, {12_000, 1, 300}, {240_000, 20, 57}, {1_000_000, 200, 2}} {
		t.Run(fmt.Sprintf("kv=%d,batch=%d,steps=%d", tc.kv, tc.batch, tc.steps), func(t *testing.T) {
			e := &engine{m: &m, kv0: float64(tc.kv), bsize: float64(tc.batch), steps: tc.steps}
			var sum float64
			for i := range tc.steps {
				sum += m.DecodeStepBase.Seconds() + m.kvTokenSeconds()*float64(tc.kv+i*tc.batch)
				assert.InDelta(t, sum, e.decodeTime(i+1).Seconds(), 1e-9, "after %d steps", i+1)
			}
			total := e.decodeTime(tc.steps)
			for _, elapsed := range []time.Duration{0, 1, total / 3, total / 2, total - 1, total} {
				k := e.stepsCovering(elapsed)
				require.GreaterOrEqual(t, k, 0)
				require.LessOrEqual(t, k, tc.steps)
				assert.GreaterOrEqual(t, e.decodeTime(k), elapsed, "elapsed %v: %d steps end too early", elapsed, k)
				if k > 0 {
					assert.Less(t, e.decodeTime(k-1), elapsed, "elapsed %v: %d steps is not the first boundary", elapsed, k)
				}
			}
		})
	}
}

func TestEngineModelDefaultsAndValidation(t *testing.T) {
	m := DefaultEngineModel()
	assert.Equal(t, 131072, m.KVBytesPerToken, "Llama-3-8B: 2 × 32 layers × 8 KV heads × 128 dim × 2 bytes")
	assert.Equal(t, 8192, m.ChunkedPrefillTokens)
	assert.Equal(t, MooncakeBlockTokens, m.BlockTokens)
	assert.InDelta(t, 48.9e-9, m.kvTokenSeconds(), 0.1e-9)
	assert.InDelta(t, 0.031, m.transferTime(12_000).Seconds(), 0.001, "12k-token prompt over 50 GB/s")
	require.NoError(t, m.validate())
	for name, bad := range map[string]EngineModel{
		"BlockTokens":      {BlockTokens: 1 << 17},
		"MaxRunning":       {MaxRunningRequests: -1},
		"Chunk":            {ChunkedPrefillTokens: -1},
		"DecodeStepBase":   {DecodeStepBase: -time.Second},
		"Memory bandwidth": {MemoryBytesPerSecond: -1},
		"Transfer":         {KVTransferBytesPerSecond: -1},
		"KV below context": {KVCapacityTokens: 100, MaxContextTokens: 200},
	} {
		bad.fill()
		assert.ErrorIs(t, bad.validate(), state.ErrInvalidConfiguration, name)
	}
}

// TestPrefillSeconds checks both prefill time models on exact values: the flat model charges
// uncached tokens only, at one rate; the attention model charges each uncached token its linear
// work plus attention over every token at or before it, cached ones included.
func TestPrefillSeconds(t *testing.T) {
	m := EngineModel{PrefillLinearTokensPerSecond: 1000, PrefillAttentionPairsPerSecond: 1e6, PrefillTokensPerSecond: 500}
	m.fill()
	require.Equal(t, PrefillAttention, m.PrefillModel, "the attention model is the default")
	cases := []struct {
		name            string
		tokens, context int
		want            float64
	}{
		{"cold 1000", 1000, 0, 1000.0/1000 + (1000.0*1001/2)/1e6},
		{"100 after 4000 cached", 100, 4000, 100.0/1000 + (100.0*4000+100.0*101/2)/1e6},
		{"one token after 10000", 1, 10_000, 1.0/1000 + 10_001.0/1e6},
		{"nothing", 0, 5000, 0},
	}
	for _, tc := range cases {
		assert.InDelta(t, tc.want, m.prefillSeconds(tc.tokens, tc.context), 1e-12, "attention %s", tc.name)
	}
	// A hit saves its own tokens' work but the tokens after it still attend over it: 1,000
	// tokens with 4,000 cached cost more than 1,000 cold ones.
	assert.Greater(t, m.prefillSeconds(1000, 4000), m.prefillSeconds(1000, 0))

	flat := m
	flat.PrefillModel = PrefillFlat
	for _, tc := range cases {
		assert.InDelta(t, float64(tc.tokens)/500, flat.prefillSeconds(tc.tokens, tc.context), 1e-12, "flat %s", tc.name)
	}

	bad := EngineModel{PrefillModel: "quadratic"}
	bad.fill()
	assert.ErrorIs(t, bad.validate(), state.ErrInvalidConfiguration)
	for _, f := range []func(*EngineModel){
		func(m *EngineModel) { m.PrefillLinearTokensPerSecond = -1 },
		func(m *EngineModel) { m.PrefillAttentionPairsPerSecond = math.Inf(1) },
	} {
		m := EngineModel{}
		f(&m)
		m.fill()
		assert.ErrorIs(t, m.validate(), state.ErrInvalidConfiguration)
	}
}

// With PriorityScheduling an engine's waiting requests are served by priority, then in arrival
// order; without, in arrival order: one engine, ten band-0 requests queued behind a prefill step,
// then a band-1 request, each prompt a whole 1,000-token step.
func TestEnginePriorityScheduling(t *testing.T) {
	t.Parallel()
	tr := &Trace{Name: "priority"}
	for i := range 11 {
		r := Request{Index: i, Arrival: time.Duration(i) * time.Millisecond, InputTokens: 1000, OutputTokens: 1, Tenant: "bulk"}
		if i == 10 {
			r.Priority, r.Tenant = 1, "urgent"
		}
		tr.Requests = append(tr.Requests, r)
	}
	tr.Tenants = []Tenant{{Name: "bulk", Weight: 1}, {Name: "urgent", Weight: 1}}
	for _, tc := range []struct {
		priority bool
		steps    float64 // the urgent request's TTFT, in prefill steps
	}{{false, 11}, {true, 2}} {
		cfg := Config{Trace: tr, Fleet: Fleet{Plain: 1}, Policies: []string{NameRoundRobin},
			Model: EngineModel{ChunkedPrefillTokens: 1000, PriorityScheduling: tc.priority}}
		rep := replayLogged(t, cfg)
		step := rep.Model.prefillSeconds(1000, 0)
		urgent := tenant(t, rep.Results[0], "urgent")
		assert.InDelta(t, tc.steps*step-0.010, urgent.TTFT.P50, 1e-6, "priority scheduling %v: arrived 10 ms after the first", tc.priority)
	}
}
