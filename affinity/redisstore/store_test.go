package redisstore_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/affinity/affinitytest"
	"github.com/enginepick/enginepick/affinity/redisstore"
	"github.com/enginepick/enginepick/state"
)

// Environment variables naming the test servers (.ci/redis.sh starts both and exports them).
const (
	envAddr         = "ENGINEPICK_REDIS_ADDR"          // host:port of one redis-server
	envClusterAddrs = "ENGINEPICK_REDIS_CLUSTER_ADDRS" // comma-separated seed nodes of a cluster
	envRequire      = "ENGINEPICK_REQUIRE_SERVERS"     // "1": a missing server fails instead of skipping
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// go-redis keeps per-client background goroutines until Close; the tests close every
		// client, but a pool's reaper may still be winding down when TestMain checks.
		goleak.IgnoreTopFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).reaper"),
	)
}

var bg = context.Background()

// server is one kind of Redis deployment the suite runs against.
type server struct {
	name   string
	client func(t testing.TB) redis.UniversalClient
}

func servers() []server {
	return []server{
		{name: "single", client: singleClient},
		{name: "cluster", client: clusterClient},
	}
}

func missing(t testing.TB, env, what string) {
	t.Helper()
	msg := fmt.Sprintf("%s not set: no %s to test against (start one with .ci/redis.sh start)", env, what)
	if os.Getenv(envRequire) == "1" {
		t.Fatal(msg + "; " + envRequire + "=1 requires it")
	}
	t.Skip(msg)
}

func singleClient(t testing.TB) redis.UniversalClient {
	t.Helper()
	addr := os.Getenv(envAddr)
	if addr == "" {
		missing(t, envAddr, "redis-server")
	}
	c := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { _ = c.Close() })
	require.NoError(t, c.Ping(bg).Err(), "redis-server at %s", addr)
	return c
}

func clusterClient(t testing.TB) redis.UniversalClient {
	t.Helper()
	addrs := os.Getenv(envClusterAddrs)
	if addrs == "" {
		missing(t, envClusterAddrs, "Redis Cluster")
	}
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: strings.Split(addrs, ",")})
	t.Cleanup(func() { _ = c.Close() })
	require.NoError(t, c.ForEachShard(bg, func(ctx context.Context, s *redis.Client) error {
		return s.Ping(ctx).Err()
	}), "Redis Cluster at %s", addrs)
	return c
}

var prefixSeq atomic.Int64

// uniquePrefix isolates one store's keys from every other test and run on the same server.
func uniquePrefix() string {
	return fmt.Sprintf("enginepick-test:%d:%d:%d", os.Getpid(), time.Now().UnixNano(), prefixSeq.Add(1))
}

func newStore(t testing.TB, c redis.UniversalClient, now func() time.Time, idle time.Duration) *redisstore.Store {
	t.Helper()
	// The slack keeps keys on the server however long a loaded test machine stalls: the expiry
	// rule is judged against the test's clock, not the server's TTL.
	st, err := redisstore.New(redisstore.Options{Client: c, Prefix: uniquePrefix(), IdleTimeout: idle, Now: now, Shards: 64,
		TTLSlack: time.Hour})
	require.NoError(t, err)
	return st
}

// The behavioural suite of every affinity.Store, on one redis-server and on a three-master Redis
// Cluster.
func TestConformance(t *testing.T) {
	t.Parallel()
	for _, srv := range servers() {
		t.Run(srv.name, func(t *testing.T) {
			t.Parallel()
			c := srv.client(t)
			affinitytest.Run(t, func(t *testing.T, now func() time.Time, idle time.Duration) affinity.Store {
				return newStore(t, c, now, idle)
			})
		})
	}
}

func TestNewValidates(t *testing.T) {
	t.Parallel()
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer c.Close()
	for _, o := range []redisstore.Options{
		{},
		{Client: c, Prefix: "a{b"},
		{Client: c, Prefix: "a}b"},
		{Client: c, Shards: -1},
		{Client: c, Shards: 16385},
		{Client: c, IdleTimeout: -time.Second},
		{Client: c, IdleTimeout: time.Microsecond},
		{Client: c, IdleTimeout: 1500 * time.Microsecond},
		{Client: c, TTLSlack: -time.Millisecond},
		{Client: c, TTLSlack: time.Microsecond},
	} {
		_, err := redisstore.New(o)
		assert.ErrorIs(t, err, state.ErrInvalidConfiguration, "New(%+v)", o)
	}
	_, err := redisstore.New(redisstore.Options{Client: c})
	assert.NoError(t, err, "defaults")
}

// Redis unreachable: every operation returns an *affinity.UnavailableError, matched by
// errors.Is(err, affinity.ErrUnavailable), naming the operation. Needs no server.
func TestUnreachableIsTypedError(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close()) // nothing listens there now
	c := redis.NewClient(&redis.Options{Addr: addr, DialTimeout: 200 * time.Millisecond, MaxRetries: -1,
		DialerRetries: 1, DialerRetryTimeout: time.Millisecond})
	defer c.Close()
	st, err := redisstore.New(redisstore.Options{Client: c})
	require.NoError(t, err)
	s := affinity.Scope{Model: "m", Key: "k"}

	_, ok, err := st.Lookup(bg, s)
	assert.False(t, ok)
	var ue *affinity.UnavailableError
	if assert.ErrorAs(t, err, &ue) {
		assert.Equal(t, "lookup", ue.Op)
	}
	assert.ErrorIs(t, err, affinity.ErrUnavailable)
	_, err = st.Bind(bg, s, "e")
	assert.ErrorIs(t, err, affinity.ErrUnavailable)
	_, err = st.Replace(bg, s, "e", "f")
	assert.ErrorIs(t, err, affinity.ErrUnavailable)
	_, err = st.InvalidateEngine(bg, "e")
	assert.ErrorIs(t, err, affinity.ErrUnavailable)

	// Bad input is still a bad-input error: it is rejected before any I/O.
	_, _, err = st.Lookup(bg, affinity.Scope{})
	assert.ErrorIs(t, err, affinity.ErrInvalidKey)
	assert.NotErrorIs(t, err, affinity.ErrUnavailable)
}

// commandCounter counts the commands a client sends (one per round trip without pipelining).
type commandCounter struct{ n atomic.Int64 }

func (c *commandCounter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (c *commandCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.n.Add(1)
		return next(ctx, cmd)
	}
}
func (c *commandCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		c.n.Add(1)
		return next(ctx, cmds)
	}
}

// A hit is one round trip; so are a first bind and a replace.
func TestOneRoundTripPerOperation(t *testing.T) {
	t.Parallel()
	for _, srv := range servers() {
		t.Run(srv.name, func(t *testing.T) {
			t.Parallel()
			c := srv.client(t)
			cnt := &commandCounter{}
			c.AddHook(cnt)
			st := newStore(t, c, nil, time.Minute)
			s := affinity.Scope{Model: "m", Key: "warm"}
			// Warm the script caches of every node (the first EVALSHA of a script may be
			// answered NOSCRIPT and retried as EVAL).
			for i := range 64 {
				s.Key = fmt.Sprintf("warm%d", i)
				_, err := st.Bind(bg, s, "e")
				require.NoError(t, err)
				_, _, err = st.Lookup(bg, s)
				require.NoError(t, err)
				_, err = st.Replace(bg, s, "e", "f")
				require.NoError(t, err)
			}
			for i := range 32 {
				s.Key = fmt.Sprintf("k%d", i)
				before := cnt.n.Load()
				_, err := st.Bind(bg, s, "e")
				require.NoError(t, err)
				assert.Equal(t, int64(1), cnt.n.Load()-before, "bind")
				before = cnt.n.Load()
				_, ok, err := st.Lookup(bg, s)
				require.NoError(t, err)
				require.True(t, ok)
				assert.Equal(t, int64(1), cnt.n.Load()-before, "lookup hit")
				before = cnt.n.Load()
				_, err = st.Replace(bg, s, "e", "f")
				require.NoError(t, err)
				assert.Equal(t, int64(1), cnt.n.Load()-before, "replace")
			}
		})
	}
}

// Keys of one binding and of its engine index share one cluster slot, and the bindings of many
// scopes spread over all three masters.
func TestClusterKeysShareOneSlotAndSpread(t *testing.T) {
	t.Parallel()
	c := clusterClient(t).(*redis.ClusterClient)
	prefix := uniquePrefix()
	st, err := redisstore.New(redisstore.Options{Client: c, Prefix: prefix})
	require.NoError(t, err)
	const engine = "http://e:1"
	for i := range 300 {
		_, err := st.Bind(bg, affinity.Scope{Model: "m", Key: fmt.Sprintf("k%d", i)}, engine)
		require.NoError(t, err)
	}
	var total, masters atomic.Int64
	require.NoError(t, c.ForEachMaster(bg, func(ctx context.Context, m *redis.Client) error {
		keys, err := m.Keys(ctx, prefix+":*").Result()
		if err != nil {
			return err
		}
		n := int64(0)
		for _, k := range keys {
			tagged, _, ok := strings.Cut(k, "b:")
			if !ok {
				continue
			}
			n++
			rev := tagged + "e:" + engine
			slotB, err := m.ClusterKeySlot(ctx, k).Result()
			if err != nil {
				return err
			}
			slotE, err := m.ClusterKeySlot(ctx, rev).Result()
			if err != nil {
				return err
			}
			assert.Equal(t, slotB, slotE, "binding %q and its engine index %q", k, rev)
			exists, err := m.Exists(ctx, rev).Result()
			if err != nil {
				return err
			}
			assert.Equal(t, int64(1), exists, "engine index %q lives on the binding's node", rev)
		}
		total.Add(n)
		if n > 0 {
			masters.Add(1)
		}
		return nil
	}))
	assert.Equal(t, int64(300), total.Load(), "every binding is stored once")
	assert.Equal(t, int64(3), masters.Load(), "bindings spread over the three masters")
	n, err := st.InvalidateEngine(bg, engine)
	require.NoError(t, err)
	assert.Equal(t, 300, n, "invalidation across the cluster finds every binding")
}

// Several stores (router replicas) on one backend: racing first binds of many scopes converge,
// each scope on one engine that every replica then reads.
func TestReplicasConverge(t *testing.T) {
	t.Parallel()
	for _, srv := range servers() {
		t.Run(srv.name, func(t *testing.T) {
			t.Parallel()
			c := srv.client(t)
			prefix := uniquePrefix()
			replicas := make([]*redisstore.Store, 3)
			for i := range replicas {
				var err error
				replicas[i], err = redisstore.New(redisstore.Options{Client: c, Prefix: prefix, Shards: 16})
				require.NoError(t, err)
			}
			const scopes = 200
			got := make([][3]state.EngineID, scopes)
			done := make(chan struct{})
			for r, st := range replicas {
				go func() {
					defer func() { done <- struct{}{} }()
					rng := rand.New(rand.NewPCG(uint64(r), 7))
					for _, k := range rng.Perm(scopes) {
						e, err := st.Bind(bg, affinity.Scope{Key: fmt.Sprintf("s%d", k)}, state.EngineID(fmt.Sprintf("r%d", r)))
						if err != nil {
							t.Error(err)
						}
						got[k][r] = e
					}
				}()
			}
			for range replicas {
				<-done
			}
			for k := range scopes {
				assert.Equal(t, got[k][0], got[k][1], "scope %d", k)
				assert.Equal(t, got[k][0], got[k][2], "scope %d", k)
				for _, st := range replicas {
					e, ok, err := st.Lookup(bg, affinity.Scope{Key: fmt.Sprintf("s%d", k)})
					require.NoError(t, err)
					assert.True(t, ok)
					assert.Equal(t, got[k][0], e)
				}
			}
		})
	}
}

// The Redis TTL frees an idle binding's keys on the server at the idle timeout, with the real
// clock: nothing stays behind once every binding expired.
func TestIdleKeysLeaveTheServer(t *testing.T) {
	t.Parallel()
	c := singleClient(t)
	keys := func(pattern string) []string {
		k, err := c.Keys(bg, pattern).Result()
		require.NoError(t, err)
		return k
	}
	bindAll := func(prefix string, idle time.Duration) {
		st, err := redisstore.New(redisstore.Options{Client: c, Prefix: prefix, IdleTimeout: idle, Shards: 4})
		require.NoError(t, err)
		for i := range 20 {
			_, err := st.Bind(bg, affinity.Scope{Key: fmt.Sprintf("k%d", i)}, state.EngineID(fmt.Sprintf("e%d", i%3)))
			require.NoError(t, err)
		}
	}

	// The layout, with an idle timeout no test outlives: 20 bindings, and per engine and shard
	// at most one index.
	long := uniquePrefix()
	bindAll(long, time.Hour)
	assert.Len(t, keys(long+":*}:b:*"), 20)
	indexes := keys(long + ":*}:e:*")
	assert.NotEmpty(t, indexes)
	assert.LessOrEqual(t, len(indexes), 12, "at most one index per engine and shard (3 engines × 4 shards)")
	assert.Len(t, keys(long+":*"), 20+len(indexes), "nothing else")

	// With a 300 ms idle timeout on the real clock, the server frees every key by itself.
	short := uniquePrefix()
	bindAll(short, 300*time.Millisecond)
	assert.Eventually(t, func() bool { return len(keys(short+":*")) == 0 }, 10*time.Second, 20*time.Millisecond,
		"the server frees every key after the idle timeout")
}
