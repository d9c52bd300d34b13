package config_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/config"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

// replicasRedis returns the redis-server of ENGINEPICK_REDIS_ADDR (.ci/redis.sh). Without one the
// test skips, or fails when ENGINEPICK_REQUIRE_SERVERS=1 (CI).
func replicasRedis(t *testing.T) string {
	t.Helper()
	addr := os.Getenv("ENGINEPICK_REDIS_ADDR")
	if addr == "" {
		msg := "ENGINEPICK_REDIS_ADDR not set: no redis-server for the replicas (start one with .ci/redis.sh start)"
		if os.Getenv("ENGINEPICK_REQUIRE_SERVERS") == "1" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return addr
}

// Two Routers built from one file with a replicas block share their dispatches through Redis:
// engine e1 reports one waiting request, e2 none but one running. The first replica sends a
// request to e2 (fewer waiting); the second, once the first's dispatch has reached it, counts it
// in e2's waiting requests, ties them and takes e1 on running requests. With sharing off (the
// block removed) the second replica takes e2 as the first did. The peer's dispatch never counts
// in the second replica's own in-flight requests. Close stops the sharing (the package's leak
// check).
func TestReplicasShareDispatches(t *testing.T) {
	addr := replicasRedis(t)
	doc := fmt.Sprintf(`
engines:
  - {id: e1, model: m}
  - {id: e2, model: m}
models:
  - id: m
    buckets: [{id: all, groups: {plain: {}}}]
replicas: {redis: {addr: %q}, channel: "enginepick:test:%d", lease: 2s, flush_interval: 2ms}
`, addr, time.Now().UnixNano())
	for _, share := range []bool{true, false} {
		t.Run(fmt.Sprintf("share=%v", share), func(t *testing.T) {
			cfg := mustParse(t, doc)
			if !share {
				cfg.Replicas = nil
			}
			a, b := mustNew(t, cfg, nil), mustNew(t, cfg, nil)
			report := func() {
				for _, r := range []*config.Router{a, b} {
					require.NoError(t, r.LoadTable().ReportBatch([]loadmon.Report{
						{Engine: "e1", WaitingRequests: 1}, {Engine: "e2", RunningRequests: 1}}))
				}
			}
			report()
			if share {
				// Probe dispatches on e1 until one reaches b (both subscribed), then report again:
				// the probes are no dispatches since the report.
				require.Eventually(t, func() bool {
					a.InFlight().Acquire("e1", -1, 0).Release()
					return dispatched(b, "e1") > 0
				}, 5*time.Second, 2*time.Millisecond, "the replicas hear each other")
				time.Sleep(10 * time.Millisecond) // the last probes land
				report()
			}
			d := mustSelect(t, a, selectReq("m", 100, 200))
			defer d.Release()
			require.Equal(t, state.EngineID("e2"), d.Selection.Engines()[0].ID())
			if share {
				require.Eventually(t, func() bool { return dispatched(b, "e2") == 1 }, 5*time.Second, time.Millisecond,
					"a's dispatch reaches b")
				assert.Equal(t, uint64(0), b.InFlight().Count("e2"), "a peer's dispatch is not b's in flight")
			}
			db := mustSelect(t, b, selectReq("m", 100, 200))
			defer db.Release()
			want := state.EngineID("e2")
			if share {
				want = "e1"
			}
			assert.Equal(t, want, db.Selection.Engines()[0].ID())
		})
	}
}

// dispatched returns the dispatches to engine since its report that r's pressure comparisons see.
func dispatched(r *config.Router, engine state.EngineID) uint64 {
	return loadmon.Observe(r.LoadTable().Snapshot(), r.InFlight(), engine).Dispatched
}

// A replicas block with an unreachable broker never fails New or a request: the Router decides on
// its own view.
func TestReplicasUnreachableBrokerDoesNotFailRequests(t *testing.T) {
	cfg := mustParse(t, `
engines: [{id: e1, model: m}]
models: [{id: m, buckets: [{id: all, groups: {plain: {}}}]}]
replicas: {redis: {addr: "127.0.0.1:1"}}
`)
	r := mustNew(t, cfg, nil)
	for range 10 {
		d, err := r.Select(context.Background(), selectReq("m", 10, 20))
		require.NoError(t, err)
		d.Release()
	}
}
