package metrics_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/internal/cputime"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/metrics"
	"github.com/enginepick/enginepick/state"
)

// benchRouter builds a Router over 16 plain engines with fresh loads, running policy, with or
// without the Prometheus observer. For cache_aware, engine e03 holds the prompt's first half.
func benchRouter(b testing.TB, policy string, observed bool) (*enginepick.Router, *bucket.Request) {
	b.Helper()
	yaml := "kv: {block_tokens: 16}\nengines:\n"
	for i := range 16 {
		yaml += fmt.Sprintf("  - {id: e%02d, model: m}\n", i)
	}
	yaml += "models: [{id: m, buckets: [{id: chat, groups: {plain: {policy: {type: " + policy + "}}}}]}]\n"
	cfg, err := enginepick.ParseConfig([]byte(yaml), enginepick.FormatYAML)
	require.NoError(b, err)
	opts := []enginepick.Option{enginepick.WithHealthInterval(0)}
	if observed {
		p, err := metrics.New(prometheus.NewRegistry(), metrics.Options{})
		require.NoError(b, err)
		opts = append(opts, enginepick.WithObserver(p))
	}
	r, err := enginepick.New(cfg, nil, opts...)
	require.NoError(b, err)
	b.Cleanup(func() { _ = r.Close() })
	for i := range 16 {
		require.NoError(b, r.LoadTable().Report(loadmon.Report{Engine: state.EngineID(fmt.Sprintf("e%02d", i)), RunningRequests: uint64(i % 5), WaitingRequests: uint64(i % 3)}))
	}
	tokens := make([]uint32, 2048)
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	if x := r.Index(); x != nil {
		hs := make([]uint64, 64)
		for i := range hs {
			hs[i] = uint64(i + 1)
		}
		require.NoError(b, x.Store(kvindex.StoreEvent{Engine: "e03", BlockHashes: hs, TokenIDs: tokens[:1024], Tier: kvindex.TierDevice}))
	}
	req := &bucket.Request{Model: "m", Signals: bucket.Signals{InputTokens: 2048, ExpectedPeakTokens: 2304, HasExpectedPeak: true}}
	if policy == enginepick.TypeCacheAware {
		req.TokenIDs = tokens
	}
	return r, req
}

// pickLoop is the measured loop, a named function so that callgrind can count its instructions
// alone (--toggle-collect=*pickLoop, docs/performance.md).
func pickLoop(ctx context.Context, b *testing.B, r *enginepick.Router, req *bucket.Request, done bool, outcome enginepick.Outcome) {
	for b.Loop() {
		d, err := r.Select(ctx, req)
		if err != nil {
			b.Fatal(err)
		}
		if done {
			d.Done(outcome)
		} else {
			d.Release()
		}
	}
}

// BenchmarkPickObserver measures one pick (Router.Select and Dispatch.Release) with and without
// the Prometheus observer, side by side in one run, for the cheapest policy and the costliest;
// observer=prometheus_done adds Dispatch.Done with a full Outcome instead of Release. The issue
// target is observer=prometheus within 10 % of observer=none (docs/performance.md). Besides
// ns/op it reports cpu-ns/op, the process CPU time per pick, which the machine's load moves far
// less than wall time; run it with -cpu 1 so that no other goroutine's work is counted.
func BenchmarkPickObserver(b *testing.B) {
	ctx := context.Background()
	for _, pol := range []string{enginepick.TypeRoundRobin, enginepick.TypePowerOfTwo, enginepick.TypeCacheAware} {
		for _, obs := range []string{"none", "prometheus", "prometheus_done"} {
			b.Run("policy="+pol+"/observer="+obs, func(b *testing.B) {
				r, req := benchRouter(b, pol, obs != "none")
				outcome := enginepick.Outcome{TTFT: 80 * time.Millisecond, PromptTokens: 2048, OutputTokens: 256, CachedTokens: 1024, CachedTokensReported: true}
				b.ReportAllocs()
				cpu := cputime.Process()
				pickLoop(ctx, b, r, req, obs == "prometheus_done", outcome)
				b.ReportMetric(float64(cputime.Process()-cpu)/float64(b.N), "cpu-ns/op")
			})
		}
	}
}

// TestObserverAllocatesNothingPerPick checks that the Prometheus observer adds no allocation to a
// pick (docs/performance.md, observer overhead): the same Router.Select and Dispatch.Release with
// and without it allocate the same number of objects. A cache-aware decision reaches the observer
// without a copy to the heap (policy.CacheObserver).
func TestObserverAllocatesNothingPerPick(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are not exact under the race detector")
	}
	for _, policy := range []string{enginepick.TypeRoundRobin, enginepick.TypePowerOfTwo, enginepick.TypeCacheAware} {
		allocs := func(observed bool) float64 {
			r, req := benchRouter(t, policy, observed)
			ctx := context.Background()
			return testing.AllocsPerRun(200, func() {
				d, err := r.Select(ctx, req)
				if err != nil {
					t.Fatal(err)
				}
				d.Release()
			})
		}
		assert.Equal(t, allocs(false), allocs(true), policy)
	}
}
