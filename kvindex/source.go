package kvindex

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"sync"
	"time"

	"github.com/enginepick/enginepick/state"
)

// Source answers prefix lookups for the cache-aware policy: a local Index (LocalSource) or a
// remote indexer service (RemoteSource) (docs/design.md §10).
//
// Lookup returns a Result whose Outcome tells a hit, a confirmed miss and an unavailable backend
// apart: the last two both let the policy fall back to load-based selection, but stay
// distinguishable in diagnostics. It returns an error only for a query the source rejects, wrapping
// state.ErrInvalidSignal; the request then fails and is not retried on another bucket. Unavailable
// is never an error. Implementations must be safe for concurrent use and must honour ctx. Use a
// Memo to look up each Source at most once per request.
type Source interface {
	Lookup(ctx context.Context, q Query) (Result, error)
}

// Query is one request's prompt, as the host tokenized it.
type Query struct {
	// TokenIDs are the prompt's token IDs. Each Source hashes them with its own Hasher, so a
	// prompt shorter than one block (or empty) is a valid query with zero blocks, answered as a
	// miss without I/O. Sources only read it; a RemoteSource whose backend hangs may still read
	// it after Lookup returns, so the caller must not modify it while the request lives.
	TokenIDs []uint32
	// Adapter is the LoRA adapter the prompt is for (vLLM lora_name); empty means the base model.
	// The prompt's keys chain from the adapter's root (Hasher), so it matches only blocks stored
	// under the same adapter (StoreEvent.Adapter): a base-model query never matches an adapter's
	// blocks, nor an adapter's query the base model's.
	Adapter string
	// Buffers, when not nil, is memory the caller lends a LocalSource to build the Result in, so
	// that the lookup allocates nothing; nil means the source allocates. Other sources, and a
	// Memo (whose results are shared), ignore it.
	Buffers *LookupBuffers
}

// LookupBuffers is memory a caller lends to LocalSource.Lookup (Query.Buffers): the Result's
// Engines and DPRanks, and the block keys it keeps for Place, are built in it instead of in new
// slices. The Result aliases the buffers, so the caller must not pass them to another Lookup
// while it still uses that Result, nor share the Result. The buffers grow to the largest result
// seen. A cache-aware pick without a Memo lends pooled buffers, which spares each pick the cache
// misses of writing its keys to fresh memory. The zero value is ready to use; it is not safe for
// concurrent use.
type LookupBuffers struct {
	keys    []uint64
	engines []EngineMatch
	ranks   []int
}

// Outcome is the kind of a Result, also its metric label. The zero Outcome is never returned by a
// Source.
type Outcome string

// The three outcomes.
const (
	// OutcomeHit: at least one engine holds the query's first block; Result.Engines lists them.
	OutcomeHit Outcome = "hit"
	// OutcomeMiss: the backend answered and no engine holds the first block, or the query has no
	// full block. Fall back to load.
	OutcomeMiss Outcome = "miss"
	// OutcomeUnavailable: the backend did not answer usefully (Result.Reason says why). Fall back
	// to load, as for a miss, but report it differently.
	OutcomeUnavailable Outcome = "unavailable"
)

// Result.Reason values, one per way a Source can be unavailable (docs/design.md §10).
const (
	reasonTimeout       = "timeout"
	reasonCanceled      = "canceled"
	reasonOverloaded    = "overloaded"
	reasonUnreachable   = "unreachable"
	reasonInvalidAnswer = "invalid_answer"
)

// Result is a Source's answer. Results may be shared between the callers of one Memo: treat
// Engines as read-only.
type Result struct {
	// Outcome is hit, miss or unavailable; never the zero Outcome.
	Outcome Outcome
	// Engines lists, for a hit, every engine holding at least the first block with its matched
	// block count in [1, QueryBlocks], deepest first, ties by engine ID. nil otherwise.
	Engines []EngineMatch
	// DPRanks, when non-nil, has one entry per Engines entry: the engine's DP rank holding its
	// matched blocks (the lowest such rank on a tie). A LocalSource's hits carry it; nil means the source does
	// not know ranks (a remote indexer), and a pick then chooses the rank by load.
	DPRanks []int
	// QueryBlocks is the number of full blocks in the query (0 when it has none, or when the
	// source was unavailable before hashing).
	QueryBlocks int
	// BlockTokens is the source's block size in tokens, so that a policy converts blocks to
	// tokens only with a valid conversion (docs/design.md §10). Sources set it
	// for every outcome; it is 0 only in the result a Memo gives a caller that stopped waiting.
	BlockTokens int
	// Reason says why, for OutcomeUnavailable, as a metric label; empty otherwise. "timeout": the
	// lookup did not finish within the source's timeout or the caller's deadline; "canceled":
	// the caller's context was canceled; "overloaded": the source's concurrency limit was
	// reached and the lookup was not attempted; "unreachable": the backend returned an error
	// other than a rejection, or panicked; "invalid_answer": the backend answered with a
	// negative block count or an empty engine ID.
	Reason string
	// Err is the backend's error behind an OutcomeUnavailable, when there is one; nil otherwise.
	Err error

	// keys are the query's chained block keys as the source computed them (a prefix of the full
	// chain, possibly empty), kept so that Placer.Place need not hash them again. Read-only: a
	// Memo shares them between callers.
	keys    []uint64
	source  Source // the source that computed keys
	adapter string // the adapter whose root keys chain from
}

// Blocks returns engine's matched block count, 0 when it holds not even the first block or the
// result is not a hit.
func (r Result) Blocks(engine state.EngineID) int {
	for _, e := range r.Engines {
		if e.Engine == engine {
			return e.Blocks
		}
	}
	return 0
}

func unavailable(blockTokens int, reason string, err error) Result {
	return Result{Outcome: OutcomeUnavailable, BlockTokens: blockTokens, Reason: reason, Err: err}
}

// Placer is implemented by a Source that can record the router's own placements: that an engine
// was just chosen for a prompt, before the engine has prefilled it and published BlockStored
// (route-time placements, docs/design.md §9.10). LocalSource implements it with approximate
// entries; a policy detects it once, at construction.
type Placer interface {
	// Place records that engine's DP rank rank (0 for an engine without DP, or when the pick
	// named no rank) is taken to hold q's prompt, every full block, from now until the source's
	// approximate-entry TTL, so that the next match finds the prefix on the rank the request
	// went to (docs/design.md §11). r is this source's Lookup result for q (through a Memo or
	// not): the keys it computed are reused, so the prompt is hashed once per request. A result
	// from another source or query is ignored and q is hashed again. Errors are the index's
	// (*EventError); the caller may ignore them, a placement being a hint.
	Place(engine state.EngineID, rank int, q Query, r *Result) error
}

// LocalSource is a Source over an Index in this process. It never returns an error: every token
// sequence is a valid query. It is safe for concurrent use.
type LocalSource struct {
	index *Index
	pool  sync.Pool // *localScratch
}

type localScratch struct {
	m matches
}

var (
	_ Source = (*LocalSource)(nil)
	_ Placer = (*LocalSource)(nil)
)

// NewLocalSource returns a Source over index, hashing queries with index.Hasher(). A nil index
// returns an error wrapping state.ErrInvalidConfiguration.
func NewLocalSource(index *Index) (*LocalSource, error) {
	if index == nil {
		return nil, fmt.Errorf("kvindex: NewLocalSource: nil index: %w", state.ErrInvalidConfiguration)
	}
	return &LocalSource{index: index}, nil
}

// Lookup hashes q.TokenIDs and matches them against the index, hashing only as far as some engine
// may hold the prefix. A canceled ctx returns OutcomeUnavailable with
// Reason "canceled" (or "timeout" for an expired deadline) before any work; a query with no full
// block is a miss. The result's Engines is a new slice owned by the caller; the result also keeps
// the keys the match hashed, for Place (one allocation of 8 bytes per block when the first block
// is held, none on a miss); the other matching buffers are pooled. With q.Buffers, the result is
// built in them instead and the lookup allocates nothing once they have grown.
func (s *LocalSource) Lookup(ctx context.Context, q Query) (Result, error) {
	bt := s.index.hasher.BlockTokens()
	if err := ctx.Err(); err != nil {
		return unavailable(bt, ctxReason(err), err), nil
	}
	sc, _ := s.pool.Get().(*localScratch)
	if sc == nil {
		sc = new(localScratch)
	}
	defer s.pool.Put(sc)
	b := q.Buffers
	if b != nil {
		sc.m.keys = b.keys[:0] // hash into the caller's buffer
	}
	s.index.matchTokensFrom(q.TokenIDs, s.index.hasher.rootFor(q.Adapter), &sc.m)
	r := Result{Outcome: OutcomeMiss, QueryBlocks: sc.m.QueryBlocks, BlockTokens: bt, source: s, adapter: q.Adapter}
	if b != nil {
		// The scratch goes back to the pool: it must not keep the caller's memory.
		b.keys = sc.m.keys[:0]
		if r.QueryBlocks > 0 && len(sc.m.keys) > 1 && len(sc.m.keys) <= r.QueryBlocks {
			r.keys = sc.m.keys[:len(sc.m.keys):len(sc.m.keys)]
		}
		sc.m.keys = nil
		if len(sc.m.Engines) > 0 {
			b.engines, b.ranks = s.index.trustedAppend(b.engines[:0], b.ranks[:0], sc.m.Engines, sc.m.DPRanks)
			if len(b.engines) > 0 {
				r.Engines, r.DPRanks = b.engines, b.ranks
				r.Outcome = OutcomeHit
			}
		}
		return r, nil
	}
	if r.QueryBlocks > 0 && len(sc.m.keys) > 1 && len(sc.m.keys) <= r.QueryBlocks {
		// The result takes the keys the match hashed, for Place, and the scratch lets go of them:
		// its next match hashes into a new buffer. Hashing into a buffer the result keeps costs
		// less than copying the keys into one: the stores to new memory overlap the hashing, a
		// copy waits for them.
		r.keys = sc.m.keys[:len(sc.m.keys):len(sc.m.keys)]
		sc.m.keys = nil
	}
	if len(sc.m.Engines) > 0 {
		r.Engines, r.DPRanks = s.index.trustedClone(sc.m.Engines, sc.m.DPRanks) // untrusted engines hold nothing (trust.go)
	}
	if len(r.Engines) > 0 {
		r.Outcome = OutcomeHit
	}
	return r, nil
}

// Place implements Placer with approximate entries of the source's index (docs/design.md §11,
// after Dynamo's approximate mode): they live Options.ApproxTTL, Match counts them like real
// blocks until then, and a real BlockStored of a block by (engine, rank) turns its entry real, so
// it no longer expires. Placing a block again sets its expiry anew; blocks the engine's rank holds
// through real events are left real: when r says the engine holds every block, nothing is
// recorded, and when the last block r says it holds is held through a real event, the prefix up
// to it is skipped and only the rest is recorded, so a conversation's next turn costs the new
// blocks only. Before adding, it drops the index's expired entries; when the index then holds
// more than Options.MaxApproxBlocks approximate entries it prunes them to 0.8 of the cap,
// earliest expiry first and, within an expiry, deepest block first. Approximate entries are not
// tree blocks: they neither count against MaxBlocks nor are evicted by it. The keys r carries are
// reused when r is this source's result for a prompt of q's length and adapter; a prompt with no
// full block records nothing. The entries are keyed from q.Adapter's root, so only queries for
// that adapter match them.
//
// Errors (an *EventError with Op "assume"; the index is unchanged): ErrInvalidEngine (engine is
// empty), ErrInvalidRank (rank < 0), ErrKeyConflict (a 64-bit key collision with a block of the
// index that is not a prompt's first block), ErrTooManyHolders (the engine's rank would be holder
// number 2^24).
func (s *LocalSource) Place(engine state.EngineID, rank int, q Query, r *Result) error {
	return s.place(engine, rank, q, r)
}

func (s *LocalSource) place(engine state.EngineID, rank int, q Query, r *Result) error {
	n := s.index.hasher.blocks(len(q.TokenIDs))
	if n == 0 {
		return nil
	}
	var keys []uint64
	held := 0
	if r != nil && r.source == Source(s) && r.adapter == q.Adapter && r.QueryBlocks == n {
		if r.Outcome == OutcomeHit {
			for j, m := range r.Engines {
				// The match's depth is the engine's deepest rank's: it says nothing of
				// another rank's holding.
				if m.Engine == engine && (r.DPRanks == nil || r.DPRanks[j] == rank) {
					held = m.Blocks
				}
			}
		}
		if held >= n {
			return nil
		}
		keys = r.keys
	}
	if len(keys) < n { // the lookup stopped hashing where the walk stopped: hash the rest
		b := s.index.hasher.BlockTokens()
		keys = s.index.hasher.appendFrom(slices.Clip(keys), lastKey(keys, s.index.hasher.rootFor(q.Adapter)), q.TokenIDs[len(keys)*b:n*b])
	}
	if err := s.index.assume(engine, rank, keys, held, 0, true); err != nil {
		return err
	}
	if h := s.index.placeHook.Load(); h != nil {
		(*h)(engine, rank, keys[:n], held)
	}
	return nil
}

// lastKey is the key a continuation of keys chains from: the last key, or root.
func lastKey(keys []uint64, root uint64) uint64 {
	if len(keys) == 0 {
		return root
	}
	return keys[len(keys)-1]
}

func ctxReason(err error) string {
	if errors.Is(err, context.DeadlineExceeded) {
		return reasonTimeout
	}
	return reasonCanceled
}

// RemoteIndexer is the host's client for a remote prefix-index service (for example
// MatchExternalKvPrefix of sgl-project/sglang `experimental/sgl-router/sgl-kv-indexer/proto/kv_indexer.proto`;
// docs/design.md §10). The host implements it; RemoteSource wraps it with
// the timeout, the concurrency limit and the outcome mapping.
//
// Contract:
//   - MatchPrefix returns, per engine, the number of leading query blocks the engine holds
//     contiguously. Engines holding none may be omitted or reported with 0. Duplicate engines are
//     merged by maximum; counts above the query's block count are capped to it; a negative count
//     or an empty engine ID makes the answer invalid (OutcomeUnavailable, Reason "invalid_answer").
//   - It should return promptly when ctx is done. If it does not, RemoteSource returns anyway at
//     the deadline and the call keeps its concurrency slot until it returns.
//   - An error wrapping state.ErrInvalidSignal means the service rejected the query (malformed,
//     wrong namespace); RemoteSource returns it as an error. Any other error means unavailable.
//   - It must not retain q after returning. It must be safe for concurrent use.
type RemoteIndexer interface {
	MatchPrefix(ctx context.Context, q RemoteQuery) ([]EngineMatch, error)
}

// RemoteQuery is what a RemoteIndexer receives: the prompt, its chained keys from the
// RemoteSource's Hasher, and the block size. A service keyed by tokens reads TokenIDs; one that
// shares this package's key scheme reads Keys. Both are read-only.
type RemoteQuery struct {
	// TokenIDs is the prompt, as the host tokenized it.
	TokenIDs []uint32
	// Keys are the chained keys of the prompt's full blocks, from Adapter's root (Hasher).
	Keys []uint64
	// Adapter is the LoRA adapter the prompt is for (Query.Adapter); empty means the base model.
	Adapter string
	// BlockTokens is the block size in tokens.
	BlockTokens int
}

// Defaults for RemoteOptions (docs/design.md §10: a 100 ms deadline and 32
// concurrent queries, as the experimental SGLang router).
const (
	defaultRemoteTimeout       = 100 * time.Millisecond
	defaultRemoteMaxConcurrent = 32
)

// RemoteOptions configures a RemoteSource. The zero value is the documented default for every
// field.
type RemoteOptions struct {
	// Timeout bounds each lookup; the caller's own deadline applies too, whichever is earlier.
	// 0 means 100 ms; negative is an error.
	Timeout time.Duration
	// MaxConcurrent is the most lookups in flight at once, counting calls that outlived their
	// deadline. A lookup over the limit does not wait: it returns OutcomeUnavailable with
	// Reason "overloaded". 0 means 32; negative is an error.
	MaxConcurrent int
}

// RemoteSource is a Source over a RemoteIndexer. It is safe for concurrent use.
type RemoteSource struct {
	indexer RemoteIndexer
	hasher  Hasher
	timeout time.Duration
	sem     chan struct{}
}

var _ Source = (*RemoteSource)(nil)

// NewRemoteSource returns a Source that asks indexer, hashing queries with h (whose block size
// must be the service's). A nil indexer, an invalid h or a negative option returns an error
// wrapping state.ErrInvalidConfiguration that names the field. It starts no goroutine.
func NewRemoteSource(indexer RemoteIndexer, h Hasher, opts RemoteOptions) (*RemoteSource, error) {
	switch {
	case indexer == nil:
		return nil, fmt.Errorf("kvindex: NewRemoteSource: nil indexer: %w", state.ErrInvalidConfiguration)
	case h.BlockTokens() <= 0:
		return nil, fmt.Errorf("kvindex: NewRemoteSource: Hasher.BlockTokens: %d, must be > 0 (use NewHasher): %w",
			h.BlockTokens(), state.ErrInvalidConfiguration)
	case opts.Timeout < 0:
		return nil, fmt.Errorf("kvindex: RemoteOptions.Timeout: %v, must be >= 0: %w", opts.Timeout, state.ErrInvalidConfiguration)
	case opts.MaxConcurrent < 0:
		return nil, fmt.Errorf("kvindex: RemoteOptions.MaxConcurrent: %d, must be >= 0: %w", opts.MaxConcurrent, state.ErrInvalidConfiguration)
	}
	if opts.Timeout == 0 {
		opts.Timeout = defaultRemoteTimeout
	}
	if opts.MaxConcurrent == 0 {
		opts.MaxConcurrent = defaultRemoteMaxConcurrent
	}
	return &RemoteSource{indexer: indexer, hasher: h, timeout: opts.Timeout, sem: make(chan struct{}, opts.MaxConcurrent)}, nil
}

type remoteReply struct {
	engines []EngineMatch
	err     error
}

// Lookup asks the remote indexer, within the timeout and the concurrency limit, and maps the
// outcome: an answer naming engines is a hit, an empty answer or a query with no full block (no
// I/O) a miss; timeout, cancellation, overload, a backend error and an invalid answer are
// OutcomeUnavailable with the matching Reason. A rejection (an error wrapping
// state.ErrInvalidSignal from the indexer) is returned as an error that wraps it.
func (s *RemoteSource) Lookup(ctx context.Context, q Query) (Result, error) {
	bt := s.hasher.BlockTokens()
	if err := ctx.Err(); err != nil {
		return unavailable(bt, ctxReason(err), err), nil
	}
	var keys []uint64
	if n := s.hasher.blocks(len(q.TokenIDs)); n > 0 {
		keys = s.hasher.appendFrom(make([]uint64, 0, n), s.hasher.rootFor(q.Adapter), q.TokenIDs)
	}
	if len(keys) == 0 {
		return Result{Outcome: OutcomeMiss, BlockTokens: bt}, nil
	}
	select {
	case s.sem <- struct{}{}:
	default:
		return unavailable(bt, reasonOverloaded, nil), nil
	}
	cctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	done := make(chan remoteReply, 1)
	rq := RemoteQuery{TokenIDs: q.TokenIDs, Keys: keys, BlockTokens: bt, Adapter: q.Adapter}
	go func() {
		defer func() { <-s.sem }()
		engines, err := s.indexer.MatchPrefix(cctx, rq)
		done <- remoteReply{engines, err}
	}()
	var reply remoteReply
	select {
	case reply = <-done:
	case <-cctx.Done():
		// The call may still finish; it keeps its slot until then.
		return unavailable(bt, ctxReason(cctx.Err()), cctx.Err()), nil
	}
	r := Result{QueryBlocks: len(keys), BlockTokens: bt}
	switch err := reply.err; {
	case err == nil:
	case errors.Is(err, state.ErrInvalidSignal):
		return Result{}, fmt.Errorf("kvindex: remote lookup of %d blocks rejected: %w", len(keys), err)
	case cctx.Err() != nil:
		return unavailable(bt, ctxReason(cctx.Err()), err), nil
	default:
		return unavailable(bt, reasonUnreachable, err), nil
	}
	engines, ok := normalizeRemote(reply.engines, len(keys))
	if !ok {
		return unavailable(bt, reasonInvalidAnswer, nil), nil
	}
	r.Outcome, r.Engines = OutcomeMiss, nil
	if len(engines) > 0 {
		r.Outcome, r.Engines = OutcomeHit, engines
	}
	return r, nil
}

// normalizeRemote validates a remote answer, drops zero counts, merges duplicate engines by
// maximum, caps counts at the query's block count (docs/design.md
// §10) and sorts deepest
// first. Engine IDs are compared exactly ("http://b/" is not "http://b").
func normalizeRemote(in []EngineMatch, queryBlocks int) ([]EngineMatch, bool) {
	out := make([]EngineMatch, 0, len(in))
	for _, e := range in {
		if e.Blocks < 0 || e.Engine == "" {
			return nil, false
		}
		if e.Blocks == 0 {
			continue
		}
		e.Blocks = min(e.Blocks, queryBlocks)
		if i := slices.IndexFunc(out, func(o EngineMatch) bool { return o.Engine == e.Engine }); i >= 0 {
			out[i].Blocks = max(out[i].Blocks, e.Blocks)
			continue
		}
		out = append(out, e)
	}
	slices.SortFunc(out, func(a, b EngineMatch) int {
		if a.Blocks != b.Blocks {
			return b.Blocks - a.Blocks
		}
		return cmp.Compare(a.Engine, b.Engine)
	})
	return out, true
}

// Memo makes one lookup per Source per request: the first Lookup of a source runs it, every later
// or concurrent Lookup of the same source in the same request gets the same Result and error,
// whatever bucket or group asks (docs/design.md §10; the scenarios
// memo_reuses_io_but_reruns_admission_and_group_selection and
// concurrent_picks_share_one_query_and_new_requests_query_again of sgl-project/sglang
// `experimental/sgl-router/tests/component/policies_reorg_cache_aware.rs`). Hits, misses, unavailability and
// rejections are all memoized.
//
// The host (or the bucket loop) creates one Memo per request (new(Memo)) and drops it with the
// request; a Memo must not outlive its request, since it answers every later lookup from memory.
// Sources are identified by interface equality, so each must be a comparable value, such as the
// *LocalSource or *RemoteSource pointer. A lookup is memoized per source and adapter
// (Query.Adapter), so a lookup for another adapter, or for the base model, runs again; Memo
// ignores the TokenIDs of all but the first Lookup of a source and adapter: one request has one
// prompt. It is safe for concurrent use; a repeated Lookup allocates nothing. The zero Memo is
// ready to use.
type Memo struct {
	mu      sync.Mutex
	entries []*memoEntry
}

type memoEntry struct {
	src     Source
	adapter string
	done    chan struct{}
	res     Result
	err     error
}

// Lookup returns src's answer to q, running src.Lookup only if no earlier Lookup of src for
// q.Adapter in this Memo did. A caller that finds the lookup in progress waits for it, or for its own ctx: if ctx
// ends first it gets OutcomeUnavailable with Reason "canceled" or "timeout", which is not
// memoized. A nil or non-comparable src returns an error wrapping state.ErrInvalidConfiguration.
// If src.Lookup panics, the panic propagates to the caller that ran it, and the memoized result
// is OutcomeUnavailable with Reason "unreachable".
func (m *Memo) Lookup(ctx context.Context, src Source, q Query) (Result, error) {
	if src == nil || !reflect.TypeOf(src).Comparable() {
		return Result{}, fmt.Errorf("kvindex: Memo.Lookup: source %T is nil or not comparable: %w", src, state.ErrInvalidConfiguration)
	}
	m.mu.Lock()
	for _, e := range m.entries {
		if e.src == src && e.adapter == q.Adapter {
			m.mu.Unlock()
			select {
			case <-e.done:
				return e.res, e.err
			default:
			}
			select {
			case <-e.done:
				return e.res, e.err
			case <-ctx.Done():
				return unavailable(0, ctxReason(ctx.Err()), ctx.Err()), nil
			}
		}
	}
	e := &memoEntry{src: src, adapter: q.Adapter, done: make(chan struct{})}
	m.entries = append(m.entries, e)
	m.mu.Unlock()
	finished := false
	defer func() {
		if !finished {
			e.res = unavailable(0, reasonUnreachable, fmt.Errorf("kvindex: Memo.Lookup: source %T panicked", src))
			close(e.done)
		}
	}()
	q.Buffers = nil // the result is shared: it must not alias one caller's buffers
	e.res, e.err = src.Lookup(ctx, q)
	finished = true
	close(e.done)
	return e.res, e.err
}
