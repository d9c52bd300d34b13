// Package redisstore implements affinity.Store on Redis (github.com/redis/go-redis/v9), so that
// several router replicas share session and sticky bindings and agree on every key's engine
// (docs/design.md §12).
//
// Every operation is one Lua script on one key's slot, so first-bind and replace are atomic and a
// hit costs one round trip. Keys carry a Redis Cluster hash tag, "{N}" for one of Shards shards
// chosen by the scope's hash, and every key a script touches has that same tag: the layout works
// unchanged on one Redis server and on a Redis Cluster. Idle expiry is the binding's own expiry
// time, refreshed on every hit and judged against the caller's clock (Options.Now), backed by a
// Redis key TTL that frees the key at the same instant. Engine invalidation reads a per-engine,
// per-shard index of the engine's bindings, never the whole keyspace.
//
// Replicas that share bindings must use the same Prefix, Shards and IdleTimeout; their clocks
// should agree to within the precision expected of the idle timeout.
//
// It is not a general Redis cache and holds nothing but bindings; it does not own the client,
// which the host configures (timeouts, pool, TLS) and closes.
package redisstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/redis/go-redis/v9"

	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/state"
)

// Defaults of Options.
const (
	// defaultPrefix starts every key of the store.
	defaultPrefix = "enginepick:affinity"
	// defaultShards is the number of hash-tag shards: 256 tags spread bindings over a cluster's
	// masters, and invalidating an engine costs one script per shard (pipelined).
	defaultShards = 256
	// maxShards is the largest Shards value: Redis Cluster has 16,384 slots.
	maxShards = 16384
)

// Options configures a Store. The zero value of every field but Client is its documented default.
type Options struct {
	// Client is the Redis client: a *redis.Client for one server, a *redis.ClusterClient for a
	// cluster (or any redis.UniversalClient). Required. The Store does not close it.
	Client redis.UniversalClient
	// Prefix starts every key: "<Prefix>:{N}:b:…" for bindings, "<Prefix>:{N}:e:…" for engine
	// indexes. "" means "enginepick:affinity". It must not contain '{' or '}', which would move the
	// cluster hash tag.
	Prefix string
	// Shards is the number of hash-tag shards, in [1, 16,384]. 0 means 256.
	Shards int
	// IdleTimeout is how long a binding lives without a hit: a positive whole number of
	// milliseconds. 0 means affinity.DefaultIdleTimeout (600 s).
	IdleTimeout time.Duration
	// Now is the clock of the expiry rule. Nil means time.Now.
	Now func() time.Time
	// TTLSlack is how long the server keeps an idle binding's keys beyond its expiry before it
	// frees them: a whole number of milliseconds, ≥ 0. 0 (the default) frees them at the expiry.
	// The expiry itself does not move: a binding past it is absent to every operation. A slack
	// keeps bindings inspectable for a while, and keeps them on the server when Now runs behind
	// the real clock (a test clock, or a replica whose clock lags).
	TTLSlack time.Duration
}

// Store is an affinity.Store on Redis. It is safe for concurrent use and keeps no binding state
// in the process.
type Store struct {
	c       redis.UniversalClient
	prefix  string
	shards  uint64
	idleMS  int64
	slackMS int64
	now     func() time.Time
}

var _ affinity.Store = (*Store)(nil)

// New validates opts and returns a Store. It does not contact Redis. Errors wrap
// state.ErrInvalidConfiguration and name the field: a nil Client, a Prefix with '{' or '}',
// Shards outside [0, 16,384], or an IdleTimeout or TTLSlack that is negative or not a whole
// number of milliseconds.
func New(opts Options) (*Store, error) {
	fail := func(format string, args ...any) (*Store, error) {
		return nil, fmt.Errorf("redisstore: "+format+": %w", append(args, state.ErrInvalidConfiguration)...)
	}
	if opts.Client == nil {
		return fail("Options.Client is nil")
	}
	if opts.Prefix == "" {
		opts.Prefix = defaultPrefix
	}
	if strings.ContainsAny(opts.Prefix, "{}") {
		return fail("Options.Prefix %q contains '{' or '}'", opts.Prefix)
	}
	if opts.Shards == 0 {
		opts.Shards = defaultShards
	}
	if opts.Shards < 1 || opts.Shards > maxShards {
		return fail("Options.Shards %d: must be in [1, %d]", opts.Shards, maxShards)
	}
	if opts.IdleTimeout == 0 {
		opts.IdleTimeout = affinity.DefaultIdleTimeout
	}
	if opts.IdleTimeout < time.Millisecond || opts.IdleTimeout%time.Millisecond != 0 {
		return fail("Options.IdleTimeout %v: must be a positive whole number of milliseconds", opts.IdleTimeout)
	}
	if opts.TTLSlack < 0 || opts.TTLSlack%time.Millisecond != 0 {
		return fail("Options.TTLSlack %v: must be a whole number of milliseconds >= 0", opts.TTLSlack)
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	return &Store{c: opts.Client, prefix: opts.Prefix, shards: uint64(opts.Shards),
		idleMS: opts.IdleTimeout.Milliseconds(), slackMS: opts.TTLSlack.Milliseconds(), now: opts.Now}, nil
}

// keys returns the scope's binding key and its shard's reverse-set key prefix. Both carry the
// shard's hash tag, so they live in one cluster slot.
func (s *Store) keys(scope *affinity.Scope) (binding, revPrefix string) {
	enc := scope.AppendEncoded(make([]byte, 0, 32+len(scope.Namespace)+len(scope.Model)+len(scope.BucketID)+len(scope.Key)))
	tagged := s.tagged(xxhash.Sum64(enc) % s.shards)
	return tagged + "b:" + string(enc), tagged + "e:"
}

// tagged returns "<prefix>:{<shard>}:".
func (s *Store) tagged(shard uint64) string {
	return s.prefix + ":{" + strconv.FormatUint(shard, 10) + "}:"
}

func (s *Store) nowMS() int64 { return s.now().UnixMilli() }

func unavailable(op string, err error) error { return &affinity.UnavailableError{Op: op, Err: err} }

// Lookup implements affinity.Store: one script, one round trip.
func (s *Store) Lookup(ctx context.Context, scope affinity.Scope) (state.EngineID, bool, error) {
	if err := scope.Validate(); err != nil {
		return "", false, err
	}
	key, rev := s.keys(&scope)
	v, err := scriptLookup.Run(ctx, s.c, []string{key}, s.nowMS(), s.idleMS, rev, s.slackMS).Text()
	switch {
	case errors.Is(err, redis.Nil):
		return "", false, nil
	case err != nil:
		return "", false, unavailable("lookup", err)
	}
	return state.EngineID(v), true, nil
}

// Bind implements affinity.Store: one script, one round trip.
func (s *Store) Bind(ctx context.Context, scope affinity.Scope, engine state.EngineID) (state.EngineID, error) {
	return s.set(ctx, "bind", scope, engine, "0", "")
}

// Replace implements affinity.Store: one script, one round trip.
func (s *Store) Replace(ctx context.Context, scope affinity.Scope, expected, engine state.EngineID) (state.EngineID, error) {
	return s.set(ctx, "replace", scope, engine, "1", expected)
}

func (s *Store) set(ctx context.Context, op string, scope affinity.Scope, engine state.EngineID, mode string, expected state.EngineID) (state.EngineID, error) {
	if err := scope.Validate(); err != nil {
		return "", err
	}
	if engine == "" {
		return "", affinity.ErrInvalidEngine
	}
	key, rev := s.keys(&scope)
	v, err := scriptSet.Run(ctx, s.c, []string{key}, s.nowMS(), s.idleMS, rev, string(engine), mode,
		string(expected), s.slackMS).Text()
	if err != nil {
		return "", unavailable(op, err)
	}
	return state.EngineID(v), nil
}

// InvalidateEngine implements affinity.Store: one script per shard on the engine's reverse set in
// that shard, sent as one pipeline (split by node on a cluster). Its cost grows with Shards and
// with the engine's own bindings, not with the keyspace. On a backend error some shards may have
// been invalidated; calling it again finishes the job.
func (s *Store) InvalidateEngine(ctx context.Context, engine state.EngineID) (int, error) {
	now := s.nowMS()
	pipe := s.c.Pipeline()
	cmds := make([]*redis.Cmd, s.shards)
	for i := range s.shards {
		key := s.tagged(i) + "e:" + string(engine)
		cmds[i] = scriptInvalidate.Eval(ctx, pipe, []string{key}, string(engine), now)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return 0, unavailable("invalidate", err)
	}
	live := 0
	for _, c := range cmds {
		n, err := c.Int()
		if err != nil {
			return 0, unavailable("invalidate", err)
		}
		live += n
	}
	return live, nil
}
