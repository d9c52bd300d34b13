package flowcontrol_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/flowcontrol"
)

// events records an Observer's events.
type events struct {
	mu  sync.Mutex
	got []flowcontrol.Event
}

func (e *events) ObserveFlow(ev flowcontrol.Event) {
	e.mu.Lock()
	e.got = append(e.got, ev)
	e.mu.Unlock()
}

func (e *events) take() []flowcontrol.Event {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := e.got
	e.got = nil
	return out
}

// The Observer sees each request that waits twice (its start, then its end with the time waited
// on the Controller's clock) and each request refused without waiting once; a request served at
// its first attempt reports nothing.
func TestObserverSeesEveryWait(t *testing.T) {
	t.Parallel()
	obs := &events{}
	c, err := flowcontrol.New(flowcontrol.Config{MaxQueued: 2, Observer: obs, Bands: []flowcontrol.Band{
		{Priority: -1, Sheddable: true}, {Priority: 0, MaxQueued: 2}, {Priority: 5}, {Priority: 9, TTL: 20 * time.Millisecond}}})
	require.NoError(t, err)
	var clockMu sync.Mutex
	now := time.Unix(1000, 0)
	flowcontrol.SetClock(c, func() time.Time { clockMu.Lock(); defer clockMu.Unlock(); return now })
	advance := func(d time.Duration) { clockMu.Lock(); now = now.Add(d); clockMu.Unlock() }
	h := &harness{t: t, c: c, capacity: map[uint64]int{0: 1}, attempts: map[string]int{}, results: map[string]error{}}
	t.Cleanup(h.wg.Wait)

	h.arrive(context.Background(), "direct", flowcontrol.Request{Flow: "A"})
	require.NoError(t, h.result("direct"))
	assert.Empty(t, obs.take(), "served at its first attempt")

	h.arrive(context.Background(), "shed", flowcontrol.Request{Priority: -1, Flow: "A"})
	require.Error(t, h.result("shed"))
	assert.Equal(t, []flowcontrol.Event{{Model: model, Band: -1, Flow: "A", Outcome: "sheddable"}}, obs.take())

	h.arrive(context.Background(), "waits", flowcontrol.Request{Flow: "B"})
	assert.Equal(t, []flowcontrol.Event{{Model: model, Band: 0, Flow: "B"}}, obs.take())
	advance(3 * time.Second)
	h.free(0, 1, 2)
	require.NoError(t, h.result("waits"))
	assert.Equal(t, []flowcontrol.Event{{Model: model, Band: 0, Flow: "B", Outcome: "served", Waited: 3 * time.Second}}, obs.take())

	ctx, cancel := context.WithCancel(context.Background())
	h.arrive(ctx, "low1", flowcontrol.Request{})
	h.arrive(context.Background(), "low2", flowcontrol.Request{})
	h.arrive(context.Background(), "low3", flowcontrol.Request{})
	require.Error(t, h.result("low3"), "band 0 is full")
	h.arrive(context.Background(), "mid", flowcontrol.Request{Priority: 5})
	require.Error(t, h.result("low2"), "displaced by mid")
	cancel()
	require.ErrorIs(t, h.result("low1"), context.Canceled)
	h.arrive(context.Background(), "high", flowcontrol.Request{Priority: 9})
	require.ErrorIs(t, h.result("high"), flowcontrol.ErrTimeout)
	assert.ElementsMatch(t, []flowcontrol.Event{
		{Model: model, Band: 0}, {Model: model, Band: 0},
		{Model: model, Band: 0, Outcome: "queue_full"},
		{Model: model, Band: 5},
		{Model: model, Band: 0, Outcome: "displaced"},
		{Model: model, Band: 0, Outcome: "canceled"},
		{Model: model, Band: 9}, {Model: model, Band: 9, Outcome: "expired"},
	}, obs.take())

	boom := errors.New("boom")
	done := make(chan error)
	go func() {
		n := 0 // the attempts run on this goroutine
		done <- c.Wait(context.Background(), flowcontrol.Request{Model: model, Priority: 5, Class: 1}, func() (bool, uint64, error) {
			if n++; n == 1 {
				return true, 1, nil
			}
			return false, 0, boom
		})
	}()
	require.Eventually(t, func() bool { return flowcontrol.Queued(c, model) == 2 }, 5*time.Second, time.Millisecond)
	c.Notify(model)
	h.serveAll(0, 1)
	require.ErrorIs(t, <-done, boom)
	assert.ElementsMatch(t, []flowcontrol.Event{
		{Model: model, Band: 5, Outcome: "served"}, {Model: model, Band: 5}, {Model: model, Band: 5, Outcome: "failed"},
	}, obs.take())
}
