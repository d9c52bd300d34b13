package redispeer_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/enginepick/enginepick/internal/peersync"
	"github.com/enginepick/enginepick/internal/peersync/redispeer"
	"github.com/enginepick/enginepick/internal/testredis"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

// Environment of the test servers (.ci/redis.sh starts one and exports its address).
const (
	envAddr    = "ENGINEPICK_REDIS_ADDR"      // host:port of a redis-server
	envRequire = "ENGINEPICK_REQUIRE_SERVERS" // "1": a missing server fails instead of skipping
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const (
	engA state.EngineID = "http://a"
	engB state.EngineID = "http://b"
)

func missing(t *testing.T, msg string) {
	t.Helper()
	if os.Getenv(envRequire) == "1" {
		t.Fatal(msg + "; " + envRequire + "=1 requires it")
	}
	t.Skip(msg)
}

// sharedRedis returns the address of the redis-server of ENGINEPICK_REDIS_ADDR.
func sharedRedis(t *testing.T) string {
	t.Helper()
	addr := os.Getenv(envAddr)
	if addr == "" {
		missing(t, envAddr+" not set: no redis-server to test against (start one with .ci/redis.sh start)")
	}
	return addr
}

// channel returns a channel no other test uses.
func channel(t *testing.T) string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return "enginepick:test:" + t.Name() + ":" + hex.EncodeToString(b[:])
}

// replica is one router replica's shared state and its Peer, running until the test ends or stop.
type replica struct {
	load     *loadmon.Table
	inflight *loadmon.InFlight
	source   *kvindex.LocalSource
	core     *peersync.Core
	peer     *redispeer.Peer
	stop     func()
}

func newReplica(t *testing.T, addr, ch, id string, lease time.Duration) *replica {
	t.Helper()
	r := &replica{load: loadmon.NewTable(), inflight: loadmon.NewInFlight(nil)}
	h, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: 4})
	require.NoError(t, err)
	index, err := kvindex.NewIndex(h, kvindex.Options{})
	require.NoError(t, err)
	r.source, err = kvindex.NewLocalSource(index)
	require.NoError(t, err)
	r.core, err = peersync.New(peersync.Config{ID: id, Incarnation: 1, InFlight: r.inflight, Index: index,
		Known: func(e state.EngineID) bool { return e == engA || e == engB }, Lease: lease})
	require.NoError(t, err)
	r.peer, err = redispeer.New(r.core, redispeer.Options{Redis: &redis.Options{Addr: addr}, Channel: ch})
	require.NoError(t, err)
	for _, e := range []state.EngineID{engA, engB} {
		require.NoError(t, r.load.Report(loadmon.Report{Engine: e}))
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { r.peer.Run(ctx); close(done) }()
	var once sync.Once
	r.stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(func() { r.stop(); r.core.Close() })
	return r
}

// dispatched returns the dispatches since the report r's pressure comparisons see on engine.
func (r *replica) dispatched(engine state.EngineID) uint64 {
	return loadmon.Observe(r.load.Snapshot(), r.inflight, engine).Dispatched
}

func (r *replica) live() int {
	_, n := r.core.Peers()
	return n
}

// waitUp waits until every replica is subscribed, has heard the others and has nothing left to
// send, the announcements that follow a subscription included.
func waitUp(t *testing.T, rs ...*replica) {
	t.Helper()
	for _, r := range rs {
		require.Eventually(t, func() bool {
			peers, _ := r.core.Peers()
			return r.peer.Stats().Up && peers == len(rs)-1 && !r.core.Pending()
		}, 5*time.Second, time.Millisecond, "subscribed, hearing the others")
	}
}

// Two replicas over a real Redis: a dispatch, its first token and its end, and a route-time
// placement, reach the peer; a replica does not count its own batches, which come back to it.
func TestDeltasReachThePeer(t *testing.T) {
	addr, ch := sharedRedis(t), channel(t)
	a, b := newReplica(t, addr, ch, "a", 2*time.Second), newReplica(t, addr, ch, "b", 2*time.Second)
	waitUp(t, a, b)

	g := a.inflight.Acquire(engA, -1, 100)
	require.Eventually(t, func() bool { return b.dispatched(engA) == 1 }, 5*time.Second, time.Millisecond, "b counts a's dispatch")
	assert.Equal(t, uint64(0), b.inflight.Count(engA), "a peer's dispatch is not b's in flight")
	g.FirstToken()
	g.Release()
	require.Eventually(t, func() bool { return b.live() == 0 && b.peer.Stats().Received == 3 }, 5*time.Second, time.Millisecond,
		"the start, first token and end applied")

	prompt := []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9}
	q := kvindex.Query{TokenIDs: prompt}
	res, err := a.source.Lookup(context.Background(), q)
	require.NoError(t, err)
	require.NoError(t, a.source.Place(engB, 0, q, &res))
	require.Eventually(t, func() bool {
		got, err := b.source.Lookup(context.Background(), q)
		return err == nil && got.Blocks(engB) == 2
	}, 5*time.Second, time.Millisecond, "a's placement found in b's index")

	assert.Equal(t, uint64(1), a.dispatched(engA), "a counts its own dispatch once")
	// a hears of b only from b's heartbeats (every lease ÷ 4): b has sent no delta.
	require.Eventually(t, func() bool { return a.peer.Stats().Peers == 1 }, 5*time.Second, time.Millisecond, "a hears b's heartbeat")
	st := a.peer.Stats()
	assert.True(t, st.Up)
	assert.Equal(t, uint64(4), st.Sent, "start, first token, end, placement")
	assert.Equal(t, uint64(0), st.Unpublished)
	assert.Equal(t, [peersync.NumReasons]uint64{}, b.peer.Stats().Dropped)
}

// A message on the channel that is not a batch is counted as malformed; sharing goes on.
func TestMalformedMessageCounted(t *testing.T) {
	addr, ch := sharedRedis(t), channel(t)
	a, b := newReplica(t, addr, ch, "a", 2*time.Second), newReplica(t, addr, ch, "b", 2*time.Second)
	waitUp(t, a, b)
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	require.NoError(t, c.Publish(context.Background(), ch, "not a batch").Err())
	require.Eventually(t, func() bool { return b.peer.Stats().Dropped[peersync.ReasonMalformed] == 1 }, 5*time.Second, time.Millisecond)
	a.inflight.Acquire(engB, -1, 1)
	require.Eventually(t, func() bool { return b.dispatched(engB) == 1 }, 5*time.Second, time.Millisecond, "sharing goes on")
	assert.True(t, b.peer.Stats().Up)
}

// A replica that dies (its Peer stops: no heartbeat, no end for its dispatch) stops counting in
// its peer's view once the lease has passed, not before.
func TestDeadReplicaExpiresAfterLease(t *testing.T) {
	addr, ch := sharedRedis(t), channel(t)
	const lease = time.Second
	a, b := newReplica(t, addr, ch, "a", lease), newReplica(t, addr, ch, "b", lease)
	waitUp(t, a, b)
	a.inflight.Acquire(engA, -1, 10) // never released
	require.Eventually(t, func() bool { return b.live() == 1 }, 5*time.Second, time.Millisecond)
	a.stop()
	died := time.Now()
	time.Sleep(lease / 8)
	assert.Equal(t, 1, b.live(), "within the lease the dispatch still counts")
	require.Eventually(t, func() bool { return b.live() == 0 }, 5*time.Second, time.Millisecond, "expired")
	assert.GreaterOrEqual(t, time.Since(died), lease-lease/4, "not before the lease (less one heartbeat) has passed")
	peers, _ := b.core.Peers()
	assert.Equal(t, 0, peers)
}

func TestNewRejectsInvalidOptions(t *testing.T) {
	core, err := peersync.New(peersync.Config{ID: "a", InFlight: loadmon.NewInFlight(nil),
		Known: func(state.EngineID) bool { return true }, Lease: time.Second})
	require.NoError(t, err)
	defer core.Close()
	ro := &redis.Options{Addr: "127.0.0.1:1"}
	for name, tc := range map[string]struct {
		core *peersync.Core
		opts redispeer.Options
	}{
		"nil core":                       {nil, redispeer.Options{Redis: ro, Channel: "c"}},
		"nil redis options":              {core, redispeer.Options{Channel: "c"}},
		"empty channel":                  {core, redispeer.Options{Redis: ro}},
		"negative flush interval":        {core, redispeer.Options{Redis: ro, Channel: "c", FlushInterval: -1}},
		"heartbeat below flush interval": {core, redispeer.Options{Redis: ro, Channel: "c", FlushInterval: 300 * time.Millisecond}},
	} {
		_, err := redispeer.New(tc.core, tc.opts)
		assert.ErrorIs(t, err, state.ErrInvalidConfiguration, name)
	}
}

// The broker killed and started again on the same port mid-run: both replicas notice, forget
// their peers and keep routing on their own view (a dispatch never waits for the broker); the
// deltas made meanwhile wait for the broker, all dropped once more than 1,024 wait; once the
// broker is back, both replicas subscribe again and announce their dispatches in flight, so the
// peer counts again the dispatch running across the outage, and a new dispatch reaches it, within
// one second of the broker answering again.
func TestBrokerStopAndRestart(t *testing.T) {
	srv := testredis.Start(t, "the broker stop/restart test")
	ch := channel(t)
	a, b := newReplica(t, srv.Addr(), ch, "a", 2*time.Second), newReplica(t, srv.Addr(), ch, "b", 2*time.Second)
	waitUp(t, a, b)
	g := a.inflight.Acquire(engA, -1, 10)
	require.Eventually(t, func() bool { return b.live() == 1 }, 5*time.Second, time.Millisecond)

	srv.Stop()
	for _, r := range []*replica{a, b} {
		require.Eventually(t, func() bool { return !r.peer.Stats().Up }, 5*time.Second, time.Millisecond, "the loss is noticed")
	}
	assert.Equal(t, 0, b.live(), "b forgot a's dispatch: its own view only")
	const pairs = 600 // 1,200 deltas: more than are held
	began := time.Now()
	for range pairs {
		a.inflight.Acquire(engB, -1, 10).Release()
	}
	assert.Less(t, time.Since(began), time.Second, "dispatches do not wait for the broker")
	require.Eventually(t, func() bool { return a.peer.Stats().Unpublished > 0 }, 5*time.Second, time.Millisecond,
		"beyond 1,024 held deltas, they are dropped")
	assert.False(t, a.peer.Stats().Up)

	srv.Restart()
	back := time.Now()
	// Pub/sub keeps nothing for a subscriber that is not there yet: the announcements after the
	// subscriptions bring what is in flight; the new dispatch follows both subscriptions.
	require.Eventually(t, func() bool { return a.peer.Stats().Up && b.peer.Stats().Up }, time.Second, time.Millisecond,
		"both replicas subscribe again within one second of the broker's return")
	a.inflight.Acquire(engA, -1, 10)
	require.Eventually(t, func() bool { return b.live() == 2 }, time.Second-time.Since(back), time.Millisecond,
		"the dispatch running across the outage, announced again, and a new one reach the peer within one second of the broker's return")
	t.Logf("the peer counted both %v after the broker answered again", time.Since(back).Round(time.Millisecond))
	st := a.peer.Stats()
	assert.True(t, st.Up)
	assert.Equal(t, uint64(1+2*pairs+1), st.Sent+st.Unpublished, "every delta published or counted unpublished: %+v", st)
	g.Release()
	require.Eventually(t, func() bool { return b.live() == 1 }, 5*time.Second, time.Millisecond, "its end applies")
}
