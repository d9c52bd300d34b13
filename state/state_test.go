package state_test

import (
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/state"
)

func TestStageTextRoundTrip(t *testing.T) {
	t.Parallel()
	for _, s := range []state.Stage{state.StagePlain, state.StagePrefill, state.StageDecode} {
		text, err := s.MarshalText()
		require.NoError(t, err)
		var got state.Stage
		require.NoError(t, got.UnmarshalText(text))
		assert.Equal(t, s, got, "round trip of %q", text)
	}
	assert.Equal(t, "stage(9)", state.Stage(9).String())
	_, err := state.Stage(9).MarshalText()
	assert.ErrorIs(t, err, state.ErrInvalidConfiguration)
}

func TestParseStageRejectsUnknownText(t *testing.T) {
	t.Parallel()
	for _, text := range []string{"", "Plain", "PREFILL", "decode ", "mixed"} {
		_, err := state.ParseStage(text)
		assert.ErrorIs(t, err, state.ErrInvalidConfiguration, "ParseStage(%q)", text)
	}
	s := state.StageDecode
	require.Error(t, s.UnmarshalText([]byte("bogus")))
	assert.Equal(t, state.StageDecode, s, "a failed UnmarshalText leaves the stage unchanged")
}

func TestStaticRegistryAddRemove(t *testing.T) {
	t.Parallel()
	a := state.NewStaticEngine("a", "m", state.StagePlain)
	b := state.NewStaticEngine("b", "m", state.StagePlain)
	c := state.NewStaticEngine("c", "other", state.StageDecode)
	r, err := state.NewStaticRegistry(a, b, c)
	require.NoError(t, err)

	assert.Equal(t, []state.Engine{a, b}, r.Engines("m"))
	assert.Equal(t, []state.Engine{c}, r.Engines("other"))
	assert.Nil(t, r.Engines("unknown"))

	held := r.Engines("m")
	assert.True(t, r.Remove("a"))
	assert.False(t, r.Remove("a"), "second remove reports absence")
	assert.Equal(t, []state.Engine{b}, r.Engines("m"))
	assert.Equal(t, []state.Engine{a, b}, held, "a slice already handed out is never modified")

	got, ok := r.Engine("b")
	assert.True(t, ok)
	assert.Same(t, b, got)
	_, ok = r.Engine("a")
	assert.False(t, ok)
}

func TestStaticRegistryRejectsBadEngines(t *testing.T) {
	t.Parallel()
	r := &state.StaticRegistry{}
	require.NoError(t, r.Add(state.NewStaticEngine("a", "m", state.StagePlain)))
	tests := []struct {
		name string
		e    state.Engine
		want error
	}{
		{"nil engine", nil, state.ErrInvalidConfiguration},
		{"empty id", state.NewStaticEngine("", "m", state.StagePlain), state.ErrInvalidConfiguration},
		{"invalid stage", state.NewStaticEngine("x", "m", state.Stage(7)), state.ErrInvalidConfiguration},
		{"duplicate id", state.NewStaticEngine("a", "other", state.StageDecode), state.ErrDuplicate},
	}
	for _, tt := range tests {
		err := r.Add(tt.e)
		assert.ErrorIs(t, err, tt.want, tt.name)
	}
	assert.Len(t, r.Engines("m"), 1, "failed adds leave the registry unchanged")
	assert.Nil(t, r.Engines("other"))
}

func TestStaticRegistryConcurrentReadsAndWrites(t *testing.T) {
	t.Parallel()
	r := &state.StaticRegistry{}
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			for i := range 200 {
				id := state.EngineID(fmt.Sprintf("e%d-%d", w, i))
				if err := r.Add(state.NewStaticEngine(id, "m", state.StagePlain)); err != nil {
					t.Error(err)
				}
				if i%2 == 0 {
					r.Remove(id)
				}
			}
		})
		wg.Go(func() {
			for range 2000 {
				for _, e := range r.Engines("m") {
					if e == nil {
						t.Error("nil engine in view")
					}
				}
			}
		})
	}
	wg.Wait()
	assert.Len(t, r.Engines("m"), 400)
}

func TestStaticEngineHealth(t *testing.T) {
	t.Parallel()
	e := state.NewStaticEngine("a", "m", state.StagePrefill)
	assert.True(t, e.Healthy())
	e.SetHealthy(false)
	assert.False(t, e.Healthy())
	assert.Equal(t, "a", e.String())
	var zero state.StaticEngine
	assert.False(t, zero.Healthy(), "the zero value reports unhealthy")
}

func TestStaticRegistryVersionChangesOnEveryWrite(t *testing.T) {
	t.Parallel()
	r := &state.StaticRegistry{}
	v0 := r.EnginesVersion("m")
	require.NoError(t, r.Add(state.NewStaticEngine("a", "m", state.StagePlain)))
	v1 := r.EnginesVersion("m")
	assert.NotEqual(t, v0, v1)
	require.Error(t, r.Add(state.NewStaticEngine("a", "m", state.StagePlain)))
	assert.Equal(t, v1, r.EnginesVersion("m"), "a failed add changes nothing")
	r.Remove("a")
	assert.NotEqual(t, v1, r.EnginesVersion("m"))
	v2 := r.EnginesVersion("m")
	r.Remove("a")
	assert.Equal(t, v2, r.EnginesVersion("m"), "removing an absent engine changes nothing")
}
