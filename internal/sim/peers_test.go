package sim

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/internal/label"
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

// TestDynamoLegacyCost checks the legacy Dynamo cost on a hand-built case. Prompt: 17 tokens, 4 full blocks of
// 4. Engine a holds all 4 blocks: cost = (17 − 16)/4 + 4 = 4.25; engine b holds none: 17/4 + 4 =
// 8.25. Each pick bound to a request adds its 1 uncached token to a's active prefill tokens and
// shares its 4 active blocks, so a's cost grows by 0.25 per request in prefill: a wins 16 times
// (4.25 + 0.25·15 = 8.0 < 8.25), ties b at the 17th; the first tokens drop the prefill tokens and
// a wins again; a request ending drops its blocks.
func TestDynamoLegacyCost(t *testing.T) {
	f := newPeerFixture(t, "a", "b")
	d, err := NewDynamoLegacy(f.env)
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
	d2, err := NewDynamoLegacy(f2.env)
	require.NoError(t, err)
	f2.rand = func(int) int { return 0 } // equal trees: ties go to the last (b)
	id, _ = pickID(t, d2, f2, prompt(1000, 160))
	require.Equal(t, state.EngineID("b"), id)
	d2.bind(0)
	d2.firstToken(0) // b: 40 active blocks, no prefill tokens
	id, _ = pickID(t, d2, f2, prompt(5000, 8))
	assert.Equal(t, state.EngineID("a"), id, "a: 2 + 2 = 4; b: 2 + 42 = 44")
}

// TestLLMDLegacyScore checks the weighted score 2·queue + 2·kv + 3·prefix and the route-time prefix
// index on a hand-built case.
func TestLLMDLegacyScore(t *testing.T) {
	f := newPeerFixture(t, "a", "b")
	l, err := NewLLMDLegacy(f.env)
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
	assert.Equal(t, map[state.EngineID]int{"a": 2, "b": 2}, l.index.matched)
}

// TestLLMDLegacyLRU checks the per-endpoint LRU: its capacity is the endpoint's KV capacity in blocks,
// and a block it evicts no longer counts for that endpoint.
func TestLLMDLegacyLRU(t *testing.T) {
	f := newPeerFixture(t, "a")
	l, err := NewLLMDLegacy(f.env)
	require.NoError(t, err)
	f.report(t, "a", 0, 0, 12) // 3 blocks of 4 tokens
	p := prompt(100, 12)
	pickID(t, l, f, p)
	require.Equal(t, 3, l.index.lrus["a"].capacity)
	pickID(t, l, f, p)
	assert.Equal(t, map[state.EngineID]int{"a": 3}, l.index.matched)
	pickID(t, l, f, prompt(500, 8)) // evicts p's two least recently added blocks (blocks 0, 1)
	pickID(t, l, f, p)
	assert.Empty(t, l.index.matched, "block 0 of p was evicted: the walk stops at once")
	assert.Len(t, l.index.lrus["a"].slot, 3)

	// At most LLMDMaxPrefixBlocks blocks are hashed.
	f.report(t, "a", 0, 0, 1<<20)
	l2, err := NewLLMDLegacy(f.env)
	require.NoError(t, err)
	pickID(t, l2, f, prompt(1, 4*300))
	assert.Len(t, l2.index.keys, LLMDMaxPrefixBlocks)
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
			guards = append(guards, f.env.InFlight.Acquire(id, -1, 0))
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
	assert.Equal(t, label.ReasonLeastLoad, reason)
	assert.Equal(t, 16, s.tree.size["a"], "the imbalanced branch still inserts the prompt")
	unload()

	load("a", 64) // 64 − 0 is not > 64: balanced
	id, reason = pickID(t, s, f, p)
	assert.Equal(t, state.EngineID("a"), id, "match rate 1 > 0.3")
	assert.Equal(t, label.ReasonCacheCandidate, reason)
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
	assert.Equal(t, label.ReasonNoCacheCandidate, reason)
	assert.Equal(t, 16, s.tree.size["b"])
	// Shares 2 of 5 blocks with q (0.4 > 0.3): b is the only worker at that depth.
	r := append(prompt(100, 4), prompt(700, 4)...)
	r = append(r, prompt(3000, 12)...)
	id, reason = pickID(t, s, f, r)
	assert.Equal(t, state.EngineID("b"), id)
	assert.Equal(t, label.ReasonCacheCandidate, reason)
}

// TestSGLangLegacyEviction checks evict_tenant_by_size: at each eviction interval a worker over
// the size cap loses its least recently used leaves until it fits, and what it lost no longer
// matches.
func TestSGLangLegacyEviction(t *testing.T) {
	f := newPeerFixture(t, "a")
	s, err := NewSGLangLegacy(f.env)
	require.NoError(t, err)
	s.tree.maxTreeTokens = 16
	old, recent := prompt(100, 16), prompt(500, 16)
	pickID(t, s, f, old)
	f.now = f.now.Add(time.Second)
	pickID(t, s, f, recent)
	assert.Equal(t, 32, s.tree.size["a"], "no eviction before the interval")
	f.now = simEpoch.Add(SGLangEvictionInterval)
	_, reason := pickID(t, s, f, recent)
	assert.Equal(t, label.ReasonCacheCandidate, reason)
	assert.Equal(t, 16, s.tree.size["a"], "evicted down to the cap, oldest leaves first")
	s.tree.keys = s.tree.hasher.AppendKeys(s.tree.keys[:0], old)
	_, depth := s.tree.match()
	assert.Zero(t, depth, "the older prompt was evicted")
	s.tree.keys = s.tree.hasher.AppendKeys(s.tree.keys[:0], recent)
	_, depth = s.tree.match()
	assert.Equal(t, 4, depth, "the recent prompt stays")
	assert.Equal(t, simEpoch.Add(2*SGLangEvictionInterval), s.tree.nextEviction)
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

func TestPeerPolicyNames(t *testing.T) {
	names := PeerPolicyNames()
	assert.Equal(t, []string{"dynamo", "llmd", "smg", "dynamo_legacy", "llmd_legacy", "sglang_legacy"}, names)
	names[0] = "changed"
	assert.Equal(t, NameDynamo, PeerPolicyNames()[0], "a new slice on every call")
	f := newPeerFixture(t, "a")
	for _, name := range PeerPolicyNames() {
		assert.NotContains(t, DefaultPolicyNames(), name)
		factory, ok := DefaultPolicies()[name]
		require.True(t, ok, name)
		p, err := factory(f.env, state.StagePlain)
		require.NoError(t, err, name)
		switch v := p.(type) {
		case *Dynamo:
			assert.Equal(t, name == NameDynamoLegacy, v.legacy, name)
			assert.Equal(t, name, v.name)
		case *LLMD:
			assert.Equal(t, NameLLMD, name)
		case *LLMDLegacy:
			assert.Equal(t, NameLLMDLegacy, name)
		case *SMG:
			assert.Equal(t, NameSMG, name)
		case *SGLangLegacy:
			assert.Equal(t, NameSGLangLegacy, name)
		default:
			t.Errorf("%s builds %T", name, p)
		}
	}
}

// TestDynamoCost checks the current Dynamo cost on a worked example (4-token blocks). Prompt p:
// 17 tokens, 4 full blocks. a holds all 4 in the index; b holds the first 2 and has one request of
// 12 other tokens in prefill (12 active prefill tokens, 3 active blocks); c is idle and cold:
//
//	a: max((0 + 17)/4 − 4, 0) + (0 + 4)  = 0.25 + 4 = 4.25
//	b: max((12 + 17)/4 − 2, 0) + (3 + 4) = 5.25 + 7 = 12.25
//	c: max((0 + 17)/4 − 0, 0) + (0 + 4)  = 4.25 + 4 = 8.25
//
// Then an exact tie between a cold a and b: the current cost draws uniformly (Rand decides), where
// the legacy one takes the smaller tree whatever Rand says.
func TestDynamoCost(t *testing.T) {
	f := newPeerFixture(t, "a", "b", "c")
	d, err := NewDynamo(f.env)
	require.NoError(t, err)
	p := prompt(100, 17)
	f.store(t, "a", p)
	f.store(t, "b", p[:8])
	_, err = d.Pick(context.Background(), f.engines[1:2], request(prompt(500, 12)))
	require.NoError(t, err)
	d.bind(0)
	require.Equal(t, 12, d.workers["b"].prefillTokens)
	require.Len(t, d.workers["b"].blocks, 3)

	id, reason := pickID(t, d, f, p)
	assert.Equal(t, state.EngineID("a"), id)
	assert.Equal(t, ReasonDynamoCost, reason)
	assert.Equal(t, []float64{4.25, 12.25, 8.25}, d.costs)
	assert.Equal(t, 1, d.workers["a"].prefillTokens, "the pick adds its one uncached token")
	d.discard()

	ties := newPeerFixture(t, "a", "b")
	ties.store(t, "a", prompt(900, 16)) // a's tree: 4 blocks, b's: none
	q := prompt(300, 8)                 // no overlap anywhere: 8/4 + 2 = 4 on both
	for _, tc := range []struct {
		legacy bool
		draw   int // Rand's answer: n−1 keeps the first of the tied, 0 takes the last
		want   state.EngineID
	}{
		{false, -1, "a"}, {false, 0, "b"}, {true, -1, "b"}, {true, 0, "b"},
	} {
		ties.rand = func(n int) int {
			if tc.draw < 0 {
				return n - 1
			}
			return tc.draw
		}
		build := NewDynamo
		if tc.legacy {
			build = NewDynamoLegacy
		}
		d, err := build(ties.env)
		require.NoError(t, err)
		id, _ := pickID(t, d, ties, q)
		assert.Equal(t, tc.want, id, "legacy %v, draw %d", tc.legacy, tc.draw)
		assert.Equal(t, []float64{4, 4}, d.costs)
	}
}

// TestLLMDStickyUntilSaturated checks the prefix affinity filter's load gate: the sticky endpoint
// keeps the request until its estimated TTFT exceeds the best non-sticky endpoint's by more than
// 18,000 ms at 15,928 tokens/s, that is until it has more than 286,704 in-flight tokens more.
func TestLLMDStickyUntilSaturated(t *testing.T) {
	f := newPeerFixture(t, "a", "b")
	l, err := NewLLMD(f.env)
	require.NoError(t, err)
	p := prompt(100, 16)
	id, reason := pickID(t, l, f, p) // nothing sticky, equal loads: the first of the tie
	require.Equal(t, state.EngineID("a"), id)
	assert.Equal(t, ReasonLLMDMaxScore, reason)
	l.bind(0)
	l.firstToken(0)
	require.Equal(t, int64(0), l.inflight["a"])

	for _, tc := range []struct {
		a, b   int64
		want   state.EngineID
		reason string
	}{
		{286_704, 0, "a", ReasonLLMDSticky},      // 18,000 ms exactly: not more than the penalty
		{300_000, 20_000, "a", ReasonLLMDSticky}, // the gap, not the level, counts: 17,579 ms
		{286_705, 0, "b", ReasonLLMDMaxScore},    // 18,000.06 ms: saturated, every endpoint competes
		{1_000_000, 0, "b", ReasonLLMDMaxScore},  // and the token load decides
	} {
		l.inflight["a"], l.inflight["b"] = tc.a, tc.b
		id, reason := pickID(t, l, f, p)
		assert.Equal(t, tc.want, id, "in flight a %d, b %d", tc.a, tc.b)
		assert.Equal(t, tc.reason, reason)
		l.discard()
		if id == "b" {
			break // b now holds p too
		}
	}
}

// TestLLMDAffinityThreshold checks the sticky threshold (prefix score ≥ 0.80, a trailing partial
// block counted as a block) and the token-load score 1 − (in-flight + uncached) ÷ 4,194,304 with
// uncached = (blocks − matched)·B + the tokens beyond the hashed blocks.
func TestLLMDAffinityThreshold(t *testing.T) {
	f := newPeerFixture(t, "a", "b")
	l, err := NewLLMD(f.env)
	require.NoError(t, err)
	p := prompt(100, 16)
	pickID(t, l, f, p) // a records p's 4 blocks
	l.discard()
	l.inflight["a"] = 1000 // busier than b: without the filter b would win

	for _, tc := range []struct {
		name     string
		tokens   []uint32
		want     state.EngineID
		reason   string
		uncached []int64
	}{
		{"4 of 5 full blocks", append(prompt(100, 16), prompt(900, 4)...), "a", ReasonLLMDSticky, []int64{4, 20}},
		{"4 of 4 full blocks and a partial one", append(prompt(100, 16), 7), "a", ReasonLLMDSticky, []int64{4, 20}},
		{"4 of 6 full blocks", append(prompt(100, 16), prompt(700, 8)...), "b", ReasonLLMDMaxScore, []int64{8, 24}},
	} {
		id, reason := pickID(t, l, f, tc.tokens)
		assert.Equal(t, tc.want, id, tc.name)
		assert.Equal(t, tc.reason, reason, tc.name)
		assert.Equal(t, tc.uncached, l.uncached, tc.name)
		l.discard()
	}
	// A request without tokens: nothing is sticky, all its InputTokens are uncached.
	pk, err := l.Pick(context.Background(), f.engines, &policy.Request{InputTokens: 30})
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("b"), pk.Engine.ID())
	assert.Equal(t, []int64{30, 30}, l.uncached)
}

// TestLLMDInFlightTokens checks the in-flight bookkeeping: a bound pick adds its uncached tokens
// to its endpoint until the first token (or the end of a request that never produced one); an
// unbound pick is undone.
func TestLLMDInFlightTokens(t *testing.T) {
	f := newPeerFixture(t, "a", "b")
	l, err := NewLLMD(f.env)
	require.NoError(t, err)
	id, _ := pickID(t, l, f, prompt(100, 16))
	require.Equal(t, state.EngineID("a"), id)
	l.bind(0)
	id, _ = pickID(t, l, f, prompt(500, 16)) // a: 16 + 16 in flight, b: 0 + 16
	require.Equal(t, state.EngineID("b"), id)
	l.bind(1)
	assert.Equal(t, map[state.EngineID]int64{"a": 16, "b": 16}, l.inflight)
	l.firstToken(0)
	assert.Equal(t, int64(0), l.inflight["a"])
	l.finished(1) // ended without a first token
	assert.Equal(t, int64(0), l.inflight["b"])
	pickID(t, l, f, prompt(900, 10))
	l.discard()
	assert.Equal(t, map[state.EngineID]int64{"a": 0, "b": 0}, l.inflight)
	l.finished(0)
	assert.Empty(t, l.active)
}

// TestSMGBranches checks SMG's cache-miss and cache-hit branches: a miss goes to the least
// (load, processed, position); a match above 0.3 to the least-loaded worker holding the prefix.
func TestSMGBranches(t *testing.T) {
	f := newPeerFixture(t, "a", "b")
	s, err := NewSMG(f.env)
	require.NoError(t, err)
	p := prompt(100, 16)
	for i, tc := range []struct {
		tokens []uint32
		want   state.EngineID
		reason string
	}{
		{p, "a", label.ReasonNoCacheCandidate},                                          // empty tree: all (0, 0), the first
		{prompt(500, 16), "b", label.ReasonNoCacheCandidate},                            // a has processed 1
		{p, "a", label.ReasonCacheCandidate},                                            // match rate 1
		{append(prompt(100, 4), prompt(700, 12)...), "b", label.ReasonNoCacheCandidate}, // rate 0.25: the miss branch
	} {
		id, reason := pickID(t, s, f, tc.tokens)
		assert.Equal(t, tc.want, id, "pick %d", i)
		assert.Equal(t, tc.reason, reason, "pick %d", i)
	}
	assert.Equal(t, map[state.EngineID]uint64{"a": 2, "b": 2}, s.processed)
	assert.Equal(t, 16, s.tree.size["a"], "p once")
	assert.Equal(t, 32, s.tree.size["b"], "two prompts of 4 blocks")
}

// TestSMGSpillGate checks the per-request gate on the matched worker: it spills to the
// least-loaded worker only when its load exceeds both 1.5 × the mean and the mean + 64.
func TestSMGSpillGate(t *testing.T) {
	f := newPeerFixture(t, "a", "b")
	s, err := NewSMG(f.env)
	require.NoError(t, err)
	p := prompt(100, 16)
	id, _ := pickID(t, s, f, p)
	require.Equal(t, state.EngineID("a"), id)
	var guards []*loadmon.Guard
	load := func(a, b int) {
		for _, g := range guards {
			g.Release()
		}
		guards = nil
		for range a {
			guards = append(guards, f.env.InFlight.Acquire("a", -1, 0))
		}
		for range b {
			guards = append(guards, f.env.InFlight.Acquire("b", -1, 0))
		}
	}
	for _, tc := range []struct {
		a, b   int
		want   state.EngineID
		reason string
	}{
		{128, 0, "a", label.ReasonCacheCandidate},   // mean 64: 128 is not above 64 + 64
		{250, 100, "a", label.ReasonCacheCandidate}, // mean 175: above 239, not above 262.5
		{301, 100, "b", ReasonSMGSpill},             // mean 200.5: above 264.5 and 300.75
	} {
		load(tc.a, tc.b)
		id, reason := pickID(t, s, f, p)
		assert.Equal(t, tc.want, id, "loads %d, %d", tc.a, tc.b)
		assert.Equal(t, tc.reason, reason)
	}
	// The spill made b a holder: the least-loaded holder wins, exact ties as Rand says.
	load(5, 7)
	id, _ = pickID(t, s, f, p)
	assert.Equal(t, state.EngineID("a"), id)
	load(5, 5)
	id, _ = pickID(t, s, f, p)
	assert.Equal(t, state.EngineID("a"), id, "Rand keeps the first of the tied")
	f.rand = func(int) int { return 0 }
	id, _ = pickID(t, s, f, p)
	assert.Equal(t, state.EngineID("b"), id, "Rand takes the last of the tied")
	load(0, 0)
}

// TestSMGMatchedTenants checks that only the first 8 workers recorded at the deepest matched node
// compete, and that a match none of whose holders is a candidate goes to the first candidate
// without updating the tree.
func TestSMGMatchedTenants(t *testing.T) {
	ids := []state.EngineID{"e0", "e1", "e2", "e3", "e4", "e5", "e6", "e7", "e8", "e9"}
	f := newPeerFixture(t, ids...)
	s, err := NewSMG(f.env)
	require.NoError(t, err)
	p := prompt(100, 16)
	for _, id := range ids {
		s.tree.prepare(f.now, f.engines, request(p))
		s.tree.insert(id, f.now)
	}
	node, depth := s.tree.match()
	require.Equal(t, 4, depth)
	first := s.tree.firstTenants(nil, node, SMGMatchedTenantsCap)
	require.Len(t, first, 8)
	var guards []*loadmon.Guard
	for _, id := range ids {
		n := 0 // the two holders past the cap: idle, yet not considered
		if i := slices.Index(first, id); i >= 0 && i < 7 {
			n = 2
		} else if i == 7 {
			n = 1
		}
		for range n {
			guards = append(guards, f.env.InFlight.Acquire(id, -1, 0))
		}
	}
	id, reason := pickID(t, s, f, p)
	assert.Equal(t, first[7], id)
	assert.Equal(t, label.ReasonCacheCandidate, reason)
	for _, g := range guards {
		g.Release()
	}

	// Only e8 and e9 as candidates, neither holding the prefix q shares with e0's record.
	q := prompt(4000, 16)
	s.tree.prepare(f.now, f.engines, request(q))
	s.tree.insert("e0", f.now)
	size := s.tree.total
	pk, err := s.Pick(context.Background(), f.engines[8:], request(q))
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("e8"), pk.Engine.ID())
	assert.Equal(t, size, s.tree.total, "the tree is not updated")
}

// TestSMGEviction checks the shared budget: every interval, while the whole tree holds more than
// the cap, the least recently used leaves go, whichever worker holds them.
func TestSMGEviction(t *testing.T) {
	f := newPeerFixture(t, "a", "b")
	s, err := NewSMG(f.env)
	require.NoError(t, err)
	s.tree.maxTreeTokens = 16
	old, recent := prompt(100, 16), prompt(500, 16)
	id, _ := pickID(t, s, f, old)
	require.Equal(t, state.EngineID("a"), id)
	f.now = f.now.Add(time.Second)
	id, _ = pickID(t, s, f, recent)
	require.Equal(t, state.EngineID("b"), id)
	assert.Equal(t, 32, s.tree.total, "no eviction before the interval")
	f.now = simEpoch.Add(SMGEvictionInterval)
	id, reason := pickID(t, s, f, recent)
	assert.Equal(t, state.EngineID("b"), id)
	assert.Equal(t, label.ReasonCacheCandidate, reason)
	assert.Equal(t, 16, s.tree.total, "evicted down to the cap")
	assert.Equal(t, 0, s.tree.size["a"], "a's prompt was the least recently used, though a alone is within the cap")
	assert.Equal(t, 16, s.tree.size["b"])
	assert.Equal(t, simEpoch.Add(2*SMGEvictionInterval), s.tree.nextEviction)
}

// TestPeerBookkeepingDrains replays a short trace prefix with the peers that follow their requests
// (Dynamo, LLMD) on two router replicas, PD fleet included, and checks that their per-request
// records drain to zero once every request has ended.
func TestPeerBookkeepingDrains(t *testing.T) {
	tr, err := MooncakeConversation()
	require.NoError(t, err)
	for _, fleet := range []Fleet{{Plain: 4}, {Prefill: 2, Decode: 2}} {
		cfg := Config{Trace: tr, Fleet: fleet, Speed: 4, Limit: 200, Seed: 2, Routers: 2,
			Policies: []string{NameDynamo, NameLLMD, NameDynamoLegacy}}
		var mu sync.Mutex
		checked := 0
		cfg.inspect = func(r *run) error {
			for _, rep := range r.replicas {
				for _, tk := range rep.trackers {
					switch p := tk.(type) {
					case *Dynamo:
						assert.Empty(t, p.active, "%s", r.name)
						for id, w := range p.workers {
							assert.Zero(t, w.prefillTokens, "%s: %s", r.name, id)
							assert.Empty(t, w.blocks, "%s: %s", r.name, id)
						}
					case *LLMD:
						assert.Empty(t, p.active, "%s", r.name)
						assert.Nil(t, p.pending, "%s", r.name)
						for id, n := range p.inflight {
							assert.Zero(t, n, "%s: %s", r.name, id)
						}
					default:
						t.Errorf("%s: unexpected tracker %T", r.name, tk)
					}
					mu.Lock()
					checked++
					mu.Unlock()
				}
			}
			return nil
		}
		rep, err := Replay(context.Background(), cfg)
		require.NoError(t, err)
		assert.Equal(t, 6, checked, "%+v: two replicas × three tracking peers", fleet)
		for _, r := range rep.Results {
			assert.Equal(t, 200, r.Completed, "%+v: %s", fleet, r.Policy)
		}
	}
}

// TestPeersBasicReports checks how each peer reads a basic load report (running and waiting
// requests, no KV figures) against a full one in which a's KV cache is 90 % used. Only
// llmd_legacy reads KV usage: with it b wins (score 4 against 2 + 2·0.1); without it a missing
// usage reads 0, as llm-d's zero metrics do, and the exact tie goes to the first candidate. The
// others read none of the reports and pick the same in both.
func TestPeersBasicReports(t *testing.T) {
	for _, tc := range []struct {
		name        string
		full, basic state.EngineID
	}{
		{NameDynamo, "a", "a"}, {NameLLMD, "a", "a"}, {NameSMG, "a", "a"},
		{NameDynamoLegacy, "a", "a"}, {NameLLMDLegacy, "b", "a"}, {NameSGLangLegacy, "a", "a"},
	} {
		for _, basic := range []bool{false, true} {
			f := newPeerFixture(t, "a", "b")
			if basic {
				f.report(t, "a", 0, 0, 0)
				f.report(t, "b", 0, 0, 0)
			} else {
				f.report(t, "a", 0, 900, 1000)
				f.report(t, "b", 0, 0, 1000)
			}
			p, err := DefaultPolicies()[tc.name](f.env, state.StagePlain)
			require.NoError(t, err)
			id, _ := pickID(t, p, f, prompt(100, 16))
			want := tc.full
			if basic {
				want = tc.basic
			}
			assert.Equal(t, want, id, "%s, basic %v", tc.name, basic)
		}
	}
}
