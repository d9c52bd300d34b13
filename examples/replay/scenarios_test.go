package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/sim"
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

func TestRunRejectsBadScenarioFlags(t *testing.T) {
	for _, args := range [][]string{
		{"-system-prompt", "-1"},
		{"-system-prompt", "10000001"},
		{"-routers", "0"},
		{"-routers", "65"},
		{"-prefill-model", "quadratic"},
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
