// Package hostpolicy_test tests a policy type registered by the host apart from package config's
// own tests: the registry is process-wide, and the type would show in their messages that list the
// registered types.
package hostpolicy_test

import (
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/config"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// weightedOptions is the block of the host-registered test type "config_test_weighted".
type weightedOptions struct {
	Weight *int `json:"weight,omitempty"`
}

func (o *weightedOptions) Validate() error {
	if o.Weight != nil && *o.Weight < 1 {
		return &policy.OptionError{Policy: "config_test_weighted", Field: "weight", Msg: "must be >= 1", Cause: state.ErrOutOfRange}
	}
	return nil
}

func mustParse(t *testing.T, yaml string) *config.Config {
	t.Helper()
	cfg, err := config.Parse([]byte(yaml))
	require.NoError(t, err)
	return cfg
}

var (
	weightedOnce  sync.Once
	weightedMu    sync.Mutex
	weightedBuilt []int // the weight each Build saw (0 for none)
)

// registerWeighted registers config_test_weighted once per test binary; its Build records the
// options it was given and builds a round-robin policy.
func registerWeighted(t *testing.T) {
	t.Helper()
	weightedOnce.Do(func() {
		require.NoError(t, policy.Register(policy.NewBuilder("config_test_weighted", func(o *weightedOptions, env policy.Env) (policy.Policy, error) {
			weightedMu.Lock()
			defer weightedMu.Unlock()
			w := 0
			if o.Weight != nil {
				w = *o.Weight
			}
			weightedBuilt = append(weightedBuilt, w)
			return policy.NewRoundRobin(env.Config)
		})))
	})
}

// A policy type the host registers owns its block as a built-in type does (docs/design.md §14.2):
// the block is decoded strictly into the builder's options, validated with their Validate at the
// field's path, handed to Build (zero options without a block), and a block named after it under
// another type is a conflict.
func TestRegisteredPolicyBlock(t *testing.T) {
	registerWeighted(t)
	const head = "engines: [{id: e1, model: m}]\nmodels: [{id: m, buckets: [{id: a, groups: {plain: {policy: "
	const tail = "}}}]}]\n"
	bad := []struct {
		name, policy string
		cause        error
		path, msg    string
	}{
		{"unknown field in the block", "{type: config_test_weighted, config_test_weighted: {wieght: 3}}", state.ErrUnknownField,
			"models[0].buckets[0].groups.plain.policy.config_test_weighted.wieght",
			`config: line 2: models[0].buckets[0].groups.plain.policy.config_test_weighted.wieght: unknown field: want one of weight`},
		{"the block's Validate", "{type: config_test_weighted, config_test_weighted: {weight: 0}}", state.ErrOutOfRange,
			"models[0].buckets[0].groups.plain.policy.config_test_weighted.weight",
			`config: line 2: models[0].buckets[0].groups.plain.policy.config_test_weighted.weight: must be >= 1`},
		{"its block under another type", "{type: round_robin, config_test_weighted: {weight: 3}}", state.ErrConflict,
			"models[0].buckets[0].groups.plain.policy.config_test_weighted",
			`config: line 2: models[0].buckets[0].groups.plain.policy.config_test_weighted: options for policy type config_test_weighted, but the type is "round_robin": name the block after the type`},
	}
	for _, tc := range bad {
		cfg, err := config.Parse([]byte(head + tc.policy + tail))
		assert.Nil(t, cfg, tc.name)
		var ce *config.Error
		require.True(t, errors.As(err, &ce), "%s: Parse = %v, want *config.Error", tc.name, err)
		assert.ErrorIs(t, err, tc.cause, tc.name)
		assert.ErrorIs(t, err, state.ErrInvalidConfiguration, tc.name)
		assert.Equal(t, tc.path, ce.Path, tc.name)
		assert.Equal(t, tc.msg, err.Error(), tc.name)
	}

	weightedMu.Lock()
	weightedBuilt = nil
	weightedMu.Unlock()
	for _, p := range []string{"{type: config_test_weighted, config_test_weighted: {weight: 3}}", "{type: config_test_weighted}"} {
		r, err := config.New(mustParse(t, head+p+tail), nil, config.WithHealthInterval(0))
		require.NoError(t, err, p)
		require.NoError(t, r.Close())
	}
	weightedMu.Lock()
	defer weightedMu.Unlock()
	assert.Equal(t, []int{3, 0}, weightedBuilt, "Build sees the block's options, and zero options without a block")
}
