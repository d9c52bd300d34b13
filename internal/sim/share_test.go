package sim

import (
	"context"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/state"
)

// TestReplayShareRouters checks Config.ShareRouters on the prefix-group workload: the replicas
// exchange their decisions (every batch applied by the others, none dropped), every peer dispatch
// has ended in every view when the replay ends, and the shared route-time placements bring eight
// replicas' hit rate back to one router's, which eight replicas without sharing miss.
func TestReplayShareRouters(t *testing.T) {
	w, err := ParseWorkload(WorkloadPrefixGroups)
	require.NoError(t, err)
	tr := generate(t, w, 1)
	cfg := Config{Trace: tr, Fleet: Fleet{Plain: 16}, Speed: 1, Limit: 3000, Seed: 1, Policies: []string{NameCacheAware}}
	hit := func(cfg Config) float64 {
		rep, err := Replay(context.Background(), cfg)
		require.NoError(t, err)
		return rep.Results[0].HitRate
	}
	one := hit(cfg)
	cfg.Routers = 8
	alone := hit(cfg)
	cfg.ShareRouters = true
	var mu sync.Mutex
	var received uint64
	cfg.inspect = func(r *run) error {
		checkConservation(t, r)
		for _, rep := range r.replicas {
			require.NotNil(t, rep.share)
			peers, live := rep.share.Peers()
			assert.Equal(t, 7, peers)
			assert.Zero(t, live, "peer dispatches left in a replica's view")
			_, rec, dropped := rep.share.Counts()
			assert.Zero(t, dropped)
			mu.Lock()
			received += rec
			mu.Unlock()
		}
		return nil
	}
	rep, err := Replay(context.Background(), cfg)
	require.NoError(t, err)
	shared := rep.Results[0].HitRate
	assert.Equal(t, DefaultShareDelay.Seconds(), rep.ShareDelay)
	assert.Positive(t, received)
	assert.Less(t, alone, 0.998*one, "eight replicas alone lose hit rate")
	assert.GreaterOrEqual(t, shared, 0.999*one, "sharing brings it back")
	t.Logf("hit rate: one router %.4f, 8 alone %.4f, 8 sharing %.4f", one, alone, shared)

	cfg.inspect = nil
	cfg.ShareDelay = -1
	_, err = Replay(context.Background(), cfg)
	assert.ErrorIs(t, err, state.ErrInvalidConfiguration)
}

// TestReplayShareRoutersSpreadArrivals checks what sharing buys router replicas on the
// conversation trace once each second's arrivals are spread over it (Config.SpreadArrivals): four
// sharing replicas have a lower TTFT median and p99 than four alone, and keep at least 98 % of one
// router's hit rate.
func TestReplayShareRoutersSpreadArrivals(t *testing.T) {
	tr, err := MooncakeConversation()
	require.NoError(t, err)
	cfg := Config{Trace: tr, Fleet: Fleet{Plain: 16}, Speed: 4, Limit: 1500, Seed: 1, Policies: []string{NameCacheAware},
		SpreadArrivals: true}
	replay := func(routers int, share bool) PolicyResult {
		c := cfg
		c.Routers, c.ShareRouters = routers, share
		rep, err := Replay(context.Background(), c)
		require.NoError(t, err)
		require.True(t, rep.SpreadArrivals)
		return rep.Results[0]
	}
	one, alone, shared := replay(1, false), replay(4, false), replay(4, true)
	assert.Less(t, shared.TTFT.P50, alone.TTFT.P50, "TTFT p50: sharing replicas against replicas alone")
	assert.Less(t, shared.TTFT.P99, alone.TTFT.P99, "TTFT p99: sharing replicas against replicas alone")
	assert.GreaterOrEqual(t, shared.HitRate, 0.98*one.HitRate, "hit rate: sharing replicas against one router")
	t.Logf("TTFT p50 / p99 s, hit rate: one router %.3f / %.2f, %.4f; 4 alone %.3f / %.2f, %.4f; 4 sharing %.3f / %.2f, %.4f",
		one.TTFT.P50, one.TTFT.P99, one.HitRate, alone.TTFT.P50, alone.TTFT.P99, alone.HitRate,
		shared.TTFT.P50, shared.TTFT.P99, shared.HitRate)
}
