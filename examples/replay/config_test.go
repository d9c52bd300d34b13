package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/config"
	"github.com/enginepick/enginepick/internal/sim"
)

// TestRunConfigReplaysEveryExampleConfig replays each file under examples/configs with -config:
// the same files New builds production routers from (TestExampleConfigs) describe the replayed
// fleet. Each report has one row named after the file, over exactly the file's engines of the
// model, and every request is accounted for.
func TestRunConfigReplaysEveryExampleConfig(t *testing.T) {
	files, err := filepath.Glob("../configs/*")
	require.NoError(t, err)
	require.Len(t, files, 5, "the example configurations")
	want := map[string]sim.Fleet{
		"flow-control.yaml":       {Plain: 2},
		"plain-round-robin.yaml":  {Plain: 4},
		"pd-cache-aware.yaml":     {Prefill: 4, Decode: 4},
		"length-buckets-slo.json": {},
		"sessions-redis.yaml":     {Plain: 3},
	}
	for _, f := range files {
		base := filepath.Base(f)
		t.Run(base, func(t *testing.T) {
			fleet, ok := want[base]
			require.True(t, ok, "add %s to the test", base)
			cfg, err := config.Load(f)
			require.NoError(t, err)
			if fleet == (sim.Fleet{}) { // count the first model's engines from the file
				for _, e := range cfg.Engines {
					if e.Model == cfg.Models[0].ID {
						fleet.Plain++
					}
				}
			}
			var out, stderr bytes.Buffer
			require.NoError(t, run(context.Background(), []string{"-config", f, "-limit", "120", "-json"}, &out, &stderr, false), stderr.String())
			var rep sim.Report
			require.NoError(t, json.Unmarshal(out.Bytes(), &rep))
			assert.Equal(t, fleet, rep.Fleet)
			require.Len(t, rep.Results, 1)
			r := rep.Results[0]
			assert.Equal(t, base[:len(base)-len(filepath.Ext(base))], r.Policy)
			assert.Equal(t, 120, r.Completed+r.Rejected+r.Shed+r.Unroutable)
			assert.Equal(t, base == "flow-control.yaml", rep.FlowControl, "the file's flow_control block")
			if rep.FlowControl {
				assert.Equal(t, 120, r.Completed, "what the caps turn away waits in the router")
			}
			assert.Positive(t, r.Completed)
			assert.Len(t, r.EngineRequests, fleet.Plain+fleet.Prefill)
		})
	}
}

// TestRunConfigModelAndTable checks -model (the sessions file's second model, sticky over
// least_load) and the table output.
func TestRunConfigModelAndTable(t *testing.T) {
	var out, stderr bytes.Buffer
	require.NoError(t, run(context.Background(), []string{"-config", "../configs/sessions-redis.yaml", "-model", "tenant-lora",
		"-limit", "100", "-routers", "2"}, &out, &stderr, false))
	assert.Contains(t, out.String(), "fleet 2 plain")
	assert.Contains(t, out.String(), "sessions-redis/tenant-lora")
	assert.Contains(t, stderr.String(), "replayed 100 requests × 1 policies")
}

// TestRunConfigRejects checks the command-line mistakes of -config: exit status 2, one message.
func TestRunConfigRejects(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.yaml")
	require.NoError(t, os.WriteFile(bad, []byte("models: [{id: m, buckets: [{id: b, groups: {plain: {policy: {type: fused_score}}}}]}]\n"), 0o644))
	cfg := "../configs/plain-round-robin.yaml"
	for _, tc := range []struct {
		name string
		args []string
		msg  string
	}{
		{"with_engines", []string{"-config", cfg, "-engines", "3"}, "-config and -engines are exclusive: the file describes the fleet, its policies and admission"},
		{"with_policies_and_admission", []string{"-config", cfg, "-policies", "random", "-admission", "{}"},
			"-config and -admission, -policies are exclusive: the file describes the fleet, its policies and admission"},
		{"model_alone", []string{"-model", "m"}, "-model needs -config"},
		{"removed_option", []string{"-config", bad}, "-config " + bad + `: config: line 1: models[0].buckets[0].groups.plain.policy.type: policy type "fused_score" was removed: use cache_aware, which weighs prefix hits against load, instead`},
		{"missing_file", []string{"-config", filepath.Join(dir, "none.yaml")}, ""},
		{"unknown_model", []string{"-config", cfg, "-model", "gpt"}, `sim: Config.Routing.Model "gpt" is not a model of the configuration: invalid configuration`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out, stderr bytes.Buffer
			err := run(context.Background(), append(tc.args, "-limit", "10"), &out, &stderr, false)
			require.Error(t, err)
			assert.Equal(t, 2, exitCode(err, &stderr))
			if tc.msg != "" {
				assert.Equal(t, "replay: "+tc.msg+"\n", stderr.String())
			}
			assert.Empty(t, out.String())
		})
	}
}

// TestRunConfigBlockTokens: the replayed engines' KV blocks are the file's kv.block_tokens, and
// config.New's block size when the file omits it.
func TestRunConfigBlockTokens(t *testing.T) {
	dir := t.TempDir()
	const fleet = "engines: [{id: e1, model: m}, {id: e2, model: m}]\nmodels: [{id: m, buckets: [{id: b, groups: {plain: {policy: {type: cache_aware}}}}]}]\n"
	for _, tc := range []struct {
		name, kv string
		want     int // 0: the block size of the Router config.New builds from the file
	}{
		{"unset", "", 0},
		{"set", "kv: {block_tokens: 64}\n", 64},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := filepath.Join(dir, tc.name+".yaml")
			require.NoError(t, os.WriteFile(f, []byte(tc.kv+fleet), 0o644))
			want := tc.want
			if want == 0 {
				cfg, err := config.Load(f)
				require.NoError(t, err)
				r, err := config.New(cfg, nil, config.WithHealthInterval(0))
				require.NoError(t, err)
				require.NoError(t, r.Close())
				require.NotNil(t, r.Index(), "cache_aware looks prefixes up locally")
				want = r.Index().Hasher().BlockTokens()
				require.Equal(t, 16, want, "the guide's default")
			}
			var out, stderr bytes.Buffer
			require.NoError(t, run(context.Background(), []string{"-config", f, "-limit", "20", "-json"}, &out, &stderr, false), stderr.String())
			var rep sim.Report
			require.NoError(t, json.Unmarshal(out.Bytes(), &rep))
			assert.Equal(t, want, rep.Model.BlockTokens)
		})
	}
}
