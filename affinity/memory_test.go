package affinity_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/affinity/affinitytest"
	"github.com/enginepick/enginepick/state"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var bg = context.Background()

func newMemory(t testing.TB, now func() time.Time, idle time.Duration) *affinity.MemoryStore {
	t.Helper()
	st, err := affinity.NewMemoryStore(affinity.Options{Now: now, IdleTimeout: idle})
	require.NoError(t, err)
	return st
}

func TestMemoryStoreConformance(t *testing.T) {
	t.Parallel()
	affinitytest.Run(t, func(t *testing.T, now func() time.Time, idle time.Duration) affinity.Store {
		return newMemory(t, now, idle)
	})
}

func sc(key string) affinity.Scope {
	return affinity.Scope{Namespace: "session", Model: "m", BucketID: "b", Key: key}
}

func TestNewMemoryStoreOptions(t *testing.T) {
	t.Parallel()
	for _, o := range []affinity.Options{{IdleTimeout: -1}, {SweepInterval: -time.Second}} {
		_, err := affinity.NewMemoryStore(o)
		assert.ErrorIs(t, err, state.ErrInvalidConfiguration, "NewMemoryStore(%+v)", o)
	}
	st, err := affinity.NewMemoryStore(affinity.Options{})
	require.NoError(t, err)
	assert.Equal(t, affinity.DefaultIdleTimeout, st.IdleTimeout(), "zero IdleTimeout means 600 s")
}

// The sweep visits only expired bindings: with 50,000 live bindings and 7 expired ones it removes
// exactly the 7, and the expired ones are gone from the engine index too.
func TestSweepRemovesOnlyExpired(t *testing.T) {
	t.Parallel()
	clk := affinitytest.NewClock()
	st := newMemory(t, clk.Now, 10*time.Second)
	for i := range 7 {
		_, err := st.Bind(bg, sc(fmt.Sprintf("old%d", i)), "http://old")
		require.NoError(t, err)
	}
	clk.Advance(5 * time.Second)
	for i := range 50_000 {
		_, err := st.Bind(bg, sc(fmt.Sprintf("new%d", i)), state.EngineID(fmt.Sprintf("http://e%d", i%64)))
		require.NoError(t, err)
	}
	clk.Advance(5*time.Second - 1)
	assert.Equal(t, 0, st.Sweep(), "nothing is expired 1 ns before the idle timeout")
	clk.Advance(1)
	assert.Equal(t, 7, st.Sweep(), "exactly the 7 old bindings expire at 10 s")
	assert.Equal(t, 50_000, st.Len())
	assert.Equal(t, 0, st.Sweep(), "a second sweep finds nothing")
	n, err := st.InvalidateEngine(bg, "http://old")
	require.NoError(t, err)
	assert.Equal(t, 0, n, "swept bindings left the engine index")
	clk.Advance(5 * time.Second)
	assert.Equal(t, 50_000, st.Sweep())
	assert.Equal(t, 0, st.Len())
}

// concurrent_bindings_do_not_count_as_evictions: 20,000 concurrent binds over 5,000 scopes (four
// racers per scope, two through Bind and two through Replace of a never-bound engine) with a
// sweeper running: every scope ends with exactly one binding, every racer of a scope saw the same
// engine, and no sweep removed anything.
func TestConcurrentBindsNoLossNoDuplicateNoSpuriousExpiry(t *testing.T) {
	t.Parallel()
	clk := affinitytest.NewClock()
	st, err := affinity.NewMemoryStore(affinity.Options{Now: clk.Now, IdleTimeout: time.Hour, SweepInterval: time.Millisecond})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(bg)
	var runWG sync.WaitGroup
	runWG.Go(func() { assert.NoError(t, st.Run(ctx)) })
	var swept atomic.Int64
	stopSweeps := make(chan struct{})
	var sweepWG sync.WaitGroup
	sweepWG.Go(func() {
		for {
			select {
			case <-stopSweeps:
				return
			default:
				swept.Add(int64(st.Sweep()))
				clk.Advance(time.Millisecond) // time moves, far from the 1 h idle timeout
			}
		}
	})

	const scopes, racers = 5000, 4
	got := make([][racers]state.EngineID, scopes)
	var wg sync.WaitGroup
	for r := range racers {
		for k := range scopes {
			wg.Go(func() {
				s := sc(fmt.Sprintf("s%d", k))
				e := state.EngineID(fmt.Sprintf("http://e%d-%d", k%97, r))
				var eff state.EngineID
				var err error
				if r%2 == 0 {
					eff, err = st.Bind(bg, s, e)
				} else {
					eff, err = st.Replace(bg, s, "http://never", e)
				}
				if err != nil {
					t.Error(err)
				}
				got[k][r] = eff
			})
		}
	}
	wg.Wait()
	close(stopSweeps)
	sweepWG.Wait()
	cancel()
	runWG.Wait()

	assert.Equal(t, int64(0), swept.Load(), "no live binding was swept")
	assert.Equal(t, scopes, st.Len(), "one binding per scope: none lost, none duplicated")
	for k := range scopes {
		e, ok, err := st.Lookup(bg, sc(fmt.Sprintf("s%d", k)))
		require.NoError(t, err)
		require.True(t, ok, "scope %d lost", k)
		for r := range racers {
			assert.Equal(t, e, got[k][r], "scope %d racer %d saw a different engine", k, r)
		}
	}
}

// Run sweeps on its own schedule and stops with its context, leaving no goroutine (goleak).
func TestRunSweepsAndStops(t *testing.T) {
	t.Parallel()
	clk := affinitytest.NewClock()
	st, err := affinity.NewMemoryStore(affinity.Options{Now: clk.Now, IdleTimeout: time.Second, SweepInterval: time.Millisecond})
	require.NoError(t, err)
	_, err = st.Bind(bg, sc("s"), "e")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(bg)
	done := make(chan error, 1)
	go func() { done <- st.Run(ctx) }()
	clk.Advance(time.Second)
	require.Eventually(t, func() bool { return st.Len() == 0 }, 5*time.Second, time.Millisecond, "Run swept the expired binding")
	cancel()
	select {
	case err := <-done:
		assert.NoError(t, err)
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return after cancel")
	}
}

// A hit allocates nothing.
func TestLookupHitAllocatesNothing(t *testing.T) {
	clk := affinitytest.NewClock()
	st := newMemory(t, clk.Now, time.Minute)
	s := sc("session-1")
	_, err := st.Bind(bg, s, "http://e1")
	require.NoError(t, err)
	allocs := testing.AllocsPerRun(1000, func() {
		clk.Advance(time.Millisecond)
		if _, ok, _ := st.Lookup(bg, s); !ok {
			t.Fatal("miss")
		}
	})
	assert.Zero(t, allocs)
}

func TestScopeAppendEncoded(t *testing.T) {
	t.Parallel()
	s := affinity.Scope{Namespace: "session", Model: "m:1", BucketID: "", Stage: state.StagePrefill, Key: "a\x00b"}
	assert.Equal(t, "7:session3:m:10:13:a\x00b", string(s.AppendEncoded(nil)))
}

// sameShardKeys returns n keys that land in one shard of a MemoryStore (the store shards by the
// key's xxhash modulo 16).
func sameShardKeys(n int) []string {
	var keys []string
	for i := 0; len(keys) < n; i++ {
		k := fmt.Sprintf("k-%d", i)
		if xxhash.Sum64String(k)%16 == 0 {
			keys = append(keys, k)
		}
	}
	return keys
}

// MaxBindings holds the store at its cap under a flood of new keys, evicting per shard the binding
// nearest to expiry (the least recently used) after dropping expired ones, which are not counted
// as evictions.
func TestMaxBindingsEvictsLeastRecentlyUsed(t *testing.T) {
	var ns atomic.Int64
	ns.Store(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	now := func() time.Time { return time.Unix(0, ns.Load()) }
	tick := func() { ns.Add(int64(time.Millisecond)) }

	_, err := affinity.NewMemoryStore(affinity.Options{MaxBindings: -1})
	require.ErrorIs(t, err, state.ErrInvalidConfiguration)

	t.Run("flood stays at the cap", func(t *testing.T) {
		st, err := affinity.NewMemoryStore(affinity.Options{Now: now, MaxBindings: 100}) // 7 per shard: 112 at most
		require.NoError(t, err)
		const keys = 20_000
		most := 0
		for i := range keys {
			_, err := st.Bind(bg, sc(fmt.Sprintf("flood-%d", i)), "e")
			require.NoError(t, err)
			tick()
			most = max(most, st.Len())
		}
		assert.Equal(t, 112, most, "16 shards of ceil(100/16) = 7")
		assert.Equal(t, uint64(keys-st.Len()), st.Evicted(), "every binding beyond the cap was evicted, none lost otherwise")
		// The newest key of the flood is still bound.
		e, ok, err := st.Lookup(bg, sc(fmt.Sprintf("flood-%d", keys-1)))
		require.NoError(t, err)
		assert.True(t, ok)
		assert.Equal(t, state.EngineID("e"), e)
	})

	t.Run("the least recently used binding of the shard goes", func(t *testing.T) {
		st, err := affinity.NewMemoryStore(affinity.Options{Now: now, MaxBindings: 32}) // 2 per shard
		require.NoError(t, err)
		k := sameShardKeys(3)
		_, err = st.Bind(bg, sc(k[0]), "a")
		require.NoError(t, err)
		tick()
		_, err = st.Bind(bg, sc(k[1]), "b")
		require.NoError(t, err)
		tick()
		_, ok, err := st.Lookup(bg, sc(k[0])) // k[0] is now the most recently used
		require.NoError(t, err)
		require.True(t, ok)
		tick()
		_, err = st.Bind(bg, sc(k[2]), "c")
		require.NoError(t, err)
		for key, want := range map[string]bool{k[0]: true, k[1]: false, k[2]: true} {
			_, ok, err := st.Lookup(bg, sc(key))
			require.NoError(t, err)
			assert.Equal(t, want, ok, "key %s bound", key)
		}
		assert.Equal(t, uint64(1), st.Evicted())
	})

	t.Run("expired bindings make room first and are not evictions", func(t *testing.T) {
		st, err := affinity.NewMemoryStore(affinity.Options{Now: now, IdleTimeout: time.Second, MaxBindings: 32})
		require.NoError(t, err)
		k := sameShardKeys(4)
		_, err = st.Bind(bg, sc(k[0]), "a")
		require.NoError(t, err)
		ns.Add(int64(500 * time.Millisecond))
		_, err = st.Bind(bg, sc(k[1]), "b")
		require.NoError(t, err)
		ns.Add(int64(600 * time.Millisecond)) // k[0] expired, k[1] live
		_, err = st.Bind(bg, sc(k[2]), "c")
		require.NoError(t, err)
		assert.Zero(t, st.Evicted(), "an expired binding made room")
		for key, want := range map[string]bool{k[1]: true, k[2]: true} {
			_, ok, err := st.Lookup(bg, sc(key))
			require.NoError(t, err)
			assert.Equal(t, want, ok, "key %s bound", key)
		}
		// Replacing a live binding in a full shard evicts nothing: the scope keeps its place.
		_, err = st.Replace(bg, sc(k[1]), "b", "b2")
		require.NoError(t, err)
		assert.Zero(t, st.Evicted())
		assert.Equal(t, 2, st.Len())
	})
}
