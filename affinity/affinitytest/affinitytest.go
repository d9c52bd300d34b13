// Package affinitytest is the behavioural conformance suite of affinity.Store. Every store of the
// module runs it (affinity.MemoryStore, affinity/redisstore on one Redis server and on a Redis
// Cluster), and a host that writes its own Store can run it too:
//
//	func TestMyStore(t *testing.T) {
//		affinitytest.Run(t, func(t *testing.T, now func() time.Time, idle time.Duration) affinity.Store {
//			return newMyStore(now, idle)
//		})
//	}
//
// Each case states the rule it checks (docs/design.md §12). It is test support, not part of the
// routing path.
package affinitytest

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/state"
)

// Factory returns a new, empty store whose clock is now and whose idle timeout is idle. Stores of
// one test share nothing. It may call t.Skip.
type Factory func(t *testing.T, now func() time.Time, idle time.Duration) affinity.Store

// Clock is a manual clock for stores under test: it starts at a fixed instant (a whole second)
// and moves only when told. Safe for concurrent use.
type Clock struct{ ns atomic.Int64 }

// NewClock returns a clock at 2026-01-01T00:00:00Z.
func NewClock() *Clock {
	c := &Clock{}
	c.ns.Store(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	return c
}

// Now returns the clock's time.
func (c *Clock) Now() time.Time { return time.Unix(0, c.ns.Load()).UTC() }

// Advance moves the clock by d (negative moves it back).
func (c *Clock) Advance(d time.Duration) { c.ns.Add(int64(d)) }

// Sweeper is implemented by stores that free expired bindings in a sweep (affinity.MemoryStore).
// The suite calls it where a sweep could matter, to check it never removes a live binding.
type Sweeper interface{ Sweep() int }

type testCase struct {
	name        string
	explanation string
	run         func(t *testing.T, st affinity.Store, clk *Clock)
}

// idle is the idle timeout of every case: a whole number of seconds, so that stores with
// millisecond resolution meet the exact instants.
const idle = 10 * time.Second

var bg = context.Background()

func sc(key string) affinity.Scope {
	return affinity.Scope{Namespace: "session", Model: "m", BucketID: "b", Stage: state.StagePlain, Key: key}
}

func sweep(st affinity.Store) {
	if s, ok := st.(Sweeper); ok {
		s.Sweep()
	}
}

func lookup(t *testing.T, st affinity.Store, s affinity.Scope) (state.EngineID, bool) {
	t.Helper()
	e, ok, err := st.Lookup(bg, s)
	require.NoError(t, err, "Lookup(%+v)", s)
	return e, ok
}

func bind(t *testing.T, st affinity.Store, s affinity.Scope, e state.EngineID) state.EngineID {
	t.Helper()
	got, err := st.Bind(bg, s, e)
	require.NoError(t, err, "Bind(%+v, %q)", s, e)
	return got
}

var cases = []testCase{
	{
		name:        "a_live_binding_wins_over_a_later_bind_and_a_dead_one_is_replaced",
		explanation: "Bind keeps a live binding; Replace swaps only the expected binding; a missing binding is created by either",
		run: func(t *testing.T, st affinity.Store, _ *Clock) {
			_, ok := lookup(t, st, sc("s"))
			assert.False(t, ok, "an unknown scope has no binding")
			assert.Equal(t, state.EngineID("a"), bind(t, st, sc("s"), "a"), "first bind")
			assert.Equal(t, state.EngineID("a"), bind(t, st, sc("s"), "b"), "a later bind returns the live binding")
			got, err := st.Replace(bg, sc("s"), "c", "b")
			require.NoError(t, err)
			assert.Equal(t, state.EngineID("a"), got, "Replace with the wrong expected engine keeps the live binding")
			got, err = st.Replace(bg, sc("s"), "a", "b")
			require.NoError(t, err)
			assert.Equal(t, state.EngineID("b"), got, "Replace of the expected binding")
			e, ok := lookup(t, st, sc("s"))
			assert.True(t, ok)
			assert.Equal(t, state.EngineID("b"), e)
			got, err = st.Replace(bg, sc("new"), "x", "c")
			require.NoError(t, err)
			assert.Equal(t, state.EngineID("c"), got, "Replace of a missing binding creates it")
		},
	},
	{
		name:        "idle_bindings_expire_at_the_exact_instant_and_hits_refresh",
		explanation: "live while now < last use + idle; a Lookup, Bind or Replace that finds the binding live refreshes it",
		run: func(t *testing.T, st affinity.Store, clk *Clock) {
			bind(t, st, sc("hot"), "a")
			bind(t, st, sc("cold"), "b")
			bind(t, st, sc("rebound"), "c")
			clk.Advance(8 * time.Second)
			_, ok := lookup(t, st, sc("hot"))
			require.True(t, ok, "hit at 8 s")
			assert.Equal(t, state.EngineID("c"), bind(t, st, sc("rebound"), "z"), "a bind that finds the binding live refreshes it")
			clk.Advance(2*time.Second - time.Millisecond) // 9.999 s
			sweep(st)
			_, ok = lookup(t, st, sc("cold"))
			assert.True(t, ok, "cold is live 1 ms before its idle timeout")
			clk.Advance(8*time.Second + time.Millisecond) // 18 s: hot and rebound, refreshed at 8 s, expire now
			_, ok = lookup(t, st, sc("hot"))
			assert.False(t, ok, "hot expired exactly 10 s after its last hit")
			_, ok = lookup(t, st, sc("rebound"))
			assert.False(t, ok, "rebound expired exactly 10 s after the refreshing bind")
			e, ok := lookup(t, st, sc("cold"))
			assert.True(t, ok, "cold, hit at 9.999 s, lives until 19.999 s")
			assert.Equal(t, state.EngineID("b"), e)
			sweep(st)
			e, ok = lookup(t, st, sc("cold"))
			assert.True(t, ok, "a sweep at 18 s keeps cold")
			assert.Equal(t, state.EngineID("b"), e)
			assert.Equal(t, state.EngineID("d"), bind(t, st, sc("hot"), "d"), "an expired binding is replaced by a bind")
		},
	},
	{
		name:        "shared_store_refreshes_active_sessions_and_expires_idle_ones",
		explanation: "idle 10 s: a hit at 8 s keeps hot; cold is gone at 16 s (sgl-router affinity store scenario)",
		run: func(t *testing.T, st affinity.Store, clk *Clock) {
			bind(t, st, sc("hot"), "a")
			bind(t, st, sc("cold"), "b")
			clk.Advance(8 * time.Second)
			_, ok := lookup(t, st, sc("hot"))
			require.True(t, ok)
			clk.Advance(8 * time.Second)
			sweep(st)
			_, ok = lookup(t, st, sc("cold"))
			assert.False(t, ok, "cold swept at 16 s")
			e, ok := lookup(t, st, sc("hot"))
			assert.True(t, ok, "hot kept at 16 s")
			assert.Equal(t, state.EngineID("a"), e)
		},
	},
	{
		name:        "clock_going_backwards_never_shortens_or_corrupts_a_binding",
		explanation: "a refresh keeps the later expiry; lookups and sweeps at an earlier time see the binding live",
		run: func(t *testing.T, st affinity.Store, clk *Clock) {
			clk.Advance(100 * time.Second)
			bind(t, st, sc("s"), "a") // expires at 110 s
			clk.Advance(-60 * time.Second)
			sweep(st)
			e, ok := lookup(t, st, sc("s")) // a refresh at 40 s would give 50 s: kept at 110 s
			require.True(t, ok)
			assert.Equal(t, state.EngineID("a"), e)
			assert.Equal(t, state.EngineID("a"), bind(t, st, sc("s"), "b"), "still live, still wins")
			clk.Advance(70*time.Second - time.Millisecond) // 109.999 s
			sweep(st)
			_, ok = lookup(t, st, sc("s"))
			assert.True(t, ok, "live 1 ms before the original expiry")
			clk.Advance(10*time.Second + time.Millisecond) // 120 s: refreshed at 109.999 s → 119.999 s
			sweep(st)
			_, ok = lookup(t, st, sc("s"))
			assert.False(t, ok, "expired 10 s after the last hit")
		},
	},
	{
		name:        "bindings_are_scoped_by_namespace_model_bucket_stage_and_key",
		explanation: "six scopes differing in one field each hold six independent bindings",
		run: func(t *testing.T, st affinity.Store, _ *Clock) {
			base := sc("s")
			scopes := []affinity.Scope{base, base, base, base, base, base}
			scopes[1].Model = "m2"
			scopes[2].BucketID = "b2"
			scopes[3].Stage = state.StagePrefill
			scopes[4].Key = "s2"
			scopes[5].Namespace = "sticky"
			for i, s := range scopes {
				want := state.EngineID(fmt.Sprintf("e%d", i))
				assert.Equal(t, want, bind(t, st, s, want), "scope %d %+v is new", i, s)
			}
			for i, s := range scopes {
				e, ok := lookup(t, st, s)
				assert.True(t, ok)
				assert.Equal(t, state.EngineID(fmt.Sprintf("e%d", i)), e, "scope %d %+v", i, s)
			}
		},
	},
	{
		name:        "embedded_delimiters_do_not_alias_scopes",
		explanation: "fields containing NUL, ':', digits, '{' or '}' never collide with another split of the same bytes",
		run: func(t *testing.T, st affinity.Store, _ *Clock) {
			scopes := []affinity.Scope{
				{Model: "a\x00b", BucketID: "c", Key: "k"},
				{Model: "a", BucketID: "\x00bc", Key: "k"},
				{Model: "a\x00", BucketID: "bc", Key: "k"},
				{Model: "1:a", BucketID: "", Key: "k"},
				{Model: "", BucketID: "1:a", Key: "k"},
				{Model: "", BucketID: "", Key: "1:a0k"},
				{Namespace: "1:a", Key: "k"},
				{Model: "m", BucketID: "b", Key: "k\x00"},
				{Model: "m", BucketID: "b", Key: "{0}k"},
				{Model: "m", BucketID: "b0", Key: "k"},
				{Model: "m", BucketID: "b", Stage: state.StageDecode, Key: "k"},
			}
			for i, s := range scopes {
				want := state.EngineID(fmt.Sprintf("e%d", i))
				assert.Equal(t, want, bind(t, st, s, want), "scope %d %+v must be new", i, s)
			}
			for i, s := range scopes {
				e, ok := lookup(t, st, s)
				assert.True(t, ok)
				assert.Equal(t, state.EngineID(fmt.Sprintf("e%d", i)), e, "scope %d %+v", i, s)
			}
		},
	},
	{
		name:        "invalidate_engine_removes_only_its_bindings",
		explanation: "InvalidateEngine drops every binding to the engine, counts the live ones, and leaves the others",
		run: func(t *testing.T, st affinity.Store, clk *Clock) {
			for i := range 5 {
				bind(t, st, sc(fmt.Sprintf("a%d", i)), "http://a:8000")
			}
			stale := sc("stale")
			stale.Stage = state.StageDecode
			bind(t, st, stale, "http://a:8000")
			for i := range 3 {
				bind(t, st, sc(fmt.Sprintf("b%d", i)), "http://b:8000")
			}
			other := sc("a0")
			other.Model = "other"
			bind(t, st, other, "http://a:8000")
			n, err := st.InvalidateEngine(bg, "http://a:8000")
			require.NoError(t, err)
			assert.Equal(t, 7, n, "5 + 1 decode + 1 other-model live bindings")
			for i := range 5 {
				_, ok := lookup(t, st, sc(fmt.Sprintf("a%d", i)))
				assert.False(t, ok, "a%d invalidated", i)
			}
			_, ok := lookup(t, st, other)
			assert.False(t, ok)
			for i := range 3 {
				e, ok := lookup(t, st, sc(fmt.Sprintf("b%d", i)))
				assert.True(t, ok)
				assert.Equal(t, state.EngineID("http://b:8000"), e)
			}
			n, err = st.InvalidateEngine(bg, "http://a:8000")
			require.NoError(t, err)
			assert.Equal(t, 0, n, "invalidating again finds nothing")
			n, err = st.InvalidateEngine(bg, "http://never:1")
			require.NoError(t, err)
			assert.Equal(t, 0, n)
			assert.Equal(t, state.EngineID("http://c:8000"), bind(t, st, sc("a1"), "http://c:8000"), "a new bind after invalidation")

			// Expired bindings are removed but not counted.
			bind(t, st, sc("x"), "http://x:1")
			clk.Advance(idle)
			n, err = st.InvalidateEngine(bg, "http://x:1")
			require.NoError(t, err)
			assert.Equal(t, 0, n, "an expired binding is not a live one")
			clk.Advance(-idle)
			_, ok = lookup(t, st, sc("x"))
			assert.False(t, ok, "the expired binding was removed, so turning the clock back does not revive it")
		},
	},
	{
		name:        "bad_input_is_rejected_and_changes_nothing",
		explanation: "empty keys, keys over 4 KiB, invalid stages and empty engine IDs are typed errors; nothing is written",
		run: func(t *testing.T, st affinity.Store, _ *Clock) {
			long := strings.Repeat("k", affinity.MaxKeyBytes+1)
			bad := []affinity.Scope{
				sc(""), sc(long),
				{Model: state.ModelID(long), Key: "k"},
				{BucketID: long, Key: "k"},
				{Namespace: long, Key: "k"},
				{Stage: 9, Key: "k"},
			}
			for _, s := range bad {
				_, _, err := st.Lookup(bg, s)
				assert.ErrorIs(t, err, affinity.ErrInvalidKey, "Lookup")
				assert.ErrorIs(t, err, state.ErrInvalidSignal)
				_, err = st.Bind(bg, s, "e")
				assert.ErrorIs(t, err, affinity.ErrInvalidKey, "Bind")
				_, err = st.Replace(bg, s, "e", "f")
				assert.ErrorIs(t, err, affinity.ErrInvalidKey, "Replace")
			}
			_, err := st.Bind(bg, sc("k"), "")
			assert.ErrorIs(t, err, affinity.ErrInvalidEngine)
			_, err = st.Replace(bg, sc("k"), "a", "")
			assert.ErrorIs(t, err, affinity.ErrInvalidEngine)
			_, ok := lookup(t, st, sc("k"))
			assert.False(t, ok, "a rejected bind writes nothing")

			edge := sc(strings.Repeat("k", affinity.MaxKeyBytes))
			assert.Equal(t, state.EngineID("e"), bind(t, st, edge, "e"), "a key of exactly 4 KiB is accepted")
			e, ok := lookup(t, st, edge)
			assert.True(t, ok)
			assert.Equal(t, state.EngineID("e"), e)
		},
	},
	{
		name:        "concurrent_first_binds_converge_on_one_engine",
		explanation: "racing binds of one scope all return the same engine, the first one stored",
		run: func(t *testing.T, st affinity.Store, _ *Clock) {
			const racers = 16
			for k := range 20 {
				s := sc(fmt.Sprintf("race%d", k))
				got := make([]state.EngineID, racers)
				var wg sync.WaitGroup
				for i := range racers {
					wg.Go(func() {
						e, err := st.Bind(bg, s, state.EngineID(fmt.Sprintf("e%d", i)))
						if err != nil {
							t.Error(err)
						}
						got[i] = e
					})
				}
				wg.Wait()
				for i := range got {
					assert.Equal(t, got[0], got[i], "scope %d racer %d", k, i)
				}
				e, ok := lookup(t, st, s)
				assert.True(t, ok)
				assert.Equal(t, got[0], e)
			}
		},
	},
	{
		name:        "concurrent_replaces_of_one_dead_binding_converge",
		explanation: "racing Replace calls expecting the same dead engine: one wins, every other returns the winner",
		run: func(t *testing.T, st affinity.Store, _ *Clock) {
			const racers = 16
			s := sc("dead")
			bind(t, st, s, "gone")
			got := make([]state.EngineID, racers)
			var wg sync.WaitGroup
			for i := range racers {
				wg.Go(func() {
					e, err := st.Replace(bg, s, "gone", state.EngineID(fmt.Sprintf("e%d", i)))
					if err != nil {
						t.Error(err)
					}
					got[i] = e
				})
			}
			wg.Wait()
			assert.NotEqual(t, state.EngineID("gone"), got[0])
			for i := range got {
				assert.Equal(t, got[0], got[i], "racer %d", i)
			}
		},
	},
}

// Run runs every case of the suite as a parallel subtest, each on a new store from newStore with
// its own Clock and a 10 s idle timeout.
func Run(t *testing.T, newStore Factory) {
	t.Helper()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			clk := NewClock()
			st := newStore(t, clk.Now, idle)
			c.run(t, st, clk)
			if t.Failed() {
				t.Log("rule:", c.explanation)
			}
		})
	}
}
