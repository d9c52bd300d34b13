package metrics_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/flowcontrol"
)

const flowConfig = `
flow_control:
  bands: [{priority: 0}, {priority: -1, sheddable: true}]
  flow_weights: {gold: 2}
engines: [{id: e1, model: m}]
models:
  - id: m
    buckets: [{id: all, groups: {plain: {policy: {type: round_robin, admission: {max_inflight_requests: 1}}}}}]
`

// A Router with flow control built by config.New reports its queue: the gauge while a request
// waits, its wait once served, a sheddable rejection, each outcome by band and by flow (gold is
// named by flow_weights, the rest is other), and the selection failure as flow_rejected.
func TestFlowControlMetrics(t *testing.T) {
	t.Parallel()
	f := newFixture(t, flowConfig)
	req := func(priority int, flow string) *bucket.Request {
		return &bucket.Request{Model: "m", Priority: priority, Flow: flow, Signals: bucket.Signals{InputTokens: 10}}
	}
	first, err := f.r.Select(context.Background(), req(0, "tenant-1"))
	require.NoError(t, err)
	waited := make(chan *enginepick.Dispatch)
	go func() {
		d, err := f.r.Select(context.Background(), req(0, "gold"))
		assert.NoError(t, err)
		waited <- d
	}()
	require.Eventually(t, func() bool {
		return scrape(t, f.reg)["flow_control_queued_requests"]["{band=0,model_id=m}"] == 1
	}, 5*time.Second, time.Millisecond, "the waiting request shows in the gauge")
	_, err = f.r.Select(context.Background(), req(-1, "tenant-2"))
	require.Error(t, err)
	first.Done(enginepick.Outcome{})
	(<-waited).Done(enginepick.Outcome{})

	m := scrape(t, f.reg)
	assert.Equal(t, map[string]float64{"{band=0,model_id=m}": 0}, m["flow_control_queued_requests"])
	assert.Equal(t, map[string]float64{
		"{band=0,flow=gold,model_id=m,outcome=served}":      1,
		"{band=-1,flow=other,model_id=m,outcome=sheddable}": 1,
	}, m["flow_control_requests_total"])
	assert.Equal(t, 1.0, m["flow_control_wait_seconds"]["_count{band=0,model_id=m}"])
	assert.Equal(t, 1.0, m["selection_failures_total"]["{model_id=m,reason=flow_rejected}"])
}

// The events of every outcome, with exact waits: the gauge goes up and down, only the waits of
// served requests are observed, and unnamed flows are other.
func TestObserveFlowScripted(t *testing.T) {
	t.Parallel()
	f := newFixture(t, flowConfig)
	obs, ok := f.obs.(flowcontrol.Observer)
	require.True(t, ok, "metrics.New's observer implements flowcontrol.Observer")
	ev := func(band int, flow, outcome string, waited time.Duration) flowcontrol.Event {
		return flowcontrol.Event{Model: "m", Band: band, Flow: flow, Outcome: outcome, Waited: waited}
	}
	for _, e := range []flowcontrol.Event{
		ev(0, "gold", "", 0), ev(0, "a", "", 0), ev(0, "b", "", 0), ev(5, "c", "", 0), ev(5, "d", "", 0), ev(5, "e", "", 0),
		ev(0, "gold", "served", 3*time.Second), ev(0, "a", "served", 40*time.Millisecond),
		ev(0, "b", "expired", 30*time.Second), ev(5, "c", "displaced", time.Second), ev(5, "d", "canceled", 2*time.Second),
		ev(0, "gold", "queue_full", 0), ev(-1, "x", "sheddable", 0),
	} {
		obs.ObserveFlow(e)
	}
	m := scrape(t, f.reg)
	assert.Equal(t, map[string]float64{"{band=0,model_id=m}": 0, "{band=5,model_id=m}": 1}, m["flow_control_queued_requests"])
	assert.Equal(t, map[string]float64{
		"{band=0,flow=gold,model_id=m,outcome=served}":      1,
		"{band=0,flow=other,model_id=m,outcome=served}":     1,
		"{band=0,flow=other,model_id=m,outcome=expired}":    1,
		"{band=5,flow=other,model_id=m,outcome=displaced}":  1,
		"{band=5,flow=other,model_id=m,outcome=canceled}":   1,
		"{band=0,flow=gold,model_id=m,outcome=queue_full}":  1,
		"{band=-1,flow=other,model_id=m,outcome=sheddable}": 1,
	}, m["flow_control_requests_total"])
	w := m["flow_control_wait_seconds"]
	assert.Equal(t, 2.0, w["_count{band=0,model_id=m}"])
	assert.InDelta(t, 3.04, w["_sum{band=0,model_id=m}"], 1e-9)
	assert.Equal(t, 1.0, w["_bucket{band=0,model_id=m,le=0.08}"], "40 ms")
	assert.Equal(t, 2.0, w["_bucket{band=0,model_id=m,le=5.12}"], "and 3 s")
	assert.NotContains(t, w, "_count{band=5,model_id=m}", "only served requests' waits")
}
