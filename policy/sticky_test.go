package policy_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

func memStore(t testing.TB) *affinity.MemoryStore {
	t.Helper()
	st, err := affinity.NewMemoryStore(affinity.Options{})
	require.NoError(t, err)
	return st
}

func TestStickyOptionsValidation(t *testing.T) {
	t.Parallel()
	st := memStore(t)
	e := newEnv()
	for _, o := range []policy.StickyOptions{
		{},
		{Store: st, Rendezvous: true},
		{Store: st, Fallback: "cache_aware"},
		{Store: st, Fallback: "ROUND_ROBIN"},
		{Store: st, LoadFactor: 1.5},
		{Rendezvous: true, LoadFactor: 0.5},
		{Rendezvous: true, LoadFactor: -1},
		{Rendezvous: true, LoadFactor: math.NaN()},
		{Rendezvous: true, LoadFactor: math.Inf(1)},
	} {
		_, err := policy.NewSticky(e.cfg(), o)
		assert.ErrorIs(t, err, policy.ErrInvalidConfiguration, "NewSticky(%+v)", o)
	}
	_, err := policy.NewSticky(policy.Config{}, policy.StickyOptions{Store: st})
	assert.ErrorIs(t, err, policy.ErrInvalidConfiguration, "nil state handles")
	for _, o := range []policy.StickyOptions{
		{Store: st}, {Store: st, Fallback: label.Random}, {Rendezvous: true}, {Rendezvous: true, LoadFactor: 1},
	} {
		_, err := policy.NewSticky(e.cfg(), o)
		assert.NoError(t, err, "NewSticky(%+v)", o)
	}
	_, err = policy.NewSessionAware(e.cfg(), policy.SessionAwareOptions{})
	assert.ErrorIs(t, err, policy.ErrInvalidConfiguration, "SessionAware without a store")
	_, err = policy.NewSessionAware(e.cfg(), policy.SessionAwareOptions{Store: st, Choices: -1})
	assert.ErrorIs(t, err, policy.ErrInvalidConfiguration)
}

// Each fallback serves keyless requests by its own rule, and Sticky's admission checks its pick
// exactly once (the fallback itself admits everything).
func TestStickyFallbacks(t *testing.T) {
	t.Parallel()
	cands := engines(state.StagePlain, "a", "b", "c")
	cases := []struct {
		fallback string
		rand     []int
		want     []state.EngineID
	}{
		{"", nil, []state.EngineID{"a", "b", "c", "a"}}, // round_robin is the default
		{label.RoundRobin, nil, []state.EngineID{"a", "b", "c", "a"}},
		{label.Random, []int{2, 0, 2, 1}, []state.EngineID{"c", "a", "c", "b"}},
		{label.PowerOfTwo, []int{0, 1, 2, 1, 0, 2, 1, 2}, []state.EngineID{"b", "b", "a", "b"}}, // (a,c) sampled: a
		{label.LeastLoad, nil, []state.EngineID{"b", "b", "b", "b"}},
	}
	for _, c := range cases {
		t.Run("fallback="+c.fallback, func(t *testing.T) {
			t.Parallel()
			e := newEnv()
			e.rnd.vals = c.rand
			e.native("a", loadmon.Report{WaitingRequests: 5, Native: &loadmon.NativeLoad{WaitingUncachedTokens: 5000}})
			e.native("b", loadmon.Report{})
			e.native("c", loadmon.Report{WaitingRequests: 9, Native: &loadmon.NativeLoad{WaitingUncachedTokens: 9000}})
			for _, mode := range []policy.StickyOptions{{Store: memStore(t)}, {Rendezvous: true}} {
				mode.Fallback = c.fallback
				e.rnd.vals = slices.Clone(c.rand)
				p, err := policy.NewSticky(e.cfg(), mode)
				require.NoError(t, err)
				var got []state.EngineID
				for range c.want {
					pk, err := p.Pick(ctx, cands, &policy.Request{Stage: state.StagePlain})
					require.NoError(t, err)
					assert.Equal(t, label.ReasonNoRoutingKey, pk.Reason)
					got = append(got, pk.Engine.ID())
				}
				assert.Equal(t, c.want, got, "rendezvous=%v", mode.Rendezvous)
			}
			assert.Len(t, e.check.Calls(), 2*len(c.want), "one admission check per pick")

			e.check.reject = map[state.EngineID]string{"b": "full", "a": "full", "c": "full"}
			p, err := policy.NewSticky(e.cfg(), policy.StickyOptions{Store: memStore(t), Fallback: c.fallback})
			require.NoError(t, err)
			_, err = p.Pick(ctx, cands, &policy.Request{RoutingKey: "k"})
			assert.ErrorIs(t, err, policy.ErrAdmissionRejected, "the fallback's pick is checked by Sticky's admission")
		})
	}
}

// Store mode with the default round-robin fallback: new keys rotate, known keys stay.
func TestStickyStoreBindsNewKeysThroughTheFallback(t *testing.T) {
	t.Parallel()
	e := newEnv()
	st := memStore(t)
	p, err := policy.NewSticky(e.cfg(), policy.StickyOptions{Store: st})
	require.NoError(t, err)
	cands := engines(state.StagePlain, "a", "b", "c")
	pick := func(key string) policy.Pick {
		pk, err := p.Pick(ctx, cands, &policy.Request{Model: "m", BucketID: "x", RoutingKey: key})
		require.NoError(t, err)
		return pk
	}
	for i, key := range []string{"k1", "k2", "k3", "k4"} {
		pk := pick(key)
		assert.Equal(t, label.ReasonStickyAssigned, pk.Reason)
		assert.Equal(t, cands[i%3], pk.Engine)
	}
	for range 3 {
		pk := pick("k2")
		assert.Equal(t, label.ReasonStickyPrimary, pk.Reason)
		assert.Equal(t, cands[1], pk.Engine)
	}
	// The session namespace is separate: a session key equal to a routing key is another binding.
	id, ok, err := st.Lookup(ctx, affinity.Scope{Namespace: "session", Model: "m", BucketID: "x", Key: "k2"})
	require.NoError(t, err)
	assert.False(t, ok, "got %q", id)
}

func rendezvous(t testing.TB, e *env, factor float64) policy.Policy {
	t.Helper()
	p, err := policy.NewSticky(e.cfg(), policy.StickyOptions{Rendezvous: true, LoadFactor: factor})
	require.NoError(t, err)
	return p
}

func keyOwners(t testing.TB, p policy.Policy, cands []state.Engine, keys int) []state.EngineID {
	t.Helper()
	out := make([]state.EngineID, keys)
	for k := range out {
		pk, err := p.Pick(ctx, cands, &policy.Request{RoutingKey: fmt.Sprintf("user-%d", k)})
		require.NoError(t, err)
		out[k] = pk.Engine.ID()
	}
	return out
}

// Rendezvous hashing: replicas agree without coordination, whatever the candidate order, and
// keys spread evenly.
func TestRendezvousAgreesAndSpreads(t *testing.T) {
	t.Parallel()
	cands := manyEngines(16)
	a := keyOwners(t, rendezvous(t, newEnv(), 0), cands, 10_000)
	shuffled := slices.Clone(cands)
	rand.New(rand.NewPCG(1, 2)).Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
	b := keyOwners(t, rendezvous(t, newEnv(), 0), shuffled, 10_000)
	assert.Equal(t, a, b, "another replica, another candidate order: the same engines")
	counts := map[state.EngineID]int{}
	for _, id := range a {
		counts[id]++
	}
	require.Len(t, counts, 16)
	for id, n := range counts {
		assert.InDelta(t, 625, n, 150, "engine %s holds %d of 10,000 keys", id, n)
	}
}

// Removing one of 16 engines moves only that engine's keys, spread over all the others; adding
// it back moves exactly those keys back.
func TestRendezvousRemovalMovesOnlyThatEnginesKeys(t *testing.T) {
	t.Parallel()
	cands := manyEngines(16)
	p := rendezvous(t, newEnv(), 0)
	before := keyOwners(t, p, cands, 10_000)
	removed := cands[5].ID()
	without := slices.Delete(slices.Clone(cands), 5, 6)
	after := keyOwners(t, p, without, 10_000)
	moved, receivers := 0, map[state.EngineID]int{}
	for k := range before {
		if before[k] == removed {
			moved++
			receivers[after[k]]++
			continue
		}
		assert.Equal(t, before[k], after[k], "key %d of a surviving engine moved", k)
	}
	assert.Positive(t, moved)
	assert.Len(t, receivers, 15, "the removed engine's keys spread over every survivor")
	assert.Equal(t, before, keyOwners(t, p, cands, 10_000), "adding the engine back restores every key")
}

// Bounded load on a skewed (Zipf) key stream: after every placement no engine holds more than
// ⌈factor × mean⌉ in-flight requests; the same stream unbounded breaks that bound, so the check
// can fail.
func TestRendezvousBoundedLoadOnSkewedKeys(t *testing.T) {
	t.Parallel()
	const engines, requests, factor = 16, 4000, 1.25
	cands := manyEngines(engines)
	run := func(f float64, release bool) (worst float64, bounded int) {
		e := newEnv()
		p := rendezvous(t, e, f)
		rng := rand.New(rand.NewPCG(7, 7))
		zipf := rand.NewZipf(rng, 1.3, 1, 999)
		var guards []*loadmon.Guard
		total := 0
		for range requests {
			key := fmt.Sprintf("tenant-%d", zipf.Uint64())
			pk, err := p.Pick(ctx, cands, &policy.Request{RoutingKey: key})
			require.NoError(t, err)
			if pk.Reason == label.ReasonRendezvousBounded {
				bounded++
			}
			guards = append(guards, e.inflight.Acquire(pk.Engine.ID(), -1, 0))
			total++
			limit := math.Ceil(factor * float64(total) / engines)
			for _, c := range cands {
				worst = max(worst, float64(e.inflight.Count(c.ID()))/limit)
			}
			if release && rng.IntN(3) == 0 { // requests finish at random: some load drains
				i := rng.IntN(len(guards))
				guards[i].Release()
				guards = slices.Delete(guards, i, i+1)
				total--
			}
		}
		return worst, bounded
	}
	worst, bounded := run(factor, false)
	assert.LessOrEqual(t, worst, 1.0, "with the bound no engine exceeds ⌈1.25 × mean⌉")
	assert.Positive(t, bounded, "the bound moved some hot keys")
	worst, _ = run(0, false)
	assert.Greater(t, worst, 2.0, "unbounded, the hot key's engine exceeds the bound by far")

	// With requests finishing, each placement still respects the bound at its time: the engine
	// chosen is below ⌈factor × (total + 1) / n⌉ before the request is added.
	e := newEnv()
	p := rendezvous(t, e, factor)
	rng := rand.New(rand.NewPCG(9, 9))
	zipf := rand.NewZipf(rng, 1.3, 1, 999)
	var guards []*loadmon.Guard
	for range requests {
		var total uint64
		for _, c := range cands {
			total += e.inflight.Count(c.ID())
		}
		pk, err := p.Pick(ctx, cands, &policy.Request{RoutingKey: fmt.Sprintf("tenant-%d", zipf.Uint64())})
		require.NoError(t, err)
		limit := uint64(math.Ceil(factor * float64(total+1) / engines))
		require.Less(t, e.inflight.Count(pk.Engine.ID()), limit, "placement on %s", pk.Engine.ID())
		guards = append(guards, e.inflight.Acquire(pk.Engine.ID(), -1, 0))
		if rng.IntN(2) == 0 {
			i := rng.IntN(len(guards))
			guards[i].Release()
			guards = slices.Delete(guards, i, i+1)
		}
	}
}

func TestRendezvousEdgeCases(t *testing.T) {
	t.Parallel()
	e := newEnv()
	p := rendezvous(t, e, 0)
	cands := engines(state.StagePlain, "a", "b", "c")
	_, err := p.Pick(ctx, nil, &policy.Request{RoutingKey: "k"})
	assert.ErrorIs(t, err, policy.ErrNoCandidates)
	_, err = p.Pick(ctx, cands, &policy.Request{RoutingKey: strings.Repeat("x", affinity.MaxKeyBytes+1)})
	assert.ErrorIs(t, err, affinity.ErrInvalidKey)
	assert.ErrorIs(t, err, policy.ErrInvalidSignal)
	assert.Empty(t, e.check.Calls(), "no admission for an empty group or a bad key")

	pk, err := p.Pick(ctx, cands, &policy.Request{RoutingKey: "k"})
	require.NoError(t, err)
	assert.Equal(t, label.ReasonRendezvous, pk.Reason)
	e.check.reject = map[state.EngineID]string{pk.Engine.ID(): "full"}
	_, err = p.Pick(ctx, cands, &policy.Request{RoutingKey: "k"})
	var rej *policy.AdmissionRejectedError
	require.ErrorAs(t, err, &rej)
	assert.Equal(t, pk.Engine.ID(), rej.Engine.ID(), "a rejection is returned, never moved to the next engine")
	assert.Len(t, e.check.Calls(), 2)
}

// The stateless sticky pick allocates nothing, bounded or not.
func TestRendezvousAllocatesNothing(t *testing.T) {
	e := newEnv()
	cands := manyEngines(64)
	for i, c := range cands {
		for range i % 4 {
			e.inflight.Acquire(c.ID(), -1, 0)
		}
	}
	req := &policy.Request{RoutingKey: "conversation-4711"}
	for _, f := range []float64{0, 1.25} {
		p := rendezvous(t, e, f)
		allocs := testing.AllocsPerRun(200, func() {
			if _, err := p.Pick(ctx, cands, req); err != nil {
				t.Fatal(err)
			}
		})
		assert.Zero(t, allocs, "load factor %v", f)
	}
}
