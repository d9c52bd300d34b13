package sim

import (
	"context"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestRequestSessionKey(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		hashes []uint64
		want   string
	}{
		{[]uint64{0, 7, 8}, "conv-7"},
		{[]uint64{0, 7}, "conv-7"},
		{[]uint64{0}, ""},
		{[]uint64{}, ""},
		{nil, ""}, // Azure: no conversation information
	} {
		r := Request{HashIDs: c.hashes}
		assert.Equal(t, c.want, r.SessionKey(), "HashIDs %v", c.hashes)
	}
	tr, err := MooncakeConversation()
	require.NoError(t, err)
	keys := map[string]int{}
	for i := range tr.Requests {
		k := tr.Requests[i].SessionKey()
		require.NotEmpty(t, k, "request %d has a chain", i)
		keys[k]++
	}
	assert.Len(t, keys, 7373, "conversation chains of the embedded Mooncake trace")
	assert.Equal(t, 43, keys["conv-7402"], "the longest chain")
}

// With three router replicas (requests dealt round-robin), the affinity policies share one store,
// so every turn of a conversation lands on the same engine whichever replica routed it; power of
// two scatters them. Sharing the conversation's engine lifts the hit rate far above power of two.
func TestReplaySessionAffinityAcrossReplicas(t *testing.T) {
	tr, err := MooncakeConversation()
	require.NoError(t, err)
	var mu sync.Mutex
	engines := map[string]map[string]map[string]bool{} // policy → key → engines
	cfg := Config{Trace: tr, Fleet: Fleet{Plain: 8}, Speed: 4, Limit: 1500, Seed: 3, Routers: 3,
		Policies: []string{NamePowerOfTwo, NameSessionAware, NameSticky}}
	cfg.inspect = func(r *run) error {
		byKey := map[string]map[string]bool{}
		for i := range r.reqs {
			q := &r.reqs[i]
			if q.front == nil {
				continue
			}
			k := q.tr.SessionKey()
			if byKey[k] == nil {
				byKey[k] = map[string]bool{}
			}
			byKey[k][string(q.front.id)] = true
		}
		mu.Lock()
		engines[r.name] = byKey
		mu.Unlock()
		return nil
	}
	rep, err := Replay(context.Background(), cfg)
	require.NoError(t, err)
	multi := func(name string) int {
		n := 0
		for _, es := range engines[name] {
			if len(es) > 1 {
				n++
			}
		}
		return n
	}
	assert.Zero(t, multi(NameSessionAware), "session_aware: every conversation on one engine")
	assert.Zero(t, multi(NameSticky), "sticky: every conversation on one engine")
	assert.Positive(t, multi(NamePowerOfTwo), "power_of_two scatters conversations (the check can fail)")
	p2, _ := rep.Result(NamePowerOfTwo)
	for _, name := range []string{NameSessionAware, NameSticky} {
		r, ok := rep.Result(name)
		require.True(t, ok)
		assert.Equal(t, 1500, r.Completed, name)
		assert.Greater(t, r.HitRate, 2*p2.HitRate, "%s hit rate %.3f, power_of_two %.3f", name, r.HitRate, p2.HitRate)
	}
}
