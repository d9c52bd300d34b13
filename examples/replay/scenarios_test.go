package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/internal/sim"
)

func TestRunSystemPromptAndRouters(t *testing.T) {
	args := []string{"-limit", "120", "-engines", "4", "-policies", "dynamo,llmd,sglang_legacy", "-system-prompt", "2048",
		"-routers", "2", "-json"}
	var out, stderr bytes.Buffer
	require.NoError(t, run(context.Background(), args, &out, &stderr, false))
	var rep sim.Report
	require.NoError(t, json.Unmarshal(out.Bytes(), &rep))
	assert.Equal(t, 2048, rep.SystemPromptTokens)
	assert.Equal(t, 2, rep.Routers)
	require.Len(t, rep.Results, 3)
	for _, r := range rep.Results {
		assert.Equal(t, 120, r.Completed, r.Policy)
		assert.Positive(t, r.CachedTokens, "%s: the shared prompt is reused", r.Policy)
	}
}

func TestRunSpreadArrivals(t *testing.T) {
	for _, spread := range []bool{false, true} {
		args := []string{"-limit", "60", "-engines", "2", "-policies", "round_robin", "-json"}
		if spread {
			args = append(args, "-spread-arrivals")
		}
		var out, stderr bytes.Buffer
		require.NoError(t, run(context.Background(), args, &out, &stderr, false))
		var rep sim.Report
		require.NoError(t, json.Unmarshal(out.Bytes(), &rep))
		assert.Equal(t, spread, rep.SpreadArrivals)
		// The embedded trace's timestamps are whole seconds, so its span at -speed 4 is a multiple
		// of 0.25 s unless the arrivals are spread.
		quarters := rep.Span * 4
		assert.Equal(t, !spread, quarters == float64(int(quarters)), "span %v s", rep.Span)
	}
}

func TestRunRejectsBadScenarioFlags(t *testing.T) {
	for _, args := range [][]string{
		{"-system-prompt", "-1"},
		{"-system-prompt", "10000001"},
		{"-routers", "0"},
		{"-routers", "65"},
		{"-prefill-model", "quadratic"},
		{"-reports", "vllm"},
		{"-sweep", "-slo", "0s"},
		{"-sweep", "-plot", "/tmp/x"},
	} {
		var out, stderr bytes.Buffer
		err := run(context.Background(), args, &out, &stderr, false)
		var ue *usageError
		assert.True(t, errors.As(err, &ue), "%v: %v is not a usage error", args, err)
		assert.Equal(t, 2, exitCode(err, &stderr), "%v", args)
		assert.Empty(t, out.String())
	}
}

func TestRunPrefillModel(t *testing.T) {
	for _, pm := range []sim.PrefillModel{sim.PrefillAttention, sim.PrefillFlat} {
		var out, stderr bytes.Buffer
		require.NoError(t, run(context.Background(), []string{"-limit", "60", "-engines", "2", "-policies", "round_robin",
			"-prefill-model", string(pm), "-json"}, &out, &stderr, false))
		var rep sim.Report
		require.NoError(t, json.Unmarshal(out.Bytes(), &rep))
		assert.Equal(t, pm, rep.Model.PrefillModel)
	}
}

func TestRunReports(t *testing.T) {
	for _, r := range []sim.LoadReports{sim.ReportsNative, sim.ReportsBasic} {
		var out, stderr bytes.Buffer
		require.NoError(t, run(context.Background(), []string{"-limit", "60", "-engines", "2", "-policies", "power_of_two",
			"-reports", string(r)}, &out, &stderr, false))
		if r == sim.ReportsBasic {
			assert.Contains(t, out.String(), "seed 1, basic load reports (running and waiting only)\n")
		} else {
			assert.Contains(t, out.String(), "seed 1\n", "native, the default, is not named")
		}
	}
}

func TestRunSweep(t *testing.T) {
	var out, stderr bytes.Buffer
	args := []string{"-sweep", "-slo", "20s", "-limit", "200", "-engines", "4", "-speed", "1", "-policies", "round_robin,dynamo"}
	require.NoError(t, run(context.Background(), args, &out, &stderr, false))
	assert.Contains(t, out.String(), "highest speed with TTFT p99 <= 20 s")
	assert.Contains(t, out.String(), "dynamo")
	assert.Contains(t, stderr.String(), "swept 2 policies over 200 requests")

	out.Reset()
	require.NoError(t, run(context.Background(), append(args, "-json"), &out, &stderr, false))
	var rep sim.SweepReport
	require.NoError(t, json.Unmarshal(out.Bytes(), &rep))
	require.Len(t, rep.Results, 2)
	assert.Equal(t, 200, rep.Requests)
	for _, r := range rep.Results {
		assert.Positive(t, r.Speed, r.Policy)
	}
}

// TestRunWorkloads replays a short run of each generated workload: the trace named by its
// canonical spec and seed, -speed 1 by default, 16-token KV blocks, every request served.
func TestRunWorkloads(t *testing.T) {
	for _, tc := range []struct{ spec, name string }{
		{"chats:conversations=40,turns=4", "chats:conversations=40,turns=4,rate=45,think=5s,shared-system=false (seed 1)"},
		{"prefix-groups:requests=80", "prefix-groups:groups=150,prompts=5,prefix=6000,question=1200,output=1000,requests=80,rate=20 (seed 1)"},
		{"tenants:duration=5s", "tenants:tenants=4,rate=25,heavy=10,critical=0.7,duration=5s (seed 1)"},
		{"lora:adapters=8,requests=100", "lora:adapters=8,zipf=1,base=0,requests=100,rate=70 (seed 1)"},
	} {
		t.Run(tc.spec, func(t *testing.T) {
			var out, stderr bytes.Buffer
			args := []string{"-workload", tc.spec, "-limit", "60", "-engines", "4", "-policies", "round_robin,cache_aware", "-json"}
			require.NoError(t, run(context.Background(), args, &out, &stderr, false))
			var rep sim.Report
			require.NoError(t, json.Unmarshal(out.Bytes(), &rep))
			assert.Equal(t, tc.name, rep.Trace)
			assert.Equal(t, 60, rep.Requests)
			assert.Equal(t, 1.0, rep.Speed)
			assert.Equal(t, sim.WorkloadBlockTokens, rep.Model.BlockTokens)
			assert.Positive(t, rep.InfiniteCacheHitRate)
			require.Len(t, rep.Results, 2)
			tenants := strings.HasPrefix(tc.spec, sim.WorkloadTenants)
			lora := strings.HasPrefix(tc.spec, sim.WorkloadLoRA)
			assert.Equal(t, lora, rep.Adapters > 0, "adapters for the lora workload only")
			for _, r := range rep.Results {
				assert.Equal(t, 60, r.Completed, r.Policy)
				assert.Equal(t, tenants, r.Bands != nil, "per-band results for the tenants workload only")
				assert.Equal(t, lora, r.AdapterLoads > 0, "adapter loads for the lora workload only")
			}

			out.Reset()
			require.NoError(t, run(context.Background(), args[:len(args)-1], &out, &stderr, false))
			assert.Contains(t, out.String(), "trace "+tc.name+": 60 requests")
			assert.Contains(t, out.String(), "in 16-token blocks")
			assert.Equal(t, tenants, strings.Contains(out.String(), "\nper priority band and tenant"), "the second table")
			assert.Equal(t, lora, strings.Contains(out.String(), "hit rate  loads/1k  TTFT p50"), "the adapter loads column")
		})
	}
}

// TestRunWorkloadSeed: -workload-seed defaults to -seed, and another seed is another trace;
// -speed still applies.
func TestRunWorkloadSeed(t *testing.T) {
	replay := func(args ...string) sim.Report {
		t.Helper()
		var out, stderr bytes.Buffer
		args = append([]string{"-workload", "chats:conversations=20,turns=2", "-engines", "2", "-policies", "round_robin", "-json"}, args...)
		require.NoError(t, run(context.Background(), args, &out, &stderr, false))
		var rep sim.Report
		require.NoError(t, json.Unmarshal(out.Bytes(), &rep))
		return rep
	}
	bySeed := replay("-seed", "5")
	explicit := replay("-seed", "5", "-workload-seed", "5")
	assert.Equal(t, bySeed, explicit)
	assert.Contains(t, bySeed.Trace, "(seed 5)")
	other := replay("-seed", "5", "-workload-seed", "6")
	assert.Contains(t, other.Trace, "(seed 6)")
	assert.NotEqual(t, bySeed.Results[0].PromptTokens, other.Results[0].PromptTokens)
	assert.Equal(t, 2.5, replay("-speed", "2.5").Speed)
}

// TestRunWorkloadWithConfig: a -config file keeps its own KV block size under -workload.
// TestRunFlowControl: -flow-control queues in the router what the in-flight caps turn away: the
// requests the caps reject without it are served, the heading says so and the table counts shed
// requests; with a -config file, the file's flow_control block decides.
func TestRunFlowControl(t *testing.T) {
	args := []string{"-workload", "tenants:rate=84,duration=1s", "-policies", "round_robin", "-admission", `{"max_inflight_requests": 8}`}
	var out, stderr bytes.Buffer
	require.NoError(t, run(context.Background(), append(args, "-json"), &out, &stderr, false))
	var off, on sim.Report
	require.NoError(t, json.Unmarshal(out.Bytes(), &off))
	out.Reset()
	require.NoError(t, run(context.Background(), append(args, "-json", "-flow-control"), &out, &stderr, false))
	require.NoError(t, json.Unmarshal(out.Bytes(), &on))
	assert.False(t, off.FlowControl)
	assert.True(t, on.FlowControl)
	assert.Positive(t, off.Results[0].Rejected)
	assert.Zero(t, on.Results[0].Rejected)
	assert.Equal(t, on.Requests, on.Results[0].Completed+on.Results[0].Shed)
	assert.Greater(t, on.Results[0].Completed, off.Results[0].Completed)

	out.Reset()
	require.NoError(t, run(context.Background(), append(args, "-flow-control"), &out, &stderr, false))
	assert.Contains(t, out.String(), ", flow control\n")
	assert.Contains(t, out.String(), "rejected  shed  too long")

	out.Reset()
	require.NoError(t, run(context.Background(), append(args, "-flow-control", "-engine-priority", "-json"), &out, &stderr, false))
	var prio sim.Report
	require.NoError(t, json.Unmarshal(out.Bytes(), &prio))
	assert.True(t, prio.Model.PriorityScheduling, "-engine-priority")
	assert.False(t, on.Model.PriorityScheduling)

	out.Reset()
	stderr.Reset()
	err := run(context.Background(), []string{"-config", "../configs/plain-round-robin.yaml", "-flow-control"}, &out, &stderr, false)
	assert.Equal(t, 2, exitCode(err, &stderr))
	assert.Contains(t, stderr.String(), "the file's flow_control block configures flow control")
}

// TestRunWorkloadWithConfig: -workload with -config replays the file's kv.block_tokens, not the
// workload's default block size.
func TestRunWorkloadWithConfig(t *testing.T) {
	raw, err := os.ReadFile("../configs/plain-round-robin.yaml")
	require.NoError(t, err)
	f := filepath.Join(t.TempDir(), "blocks.yaml")
	require.NoError(t, os.WriteFile(f, append([]byte("kv: {block_tokens: 64}\n"), raw...), 0o644))
	var out, stderr bytes.Buffer
	require.NoError(t, run(context.Background(), []string{"-config", f, "-workload",
		"prefix-groups:requests=30", "-json"}, &out, &stderr, false))
	var rep sim.Report
	require.NoError(t, json.Unmarshal(out.Bytes(), &rep))
	assert.Equal(t, 30, rep.Requests)
	assert.Equal(t, 64, rep.Model.BlockTokens, "the file's kv.block_tokens, not the workload's")
}

func TestRunRejectsBadWorkloadFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		msg  string
	}{
		{[]string{"-workload", "chats:turns=0"}, `replay: sim: workload "chats:turns=0": turns="0": must be >= 1 (omit it for the default): invalid configuration`},
		{[]string{"-workload", "sessions"}, `unknown workload "sessions" (known: chats, prefix-groups, tenants, lora)`},
		{[]string{"-workload", "chats:rate=1e-9"}, "passes MaxArrival"},
		{[]string{"-workload", "chats", "-trace", "x.jsonl"}, "replay: -trace and -workload are exclusive"},
		{[]string{"-workload-seed", "3"}, "replay: -workload-seed needs -workload"},
	} {
		var out, stderr bytes.Buffer
		err := run(context.Background(), tc.args, &out, &stderr, false)
		var ue *usageError
		require.True(t, errors.As(err, &ue), "%v: %v is not a usage error", tc.args, err)
		assert.Equal(t, 2, exitCode(err, &stderr), "%v", tc.args)
		assert.Contains(t, stderr.String(), tc.msg, "%v", tc.args)
		assert.Equal(t, 1, strings.Count(stderr.String(), "\n"), "one line: %q", stderr.String())
		assert.Empty(t, out.String())
	}
}
