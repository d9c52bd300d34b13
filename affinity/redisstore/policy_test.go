package redisstore_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/affinity/redisstore"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/internal/affinitysuite"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// The acceptance scenarios of SessionAware and store-mode Sticky, on Redis and Redis Cluster.
func TestAffinityScenarios(t *testing.T) {
	t.Parallel()
	for _, srv := range servers() {
		t.Run(srv.name, func(t *testing.T) {
			t.Parallel()
			c := srv.client(t)
			affinitysuite.Run(t, func(t *testing.T, now func() time.Time, idle time.Duration) affinity.Store {
				return newStore(t, c, now, idle)
			})
		})
	}
}

// A session pick that hits its binding costs exactly one Redis round trip; a new session two
// (lookup, bind).
func TestSessionPickRoundTrips(t *testing.T) {
	t.Parallel()
	for _, srv := range servers() {
		t.Run(srv.name, func(t *testing.T) {
			t.Parallel()
			c := srv.client(t)
			cnt := &commandCounter{}
			c.AddHook(cnt)
			st := newStore(t, c, nil, time.Minute)
			p, cands := sessionPolicy(t, st, 16)
			warm := 64
			for i := range warm { // load the scripts on every node
				_, err := p.Pick(bg, cands, &policy.Request{Model: "m", SessionKey: fmt.Sprintf("warm-%d", i)})
				require.NoError(t, err)
				_, err = p.Pick(bg, cands, &policy.Request{Model: "m", SessionKey: fmt.Sprintf("warm-%d", i)})
				require.NoError(t, err)
			}
			for i := range 32 {
				req := &policy.Request{Model: "m", SessionKey: fmt.Sprintf("s-%d", i)}
				before := cnt.n.Load()
				pk, err := p.Pick(bg, cands, req)
				require.NoError(t, err)
				require.Equal(t, label.ReasonAssigned, pk.Reason)
				assert.Equal(t, int64(2), cnt.n.Load()-before, "new session: lookup and bind")
				before = cnt.n.Load()
				pk, err = p.Pick(bg, cands, req)
				require.NoError(t, err)
				require.Equal(t, label.ReasonSessionPrimary, pk.Reason)
				assert.Equal(t, int64(1), cnt.n.Load()-before, "hit: one round trip")
			}
		})
	}
}

func sessionPolicy(t testing.TB, st affinity.Store, n int) (policy.Policy, []state.Engine) {
	t.Helper()
	load := loadmon.NewTable()
	cands := make([]state.Engine, n)
	for i := range cands {
		id := state.EngineID(fmt.Sprintf("http://10.0.0.%d:8000", i))
		cands[i] = state.NewStaticEngine(id, "m", state.StagePlain)
		require.NoError(t, load.Report(loadmon.Report{Engine: id, WaitingRequests: uint64(i % 5), KVCapacityTokens: 1 << 20,
			Native: &loadmon.NativeLoad{MaxRunningRequests: 256, WaitingUncachedTokens: uint64(i%5) * 1000}}))
	}
	p, err := policy.NewSessionAware(policy.Config{Load: load, InFlight: loadmon.NewInFlight(nil),
		Admission: admission.Limits{MaxInFlightRequests: admission.Cap(1 << 20)}}, policy.SessionAwareOptions{Store: st})
	require.NoError(t, err)
	return p, cands
}

// Two Routers (two router replicas, each with its own registry values, load table and in-flight
// counters) sharing one Redis store agree on every session's engine, for plain and PD buckets.
func TestTwoRoutersAgree(t *testing.T) {
	t.Parallel()
	for _, srv := range servers() {
		t.Run(srv.name, func(t *testing.T) {
			t.Parallel()
			c := srv.client(t)
			prefix := uniquePrefix()
			routers := make([]*enginepick.Router, 2)
			for r := range routers {
				st, err := redisstore.New(redisstore.Options{Client: c, Prefix: prefix})
				require.NoError(t, err)
				routers[r] = newRouter(t, st, r)
			}
			const sessions = 150
			type pair struct{ prefill, decode state.EngineID }
			got := make([][2]pair, sessions)
			var wg sync.WaitGroup
			for r, rt := range routers {
				wg.Go(func() {
					for k := range sessions {
						k := (k + r*sessions/2) % sessions
						d, err := rt.Select(bg, &bucket.Request{Model: "m", SessionKey: fmt.Sprintf("conv-%d", k),
							Signals: bucket.Signals{InputTokens: 100}})
						if err != nil {
							t.Error(err)
							return
						}
						got[k][r] = pair{d.Selection.Prefill.Engine.ID(), d.Selection.Decode.Engine.ID()}
						d.Release()
					}
				})
			}
			wg.Wait()
			distinct := map[pair]bool{}
			for k := range sessions {
				assert.Equal(t, got[k][0], got[k][1], "session %d", k)
				distinct[got[k][0]] = true
			}
			assert.Greater(t, len(distinct), 1, "sessions spread over several engines")
		})
	}
}

// newRouter builds replica r: a PD bucket of 4 prefill and 4 decode engines (its own Engine
// values), session-aware on both stages over st, with a load view in which replica r prefers
// other engines than replica 1-r.
func newRouter(t *testing.T, st affinity.Store, r int) *enginepick.Router {
	t.Helper()
	reg := &state.StaticRegistry{}
	load := loadmon.NewTable()
	inflight := loadmon.NewInFlight(nil)
	for _, stage := range []state.Stage{state.StagePrefill, state.StageDecode} {
		for i := range 4 {
			id := state.EngineID(fmt.Sprintf("http://%s-%d:8000", stage, i))
			require.NoError(t, reg.Add(state.NewStaticEngine(id, "m", stage)))
			w := uint64(10 * ((i + 2*r) % 4))
			require.NoError(t, load.Report(loadmon.Report{Engine: id, WaitingRequests: w, RunningRequests: w, KVCapacityTokens: 1 << 20,
				Native: &loadmon.NativeLoad{MaxRunningRequests: 256, WaitingUncachedTokens: w * 1000}}))
		}
	}
	cfg := policy.Config{Load: load, InFlight: inflight}
	group := func() *bucket.EngineGroup {
		p, err := policy.NewSessionAware(cfg, policy.SessionAwareOptions{Store: st, Choices: 4})
		require.NoError(t, err)
		g, err := bucket.NewEngineGroup(p, nil)
		require.NoError(t, err)
		return g
	}
	b, err := bucket.NewPDBucket(bucket.Spec{ID: "pd"}, group(), group())
	require.NoError(t, err)
	res, err := bucket.NewResolver([]*bucket.Bucket{b}, bucket.ResolverOptions{})
	require.NoError(t, err)
	rt, err := enginepick.NewRouter(enginepick.Options{Registry: reg, InFlight: inflight, Load: load,
		Resolvers: map[state.ModelID]*bucket.Resolver{"m": res}})
	require.NoError(t, err)
	return rt
}
