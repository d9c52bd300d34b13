package sim

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/config"
	"github.com/enginepick/enginepick/flowcontrol"
	"github.com/enginepick/enginepick/state"
)

// flowCap is the in-flight cap the flow-control replays pair with flow control: the engines'
// running batch (EngineModel.MaxRunningRequests), so that the router, not the engines' queues,
// holds what the fleet cannot run.
const flowCap = DefaultMaxRunningRequests

// tenantsConfig is a replay of the tenants workload spec on 16 engines under round_robin, with
// flow control and the in-flight cap when fc is set.
func tenantsConfig(t *testing.T, spec string, fc bool) Config {
	t.Helper()
	w, err := ParseWorkload(spec)
	require.NoError(t, err)
	tr, err := w.Generate(1)
	require.NoError(t, err)
	cfg := Config{Trace: tr, Fleet: Fleet{Plain: 16}, Seed: 1, Model: EngineModel{BlockTokens: WorkloadBlockTokens},
		Policies: []string{NameRoundRobin}}
	if fc {
		cfg.FlowControl = &flowcontrol.Config{}
		cfg.Admission = admission.Limits{MaxInFlightRequests: admission.Cap(flowCap)}
	}
	return cfg
}

// accounted checks that every request of a run ended once: completed, or refused with a typed
// error (503, 429, 400), in total and per tenant.
func accounted(t *testing.T, rep *Report) {
	t.Helper()
	for _, r := range rep.Results {
		assert.Equal(t, rep.Requests, r.Completed+r.Rejected+r.Shed+r.Unroutable, "%s: every request ends once", r.Policy)
		sum := 0
		for _, x := range r.Tenants {
			sum += x.Requests
		}
		assert.Equal(t, rep.Requests, sum, r.Policy)
	}
}

// tenant returns the result of a tenant of band 0, or of the critical tenant.
func tenant(t *testing.T, r PolicyResult, name string) TenantResult {
	t.Helper()
	for _, x := range r.Tenants {
		if x.Tenant == name {
			return x
		}
	}
	require.Failf(t, "no tenant", "%s", name)
	return TenantResult{}
}

// TestFlowControlReplay: a replay with flow control queues what the capped fleet cannot run in
// each router replica's Controller on the virtual clock: the requests the caps turn away wait
// instead of failing with 503, every request ends once, the report says so, and the replay is
// deterministic.
func TestFlowControlReplay(t *testing.T) {
	t.Parallel()
	cfg := tenantsConfig(t, "tenants:rate=84,duration=2s", true)
	cfg.Admission = admission.Limits{MaxInFlightRequests: admission.Cap(16)}
	off := cfg
	off.FlowControl = nil
	offRep := replayLogged(t, off)
	require.Positive(t, offRep.Results[0].Rejected, "the caps turn requests away")
	for _, variant := range []string{"one router", "two routers", "PD 8:8"} {
		switch variant {
		case "two routers":
			cfg.Routers = 2
		case "PD 8:8":
			cfg.Routers, cfg.Fleet = 1, Fleet{Prefill: 8, Decode: 8}
		}
		rep := replayLogged(t, cfg)
		accounted(t, rep)
		r := rep.Results[0]
		assert.Zero(t, r.Rejected, "no wait times out: no TTL")
		assert.Equal(t, rep.Requests, r.Completed+r.Shed)
		assert.Greater(t, r.Completed, offRep.Results[0].Completed, variant)
		assert.Greater(t, r.TTFT.P99, 1.0, "TTFT counts the wait in the router")

		again, err := Replay(context.Background(), cfg)
		require.NoError(t, err)
		var a, b bytes.Buffer
		require.NoError(t, rep.WriteJSON(&a))
		require.NoError(t, again.WriteJSON(&b))
		assert.Equal(t, a.String(), b.String(), "deterministic")

		var table bytes.Buffer
		require.NoError(t, rep.WriteTable(&table))
		assert.Contains(t, table.String(), ", flow control\n")
		assert.Contains(t, table.String(), "rejected  shed  too long")
	}
}

func TestFlowControlConfig(t *testing.T) {
	t.Parallel()
	tr := generate(t, Tenants{Rate: 1, Heavy: 1, Critical: 1, Duration: 10 * time.Second}, 1)
	base := Config{Trace: tr, Fleet: Fleet{Plain: 2}, FlowControl: &flowcontrol.Config{}}
	rc, err := base.resolve()
	require.NoError(t, err)
	assert.Equal(t, []flowcontrol.Band{{Priority: 0}, {Priority: CriticalPriority}}, rc.flowControl.Bands,
		"one band per priority of the requests")
	assert.Nil(t, base.FlowControl.Bands, "the caller's Config is not changed")

	for name, cfg := range map[string]Config{
		"invalid flow control": {Trace: tr, Fleet: Fleet{Plain: 2}, FlowControl: &flowcontrol.Config{MaxQueued: -1}},
		"with routing":         {Trace: tr, FlowControl: &flowcontrol.Config{}, Routing: &Routing{Config: &config.Config{}}},
	} {
		_, err := Replay(context.Background(), cfg)
		assert.ErrorIs(t, err, state.ErrInvalidConfiguration, name)
	}
}

// TestFlowControlTargets measures flow control on the tenants workload, 16 engines, one seed,
// 20 s of arrivals, flow control on (with an in-flight cap of 256, the engines' running batch)
// against off (no cap), the same arrivals (docs/performance.md "Flow control at saturation"):
//
//   - at 1.5 × capacity (rate=84: the heavy tenant sends 10 × each other tenant), latencies of
//     the requests arriving after the first 10 s (Config.Warmup: the fleet has filled): the
//     critical band's TTFT p99 is at most 2 × its p99 alone on the fleet (flow control off); each
//     light tenant's TTFT p99 is at most 1.2 × its p99 without the heavy tenant (off) and lower
//     than with flow control off; the light tenants are served in full (only the heavy tenant's
//     requests are shed) and band 0's Jain index is at least 0.95; output throughput is at least
//     98 % of flow control off; under cache_aware, the same latency targets, Jain index and
//     throughput;
//   - below capacity (the default rates), every request: TTFT p50 and p99 no more than 2 % above
//     flow control off, the hit rate no more than 2 % below (a lower band skipping an engine that
//     is still prefilling may only make them better);
//   - every request ends once, completed or with a typed error.
//
// Skipped under -race (single-goroutine replays); .ci/run runs it without.
func TestFlowControlTargets(t *testing.T) {
	if raceEnabled {
		t.Skip("sim: TestFlowControlTargets replays on one goroutine; .ci/run runs it without -race")
	}
	if testing.Short() {
		t.Skip("sim: TestFlowControlTargets replays 20 s of the tenants workload 9 times")
	}
	run := func(policy, spec string, fc bool, warmup time.Duration) PolicyResult {
		cfg := tenantsConfig(t, spec+"duration=20s", fc)
		cfg.Policies, cfg.Warmup = []string{policy}, warmup
		rep := replayLogged(t, cfg)
		accounted(t, rep)
		return rep.Results[0]
	}
	light := []string{"tenant-1", "tenant-2", "tenant-3"}

	// cache_aware takes admission's refusals at pick time: a request whose holders are at their
	// cap, or held off prefilling engines, goes to the cheapest engine with room.
	for _, policy := range []string{NameRoundRobin, NameCacheAware} {
		t.Run("1.5 x capacity, "+policy, func(t *testing.T) {
			const warmup = 10 * time.Second
			off, on := run(policy, "tenants:rate=84,", false, warmup), run(policy, "tenants:rate=84,", true, warmup)
			alone := run(policy, "tenants:rate=84,tenants=1,heavy=0,", false, warmup)
			absent := run(policy, "tenants:rate=84,heavy=0,", false, warmup)
			assert.Zero(t, off.Shed+off.Rejected)
			require.Equal(t, CriticalPriority, on.Bands[0].Priority)
			// The top band's last slot of each engine: its requests find engines with room.
			assert.LessOrEqual(t, on.Bands[0].TTFT.P99, 2*tenant(t, alone, CriticalTenant).TTFT.P99, "critical band")
			for _, name := range light {
				x, y := tenant(t, off, name), tenant(t, on, name)
				assert.Equal(t, y.Requests, y.Completed, "%s: served in full", name)
				assert.Less(t, y.TTFT.P99, x.TTFT.P99/5, name)
				assert.LessOrEqual(t, y.TTFT.P99, 1.2*tenant(t, absent, name).TTFT.P99, "%s: heavy tenant absent", name)
			}
			heavy := tenant(t, on, "tenant-0")
			assert.Equal(t, on.Shed, heavy.Requests-heavy.Completed, "only the heavy tenant is shed")
			assert.Positive(t, on.Shed)
			assert.GreaterOrEqual(t, on.Bands[1].Fairness, 0.95)
			assert.GreaterOrEqual(t, on.OutputTokensPerSecond, 0.98*off.OutputTokensPerSecond)
			if policy == NameRoundRobin {
				assert.Less(t, off.Bands[1].Fairness, 0.95)
			}
		})
	}
	t.Run("below capacity", func(t *testing.T) {
		off, on := run(NameRoundRobin, "tenants:", false, 0), run(NameRoundRobin, "tenants:", true, 0)
		assert.LessOrEqual(t, on.TTFT.P50, 1.02*off.TTFT.P50, "TTFT p50")
		assert.LessOrEqual(t, on.TTFT.P99, 1.02*off.TTFT.P99, "TTFT p99")
		assert.GreaterOrEqual(t, on.HitRate, 0.98*off.HitRate, "hit rate")
		assert.Zero(t, on.Shed+on.Rejected)
	})
}

// TestFlowControlFromRoutingFile: a routing file's flow_control block runs in the replay as
// Config.FlowControl does, on the virtual clock: the same bands, caps and fleet replay to the same
// figures as the built-in run.
func TestFlowControlFromRoutingFile(t *testing.T) {
	t.Parallel()
	tr := generate(t, Tenants{Rate: 20, Heavy: 10, Critical: 0.7, Duration: 2 * time.Second}, 1)
	builtIn := Config{Trace: tr, Fleet: Fleet{Plain: 4}, Seed: 1, Policies: []string{NameRoundRobin},
		Admission: admission.Limits{MaxInFlightRequests: admission.Cap(8)}, FlowControl: &flowcontrol.Config{}}
	want := replayLogged(t, builtIn)
	require.True(t, want.FlowControl)

	// kv.block_tokens: the built-in run's blocks (DefaultBlockTokens).
	yaml := "kv: {block_tokens: 512}\nengines:\n" + fleetYAML("llama-3.1-8b", "engine", "plain", 4) +
		"flow_control: {bands: [{priority: 0}, {priority: 1}]}\n" +
		"models: [{id: llama-3.1-8b, buckets: [{id: default, max_context_tokens: 131072, groups: {plain: {policy: {type: round_robin, admission: {max_inflight_requests: 8}}}}}]}]\n"
	fromFile := Config{Trace: tr, Seed: 1, Routing: &Routing{Config: parseRouting(t, yaml), Name: NameRoundRobin}}
	got := replayLogged(t, fromFile)
	assert.True(t, got.FlowControl)
	assert.Equal(t, want.Results, got.Results)
	accounted(t, got)

	fromFile.FlowControl = &flowcontrol.Config{}
	_, err := Replay(context.Background(), fromFile)
	assert.ErrorIs(t, err, ErrRoutingConflict)
}

// TestWarmup: Config.Warmup leaves the requests arriving before it out of the latency figures,
// and only those: the run, its bands and its tenants summarize exactly the later arrivals, the
// counts and throughput are the whole run's, and a warm-up that is negative or leaves no arrival
// is an invalid configuration.
func TestWarmup(t *testing.T) {
	t.Parallel()
	tr := generate(t, Tenants{Rate: 20, Heavy: 2, Critical: 1, Duration: 4 * time.Second}, 1)
	const warmup = 2 * time.Second
	later := map[string]int{}
	total := 0
	for _, r := range tr.Requests {
		if r.Arrival >= warmup {
			later[r.Tenant]++
			total++
		}
	}
	require.Positive(t, total)
	require.Less(t, total, len(tr.Requests))
	cfg := Config{Trace: tr, Fleet: Fleet{Plain: 4}, Seed: 1, Policies: []string{NameRoundRobin}}
	whole := replayLogged(t, cfg)
	cfg.Warmup = warmup
	warm := replayLogged(t, cfg)
	w, h := warm.Results[0], whole.Results[0]
	assert.Equal(t, 2.0, warm.Warmup)
	assert.Zero(t, whole.Warmup)
	assert.Equal(t, len(tr.Requests), w.Completed, "every request is replayed")
	assert.Equal(t, h.Completed, w.Completed)
	assert.Equal(t, h.OutputTokensPerSecond, w.OutputTokensPerSecond)
	assert.Equal(t, h.HitRate, w.HitRate)
	assert.Len(t, w.TTFTSamples, total)
	assert.Len(t, h.TTFTSamples, len(tr.Requests))
	for i, x := range w.Tenants {
		assert.Len(t, x.TTFTSamples, later[x.Tenant], x.Tenant)
		assert.Equal(t, h.Tenants[i].Completed, x.Completed, x.Tenant)
		assert.Equal(t, h.Tenants[i].Service, x.Service, x.Tenant)
	}
	n := 0
	for _, b := range w.Bands {
		n += len(b.TTFTSamples)
	}
	assert.Equal(t, total, n)
	var table bytes.Buffer
	require.NoError(t, warm.WriteTable(&table))
	assert.Contains(t, table.String(), ", latencies of arrivals after 2 s\n")

	for _, bad := range []time.Duration{-time.Second, tr.Requests[len(tr.Requests)-1].Arrival} {
		cfg.Warmup = bad
		_, err := Replay(context.Background(), cfg)
		assert.ErrorIs(t, err, state.ErrInvalidConfiguration, "%v", bad)
	}
}
