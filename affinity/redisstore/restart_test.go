package redisstore_test

import (
	"errors"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/affinity/redisstore"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/internal/testredis"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// TestRouterThroughRedisStopAndRestart routes sessions through a Router whose session-aware
// bucket keeps its bindings in a redis-server, and kills the server and starts it again:
//   - while Redis is up, a session's second request goes to the engine of its first;
//   - while it is down, a session request fails with an error wrapping affinity.ErrUnavailable
//     (status 500, no guard held) under the default policy, and is routed unbound with reason
//     affinity_unavailable under FallbackOnUnavailable; a request without a session key is routed
//     as usual; no selection takes longer than the client's timeouts allow;
//   - once Redis is back (empty: no persistence), the next session request binds afresh and the
//     one after it hits that binding, with no action by the host (go-redis dials again);
//   - every guard is released at the end.
func TestRouterThroughRedisStopAndRestart(t *testing.T) {
	srv := testredis.Start(t, "the Redis stop/restart test")
	// go-redis's defaults, but for no command retries: while the server is down each command
	// costs the pool's dial attempts (5, 100 ms apart, each refused at once on loopback).
	c := redis.NewClient(&redis.Options{Addr: srv.Addr(), MaxRetries: -1})
	t.Cleanup(func() { _ = c.Close() })
	st, err := redisstore.New(redisstore.Options{Client: c, Prefix: uniquePrefix()})
	require.NoError(t, err)

	reg := &state.StaticRegistry{}
	load := loadmon.NewTable()
	inflight := loadmon.NewInFlight(nil)
	ids := make([]state.EngineID, 4)
	for i := range ids {
		ids[i] = state.EngineID(fmt.Sprintf("http://10.1.0.%d:8000", i))
		require.NoError(t, reg.Add(state.NewStaticEngine(ids[i], "m", state.StagePlain)))
	}
	cfg := policy.Config{Load: load, InFlight: inflight}
	router := func(fallback bool) *enginepick.Router {
		p, err := policy.NewSessionAware(cfg, policy.SessionAwareOptions{Store: st, FallbackOnUnavailable: fallback})
		require.NoError(t, err)
		g, err := bucket.NewEngineGroup(p, nil)
		require.NoError(t, err)
		b, err := bucket.NewPlainBucket(bucket.Spec{ID: "plain"}, g)
		require.NoError(t, err)
		res, err := bucket.NewResolver([]*bucket.Bucket{b}, bucket.ResolverOptions{})
		require.NoError(t, err)
		rt, err := enginepick.NewRouter(enginepick.Options{Registry: reg, InFlight: inflight, Load: load,
			Resolvers: map[state.ModelID]*bucket.Resolver{"m": res}})
		require.NoError(t, err)
		return rt
	}
	strict, lenient := router(false), router(true)
	req := func(session string) *bucket.Request {
		return &bucket.Request{Model: "m", SessionKey: session, Signals: bucket.Signals{InputTokens: 100}}
	}
	pick := func(rt *enginepick.Router, session string) (policy.Pick, error) {
		d, err := rt.Select(bg, req(session))
		if err != nil {
			return policy.Pick{}, err
		}
		defer d.Release()
		return d.Selection.Plain, nil
	}

	// Up: sessions bind, and stick.
	bound := map[string]state.EngineID{}
	for i := range 16 {
		s := fmt.Sprintf("conv-%d", i)
		first, err := pick(strict, s)
		require.NoError(t, err)
		assert.Equal(t, label.ReasonAssigned, first.Reason)
		again, err := pick(lenient, s)
		require.NoError(t, err)
		assert.Equal(t, label.ReasonSessionPrimary, again.Reason)
		assert.Equal(t, first.Engine.ID(), again.Engine.ID(), "session %s sticks", s)
		bound[s] = first.Engine.ID()
	}

	// Down.
	srv.Stop()
	var slowest time.Duration
	for i := range 4 {
		s := fmt.Sprintf("conv-%d", i)
		began := time.Now()
		_, err := pick(strict, s)
		took := time.Since(began)
		slowest = max(slowest, took)
		require.Error(t, err)
		assert.ErrorIs(t, err, affinity.ErrUnavailable)
		var ue *affinity.UnavailableError
		assert.True(t, errors.As(err, &ue), "a typed *affinity.UnavailableError: %v", err)
		assert.Equal(t, http.StatusInternalServerError, bucket.StatusCode(err))
		assert.Less(t, took, 2*time.Second, "the outage is reported within the client's timeouts")

		pk, err := pick(lenient, s)
		require.NoError(t, err, "FallbackOnUnavailable routes without the store")
		assert.Equal(t, label.ReasonAffinityUnavailable, pk.Reason)
		assert.Contains(t, ids, pk.Engine.ID())

		pk, err = pick(strict, "")
		require.NoError(t, err, "a request without a session key does not touch the store")
		assert.Contains(t, ids, pk.Engine.ID())
	}
	t.Logf("Redis down: the slowest failed session selection took %v (go-redis: %d dial attempts, %v apart)",
		slowest.Round(time.Millisecond), 5, 100*time.Millisecond)
	for _, id := range ids {
		assert.Zero(t, inflight.Count(id), "no guard held after failed and fallback selections")
	}

	// Back, empty.
	srv.Restart()
	restarted := time.Now()
	var first policy.Pick
	require.Eventually(t, func() bool {
		first, err = pick(strict, "conv-0")
		return err == nil
	}, 5*time.Second, 10*time.Millisecond, "session requests succeed again once Redis answers")
	t.Logf("first session pick succeeded %v after the restart", time.Since(restarted).Round(time.Millisecond))
	assert.Equal(t, label.ReasonAssigned, first.Reason, "the restarted Redis lost the binding: bound afresh")
	again, err := pick(lenient, "conv-0")
	require.NoError(t, err)
	assert.Equal(t, label.ReasonSessionPrimary, again.Reason)
	assert.Equal(t, first.Engine.ID(), again.Engine.ID())
	for _, id := range ids {
		assert.Zero(t, inflight.Count(id), "every guard released")
	}
}
