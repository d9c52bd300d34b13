package affinity

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/google/btree"

	"github.com/enginepick/enginepick/state"
)

// Options configures a MemoryStore. The zero value of every field is its documented default.
type Options struct {
	// IdleTimeout is how long a binding lives without a hit. 0 means DefaultIdleTimeout (600 s);
	// negative is invalid.
	IdleTimeout time.Duration
	// SweepInterval is how often Run sweeps expired bindings. 0 means 60 s;
	// negative is invalid. Expired bindings are invisible between sweeps either way;
	// the sweep only frees their memory.
	SweepInterval time.Duration
	// Now is the clock of every expiry rule. Nil means time.Now.
	Now func() time.Time
	// MaxBindings caps the bindings a MemoryStore holds, so that a flood of new session or
	// routing keys cannot grow it without bound (docs/design.md §12). The cap applies per shard:
	// each of the 16 shards holds at most ceil(MaxBindings / 16), so the store holds at most
	// MaxBindings rounded up to a multiple of 16. A new binding in a full shard first drops the
	// shard's expired bindings and, if none, evicts its binding nearest to expiry: the least
	// recently used one (a binding's expiry is its last use plus IdleTimeout). 0 means no cap:
	// the idle timeout alone bounds the store (rate of new keys × IdleTimeout). Negative is
	// invalid.
	MaxBindings int
}

// memShards is the number of independently locked shards of a MemoryStore.
const memShards = 16

// btreeDegree is the degree of each shard's expiry B-tree.
const btreeDegree = 32

// MemoryStore is the in-process Store: bindings in a map per shard, their expiry order in a
// google/btree per shard so that Sweep touches only expired bindings, and an intrusive list per
// engine so that InvalidateEngine touches only that engine's bindings. Lookups and binds of
// different keys mostly take different locks (16 shards by key hash).
//
// The store starts no goroutine: the caller runs Run (or calls Sweep) and stops it through its
// context (docs/design.md §12, "the caller owns the sweeper's lifecycle"). It is safe for
// concurrent use.
type MemoryStore struct {
	idle     int64 // nanoseconds
	every    time.Duration
	now      func() time.Time
	shardCap int // 0: no cap
	evicted  atomic.Uint64

	shards [memShards]memShard
}

var _ Store = (*MemoryStore)(nil)

type memShard struct {
	mu       sync.Mutex
	byScope  map[Scope]*memEntry
	order    *btree.BTreeG[expiryItem]
	byEngine map[state.EngineID]*memEntry // head of the engine's list
	nextID   uint64
	_        [64]byte // keep shards on separate cache lines
}

type memEntry struct {
	scope      Scope
	engine     state.EngineID
	exp        int64  // unix nanos of expiry
	id         uint64 // unique in the shard; breaks expiry ties in the B-tree
	prev, next *memEntry
}

type expiryItem struct {
	exp int64
	id  uint64
	e   *memEntry
}

func lessExpiry(a, b expiryItem) bool {
	return a.exp < b.exp || (a.exp == b.exp && a.id < b.id)
}

// NewMemoryStore returns an empty store. A negative IdleTimeout, SweepInterval or MaxBindings is
// an error wrapping state.ErrInvalidConfiguration.
func NewMemoryStore(opts Options) (*MemoryStore, error) {
	if opts.IdleTimeout < 0 {
		return nil, fmt.Errorf("affinity: Options.IdleTimeout %v: must be >= 0: %w", opts.IdleTimeout, state.ErrInvalidConfiguration)
	}
	if opts.SweepInterval < 0 {
		return nil, fmt.Errorf("affinity: Options.SweepInterval %v: must be >= 0: %w", opts.SweepInterval, state.ErrInvalidConfiguration)
	}
	if opts.MaxBindings < 0 {
		return nil, fmt.Errorf("affinity: Options.MaxBindings %d: must be >= 0: %w", opts.MaxBindings, state.ErrInvalidConfiguration)
	}
	if opts.IdleTimeout == 0 {
		opts.IdleTimeout = DefaultIdleTimeout
	}
	if opts.SweepInterval == 0 {
		opts.SweepInterval = defaultSweepInterval
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	s := &MemoryStore{idle: int64(opts.IdleTimeout), every: opts.SweepInterval, now: opts.Now,
		shardCap: (opts.MaxBindings + memShards - 1) / memShards}
	for i := range s.shards {
		sh := &s.shards[i]
		sh.byScope = map[Scope]*memEntry{}
		sh.order = btree.NewWithFreeListG(btreeDegree, lessExpiry, btree.NewFreeListG[expiryItem](64))
		sh.byEngine = map[state.EngineID]*memEntry{}
	}
	return s, nil
}

// IdleTimeout returns the store's idle timeout.
func (s *MemoryStore) IdleTimeout() time.Duration { return time.Duration(s.idle) }

func (s *MemoryStore) shard(scope *Scope) *memShard {
	return &s.shards[xxhash.Sum64String(scope.Key)%memShards]
}

func (s *MemoryStore) nowNanos() int64 { return s.now().UnixNano() }

// Lookup implements Store. It allocates nothing.
func (s *MemoryStore) Lookup(_ context.Context, scope Scope) (state.EngineID, bool, error) {
	if err := scope.Validate(); err != nil {
		return "", false, err
	}
	now := s.nowNanos()
	sh := s.shard(&scope)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e := sh.byScope[scope]
	if e == nil {
		return "", false, nil
	}
	if now >= e.exp {
		sh.remove(e)
		return "", false, nil
	}
	sh.refresh(e, now+s.idle)
	return e.engine, true, nil
}

// Bind implements Store.
func (s *MemoryStore) Bind(_ context.Context, scope Scope, engine state.EngineID) (state.EngineID, error) {
	return s.set(scope, engine, "", false)
}

// Replace implements Store.
func (s *MemoryStore) Replace(_ context.Context, scope Scope, expected, engine state.EngineID) (state.EngineID, error) {
	return s.set(scope, engine, expected, true)
}

func (s *MemoryStore) set(scope Scope, engine, expected state.EngineID, replace bool) (state.EngineID, error) {
	if err := scope.Validate(); err != nil {
		return "", err
	}
	if engine == "" {
		return "", ErrInvalidEngine
	}
	now := s.nowNanos()
	sh := s.shard(&scope)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e := sh.byScope[scope]
	if e != nil && now < e.exp && (!replace || e.engine != expected) {
		sh.refresh(e, now+s.idle)
		return e.engine, nil
	}
	if e != nil {
		sh.remove(e)
	}
	if s.shardCap > 0 && len(sh.byScope) >= s.shardCap {
		s.makeRoom(sh, now)
	}
	sh.insert(scope, engine, now+s.idle)
	return engine, nil
}

// makeRoom frees one place in a full shard: its expired bindings if it has any, else its binding
// nearest to expiry (the least recently used). Callers hold sh.mu.
func (s *MemoryStore) makeRoom(sh *memShard, now int64) {
	it, ok := sh.order.Min()
	if !ok {
		return
	}
	if it.exp > now {
		sh.remove(it.e)
		s.evicted.Add(1)
		return
	}
	for ok && it.exp <= now {
		sh.remove(it.e)
		it, ok = sh.order.Min()
	}
}

// Evicted returns how many live bindings the store has evicted to stay within
// Options.MaxBindings since it was created (expired bindings dropped are not counted).
func (s *MemoryStore) Evicted() uint64 { return s.evicted.Load() }

// InvalidateEngine implements Store. It touches only the engine's bindings.
func (s *MemoryStore) InvalidateEngine(_ context.Context, engine state.EngineID) (int, error) {
	now := s.nowNanos()
	live := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		for e := sh.byEngine[engine]; e != nil; {
			next := e.next
			if now < e.exp {
				live++
			}
			sh.remove(e)
			e = next
		}
		sh.mu.Unlock()
	}
	return live, nil
}

// Sweep removes every binding expired at the store clock's current time and returns how many it
// removed. It visits only those bindings: the B-tree yields them in expiry order and stops at the
// first live one.
func (s *MemoryStore) Sweep() int {
	now := s.nowNanos()
	n := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		for {
			it, ok := sh.order.Min()
			if !ok || it.exp > now {
				break
			}
			sh.remove(it.e)
			n++
		}
		sh.mu.Unlock()
	}
	return n
}

// Run sweeps every SweepInterval (real time, time.Ticker) until ctx is done, then returns nil.
// Start it once, in a goroutine the caller owns; cancelling ctx stops it and it leaves nothing
// running.
func (s *MemoryStore) Run(ctx context.Context) error {
	t := time.NewTicker(s.every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			s.Sweep()
		}
	}
}

// Len returns the number of bindings held, including expired ones not yet swept or looked up.
func (s *MemoryStore) Len() int {
	n := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		n += len(sh.byScope)
		sh.mu.Unlock()
	}
	return n
}

// insert adds a new binding. Callers hold sh.mu and have removed any previous entry of scope.
func (sh *memShard) insert(scope Scope, engine state.EngineID, exp int64) {
	sh.nextID++
	e := &memEntry{scope: scope, engine: engine, exp: exp, id: sh.nextID}
	sh.byScope[scope] = e
	sh.order.ReplaceOrInsert(expiryItem{exp: exp, id: e.id, e: e})
	if head := sh.byEngine[engine]; head != nil {
		e.next = head
		head.prev = e
	}
	sh.byEngine[engine] = e
}

// remove deletes e from the map, the expiry order and its engine's list. Callers hold sh.mu.
func (sh *memShard) remove(e *memEntry) {
	delete(sh.byScope, e.scope)
	sh.order.Delete(expiryItem{exp: e.exp, id: e.id})
	switch {
	case e.prev != nil:
		e.prev.next = e.next
	case e.next != nil:
		sh.byEngine[e.engine] = e.next
	default:
		delete(sh.byEngine, e.engine)
	}
	if e.next != nil {
		e.next.prev = e.prev
	}
	e.prev, e.next = nil, nil
}

// refresh moves e's expiry to exp, never earlier than it is (a clock that went backwards does not
// shorten a binding). Callers hold sh.mu.
func (sh *memShard) refresh(e *memEntry, exp int64) {
	if exp <= e.exp {
		return
	}
	sh.order.Delete(expiryItem{exp: e.exp, id: e.id})
	e.exp = exp
	sh.order.ReplaceOrInsert(expiryItem{exp: exp, id: e.id, e: e})
}
