package metrics_test

import (
	"context"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/config"
	"github.com/enginepick/enginepick/internal/cputime"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/metrics"
	"github.com/enginepick/enginepick/state"
)

// benchRouter builds a Router over 16 plain engines with fresh loads, running policy, with or
// without the Prometheus observer (built with opts when observed). For cache_aware, engine e03
// holds the prompt's first half.
func benchRouter(b testing.TB, pol string, observed bool, mopts metrics.Options) (*config.Router, *bucket.Request) {
	b.Helper()
	yaml := "kv: {block_tokens: 16}\nengines:\n"
	for i := range 16 {
		yaml += fmt.Sprintf("  - {id: e%02d, model: m}\n", i)
	}
	yaml += "models: [{id: m, buckets: [{id: chat, groups: {plain: {policy: {type: " + pol + "}}}}]}]\n"
	cfg, err := config.Parse([]byte(yaml))
	require.NoError(b, err)
	opts := []config.Option{config.WithHealthInterval(0)}
	if observed {
		p, err := metrics.New(prometheus.NewRegistry(), mopts)
		require.NoError(b, err)
		opts = append(opts, config.WithObserver(p))
	}
	r, err := config.New(cfg, nil, opts...)
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
	if pol == label.CacheAware {
		req.TokenIDs = tokens
	}
	return r, req
}

// pickLoop is the measured loop, a named function so that callgrind can count its instructions
// alone (--toggle-collect=*pickLoop, docs/performance.md, "How these figures were measured").
func pickLoop(ctx context.Context, b *testing.B, r *config.Router, req *bucket.Request, done bool, outcome enginepick.Outcome) {
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
// observer=prometheus_done adds Dispatch.Done with a full Outcome instead of Release. The target
// is observer=prometheus within 10 % of observer=none (docs/performance.md, "metrics: the
// observer's cost on a pick"). Besides ns/op it reports cpu-ns/op, the process CPU time per pick,
// which the machine's load moves far less than wall time; run it with -cpu 1 so that no other
// goroutine's work is counted.
func BenchmarkPickObserver(b *testing.B) {
	ctx := context.Background()
	for _, pol := range []string{label.RoundRobin, label.PowerOfTwo, label.CacheAware} {
		for _, obs := range []string{"none", "prometheus", "prometheus_done"} {
			b.Run("policy="+pol+"/observer="+obs, func(b *testing.B) {
				r, req := benchRouter(b, pol, obs != "none", metrics.Options{})
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
// pick (docs/performance.md, "metrics: the observer's cost on a pick"): the same Router.Select and Dispatch.Release with
// and without it allocate the same number of objects. A cache-aware decision reaches the observer
// without a copy to the heap (policy.CacheObserver).
func TestObserverAllocatesNothingPerPick(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are not exact under the race detector")
	}
	for _, pol := range []string{label.RoundRobin, label.PowerOfTwo, label.CacheAware} {
		allocs := func(observed bool) float64 {
			r, req := benchRouter(t, pol, observed, metrics.Options{})
			ctx := context.Background()
			return testing.AllocsPerRun(200, func() {
				d, err := r.Select(ctx, req)
				if err != nil {
					t.Fatal(err)
				}
				d.Release()
			})
		}
		assert.Equal(t, allocs(false), allocs(true), pol)
	}
}

// pairedChunk is how many picks BenchmarkPickObserverPaired times on one Router before it
// switches to the other: enough that the two thread-clock readings around a chunk (each a
// system call) are under 1 % of it.
const pairedChunk = 128

// BenchmarkPickObserverPaired measures the observer's cost as a ratio that the machine's load
// moves little: one Router without an observer and one with the Prometheus observer, built
// alike, take turns of pairedChunk picks (Router.Select and Dispatch.Release) on one locked OS
// thread, whichever went second going first next, and each turn is timed on the thread's CPU
// clock. Both Routers therefore see the same host, the same caches and the same collector; the
// benchmark reports each one's CPU time per pick and their ratio, whose goal is at most 1.10
// (docs/design.md §15.2, docs/performance.md). One op is one turn of each Router. timing=sampled
// is the observer's default (one selection in 8); timing=every times every
// selection (SelectTimingEvery 1); timing=control gives neither Router an observer, so that its
// ratio shows how far from 1 the method itself strays on this machine.
func BenchmarkPickObserverPaired(b *testing.B) {
	if cputime.Thread() == 0 {
		b.Skip("no thread CPU clock on this platform")
	}
	ctx := context.Background()
	for _, pol := range []string{label.RoundRobin, label.PowerOfTwo, label.CacheAware} {
		for _, timing := range []struct {
			name  string
			every int
		}{{"sampled", 0}, {"every", 1}, {"control", -1}} {
			b.Run("policy="+pol+"/timing="+timing.name, func(b *testing.B) {
				routers := [2]*config.Router{}
				reqs := [2]*bucket.Request{}
				routers[0], reqs[0] = benchRouter(b, pol, false, metrics.Options{})
				routers[1], reqs[1] = benchRouter(b, pol, timing.every >= 0, metrics.Options{SelectTimingEvery: timing.every})
				turn := func(i int) time.Duration {
					r, req := routers[i], reqs[i]
					start := cputime.Thread()
					for range pairedChunk {
						d, err := r.Select(ctx, req)
						if err != nil {
							b.Fatal(err)
						}
						d.Release()
					}
					return cputime.Thread() - start
				}
				runtime.LockOSThread()
				defer runtime.UnlockOSThread()
				for i := range 2 { // warm both before timing
					turn(i)
				}
				var cpu [2]time.Duration
				first := 0
				b.ReportAllocs()
				for b.Loop() {
					cpu[first] += turn(first)
					cpu[1-first] += turn(1 - first)
					first = 1 - first
				}
				picks := float64(b.N) * pairedChunk
				b.ReportMetric(float64(cpu[0])/picks, "none-cpu-ns/pick")
				b.ReportMetric(float64(cpu[1])/picks, "prom-cpu-ns/pick")
				b.ReportMetric(float64(cpu[1])/float64(cpu[0]), "ratio")
			})
		}
	}
}
