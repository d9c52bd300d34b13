package flowcontrol_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/flowcontrol"
)

// TestRetryAfterAfterALongIdlePeriod: after one dispatch and an idle period of k half-lives (60 s
// each), the dispatch rate is near zero, or zero in float64: a full queue's RetryAfter is the
// 1 min ceiling, whatever k (the hint never wraps around past the largest Duration).
func TestRetryAfterAfterALongIdlePeriod(t *testing.T) {
	got := map[int]time.Duration{}
	for _, k := range []int{20, 26, 27, 30, 40} {
		c, err := flowcontrol.New(flowcontrol.Config{MaxQueued: 1})
		require.NoError(t, err)
		var mu sync.Mutex
		now := time.Unix(1000, 0)
		flowcontrol.SetClock(c, func() time.Time { mu.Lock(); defer mu.Unlock(); return now })
		require.NoError(t, c.Wait(context.Background(), flowcontrol.Request{Model: model}, func() (bool, uint64, error) { return false, 0, nil }))
		mu.Lock()
		now = now.Add(time.Duration(k) * time.Minute) // k half-lives
		mu.Unlock()
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { // fills the queue
			defer close(done)
			_ = c.Wait(ctx, flowcontrol.Request{Model: model}, func() (bool, uint64, error) { return true, 1, nil })
		}()
		require.Eventually(t, func() bool { return flowcontrol.Queued(c, model) == 1 }, 5*time.Second, time.Millisecond)
		err = c.Wait(context.Background(), flowcontrol.Request{Model: model}, func() (bool, uint64, error) { return true, 1, nil })
		var rej *flowcontrol.RejectedError
		require.ErrorAs(t, err, &rej)
		got[k] = rej.RetryAfter
		cancel()
		<-done
	}
	for k, d := range got {
		assert.Equal(t, time.Minute, d, "idle %d half-lives", k)
	}
}

// TestDisplacementPassesOverTheRequestHoldingTheTurn: a full queue displaces a waiting lower-band
// request for a top-band arrival even when the only request of the lowest band holds the turn
// (its attempt is running): the band above it gives the victim.
func TestDisplacementPassesOverTheRequestHoldingTheTurn(t *testing.T) {
	c, err := flowcontrol.New(flowcontrol.Config{MaxQueued: 2,
		Bands: []flowcontrol.Band{{Priority: 0}, {Priority: 5}, {Priority: 10}}})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	res := map[string]chan error{"low": make(chan error, 1), "mid": make(chan error, 1), "high": make(chan error, 1)}
	start := func(id string, r flowcontrol.Request, attempt func() (bool, uint64, error)) {
		wg.Add(1)
		go func() { defer wg.Done(); res[id] <- c.Wait(ctx, r, attempt) }()
	}
	release, inAttempt := make(chan struct{}), make(chan struct{}, 1)
	var tries atomic.Int32
	// low (band 0): refused; from its second attempt (its turn), it blocks until release.
	start("low", flowcontrol.Request{Model: model, Priority: 0, Flow: "low", Class: 1}, func() (bool, uint64, error) {
		if tries.Add(1) == 2 {
			inAttempt <- struct{}{}
			<-release
		}
		return true, 1, nil
	})
	require.Eventually(t, func() bool { return flowcontrol.Queued(c, model) == 1 }, 5*time.Second, time.Millisecond)
	// mid (band 5): always refused.
	start("mid", flowcontrol.Request{Model: model, Priority: 5, Flow: "mid", Class: 2}, func() (bool, uint64, error) { return true, 2, nil })
	require.Eventually(t, func() bool { return flowcontrol.Queued(c, model) == 2 }, 5*time.Second, time.Millisecond)
	c.Notify(model) // the pass: mid is refused, then low takes the turn and blocks in its attempt
	<-inAttempt
	// The queue is full: a band-10 arrival should displace mid, the only request merely waiting.
	start("high", flowcontrol.Request{Model: model, Priority: 10, Flow: "high"}, func() (bool, uint64, error) { return false, 0, nil })
	var rej *flowcontrol.RejectedError
	select {
	case err := <-res["high"]:
		t.Errorf("high (band 10) ended with %v while mid (band 5) still waits", err)
	case err := <-res["mid"]:
		require.ErrorAs(t, err, &rej)
		assert.Equal(t, "displaced", rej.Reason)
	case <-time.After(5 * time.Second):
		t.Error("neither ended")
	}
	close(release)
}

// TestFairDisplacementPassesOverTheRequestHoldingTheTurn: in one band, a full queue displaces the
// newest request of the flow served last among those merely waiting: flow a (most served) holds
// the turn with its only request, so flow b's request gives way to flow c's arrival (least
// served), which is not rejected.
func TestFairDisplacementPassesOverTheRequestHoldingTheTurn(t *testing.T) {
	c, err := flowcontrol.New(flowcontrol.Config{MaxQueued: 2})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	served := func() (bool, uint64, error) { return false, 0, nil }
	require.NoError(t, c.Wait(ctx, flowcontrol.Request{Model: model, Flow: "a", Cost: 100}, served))
	require.NoError(t, c.Wait(ctx, flowcontrol.Request{Model: model, Flow: "b", Cost: 10}, served))
	res := map[string]chan error{"a": make(chan error, 1), "b": make(chan error, 1), "c": make(chan error, 1)}
	start := func(id string, r flowcontrol.Request, attempt func() (bool, uint64, error)) {
		wg.Add(1)
		go func() { defer wg.Done(); res[id] <- c.Wait(ctx, r, attempt) }()
	}
	release, inAttempt := make(chan struct{}), make(chan struct{}, 1)
	var tries atomic.Int32
	start("a", flowcontrol.Request{Model: model, Flow: "a", Class: 1}, func() (bool, uint64, error) {
		if tries.Add(1) == 2 {
			inAttempt <- struct{}{}
			<-release
		}
		return true, 1, nil
	})
	require.Eventually(t, func() bool { return flowcontrol.Queued(c, model) == 1 }, 5*time.Second, time.Millisecond)
	start("b", flowcontrol.Request{Model: model, Flow: "b", Class: 2}, func() (bool, uint64, error) { return true, 2, nil })
	require.Eventually(t, func() bool { return flowcontrol.Queued(c, model) == 2 }, 5*time.Second, time.Millisecond)
	c.Notify(model) // the pass: b (less served) is refused, then a takes the turn and blocks
	<-inAttempt
	start("c", flowcontrol.Request{Model: model, Flow: "c"}, func() (bool, uint64, error) { return false, 0, nil })
	var rej *flowcontrol.RejectedError
	select {
	case err := <-res["c"]:
		t.Errorf("c (least served) ended with %v while b (more served) still waits", err)
	case err := <-res["b"]:
		require.ErrorAs(t, err, &rej)
		assert.Equal(t, "displaced", rej.Reason)
	case <-time.After(5 * time.Second):
		t.Error("neither ended")
	}
	close(release)
}
