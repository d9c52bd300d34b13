package config

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/state"
)

// plainRegistry is a registry without versions: fleet scans it on every call.
type plainRegistry struct{ engines []state.Engine }

func (r plainRegistry) Engines(state.ModelID) []state.Engine { return r.engines }

// The engines peers' deltas may name (fleet.known) are the registry's engines of the configured
// models: with a versioned registry, the cached set follows every change; without versions, every
// call scans the registry.
func TestFleetKnowsTheRegistrysEngines(t *testing.T) {
	reg := &state.StaticRegistry{}
	require.NoError(t, reg.Add(state.NewStaticEngine("a", "m", state.StagePlain)))
	require.NoError(t, reg.Add(state.NewStaticEngine("other-model", "n", state.StagePlain)))
	f := &fleet{reg: reg, models: []state.ModelID{"m"}}
	assert.True(t, f.known("a"))
	assert.False(t, f.known("b"))
	assert.False(t, f.known("other-model"), "an engine of a model the configuration does not serve")
	require.NoError(t, reg.Add(state.NewStaticEngine("b", "m", state.StagePlain)))
	assert.True(t, f.known("b"), "an engine added later")
	reg.Remove("a")
	assert.False(t, f.known("a"), "an engine removed")

	p := &fleet{reg: plainRegistry{[]state.Engine{state.NewStaticEngine("c", "m", state.StagePlain), nil}}, models: []state.ModelID{"m"}}
	assert.True(t, p.known("c"))
	assert.False(t, p.known("a"))
}
