package sim

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/state"
)

// TestComputeCeiling prices three requests by hand: the prefill floor counts only the prefix an
// earlier request had (the last prompt token recomputed), decode reads every step's context, and
// a request too long for the model is left out.
func TestComputeCeiling(t *testing.T) {
	tr := &Trace{Name: "ceiling", Requests: []Request{
		{Index: 0, Arrival: 0, InputTokens: 1024, OutputTokens: 3, HashIDs: []uint64{1, 2}},
		{Index: 1, Arrival: 10 * time.Second, InputTokens: 1024, OutputTokens: 1, HashIDs: []uint64{1, 2}},
		{Index: 2, Arrival: 15 * time.Second, InputTokens: 200_000, OutputTokens: 1, HashIDs: make([]uint64, 391)},
		{Index: 3, Arrival: 20 * time.Second, InputTokens: 600, OutputTokens: 2, HashIDs: []uint64{1, 9}},
	}}
	for i := range tr.Requests[2].HashIDs {
		tr.Requests[2].HashIDs[i] = uint64(1000 + i)
	}
	c, err := ComputeCeiling(Config{Trace: tr, Fleet: Fleet{Plain: 4}, Speed: 3, Policies: []string{NameRandom}})
	require.NoError(t, err)
	m := DefaultEngineModel()
	p := func(tok, ctx float64) float64 { return want(&m, tok, ctx) }
	kv := float64(DefaultKVBytesPerToken) / DefaultMemoryBytesPerSecond

	assert.Equal(t, 3, c.Requests, "the 200,000-token request does not fit the context window")
	assert.InDelta(t, 20, c.ArrivalSpan, 1e-12)
	assert.InDelta(t, p(1024, 0)+p(1024, 0)+p(600, 0), c.PrefillNoCache, 1e-9)
	// Request 1 repeats request 0: both blocks seen, but its last token is recomputed, so one
	// block (512 tokens) is cached. Request 3 shares block 1 only.
	assert.InDelta(t, p(1024, 0)+p(512, 512)+p(88, 512), c.PrefillInfiniteCache, 1e-9)
	// Request 0 decodes 2 tokens over 1,025 and 1,026 tokens of context, request 3 one over 601.
	assert.InDelta(t, (1025+1026+601)*kv, c.DecodeKV, 1e-12)
	assert.InDelta(t, 3.0/DefaultMaxRunningRequests*DefaultDecodeStepBase.Seconds(), c.DecodeBase, 1e-15)
	assert.InDelta(t, 4*20/(c.PrefillInfiniteCache+c.DecodeKV+c.DecodeBase), c.Speed, 1e-9)

	pd, err := ComputeCeiling(Config{Trace: tr, Fleet: Fleet{Prefill: 1, Decode: 2}, Policies: []string{NameRandom}})
	require.NoError(t, err)
	assert.InDelta(t, min(20/c.PrefillInfiniteCache, 2*20/(c.DecodeKV+c.DecodeBase)), pd.Speed, 1e-9,
		"PD: the slower of the two groups")

	one, err := ComputeCeiling(Config{Trace: tr, Fleet: Fleet{Plain: 4}, Limit: 1, Policies: []string{NameRandom}})
	require.NoError(t, err)
	assert.True(t, math.IsInf(one.Speed, 1), "one request: no span")

	_, err = ComputeCeiling(Config{Trace: tr, Policies: []string{NameRandom}})
	assert.ErrorIs(t, err, state.ErrInvalidConfiguration, "no fleet")
}
