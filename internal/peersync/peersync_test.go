package peersync_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/enginepick/enginepick/internal/loadbridge"
	"github.com/enginepick/enginepick/internal/peersync"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

const (
	engA state.EngineID = "http://a"
	engB state.EngineID = "http://b"
)

var t0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// replica is one router replica's state over a fixed clock.
type replica struct {
	now      time.Time
	load     *loadmon.Table
	inflight *loadmon.InFlight
	index    *kvindex.Index
	source   *kvindex.LocalSource
	core     *peersync.Core
}

func newReplica(t *testing.T, id string, inc uint64) *replica {
	t.Helper()
	r := &replica{now: t0}
	clock := func() time.Time { return r.now }
	r.load = loadmon.NewTable(loadmon.WithClock(clock))
	r.inflight = loadmon.NewInFlight(clock)
	h, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: 4})
	require.NoError(t, err)
	r.index, err = kvindex.NewIndex(h, kvindex.Options{Now: clock})
	require.NoError(t, err)
	r.source, err = kvindex.NewLocalSource(r.index)
	require.NoError(t, err)
	r.core, err = peersync.New(peersync.Config{ID: id, Incarnation: inc, InFlight: r.inflight, Index: r.index,
		Known: func(e state.EngineID) bool { return e == engA || e == engB }, Lease: 3 * time.Second})
	require.NoError(t, err)
	t.Cleanup(r.core.Close)
	for _, e := range []state.EngineID{engA, engB} {
		require.NoError(t, r.load.Report(loadmon.Report{Engine: e, WaitingRequests: 1}))
	}
	return r
}

// dispatched returns the dispatches since the report and their prefill tokens that r's pressure
// comparisons see on engine.
func (r *replica) dispatched(engine state.EngineID) (uint64, uint64) {
	o := loadmon.Observe(r.load.Snapshot(), r.inflight, engine)
	return o.Dispatched, o.DispatchedTokens
}

func (r *replica) pendingPrefill(engine state.EngineID) uint64 {
	o := loadmon.Observe(r.load.Snapshot(), r.inflight, engine)
	p, ok := o.EstimatePendingPrefillTokens(r.inflight, 0)
	if !ok {
		panic("unknown load")
	}
	return p
}

func TestPeerDispatchesCountInPressureNotInFlight(t *testing.T) {
	a, b := newReplica(t, "a", 1), newReplica(t, "b", 1)
	g := a.inflight.Acquire(engA, -1, 100)
	require.NoError(t, b.core.Receive(a.core.Flush(false), b.now))

	n, tok := b.dispatched(engA)
	assert.Equal(t, uint64(1), n)
	assert.Equal(t, uint64(100), tok)
	assert.Equal(t, uint64(0), b.inflight.Count(engA), "a peer's dispatch is not this replica's in-flight")
	n, _ = b.dispatched(engB)
	assert.Equal(t, uint64(0), n)
	// A report after the dispatch reflects it: the peer's dispatch no longer counts as since.
	b.now = b.now.Add(time.Second)
	require.NoError(t, b.load.Report(loadmon.Report{Engine: engA, WaitingRequests: 2}))
	n, _ = b.dispatched(engA)
	assert.Equal(t, uint64(0), n)

	g.FirstToken()
	require.NoError(t, b.core.Receive(a.core.Flush(false), b.now))
	assert.Equal(t, uint64(0), b.pendingPrefill(engA), "no in-flight prefill left; b's own mean is 0")
	_, live := b.core.Peers()
	assert.Equal(t, 1, live)
	g.Release()
	require.NoError(t, b.core.Receive(a.core.Flush(false), b.now))
	_, live = b.core.Peers()
	assert.Equal(t, 0, live)
	sent, _, _ := a.core.Counts()
	_, received, dropped := b.core.Counts()
	assert.Equal(t, [3]uint64{3, 3, 0}, [3]uint64{sent, received, dropped})
}

// Peers' requests in flight count in the pressure comparisons' last key (docs/design.md §6): with
// both loads unknown (in-flight basis), b, with one request of its own in flight on engB, sends the
// next one to engA, unless its peer a has two in flight there. b's own in-flight count, which caps
// read, stays its own. Ties would be broken at random: Rand always takes the first.
func TestPeerInFlightInPressureComparisons(t *testing.T) {
	engines := []state.Engine{state.NewStaticEngine(engA, "m", state.StagePlain), state.NewStaticEngine(engB, "m", state.StagePlain)}
	for _, tc := range []struct {
		name string
		new  func(policy.Config) (policy.Policy, error)
	}{
		{"power_of_two", func(c policy.Config) (policy.Policy, error) { return policy.NewPowerOfN(c, 2) }},
		{"least_load", policy.NewLeastLoad},
	} {
		for _, peers := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/peers=%v", tc.name, peers), func(t *testing.T) {
				a, b := newReplica(t, "a", 1), newReplica(t, "b", 1)
				b.now = b.now.Add(time.Minute) // the reports are stale: loads unknown
				b.inflight.Acquire(engB, -1, 0)
				want := engA
				if peers {
					a.inflight.Acquire(engA, -1, 0)
					a.inflight.Acquire(engA, -1, 0)
					require.NoError(t, b.core.Receive(a.core.Flush(false), b.now))
					want = engB
				}
				o := loadmon.Observe(b.load.Snapshot(), b.inflight, engA)
				assert.Equal(t, [2]uint64{0, map[bool]uint64{false: 0, true: 2}[peers]}, [2]uint64{o.InFlight, o.PeerInFlight})
				p, err := tc.new(policy.Config{Load: b.load, InFlight: b.inflight, Rand: func(int) int { return 1 }})
				require.NoError(t, err)
				pk, err := p.Pick(context.Background(), engines, &policy.Request{Model: "m", Stage: state.StagePlain, InputTokens: 1})
				require.NoError(t, err)
				assert.Equal(t, want, pk.Engine.ID())
			})
		}
	}
}

func TestPeerInFlightPrefill(t *testing.T) {
	a, b := newReplica(t, "a", 1), newReplica(t, "b", 1)
	g := a.inflight.Acquire(engA, -1, 500)
	g.FirstToken() // a reports first tokens; its second dispatch is still prefilling
	a.inflight.Acquire(engA, -1, 300)
	require.NoError(t, b.core.Receive(a.core.Flush(false), b.now))
	b.now = b.now.Add(time.Second)
	require.NoError(t, b.load.Report(loadmon.Report{Engine: engA})) // nothing waiting since
	assert.Equal(t, uint64(300), b.pendingPrefill(engA))
}

func TestDuplicateGapIncarnationAndUnknown(t *testing.T) {
	tests := []struct {
		name           string
		run            func(a, a2, b *replica) // a2: a restarted
		live           int
		dispatched     uint64
		received, drop uint64
		reason         peersync.Reason // of the drops
	}{
		{"duplicate batch counted once", func(a, _, b *replica) {
			a.inflight.Acquire(engA, -1, 10)
			m := a.core.Flush(false)
			_ = b.core.Receive(m, b.now)
			_ = b.core.Receive(m, b.now)
		}, 1, 1, 1, 1, peersync.ReasonDuplicate},
		{"duplicate start dropped", func(a, _, b *replica) {
			a.inflight.Acquire(engA, -1, 10)
			m := a.core.Flush(false)
			_ = b.core.Receive(m, b.now)
			// The same start again, in a's next batch.
			_ = b.core.Receive(rawBatch("a", 1, 2, []any{uint8(1), uint64(1), string(engA), -1, uint64(10), int64(0)}), b.now)
		}, 1, 1, 1, 1, peersync.ReasonDuplicate},
		{"unknown engine not sent", func(a, _, b *replica) {
			a.inflight.Acquire("http://other", -1, 10)
			a.inflight.Acquire(engA, -1, 10)
			_ = b.core.Receive(a.core.Flush(false), b.now)
		}, 1, 1, 1, 0, 0},
		{"unknown engine dropped", func(a, _, b *replica) {
			a.inflight.Acquire(engA, -1, 10)
			_ = b.core.Receive(a.core.Flush(false), b.now)
			// A peer whose fleet has an engine b's has not.
			_ = b.core.Receive(rawBatch("a", 1, 2, []any{uint8(1), uint64(2), "http://other", -1, uint64(10), int64(0)}), b.now)
		}, 1, 1, 1, 1, peersync.ReasonUnknownEngine},
		{"gap keeps the peer's dispatches until its announcement", func(a, _, b *replica) {
			a.inflight.Acquire(engA, -1, 10)
			_ = b.core.Receive(a.core.Flush(false), b.now)
			g := a.inflight.Acquire(engB, -1, 10)
			_ = a.core.Flush(false) // lost
			g.Release()
			_ = b.core.Receive(a.core.Flush(false), b.now) // the end of a dispatch b never saw
		}, 1, 1, 1, 1, peersync.ReasonUnknownDispatch},
		{"restart forgets the old incarnation", func(a, a2, b *replica) {
			a.inflight.Acquire(engA, -1, 10)
			_ = b.core.Receive(a.core.Flush(false), b.now)
			a2.inflight.Acquire(engB, -1, 10)
			_ = b.core.Receive(a2.core.Flush(false), b.now)
		}, 1, 2, 2, 0, 0},
		{"own batches ignored", func(_, _, b *replica) {
			b.inflight.Acquire(engA, -1, 10)
			_ = b.core.Receive(b.core.Flush(false), b.now)
		}, 0, 1, 0, 0, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, a2, b := newReplica(t, "a", 1), newReplica(t, "a", 2), newReplica(t, "b", 1)
			tt.run(a, a2, b)
			_, live := b.core.Peers()
			assert.Equal(t, tt.live, live)
			_, received, dropped := b.core.Counts()
			assert.Equal(t, tt.received, received)
			assert.Equal(t, tt.drop, dropped)
			var want [peersync.NumReasons]uint64
			want[tt.reason] = tt.drop
			assert.Equal(t, want, b.core.Drops(), "drops by reason")
			na, _ := b.dispatched(engA)
			nb, _ := b.dispatched(engB)
			assert.Equal(t, tt.dispatched, na+nb, "dispatches since the report (a forgotten dispatch's time stays recorded)")
		})
	}
}

// rawBatch encodes a batch as a replica would send it: [origin, incarnation, sequence, changes,
// placements], each change [op, dispatch ID, engine, rank, prefill tokens, time].
func rawBatch(origin string, inc, seq uint64, changes ...[]any) []byte {
	cs := make([]any, len(changes))
	for i, c := range changes {
		cs[i] = c
	}
	b, err := msgpack.Marshal([]any{origin, inc, seq, cs, []any{}})
	if err != nil {
		panic(err)
	}
	return b
}

func TestLeaseAndForget(t *testing.T) {
	a, b, c := newReplica(t, "a", 1), newReplica(t, "b", 1), newReplica(t, "c", 1)
	a.inflight.Acquire(engA, -1, 10)
	c.inflight.Acquire(engA, -1, 10)
	require.NoError(t, b.core.Receive(a.core.Flush(false), b.now))
	b.now = b.now.Add(2 * time.Second)
	require.NoError(t, b.core.Receive(c.core.Flush(false), b.now))
	assert.Equal(t, 0, b.core.Expire(b.now.Add(time.Second)), "a lease of 3 s: a is still within it")
	assert.Equal(t, 1, b.core.Expire(b.now.Add(time.Second+time.Nanosecond)))
	peers, live := b.core.Peers()
	assert.Equal(t, [2]int{1, 1}, [2]int{peers, live})
	// A heartbeat keeps the lease.
	require.NoError(t, b.core.Receive(c.core.Flush(true), b.now.Add(3*time.Second)))
	assert.Equal(t, 0, b.core.Expire(b.now.Add(6*time.Second)))
	assert.Nil(t, c.core.Flush(false), "nothing pending, no heartbeat: no batch")
	b.core.Forget()
	peers, live = b.core.Peers()
	assert.Equal(t, [2]int{0, 0}, [2]int{peers, live})
}

// TestReplicaRanks: each replica records on its InFlight its rank among the replicas it knows, in
// their IDs' order, and their number; an earlier incarnation of itself is not another replica,
// and a replica that knows no peer (none yet, all expired or forgotten, or closed) is alone.
func TestReplicaRanks(t *testing.T) {
	a, b, c := newReplica(t, "a", 1), newReplica(t, "b", 1), newReplica(t, "c", 1)
	ranks := func(r *replica) [2]int {
		rank, n := loadbridge.Replicas(r.inflight)
		return [2]int{rank, n}
	}
	hear := func(to *replica, from ...*replica) {
		for _, f := range from {
			require.NoError(t, to.core.Receive(f.core.Flush(true), to.now))
		}
	}
	assert.Equal(t, [2]int{0, 1}, ranks(a), "no peer heard: alone")

	hear(c, b)
	assert.Equal(t, [2]int{1, 2}, ranks(c))
	hear(a, c)
	assert.Equal(t, [2]int{0, 2}, ranks(a))
	hear(a, b)
	hear(b, c, a)
	hear(c, a)
	assert.Equal(t, [3][2]int{{0, 3}, {1, 3}, {2, 3}}, [3][2]int{ranks(a), ranks(b), ranks(c)})

	a2 := newReplica(t, "a", 2) // a restarted; its earlier incarnation's batches may still arrive
	hear(a2, a, b)
	assert.Equal(t, [2]int{0, 2}, ranks(a2))

	c.now = c.now.Add(4 * time.Second)
	hear(c, b)
	assert.Equal(t, 1, c.core.Expire(c.now))
	assert.Equal(t, [2]int{1, 2}, ranks(c), "a expired")
	c.core.Forget()
	assert.Equal(t, [2]int{0, 1}, ranks(c), "forgotten")
	b.core.Close()
	assert.Equal(t, [2]int{0, 1}, ranks(b), "closed")
}

func TestPeerPlacementFound(t *testing.T) {
	a, b := newReplica(t, "a", 1), newReplica(t, "b", 1)
	prompt := []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9}
	ctx := context.Background()
	q := kvindex.Query{TokenIDs: prompt}
	res, err := a.source.Lookup(ctx, q)
	require.NoError(t, err)
	require.NoError(t, a.source.Place(engB, 0, q, &res))
	before, err := b.source.Lookup(ctx, q)
	require.NoError(t, err)
	assert.Equal(t, kvindex.OutcomeMiss, before.Outcome)
	require.NoError(t, b.core.Receive(a.core.Flush(false), b.now))
	after, err := b.source.Lookup(ctx, q)
	require.NoError(t, err)
	assert.Equal(t, 2, after.Blocks(engB), "both full blocks of a's placement")

	// A placement on an engine b does not know is dropped.
	require.NoError(t, a.source.Place("http://other", 0, q, &res))
	require.NoError(t, b.core.Receive(a.core.Flush(false), b.now))
	_, received, dropped := b.core.Counts()
	assert.Equal(t, [2]uint64{1, 1}, [2]uint64{received, dropped})
	assert.Equal(t, uint64(1), b.core.Drops()[peersync.ReasonUnknownEngine])
}

func TestInvalidBatch(t *testing.T) {
	b := newReplica(t, "b", 1)
	for _, msg := range [][]byte{nil, {0xc1}, []byte("not msgpack")} {
		assert.ErrorIs(t, b.core.Receive(msg, b.now), peersync.ErrInvalidBatch)
	}
	peers, _ := b.core.Peers()
	assert.Equal(t, 0, peers)
	// A change of an unknown kind in a valid batch is dropped alone.
	require.NoError(t, b.core.Receive(rawBatch("a", 1, 1, []any{uint8(9), uint64(1), string(engA), -1, uint64(0), int64(0)}), b.now))
	var want [peersync.NumReasons]uint64
	want[peersync.ReasonMalformed] = 4
	assert.Equal(t, want, b.core.Drops())
}

func TestNewRejectsInvalidConfig(t *testing.T) {
	f := loadmon.NewInFlight(nil)
	known := func(state.EngineID) bool { return true }
	for _, cfg := range []peersync.Config{
		{InFlight: f, Known: known, Lease: time.Second},
		{ID: "a", Known: known, Lease: time.Second},
		{ID: "a", InFlight: f, Lease: time.Second},
		{ID: "a", InFlight: f, Known: known},
	} {
		_, err := peersync.New(cfg)
		assert.ErrorIs(t, err, state.ErrInvalidConfiguration)
	}
}

// Concurrent dispatches on two replicas, flushed and received while they run: once every
// dispatch has ended and the last batches are in, no peer dispatch is left in either view.
func TestConcurrentSharingSettles(t *testing.T) {
	a, b := newReplica(t, "a", 1), newReplica(t, "b", 1)
	var wg sync.WaitGroup
	stop := make(chan struct{})
	var pump sync.WaitGroup
	pump.Add(1)
	go func() {
		defer pump.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if m := a.core.Flush(false); m != nil {
				_ = b.core.Receive(m, b.now)
			}
			if m := b.core.Flush(false); m != nil {
				_ = a.core.Receive(m, a.now)
			}
		}
	}()
	for w := range 4 {
		r := a
		if w%2 == 1 {
			r = b
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 200 {
				g := r.inflight.Acquire([]state.EngineID{engA, engB}[i%2], i%3-1, uint64(i))
				g.FirstToken()
				g.Release()
			}
		}()
	}
	wg.Wait()
	close(stop)
	pump.Wait()
	require.NoError(t, b.core.Receive(a.core.Flush(true), b.now))
	require.NoError(t, a.core.Receive(b.core.Flush(true), a.now))
	for _, r := range []*replica{a, b} {
		_, live := r.core.Peers()
		assert.Equal(t, 0, live)
		_, received, dropped := r.core.Counts()
		assert.Equal(t, uint64(400*2+ /* prefill ends of dispatches with tokens */ 2*199), received)
		assert.Equal(t, uint64(0), dropped)
	}
}

func FuzzReceive(f *testing.F) {
	a := func() *replica {
		t := &testing.T{}
		return newReplica(t, "a", 1)
	}()
	a.inflight.Acquire(engA, 0, 7)
	f.Add(a.core.Flush(false))
	f.Add([]byte{0x95, 0xa1, 'x', 1, 1, 0x90, 0x90})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, msg []byte) {
		b := newReplica(t, "b", 1)
		_ = b.core.Receive(msg, b.now)
		_ = b.core.Receive(msg, b.now)
		b.core.Forget()
		_, live := b.core.Peers()
		assert.Equal(t, 0, live)
		o := loadmon.Observe(b.load.Snapshot(), b.inflight, engA)
		assert.Equal(t, uint64(0), o.InFlight)
	})
}

// peerInFlight returns the peer dispatches in flight that r counts on engine.
func (r *replica) peerInFlight(engine state.EngineID) uint64 {
	return loadmon.Observe(r.load.Snapshot(), r.inflight, engine).PeerInFlight
}

// A replica that misses a peer's batches (a gap, or batches sent before it first heard the peer,
// or a Resync after its transport subscribed again) asks the peers to announce their dispatches
// in flight; their next batch carries them all, and replaces what the view held of them: the
// view ends exact, prefill included.
func TestMissedBatchesAreAnnouncedAgain(t *testing.T) {
	for _, tc := range []struct {
		name string
		miss func(a, b *replica) // loses some of a's batches to b
	}{
		{"gap", func(a, b *replica) {
			require.NoError(t, b.core.Receive(a.core.Flush(true), b.now))
			a.inflight.Acquire(engA, -1, 100)
			_ = a.core.Flush(false) // lost
			require.NoError(t, b.core.Receive(a.core.Flush(true), b.now))
		}},
		{"first heard after its first batch", func(a, b *replica) {
			a.inflight.Acquire(engA, -1, 100)
			_ = a.core.Flush(false) // sent before b listened
			require.NoError(t, b.core.Receive(a.core.Flush(true), b.now))
		}},
		{"resubscribed", func(a, b *replica) {
			a.inflight.Acquire(engA, -1, 100)
			_ = a.core.Flush(false) // sent while b's subscription was down
			b.core.Resync()
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := newReplica(t, "a", 1), newReplica(t, "b", 1)
			ended := a.inflight.Acquire(engB, -1, 50)
			prefilled := a.inflight.Acquire(engB, -1, 30)
			prefilled.FirstToken()
			require.NoError(t, b.core.Receive(a.core.Flush(false), b.now))
			ended.Release()
			_ = a.core.Flush(false) // lost: b never hears of the end
			tc.miss(a, b)

			require.True(t, b.core.Pending(), "b asks")
			require.NoError(t, a.core.Receive(b.core.Flush(false), a.now))
			require.True(t, a.core.Pending(), "a announces")
			require.NoError(t, b.core.Receive(a.core.Flush(false), b.now))

			peers, live := b.core.Peers()
			assert.Equal(t, 1, peers)
			assert.Equal(t, 2, live, "the start b missed and the dispatch still prefilled; not the one that ended")
			assert.Equal(t, uint64(1), b.peerInFlight(engA))
			assert.Equal(t, uint64(1), b.peerInFlight(engB))
			assert.Equal(t, uint64(100), loadbridge.InFlightPrefill(b.inflight, engA), "the missed start's prefill")
			assert.Zero(t, loadbridge.InFlightPrefill(b.inflight, engB), "the other's prefill ended before")
			assert.False(t, a.core.Pending(), "one announcement")
			assert.False(t, b.core.Pending())
		})
	}
}

// A lost request to announce is made good: the peer that lost it sees a gap in the asker's
// batches and announces its dispatches with its own request. b misses a's start, asks, and its
// asking batch is lost to a; both views end exact.
func TestLostWantIsMadeGood(t *testing.T) {
	a, b := newReplica(t, "a", 1), newReplica(t, "b", 1)
	require.NoError(t, b.core.Receive(a.core.Flush(true), b.now))
	require.NoError(t, a.core.Receive(b.core.Flush(true), a.now))
	a.inflight.Acquire(engA, -1, 10)
	b.inflight.Acquire(engB, -1, 10)
	_ = a.core.Flush(false) // lost: b sees a gap
	require.NoError(t, b.core.Receive(a.core.Flush(true), b.now))
	_ = b.core.Flush(false) // b's request and its start, lost: a sees a gap
	require.NoError(t, a.core.Receive(b.core.Flush(true), a.now))
	require.NoError(t, b.core.Receive(a.core.Flush(false), b.now))
	require.NoError(t, a.core.Receive(b.core.Flush(false), a.now))
	assert.Equal(t, uint64(1), b.peerInFlight(engA), "b counts a's dispatch")
	assert.Equal(t, uint64(1), a.peerInFlight(engB), "a counts b's dispatch")
	assert.False(t, a.core.Pending())
	assert.False(t, b.core.Pending())
}

// An announcement follows the batch's deltas, so that a replica without announcements, which
// drops the markers as malformed and an announced start it knows as a duplicate, still applies
// the ends and first tokens: [want, end of d1, first token of d2, full, start of d2 (its prefill
// ended)].
func TestAnnouncementFollowsTheDeltas(t *testing.T) {
	a := newReplica(t, "a", 1)
	d1 := a.inflight.Acquire(engA, -1, 10)
	d2 := a.inflight.Acquire(engB, -1, 20)
	_ = a.core.Flush(false)
	d1.Release()
	d2.FirstToken()
	a.core.Resync()
	var b struct {
		Changes []struct{ Op, ID, Tokens uint64 }
	}
	require.NoError(t, msgpack.Unmarshal(a.core.Flush(false), &b))
	assert.Equal(t, []struct{ Op, ID, Tokens uint64 }{{0xf0, 0, 0}, {uint64(loadbridge.OpEnd), 1, 10},
		{uint64(loadbridge.OpPrefillEnd), 2, 20}, {0xf1, 0, 0}, {uint64(loadbridge.OpStart), 2, 0}}, b.Changes)
}

// A gap in a peer's batches keeps its dispatches counted until its announcement replaces them:
// a dispatch the view held, announced again, counts once in the dispatches since the report and
// in flight, before and after the announcement; the one whose end was lost stops counting then.
func TestGapKeepsDispatchesUntilTheAnnouncement(t *testing.T) {
	a, b := newReplica(t, "a", 1), newReplica(t, "b", 1)
	a.inflight.Acquire(engA, -1, 100)
	ended := a.inflight.Acquire(engB, -1, 10)
	require.NoError(t, b.core.Receive(a.core.Flush(false), b.now))
	b.now = b.now.Add(time.Second)
	ended.Release()
	_ = a.core.Flush(false) // lost
	require.NoError(t, b.core.Receive(a.core.Flush(true), b.now))

	view := func() [5]uint64 {
		n, tok := b.dispatched(engA)
		nb, _ := b.dispatched(engB)
		return [5]uint64{n, tok, b.peerInFlight(engA), loadbridge.InFlightAt(b.inflight, engA, t0.Add(time.Nanosecond)), nb}
	}
	assert.Equal(t, [5]uint64{1, 100, 1, 1, 1}, view(), "the gap: both dispatches still count (the end was lost)")
	require.True(t, b.core.Pending(), "b asks")
	require.NoError(t, a.core.Receive(b.core.Flush(false), a.now))
	require.NoError(t, b.core.Receive(a.core.Flush(false), b.now))
	assert.Equal(t, [5]uint64{1, 100, 1, 1, 1}, view(), "announced: engA's dispatch once; engB's ended (its dispatch stays since the report)")
	assert.Zero(t, b.peerInFlight(engB))
	_, live := b.core.Peers()
	assert.Equal(t, 1, live)
}
