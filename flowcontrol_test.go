package enginepick_test

import (
	"context"
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/flowcontrol"
	"github.com/enginepick/enginepick/internal/flowbridge"
	"github.com/enginepick/enginepick/internal/loadbridge"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// flowFleet: model "m" has a bucket "short" (inputs up to 100 tokens) over plain engines s1 and s2
// and a bucket "long" (101 to 1,000 tokens) over l1; model "pd" has one PD bucket over p1 and d1.
// Every group runs least-load, with an in-flight cap per engine when inflightCap > 0.
type flowFleet struct {
	router   *enginepick.Router
	reg      *state.StaticRegistry
	load     *loadmon.Table
	inflight *loadmon.InFlight
}

func newFlowFleet(t *testing.T, fc *flowcontrol.Controller, inflightCap uint64, opts ...loadmon.Option) *flowFleet {
	t.Helper()
	f := &flowFleet{reg: &state.StaticRegistry{}, load: loadmon.NewTable(opts...), inflight: loadmon.NewInFlight(nil)}
	for _, e := range []*state.StaticEngine{
		state.NewStaticEngine("s1", "m", state.StagePlain), state.NewStaticEngine("s2", "m", state.StagePlain),
		state.NewStaticEngine("l1", "m", state.StagePlain),
		state.NewStaticEngine("p1", "pd", state.StagePrefill), state.NewStaticEngine("d1", "pd", state.StageDecode),
	} {
		require.NoError(t, f.reg.Add(e))
	}
	var limits admission.Limits
	if inflightCap > 0 {
		limits.MaxInFlightRequests = admission.Cap(inflightCap)
	}
	group := func(members ...state.EngineID) *bucket.EngineGroup {
		p, err := policy.NewLeastLoad(policy.Config{Load: f.load, InFlight: f.inflight, Admission: limits})
		require.NoError(t, err)
		g, err := bucket.NewEngineGroup(p, members)
		require.NoError(t, err)
		return g
	}
	short, err := bucket.NewPlainBucket(bucket.Spec{ID: "short", MaxInputTokens: 100}, group("s1", "s2"))
	require.NoError(t, err)
	long, err := bucket.NewPlainBucket(bucket.Spec{ID: "long", MinInputTokens: 101, MaxInputTokens: 1000}, group("l1"))
	require.NoError(t, err)
	pd, err := bucket.NewPDBucket(bucket.Spec{ID: "pd"}, group("p1"), group("d1"))
	require.NoError(t, err)
	rm, err := bucket.NewResolver([]*bucket.Bucket{short, long}, bucket.ResolverOptions{})
	require.NoError(t, err)
	rpd, err := bucket.NewResolver([]*bucket.Bucket{pd}, bucket.ResolverOptions{})
	require.NoError(t, err)
	f.router, err = enginepick.NewRouter(enginepick.Options{Registry: f.reg, InFlight: f.inflight, Load: f.load,
		Resolvers: map[state.ModelID]*bucket.Resolver{"m": rm, "pd": rpd}, FlowControl: fc})
	require.NoError(t, err)
	return f
}

func shortReq() *bucket.Request {
	return &bucket.Request{Model: "m", Signals: bucket.Signals{InputTokens: 10}}
}

func longReq() *bucket.Request {
	return &bucket.Request{Model: "m", Signals: bucket.Signals{InputTokens: 500}}
}

type selected struct {
	d   *enginepick.Dispatch
	err error
}

// selectAsync runs Select on its own goroutine; the test must receive the result.
func (f *flowFleet) selectAsync(ctx context.Context, req *bucket.Request) <-chan selected {
	ch := make(chan selected, 1)
	go func() {
		d, err := f.router.Select(ctx, req)
		ch <- selected{d, err}
	}()
	return ch
}

// lastRefusal runs a Select of longReq that waits, ends its wait and returns the admission
// rejection its error carries as the last refusal.
func (f *flowFleet) lastRefusal(t *testing.T, ctx context.Context) *policy.AdmissionRejectedError {
	t.Helper()
	cctx, cancel := context.WithCancel(ctx)
	late := f.selectAsync(cctx, longReq())
	waits(t, late)
	cancel()
	var rej *policy.AdmissionRejectedError
	require.ErrorAs(t, (<-late).err, &rej, "the last refusal")
	return rej
}

// waits asserts that the Select behind ch has not returned after a moment.
func waits(t *testing.T, ch <-chan selected) {
	t.Helper()
	select {
	case s := <-ch:
		t.Fatalf("Select returned while the fleet is saturated: %v, %v", s.d, s.err)
	case <-time.After(30 * time.Millisecond):
	}
}

// served receives the Select behind ch and returns its dispatch.
func served(t *testing.T, ch <-chan selected) *enginepick.Dispatch {
	t.Helper()
	select {
	case s := <-ch:
		require.NoError(t, s.err)
		return s.d
	case <-time.After(5 * time.Second):
		t.Fatal("Select did not return")
		return nil
	}
}

func engineOf(d *enginepick.Dispatch) state.EngineID { return d.Selection.Plain.Engine.ID() }

func mustController(t *testing.T, cfg flowcontrol.Config) *flowcontrol.Controller {
	t.Helper()
	c, err := flowcontrol.New(cfg)
	require.NoError(t, err)
	return c
}

// Today a capped fleet answers 503 at once; with flow control the request waits and is served when
// a dispatch ends.
func TestFlowControlWaitsForADispatchToEnd(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	plain := newFlowFleet(t, nil, 1)
	d1, err := plain.router.Select(ctx, shortReq())
	require.NoError(t, err)
	d2, err := plain.router.Select(ctx, shortReq())
	require.NoError(t, err)
	_, err = plain.router.Select(ctx, shortReq())
	var ex *bucket.ExhaustedError
	require.ErrorAs(t, err, &ex, "without flow control: 503 at once")
	assert.Equal(t, http.StatusServiceUnavailable, bucket.StatusCode(err))
	d1.Release()
	d2.Release()

	f := newFlowFleet(t, mustController(t, flowcontrol.Config{}), 1)
	d1, err = f.router.Select(ctx, shortReq())
	require.NoError(t, err)
	d2, err = f.router.Select(ctx, shortReq())
	require.NoError(t, err)
	third := f.selectAsync(ctx, shortReq())
	waits(t, third)
	freed := engineOf(d2)
	d2.Done(enginepick.Outcome{})
	d3 := served(t, third)
	assert.Equal(t, freed, engineOf(d3))
	assert.Equal(t, uint64(1), f.inflight.Count("s1"))
	assert.Equal(t, uint64(1), f.inflight.Count("s2"))
	d1.Release()
	d3.Release()
}

// A PD selection waits until both legs have room, and the whole Select runs again: ending the
// prefill leg alone does not serve a request waiting for the decode engine.
func TestFlowControlPDWaitsForBothLegs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFlowFleet(t, mustController(t, flowcontrol.Config{}), 1)
	req := &bucket.Request{Model: "pd", Signals: bucket.Signals{InputTokens: 10}}
	d1, err := f.router.Select(ctx, req)
	require.NoError(t, err)
	second := f.selectAsync(ctx, req)
	waits(t, second)
	d1.ReleaseStage(state.StagePrefill)
	waits(t, second)
	d1.ReleaseStage(state.StageDecode)
	d2 := served(t, second)
	assert.Equal(t, state.EngineID("p1"), d2.Selection.Prefill.Engine.ID())
	assert.Equal(t, state.EngineID("d1"), d2.Selection.Decode.Engine.ID())
	d1.Release()
	d2.Release()
	assert.Equal(t, uint64(0), f.inflight.Count("p1"))
}

// The detector: with no caps, a request waits while every candidate engine's fresh report is at
// the queue threshold, and a report with room serves it; no dispatch needs to end.
func TestFlowControlDetectorWaitsForAReport(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFlowFleet(t, mustController(t, flowcontrol.Config{QueueThreshold: 4}), 0)
	require.NoError(t, f.load.Report(loadmon.Report{Engine: "s1", WaitingRequests: 4}))
	require.NoError(t, f.load.Report(loadmon.Report{Engine: "s2", WaitingRequests: 9}))
	waiting := f.selectAsync(ctx, shortReq())
	waits(t, waiting)
	require.NoError(t, f.load.Report(loadmon.Report{Engine: "s1", WaitingRequests: 3}))
	d := served(t, waiting)
	assert.Equal(t, state.EngineID("s1"), engineOf(d))
	d.Release()
}

// Unknown or stale load is not saturated (the detector fails open, as admission does): only fresh
// reports at the thresholds hold a request back.
func TestFlowControlDetectorUnknownAndStaleLoad(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	clock := time.Unix(1000, 0)
	now := func() time.Time { return clock }
	for _, tc := range []struct {
		name    string
		reports []loadmon.Report
		age     time.Duration
		waits   bool
	}{
		{"every engine unknown", nil, 0, false},
		{"one engine unknown, the other saturated", []loadmon.Report{{Engine: "s1", WaitingRequests: 5}}, 0, false},
		{"both saturated", []loadmon.Report{{Engine: "s1", WaitingRequests: 5}, {Engine: "s2", KVCapacityTokens: 10, UsedKVTokens: 8}}, 0, true},
		{"both saturated, reports at the freshness", []loadmon.Report{{Engine: "s1", WaitingRequests: 5}, {Engine: "s2", WaitingRequests: 5}}, loadmon.DefaultFreshness, true},
		{"both saturated, reports stale", []loadmon.Report{{Engine: "s1", WaitingRequests: 5}, {Engine: "s2", WaitingRequests: 5}}, loadmon.DefaultFreshness + 1, false},
	} {
		clock = time.Unix(1000, 0)
		f := newFlowFleet(t, mustController(t, flowcontrol.Config{}), 0, loadmon.WithClock(now))
		for _, r := range tc.reports {
			require.NoError(t, f.load.Report(r))
		}
		clock = clock.Add(tc.age)
		ctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		d, err := f.router.Select(ctx, shortReq())
		cancel()
		if tc.waits {
			require.ErrorIs(t, err, context.DeadlineExceeded, tc.name)
			assert.ErrorContains(t, err, "saturation detector", tc.name)
			continue
		}
		require.NoError(t, err, tc.name)
		d.Release()
	}
}

// Reports that stop while they show the fleet saturated go stale, and stale load is not
// saturated: the waiting request is served once the freshness has passed, without another event.
func TestFlowControlDetectorWakesWhenReportsGoStale(t *testing.T) {
	t.Parallel()
	const freshness = 50 * time.Millisecond
	f := newFlowFleet(t, mustController(t, flowcontrol.Config{}), 0, loadmon.WithFreshness(freshness))
	start := time.Now()
	require.NoError(t, f.load.Report(loadmon.Report{Engine: "s1", WaitingRequests: 5}))
	require.NoError(t, f.load.Report(loadmon.Report{Engine: "s2", WaitingRequests: 5}))
	ch := f.selectAsync(context.Background(), shortReq())
	d := served(t, ch)
	assert.GreaterOrEqual(t, time.Since(start), freshness)
	d.Release()
}

// Work-conserving: a request whose engines have room is served at once, even while requests that
// cannot be served wait; and a dispatch end serves the waiting request it makes room for.
func TestFlowControlIsWorkConserving(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFlowFleet(t, mustController(t, flowcontrol.Config{}), 1)
	d1, err := f.router.Select(ctx, shortReq())
	require.NoError(t, err)
	d2, err := f.router.Select(ctx, shortReq()) // s1 is full, s2 has room: served, not queued
	require.NoError(t, err)
	assert.ElementsMatch(t, []state.EngineID{"s1", "s2"}, []state.EngineID{engineOf(d1), engineOf(d2)})
	shortWaits := f.selectAsync(ctx, shortReq())
	waits(t, shortWaits)
	l1, err := f.router.Select(ctx, longReq()) // a short request waits; l1 has room
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("l1"), engineOf(l1))
	longWaits := f.selectAsync(ctx, longReq())
	waits(t, longWaits)
	d1.Release() // room for the short request only
	d3 := served(t, shortWaits)
	waits(t, longWaits)
	l1.Release()
	l2 := served(t, longWaits)
	for _, d := range []*enginepick.Dispatch{d2, d3, l2} {
		d.Release()
	}
}

// Priorities through the Router: the higher band is served first however late it came.
func TestFlowControlServesHigherPriorityFirst(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFlowFleet(t, mustController(t, flowcontrol.Config{Bands: []flowcontrol.Band{{Priority: 0}, {Priority: 1}}}), 1)
	l, err := f.router.Select(ctx, longReq())
	require.NoError(t, err)
	low := longReq()
	lowCh := f.selectAsync(ctx, low)
	waits(t, lowCh)
	high := longReq()
	high.Priority = 1
	highCh := f.selectAsync(ctx, high)
	waits(t, highCh)
	l.Release()
	h := served(t, highCh)
	waits(t, lowCh)
	h.Release()
	served(t, lowCh).Release()
}

// Removing an engine wakes the requests waiting for it: with no candidate left, they fail at once.
func TestFlowControlRemovedEngineWakesItsWaiters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFlowFleet(t, mustController(t, flowcontrol.Config{}), 1)
	l, err := f.router.Select(ctx, longReq())
	require.NoError(t, err)
	ch := f.selectAsync(ctx, longReq())
	waits(t, ch)
	require.True(t, f.reg.Remove("l1"))
	f.router.RemoveEngine("l1")
	s := <-ch
	require.ErrorIs(t, s.err, policy.ErrNoCandidates)
	assert.Equal(t, http.StatusServiceUnavailable, bucket.StatusCode(s.err))
	l.Release()
}

// Every way a wait ends has its typed error and status.
func TestFlowControlErrors(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	fc := mustController(t, flowcontrol.Config{MaxQueued: 1, Bands: []flowcontrol.Band{
		{Priority: -1, Sheddable: true}, {Priority: 0, TTL: 30 * time.Millisecond}, {Priority: 1}}})
	f := newFlowFleet(t, fc, 1)
	l, err := f.router.Select(ctx, longReq())
	require.NoError(t, err)

	shed := longReq()
	shed.Priority = -1
	_, err = f.router.Select(ctx, shed)
	var rej *flowcontrol.RejectedError
	require.ErrorAs(t, err, &rej)
	assert.Equal(t, "sheddable", rej.Reason)
	assert.Equal(t, http.StatusTooManyRequests, bucket.StatusCode(err))
	assert.Equal(t, time.Second, rej.RetryAfter)

	start := time.Now()
	_, err = f.router.Select(ctx, longReq())
	require.ErrorIs(t, err, flowcontrol.ErrTimeout)
	assert.GreaterOrEqual(t, time.Since(start), 30*time.Millisecond)
	var ex *bucket.ExhaustedError
	assert.ErrorAs(t, err, &ex, "the last refusal is kept")
	assert.Equal(t, http.StatusServiceUnavailable, bucket.StatusCode(err))

	deadline, cancel := context.WithTimeout(ctx, 30*time.Millisecond)
	top := longReq()
	top.Priority = 1
	_, err = f.router.Select(deadline, top)
	cancel()
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Equal(t, http.StatusGatewayTimeout, bucket.StatusCode(err))

	cancelled, cancel := context.WithCancel(ctx)
	ch := f.selectAsync(cancelled, top)
	waits(t, ch)
	full := longReq() // band 0 is below the waiting request's band: rejected
	_, err = f.router.Select(ctx, full)
	require.ErrorAs(t, err, &rej)
	assert.Equal(t, "queue_full", rej.Reason)
	cancel()
	s := <-ch
	require.ErrorIs(t, s.err, context.Canceled)
	assert.Equal(t, 499, bucket.StatusCode(s.err))
	assert.True(t, errors.Is(s.err, context.Canceled))
	l.Release()
	d, err := f.router.Select(ctx, longReq())
	require.NoError(t, err, "the cancelled request left the queue")
	d.Release()
}

// cacheFleet is a Router under flow control over engines a and b, each holding the blocks of its
// own 64-token prompt (prompt), under cache_aware with an in-flight cap per engine.
type cacheFleet struct {
	*flowFleet
	prompts map[state.EngineID][]uint32
}

func newCacheFleet(t *testing.T, inflightCap uint64) *cacheFleet {
	t.Helper()
	inflight := loadmon.NewInFlight(nil)
	load := loadmon.NewTable()
	h, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: 16})
	require.NoError(t, err)
	index, err := kvindex.NewIndex(h, kvindex.Options{})
	require.NoError(t, err)
	src, err := kvindex.NewLocalSource(index)
	require.NoError(t, err)
	reg := &state.StaticRegistry{}
	prompts := map[state.EngineID][]uint32{"a": tokens(64, 1), "b": tokens(64, 2)}
	for _, id := range []state.EngineID{"a", "b"} {
		require.NoError(t, reg.Add(state.NewStaticEngine(id, "m", state.StagePlain)))
		require.NoError(t, index.Store(kvindex.StoreEvent{Engine: id, BlockHashes: h.Keys(prompts[id]), TokenIDs: prompts[id], Tier: kvindex.TierDevice}))
	}
	p, err := policy.NewCacheAware(policy.Config{Load: load, InFlight: inflight, Admission: admission.Limits{MaxInFlightRequests: admission.Cap(inflightCap)}},
		policy.CacheAwareOptions{Source: src, MinMatchedTokens: 16, DisableRoutePlacements: true})
	require.NoError(t, err)
	g, err := bucket.NewEngineGroup(p, nil)
	require.NoError(t, err)
	b, err := bucket.NewPlainBucket(bucket.Spec{ID: "all"}, g)
	require.NoError(t, err)
	res, err := bucket.NewResolver([]*bucket.Bucket{b}, bucket.ResolverOptions{})
	require.NoError(t, err)
	f := &flowFleet{reg: reg, load: load, inflight: inflight}
	f.router, err = enginepick.NewRouter(enginepick.Options{Registry: reg, InFlight: inflight, Load: load, Index: index,
		Resolvers: map[state.ModelID]*bucket.Resolver{"m": res}, FlowControl: mustController(t, flowcontrol.Config{})})
	require.NoError(t, err)
	return &cacheFleet{flowFleet: f, prompts: prompts}
}

// prompt is a request for the prompt engine id holds.
func (f *cacheFleet) prompt(id state.EngineID) *bucket.Request {
	return &bucket.Request{Model: "m", TokenIDs: f.prompts[id], Signals: bucket.Signals{InputTokens: int64(len(f.prompts[id]))}}
}

// fill dispatches n requests for the prompt engine id holds, each to id.
func (f *cacheFleet) fill(t *testing.T, id state.EngineID, n int) []*enginepick.Dispatch {
	t.Helper()
	var ds []*enginepick.Dispatch
	for range n {
		d, err := f.router.Select(context.Background(), f.prompt(id))
		require.NoError(t, err)
		require.Equal(t, id, engineOf(d))
		ds = append(ds, d)
	}
	return ds
}

// Under cache_aware with in-flight caps, a request waits only while no engine has room, and a
// freed slot goes to the first waiting request, whatever its prefix holders (docs/design.md §9.11,
// §17). Engines a and b (cap 2) each hold one prompt's blocks; both are full, A (a's prompt) and B
// (b's prompt) wait; when one of b's dispatches ends, A, first in order, is served by b, the
// cheapest engine with room, and B waits; when one of a's ends, B is served by a.
func TestFlowControlFreedSlotGoesToFirstWaitingRequest(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newCacheFleet(t, 2)
	heldA, heldB := f.fill(t, "a", 2), f.fill(t, "b", 2)
	chA := f.selectAsync(ctx, f.prompt("a"))
	waits(t, chA)
	chB := f.selectAsync(ctx, f.prompt("b"))
	waits(t, chB)
	heldB[0].Release()
	dA := served(t, chA)
	assert.Equal(t, state.EngineID("b"), engineOf(dA))
	assert.Equal(t, "no_cache_candidate", dA.Selection.Plain.Reason)
	waits(t, chB)
	heldA[0].Release()
	dB := served(t, chB)
	assert.Equal(t, state.EngineID("a"), engineOf(dB))
	for _, d := range []*enginepick.Dispatch{dA, dB, heldA[1], heldB[1]} {
		d.Release()
	}
}

// A request waiting for its prefix holders, at their caps, is served by an engine that goes idle
// (docs/design.md §9.11): engines do not idle while requests wait. Engines a and b (cap 1) each
// hold one prompt's blocks and run one request; A (a's prompt) waits; when b's request ends, A
// goes to b.
func TestFlowControlIdleEngineServesRequestWaitingForItsHolders(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newCacheFleet(t, 1)
	heldA, heldB := f.fill(t, "a", 1), f.fill(t, "b", 1)
	chA := f.selectAsync(ctx, f.prompt("a"))
	waits(t, chA)
	heldB[0].Release()
	dA := served(t, chA)
	assert.Equal(t, state.EngineID("b"), engineOf(dA))
	assert.Equal(t, "no_cache_candidate", dA.Selection.Plain.Reason)
	dA.Release()
	heldA[0].Release()
}

// Below the highest band, a request waits while its engine is still prefilling a dispatch of the
// router (no first token yet) and is served when the first token arrives; a request of the highest
// band, or of the only band, is served at once.
func TestFlowControlLowerBandWaitsForEnginePrefill(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, tc := range []struct {
		name  string
		bands []flowcontrol.Band
		holds bool
	}{
		{"two bands", []flowcontrol.Band{{Priority: 0}, {Priority: 1}}, true},
		{"one band", nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFlowFleet(t, mustController(t, flowcontrol.Config{Bands: tc.bands}), 0)
			first, err := f.router.Select(ctx, longReq())
			require.NoError(t, err, "no first token seen yet: no prefill is known to hold")
			first.FirstToken()
			d1, err := f.router.Select(ctx, longReq())
			require.NoError(t, err, "l1 has ended its prefills")
			require.Equal(t, uint64(500), loadbridge.Prefilling(f.inflight, "l1"))

			low := f.selectAsync(ctx, longReq())
			if !tc.holds {
				served(t, low).Release()
				d1.Release()
				first.Release()
				return
			}
			waits(t, low)
			rej := f.lastRefusal(t, ctx)
			assert.Equal(t, []any{flowbridge.LimitPrefilling, uint64(500), uint64(0)}, []any{rej.Limit, rej.Observed, rej.Cap},
				"the engine's prefill tokens in flight")
			high := longReq()
			high.Priority = 1
			h, err := f.router.Select(ctx, high)
			require.NoError(t, err, "the highest band is never held")
			assert.Equal(t, state.EngineID("l1"), engineOf(h))
			d1.FirstToken()
			waits(t, low) // l1 still prefills h
			h.FirstToken()
			d := served(t, low)
			assert.Equal(t, state.EngineID("l1"), engineOf(d))
			assert.Equal(t, uint64(4), f.inflight.Count("l1"))
			for _, x := range []*enginepick.Dispatch{d, h, d1, first} {
				x.Release()
			}
		})
	}
}

// With two bands, a request below the top band leaves an engine's last in-flight slot to the top
// band (docs/design.md §17): on l1 (cap 3) two band-0 requests run and a third waits, while a
// band-1 request takes the last slot at once; with one band the third is served. A cap of 1 keeps
// its slot for every band (TestFlowControlServesHigherPriorityFirst).
func TestFlowControlLowerBandLeavesTheLastSlot(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, tc := range []struct {
		name    string
		bands   []flowcontrol.Band
		reserve bool
	}{
		{"two bands", []flowcontrol.Band{{Priority: 0}, {Priority: 1}}, true},
		{"one band", nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFlowFleet(t, mustController(t, flowcontrol.Config{Bands: tc.bands}), 3)
			var running []*enginepick.Dispatch
			for range 2 {
				d, err := f.router.Select(ctx, longReq())
				require.NoError(t, err)
				running = append(running, d)
			}
			low := f.selectAsync(ctx, longReq())
			if !tc.reserve {
				running = append(running, served(t, low))
				assert.Equal(t, uint64(3), f.inflight.Count("l1"))
				for _, d := range running {
					d.Release()
				}
				return
			}
			waits(t, low)
			rej := f.lastRefusal(t, ctx)
			assert.Equal(t, []any{flowbridge.LimitTopBandSlot, uint64(2), uint64(3)}, []any{rej.Limit, rej.Observed, rej.Cap},
				"the engine's in-flight requests and its cap, of which the last slot is the top band's")
			high := longReq()
			high.Priority = 1
			h, err := f.router.Select(ctx, high)
			require.NoError(t, err, "the last slot is the top band's")
			assert.Equal(t, uint64(3), f.inflight.Count("l1"))
			waits(t, low) // l1 is full
			h.Release()
			waits(t, low) // the last slot again
			running[0].Release()
			d := served(t, low)
			assert.Equal(t, uint64(2), f.inflight.Count("l1"))
			d.Release()
			running[1].Release()
		})
	}
}

// capPicker picks the first engine under an in-flight cap without checking it, as a host policy
// may: the Router applies the cap, and the top band's last slot, when it counts the dispatch.
type capPicker struct{ cap uint64 }

func (p capPicker) Pick(_ context.Context, engines []state.Engine, _ *policy.Request) (policy.Pick, error) {
	return policy.Pick{Engine: engines[0], Reason: "fixed", InFlightCap: p.cap, HasInFlightCap: true}, nil
}

// The Router holds a request below the top band to the cap less its last slot when it counts the
// dispatch (docs/design.md §17), whatever the policy checked: under a cap of 3 the third band-0
// request is refused with top_band_slot, a band-1 request takes the last slot, and the next one is
// refused with max_inflight_requests.
func TestFlowControlRouterKeepsTheLastSlotForAnyPolicy(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	reg := &state.StaticRegistry{}
	require.NoError(t, reg.Add(state.NewStaticEngine("e1", "m", state.StagePlain)))
	group, err := bucket.NewEngineGroup(capPicker{cap: 3}, nil)
	require.NoError(t, err)
	all, err := bucket.NewPlainBucket(bucket.Spec{ID: "all"}, group)
	require.NoError(t, err)
	res, err := bucket.NewResolver([]*bucket.Bucket{all}, bucket.ResolverOptions{})
	require.NoError(t, err)
	router, err := enginepick.NewRouter(enginepick.Options{Registry: reg, InFlight: loadmon.NewInFlight(nil),
		Resolvers:   map[state.ModelID]*bucket.Resolver{"m": res},
		FlowControl: mustController(t, flowcontrol.Config{Bands: []flowcontrol.Band{{Priority: 0}, {Priority: 1}}})})
	require.NoError(t, err)
	req := func(priority int) *bucket.Request {
		return &bucket.Request{Model: "m", Priority: priority, Signals: bucket.Signals{InputTokens: 10}}
	}
	refusal := func(priority int) []any {
		cctx, cancel := context.WithTimeout(ctx, 30*time.Millisecond)
		defer cancel()
		_, err := router.Select(cctx, req(priority))
		var rej *policy.AdmissionRejectedError
		require.ErrorAs(t, err, &rej, "the last refusal")
		return []any{rej.Limit, rej.Observed, rej.Cap}
	}
	var running []*enginepick.Dispatch
	for range 2 {
		d, err := router.Select(ctx, req(0))
		require.NoError(t, err)
		running = append(running, d)
	}
	assert.Equal(t, []any{flowbridge.LimitTopBandSlot, uint64(2), uint64(3)}, refusal(0))
	d, err := router.Select(ctx, req(1))
	require.NoError(t, err, "the last slot is the top band's")
	assert.Equal(t, []any{admission.LimitInFlightRequests, uint64(3), uint64(3)}, refusal(1))
	for _, d := range append(running, d) {
		d.Release()
	}
}
