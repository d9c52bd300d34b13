package config_test

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/config"
	"github.com/enginepick/enginepick/flowcontrol"
)

const flowFleet = `
engines: [{id: e1, model: m}]
models:
  - id: m
    buckets: [{id: all, groups: {plain: {policy: {type: round_robin, admission: {max_inflight_requests: 1}}}}}]
`

func TestFlowControlBlock(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, block string
		want        *config.FlowControl
	}{
		{"absent: off", "", nil},
		{"null: off", "flow_control: null\n", nil},
		{"empty: the defaults", "flow_control: {}\n", &config.FlowControl{}},
		{"every key", `
flow_control:
  bands:
    - {priority: 10, ttl: 30s}
    - {priority: 0, max_queued: 100}
    - {priority: -1, sheddable: true}
  max_queued: 1000
  half_life: 2m
  flow_weights: {gold: 4, "": 0.5}
  queue_threshold: 8
  kv_threshold: 0.9
`, &config.FlowControl{
			Bands: []config.FlowBand{{Priority: 10, TTL: config.Duration(30 * time.Second)}, {Priority: 0, MaxQueued: 100},
				{Priority: -1, Sheddable: true}},
			MaxQueued: 1000, HalfLife: config.Duration(2 * time.Minute), FlowWeights: map[string]float64{"gold": 4, "": 0.5},
			QueueThreshold: 8, KVThreshold: 0.9,
		}},
	} {
		cfg, err := config.Parse([]byte(tc.block + flowFleet))
		require.NoError(t, err, tc.name)
		assert.Equal(t, tc.want, cfg.FlowControl, tc.name)
	}
}

// flowEvents is an Observer that also records flow control's events.
type flowEvents struct {
	recorder
	fmu    sync.Mutex
	events []flowcontrol.Event
}

func (f *flowEvents) ObserveFlow(e flowcontrol.Event) {
	f.fmu.Lock()
	f.events = append(f.events, e)
	f.fmu.Unlock()
}

func (f *flowEvents) outcomes() []string {
	f.fmu.Lock()
	defer f.fmu.Unlock()
	var out []string
	for _, e := range f.events {
		out = append(out, e.Flow+":"+e.Outcome)
	}
	return out
}

// A flow_control block makes the Router New builds wait instead of failing: with the one engine
// at its in-flight cap, a request waits and is served when the dispatch ends, a request of the
// sheddable band is rejected with 429 at once, and the observer passed with WithObserver sees the
// queue's events.
func TestFlowControlRouterWaits(t *testing.T) {
	t.Parallel()
	cfg, err := config.Parse([]byte("flow_control: {bands: [{priority: 0}, {priority: -1, sheddable: true}]}\n" + flowFleet))
	require.NoError(t, err)
	obs := &flowEvents{}
	r, err := config.New(cfg, nil, config.WithHealthInterval(0), config.WithObserver(obs))
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	req := func(priority int, flow string) *bucket.Request {
		return &bucket.Request{Model: "m", Priority: priority, Flow: flow, Signals: bucket.Signals{InputTokens: 10}}
	}

	first, err := r.Select(context.Background(), req(0, "a"))
	require.NoError(t, err)
	waited := make(chan *enginepick.Dispatch)
	go func() {
		d, err := r.Select(context.Background(), req(0, "b"))
		assert.NoError(t, err)
		waited <- d
	}()
	require.Eventually(t, func() bool { return len(obs.outcomes()) == 1 }, 5*time.Second, time.Millisecond)
	assert.Equal(t, []string{"b:"}, obs.outcomes(), "b waits")

	_, err = r.Select(context.Background(), req(-1, "c"))
	var rej *flowcontrol.RejectedError
	require.ErrorAs(t, err, &rej)
	assert.Equal(t, "sheddable", rej.Reason)
	assert.Equal(t, http.StatusTooManyRequests, bucket.StatusCode(err))

	first.Done(enginepick.Outcome{})
	d := <-waited
	require.NotNil(t, d)
	assert.Equal(t, "e1", string(d.Selection.Plain.Engine.ID()))
	d.Done(enginepick.Outcome{})
	assert.Equal(t, []string{"b:", "c:sheddable", "b:served"}, obs.outcomes())
}
