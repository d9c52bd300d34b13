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
