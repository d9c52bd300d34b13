// Package peersync folds router replicas' shared decisions into each replica's view: the
// dispatches each replica starts and ends per engine and DP rank, and its route-time placements
// (docs/design.md §6, "Router replicas"). It has no goroutine and no transport: package
// internal/peersync/redispeer runs it over Redis, the replay (internal/sim) over virtual time.
package peersync

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"

	"github.com/enginepick/enginepick/internal/kvbridge"
	"github.com/enginepick/enginepick/internal/loadbridge"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

// ErrInvalidBatch is returned by Receive for a message that is not a batch.
var ErrInvalidBatch = errors.New("peersync: invalid batch")

// Config configures a Core.
type Config struct {
	// ID names this replica among its peers; required. Incarnation tells a restarted replica
	// from its previous run (any value that differs between runs, e.g. the start time).
	ID          string
	Incarnation uint64
	// InFlight is this replica's in-flight counters: its dispatches are shared, its peers' folded
	// in. Required.
	InFlight *loadmon.InFlight
	// Index is this replica's prefix index: its LocalSource placements are shared, its peers'
	// recorded. nil: placements are neither shared nor received.
	Index *kvindex.Index
	// Known reports whether an engine is in this replica's fleet; deltas for others are dropped.
	// Required.
	Known func(state.EngineID) bool
	// Lease is how long a silent peer's dispatches keep counting (Expire); > 0.
	Lease time.Duration
}

// Core is one replica's side of the sharing: the local deltas waiting for Flush and the state of
// every peer heard from. Safe for concurrent use.
type Core struct {
	cfg Config

	outMu sync.Mutex
	out   batch // pending local deltas; out.Seq is the last sequence number flushed
	// own is this replica's dispatches in flight, as started (prefill tokens 0 once its first
	// token came): what a Full batch announces.
	own map[uint64]change
	// want asks the peers, in the next batch, to announce their dispatches (a gap, or a peer
	// first heard after its first batch); announce makes the next batch Full.
	want, announce bool

	mu    sync.Mutex
	peers map[string]*peer

	sent, received atomic.Uint64
	dropped        [NumReasons]atomic.Uint64
}

// Reason is why deltas were dropped (Drops).
type Reason uint8

// The reasons a delta is dropped.
const (
	// ReasonDuplicate: a batch received before, a second start of one dispatch, or a second
	// first token.
	ReasonDuplicate Reason = iota
	// ReasonUnknownEngine: a start or placement on an engine not in this replica's fleet.
	ReasonUnknownEngine
	// ReasonUnknownDispatch: a first token or end of a dispatch not counted (its start was lost in
	// a gap, or the peer was forgotten since).
	ReasonUnknownDispatch
	// ReasonRefusedPlacement: a placement the index refused, or any placement when this replica
	// has no index.
	ReasonRefusedPlacement
	// ReasonMalformed: a message that is not a batch (counted once per message), or a change of
	// an unknown kind.
	ReasonMalformed
	// NumReasons is the number of reasons.
	NumReasons
)

// String returns the reason's metric label: duplicate, unknown_engine, unknown_dispatch,
// refused_placement or malformed.
func (r Reason) String() string {
	if r >= NumReasons {
		return "unknown"
	}
	return [...]string{"duplicate", "unknown_engine", "unknown_dispatch", "refused_placement", "malformed"}[r]
}

// batch is the message replicas exchange, msgpack-encoded.
type batch struct {
	_      struct{} `msgpack:",as_array"`
	Origin string
	Inc    uint64
	Seq    uint64 // from 1 per incarnation; a gap means lost batches
	// Changes may open with opWant, and may end with opFull and an announcement: changes of an
	// Op a replica without them drops as malformed, applying the rest as ever.
	Changes []change
	Places  []place
}

// Markers in a batch's Changes.
const (
	// opWant asks every peer to announce its dispatches in flight.
	opWant loadbridge.Op = 0xf0 + iota
	// opFull: the Changes after it are the origin's dispatches in flight, as starts, and nothing
	// else.
	opFull
)

type change struct {
	_      struct{} `msgpack:",as_array"`
	Op     loadbridge.Op
	ID     uint64
	Engine state.EngineID
	Rank   int
	Tokens uint64
	At     int64
}

type place struct {
	_      struct{} `msgpack:",as_array"`
	Engine state.EngineID
	Rank   int
	Keys   []uint64
	Held   int
}

// checkLengths walks one msgpack value of a message of limit bytes and refuses an array or map
// longer than limit, which the message cannot hold (an element takes a byte at least), or nested
// deeper than depth: msgpack's reflection would allocate the declared length first, so that a few
// bytes declaring 2^28 placements exhaust memory.
func checkLengths(d *msgpack.Decoder, limit, depth int) error {
	c, err := d.PeekCode()
	if err != nil {
		return err
	}
	var n int
	switch {
	case msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32:
		n, err = d.DecodeArrayLen()
	case msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32:
		n, err = d.DecodeMapLen()
		n *= 2
	default:
		return d.Skip()
	}
	switch {
	case err != nil:
		return err
	case n > 2*limit || depth == 0:
		return errors.New("array or map longer than the message, or nested too deep")
	}
	for range n {
		if err := checkLengths(d, limit, depth-1); err != nil {
			return err
		}
	}
	return nil
}

// peer is what a replica knows of one peer: its live dispatches, folded into the InFlight.
type peer struct {
	inc   uint64
	seq   uint64
	heard time.Time
	live  map[uint64]*dispatch
}

type dispatch struct {
	engine     state.EngineID
	rank       int
	prefilling uint64 // prefill tokens still counted
}

// New returns a Core and installs its hooks on cfg.InFlight and cfg.Index (Close removes them).
func New(cfg Config) (*Core, error) {
	switch {
	case cfg.ID == "":
		return nil, fmt.Errorf("peersync: empty replica ID: %w", state.ErrInvalidConfiguration)
	case cfg.InFlight == nil || cfg.Known == nil:
		return nil, fmt.Errorf("peersync: InFlight and Known are required: %w", state.ErrInvalidConfiguration)
	case cfg.Lease <= 0:
		return nil, fmt.Errorf("peersync: lease %v, must be > 0: %w", cfg.Lease, state.ErrInvalidConfiguration)
	}
	c := &Core{cfg: cfg, peers: map[string]*peer{}, own: map[uint64]change{}}
	c.out.Origin, c.out.Inc = cfg.ID, cfg.Incarnation
	loadbridge.SetHook(cfg.InFlight, c.local)
	if cfg.Index != nil {
		kvbridge.SetPlaceHook(cfg.Index, c.localPlace)
	}
	return c, nil
}

// Close removes the hooks New installed; the InFlight's router counts as alone again.
func (c *Core) Close() {
	loadbridge.SetHook(c.cfg.InFlight, nil)
	loadbridge.SetReplicas(c.cfg.InFlight, 0, 1)
	if c.cfg.Index != nil {
		kvbridge.SetPlaceHook(c.cfg.Index, nil)
	}
}

func (c *Core) local(ch loadbridge.Change) {
	if !c.cfg.Known(ch.Engine) {
		return
	}
	d := change{Op: ch.Op, ID: ch.ID, Engine: ch.Engine, Rank: ch.Rank, Tokens: ch.Tokens, At: ch.At}
	c.outMu.Lock()
	c.out.Changes = append(c.out.Changes, d)
	switch ch.Op {
	case loadbridge.OpStart:
		c.own[ch.ID] = d
	case loadbridge.OpPrefillEnd:
		if o, ok := c.own[ch.ID]; ok {
			o.Tokens = 0
			c.own[ch.ID] = o
		}
	case loadbridge.OpEnd:
		delete(c.own, ch.ID)
	}
	c.outMu.Unlock()
}

// Resync makes the next batch announce this replica's dispatches in flight and ask every peer to
// announce theirs: after the transport (re)subscribes, when batches sent or published meanwhile
// are lost.
func (c *Core) Resync() {
	c.outMu.Lock()
	c.want, c.announce = true, true
	c.outMu.Unlock()
}

func (c *Core) localPlace(engine state.EngineID, rank int, keys []uint64, held int) {
	p := place{Engine: engine, Rank: rank, Keys: append([]uint64(nil), keys...), Held: held}
	c.outMu.Lock()
	c.out.Places = append(c.out.Places, p)
	c.outMu.Unlock()
}

// Lease returns Config.Lease.
func (c *Core) Lease() time.Duration { return c.cfg.Lease }

// Pending reports whether local deltas, a request to the peers or an announcement wait for Flush.
func (c *Core) Pending() bool {
	c.outMu.Lock()
	defer c.outMu.Unlock()
	return len(c.out.Changes)+len(c.out.Places) > 0 || c.want || c.announce
}

// PendingDeltas returns how many local deltas wait for Flush.
func (c *Core) PendingDeltas() int {
	c.outMu.Lock()
	defer c.outMu.Unlock()
	return len(c.out.Changes) + len(c.out.Places)
}

// Flush takes the pending local deltas as one encoded batch with the next sequence number; with
// none pending it returns nil unless heartbeat (an empty batch keeps this replica's lease) or a
// peer asked for this replica's dispatches. A batch the caller fails to deliver is lost: peers
// see the gap and ask for this replica's dispatches again (Receive).
func (c *Core) Flush(heartbeat bool) []byte {
	msg, _ := c.FlushDeltas(heartbeat)
	return msg
}

// FlushDeltas is Flush that also returns how many local deltas the batch carries (0 for a
// heartbeat alone or no batch; an announcement of the dispatches in flight is not counted).
func (c *Core) FlushDeltas(heartbeat bool) ([]byte, int) {
	c.outMu.Lock()
	n := len(c.out.Changes) + len(c.out.Places)
	if n == 0 && !heartbeat && !c.want && !c.announce {
		c.outMu.Unlock()
		return nil, 0
	}
	c.out.Seq++
	if c.announce {
		// After the deltas, which a replica without announcements applies as ever.
		c.out.Changes = append(c.out.Changes, change{Op: opFull})
		k := len(c.out.Changes)
		for _, d := range c.own {
			c.out.Changes = append(c.out.Changes, d)
		}
		slices.SortFunc(c.out.Changes[k:], func(a, b change) int { return cmp.Compare(a.ID, b.ID) })
	}
	if c.want {
		c.out.Changes = slices.Insert(c.out.Changes, 0, change{Op: opWant})
	}
	b, err := msgpack.Marshal(&c.out)
	c.out.Changes, c.out.Places = c.out.Changes[:0], c.out.Places[:0]
	c.want, c.announce = false, false
	c.outMu.Unlock()
	if err != nil {
		panic(err) // a batch of plain values always encodes
	}
	c.sent.Add(uint64(n))
	return b, n
}

// Counts returns the deltas this replica flushed, the peers' deltas it applied and those it
// dropped, for every reason (Drops).
func (c *Core) Counts() (sent, received, dropped uint64) {
	for _, n := range c.Drops() {
		dropped += n
	}
	return c.sent.Load(), c.received.Load(), dropped
}

// Drops returns the peers' deltas dropped, by Reason.
func (c *Core) Drops() [NumReasons]uint64 {
	var out [NumReasons]uint64
	for r := range out {
		out[r] = c.dropped[r].Load()
	}
	return out
}

func (c *Core) drop(r Reason, n int) { c.dropped[r].Add(uint64(n)) }

// Receive folds one peer batch into the view at now: its own batches are ignored, a batch seen
// before is dropped, and a new incarnation first drops what the peer had in flight, which then
// counts again from the starts received; after a gap in a peer's sequence, what the view held
// of the peer counts until the peer's announcement replaces it. A gap, or a peer first
// heard after its first batch, makes this replica's next batch ask the peers to announce their
// dispatches in flight and announce its own (the lost batches may have asked for them); a batch
// asking so makes the next one announce this replica's; an announcement, after its batch's
// deltas, replaces what the view held of its origin. Errors: ErrInvalidBatch (nothing
// changes).
func (c *Core) Receive(msg []byte, now time.Time) error {
	var b batch
	err := checkLengths(msgpack.NewDecoder(bytes.NewReader(msg)), len(msg), 4)
	if err == nil {
		err = msgpack.Unmarshal(msg, &b)
	}
	if err != nil || b.Origin == "" || b.Seq == 0 {
		c.drop(ReasonMalformed, 1)
		return fmt.Errorf("%w: %v", ErrInvalidBatch, err)
	}
	if b.Origin == c.cfg.ID && b.Inc == c.cfg.Incarnation {
		return nil
	}
	want := len(b.Changes) > 0 && b.Changes[0].Op == opWant
	if want {
		b.Changes = b.Changes[1:]
	}
	var announced []change
	full := false
	if k := slices.IndexFunc(b.Changes, func(ch change) bool { return ch.Op == opFull }); k >= 0 {
		b.Changes, announced, full = b.Changes[:k], b.Changes[k+1:], true
	}
	if want {
		c.outMu.Lock()
		c.announce = true
		c.outMu.Unlock()
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	p := c.peers[b.Origin]
	missed := false // batches of the peer this view never saw
	switch {
	case p == nil:
		p = &peer{inc: b.Inc, live: map[uint64]*dispatch{}}
		c.peers[b.Origin] = p
		c.rank()
		missed = b.Seq > 1
	case p.inc != b.Inc:
		c.forget(p)
		p.inc = b.Inc
		missed = b.Seq > 1
	case b.Seq <= p.seq:
		c.drop(ReasonDuplicate, len(b.Changes)+len(b.Places))
		return nil
	case b.Seq != p.seq+1:
		// Its dispatches stay counted until its announcement replaces them: forgotten, those
		// still in flight would be recorded twice among the dispatches since a report.
		missed = true
	}
	if missed && !full {
		// The lost batches may have asked for this replica's dispatches too.
		c.outMu.Lock()
		c.want, c.announce = true, true
		c.outMu.Unlock()
	}
	p.seq, p.heard = b.Seq, now
	for _, ch := range b.Changes {
		c.applyCounted(p, ch)
	}
	if full {
		c.reconcile(p, announced)
		for _, ch := range announced {
			if d := p.live[ch.ID]; d != nil && ch.Op == loadbridge.OpStart {
				// Counted already: only its prefill may have ended since.
				if ch.Tokens == 0 && d.prefilling > 0 {
					c.apply(p, change{Op: loadbridge.OpPrefillEnd, ID: ch.ID})
				}
				continue
			}
			c.applyCounted(p, ch)
		}
	}
	for _, pl := range b.Places {
		switch {
		case c.cfg.Index == nil:
			c.drop(ReasonRefusedPlacement, 1)
		case !c.cfg.Known(pl.Engine):
			c.drop(ReasonUnknownEngine, 1)
		case kvbridge.PlacePeer(c.cfg.Index, pl.Engine, pl.Rank, pl.Keys, pl.Held) != nil:
			c.drop(ReasonRefusedPlacement, 1)
		default:
			c.received.Add(1)
		}
	}
	return nil
}

// apply folds one change of p; false, with the reason, when it is dropped. Callers hold c.mu.
func (c *Core) apply(p *peer, ch change) (Reason, bool) {
	d := p.live[ch.ID]
	switch ch.Op {
	case loadbridge.OpStart:
		if d != nil {
			return ReasonDuplicate, false
		}
		if !c.cfg.Known(ch.Engine) {
			return ReasonUnknownEngine, false
		}
		rank := max(ch.Rank, -1)
		p.live[ch.ID] = &dispatch{engine: ch.Engine, rank: rank, prefilling: ch.Tokens}
		loadbridge.ApplyPeer(c.cfg.InFlight, loadbridge.Change{Op: loadbridge.OpStart, Engine: ch.Engine, Rank: rank, Tokens: ch.Tokens, At: ch.At})
	case loadbridge.OpPrefillEnd:
		if d == nil {
			return ReasonUnknownDispatch, false
		}
		if d.prefilling == 0 {
			return ReasonDuplicate, false
		}
		loadbridge.ApplyPeer(c.cfg.InFlight, loadbridge.Change{Op: loadbridge.OpPrefillEnd, Engine: d.engine, Rank: d.rank, Tokens: d.prefilling})
		d.prefilling = 0
	case loadbridge.OpEnd:
		if d == nil {
			return ReasonUnknownDispatch, false
		}
		c.end(p, ch.ID, d)
	default:
		return ReasonMalformed, false
	}
	return 0, true
}

// applyCounted is apply counting the change as received or dropped. Callers hold c.mu.
func (c *Core) applyCounted(p *peer, ch change) {
	if r, ok := c.apply(p, ch); ok {
		c.received.Add(1)
	} else {
		c.drop(r, 1)
	}
}

// end ends p's dispatch id in the view. Callers hold c.mu.
func (c *Core) end(p *peer, id uint64, d *dispatch) {
	loadbridge.ApplyPeer(c.cfg.InFlight, loadbridge.Change{Op: loadbridge.OpEnd, Engine: d.engine, Rank: d.rank, Tokens: d.prefilling})
	delete(p.live, id)
}

// reconcile ends every dispatch of p in the view that p's announcement of its dispatches in
// flight, starts, does not name. Callers hold c.mu.
func (c *Core) reconcile(p *peer, starts []change) {
	named := make(map[uint64]bool, len(starts))
	for _, ch := range starts {
		named[ch.ID] = true
	}
	for id, d := range p.live {
		if !named[id] {
			c.end(p, id, d)
		}
	}
}

// forget ends every dispatch of p in the view. Callers hold c.mu.
func (c *Core) forget(p *peer) {
	for id, d := range p.live {
		c.end(p, id, d)
	}
	p.seq = 0
}

// Expire forgets the peers last heard before now − Lease: their dispatches stop counting. It
// returns how many it forgot.
func (c *Core) Expire(now time.Time) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for id, p := range c.peers {
		if now.Sub(p.heard) > c.cfg.Lease {
			c.forget(p)
			delete(c.peers, id)
			n++
		}
	}
	if n > 0 {
		c.rank()
	}
	return n
}

// Forget forgets every peer (the broker is unreachable: the replica runs on its own view).
func (c *Core) Forget() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for id, p := range c.peers {
		c.forget(p)
		delete(c.peers, id)
	}
	c.rank()
}

// rank records on the InFlight this replica's place among itself and the peers it counts: their
// number, and its position in their IDs' order (loadbridge.SetReplicas), so that replicas that
// know each other hold different ranks. Callers hold c.mu.
func (c *Core) rank() {
	ids := make([]string, 0, len(c.peers)+1)
	ids = append(ids, c.cfg.ID)
	for id := range c.peers {
		if id != c.cfg.ID { // an earlier incarnation of this replica is not another one
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	r, _ := slices.BinarySearch(ids, c.cfg.ID)
	loadbridge.SetReplicas(c.cfg.InFlight, r, len(ids))
}

// Peers returns how many peers the view counts and their dispatches in flight.
func (c *Core) Peers() (peers, dispatches int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, p := range c.peers {
		dispatches += len(p.live)
	}
	return len(c.peers), dispatches
}
