package loadmon

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/enginepick/enginepick/internal/loadbridge"
	"github.com/enginepick/enginepick/state"
)

// dispatchRing is how many recent dispatch times each engine keeps for DispatchedSince. Counts
// since a time older than the ring saturate at this value.
const dispatchRing = 64

// InFlight holds router-local in-flight counters: requests this router dispatched to an engine and
// whose response has not ended. It is always known (never unknown, unlike engine reports) and is
// the fallback pressure when reports are missing (docs/design.md §6).
//
// Each engine's counter lives as long as some guard or the table references it: Remove detaches an
// engine, and guards acquired before keep decrementing the counter they incremented, so a re-added
// engine starts from zero and is never driven negative (docs/design.md §6).
//
// All methods are safe for concurrent use. Count and DispatchedSince are lock-free: the engine
// map is an immutable value replaced as a whole when an engine is first seen or removed (rare), and
// the counters are atomics. They allocate nothing.
type InFlight struct {
	now    func() time.Time
	system bool // now is time.Now (NewInFlight(nil)): TryAcquire records the caller's reading

	// firstTokens is set once a host has ended some dispatch's prefill with Guard.FirstToken:
	// from then on, prefill tokens in flight count in the pending-prefill estimates.
	firstTokens atomic.Bool

	mu       sync.Mutex // serializes map replacement
	counters atomic.Pointer[map[state.EngineID]*counter]
	ranks    atomic.Pointer[map[rankKey]*counter] // per (engine, DP rank): dispatches that named one

	// hook, when set, is told every dispatch change (loadbridge.SetHook); ids numbers dispatches
	// for it.
	hook atomic.Pointer[func(loadbridge.Change)]
	ids  atomic.Uint64
	// peers and peerRanks count other router replicas' dispatches (loadbridge.ApplyPeer), same
	// scheme as counters and ranks.
	peers     atomic.Pointer[map[state.EngineID]*counter]
	peerRanks atomic.Pointer[map[rankKey]*counter]
	// replicas is this router's rank among the replicas sharing with it (high 32 bits) and their
	// number (low 32 bits; 0 means 1): loadbridge.SetReplicas.
	replicas atomic.Uint64
}

// rankKey names one DP rank of an engine.
type rankKey struct {
	engine state.EngineID
	rank   int
}

type counter struct {
	n atomic.Int64
	// dispatches records the recent dispatches (Acquire): their times and prefill tokens.
	dispatches stampRing
	// ringTokens is the sum of dispatches' tokens: the prefill tokens of the recorded dispatches.
	ringTokens atomic.Uint64
	// prefilling is the prefill tokens of the in-flight dispatches whose first token has not
	// arrived (Guard.FirstToken) and that are not released.
	prefilling atomic.Uint64
	// ends records the recent prefill ends (first tokens) of the dispatches: endedSince.
	ends stampRing
	// releases records the times of the recent releases (engine counters only): inFlightAt.
	releases stampRing
}

// stampRing records the time (unix nanos) and prefill tokens of the 64 most recent events of an
// engine (dispatches, or prefill ends), lock-free.
type stampRing struct {
	head   atomic.Uint64 // number of events recorded
	at     [dispatchRing]atomic.Int64
	tokens [dispatchRing]atomic.Uint64
}

// record records an event of tokens prefill tokens at at (unix nanos) and returns the tokens of
// the event it overwrote (0 while the ring fills). Tokens before the time: a reader that sees the
// new time sees these tokens, unless a later event has already reused the slot (64 events
// between a reader's two loads).
func (r *stampRing) record(tokens uint64, at int64) (old uint64) {
	i := r.head.Add(1) - 1
	old = r.tokens[i%dispatchRing].Swap(tokens)
	r.at[i%dispatchRing].Store(at)
	return old
}

// since counts the recorded events at or after t, newest first, and their tokens.
func (r *stampRing) since(t time.Time) (events, tokens uint64) {
	head := r.head.Load()
	at := t.UnixNano()
	for events < head && events < dispatchRing {
		i := (head - 1 - events) % dispatchRing
		if r.at[i].Load() < at {
			break
		}
		tokens = satAdd(tokens, r.tokens[i].Load())
		events++
	}
	return events, tokens
}

// endedSince returns the prefill tokens of the dispatches whose prefill ended at or after t, over
// at most the 64 most recent ends; 0 for a nil counter.
func (c *counter) endedSince(t time.Time) uint64 {
	if c == nil {
		return 0
	}
	_, tok := c.ends.since(t)
	return tok
}

// NewInFlight returns empty counters that timestamp dispatches with now (nil: time.Now).
func NewInFlight(now func() time.Time) *InFlight {
	system := now == nil
	if system {
		now = time.Now
	}
	f := &InFlight{now: now, system: system}
	f.counters.Store(&map[state.EngineID]*counter{})
	f.ranks.Store(&map[rankKey]*counter{})
	f.peers.Store(&map[state.EngineID]*counter{})
	f.peerRanks.Store(&map[rankKey]*counter{})
	return f
}

// Guard is one dispatched request's hold on an engine's in-flight counter. Release it when the
// response (or stream) ends, whatever the outcome. Release is idempotent and safe for concurrent
// use; a nil *Guard's Release does nothing.
type Guard struct {
	c        *counter
	rc       *counter // the DP rank's counter; nil unless the dispatch named a rank
	f        *InFlight
	tokens   uint64 // prefill tokens, counted in prefilling until the first token
	released atomic.Bool
	prefill  atomic.Bool // the prefill has ended (FirstToken or Release)

	// Set when the InFlight has a hook: the dispatch as the hook names it.
	hook   func(loadbridge.Change)
	id     uint64
	engine state.EngineID
	rank   int
}

// FirstToken records that the request's first output token has arrived: the engine has ended its
// prefill, so its prefill tokens no longer count as pending there. Calling it is optional; a host
// that calls it for its dispatches gives pending-prefill estimates on engines without native load
// reports the router's exact in-flight prefill work (docs/design.md §9.11). Idempotent; a nil
// *Guard's FirstToken does nothing.
func (g *Guard) FirstToken() {
	if g == nil {
		return
	}
	if !g.f.firstTokens.Load() {
		g.f.firstTokens.Store(true)
	}
	if g.endPrefill() && g.hook != nil {
		g.hook(loadbridge.Change{Op: loadbridge.OpPrefillEnd, ID: g.id, Engine: g.engine, Rank: g.rank, Tokens: g.tokens})
	}
}

// endPrefill ends the dispatch's prefill once, reporting whether it had prefill tokens. Once the
// host reports first tokens, the end is recorded with its time (endedSince): a release before the
// first token is an aborted prefill, which the engine drops then too; without first tokens, a
// release comes when the whole request ends, long after its prefill did, and is not recorded.
func (g *Guard) endPrefill() bool {
	if !g.prefill.CompareAndSwap(false, true) || g.tokens == 0 {
		return false
	}
	g.c.prefilling.Add(-g.tokens)
	if g.rc != nil {
		g.rc.prefilling.Add(-g.tokens)
	}
	if g.f.firstTokens.Load() {
		at := g.f.now().UnixNano()
		g.c.ends.record(g.tokens, at)
		if g.rc != nil {
			g.rc.ends.record(g.tokens, at)
		}
	}
	return true
}

// Release decrements the counters the guard incremented, once.
func (g *Guard) Release() {
	if g == nil || !g.released.CompareAndSwap(false, true) {
		return
	}
	ended := g.endPrefill()
	g.c.n.Add(-1)
	g.c.releases.record(0, g.f.now().UnixNano())
	if g.rc != nil {
		g.rc.n.Add(-1)
	}
	if g.hook != nil {
		var tokens uint64
		if ended {
			tokens = g.tokens
		}
		g.hook(loadbridge.Change{Op: loadbridge.OpEnd, ID: g.id, Engine: g.engine, Rank: g.rank, Tokens: tokens})
	}
}

func (f *InFlight) lookup(engine state.EngineID) *counter {
	return (*f.counters.Load())[engine]
}

// replace publishes a copy of the engine map changed by edit. Callers hold f.mu.
func (f *InFlight) replace(edit func(map[state.EngineID]*counter)) {
	old := *f.counters.Load()
	next := make(map[state.EngineID]*counter, len(old)+1)
	for k, v := range old {
		next[k] = v
	}
	edit(next)
	f.counters.Store(&next)
}

// Acquire counts one dispatch to the engine and records its time and prefillTokens, the prompt
// tokens it brings to prefill (a pick's Pick.PrefillTokens; 0 for a decode dispatch or unknown
// work), which DispatchedSince sums so that pressure comparisons count the prefill work dispatched
// after an engine's last report (docs/design.md §6). rank is the engine's DP rank the dispatch
// names (a pick's Pick.DPRank), counted on that rank too; a negative rank names none. Call it at
// dispatch, before the request is sent (sglang PR #27547: counting only once decode streams
// starts hot-spots prefill). TryAcquire is Acquire under an in-flight cap.
func (f *InFlight) Acquire(engine state.EngineID, rank int, prefillTokens uint64) *Guard {
	at := f.now().UnixNano()
	return f.withRank(f.acquire(engine, prefillTokens, at), engine, rank, prefillTokens, at)
}

func (f *InFlight) acquire(engine state.EngineID, prefillTokens uint64, at int64) *Guard {
	c := f.engineCounter(engine)
	c.n.Add(1)
	c.stamp(prefillTokens, at)
	return &Guard{c: c, f: f, tokens: prefillTokens}
}

// engineCounter returns the engine's counter, creating it on the engine's first dispatch.
func (f *InFlight) engineCounter(engine state.EngineID) *counter {
	c := f.lookup(engine)
	if c == nil {
		f.mu.Lock()
		if c = f.lookup(engine); c == nil {
			c = &counter{}
			f.replace(func(m map[state.EngineID]*counter) { m[engine] = c })
		}
		f.mu.Unlock()
	}
	return c
}

// TryAcquire is Acquire under an in-flight cap: it counts the dispatch only while the engine's
// in-flight count (Count) is below limit, checking and incrementing in one atomic step, so that
// concurrent dispatches never take the engine past limit (math.MaxUint64: no cap). It returns the
// guard and the count it found; the guard is nil, and nothing is counted or recorded, when that
// count had reached limit (a limit of 0 admits nothing). The cap is on the engine's count, as
// admission.Limits.MaxInFlightRequests is; a named rank is counted as Acquire counts it.
//
// at is the caller's reading of time.Now at dispatch, or zero: counters built with
// NewInFlight(nil) record it rather than read the clock again (a Router timing its selection,
// docs/design.md §15); counters with another clock, or a zero at, read their own clock.
//
// A configured in-flight cap is a promise only if the dispatch is acquired this way, with the cap
// its pick was admitted under (policy.Pick.InFlightCap): the admission check read a count that
// concurrent selections may have raised since. A failed acquire is a rejection: release what the
// selection already acquired (a PD pair's other leg) and select again, so that the policy sees
// the new count (docs/design.md §5). Router.Select does this.
func (f *InFlight) TryAcquire(engine state.EngineID, rank int, prefillTokens, limit uint64, at time.Time) (*Guard, uint64) {
	c := f.engineCounter(engine)
	for {
		n := c.n.Load()
		found := uint64(max(n, 0))
		if found >= limit {
			return nil, found
		}
		if c.n.CompareAndSwap(n, n+1) {
			var ns int64
			if f.system && !at.IsZero() {
				ns = at.UnixNano()
			} else {
				ns = f.now().UnixNano()
			}
			c.stamp(prefillTokens, ns)
			return f.withRank(&Guard{c: c, f: f, tokens: prefillTokens}, engine, rank, prefillTokens, ns), found
		}
	}
}

// withRank counts the engine's dispatch g on its DP rank too; a negative rank counts on none.
func (f *InFlight) withRank(g *Guard, engine state.EngineID, rank int, prefillTokens uint64, at int64) *Guard {
	if h := f.hook.Load(); h != nil {
		g.hook, g.id, g.engine, g.rank = *h, f.ids.Add(1), engine, max(rank, -1)
		defer g.hook(loadbridge.Change{Op: loadbridge.OpStart, ID: g.id, Engine: engine, Rank: g.rank, Tokens: prefillTokens, At: at})
	}
	if rank < 0 {
		return g
	}
	k := rankKey{engine, rank}
	rc := (*f.ranks.Load())[k]
	if rc == nil {
		f.mu.Lock()
		if rc = (*f.ranks.Load())[k]; rc == nil {
			rc = &counter{}
			old := *f.ranks.Load()
			next := make(map[rankKey]*counter, len(old)+1)
			for k, v := range old {
				next[k] = v
			}
			next[k] = rc
			f.ranks.Store(&next)
		}
		f.mu.Unlock()
	}
	rc.n.Add(1)
	rc.stamp(prefillTokens, at)
	g.rc = rc
	return g
}

// stamp records the time (unix nanos) and prefill tokens of a dispatch already counted in n.
func (c *counter) stamp(prefillTokens uint64, at int64) {
	old := c.dispatches.record(prefillTokens, at)
	c.ringTokens.Add(prefillTokens - old) // modular: the sum stays exact
	c.prefilling.Add(prefillTokens)
}

// meanTokens returns the mean prefill tokens of the recorded dispatches (the 64 most recent),
// rounded down; 0 for none or for a nil counter.
func (c *counter) meanTokens() uint64 {
	if c == nil {
		return 0
	}
	n := min(c.dispatches.head.Load(), dispatchRing)
	if n == 0 {
		return 0
	}
	return c.ringTokens.Load() / n
}

// prefilling returns the prefill tokens of this router's in-flight dispatches to the engine whose
// first token has not arrived (Guard.FirstToken). It is 0 until the host has called FirstToken for
// some dispatch: without first tokens, no prefill is known to have ended. An engine never
// dispatched to has 0.
func (f *InFlight) prefilling(engine state.EngineID) uint64 {
	c := f.lookup(engine)
	if c == nil || !f.firstTokens.Load() {
		return 0
	}
	return c.prefilling.Load()
}

// Count returns the engine's in-flight requests; an engine never dispatched to has 0.
func (f *InFlight) Count(engine state.EngineID) uint64 {
	return f.lookup(engine).count()
}

// count returns the counter's value, 0 for a nil counter.
func (c *counter) count() uint64 {
	if c == nil {
		return 0
	}
	if n := c.n.Load(); n > 0 {
		return uint64(n)
	}
	return 0
}

// DispatchedSince returns how many dispatches to the engine happened at or after t and the
// prefill tokens they brought (Acquire), over at most the 64 most recent dispatches. rank ≥ 0
// counts only the dispatches that named that DP rank; a negative rank counts every dispatch to the
// engine. A dispatch stamped with exactly a report's arrival time may or may not be reflected in
// that report; it is counted, erring toward spreading a burst rather than sending it all to one
// engine (with a coarse clock, or a simulated one, every request of a burst can share the report's
// timestamp). It allocates nothing and takes no lock; under concurrent acquires the token sum may
// miss or include a dispatch the count does not.
func (f *InFlight) DispatchedSince(engine state.EngineID, rank int, t time.Time) (requests, prefillTokens uint64) {
	if rank >= 0 {
		return (*f.ranks.Load())[rankKey{engine, rank}].since(t)
	}
	return f.lookup(engine).since(t)
}

// inFlightAt returns the dispatches in flight at t, as their counts and recent times show: in
// flight now, less those dispatched at or after t, plus those released at or after t, each over
// the 64 most recent; 0 for a nil counter. peer selects the peer counters' scan of dispatch
// times (peerSince).
func (c *counter) inFlightAt(t time.Time, peer bool) uint64 {
	if c == nil {
		return 0
	}
	since, _ := c.since(t)
	if peer {
		since, _ = c.peerSince(t)
	}
	released, _ := c.releases.since(t)
	n := satAdd(c.count(), released)
	return n - min(n, since)
}

// rankCount returns the in-flight requests dispatched to the engine's DP rank; 0 for a rank never
// named.
func (f *InFlight) rankCount(engine state.EngineID, rank int) uint64 {
	return (*f.ranks.Load())[rankKey{engine, rank}].count()
}

// since counts the dispatches recorded at or after t and their prefill tokens; 0 for nil.
func (c *counter) since(t time.Time) (requests, prefillTokens uint64) {
	if c == nil {
		return 0, 0
	}
	return c.dispatches.since(t)
}

// Remove detaches the engine's counters, its ranks' included (engine removal). Outstanding guards still release into the
// detached counter; the next Acquire starts a fresh one at zero.
func (f *InFlight) Remove(engine state.EngineID) {
	f.mu.Lock()
	if f.lookup(engine) != nil {
		f.replace(func(m map[state.EngineID]*counter) { delete(m, engine) })
	}
	old := *f.ranks.Load()
	var next map[rankKey]*counter
	for k := range old {
		if k.engine == engine {
			if next == nil {
				next = make(map[rankKey]*counter, len(old))
				for k, v := range old {
					next[k] = v
				}
			}
			delete(next, k)
		}
	}
	if next != nil {
		f.ranks.Store(&next)
	}
	f.removePeers(engine)
	f.mu.Unlock()
}
