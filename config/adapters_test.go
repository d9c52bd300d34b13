package config_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/config"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

// TestRouterSelectMapsAdapterNames: a request whose Model is one of models[].adapters (and whose
// Adapter is empty) routes on the base model's buckets for that adapter, as if it had been
// {Model: base, Adapter: name}; a request that sets both keeps them; the caller's request is
// not modified.
func TestRouterSelectMapsAdapterNames(t *testing.T) {
	t.Parallel()
	cfg := mustParse(t, `
engines:
  - {id: e1, model: m}
  - {id: e2, model: m}
models:
  - id: m
    adapters: [sql-lora]
    buckets: [{id: a, groups: {plain: {policy: {type: least_load}}}}]
`)
	r, err := config.New(cfg, nil, config.WithHealthInterval(0))
	require.NoError(t, err)
	defer r.Close()
	// Equal loads: e2 runs the adapter, e1's one adapter slot is taken, so a request for the
	// adapter goes to e2 and a base-model request to e1 (ties keep the first).
	require.NoError(t, r.LoadTable().Report(loadmon.Report{Engine: "e1", RunningRequests: 2, LoRA: &loadmon.LoRALoad{MaxAdapters: 1, Running: []string{"other"}}}))
	require.NoError(t, r.LoadTable().Report(loadmon.Report{Engine: "e2", RunningRequests: 2, LoRA: &loadmon.LoRALoad{MaxAdapters: 1, Running: []string{"sql-lora"}}}))
	for _, tc := range []struct {
		name    string
		model   state.ModelID
		adapter string
		want    state.EngineID
		unknown bool
	}{
		{name: "adapter name as model", model: "sql-lora", want: "e2"},
		{name: "base model and adapter", model: "m", adapter: "sql-lora", want: "e2"},
		{name: "base model", model: "m", want: "e1"},
		{name: "adapter name as model with an adapter set is kept", model: "sql-lora", adapter: "sql-lora", unknown: true},
		{name: "unknown model", model: "sql", unknown: true},
	} {
		req := &bucket.Request{Model: tc.model, Adapter: tc.adapter, Signals: bucket.Signals{InputTokens: 9}}
		d, err := r.Select(context.Background(), req)
		assert.Equal(t, &bucket.Request{Model: tc.model, Adapter: tc.adapter, Signals: bucket.Signals{InputTokens: 9}}, req, tc.name)
		if tc.unknown {
			assert.ErrorIs(t, err, enginepick.ErrUnknownModel, tc.name)
			assert.Nil(t, d, tc.name)
			continue
		}
		require.NoError(t, err, tc.name)
		assert.Equal(t, tc.want, d.Selection.Plain.Engine.ID(), tc.name)
		d.Release()
	}
}
