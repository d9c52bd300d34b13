package enginepick_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/flowcontrol"
	"github.com/enginepick/enginepick/internal/flowbridge"
)

// A driven Select (flowbridge.Select) waits as a blocked one does, without a goroutine: it is
// dispatched by the Drive after a dispatch ends, in band order, and each request's done runs once.
func TestDrivenSelectWaitsWithoutAGoroutine(t *testing.T) {
	t.Parallel()
	fc := mustController(t, flowcontrol.Config{Bands: []flowcontrol.Band{{Priority: 0}, {Priority: 1}}})
	f := newFlowFleet(t, fc, 1)
	var order []string
	results := map[string]*enginepick.Dispatch{}
	selectDriven := func(id string, req *bucket.Request) {
		flowbridge.Select(f.router, context.Background(), req, func(d any, err error) {
			require.NoError(t, err, id)
			_, again := results[id]
			require.False(t, again, "%s ends twice", id)
			results[id] = d.(*enginepick.Dispatch)
			order = append(order, id)
		})
	}
	selectDriven("first", shortReq())
	selectDriven("second", shortReq())
	require.Equal(t, []string{"first", "second"}, order, "served within Select: the engines had room")
	low, high := shortReq(), shortReq()
	high.Priority = 1
	selectDriven("low", low)
	selectDriven("high", high)

	results["first"].Release() // notifies
	assert.Len(t, order, 2, "a release runs no driven attempt")
	flowbridge.Drive(fc, "m")
	assert.Equal(t, []string{"first", "second", "high"}, order)
	assert.Equal(t, engineOf(results["first"]), engineOf(results["high"]), "the freed engine")
	results["second"].Release()
	flowbridge.Drive(fc, "m")
	assert.Equal(t, []string{"first", "second", "high", "low"}, order)
}

// Without flow control, or for a request Select refuses outright, done runs before Select returns.
func TestDrivenSelectEndsAtOnce(t *testing.T) {
	t.Parallel()
	for name, fc := range map[string]*flowcontrol.Controller{"no flow control": nil, "flow control": mustController(t, flowcontrol.Config{})} {
		f := newFlowFleet(t, fc, 0)
		var got []error
		flowbridge.Select(f.router, context.Background(), shortReq(), func(d any, err error) {
			assert.IsType(t, (*enginepick.Dispatch)(nil), d, name)
			got = append(got, err)
		})
		flowbridge.Select(f.router, context.Background(), &bucket.Request{Model: "unknown"}, func(d any, err error) {
			assert.Nil(t, d, name)
			got = append(got, err)
		})
		require.Len(t, got, 2, name)
		assert.NoError(t, got[0], name)
		assert.ErrorIs(t, got[1], enginepick.ErrUnknownModel, name)
	}
}
