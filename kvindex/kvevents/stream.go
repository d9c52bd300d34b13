package kvevents

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/enginepick/enginepick/internal/kvwire"
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
	// join: nothing received since the stream was added. The first batch, whatever its number,
	// starts the stream in step: a router joining a running publisher has missed nothing it
	// holds (docs/design.md §13.1).
	join syncState = iota
	// fresh: the publisher restarted and the rank was cleared; a first batch numbered 0 or 1
	// starts the stream in step, a later one means batches of the new stream were missed (a
	// forward gap from 0).
	fresh
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
	warn   *warner
	now    func() time.Time
	report func(*StreamError)
	app    *applier
	rep    replayer // nil without a replay endpoint

	queue     chan item
	kick      chan struct{} // the receiver overflowed the queue
	overflow  atomic.Bool   // set by the receiver on overflow; cleared by the applier before resync
	silent    atomic.Bool   // set by the silence check; cleared by the receiver on the next batch
	lastBatch atomic.Int64  // unix nanos of the last batch received; 0 before the first
	created   int64         // unix nanos of the stream's creation: the silence rule's start
	drops     atomic.Uint64
	frames    atomic.Uint64 // messages for this topic with bad frames
	silences  atomic.Uint64
	unknown   atomic.Uint64          // messages on an unknown topic, when the stream is its socket's only one
	lastTopic atomic.Pointer[string] // the last such topic

	// trustMu orders the trust mark's writers: the apply goroutine, the receiver (overflow, end
	// of silence), the silence check and stop.
	trustMu   sync.Mutex
	stopped   bool // guarded by trustMu: stop has cleared the mark for good
	outOfStep bool // guarded by trustMu, written by the apply goroutine: a loss is being recovered

	// Owned by the silence check (Subscriber.checkSilence).
	pending    bool  // a dispatch after the last batch was seen at pendingAt
	pendingAt  int64 // unix nanos
	pendingFor int64 // the lastBatch value pendingAt refers to

	// Owned by the apply goroutine.
	dec      *kvwire.Decoder
	batch    kvwire.Batch
	state    syncState
	expected uint64
	dupFrom  uint64 // after a replay, live batches in [dupFrom, expected) are duplicates
	dupOpen  bool
	c        counters
	seqs     seqCounters

	mu        sync.Mutex // guards published and refusals
	published StreamStats
	refusals  [numRefusals]uint64 // published's Refused, by refusal

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
	batches, gaps, regressions, duplicates, resyncs, replays, replayFailures, replayed, malformed, clears uint64
	lastSeq                                                                                               uint64
}

func newStream(ep Endpoint, o *Options, rep replayer, report func(*StreamError)) *stream {
	log := o.Logger.With(zap.String("engine", string(ep.Engine)), zap.Int("dp_rank", ep.DPRank))
	s := &stream{ep: ep, log: log, warn: newWarner(log, o), now: o.Now,
		report: report, app: newApplier(ep.Engine, ep.DPRank, o), rep: rep,
		queue: make(chan item, o.QueueBatches), kick: make(chan struct{}, 1), dec: kvwire.NewDecoder()}
	s.created = o.Now().UnixNano()
	s.published = StreamStats{Engine: ep.Engine, DPRank: ep.DPRank, Trusted: true}
	return s
}

// enqueue is called by the receive goroutine. It never blocks: when the queue is full the batch
// is dropped, the stream is marked untrusted at once, and every later batch is dropped until the
// apply goroutine has drained the queue and resynchronised. A batch ends a silence.
func (s *stream) enqueue(it item) {
	s.lastBatch.Store(s.now().UnixNano())
	if s.silent.Load() {
		s.trustMu.Lock()
		s.silent.Store(false)
		s.remark()
		s.trustMu.Unlock()
	}
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
		s.remark()
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
				s.resync(ctx, s.expected, nil, "overflow")
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
	case s.state == join || s.state == rebase:
		s.baseline(it)
	case s.state == fresh:
		if it.seq <= 1 { // publishers number from 0 (vLLM, SGLang) or 1 (llm-d)
			s.baseline(it)
			return
		}
		s.seqs.gaps++
		s.resync(ctx, 0, &it, "gap")
	case it.seq == s.expected:
		s.applyItem(it)
		s.expected = it.seq + 1
		s.dupOpen = false
	case it.seq > s.expected:
		s.seqs.gaps++
		s.resync(ctx, s.expected, &it, "gap")
	case s.dupOpen && it.seq >= s.dupFrom:
		s.seqs.duplicates++ // already applied from the replay
	default:
		// The sequence went back: the publisher restarted, and so did the engine's cache.
		s.seqs.regressions++
		s.warn.warn(warnRestart, "kvevents: publisher restarted, rebuilding the rank",
			zap.Uint64("expected_seq", s.expected), zap.Uint64("seq", it.seq))
		s.untrust()
		s.clear("restart")
		s.dupOpen = false
		s.state = fresh
		if it.seq <= 1 {
			s.seqs.resyncs++
			s.baseline(it)
			return
		}
		s.seqs.gaps++
		s.resync(ctx, 0, &it, "gap")
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
	if err := s.decode(it.seq, it.payload); err != nil {
		s.seqs.resyncs++
		s.untrust()
		s.clear("malformed")
		s.state = rebase
		s.dupOpen = false
		return false
	}
	s.app.apply(&s.batch, it.seq, &s.c, s.refused)
	return true
}

// decode decodes payload into s.batch; a batch that does not decode, or names another DP rank, is
// counted, warned about and reported, and its error returned.
func (s *stream) decode(seq uint64, payload []byte) error {
	err := s.dec.Decode(payload, &s.batch)
	if err == nil && s.batch.HasDPRank && s.batch.DPRank != s.ep.RankStart+s.ep.DPRank {
		err = ErrRankMismatch
	}
	if err != nil {
		s.seqs.malformed++
		s.warn.warn(warnMalformed, "kvevents: malformed batch", zap.Uint64("seq", seq), zap.Error(err))
		s.report(&StreamError{Engine: s.ep.Engine, DPRank: s.ep.DPRank, Seq: seq, Err: err})
	}
	return err
}

// refused warns about a refused event and reports it; the applier has counted it.
func (s *stream) refused(e *StreamError) {
	if held, ok := s.warn.allow(warnRefused + warnKind(refusalOf(e.Err))); ok {
		s.log.Warn("kvevents: event refused", zap.String("reason", refusalOf(e.Err).String()), zap.Uint64("seq", e.Seq),
			zap.Error(e.Err), zap.Uint64("suppressed", held))
	}
	s.report(e)
}

// clear drops the rank's blocks after a loss (cause names it) and counts it.
func (s *stream) clear(cause string) {
	s.seqs.clears++
	s.warn.warn(warnClear, "kvevents: rank cleared after a loss", zap.String("cause", cause))
	s.app.clear()
}

// resync recovers from batches missed before from (cause names the loss: "gap" or "overflow"): a
// replay from the publisher's replay socket when one is configured, else (or when the replay
// cannot fill the gap) clearing the rank and rebasing on pending, the batch that revealed the gap
// (nil after a queue overflow). The stream is untrusted from here until it is in step again.
func (s *stream) resync(ctx context.Context, from uint64, pending *item, cause string) {
	s.seqs.resyncs++
	fields := []zap.Field{zap.String("cause", cause), zap.Uint64("missing_from_seq", from), zap.Bool("replay", s.rep != nil)}
	if pending != nil {
		fields = append(fields, zap.Uint64("seq", pending.seq))
	}
	s.warn.warn(warnResync, "kvevents: batches lost, resynchronising", fields...)
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
	s.clear(cause)
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
			s.clear("replay_incomplete") // the buffer no longer holds the missing batches
		}
		s.state = synced
		s.expected = seq + 1
		if s.decode(seq, payload) != nil {
			s.clear("malformed") // lost again; the remaining batches rebuild the rank from here
			return
		}
		s.seqs.replayed++
		s.app.apply(&s.batch, seq, &s.c, s.refused)
	})
	if err != nil {
		s.warn.warn(warnReplay, "kvevents: replay failed", zap.String("replay_address", s.ep.ReplayAddress), zap.Error(err))
		s.report(&StreamError{Engine: s.ep.Engine, DPRank: s.ep.DPRank, Err: err})
		return false
	}
	return true
}

// untrust marks the stream out of step.
func (s *stream) untrust() {
	s.trustMu.Lock()
	s.outOfStep = true
	s.remark()
	s.trustMu.Unlock()
}

// trust marks the stream in step again, unless the receiver has overflowed the queue since (the
// next resync will).
func (s *stream) trust() {
	s.trustMu.Lock()
	defer s.trustMu.Unlock()
	if s.overflow.Load() {
		return
	}
	s.outOfStep = false
	s.remark()
}

// remark sets the index's mark from the stream's state: untrusted while out of step, overflowed
// or silent. Callers hold trustMu.
func (s *stream) remark() {
	switch {
	case s.stopped: // a receiver may still hold the routes of a removed stream
	case s.outOfStep || s.overflow.Load() || s.silent.Load():
		s.app.markUntrusted()
	default:
		s.app.markTrusted()
	}
}

// checkSilence applies the silence rule at now (docs/design.md §13.1): once a dispatch to the
// stream's rank after its last batch has gone timeout without a batch, the stream is silent and
// untrusted until its next batch. dispatched reports whether the rank was sent a request at or
// after a time. Called by one goroutine at a time.
func (s *stream) checkSilence(now time.Time, timeout time.Duration, dispatched func(since time.Time) bool) {
	if s.silent.Load() {
		return
	}
	last := s.lastBatch.Load()
	since := last
	if since == 0 {
		since = s.created
	}
	if !dispatched(time.Unix(0, since)) {
		s.pending = false
		return
	}
	if !s.pending || s.pendingFor != last {
		s.pending, s.pendingAt, s.pendingFor = true, now.UnixNano(), last
	}
	if now.UnixNano()-s.pendingAt < int64(timeout) {
		return
	}
	s.trustMu.Lock()
	if s.stopped {
		s.trustMu.Unlock()
		return
	}
	// Set the flag, then look for a batch: a receiver that stored a batch's time after this
	// load sees the flag and clears it (enqueue); one that stored it before is seen here.
	s.silent.Store(true)
	if s.lastBatch.Load() != last {
		s.silent.Store(false)
		s.trustMu.Unlock()
		return
	}
	s.remark()
	s.trustMu.Unlock()
	s.silences.Add(1)
	s.pending = false
	s.warn.warn(warnSilent, "kvevents: no batch since requests were sent to the engine; its blocks are untrusted until one arrives",
		zap.Time("last_batch_or_start", time.Unix(0, since)), zap.Duration("silence_timeout", timeout))
}

// publish copies the counters for Stats. Called by the apply goroutine after each step.
func (s *stream) publish() {
	s.mu.Lock()
	p := &s.published
	p.LastSeq = s.seqs.lastSeq
	p.Trusted = !s.outOfStep
	p.Batches, p.Gaps, p.Regressions, p.Duplicates = s.seqs.batches, s.seqs.gaps, s.seqs.regressions, s.seqs.duplicates
	p.Resyncs, p.Replays, p.ReplayFailures, p.ReplayedBatches = s.seqs.resyncs, s.seqs.replays, s.seqs.replayFailures, s.seqs.replayed
	p.Malformed, p.RankClears = s.seqs.malformed, s.seqs.clears
	p.Events, p.StoredBlocks, p.RemovedBlocks, p.Clears = s.c.events, s.c.stored, s.c.removed, s.c.cleared
	p.Ignored, p.Rejected, p.UnknownRemovals = s.c.ignored, s.c.rejected, s.c.unknownRemovals
	s.refusals = s.c.refused
	s.mu.Unlock()
}

// stats returns the published counters with the receiver's and the silence check's.
func (s *stream) stats() StreamStats {
	s.mu.Lock()
	p := s.published
	p.Refused = make(map[string]uint64, numRefusals)
	for r, n := range s.refusals {
		p.Refused[refusalNames[r]] = n
	}
	s.mu.Unlock()
	p.Drops = s.drops.Load()
	p.Malformed += s.frames.Load()
	p.Silent, p.Silences = s.silent.Load(), s.silences.Load()
	if s.overflow.Load() || p.Silent {
		p.Trusted = false
	}
	p.UnknownTopics = s.unknown.Load()
	if t := s.lastTopic.Load(); t != nil {
		p.LastUnknownTopic = *t
	}
	if t := s.lastBatch.Load(); t != 0 {
		p.LastBatchAt = time.Unix(0, t)
	}
	return p
}
