package kvevents

import (
	"context"
	"sync"
	"sync/atomic"

	"go.uber.org/zap"
)

// item is one received batch waiting in a stream's queue.
type item struct {
	seq     uint64
	payload []byte
}

// replayer asks a publisher's replay socket for its buffered batches from start on, calling fn for
// each in order until the end marker; see zmqReplayer.
type replayer interface {
	replay(ctx context.Context, start uint64, fn func(seq uint64, payload []byte)) error
}

// syncState is where a stream stands in its publisher's sequence.
type syncState uint8

const (
	// fresh: nothing applied yet; a first batch numbered 0 or 1 starts the stream in step, a
	// later one means batches were missed (a forward gap from 0).
	fresh syncState = iota
	// rebase: the rank was just cleared after a loss; the next batch, whatever its number, is
	// applied and becomes the baseline.
	rebase
	// synced: expected is the next batch number.
	synced
)

// stream follows one (engine, DP rank) publisher: a bounded queue filled by its socket's receive
// goroutine, and one apply goroutine that checks sequence numbers, decodes and applies batches in
// order, and resynchronises after a loss (docs/design.md §13).
type stream struct {
	ep     Endpoint
	log    *zap.Logger
	report func(*StreamError)
	app    *applier
	rep    replayer // nil without a replay endpoint

	queue    chan item
	kick     chan struct{} // the receiver overflowed the queue
	overflow atomic.Bool   // set by the receiver on overflow; cleared by the applier before resync
	trustMu  sync.Mutex    // orders the receiver's overflow mark against trust() and stop()
	stopped  bool          // guarded by trustMu: stop has cleared the mark for good
	drops    atomic.Uint64
	frames   atomic.Uint64 // messages for this topic with bad frames

	// Owned by the apply goroutine.
	dec      *Decoder
	batch    Batch
	state    syncState
	expected uint64
	dupFrom  uint64 // after a replay, live batches in [dupFrom, expected) are duplicates
	dupOpen  bool
	c        counters
	seqs     seqCounters

	mu        sync.Mutex // guards published
	published StreamStats

	cancel context.CancelFunc // set by Subscriber.startStream; nil when not started
	done   chan struct{}      // closed when run returns
}

// stop ends the apply goroutine, waits for it, and clears the stream's untrusted mark.
func (s *stream) stop() {
	if s.cancel != nil {
		s.cancel()
		<-s.done
	}
	s.trustMu.Lock()
	s.stopped = true
	s.app.markTrusted()
	s.trustMu.Unlock()
}

// seqCounters count sequence events; see StreamStats.
type seqCounters struct {
	batches, gaps, regressions, duplicates, resyncs, replays, replayFailures, malformed uint64
	lastSeq                                                                             uint64
	untrusted                                                                           bool
}

func newStream(ep Endpoint, o *Options, rep replayer, report func(*StreamError)) *stream {
	s := &stream{ep: ep, log: o.Logger.With(zap.String("engine", string(ep.Engine)), zap.Int("dp_rank", ep.DPRank)),
		report: report, app: newApplier(ep.Engine, ep.DPRank, o), rep: rep,
		queue: make(chan item, o.QueueBatches), kick: make(chan struct{}, 1), dec: NewDecoder()}
	s.published = StreamStats{Engine: ep.Engine, DPRank: ep.DPRank, Trusted: true}
	return s
}

// enqueue is called by the receive goroutine. It never blocks: when the queue is full the batch
// is dropped, the stream is marked untrusted at once, and every later batch is dropped until the
// apply goroutine has drained the queue and resynchronised.
func (s *stream) enqueue(it item) {
	if s.overflow.Load() {
		s.drops.Add(1)
		return
	}
	select {
	case s.queue <- it:
	default:
		s.drops.Add(1)
		s.trustMu.Lock()
		s.overflow.Store(true)
		if !s.stopped { // a receiver may still hold the routes of a removed stream
			s.app.markUntrusted()
		}
		s.trustMu.Unlock()
		select {
		case s.kick <- struct{}{}:
		default:
		}
	}
}

// run is the apply goroutine.
func (s *stream) run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case it := <-s.queue:
			s.handle(ctx, it)
		case <-s.kick:
			// The batches still queued precede the overflow: apply them, then resynchronise.
			for drained := false; !drained; {
				select {
				case it := <-s.queue:
					s.handle(ctx, it)
				default:
					drained = true
				}
			}
			s.overflow.Store(false)
			if s.state == synced {
				s.seqs.gaps++
				s.resync(ctx, s.expected, nil)
			} else {
				s.untrust() // fresh or rebasing already: the next batch rebases the stream
			}
		}
		s.publish()
	}
}

// handle applies the sequence rules to one batch.
func (s *stream) handle(ctx context.Context, it item) {
	s.seqs.batches++
	s.seqs.lastSeq = it.seq
	switch {
	case s.state == rebase:
		s.baseline(it)
	case s.state == fresh:
		if it.seq <= 1 { // publishers number from 0 (vLLM, SGLang) or 1
			s.baseline(it)
			return
		}
		s.seqs.gaps++
		s.resync(ctx, 0, &it)
	case it.seq == s.expected:
		s.applyItem(it)
		s.expected = it.seq + 1
		s.dupOpen = false
	case it.seq > s.expected:
		s.seqs.gaps++
		s.resync(ctx, s.expected, &it)
	case s.dupOpen && it.seq >= s.dupFrom:
		s.seqs.duplicates++ // already applied from the replay
	default:
		// The sequence went back: the publisher restarted, and so did the engine's cache.
		s.seqs.regressions++
		s.untrust()
		s.app.clear()
		s.dupOpen = false
		s.state = fresh
		if it.seq <= 1 {
			s.seqs.resyncs++
			s.baseline(it)
			return
		}
		s.seqs.gaps++
		s.resync(ctx, 0, &it)
	}
}

// baseline applies it as the first batch of an in-step stream and trusts the stream again.
func (s *stream) baseline(it item) {
	s.state = synced
	s.expected = it.seq + 1
	if s.applyItem(it) {
		s.trust()
	}
}

// applyItem decodes and applies one batch; a batch that does not decode (or names another DP
// rank) is lost: the rank is cleared and the next batch rebases the stream. It reports whether the
// batch was applied.
func (s *stream) applyItem(it item) bool {
	if err := s.dec.Decode(it.payload, &s.batch); err != nil {
		s.lose(it.seq, err)
		return false
	}
	if s.batch.HasDPRank && s.batch.DPRank != s.ep.RankStart+s.ep.DPRank {
		s.lose(it.seq, ErrRankMismatch)
		return false
	}
	s.app.apply(&s.batch, it.seq, &s.c, s.report)
	return true
}

func (s *stream) lose(seq uint64, err error) {
	s.seqs.malformed++
	s.seqs.resyncs++
	s.report(&StreamError{Engine: s.ep.Engine, DPRank: s.ep.DPRank, Seq: seq, Err: err})
	s.untrust()
	s.app.clear()
	s.state = rebase
	s.dupOpen = false
}

// resync recovers from batches missed before from: a replay from the publisher's replay socket
// when one is configured, else (or when the replay cannot fill the gap) clearing the rank and
// rebasing on pending, the batch that revealed the gap (nil after a queue overflow). The stream
// is untrusted from here until it is in step again.
func (s *stream) resync(ctx context.Context, from uint64, pending *item) {
	s.seqs.resyncs++
	s.untrust()
	if s.rep != nil {
		if s.replay(ctx, from) {
			s.seqs.replays++
		} else {
			s.seqs.replayFailures++
		}
		if s.state == synced {
			switch {
			case pending == nil:
				s.trust()
				return
			case pending.seq < s.expected:
				s.seqs.duplicates++
				s.trust()
				return
			case pending.seq == s.expected:
				s.expected = pending.seq + 1
				if s.applyItem(*pending) {
					s.trust()
				}
				return
			}
		}
	}
	s.app.clear()
	s.dupOpen = false
	s.state = rebase
	if pending != nil {
		s.baseline(*pending)
	}
}

// replay applies the publisher's buffered batches numbered from on. It reports whether the replay
// ran to its end marker. When the buffer no longer holds from (or the replay skips a number) the
// rank is cleared first and the replayed batches rebuild it from there: a view with fewer blocks
// than the engine holds, never more. On return s.state is synced when what was applied is in
// step up to s.expected.
func (s *stream) replay(ctx context.Context, from uint64) bool {
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s.dupFrom, s.dupOpen = from, true
	if s.state != synced {
		s.expected = from
	}
	err := s.rep.replay(rctx, from, func(seq uint64, payload []byte) {
		if seq < s.expected {
			return
		}
		if seq > s.expected {
			s.app.clear() // the buffer no longer holds the missing batches
		}
		s.state = synced
		s.expected = seq + 1
		if err := s.dec.Decode(payload, &s.batch); err != nil {
			s.seqs.malformed++
			s.report(&StreamError{Engine: s.ep.Engine, DPRank: s.ep.DPRank, Seq: seq, Err: err})
			s.app.clear() // lost again; the remaining batches rebuild the rank from here
			return
		}
		if s.batch.HasDPRank && s.batch.DPRank != s.ep.RankStart+s.ep.DPRank {
			s.report(&StreamError{Engine: s.ep.Engine, DPRank: s.ep.DPRank, Seq: seq, Err: ErrRankMismatch})
			s.app.clear()
			return
		}
		s.app.apply(&s.batch, seq, &s.c, s.report)
	})
	if err != nil {
		s.report(&StreamError{Engine: s.ep.Engine, DPRank: s.ep.DPRank, Err: err})
		return false
	}
	return true
}

func (s *stream) untrust() {
	s.seqs.untrusted = true
	s.app.markUntrusted()
}

// trust marks the stream trusted again, unless the receiver has overflowed the queue since (the
// next resync will).
func (s *stream) trust() {
	s.trustMu.Lock()
	defer s.trustMu.Unlock()
	if s.overflow.Load() {
		return
	}
	s.seqs.untrusted = false
	s.app.markTrusted()
}

// publish copies the counters for Stats. Called by the apply goroutine after each step.
func (s *stream) publish() {
	s.mu.Lock()
	p := &s.published
	p.LastSeq = s.seqs.lastSeq
	p.Trusted = !s.seqs.untrusted
	p.Batches, p.Gaps, p.Regressions, p.Duplicates = s.seqs.batches, s.seqs.gaps, s.seqs.regressions, s.seqs.duplicates
	p.Resyncs, p.Replays, p.ReplayFailures, p.Malformed = s.seqs.resyncs, s.seqs.replays, s.seqs.replayFailures, s.seqs.malformed
	p.Events, p.StoredBlocks, p.RemovedBlocks, p.Clears = s.c.events, s.c.stored, s.c.removed, s.c.cleared
	p.Ignored, p.Rejected, p.UnknownRemovals = s.c.ignored, s.c.rejected, s.c.unknownRemovals
	s.mu.Unlock()
}

// stats returns the published counters with the receiver's atomics.
func (s *stream) stats() StreamStats {
	s.mu.Lock()
	p := s.published
	s.mu.Unlock()
	p.Drops = s.drops.Load()
	p.Malformed += s.frames.Load()
	if s.overflow.Load() {
		p.Trusted = false
	}
	return p
}
