package config_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/affinity/redisstore"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/config"
	"github.com/enginepick/enginepick/state"
)

// offline is an http.RoundTripper that fails every request at once, so that the example
// configurations' load pollers never leave the machine.
type offline struct{}

func (offline) RoundTrip(*http.Request) (*http.Response, error) { return nil, errors.New("offline") }

// TestExampleConfigs loads every file under examples/configs, builds a Router from it with New and
// routes a request that shows what the file is for (docs/design.md §14).
func TestExampleConfigs(t *testing.T) {
	t.Parallel()
	files, err := filepath.Glob("../examples/configs/*")
	require.NoError(t, err)
	checks := map[string]func(t *testing.T, r *config.Router){
		"plain-round-robin.yaml": func(t *testing.T, r *config.Router) {
			var got []state.EngineID
			for range 4 {
				d := mustSelect(t, r, &bucket.Request{Model: "llama-3.1-8b", Signals: bucket.Signals{InputTokens: 100}})
				got = append(got, d.Selection.Plain.Engine.ID())
				d.Release()
			}
			assert.Equal(t, []state.EngineID{"http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000", "http://10.0.0.4:8000"}, got)
		},
		"pd-cache-aware.yaml": func(t *testing.T, r *config.Router) {
			assert.Equal(t, 64, r.Index().Hasher().BlockTokens())
			for _, tc := range []struct {
				peak   int64
				bucket string
			}{{16384, "long-context"}, {8192, "short-context"}} {
				d := mustSelect(t, r, &bucket.Request{Model: "qwen3-32b", TokenIDs: make([]uint32, 4096),
					Signals: bucket.Signals{InputTokens: 4096, ExpectedPeakTokens: tc.peak, HasExpectedPeak: true}})
				assert.Equal(t, tc.bucket, d.Selection.Bucket.ID(), "peak %d", tc.peak)
				assert.True(t, d.Selection.IsPD())
				d.Release()
			}
			assert.Len(t, r.LoadPollStats(), 8, "one poll target per engine")
		},
		"sessions-redis.yaml": func(t *testing.T, r *config.Router) {
			for _, tc := range []struct{ model, session, key string }{{"llama-3.1-8b", "conversation-1", ""}, {"tenant-lora", "", "tenant-a"}} {
				var first state.EngineID
				for i := range 3 {
					d := mustSelect(t, r, &bucket.Request{Model: state.ModelID(tc.model), SessionKey: tc.session, RoutingKey: tc.key,
						Signals: bucket.Signals{InputTokens: 100}})
					if i == 0 {
						first = d.Selection.Plain.Engine.ID()
					}
					assert.Equal(t, first, d.Selection.Plain.Engine.ID(), "%s keeps its engine", tc.model)
					d.Release()
				}
			}
		},
		"flow-control.yaml": func(t *testing.T, r *config.Router) {
			ctx := context.Background()
			req := func(priority int) *bucket.Request {
				return &bucket.Request{Model: "llama-3.1-8b", Priority: priority, Flow: "gold", Signals: bucket.Signals{InputTokens: 100}}
			}
			held := make([]*enginepick.Dispatch, 0, 62)
			for range 62 { // both engines at their caps but the last slot, the top band's
				held = append(held, mustSelect(t, r, req(0)))
			}
			_, err := r.Select(ctx, req(-1))
			assert.Equal(t, http.StatusTooManyRequests, bucket.StatusCode(err), "best effort is shed while saturated: %v", err)
			top := mustSelect(t, r, req(1)) // the interactive band takes a last slot at once
			served := make(chan *enginepick.Dispatch, 1)
			go func() {
				d, err := r.Select(ctx, req(0))
				assert.NoError(t, err)
				served <- d
			}()
			select {
			case <-served:
				t.Fatal("a default-band request was served while both engines were at their caps")
			case <-time.After(50 * time.Millisecond):
			}
			// A dispatch ends on the engine the interactive request left alone: the waiting
			// request takes its place.
			i := slices.IndexFunc(held, func(d *enginepick.Dispatch) bool {
				return d.Selection.Plain.Engine.ID() != top.Selection.Plain.Engine.ID()
			})
			require.GreaterOrEqual(t, i, 0)
			held[i].Release()
			select {
			case d := <-served:
				require.NotNil(t, d)
				assert.Equal(t, held[i].Selection.Plain.Engine.ID(), d.Selection.Plain.Engine.ID())
				d.Release()
			case <-time.After(5 * time.Second):
				t.Fatal("the waiting request was not served when a dispatch ended")
			}
			top.Release()
			held = slices.Delete(held, i, i+1)
			for _, d := range held {
				d.Release()
			}
		},
		"length-buckets-slo.json": func(t *testing.T, r *config.Router) {
			for _, tc := range []struct {
				input  int64
				ttft   time.Duration
				tps    float64
				bucket string
			}{
				{1000, 0, 0, "interactive"},           // no target: capacity, then rank
				{1000, time.Second, 0, "interactive"}, // slo_first: the bucket that meets 1 s first
				{1000, 0, 50, "batch"},                // best_effort: keep the 60 tok/s bucket free
				{1000, time.Second, 50, "interactive"},
				{1000, 5 * time.Second, 50, "batch"},
				{9000, 0, 0, "long"}, // only the long bucket accepts 9k tokens
			} {
				req := &bucket.Request{Model: "llama-3.1-70b", Signals: bucket.Signals{InputTokens: tc.input,
					TTFTTarget: tc.ttft, HasTTFTTarget: tc.ttft > 0, TPSTarget: tc.tps, HasTPSTarget: tc.tps > 0}}
				d := mustSelect(t, r, req)
				assert.Equal(t, tc.bucket, d.Selection.Bucket.ID(), "input %d, TTFT target %v, TPS target %v", tc.input, tc.ttft, tc.tps)
				d.Release()
			}
		},
	}
	var seen []string
	for _, f := range files {
		name := filepath.Base(f)
		seen = append(seen, name)
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			cfg, err := config.Load(f)
			require.NoError(t, err)
			opts := []config.Option{config.WithHealthInterval(0), config.WithHTTPClient(&http.Client{Transport: offline{}})}
			if cfg.Affinity.Store == "redis" {
				opts = append(opts, config.WithAffinityStore(testRedisStore(t, cfg)))
			}
			r, err := config.New(cfg, nil, opts...)
			require.NoError(t, err)
			defer r.Close()
			check, ok := checks[name]
			require.True(t, ok, "add a check for examples/configs/%s", name)
			check(t, r)
		})
	}
	for name := range checks {
		assert.True(t, slices.Contains(seen, name), "examples/configs/%s is gone", name)
	}
	_, err = os.Stat("../examples/configs")
	require.NoError(t, err)
}

// testRedisStore builds the Redis store a configuration describes, as a host does, but on the test
// server of ENGINEPICK_REDIS_ADDR (.ci/redis.sh) under a fresh prefix. Without a server the test
// skips, or fails when ENGINEPICK_REQUIRE_SERVERS=1 (CI).
func testRedisStore(t *testing.T, cfg *config.Config) *redisstore.Store {
	t.Helper()
	addr := os.Getenv("ENGINEPICK_REDIS_ADDR")
	if addr == "" {
		msg := "ENGINEPICK_REDIS_ADDR not set: no redis-server for the Redis example (start one with .ci/redis.sh start)"
		if os.Getenv("ENGINEPICK_REQUIRE_SERVERS") == "1" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	client := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{addr}})
	t.Cleanup(func() { _ = client.Close() })
	st, err := redisstore.New(redisstore.Options{Client: client, Prefix: fmt.Sprintf("%s:test:%d", cfg.Affinity.Redis.Prefix, time.Now().UnixNano()),
		Shards: cfg.Affinity.Redis.Shards, IdleTimeout: cfg.Affinity.IdleTimeout.D()})
	require.NoError(t, err)
	return st
}

func mustSelect(t *testing.T, r *config.Router, req *bucket.Request) *enginepick.Dispatch {
	t.Helper()
	d, err := r.Select(context.Background(), req)
	require.NoError(t, err)
	return d
}
