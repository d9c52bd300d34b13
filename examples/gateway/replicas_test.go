package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/internal/testengine"
	"github.com/enginepick/enginepick/state"
)

// The burst of TestReplicasActAsOneRouter.
const (
	replicaRequests = 32
	replicaSpacing  = 30 * time.Millisecond // between two requests, alternately to each gateway
	replicaTarget   = 0.60                  // the most of the burst one engine may take
	replicaBacklog  = 4                     // waiting requests engine a reports, engine b none
)

// Two gateways over one Redis act as one router (a replicas block, docs/design.md §6, "Router
// replicas"). Two test engines, a reporting four waiting requests and b none, are polled once;
// then 32 requests go alternately to the two gateways, 30 ms apart, all within that one report.
// Each gateway counts its own dispatches since the report, and, sharing, its peer's: together
// they send b four requests to even the backlog, then alternate, so b takes 18 (56 %); neither
// engine gets more than 60 % of the burst. Alone, each gateway evens the backlog on its own, so b
// takes four more (20, 62.5 %): the same burst without the replicas block misses the target,
// which the test checks too. Every request is answered.
func TestReplicasActAsOneRouter(t *testing.T) {
	addr := os.Getenv("ENGINEPICK_REDIS_ADDR")
	if addr == "" {
		msg := "ENGINEPICK_REDIS_ADDR not set: no redis-server for the gateways' replicas block (start one with .ci/redis.sh start)"
		if os.Getenv("ENGINEPICK_REQUIRE_SERVERS") == "1" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	for _, share := range []bool{true, false} {
		t.Run(map[bool]string{true: "sharing", false: "alone"}[share], func(t *testing.T) {
			taken := replicaBurst(t, addr, share)
			most := float64(max(taken[0], taken[1])) / replicaRequests
			t.Logf("engine a took %d, engine b %d of %d requests (the most %.1f %%)", taken[0], taken[1], replicaRequests, 100*most)
			assert.Equal(t, replicaRequests, taken[0]+taken[1], "every request reached one engine")
			if share {
				assert.LessOrEqual(t, most, replicaTarget, "sharing gateways spread the burst as one router")
			} else {
				assert.Greater(t, most, replicaTarget, "gateways alone each even the backlog: the target is missed")
			}
		})
	}
}

// replicaBurst runs the burst through two gateways, sharing or not, and returns the requests
// engines a and b took.
func replicaBurst(t *testing.T, redisAddr string, share bool) [2]int {
	t.Helper()
	engines := make([]*testengine.Engine, 2)
	for i := range engines {
		e, err := testengine.Start(testengine.Options{Model: e2eModel, KVEvents: testengine.KVEventsOptions{Disabled: true}})
		require.NoError(t, err)
		t.Cleanup(func() { _ = e.Close() })
		engines[i] = e
	}
	a, b := engines[0], engines[1]

	// Engine a's backlog: asleep, it queues requests sent straight to it.
	ctx, cancel := context.WithCancel(context.Background())
	var held sync.WaitGroup
	t.Cleanup(func() { cancel(); held.Wait() })
	require.NoError(t, a.Sleep(ctx))
	for range replicaBacklog {
		held.Go(func() {
			if resp, err := chatRequest(ctx, a.URL(), "backlog"); err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	require.Eventually(t, func() bool { return a.Stats(0).Waiting == replicaBacklog }, 5*time.Second, time.Millisecond)

	doc := fmt.Sprintf(`
engines:
  - {id: %q, model: %s, load: {url: "%s/metrics", format: vllm_metrics}}
  - {id: %q, model: %s, load: {url: "%s/metrics", format: vllm_metrics}}
models:
  - id: %s
    buckets: [{id: all, groups: {plain: {policy: {type: power_of_two}}}}]
load: {poll_interval: 1h, freshness: 1h}
`, a.URL(), e2eModel, a.URL(), b.URL(), e2eModel, b.URL(), e2eModel)
	if share {
		doc += fmt.Sprintf("replicas: {redis: {addr: %q}, channel: 'enginepick:test:%d', flush_interval: 2ms}\n", redisAddr, time.Now().UnixNano())
	}
	path := writeConfig(t, doc)
	gws := make([]*gateway, 2)
	urls := make([]string, 2)
	for i := range gws {
		var srv *httptest.Server
		gws[i], srv = startGateway(t, "--config="+path, "--tokenize=false")
		urls[i] = srv.URL
	}
	// One report per engine, the only one of the burst (the next poll is an hour away).
	for _, g := range gws {
		require.Eventually(t, func() bool {
			la, okA := g.table.Snapshot().Load(state.EngineID(a.URL()))
			_, okB := g.table.Snapshot().Load(state.EngineID(b.URL()))
			return okA && okB && la.WaitingRequests == replicaBacklog
		}, 5*time.Second, time.Millisecond, "both engines' reports")
		if share {
			require.Eventually(t, func() bool { return strings.Contains(scrapeText(g), "\nenginepick_replica_peers 1\n") },
				5*time.Second, time.Millisecond, "each gateway hears the other")
		}
	}
	a.WakeUp() // its backlog runs; the gateways keep the report that showed it

	statuses := make([]int, replicaRequests)
	var wg sync.WaitGroup
	for i := range replicaRequests {
		if i > 0 {
			time.Sleep(replicaSpacing)
		}
		wg.Go(func() {
			resp, err := chatRequest(context.Background(), urls[i%2], fmt.Sprintf("request %d", i))
			if err != nil {
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			statuses[i] = resp.StatusCode
		})
	}
	wg.Wait()
	for i, s := range statuses {
		require.Equal(t, http.StatusOK, s, "request %d", i)
	}
	return [2]int{len(a.Requests()) - replicaBacklog, len(b.Requests())}
}

// chatRequest sends a short non-streamed chat request to base.
func chatRequest(ctx context.Context, base, content string) (*http.Response, error) {
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":%q}],"max_tokens":8}`, e2eModel, content)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	return http.DefaultClient.Do(req)
}

// scrapeText returns the gateway's /metrics page.
func scrapeText(g *gateway) string {
	rec := httptest.NewRecorder()
	g.handler.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	return rec.Body.String()
}
