package flowcontrol_test

import (
	"context"
	"errors"
	"math"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/enginepick/enginepick/flowcontrol"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const model state.ModelID = "m"

// harness scripts a saturated fleet: capacity[class] requests of a class can be served; every
// attempt beyond it is refused as saturated. Requests arrive one at a time (each is queued, or has
// returned, before the next arrives), and capacity frees one unit at a time.
type harness struct {
	t        *testing.T
	c        *flowcontrol.Controller
	mu       sync.Mutex
	capacity map[uint64]int
	order    []string         // served requests, in order
	attempts map[string]int   // attempts per request
	results  map[string]error // returned requests
	wg       sync.WaitGroup
	next     uint64 // rotating's last class
}

func newHarness(t *testing.T, cfg flowcontrol.Config) *harness {
	t.Helper()
	c, err := flowcontrol.New(cfg)
	require.NoError(t, err)
	h := &harness{t: t, c: c, capacity: map[uint64]int{}, attempts: map[string]int{}, results: map[string]error{}}
	t.Cleanup(h.wg.Wait)
	return h
}

func (h *harness) attempt(id string, class uint64) func() (bool, uint64, error) {
	return func() (bool, uint64, error) {
		h.mu.Lock()
		defer h.mu.Unlock()
		h.attempts[id]++
		if h.capacity[class] == 0 {
			return true, class, nil
		}
		h.capacity[class]--
		h.order = append(h.order, id)
		return false, 0, nil
	}
}

// rotating is an attempt that picks classes 1 to 4 in turn, over every request's attempts, as
// round-robin picks engines without reading their caps; it draws on the capacity of the class
// picked and reports it as the class of its refusal.
func (h *harness) rotating(id string) func() (bool, uint64, error) {
	return func() (bool, uint64, error) {
		h.mu.Lock()
		h.next = h.next%4 + 1
		class := h.next
		h.mu.Unlock()
		return h.attempt(id, class)()
	}
}

// arrive starts request id and returns once it is queued or has returned.
func (h *harness) arrive(ctx context.Context, id string, r flowcontrol.Request) {
	h.t.Helper()
	h.arriveAs(ctx, id, r, r.Class)
}

// arriveAs is arrive for a request whose attempts draw on the capacity of class refusal and report
// it as the class of their refusal, whatever r.Class.
func (h *harness) arriveAs(ctx context.Context, id string, r flowcontrol.Request, refusal uint64) {
	h.t.Helper()
	r.Model = model
	before := flowcontrol.Enqueued(h.c, model)
	h.wg.Add(1)
	go func() {
		defer h.wg.Done()
		err := h.c.Wait(ctx, r, h.attempt(id, refusal))
		h.mu.Lock()
		h.results[id] = err
		h.mu.Unlock()
	}()
	require.Eventually(h.t, func() bool {
		h.mu.Lock()
		_, done := h.results[id]
		h.mu.Unlock()
		return done || flowcontrol.Enqueued(h.c, model) > before
	}, 5*time.Second, time.Millisecond, "request %s neither queued nor returned", id)
}

// free frees n units of class capacity, notifies, and waits until served requests reach want.
func (h *harness) free(class uint64, n, want int) {
	h.t.Helper()
	h.mu.Lock()
	h.capacity[class] += n
	h.mu.Unlock()
	h.c.Notify(model)
	require.Eventually(h.t, func() bool {
		h.mu.Lock()
		defer h.mu.Unlock()
		return len(h.order) >= want
	}, 5*time.Second, time.Millisecond)
}

// serveAll frees one unit at a time until n more requests were served, and returns the order of
// every served request.
func (h *harness) serveAll(class uint64, n int) []string {
	h.t.Helper()
	h.mu.Lock()
	base := len(h.order)
	h.mu.Unlock()
	for i := 1; i <= n; i++ {
		h.free(class, 1, base+i)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.order...)
}

func (h *harness) result(id string) error {
	h.t.Helper()
	var err error
	require.Eventually(h.t, func() bool {
		h.mu.Lock()
		defer h.mu.Unlock()
		var ok bool
		err, ok = h.results[id]
		return ok
	}, 5*time.Second, time.Millisecond, "request %s did not return", id)
	return err
}

func TestNewRejectsInvalidConfig(t *testing.T) {
	t.Parallel()
	for name, cfg := range map[string]flowcontrol.Config{
		"duplicate priority": {Bands: []flowcontrol.Band{{Priority: 1}, {Priority: 1}}},
		"negative TTL":       {Bands: []flowcontrol.Band{{TTL: -time.Second}}},
		"negative band cap":  {Bands: []flowcontrol.Band{{MaxQueued: -1}}},
		"negative cap":       {MaxQueued: -1},
		"negative half-life": {HalfLife: -time.Second},
		"negative KV":        {KVThreshold: -0.1},
		"NaN KV":             {KVThreshold: math.NaN()},
	} {
		_, err := flowcontrol.New(cfg)
		assert.ErrorIs(t, err, state.ErrInvalidConfiguration, name)
	}
}

func TestBandOfPriority(t *testing.T) {
	t.Parallel()
	c, err := flowcontrol.New(flowcontrol.Config{Bands: []flowcontrol.Band{{Priority: 0}, {Priority: 10}}})
	require.NoError(t, err)
	for p, want := range map[int]int{20: 10, 10: 10, 9: 0, 0: 0, -3: 0} {
		assert.Equal(t, want, flowcontrol.BandOf(c, p), "priority %d", p)
	}
}

// A request the fleet can serve at once is served without waiting; one it cannot waits and is
// served when capacity frees.
func TestWaitServesWhenCapacityFrees(t *testing.T) {
	t.Parallel()
	h := newHarness(t, flowcontrol.Config{})
	h.capacity[0] = 1
	h.arrive(context.Background(), "a", flowcontrol.Request{})
	require.NoError(t, h.result("a"))
	h.arrive(context.Background(), "b", flowcontrol.Request{})
	assert.Equal(t, 1, flowcontrol.Queued(h.c, model))
	assert.Equal(t, []string{"a", "b"}, h.serveAll(0, 1))
	require.NoError(t, h.result("b"))
	assert.Equal(t, 0, flowcontrol.Queued(h.c, model))
	assert.Equal(t, map[string]int{"a": 1, "b": 2}, h.attempts)
}

func TestStrictBandOrder(t *testing.T) {
	t.Parallel()
	h := newHarness(t, flowcontrol.Config{Bands: []flowcontrol.Band{{Priority: 0}, {Priority: 10}}})
	for _, id := range []string{"low1", "low2", "low3"} {
		h.arrive(context.Background(), id, flowcontrol.Request{Priority: 0, Cost: 1})
	}
	for _, id := range []string{"high1", "high2"} {
		h.arrive(context.Background(), id, flowcontrol.Request{Priority: 10, Cost: 1_000_000, Flow: "heavy"})
	}
	assert.Equal(t, []string{"high1", "high2", "low1", "low2", "low3"}, h.serveAll(0, 5))
}

// A flow sending ten times the requests of another does not starve it: flows alternate while both
// wait (least attained service first, ties to the older head), each in its own arrival order.
func TestFairShareBetweenFlows(t *testing.T) {
	t.Parallel()
	h := newHarness(t, flowcontrol.Config{})
	var want []string
	for i := range 10 {
		id := "A" + string(rune('0'+i))
		h.arrive(context.Background(), id, flowcontrol.Request{Flow: "A", Cost: 100})
	}
	h.arrive(context.Background(), "B0", flowcontrol.Request{Flow: "B", Cost: 100})
	h.arrive(context.Background(), "B1", flowcontrol.Request{Flow: "B", Cost: 100})
	want = append(want, "A0", "B0", "A1", "B1", "A2", "A3", "A4", "A5", "A6", "A7", "A8", "A9")
	assert.Equal(t, want, h.serveAll(0, 12))
}

// Weights divide attained service: a flow of weight 3 receives three times the tokens.
func TestWeightedFairShare(t *testing.T) {
	t.Parallel()
	weights := map[string]float64{"A": 1, "B": 3}
	h := newHarness(t, flowcontrol.Config{Weight: func(f string) float64 { return weights[f] }})
	for _, id := range []string{"A1", "A2", "A3", "A4"} {
		h.arrive(context.Background(), id, flowcontrol.Request{Flow: "A", Cost: 100})
	}
	for _, id := range []string{"B1", "B2", "B3", "B4"} {
		h.arrive(context.Background(), id, flowcontrol.Request{Flow: "B", Cost: 100})
	}
	// Service ÷ weight: A1 (A 100), B1 (B 33), B2 (67), B3 (100), A2 (tie at 100: the older
	// head), B4, then A's rest.
	assert.Equal(t, []string{"A1", "B1", "B2", "B3", "A2", "B4", "A3", "A4"}, h.serveAll(0, 8))
}

// Attained service decays with the half-life: 400 tokens served an half-life ago weigh 200, less
// than 300 served now; without the decay they weigh more.
func TestAttainedServiceDecays(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		halfLife time.Duration
		want     []string
	}{
		{time.Minute, []string{"A", "B"}},
		{1000 * time.Hour, []string{"B", "A"}},
	} {
		c, err := flowcontrol.New(flowcontrol.Config{HalfLife: tc.halfLife})
		require.NoError(t, err)
		now := time.Unix(1000, 0)
		var clockMu sync.Mutex
		flowcontrol.SetClock(c, func() time.Time { clockMu.Lock(); defer clockMu.Unlock(); return now })
		h := &harness{t: t, c: c, capacity: map[uint64]int{}, attempts: map[string]int{}, results: map[string]error{}}
		h.capacity[0] = 5
		for i := range 4 {
			h.arrive(context.Background(), "a"+string(rune('0'+i)), flowcontrol.Request{Flow: "A", Cost: 100})
		}
		clockMu.Lock()
		now = now.Add(time.Minute)
		clockMu.Unlock()
		h.arrive(context.Background(), "b0", flowcontrol.Request{Flow: "B", Cost: 300})
		h.arrive(context.Background(), "A", flowcontrol.Request{Flow: "A", Cost: 1})
		h.arrive(context.Background(), "B", flowcontrol.Request{Flow: "B", Cost: 1})
		order := h.serveAll(0, 2)
		assert.Equal(t, tc.want, order[5:], "half-life %v", tc.halfLife)
		h.wg.Wait()
	}
}

// After a request of a class is refused, the other requests of its class are not tried in that
// pass, and a request of another class is: a waiting request of a blocked class holds back no
// request that has room.
func TestRefusedClassDoesNotBlockOthers(t *testing.T) {
	t.Parallel()
	h := newHarness(t, flowcontrol.Config{})
	h.arrive(context.Background(), "x1", flowcontrol.Request{Class: 1})
	h.arrive(context.Background(), "x2", flowcontrol.Request{Class: 1})
	h.arrive(context.Background(), "y1", flowcontrol.Request{Class: 2})
	assert.Equal(t, []string{"y1"}, h.serveAll(2, 1))
	require.NoError(t, h.result("y1"))
	h.mu.Lock()
	assert.Equal(t, map[string]int{"x1": 2, "x2": 1, "y1": 2}, h.attempts, "x2 is not tried after x1's refusal")
	h.mu.Unlock()
	// A new request of class 2 has room: it is served at once, though class 1 waits.
	h.mu.Lock()
	h.capacity[2] = 1
	h.mu.Unlock()
	h.arrive(context.Background(), "y2", flowcontrol.Request{Class: 2})
	require.NoError(t, h.result("y2"))
	assert.Equal(t, 2, flowcontrol.Queued(h.c, model))
	assert.Equal(t, []string{"y1", "y2", "x1", "x2"}, h.serveAll(1, 2))
}

// A refused request takes its refusal's class: requests of one Class refused for different
// reasons (enginepick: by different engines) are skipped apart, and the count of waiting
// requests per class follows them.
func TestRefusalClassReplacesTheRequestClass(t *testing.T) {
	t.Parallel()
	h := newHarness(t, flowcontrol.Config{})
	ctx := context.Background()
	h.arriveAs(ctx, "a", flowcontrol.Request{Class: 1}, 10)
	h.arriveAs(ctx, "b", flowcontrol.Request{Class: 1}, 11)
	h.arriveAs(ctx, "c", flowcontrol.Request{Class: 1}, 10)
	assert.Equal(t, map[uint64]int{10: 2, 11: 1}, flowcontrol.Classes(h.c, model))
	assert.Equal(t, []string{"b"}, h.serveAll(11, 1), "a's refusal does not hold b back")
	require.NoError(t, h.result("b"))
	h.mu.Lock()
	// a and b arrive with class 1 and are refused with 10 and 11, new classes: each is tried
	// once more at once, refused alike. c's refusal, 10, was met first by a: c stops there.
	assert.Equal(t, map[string]int{"a": 3, "b": 3, "c": 1}, h.attempts, "c is not tried after a's refusal")
	h.mu.Unlock()
	assert.Equal(t, map[uint64]int{10: 2}, flowcontrol.Classes(h.c, model))
	assert.Equal(t, []string{"b", "a", "c"}, h.serveAll(10, 2))
	assert.Empty(t, flowcontrol.Classes(h.c, model))
}

// A request refused by a class no request met in this pass is tried again at once, until a
// refusal repeats: the capacity that frees goes to the first request in order, whichever class
// the attempts pick first (round-robin over engines with caps).
func TestMovedRefusalKeepsTheTurn(t *testing.T) {
	t.Parallel()
	h := newHarness(t, flowcontrol.Config{})
	ctx := context.Background()
	for _, id := range []string{"first", "second"} {
		r := flowcontrol.Request{Model: model, Class: 100}
		before := flowcontrol.Enqueued(h.c, model)
		h.wg.Add(1)
		go func() {
			defer h.wg.Done()
			err := h.c.Wait(ctx, r, h.rotating(id))
			h.mu.Lock()
			h.results[id] = err
			h.mu.Unlock()
		}()
		require.Eventually(t, func() bool { return flowcontrol.Enqueued(h.c, model) > before }, 5*time.Second, time.Millisecond)
	}
	h.mu.Lock()
	// first: classes 1, 2, 3, 4, then 1 again; second: 2, refused first by first.
	assert.Equal(t, map[string]int{"first": 5, "second": 1}, h.attempts)
	h.mu.Unlock()
	// Class 1 frees: first picks 3 and 4, then 1; the pass goes on with second, which picks 2,
	// refused as before.
	assert.Equal(t, []string{"first"}, h.serveAll(1, 1))
	require.NoError(t, h.result("first"))
	// The pass goes on with second after first's result is out: wait for its attempt.
	require.Eventually(t, func() bool {
		h.mu.Lock()
		defer h.mu.Unlock()
		return h.attempts["second"] >= 2
	}, 5*time.Second, time.Millisecond)
	h.mu.Lock()
	assert.Equal(t, map[string]int{"first": 8, "second": 2}, h.attempts)
	h.mu.Unlock()
	assert.Equal(t, 1, flowcontrol.Queued(h.c, model))
	assert.Equal(t, []string{"first", "second"}, h.serveAll(1, 1))
}

func TestBandTTLEndsTheWait(t *testing.T) {
	t.Parallel()
	const ttl = 40 * time.Millisecond
	h := newHarness(t, flowcontrol.Config{Bands: []flowcontrol.Band{{TTL: ttl}}})
	start := time.Now()
	h.arrive(context.Background(), "a", flowcontrol.Request{})
	err := h.result("a")
	elapsed := time.Since(start)
	require.ErrorIs(t, err, flowcontrol.ErrTimeout)
	assert.NotErrorIs(t, err, context.DeadlineExceeded)
	assert.GreaterOrEqual(t, elapsed, ttl)
	assert.Less(t, elapsed, ttl+time.Second)
	assert.Equal(t, 0, flowcontrol.Queued(h.c, model))
}

func TestContextEndsTheWait(t *testing.T) {
	t.Parallel()
	h := newHarness(t, flowcontrol.Config{Bands: []flowcontrol.Band{{TTL: time.Hour}}})
	const timeout = 40 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	start := time.Now()
	h.arrive(ctx, "deadline", flowcontrol.Request{})
	require.ErrorIs(t, h.result("deadline"), context.DeadlineExceeded)
	assert.Less(t, time.Since(start), timeout+time.Second)

	ctx2, cancel2 := context.WithCancel(context.Background())
	h.arrive(ctx2, "cancelled", flowcontrol.Request{})
	h.arrive(context.Background(), "next", flowcontrol.Request{})
	require.Equal(t, 2, flowcontrol.Queued(h.c, model))
	cancel2()
	require.ErrorIs(t, h.result("cancelled"), context.Canceled)
	assert.Equal(t, 1, flowcontrol.Queued(h.c, model))
	assert.Equal(t, []string{"next"}, h.serveAll(0, 1), "the cancelled request is gone")
}

// A full queue displaces the newest request of the lowest band below the arrival's, and rejects
// an arrival with no lower band to displace.
func TestFullQueueShedsTheLowestBandFirst(t *testing.T) {
	t.Parallel()
	h := newHarness(t, flowcontrol.Config{MaxQueued: 3, Bands: []flowcontrol.Band{{Priority: 0}, {Priority: 5}, {Priority: 10}}})
	h.arrive(context.Background(), "mid1", flowcontrol.Request{Priority: 5})
	h.arrive(context.Background(), "low1", flowcontrol.Request{Priority: 0})
	h.arrive(context.Background(), "low2", flowcontrol.Request{Priority: 0})
	h.arrive(context.Background(), "high1", flowcontrol.Request{Priority: 10})
	var rej *flowcontrol.RejectedError
	require.ErrorAs(t, h.result("low2"), &rej)
	assert.Equal(t, "displaced", rej.Reason)
	assert.Equal(t, 0, rej.Priority)
	assert.Equal(t, time.Second, rej.RetryAfter, "no dispatch yet: 1 s")

	h.arrive(context.Background(), "low3", flowcontrol.Request{Priority: 0})
	require.ErrorAs(t, h.result("low3"), &rej)
	assert.Equal(t, "queue_full", rej.Reason)

	h.arrive(context.Background(), "mid2", flowcontrol.Request{Priority: 5})
	require.ErrorAs(t, h.result("low1"), &rej)
	assert.Equal(t, "displaced", rej.Reason)

	h.arrive(context.Background(), "mid3", flowcontrol.Request{Priority: 5})
	require.ErrorAs(t, h.result("mid3"), &rej, "no band below 5 holds a request")
	assert.Equal(t, "queue_full", rej.Reason)
	assert.Equal(t, 5, rej.Priority)
	assert.Equal(t, []string{"high1", "mid1", "mid2"}, h.serveAll(0, 3))
}

// In a full queue or band, an arrival whose flow is served before the flow served last displaces
// that flow's newest request; an arrival of the flow served last is rejected. A flow sending ten
// times the others fills the queue without shutting them out.
func TestFullQueueDisplacesTheFlowServedLast(t *testing.T) {
	t.Parallel()
	for name, cfg := range map[string]flowcontrol.Config{
		"model cap": {MaxQueued: 3},
		"band cap":  {Bands: []flowcontrol.Band{{MaxQueued: 3}}},
	} {
		h := newHarness(t, cfg)
		h.capacity[0] = 1
		h.arrive(context.Background(), "heavy0", flowcontrol.Request{Flow: "heavy", Cost: 100})
		require.NoError(t, h.result("heavy0"), name)
		for _, id := range []string{"heavy1", "heavy2", "heavy3"} {
			h.arrive(context.Background(), id, flowcontrol.Request{Flow: "heavy", Cost: 100})
		}
		h.arrive(context.Background(), "heavy4", flowcontrol.Request{Flow: "heavy", Cost: 100})
		var rej *flowcontrol.RejectedError
		require.ErrorAs(t, h.result("heavy4"), &rej, name)
		assert.Equal(t, "queue_full", rej.Reason, "%s: the flow served last cannot displace itself", name)

		h.arrive(context.Background(), "light0", flowcontrol.Request{Flow: "light", Cost: 100})
		require.ErrorAs(t, h.result("heavy3"), &rej, name)
		assert.Equal(t, "displaced", rej.Reason, name)
		assert.Equal(t, 0, rej.Priority, name)
		h.arrive(context.Background(), "light1", flowcontrol.Request{Flow: "light", Cost: 100})
		require.ErrorAs(t, h.result("heavy2"), &rej, name)
		assert.Equal(t, "displaced", rej.Reason, name)

		// light has no service yet and heavy 100: light0 first, then a tie at 100 goes to the older
		// head.
		assert.Equal(t, []string{"heavy0", "light0", "heavy1", "light1"}, h.serveAll(0, 3), name)
		h.wg.Wait()
	}
}

func TestBandCapRejects(t *testing.T) {
	t.Parallel()
	h := newHarness(t, flowcontrol.Config{Bands: []flowcontrol.Band{{Priority: 0, MaxQueued: 1}, {Priority: 1}}})
	h.arrive(context.Background(), "a", flowcontrol.Request{})
	h.arrive(context.Background(), "b", flowcontrol.Request{})
	var rej *flowcontrol.RejectedError
	require.ErrorAs(t, h.result("b"), &rej)
	assert.Equal(t, "queue_full", rej.Reason)
	h.arrive(context.Background(), "c", flowcontrol.Request{Priority: 1})
	assert.Equal(t, 2, flowcontrol.Queued(h.c, model))
	assert.Equal(t, []string{"c", "a"}, h.serveAll(0, 2))
}

func TestSheddableBandNeverWaits(t *testing.T) {
	t.Parallel()
	h := newHarness(t, flowcontrol.Config{Bands: []flowcontrol.Band{{Priority: -1, Sheddable: true}, {Priority: 0}}})
	h.capacity[0] = 1
	h.arrive(context.Background(), "served", flowcontrol.Request{Priority: -1})
	require.NoError(t, h.result("served"))
	h.arrive(context.Background(), "shed", flowcontrol.Request{Priority: -1})
	var rej *flowcontrol.RejectedError
	require.ErrorAs(t, h.result("shed"), &rej)
	assert.Equal(t, "sheddable", rej.Reason)
	assert.Equal(t, -1, rej.Priority)
	assert.Equal(t, 0, flowcontrol.Queued(h.c, model))
}

// RetryAfter is the time the waiting requests of the band and above take at the recent dispatch
// rate, rounded up to whole seconds: 100 dispatches within the half-life are a rate of
// 100 × ln 2 ÷ 60 s.
func TestRetryAfterFollowsTheDispatchRate(t *testing.T) {
	t.Parallel()
	c, err := flowcontrol.New(flowcontrol.Config{MaxQueued: 3})
	require.NoError(t, err)
	now := time.Unix(1000, 0)
	flowcontrol.SetClock(c, func() time.Time { return now })
	h := &harness{t: t, c: c, capacity: map[uint64]int{0: 100}, attempts: map[string]int{}, results: map[string]error{}}
	for i := range 100 {
		require.NoError(t, c.Wait(context.Background(), flowcontrol.Request{Model: model}, h.attempt(strconv.Itoa(i), 0)))
	}
	for _, id := range []string{"a", "b", "c", "d"} {
		h.arrive(context.Background(), id, flowcontrol.Request{})
	}
	var rej *flowcontrol.RejectedError
	require.ErrorAs(t, h.result("d"), &rej)
	assert.Equal(t, 3*time.Second, rej.RetryAfter, "3 ÷ (100 × ln 2 ÷ 60 s) = 2.597 s")
	h.serveAll(0, 3)
	h.wg.Wait()
}

func TestAttemptErrorEndsTheWait(t *testing.T) {
	t.Parallel()
	c, err := flowcontrol.New(flowcontrol.Config{})
	require.NoError(t, err)
	boom := errors.New("boom")
	calls := 0
	err = c.Wait(context.Background(), flowcontrol.Request{Model: model}, func() (bool, uint64, error) { calls++; return false, 0, boom })
	assert.ErrorIs(t, err, boom)
	assert.Equal(t, 1, calls)
	assert.Equal(t, 0, flowcontrol.Queued(c, model))
}

func TestSaturated(t *testing.T) {
	t.Parallel()
	def, err := flowcontrol.New(flowcontrol.Config{})
	require.NoError(t, err)
	off, err := flowcontrol.New(flowcontrol.Config{QueueThreshold: math.MaxUint64, KVThreshold: 1.5})
	require.NoError(t, err)
	rank := func(waiting, used, capacity uint64) *loadmon.EngineLoad {
		return &loadmon.EngineLoad{WaitingRequests: waiting, UsedKVTokens: used, KVCapacityTokens: capacity}
	}
	for _, tc := range []struct {
		name      string
		c         *flowcontrol.Controller
		load      *loadmon.EngineLoad
		saturated bool
	}{
		{"unknown or stale load", def, nil, false},
		{"4 waiting", def, rank(4, 0, 0), false},
		{"5 waiting", def, rank(5, 0, 0), true},
		{"KV 79 %", def, rank(0, 79, 100), false},
		{"KV 80 %", def, rank(0, 80, 100), true},
		{"KV of unknown capacity", def, rank(0, 1000, 0), false},
		{"one of two ranks has room", def, &loadmon.EngineLoad{WaitingRequests: 9, RankLoads: []*loadmon.EngineLoad{rank(9, 0, 0), rank(0, 0, 0)}}, false},
		{"both ranks saturated", def, &loadmon.EngineLoad{WaitingRequests: 6, RankLoads: []*loadmon.EngineLoad{rank(5, 0, 0), rank(1, 90, 100)}}, true},
		{"thresholds off", off, rank(1000, 100, 100), false},
	} {
		assert.Equal(t, tc.saturated, tc.c.Saturated(tc.load), tc.name)
	}
}

func TestNotifyWithoutWaitersDoesNothing(t *testing.T) {
	c, err := flowcontrol.New(flowcontrol.Config{})
	require.NoError(t, err)
	c.Notify("unknown")
	assert.Equal(t, uint64(0), flowcontrol.Enqueued(c, "unknown"), "no queue is created")
	require.NoError(t, c.Wait(context.Background(), flowcontrol.Request{Model: model}, func() (bool, uint64, error) { return false, 0, nil }))
	assert.Equal(t, 0.0, testing.AllocsPerRun(100, func() { c.Notify(model) }))
}
