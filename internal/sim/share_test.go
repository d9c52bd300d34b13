package sim

import (
	"context"
	"sync"
	"testing"
	"time"

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
	assert.Less(t, alone, 0.999*one, "eight replicas alone lose hit rate")
	assert.GreaterOrEqual(t, shared, 0.999*one, "sharing brings it back")
	t.Logf("hit rate: one router %.4f, 8 alone %.4f, 8 sharing %.4f", one, alone, shared)

	cfg.inspect = nil
	cfg.ShareDelay = -1
	_, err = Replay(context.Background(), cfg)
	assert.ErrorIs(t, err, state.ErrInvalidConfiguration)
}

// TestReplayShareRoutersSpreadArrivals checks what sharing buys router replicas on the
// conversation trace once each second's arrivals are spread over it (Config.SpreadArrivals): four
// sharing replicas have a lower TTFT median and p99 than four alone, a median within 1.05 × one
// router's, and keep at least 98 % of one router's hit rate. They do not herd: replicas routing
// within the delay of their shared decisions see one view, and preferring their home engines
// among near-equal ones (docs/design.md §6, "Router replicas") they send fewer pairs of requests
// less than the delay apart to one engine than four replicas sharing nothing.
func TestReplayShareRoutersSpreadArrivals(t *testing.T) {
	tr, err := MooncakeConversation()
	require.NoError(t, err)
	cfg := Config{Trace: tr, Fleet: Fleet{Plain: 16}, Speed: 4, Limit: 1500, Seed: 1, Policies: []string{NameCacheAware},
		SpreadArrivals: true}
	replay := func(routers int, share bool) (PolicyResult, int) {
		c := cfg
		c.Routers, c.ShareRouters = routers, share
		var mu sync.Mutex
		pairs := 0
		c.inspect = func(r *run) error {
			mu.Lock()
			defer mu.Unlock()
			pairs = closePairs(r, DefaultShareDelay)
			return nil
		}
		rep, err := Replay(context.Background(), c)
		require.NoError(t, err)
		require.True(t, rep.SpreadArrivals)
		mu.Lock()
		defer mu.Unlock()
		return rep.Results[0], pairs
	}
	one, onePairs := replay(1, false)
	alone, alonePairs := replay(4, false)
	shared, sharedPairs := replay(4, true)
	assert.Less(t, shared.TTFT.P50, alone.TTFT.P50, "TTFT p50: sharing replicas against replicas alone")
	assert.Less(t, shared.TTFT.P99, alone.TTFT.P99, "TTFT p99: sharing replicas against replicas alone")
	assert.LessOrEqual(t, shared.TTFT.P50, 1.05*one.TTFT.P50, "TTFT p50: sharing replicas against one router")
	assert.GreaterOrEqual(t, shared.HitRate, 0.98*one.HitRate, "hit rate: sharing replicas against one router")
	assert.Less(t, sharedPairs, alonePairs, "requests less than the delay apart on one engine: sharing replicas against replicas alone")
	t.Logf("TTFT p50 / p99 s, hit rate, close pairs: one router %.3f / %.2f, %.4f, %d; 4 alone %.3f / %.2f, %.4f, %d; 4 sharing %.3f / %.2f, %.4f, %d",
		one.TTFT.P50, one.TTFT.P99, one.HitRate, onePairs, alone.TTFT.P50, alone.TTFT.P99, alone.HitRate, alonePairs,
		shared.TTFT.P50, shared.TTFT.P99, shared.HitRate, sharedPairs)
}

// closePairs counts the requests of r that arrived less than d after the previous request sent to
// the same front engine.
func closePairs(r *run, d time.Duration) int {
	last := make([]time.Duration, len(r.all))
	seen := make([]bool, len(r.all))
	n := 0
	for k := range r.reqs { // in arrival order
		q := &r.reqs[k]
		if q.front == nil {
			continue // dropped before routing
		}
		i := q.front.idx
		if seen[i] && q.arrival-last[i] < d {
			n++
		}
		last[i], seen[i] = q.arrival, true
	}
	return n
}
