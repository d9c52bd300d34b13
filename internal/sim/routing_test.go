package sim

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/config"
	"github.com/enginepick/enginepick/state"
)

// parseRouting parses a YAML routing configuration.
func parseRouting(t *testing.T, yaml string) *config.Config {
	t.Helper()
	cfg, err := config.Parse([]byte(yaml))
	require.NoError(t, err)
	return cfg
}

// fleetYAML lists n engines of model m and stage st named as the built-in fleet names them.
func fleetYAML(m, prefix, st string, n int) string {
	var b strings.Builder
	for k := range n {
		fmt.Fprintf(&b, "  - {id: \"sim://%s-%d\", model: %s, stage: %s, load: {url: \"http://%s-%d/metrics\", format: vllm_metrics}}\n", prefix, k, m, st, prefix, k)
	}
	return b.String()
}

// TestReplayRoutingMatchesBuiltInFleet checks that a routing configuration describing the same
// fleet and policy as a built-in run replays to exactly the same figures: the file's engines are
// simulated as the built-in ones are, and config.New builds the same policies from the file
// (plain round_robin and cache_aware; PD with cache_aware prefill and power_of_two decode, the
// decode group of every built-in PD run). The load endpoints in the file are not dialled.
func TestReplayRoutingMatchesBuiltInFleet(t *testing.T) {
	tr, err := MooncakeConversation()
	require.NoError(t, err)
	for _, tc := range []struct {
		name   string
		fleet  Fleet
		policy string
		yaml   string
	}{
		{"plain/round_robin", Fleet{Plain: 4}, NameRoundRobin, "engines:\n" + fleetYAML("llama-3.1-8b", "engine", "plain", 4) +
			"models: [{id: llama-3.1-8b, buckets: [{id: default, max_context_tokens: 131072, groups: {plain: {policy: {type: round_robin}}}}]}]\n"},
		{"plain/cache_aware", Fleet{Plain: 4}, NameCacheAware, "engines:\n" + fleetYAML("llama-3.1-8b", "engine", "plain", 4) +
			"models: [{id: llama-3.1-8b, buckets: [{id: default, max_context_tokens: 131072, groups: {plain: {policy: {type: cache_aware}}}}]}]\n"},
		{"pd/cache_aware", Fleet{Prefill: 3, Decode: 2}, NameCacheAware, "engines:\n" + fleetYAML("llama-3.1-8b", "prefill", "prefill", 3) +
			fleetYAML("llama-3.1-8b", "decode", "decode", 2) +
			"models: [{id: llama-3.1-8b, buckets: [{id: default, max_context_tokens: 131072, groups: {pd: {prefill: {policy: {type: cache_aware}}, decode: {policy: {type: power_of_two}}}}}]}]\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := Config{Trace: tr, Speed: 4, Limit: 400, Seed: 5}
			builtIn := base
			builtIn.Fleet, builtIn.Policies = tc.fleet, []string{tc.policy}
			builtIn.inspect = func(r *run) error { checkConservation(t, r); return nil }
			want, err := Replay(context.Background(), builtIn)
			require.NoError(t, err)

			fromFile := base
			// The built-in run's blocks (DefaultBlockTokens); a file without kv.block_tokens has
			// config.New's (configBlockTokens).
			fromFile.Routing = &Routing{Config: parseRouting(t, fmt.Sprintf("kv: {block_tokens: %d}\n", DefaultBlockTokens)+tc.yaml), Name: tc.policy}
			fromFile.inspect = func(r *run) error { checkConservation(t, r); return nil }
			got, err := Replay(context.Background(), fromFile)
			require.NoError(t, err)
			assert.Equal(t, tc.fleet, got.Fleet)
			require.Len(t, got.Results, 1)
			w, g := want.Results[0], got.Results[0]
			assert.Equal(t, 400, g.Completed+g.Rejected+g.Unroutable)
			assert.Equal(t, w, g, "the file's fleet and policy replay as the built-in run")
		})
	}
}

// TestReplayRoutingUsesTheFile checks that the replay routes with the file's buckets, membership,
// admission caps and affinity policies (docs/design.md §14): a bucket restricted to two of four
// engines sends nothing to the others; a session_aware model keeps every conversation on one
// engine across router replicas even with affinity.store redis (the run's in-memory store
// stands in for Redis); and the report names the run.
func TestReplayRoutingUsesTheFile(t *testing.T) {
	tr, err := MooncakeConversation()
	require.NoError(t, err)
	members := parseRouting(t, `
engines: [{id: a, model: m}, {id: b, model: m}, {id: c, model: m}, {id: d, model: m}]
models:
  - id: m
    buckets: [{id: only-two, groups: {plain: {engine_ids: [b, d], policy: {type: power_of_two}}}}]
`)
	rep, err := Replay(context.Background(), Config{Trace: tr, Speed: 4, Limit: 300, Seed: 1, Routing: &Routing{Config: members}})
	require.NoError(t, err)
	require.Len(t, rep.Results, 1)
	assert.Equal(t, DefaultRoutingName, rep.Results[0].Policy)
	assert.Equal(t, Fleet{Plain: 4}, rep.Fleet)
	er := rep.Results[0].EngineRequests // in file order: a, b, c, d
	require.Len(t, er, 4)
	assert.Zero(t, er[0]+er[2], "engines outside the bucket's engine_ids get nothing")
	assert.Equal(t, 300, er[1]+er[3])

	sessions := parseRouting(t, `
affinity: {idle_timeout: 30m, store: redis, redis: {addrs: ["redis:6379"]}}
engines:
  - {id: x, model: other}
  - {id: s0, model: chat}
  - {id: s1, model: chat}
  - {id: s2, model: chat}
  - {id: s3, model: chat}
models:
  - id: other
    buckets: [{id: all, groups: {plain: {}}}]
  - id: chat
    default_policy: {type: session_aware, admission: {max_inflight_requests: 64}}
    buckets: [{id: all, groups: {plain: {}}}]
`)
	var mu sync.Mutex
	multi := 0
	cfg := Config{Trace: tr, Speed: 4, Limit: 800, Seed: 2, Routers: 3, Routing: &Routing{Config: sessions, Model: "chat", Name: "sessions"}}
	cfg.inspect = func(r *run) error {
		byKey := map[string]map[state.EngineID]bool{}
		for i := range r.reqs {
			q := &r.reqs[i]
			if q.front == nil || q.tr.SessionKey() == "" {
				continue
			}
			k := q.tr.SessionKey()
			if byKey[k] == nil {
				byKey[k] = map[state.EngineID]bool{}
			}
			byKey[k][q.front.id] = true
		}
		mu.Lock()
		defer mu.Unlock()
		for _, es := range byKey {
			if len(es) > 1 {
				multi++
			}
		}
		assert.Equal(t, 4, len(r.all), "only the chat model's engines are simulated")
		return nil
	}
	rep, err = Replay(context.Background(), cfg)
	require.NoError(t, err)
	assert.Equal(t, "sessions", rep.Results[0].Policy)
	assert.Zero(t, multi, "session_aware from the file keeps each conversation on one engine")
}

// TestReplayRoutingRejects checks the errors of a Routing replay, all before anything is
// simulated.
func TestReplayRoutingRejects(t *testing.T) {
	tr, err := MooncakeConversation()
	require.NoError(t, err)
	good := parseRouting(t, "engines: [{id: a, model: m}]\nkv: {block_tokens: 64}\nmodels: [{id: m, buckets: [{id: b, groups: {plain: {}}}]}, {id: n, buckets: [{id: b, groups: {plain: {}}}]}]\n")
	for _, tc := range []struct {
		name string
		cfg  Config
		want error
		msg  string
	}{
		{"with_fleet", Config{Fleet: Fleet{Plain: 2}, Routing: &Routing{Config: good}}, ErrRoutingConflict,
			"sim: Config.Routing replaces Fleet, Policies, Factories and Admission: invalid configuration"},
		{"with_policies", Config{Policies: []string{NameRandom}, Routing: &Routing{Config: good}}, ErrRoutingConflict, ""},
		{"block_tokens", Config{Model: EngineModel{BlockTokens: 16}, Routing: &Routing{Config: good}}, ErrRoutingConflict,
			"sim: Config.Routing replaces Fleet, Policies, Factories and Admission: invalid configuration: EngineModel.BlockTokens 16, but kv.block_tokens is 64"},
		{"no_config", Config{Routing: &Routing{}}, state.ErrInvalidConfiguration, "sim: Config.Routing.Config is nil: invalid configuration"},
		{"unknown_model", Config{Routing: &Routing{Config: good, Model: "zzz"}}, state.ErrInvalidConfiguration,
			`sim: Config.Routing.Model "zzz" is not a model of the configuration: invalid configuration`},
		{"model_without_engines", Config{Routing: &Routing{Config: good, Model: "n"}}, ErrEmptyFleet,
			`sim: fleet has no engines: invalid configuration: the configuration lists no engines of model "n"`},
		{"invalid_file", Config{Routing: &Routing{Config: &config.Config{}}}, state.ErrMissingField, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.cfg.Trace = tr
			_, err := Replay(context.Background(), tc.cfg)
			require.ErrorIs(t, err, tc.want)
			if tc.msg != "" {
				assert.EqualError(t, err, tc.msg)
			}
		})
	}
}
