package policy_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

func TestRegistry(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"round_robin", "random", "power_of_two", "power_of_n", "least_load", "cache_aware", "session_aware", "sticky"} {
		b, ok := policy.Lookup(name)
		require.True(t, ok, "built-in %s", name)
		assert.Equal(t, name, b.Name())
		assert.Contains(t, policy.Names(), name)
	}
	_, ok := policy.Lookup("load_based")
	assert.False(t, ok, "renamed least_load")

	build := func(*struct{}, policy.Env) (policy.Policy, error) { return nil, nil }
	for _, tc := range []struct {
		name  string
		b     policy.Builder
		cause error
	}{
		{"nil builder", nil, policy.ErrInvalidConfiguration},
		{"empty name", policy.NewBuilder("", build), policy.ErrInvalidConfiguration},
		{"a built-in name", policy.NewBuilder("cache_aware", build), state.ErrDuplicate},
	} {
		err := policy.Register(tc.b)
		assert.ErrorIs(t, err, tc.cause, tc.name)
		assert.ErrorIs(t, err, policy.ErrInvalidConfiguration, tc.name)
	}
	require.NoError(t, policy.Register(policy.NewBuilder("registry_test_once", build)))
	assert.ErrorIs(t, policy.Register(policy.NewBuilder("registry_test_once", build)), state.ErrDuplicate, "twice")
	b, ok := policy.Lookup("cache_aware")
	require.True(t, ok)
	ss, ok := b.(interface{ SupportsStage(state.Stage) bool })
	require.True(t, ok)
	assert.False(t, ss.SupportsStage(state.StageDecode), "cache_aware serves plain and prefill only")
	assert.True(t, ss.SupportsStage(state.StagePrefill))
}

// NewCacheAware reports an invalid option as an *OptionError naming the Go field, with the cause
// the configuration reports for the same value.
func TestCacheAwareOptionErrors(t *testing.T) {
	t.Parallel()
	h, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: 16})
	require.NoError(t, err)
	x, err := kvindex.NewIndex(h, kvindex.Options{})
	require.NoError(t, err)
	src, err := kvindex.NewLocalSource(x)
	require.NoError(t, err)
	cfg := policy.Config{Load: loadmon.NewTable(), InFlight: loadmon.NewInFlight(nil)}
	four, five := uint64(4), uint64(5)
	for _, tc := range []struct {
		name  string
		opts  policy.CacheAwareOptions
		field string
		cause error
	}{
		{"no source", policy.CacheAwareOptions{}, "Source", state.ErrMissingField},
		{"match ratio above one", policy.CacheAwareOptions{Source: src, MinMatchRatio: 1.5}, "MinMatchRatio", state.ErrOutOfRange},
		{"floor without limit", policy.CacheAwareOptions{Source: src, SaturationQueueFloor: &four}, "SaturationQueueFloor", state.ErrConflict},
		{"floor above limit", policy.CacheAwareOptions{Source: src, EngineQueueLimit: &four, SaturationQueueFloor: &five}, "SaturationQueueFloor", state.ErrOutOfRange},
	} {
		_, err := policy.NewCacheAware(cfg, tc.opts)
		var oe *policy.OptionError
		require.True(t, errors.As(err, &oe), "%s: NewCacheAware = %v, want *OptionError", tc.name, err)
		assert.Equal(t, tc.field, oe.Field, tc.name)
		assert.ErrorIs(t, err, tc.cause, tc.name)
		assert.ErrorIs(t, err, policy.ErrInvalidConfiguration, tc.name)
	}
}
