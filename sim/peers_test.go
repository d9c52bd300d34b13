package sim

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// peerFixture is a hand-driven PolicyEnv: 4-token blocks, a settable clock, engines a and b.
type peerFixture struct {
	env     PolicyEnv
	now     time.Time
	engines []state.Engine
	rand    func(int) int
}

func newPeerFixture(t *testing.T, ids ...state.EngineID) *peerFixture {
	t.Helper()
	f := &peerFixture{now: simEpoch}
	clock := func() time.Time { return f.now }
	h, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: 4})
	require.NoError(t, err)
	x, err := kvindex.NewIndex(h, kvindex.Options{Now: clock})
	require.NoError(t, err)
	f.rand = func(n int) int { return n - 1 } // keep the first of tied candidates
	f.env = PolicyEnv{Load: loadmon.NewTable(loadmon.WithClock(clock)), InFlight: loadmon.NewInFlight(clock),
		Index: x, Rand: func(n int) int { return f.rand(n) }, Now: clock}
	for _, id := range ids {
		f.engines = append(f.engines, state.NewStaticEngine(id, simModel, state.StagePlain))
	}
	return f
}

// report publishes a load report for engine id.
func (f *peerFixture) report(t *testing.T, id state.EngineID, waiting, usedKV, capacity uint64) {
	t.Helper()
	require.NoError(t, f.env.Load.Report(loadmon.Report{Engine: id, WaitingRequests: waiting,
		UsedKVTokens: usedKV, KVCapacityTokens: capacity}))
}

// store makes engine id hold the full blocks of tokens in the fixture's index.
func (f *peerFixture) store(t *testing.T, id state.EngineID, tokens []uint32) {
	t.Helper()
	n := len(tokens) / 4
	hashes := make([]uint64, n)
	for i := range hashes {
		hashes[i] = uint64(i + 1)
	}
	require.NoError(t, f.env.Index.Store(kvindex.StoreEvent{Engine: id, BlockHashes: hashes, TokenIDs: tokens[:4*n],
		Tier: kvindex.TierDevice}))
}

func request(tokens []uint32) *policy.Request {
	return &policy.Request{Model: simModel, Stage: state.StagePlain, InputTokens: uint64(len(tokens)), TokenIDs: tokens}
}

// prompt returns n tokens: block i (4 tokens) is 4 copies of base+i, the last block cut to n.
func prompt(base uint32, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = base + uint32(i/4)
	}
	return out
}

func pickID(t *testing.T, p policy.Policy, f *peerFixture, tokens []uint32) (state.EngineID, string) {
	t.Helper()
	pk, err := p.Pick(context.Background(), f.engines, request(tokens))
	require.NoError(t, err)
	return pk.Engine.ID(), pk.Reason
}

// TestDynamoCost checks Dynamo's cost on a hand-built case. Prompt: 17 tokens, 4 full blocks of
// 4. Engine a holds all 4 blocks: cost = (17 − 16)/4 + 4 = 4.25; engine b holds none: 17/4 + 4 =
// 8.25. Each pick bound to a request adds its 1 uncached token to a's active prefill tokens and
// shares its 4 active blocks, so a's cost grows by 0.25 per request in prefill: a wins 16 times
// (4.25 + 0.25·15 = 8.0 < 8.25), ties b at the 17th; the first tokens drop the prefill tokens and
// a wins again; a request ending drops its blocks.
func TestDynamoCost(t *testing.T) {
	f := newPeerFixture(t, "a", "b")
	d, err := NewDynamo(f.env)
	require.NoError(t, err)
	p := prompt(100, 17)
	f.store(t, "a", p)
	for i := range 16 {
		id, reason := pickID(t, d, f, p)
		require.Equal(t, state.EngineID("a"), id, "pick %d", i)
		assert.Equal(t, ReasonDynamoCost, reason)
		d.bind(int32(i))
	}
	assert.Equal(t, 16, d.workers["a"].prefillTokens)
	assert.Len(t, d.workers["a"].blocks, 4, "the same 4 blocks, reference-counted")
	// The 17th is an exact tie (8.25 both): the smaller tree wins (b holds no block, a 4),
	// whatever Rand says.
	id, _ := pickID(t, d, f, p)
	assert.Equal(t, state.EngineID("b"), id, "tie broken by tree size")
	d.discard()
	assert.Equal(t, 16, d.workers["a"].prefillTokens, "discard undoes the pick")
	assert.Equal(t, 0, d.workers["b"].prefillTokens)
	assert.Empty(t, d.workers["b"].blocks)

	for i := range 16 {
		d.firstToken(int32(i))
	}
	assert.Equal(t, 0, d.workers["a"].prefillTokens, "first tokens drop the prefill tokens")
	assert.Len(t, d.workers["a"].blocks, 4, "blocks stay until the requests end")
	for i := range 16 {
		d.finished(int32(i))
	}
	assert.Empty(t, d.workers["a"].blocks, "finished requests drop their blocks")
	assert.Empty(t, d.active)

	// Decode blocks count: b busy with 40 active blocks of other prompts loses even without
	// overlap anywhere.
	f2 := newPeerFixture(t, "a", "b")
	d2, err := NewDynamo(f2.env)
	require.NoError(t, err)
	f2.rand = func(int) int { return 0 } // equal trees: ties go to the last (b)
	id, _ = pickID(t, d2, f2, prompt(1000, 160))
	require.Equal(t, state.EngineID("b"), id)
	d2.bind(0)
	d2.firstToken(0) // b: 40 active blocks, no prefill tokens
	id, _ = pickID(t, d2, f2, prompt(5000, 8))
	assert.Equal(t, state.EngineID("a"), id, "a: 2 + 2 = 4; b: 2 + 42 = 44")
}

// TestLLMDScore checks the weighted score 2·queue + 2·kv + 3·prefix and the route-time prefix
// index on a hand-built case.
func TestLLMDScore(t *testing.T) {
	f := newPeerFixture(t, "a", "b")
	l, err := NewLLMD(f.env)
	require.NoError(t, err)
	p := prompt(100, 16) // 4 blocks
	f.report(t, "a", 4, 0, 1000)
	f.report(t, "b", 0, 0, 1000)
	// No prefix anywhere: a = 2·0 + 2·1 = 2, b = 2·1 + 2·1 = 4.
	id, reason := pickID(t, l, f, p)
	require.Equal(t, state.EngineID("b"), id)
	assert.Equal(t, ReasonLLMDMaxScore, reason)
	// b now holds p in the scheduler's own index, though no engine event says so.
	f.report(t, "a", 0, 0, 1000)
	f.report(t, "b", 4, 0, 1000)
	// a = 2·1 + 2 = 4; b = 0 + 2 + 3·1 = 5.
	id, _ = pickID(t, l, f, p)
	assert.Equal(t, state.EngineID("b"), id, "prefix outweighs the queue")
	// b's KV 60 % used: b = 0 + 2·0.4 + 3 = 3.8 < a = 4.
	f.report(t, "b", 4, 600, 1000)
	id, _ = pickID(t, l, f, p)
	assert.Equal(t, state.EngineID("a"), id, "queue and KV outweigh the prefix")
	// Both now hold p: a prompt sharing its first 2 of 4 blocks scores prefix 0.5 on each.
	q := append(prompt(100, 8), prompt(900, 8)...)
	f.report(t, "a", 0, 0, 1000)
	f.report(t, "b", 0, 0, 1000)
	pickID(t, l, f, q)
	assert.Equal(t, map[state.EngineID]int{"a": 2, "b": 2}, l.matched)
}

// TestLLMDLRU checks the per-endpoint LRU: its capacity is the endpoint's KV capacity in blocks,
// and a block it evicts no longer counts for that endpoint.
func TestLLMDLRU(t *testing.T) {
	f := newPeerFixture(t, "a")
	l, err := NewLLMD(f.env)
	require.NoError(t, err)
	f.report(t, "a", 0, 0, 12) // 3 blocks of 4 tokens
	p := prompt(100, 12)
	pickID(t, l, f, p)
	require.Equal(t, 3, l.lrus["a"].capacity)
	pickID(t, l, f, p)
	assert.Equal(t, map[state.EngineID]int{"a": 3}, l.matched)
	pickID(t, l, f, prompt(500, 8)) // evicts p's two least recently added blocks (blocks 0, 1)
	pickID(t, l, f, p)
	assert.Empty(t, l.matched, "block 0 of p was evicted: the walk stops at once")
	assert.Len(t, l.lrus["a"].slot, 3)

	// At most LLMDMaxPrefixBlocks blocks are hashed.
	f.report(t, "a", 0, 0, 1<<20)
	l2, err := NewLLMD(f.env)
	require.NoError(t, err)
	pickID(t, l2, f, prompt(1, 4*300))
	assert.Len(t, l2.keys, LLMDMaxPrefixBlocks)
}

func TestBlockLRU(t *testing.T) {
	c := newBlockLRU(2)
	_, ev := c.add(1)
	assert.False(t, ev)
	_, ev = c.add(2)
	assert.False(t, ev)
	_, ev = c.add(1) // refresh: 2 is now the oldest
	assert.False(t, ev)
	old, ev := c.add(3)
	assert.True(t, ev)
	assert.Equal(t, uint64(2), old)
	old, ev = c.add(4)
	assert.True(t, ev)
	assert.Equal(t, uint64(1), old)
	assert.Len(t, c.slot, 2)
}

// TestSGLangLegacy checks the three branches: imbalance → first least-loaded; a match above the
// threshold → the worker at the deepest node; otherwise → the smallest tree.
func TestSGLangLegacy(t *testing.T) {
	f := newPeerFixture(t, "a", "b")
	s, err := NewSGLangLegacy(f.env)
	require.NoError(t, err)
	p := prompt(100, 16) // 4 blocks
	var guards []*loadmon.Guard
	load := func(id state.EngineID, n int) {
		for range n {
			guards = append(guards, f.env.InFlight.Acquire(id))
		}
	}
	unload := func() {
		for _, g := range guards {
			g.Release()
		}
		guards = nil
	}

	load("b", 66) // max − min = 66 > 64 and 66 > 1.5 · 0
	id, reason := pickID(t, s, f, p)
	assert.Equal(t, state.EngineID("a"), id)
	assert.Equal(t, policy.ReasonLeastLoad, reason)
	assert.Equal(t, 16, s.size["a"], "the imbalanced branch still inserts the prompt")
	unload()

	load("a", 64) // 64 − 0 is not > 64: balanced
	id, reason = pickID(t, s, f, p)
	assert.Equal(t, state.EngineID("a"), id, "match rate 1 > 0.3")
	assert.Equal(t, policy.ReasonCacheCandidate, reason)
	unload()
	load("a", 100)
	load("b", 67) // 33 apart: balanced
	id, _ = pickID(t, s, f, p)
	assert.Equal(t, state.EngineID("a"), id)
	unload()

	// Shares 1 block of 4 with p: rate 0.25 ≤ 0.3 → the smallest tree (b, empty).
	q := append(prompt(100, 4), prompt(700, 12)...)
	id, reason = pickID(t, s, f, q)
	assert.Equal(t, state.EngineID("b"), id)
	assert.Equal(t, policy.ReasonNoCacheCandidate, reason)
	assert.Equal(t, 16, s.size["b"])
	// Shares 2 of 5 blocks with q (0.4 > 0.3): b is the only worker at that depth.
	r := append(prompt(100, 4), prompt(700, 4)...)
	r = append(r, prompt(3000, 12)...)
	id, reason = pickID(t, s, f, r)
	assert.Equal(t, state.EngineID("b"), id)
	assert.Equal(t, policy.ReasonCacheCandidate, reason)
}

// TestSGLangLegacyEviction checks evict_tenant_by_size: at each eviction interval a worker over
// the size cap loses its least recently used leaves until it fits, and what it lost no longer
// matches.
func TestSGLangLegacyEviction(t *testing.T) {
	f := newPeerFixture(t, "a")
	s, err := NewSGLangLegacy(f.env)
	require.NoError(t, err)
	s.maxTreeTokens = 16
	old, recent := prompt(100, 16), prompt(500, 16)
	pickID(t, s, f, old)
	f.now = f.now.Add(time.Second)
	pickID(t, s, f, recent)
	assert.Equal(t, 32, s.size["a"], "no eviction before the interval")
	f.now = simEpoch.Add(SGLangEvictionInterval)
	_, reason := pickID(t, s, f, recent)
	assert.Equal(t, policy.ReasonCacheCandidate, reason)
	assert.Equal(t, 16, s.size["a"], "evicted down to the cap, oldest leaves first")
	s.keys = s.hasher.AppendKeys(s.keys[:0], old)
	_, depth := s.match()
	assert.Zero(t, depth, "the older prompt was evicted")
	s.keys = s.hasher.AppendKeys(s.keys[:0], recent)
	_, depth = s.match()
	assert.Equal(t, 4, depth, "the recent prompt stays")
	assert.Equal(t, simEpoch.Add(2*SGLangEvictionInterval), s.nextEviction)
}

// countingChecker counts admission checks and rejects engines in reject.
type countingChecker struct {
	n      atomic.Int64
	reject state.EngineID
}

func (c *countingChecker) Check(e state.Engine, _ admission.Metrics) (admission.Verdict, error) {
	c.n.Add(1)
	if e.ID() == c.reject {
		return admission.Verdict{Limit: admission.LimitInFlightRequests, Observed: 1, Cap: 1}, nil
	}
	return admission.Verdict{Admit: true}, nil
}

// TestPeersConform runs the policy.Policy contract against every peer baseline: the pick is one
// of the exact candidates; no candidates → ErrNoCandidates without an admission check; admission
// runs exactly once per pick and its rejection comes back as *policy.AdmissionRejectedError;
// concurrent picks are safe (run with -race).
func TestPeersConform(t *testing.T) {
	for _, name := range PeerPolicyNames() {
		t.Run(name, func(t *testing.T) {
			f := newPeerFixture(t, "a", "b", "c", "d")
			checker := &countingChecker{}
			f.env.Admission = checker
			f.env.Rand = func(n int) int { return 0 } // concurrent-safe
			p, err := DefaultPolicies()[name](f.env, state.StagePlain)
			require.NoError(t, err)

			_, err = p.Pick(context.Background(), nil, request(prompt(1, 16)))
			assert.ErrorIs(t, err, policy.ErrNoCandidates)
			assert.Zero(t, checker.n.Load())

			var wg sync.WaitGroup
			for g := range 4 {
				wg.Go(func() {
					for i := range 50 {
						pk, err := p.Pick(context.Background(), f.engines, request(prompt(uint32(g*1000+i%5), 20)))
						if !assert.NoError(t, err) {
							return
						}
						found := false
						for _, e := range f.engines {
							found = found || e == pk.Engine
						}
						assert.True(t, found, "pick %v is not a candidate", pk.Engine)
					}
				})
			}
			wg.Wait()
			assert.Equal(t, int64(200), checker.n.Load(), "one admission check per pick")

			checker.reject = "a"
			only := f.engines[:1]
			_, err = p.Pick(context.Background(), only, request(prompt(1, 16)))
			var rej *policy.AdmissionRejectedError
			require.ErrorAs(t, err, &rej)
			assert.Equal(t, state.EngineID("a"), rej.Engine.ID())
			assert.True(t, errors.Is(err, policy.ErrAdmissionRejected))
		})
	}
}

func TestPeersNeedHandles(t *testing.T) {
	for _, name := range PeerPolicyNames() {
		_, err := DefaultPolicies()[name](PolicyEnv{}, state.StagePlain)
		assert.ErrorIs(t, err, state.ErrInvalidConfiguration, fmt.Sprintf("%s with an empty PolicyEnv", name))
	}
}
