package metrics_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/config"
	"github.com/enginepick/enginepick/internal/kvbridge"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/metrics"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// scrape gathers reg into "name{l1=v1,l2=v2}" → value, with histograms as _count, _sum and
// _bucket{…,le=…} entries. To keep the tables short it leaves out counters at 0, histograms
// without observations and buckets whose cumulative count is 0 (the +Inf bucket is _count).
func scrape(t *testing.T, reg *prometheus.Registry) map[string]map[string]float64 {
	t.Helper()
	fams, err := reg.Gather()
	require.NoError(t, err)
	out := map[string]map[string]float64{}
	for _, f := range fams {
		series := map[string]float64{}
		for _, m := range f.GetMetric() {
			var ls []string
			for _, l := range m.GetLabel() {
				ls = append(ls, l.GetName()+"="+l.GetValue())
			}
			key := func(extra ...string) string {
				all := append(slices.Clone(ls), extra...)
				return "{" + strings.Join(all, ",") + "}"
			}
			switch f.GetType() {
			case dto.MetricType_COUNTER:
				if v := m.GetCounter().GetValue(); v != 0 {
					series[key()] = v
				}
			case dto.MetricType_GAUGE:
				series[key()] = m.GetGauge().GetValue()
			case dto.MetricType_HISTOGRAM:
				h := m.GetHistogram()
				if h.GetSampleCount() == 0 {
					continue
				}
				series["_count"+key()] = float64(h.GetSampleCount())
				series["_sum"+key()] = h.GetSampleSum()
				for _, b := range h.GetBucket() {
					if b.GetCumulativeCount() > 0 {
						series["_bucket"+key(fmt.Sprintf("le=%g", b.GetUpperBound()))] = float64(b.GetCumulativeCount())
					}
				}
			}
		}
		out[strings.TrimPrefix(f.GetName(), "enginepick_")] = series
	}
	return out
}

// scriptConfig's cache_aware group runs the upstream rules alone (no route-time placements, no
// cost comparison, docs/design.md §9.10–§9.11), so that the script below decides every pick by
// the events and reports it sets.
const scriptConfig = `
kv: {block_tokens: 4}
engines:
  - {id: e1, model: m}
  - {id: e2, model: m}
  - {id: e3, model: m}
  - {id: p1, model: pd, stage: prefill}
  - {id: d1, model: pd, stage: decode}
models:
  - id: m
    buckets:
      - id: chat
        groups:
          plain:
            policy: {type: cache_aware, admission: {max_running_requests: 8}, cache_aware: {min_matched_tokens: 4, engine_queue_limit: 2, route_placements: false, cost_comparison: false}}
  - id: pd
    buckets:
      - id: all
        groups:
          pd:
            prefill: {policy: {type: round_robin}}
            decode: {policy: {type: power_of_two, admission: {max_inflight_requests: 1}}}
`

// fixture is a Router built from scriptConfig with a Prometheus observer on a fresh registry and a
// manual clock.
type fixture struct {
	reg *prometheus.Registry
	obs enginepick.Observer
	r   *config.Router
	mu  sync.Mutex
	now time.Time
}

func (f *fixture) clock() time.Time { f.mu.Lock(); defer f.mu.Unlock(); return f.now }
func (f *fixture) advance(d time.Duration) {
	f.mu.Lock()
	f.now = f.now.Add(d)
	f.mu.Unlock()
}

// newFixture builds the Router from yaml with the Prometheus observer, every selection timed
// (SelectTimingEvery 1) so that the scripted tests can assert exact histogram counts;
// TestSelectTimingIsSampled checks the default sample.
func newFixture(t testing.TB, yaml string) *fixture {
	t.Helper()
	return newFixtureWith(t, yaml, metrics.Options{SelectTimingEvery: 1})
}

func newFixtureWith(t testing.TB, yaml string, opts metrics.Options) *fixture {
	t.Helper()
	f := &fixture{reg: prometheus.NewRegistry(), now: time.Unix(1_700_000_000, 0)}
	p, err := metrics.New(f.reg, opts)
	require.NoError(t, err)
	f.obs = p
	cfg, err := config.Parse([]byte(yaml))
	require.NoError(t, err)
	f.r, err = config.New(cfg, nil, config.WithObserver(p), config.WithClock(f.clock), config.WithHealthInterval(0))
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.r.Close() })
	return f
}

func (f *fixture) report(t *testing.T, id state.EngineID, running, waiting uint64) {
	t.Helper()
	require.NoError(t, f.r.LoadTable().Report(loadmon.Report{Engine: id, RunningRequests: running, WaitingRequests: waiting}))
}

// TestScrapeAfterScriptedPicks runs a scripted sequence of picks and dispatch outcomes through a
// Router built by config.New with the Prometheus observer, then scrapes the registry and checks
// every family with exact values (docs/design.md §15). The cache-aware decision labels sum to the
// cache-aware picks of decisions_total.
func TestScrapeAfterScriptedPicks(t *testing.T) {
	t.Parallel()
	f := newFixture(t, scriptConfig)
	ctx := context.Background()
	tokens := []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16} // 4 blocks
	x := f.r.Index()
	require.NoError(t, x.Store(kvindex.StoreEvent{Engine: "e1", BlockHashes: []uint64{1, 2, 3, 4}, TokenIDs: tokens, Tier: kvindex.TierDevice}))
	require.NoError(t, x.Store(kvindex.StoreEvent{Engine: "e2", BlockHashes: []uint64{5, 6}, TokenIDs: tokens[:8], Tier: kvindex.TierDevice | kvindex.TierHost}))
	for _, id := range []state.EngineID{"e1", "e2", "e3"} {
		f.report(t, id, 0, 0)
	}
	pick := func(model string) (*enginepick.Dispatch, error) {
		req := &bucket.Request{Model: state.ModelID(model), TokenIDs: tokens,
			Signals: bucket.Signals{InputTokens: int64(len(tokens)), ExpectedPeakTokens: 32, HasExpectedPeak: true}}
		return f.r.Select(ctx, req)
	}

	// 1. e1 holds the whole prefix: cache_hit on e1; done after 2 s with TTFT 0.5 s.
	d1, err := pick("m")
	require.NoError(t, err)
	require.Equal(t, state.EngineID("e1"), d1.Selection.Plain.Engine.ID())
	f.advance(2 * time.Second)
	d1.Done(enginepick.Outcome{TTFT: 500 * time.Millisecond, PromptTokens: 16, OutputTokens: 10, CachedTokens: 12, CachedTokensReported: true})

	// 2. e1 queues (5 waiting, limit 2): the gate sets it aside and e2's 2 blocks win, a
	// partial diversion forfeiting 2 blocks. Released without an outcome.
	f.report(t, "e1", 0, 5)
	d2, err := pick("m")
	require.NoError(t, err)
	require.Equal(t, state.EngineID("e2"), d2.Selection.Plain.Engine.ID())
	d2.Release()

	// 3. e2 queues too: both holders set aside, e3 is unqueued: cache_worker_queued, diverting
	// from 4 blocks. Done with an error after 1 s.
	f.report(t, "e2", 0, 3)
	d3, err := pick("m")
	require.NoError(t, err)
	require.Equal(t, state.EngineID("e3"), d3.Selection.Plain.Engine.ID())
	f.advance(time.Second)
	d3.Done(enginepick.Outcome{Err: errors.New("connection reset"), PromptTokens: 16})

	// 4. Every engine runs 8 (cap 8), none queues: both holders rejected by
	// max_running_requests: the selection fails with admission_rejected.
	for _, id := range []state.EngineID{"e1", "e2", "e3"} {
		f.report(t, id, 8, 0)
	}
	_, err = pick("m")
	require.Error(t, err)

	// 5. An unknown model: labelled with the empty model_id.
	_, err = pick("client-chosen")
	require.ErrorIs(t, err, enginepick.ErrUnknownModel)

	// 6. PD: one pair held; the second attempt's decode pick is rejected (in-flight cap 1)
	// after its prefill pick succeeded.
	d6, err := pick("pd")
	require.NoError(t, err)
	_, err = pick("pd")
	require.Error(t, err)
	f.advance(3 * time.Second)
	d6.Done(enginepick.Outcome{TTFT: time.Second, PromptTokens: 16, OutputTokens: 4})

	// Stale load for e3 and an untrusted e2 show in the state gauges.
	f.advance(10 * time.Second)
	f.report(t, "e1", 1, 0)
	f.report(t, "e2", 1, 0)
	require.NoError(t, kvbridge.MarkUntrusted(x, "e2", 0))

	got := scrape(t, f.reg)
	want := map[string]map[string]float64{
		"decisions_total": {
			"{bucket=chat,model_id=m,policy=cache_aware,reason=cache_candidate,stage=plain}":    2,
			"{bucket=chat,model_id=m,policy=cache_aware,reason=no_cache_candidate,stage=plain}": 1,
			"{bucket=all,model_id=pd,policy=round_robin,reason=round_robin,stage=prefill}":      2,
			"{bucket=all,model_id=pd,policy=power_of_two,reason=power_of_two,stage=decode}":     1,
		},
		"selections_total": {"{bucket=chat,model_id=m}": 3, "{bucket=all,model_id=pd}": 1},
		"cache_aware_decisions_total": {
			"{decision=cache_hit,model_id=m}": 2, "{decision=cache_worker_queued,model_id=m}": 1,
		},
		"diverted_overlap_blocks": {
			"_count{model_id=m}": 1, "_sum{model_id=m}": 4, "_bucket{model_id=m,le=4}": 1, "_bucket{model_id=m,le=8}": 1,
			"_bucket{model_id=m,le=16}": 1, "_bucket{model_id=m,le=32}": 1, "_bucket{model_id=m,le=64}": 1, "_bucket{model_id=m,le=128}": 1,
			"_bucket{model_id=m,le=256}": 1, "_bucket{model_id=m,le=512}": 1, "_bucket{model_id=m,le=1024}": 1, "_bucket{model_id=m,le=2048}": 1,
			"_bucket{model_id=m,le=4096}": 1, "_bucket{model_id=m,le=8192}": 1,
		},
		"partially_diverted_overlap_blocks": {
			"_count{model_id=m}": 1, "_sum{model_id=m}": 2, "_bucket{model_id=m,le=2}": 1, "_bucket{model_id=m,le=4}": 1,
			"_bucket{model_id=m,le=8}": 1, "_bucket{model_id=m,le=16}": 1, "_bucket{model_id=m,le=32}": 1, "_bucket{model_id=m,le=64}": 1,
			"_bucket{model_id=m,le=128}": 1, "_bucket{model_id=m,le=256}": 1, "_bucket{model_id=m,le=512}": 1, "_bucket{model_id=m,le=1024}": 1,
			"_bucket{model_id=m,le=2048}": 1, "_bucket{model_id=m,le=4096}": 1, "_bucket{model_id=m,le=8192}": 1,
		},
		"queue_gate_rejections_total": {"{model_id=m}": 3},
		"admission_rejections_total": {
			"{limit=max_running_requests,model_id=m,stage=plain}": 2, "{limit=max_inflight_requests,model_id=pd,stage=decode}": 1,
		},
		"selection_failures_total": {
			"{model_id=m,reason=admission_rejected}": 1, "{model_id=pd,reason=admission_rejected}": 1, "{model_id=,reason=unknown_model}": 1,
		},
		"dispatch_failures_total": {"{model_id=m,reason=error}": 1},
		"prompt_tokens_total": {
			"{cached_reported=true,engine=e1,model_id=m}": 16, "{cached_reported=false,engine=e3,model_id=m}": 16,
			"{cached_reported=false,engine=p1,model_id=pd}": 16,
		},
		"cached_prompt_tokens_total": {"{engine=e1,model_id=m}": 12},
		"output_tokens_total":        {"{engine=e1,model_id=m}": 10, "{engine=d1,model_id=pd}": 4},
		"inflight_requests": {
			"{engine=e1,model_id=m}": 0, "{engine=e2,model_id=m}": 0, "{engine=e3,model_id=m}": 0,
			"{engine=p1,model_id=pd}": 0, "{engine=d1,model_id=pd}": 0,
		},
		"load_report_fresh": {
			"{engine=e1,model_id=m}": 1, "{engine=e2,model_id=m}": 1, "{engine=e3,model_id=m}": 0,
			"{engine=p1,model_id=pd}": 0, "{engine=d1,model_id=pd}": 0,
		},
		"load_report_age_seconds":     {"{engine=e1,model_id=m}": 0, "{engine=e2,model_id=m}": 0, "{engine=e3,model_id=m}": 13},
		"kv_index_blocks":             {"{}": 4},
		"kv_index_approximate_blocks": {"{}": 0},
		"kv_index_engine_blocks": {
			"{engine=e1,tier=device}": 4, "{engine=e1,tier=host}": 0, "{engine=e1,tier=disk}": 0, "{engine=e1,tier=external}": 0, "{engine=e1,tier=approximate}": 0,
			"{engine=e2,tier=device}": 2, "{engine=e2,tier=host}": 2, "{engine=e2,tier=disk}": 0, "{engine=e2,tier=external}": 0, "{engine=e2,tier=approximate}": 0,
		},
		"kv_index_engine_trusted": {"{engine=e1}": 1, "{engine=e2}": 0},
	}
	for fam, series := range want {
		assert.Equal(t, series, got[fam], "family %s", fam)
	}

	// Histograms of time: exact counts and sums on the manual clock.
	ttft := got["ttft_seconds"]
	assert.Equal(t, 1.0, ttft["_count{engine=e1,model_id=m,policy=cache_aware,stage=plain}"])
	assert.Equal(t, 0.5, ttft["_sum{engine=e1,model_id=m,policy=cache_aware,stage=plain}"])
	assert.NotContains(t, ttft, "_count{engine=e3,model_id=m,policy=cache_aware,stage=plain}", "a failed dispatch records no TTFT")
	assert.Equal(t, 1.0, ttft["_sum{engine=p1,model_id=pd,policy=round_robin,stage=prefill}"])
	assert.Equal(t, 1.0, ttft["_sum{engine=d1,model_id=pd,policy=power_of_two,stage=decode}"])
	e2e := got["request_duration_seconds"]
	assert.Equal(t, 2.0, e2e["_sum{engine=e1,model_id=m,policy=cache_aware,stage=plain}"])
	assert.Equal(t, 1.0, e2e["_sum{engine=e3,model_id=m,policy=cache_aware,stage=plain}"])
	assert.Equal(t, 3.0, e2e["_sum{engine=d1,model_id=pd,policy=power_of_two,stage=decode}"])
	assert.NotContains(t, e2e, "_count{engine=e2,model_id=m,policy=cache_aware,stage=plain}", "Release reports no outcome")
	sel := got["selection_duration_seconds"]
	assert.Equal(t, map[string]float64{"{model_id=m}": 4, "{model_id=pd}": 2, "{model_id=}": 1},
		counts(sel), "one observation per Select, failures included")

	// The invariant of docs/design.md §15: decision labels sum to the cache-aware picks.
	var labels, picks float64
	for _, v := range got["cache_aware_decisions_total"] {
		labels += v
	}
	for k, v := range got["decisions_total"] {
		if strings.Contains(k, "policy=cache_aware") {
			picks += v
		}
	}
	assert.Equal(t, picks, labels)
}

// counts extracts the _count entries of a histogram's series.
func counts(h map[string]float64) map[string]float64 {
	out := map[string]float64{}
	for k, v := range h {
		if rest, ok := strings.CutPrefix(k, "_count"); ok {
			out[rest] = v
		}
	}
	return out
}

// TestLabelsAreBounded checks that no label carries a per-request value: thousands of requests
// for distinct unknown models and with distinct prompts add no series.
func TestLabelsAreBounded(t *testing.T) {
	t.Parallel()
	f := newFixture(t, scriptConfig)
	before := seriesCount(t, f.reg)
	for i := range 2000 {
		req := &bucket.Request{Model: state.ModelID(fmt.Sprintf("model-%d", i)), Signals: bucket.Signals{InputTokens: int64(i)}}
		_, _ = f.r.Select(context.Background(), req)
		d, err := f.r.Select(context.Background(), &bucket.Request{Model: "m", TokenIDs: []uint32{uint32(i)}, Signals: bucket.Signals{InputTokens: 1}})
		require.NoError(t, err)
		d.Done(enginepick.Outcome{Err: fmt.Errorf("request %d failed", i), PromptTokens: uint64(i)})
	}
	after := seriesCount(t, f.reg)
	assert.Less(t, after-before, 120, "series added by 4000 distinct requests")
}

func seriesCount(t *testing.T, reg *prometheus.Registry) int {
	n := 0
	for _, s := range scrape(t, reg) {
		n += len(s)
	}
	return n
}

// TestRegistrationErrors checks New's errors and that one Prometheus observes one Router.
func TestRegistrationErrors(t *testing.T) {
	t.Parallel()
	_, err := metrics.New(nil, metrics.Options{})
	assert.ErrorIs(t, err, state.ErrInvalidConfiguration)
	reg := prometheus.NewRegistry()
	p, err := metrics.New(reg, metrics.Options{})
	require.NoError(t, err)
	_, err = metrics.New(reg, metrics.Options{})
	assert.Error(t, err, "the same families twice on one registry")
	_, err = metrics.New(reg, metrics.Options{Namespace: "other"})
	assert.NoError(t, err, "another namespace")
	_, err = metrics.New(prometheus.NewRegistry(), metrics.Options{SelectTimingEvery: -1})
	assert.ErrorIs(t, err, state.ErrInvalidConfiguration, "a negative timing sample")
	sampler, ok := p.(enginepick.SelectTimingSampler)
	require.True(t, ok)
	assert.Equal(t, 8, sampler.SelectTimingEvery(), "zero means the default")

	cfg, err := config.Parse([]byte("engines: [{id: e, model: m}]\nmodels: [{id: m, buckets: [{id: a, groups: {plain: {}}}]}]\n"))
	require.NoError(t, err)
	r, err := config.New(cfg, nil, config.WithObserver(p), config.WithHealthInterval(0))
	require.NoError(t, err)
	defer r.Close()
	_, err = config.New(cfg, nil, config.WithObserver(p), config.WithHealthInterval(0))
	assert.ErrorIs(t, err, state.ErrInvalidConfiguration, "a second Router on the same Prometheus")
}

// TestSelectTimingIsSampled checks that selection_duration_seconds observes a random sample of
// selections, one in Options.SelectTimingEvery (8 when zero), while
// selections_total and selection_failures_total count every one, and that a dispatch of an untimed
// selection still gets its end-to-end duration.
func TestSelectTimingIsSampled(t *testing.T) {
	t.Parallel()
	const yaml = "engines: [{id: e0, model: m}, {id: e1, model: m}]\nmodels: [{id: m, buckets: [{id: a, groups: {plain: {}}}]}]\n"
	for _, tc := range []struct {
		every, selects int
		lo, hi         float64 // bounds on the histogram's count: more than 6 standard deviations wide
	}{
		{1, 500, 500, 500},
		{0, 4000, 350, 650},  // the default, 8: mean 500, σ ≈ 21
		{4, 4000, 850, 1150}, // mean 1000, σ ≈ 27
	} {
		f := newFixtureWith(t, yaml, metrics.Options{SelectTimingEvery: tc.every})
		ctx := context.Background()
		for i := range tc.selects {
			d, err := f.r.Select(ctx, &bucket.Request{Model: "m", Signals: bucket.Signals{InputTokens: 4}})
			require.NoError(t, err)
			f.advance(time.Second)
			if i%2 == 0 {
				d.Done(enginepick.Outcome{})
			} else {
				d.Release()
			}
		}
		_, err := f.r.Select(ctx, &bucket.Request{Model: "nope"})
		require.Error(t, err)
		got := scrape(t, f.reg)
		timed := counts(got["selection_duration_seconds"])["{model_id=m}"]
		assert.GreaterOrEqual(t, timed, tc.lo, "every=%d", tc.every)
		assert.LessOrEqual(t, timed, tc.hi, "every=%d", tc.every)
		assert.Equal(t, float64(tc.selects), got["selections_total"]["{bucket=a,model_id=m}"], "every=%d: every selection counted", tc.every)
		assert.Equal(t, 1.0, got["selection_failures_total"]["{model_id=,reason=unknown_model}"], "every=%d: every failure counted", tc.every)
		var e2e float64
		for k, v := range got["request_duration_seconds"] {
			if strings.HasPrefix(k, "_sum") {
				e2e += v
			}
		}
		assert.Equal(t, float64(tc.selects/2), e2e, "every=%d: each Done dispatch lasted one second of the manual clock", tc.every)
	}
}

// TestEveryCacheDecisionIsCounted checks that each decision label policy.CacheAware produces
// (docs/design.md §9.8) has its own cache_aware_decisions_total series, so that the labels sum to
// the cache-aware picks of decisions_total (§15.3), and that the cost comparison's reason is a
// pre-resolved decisions_total series (counted without building a series on the request path).
// cost_diverted went uncounted before.
func TestEveryCacheDecisionIsCounted(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	p, err := metrics.New(reg, metrics.Options{})
	require.NoError(t, err)
	po := p.ObserveGroup(enginepick.GroupInfo{Model: "m", Bucket: "a", Stage: state.StagePlain, Policy: label.CacheAware})
	decisions := map[string]string{ // decision label → the pick's reason
		label.DecisionCacheHit:          label.ReasonCacheCandidate,
		label.DecisionCacheMiss:         label.ReasonNoCacheCandidate,
		label.DecisionCacheWorkerQueued: label.ReasonNoCacheCandidate,
		label.DecisionAllQueued:         label.ReasonSaturationPin,
		label.DecisionCostDiverted:      label.ReasonCostDiverted,
	}
	for d, reason := range decisions {
		p.(policy.CacheObserver).ObserveCacheDecision(&policy.CacheDecision{Model: "m", Decision: d, Reason: reason})
		po.ObservePick(policy.Pick{Reason: reason}, nil)
	}
	got := scrape(t, reg)
	var byDecision, picks float64
	for d := range decisions {
		assert.Equal(t, 1.0, got["cache_aware_decisions_total"]["{decision="+d+",model_id=m}"], d)
		byDecision += got["cache_aware_decisions_total"]["{decision="+d+",model_id=m}"]
	}
	for _, v := range got["decisions_total"] {
		picks += v
	}
	assert.Equal(t, picks, byDecision, "the decision labels sum to the cache-aware picks")
	assert.Contains(t, got["decisions_total"], "{bucket=a,model_id=m,policy=cache_aware,reason=cost_diverted,stage=plain}")
}

// TestAffinityStoreMetrics checks the in-memory affinity store's families: affinity_bindings is
// the bindings it holds and affinity_evicted_bindings_total the live ones its cap evicted, so with
// a manual clock (nothing expires) the two sum to the distinct sessions bound; a Router without an
// affinity store reports neither.
func TestAffinityStoreMetrics(t *testing.T) {
	t.Parallel()
	const sessions = 200
	f := newFixture(t, "affinity: {store: memory, max_bindings: 16}\nengines: [{id: e0, model: m}, {id: e1, model: m}]\n"+
		"models: [{id: m, buckets: [{id: a, groups: {plain: {policy: {type: session_aware}}}}]}]\n")
	ctx := context.Background()
	for i := range 2 * sessions { // each session twice: the second finds its binding
		d, err := f.r.Select(ctx, &bucket.Request{Model: "m", SessionKey: fmt.Sprintf("s%d", i%sessions), Signals: bucket.Signals{InputTokens: 4}})
		require.NoError(t, err)
		d.Release()
	}
	got := scrape(t, f.reg)
	held, evicted := got["affinity_bindings"]["{}"], got["affinity_evicted_bindings_total"]["{}"]
	assert.LessOrEqual(t, held, 16.0, "within the cap (one per shard)")
	assert.Positive(t, held)
	assert.Equal(t, float64(2*sessions), held+evicted, "every binding is held or was evicted: each session bound twice, evicted in between")

	plain := scrape(t, newFixture(t, "engines: [{id: e0, model: m}]\nmodels: [{id: m, buckets: [{id: a, groups: {plain: {}}}]}]\n").reg)
	assert.NotContains(t, plain, "affinity_bindings")
	assert.NotContains(t, plain, "affinity_evicted_bindings_total")
}

// TestConcurrentObservation runs picks, outcomes and scrapes at once (for -race).
func TestConcurrentObservation(t *testing.T) {
	t.Parallel()
	f := newFixture(t, scriptConfig)
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			for i := range 300 {
				model := []string{"m", "pd", "nope"}[(w+i)%3]
				d, err := f.r.Select(context.Background(), &bucket.Request{Model: state.ModelID(model), TokenIDs: []uint32{1, 2, 3, 4},
					Signals: bucket.Signals{InputTokens: 4}})
				if err == nil {
					d.Done(enginepick.Outcome{TTFT: time.Millisecond, PromptTokens: 4})
				}
			}
		})
	}
	wg.Go(func() {
		for range 50 {
			_, err := f.reg.Gather()
			assert.NoError(t, err)
		}
	})
	wg.Wait()
	got := scrape(t, f.reg)
	var sel float64
	for _, v := range counts(got["selection_duration_seconds"]) {
		sel += v
	}
	assert.Equal(t, 1200.0, sel)
	keys := make([]string, 0)
	for k := range got {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	assert.Contains(t, keys, "inflight_requests")
}

// TestReplicaMetrics checks the replica_* families of a Router with a replicas block: the broker
// state, the deltas sent and received, and one dropped series per reason (a bounded set). Without
// a reachable broker the Router reports the broker down and routes on its own view.
func TestReplicaMetrics(t *testing.T) {
	t.Parallel()
	const fleet = "engines: [{id: e1, model: m}, {id: e2, model: m}]\nmodels: [{id: m, buckets: [{id: a, groups: {plain: {}}}]}]\n"
	down := newFixture(t, fleet+"replicas: {redis: {addr: '127.0.0.1:1'}}\n")
	d, err := down.r.Select(context.Background(), &bucket.Request{Model: "m", Signals: bucket.Signals{InputTokens: 4}})
	require.NoError(t, err, "an unreachable broker fails no request")
	d.Release()
	got := scrape(t, down.reg)
	assert.Equal(t, map[string]float64{"{}": 0}, got["replica_broker_up"])
	assert.Equal(t, map[string]float64{"{}": 0}, got["replica_peers"])
	assert.NotContains(t, scrape(t, newFixture(t, fleet).reg), "replica_broker_up", "no replicas block, no replica metrics")

	addr := os.Getenv("ENGINEPICK_REDIS_ADDR")
	if addr == "" {
		msg := "ENGINEPICK_REDIS_ADDR not set: no redis-server for the replicas (start one with .ci/redis.sh start)"
		if os.Getenv("ENGINEPICK_REQUIRE_SERVERS") == "1" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	block := fmt.Sprintf("replicas: {redis: {addr: %q}, channel: 'enginepick:test:%d'}\n", addr, time.Now().UnixNano())
	a, b := newFixture(t, fleet+block), newFixture(t, fleet+block)
	require.Eventually(t, func() bool {
		return scrape(t, a.reg)["replica_broker_up"]["{}"] == 1 && scrape(t, b.reg)["replica_broker_up"]["{}"] == 1
	}, 5*time.Second, time.Millisecond, "both subscribed")
	require.Eventually(t, func() bool {
		b.r.InFlight().Acquire("e1", -1, 0).Release() // until one pair reaches a
		return scrape(t, a.reg)["replica_deltas_received_total"]["{}"] >= 2
	}, 5*time.Second, 2*time.Millisecond, "b's deltas reach a")
	a.r.InFlight().Acquire("e2", -1, 0).Release()
	require.Eventually(t, func() bool { return scrape(t, a.reg)["replica_deltas_sent_total"]["{}"] == 2 }, 5*time.Second, time.Millisecond)
	assert.Equal(t, map[string]float64{"{}": 1}, scrape(t, a.reg)["replica_peers"])

	fams, err := a.reg.Gather()
	require.NoError(t, err)
	var reasons []string
	for _, f := range fams {
		if f.GetName() == "enginepick_replica_deltas_dropped_total" {
			for _, m := range f.GetMetric() {
				reasons = append(reasons, m.GetLabel()[0].GetValue())
			}
		}
	}
	assert.ElementsMatch(t, []string{"duplicate", "unknown_engine", "unknown_dispatch", "refused_placement", "malformed", "unpublished"}, reasons)
}
