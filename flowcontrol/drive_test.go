package flowcontrol_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/flowcontrol"
	"github.com/enginepick/enginepick/internal/flowbridge"
)

// driven scripts a saturated fleet as harness does, for driven requests (flowbridge) on one
// goroutine and a virtual clock.
type driven struct {
	c        *flowcontrol.Controller
	now      time.Time
	capacity map[uint64]int
	order    []string
	attempts map[string]int
	results  map[string]error
	ends     map[string]int
}

func newDriven(t *testing.T, cfg flowcontrol.Config) *driven {
	t.Helper()
	c, err := flowcontrol.New(cfg)
	require.NoError(t, err)
	d := &driven{c: c, now: time.Unix(1000, 0), capacity: map[uint64]int{}, attempts: map[string]int{},
		results: map[string]error{}, ends: map[string]int{}}
	flowbridge.SetClock(c, func() time.Time { return d.now })
	return d
}

func (d *driven) submit(id string, r flowcontrol.Request) {
	r.Model = model
	flowbridge.Submit(d.c, r, func() (bool, uint64, error) {
		d.attempts[id]++
		if d.capacity[r.Class] == 0 {
			return true, r.Class, nil
		}
		d.capacity[r.Class]--
		d.order = append(d.order, id)
		return false, 0, nil
	}, func(err error) {
		d.ends[id]++
		d.results[id] = err
	})
}

// free frees n units of class capacity, notifies and drives.
func (d *driven) free(class uint64, n int) {
	d.capacity[class] += n
	d.c.Notify(model)
	flowbridge.Drive(d.c, model)
}

// arrival is one request of an ordering script.
type arrival struct {
	id string
	r  flowcontrol.Request
}

// Driven requests wait in the same queue as blocked ones: the same script of arrivals, served one
// unit of capacity at a time, comes out in the same order (bands, weighted fair share between
// flows, arrival order within a flow).
func TestDrivenRequestsFollowTheQueueOrder(t *testing.T) {
	t.Parallel()
	weights := map[string]float64{"A": 1, "B": 3}
	cfg := flowcontrol.Config{Bands: []flowcontrol.Band{{Priority: 0}, {Priority: 10}},
		Weight: func(f string) float64 { return weights[f] }}
	var script []arrival
	for i := range 6 {
		script = append(script, arrival{fmt.Sprint("A", i), flowcontrol.Request{Flow: "A", Cost: 100}})
	}
	for i := range 3 {
		script = append(script, arrival{fmt.Sprint("B", i), flowcontrol.Request{Flow: "B", Cost: 100}})
	}
	script = append(script, arrival{"C0", flowcontrol.Request{Flow: "C", Cost: 50}},
		arrival{"high", flowcontrol.Request{Priority: 10, Flow: "A", Cost: 1000}})

	h := newHarness(t, cfg)
	for _, a := range script {
		h.arrive(context.Background(), a.id, a.r)
	}
	want := h.serveAll(0, len(script))
	require.Len(t, want, len(script))
	assert.Equal(t, "high", want[0])

	d := newDriven(t, cfg)
	for _, a := range script {
		d.submit(a.id, a.r)
	}
	require.Equal(t, len(script), flowcontrol.Queued(d.c, model))
	d.capacity[0] = 1
	d.c.Notify(model)
	assert.Empty(t, d.order, "Notify runs no driven attempt")
	flowbridge.Drive(d.c, model)
	for range len(script) - 1 {
		d.free(0, 1)
	}
	assert.Equal(t, want, d.order)
	for _, a := range script {
		assert.Equal(t, 1, d.ends[a.id], "%s ends once", a.id)
		assert.NoError(t, d.results[a.id], a.id)
	}
	assert.Equal(t, 0, flowcontrol.Queued(d.c, model))
}

// A driven request the fleet can serve is served by Submit itself; a refused one waits and keeps
// its place through refused turns, and in a pass its class's other requests are not tried after
// its refusal.
func TestDrivenRequestWaitsForItsTurn(t *testing.T) {
	t.Parallel()
	d := newDriven(t, flowcontrol.Config{})
	d.capacity[0] = 1
	d.submit("now", flowcontrol.Request{})
	require.Contains(t, d.results, "now", "served within Submit")
	d.submit("x1", flowcontrol.Request{})
	d.submit("x2", flowcontrol.Request{})
	assert.Equal(t, map[string]int{"now": 1, "x1": 1, "x2": 1}, d.attempts, "each tries once on arrival")
	d.c.Notify(model)
	flowbridge.Drive(d.c, model)
	assert.Equal(t, map[string]int{"now": 1, "x1": 2, "x2": 1}, d.attempts, "x2 is not tried after x1's refusal")
	d.free(0, 2)
	assert.Equal(t, []string{"now", "x1", "x2"}, d.order)
	assert.Equal(t, map[string]int{"now": 1, "x1": 1, "x2": 1}, d.ends)
}

// A band's TTL ends a driven wait at the first Drive at or after the deadline, on the
// Controller's clock.
func TestDrivenTTLRunsOnTheControllerClock(t *testing.T) {
	t.Parallel()
	d := newDriven(t, flowcontrol.Config{Bands: []flowcontrol.Band{{Priority: 0, TTL: time.Second}, {Priority: 1}}})
	d.submit("a", flowcontrol.Request{})
	d.now = d.now.Add(500 * time.Millisecond)
	d.submit("b", flowcontrol.Request{})
	d.submit("high", flowcontrol.Request{Priority: 1})
	d.now = d.now.Add(500*time.Millisecond - 1)
	flowbridge.Drive(d.c, model)
	assert.Empty(t, d.ends)
	d.now = d.now.Add(1)
	flowbridge.Drive(d.c, model)
	require.ErrorIs(t, d.results["a"], flowcontrol.ErrTimeout)
	assert.Equal(t, map[string]int{"a": 1}, d.ends)
	d.now = d.now.Add(time.Hour)
	flowbridge.Drive(d.c, model)
	require.ErrorIs(t, d.results["b"], flowcontrol.ErrTimeout)
	assert.Equal(t, 1, flowcontrol.Queued(d.c, model), "a band without TTL waits on")
	d.free(0, 1)
	assert.Equal(t, []string{"high"}, d.order)
}

// A driven request displaced from a full queue, or refused as sheddable, ends with a
// *RejectedError, once.
func TestDrivenRequestRejected(t *testing.T) {
	t.Parallel()
	d := newDriven(t, flowcontrol.Config{MaxQueued: 1, Bands: []flowcontrol.Band{{Priority: -1, Sheddable: true}, {Priority: 0}, {Priority: 1}}})
	d.submit("shed", flowcontrol.Request{Priority: -1})
	d.submit("low", flowcontrol.Request{})
	d.submit("high", flowcontrol.Request{Priority: 1})
	var rej *flowcontrol.RejectedError
	require.ErrorAs(t, d.results["shed"], &rej)
	assert.Equal(t, "sheddable", rej.Reason)
	require.ErrorAs(t, d.results["low"], &rej)
	assert.Equal(t, "displaced", rej.Reason)
	assert.Equal(t, map[string]int{"shed": 1, "low": 1}, d.ends)
	d.free(0, 1)
	assert.Equal(t, []string{"high"}, d.order)
	assert.Equal(t, map[string]int{"shed": 1, "low": 1, "high": 1}, d.ends)
}

// Driven requests are observed as blocked ones are: a wait's start and its end with the time
// waited on the Controller's clock, a refusal once, a request served at once not at all.
func TestDrivenRequestsObserved(t *testing.T) {
	t.Parallel()
	obs := &events{}
	d := newDriven(t, flowcontrol.Config{MaxQueued: 1, Observer: obs, Bands: []flowcontrol.Band{{Priority: 0, TTL: time.Second}, {Priority: 1}}})
	d.capacity[0] = 1
	d.submit("now", flowcontrol.Request{Flow: "f"})
	d.submit("low", flowcontrol.Request{Flow: "f"})
	d.submit("high", flowcontrol.Request{Flow: "g", Priority: 1})
	d.submit("full", flowcontrol.Request{Flow: "g", Priority: 1})
	d.now = d.now.Add(300 * time.Millisecond)
	d.free(0, 1)
	assert.Equal(t, []flowcontrol.Event{
		{Model: model, Band: 0, Flow: "f"},
		{Model: model, Band: 1, Flow: "g"},
		{Model: model, Band: 0, Flow: "f", Outcome: "displaced"},
		{Model: model, Band: 1, Flow: "g", Outcome: "queue_full"},
		{Model: model, Band: 1, Flow: "g", Outcome: "served", Waited: 300 * time.Millisecond},
	}, obs.take())
	assert.Equal(t, []string{"now", "high"}, d.order)
}
