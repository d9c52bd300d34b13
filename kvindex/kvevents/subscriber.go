package kvevents

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"go.uber.org/zap"

	"github.com/enginepick/enginepick/internal/kvwire"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/state"
)

// Defaults for Options fields left zero; each field's comment states its value.
const (
	defaultQueueBatches   = 1024
	defaultReplayTimeout  = 2 * time.Second
	defaultReconnectMin   = 100 * time.Millisecond
	defaultReconnectMax   = 5 * time.Second
	defaultWarnInterval   = time.Minute
	defaultSilenceTimeout = 30 * time.Second
)

// Options configures a Subscriber. Index is required; every other field has a documented default.
type Options struct {
	// Index receives the events, the base model's and every LoRA adapter's: a BlockStored naming
	// an adapter is stored under it (kvindex.StoreEvent.Adapter), in the adapter's own key space,
	// so that only requests for the adapter (kvindex.Query.Adapter) match it. Its Hasher's block
	// size must be the engines' (vLLM block_size, SGLang page_size): a BlockStored with another
	// block_size is refused with a *BlockSizeMismatchError.
	Index *kvindex.Index
	// AdapterNames maps a LoRA adapter's integer ID (the events' lora_id) to its name, for
	// publishers that send an ID without a name (SGLang's BlockStored has only lora_id; vLLM's
	// lora_name, when present, is used instead). A BlockStored with a lora_id this map lacks and
	// no lora_name is refused with ErrUnknownAdapter. nil: no IDs are known. An empty name is an
	// error.
	AdapterNames map[int64]string
	// Media maps an event's medium to a storage tier, case-insensitively. nil means the media
	// vLLM and SGLang publish: "GPU" (vLLM MEDIUM_GPU, and SGLang's device tier) to
	// kvindex.TierDevice; "CPU" (vLLM's CPU offloading) and "CPU_PINNED" (SGLang HiCache host
	// memory) to TierHost; "DISK" and "EXTERNAL" (SGLang HiCache storage tiers) to TierDisk and
	// TierExternal (vllm-project/vllm vllm/distributed/kv_events.py; docs/design.md §13). An
	// event without a medium is a device event. A BlockStored whose medium is not in the map is
	// refused with ErrUnknownMedium; a BlockRemoved with an unknown medium removes the blocks
	// from every tier.
	Media map[string]kvindex.Tier
	// QueueBatches is each stream's queue length, in batches; 0 means 1,024 (vLLM publishes
	// about one batch per scheduler step, so this is seconds of backlog). When it is full, batches are dropped (StreamStats.Drops) until the stream has caught up and
	// resynchronised. Negative is an error.
	QueueBatches int
	// ReplayTimeout bounds one replay exchange; 0 means 2 s (as SGLang's experimental router).
	// Negative is an error.
	ReplayTimeout time.Duration
	// ReconnectMin and ReconnectMax bound the backoff between connection attempts, which
	// doubles after each failure, with up to 25% jitter, and restarts from the minimum once a
	// message arrives; 0 means 100 ms / 5 s. Negative, or Min > Max, is an error.
	ReconnectMin, ReconnectMax time.Duration
	// Logger receives connection changes and refused batches and events at debug level, and a
	// warning (at most one per WarnInterval per kind and stream) for each refused event, malformed
	// batch, loss, rank clear, failed replay, silence and message on an unknown topic. nil means
	// zap.NewNop().
	Logger *zap.Logger
	// WarnInterval is the least time between two warnings of one kind about one stream (or
	// socket); 0 means one minute. Negative is an error.
	WarnInterval time.Duration
	// Dispatched reports whether the router sent a request to the engine's DP rank at or after
	// since (for example from loadmon.InFlight). When set, a stream that receives no batch for
	// SilenceTimeout after the subscriber first saw such a request sent after its last batch is
	// silent: untrusted until its next batch (docs/design.md §13.1). An idle engine is never
	// silent. nil: the rule is off. Called from one goroutine, about every SilenceTimeout/4; it
	// must not block.
	Dispatched func(engine state.EngineID, dpRank int, since time.Time) bool
	// SilenceTimeout is the silence rule's timeout; 0 means 30 s (an engine that prefills stores
	// blocks, and vLLM publishes them within a scheduler step). Negative is an error.
	SilenceTimeout time.Duration
	// Now is the clock of batch arrival times, warnings and the silence rule; nil means time.Now.
	// It must be the clock Dispatched compares against.
	Now func() time.Time
	// OnError, when set, is called with every refused batch or event and every failed replay,
	// from the stream's apply goroutine; it must not block. nil: they are only counted and logged
	// at debug level.
	OnError func(*StreamError)

	media map[string]kvindex.Tier
}

// Endpoint is one (engine, DP rank) event stream: where its publisher is, and how to tell its
// messages apart.
type Endpoint struct {
	// Engine is the engine's ID, as the host's registry names it (state.Engine.ID). Required.
	Engine state.EngineID
	// DPRank is the engine's data-parallel rank this stream publishes (vLLM and SGLang run one
	// publisher per rank, on the base port + rank). A batch carrying another rank than
	// RankStart + DPRank is refused with ErrRankMismatch. Negative is an error.
	DPRank int
	// RankStart is the global DP rank of the engine's rank 0, for an engine that serves a slice of
	// a larger DP group: its batches carry global ranks (data_parallel_rank RankStart + DPRank) and
	// are applied to the index as DPRank. 0 means the engine's ranks are the global ones; negative
	// is an error.
	RankStart int
	// Address is the publisher's ZMQ endpoint. By default the subscriber dials it, for an engine
	// that binds (vLLM and SGLang bind "tcp://*:5557" by default, so dial "tcp://host:5557"
	// (+ rank)). Required; "tcp://", "ipc://" or "inproc://".
	Address string
	// Bind makes the subscriber bind Address instead, for engines configured to dial out (an
	// endpoint without "*" makes vLLM's publisher connect). Several engines may dial one bound
	// address; they are told apart by Topic.
	Bind bool
	// Topic is the publisher's topic (vLLM and SGLang KVEventsConfig.topic, "" by default),
	// compared exactly: the subscriber subscribes to every topic and routes each message by its
	// whole topic frame. Two endpoints on one Address (and Bind) must have different topics.
	Topic string
	// ReplayAddress is the publisher's replay socket (KVEventsConfig.replay_endpoint, offset by
	// the rank as the publisher does), dialed to refill a gap. "" means none: a gap clears the
	// rank instead.
	ReplayAddress string
}

// StreamStats are one stream's counters since it was added. Counts are cumulative.
type StreamStats struct {
	Engine state.EngineID
	DPRank int
	// Connected: the stream's socket is connected to its publisher (dialing), or bound
	// (listening).
	Connected bool
	// Trusted: the stream is in step with its publisher and not silent; false from a detected
	// loss until it has resynchronised, and while silent (the rank is then also untrusted in the
	// index: kvindex.Stats.Untrusted).
	Trusted bool
	// Silent: the silence rule holds the stream untrusted (Options.Dispatched); Silences counts
	// the times it became silent.
	Silent   bool
	Silences uint64
	// LastSeq is the sequence number of the last batch handled.
	LastSeq uint64
	// LastBatchAt is when the last batch was received (Options.Now); zero before the first.
	LastBatchAt time.Time
	// Batches handled; Events decoded from them; StoredBlocks and RemovedBlocks applied; Clears
	// (AllBlocksCleared events) applied.
	Batches, Events, StoredBlocks, RemovedBlocks, Clears uint64
	// Ignored events: other KV-cache groups, placeholders without tokens, unknown event types.
	// Rejected events: refused by the decoder's rules or the index (OnError has each).
	// UnknownRemovals: removed hashes the index did not hold.
	Ignored, Rejected, UnknownRemovals uint64
	// Refused splits Rejected by reason (they sum to it), with an entry, zero or not, for each
	// of "unknown_parent" (kvindex.ErrUnknownParent), "block_size" (a *BlockSizeMismatchError
	// or kvindex.ErrBlockSizeMismatch), "unknown_medium" (ErrUnknownMedium), "unknown_adapter"
	// (ErrUnknownAdapter), "duplicate_hash" (kvindex.ErrDuplicateHash), "key_conflict"
	// (kvindex.ErrKeyConflict) and "other" (any other index error).
	Refused map[string]uint64
	// Gaps: forward jumps in the sequence (including a queue overflow, and a first batch after
	// a publisher restart numbered above 1; not the first batch after the stream was added).
	// Regressions: the sequence went back (a publisher restart). Duplicates: batches already
	// applied from a replay. Drops: batches dropped because the queue was full.
	Gaps, Regressions, Duplicates, Drops uint64
	// Resyncs: recoveries started (after a gap, a regression, an overflow or a lost batch);
	// Replays and ReplayFailures: replay exchanges that completed or failed; ReplayedBatches:
	// batches applied from replays; RankClears: times the subscriber cleared the rank after a
	// loss (AllBlocksCleared events are Clears); Malformed: messages or payloads that did not
	// decode, or named another DP rank.
	Resyncs, Replays, ReplayFailures, ReplayedBatches, RankClears, Malformed uint64
	// UnknownTopics counts messages on a topic no endpoint of the stream's socket names, when
	// the stream is its socket's only one (otherwise the message cannot be told to be this
	// stream's, and only Stats.UnknownTopics counts it); LastUnknownTopic is the last such topic.
	UnknownTopics    uint64
	LastUnknownTopic string
}

// Stats is a point-in-time summary of a Subscriber.
type Stats struct {
	// Streams has one entry per endpoint, sorted by engine then rank.
	Streams []StreamStats
	// UnknownTopics counts messages whose topic no endpoint of their socket names;
	// LastUnknownTopic is the last such topic.
	UnknownTopics    uint64
	LastUnknownTopic string
	// MalformedMessages counts messages without three frames or with a sequence frame that is not
	// 8 bytes.
	MalformedMessages uint64
}

// Subscriber follows the KV events of a set of engine DP ranks and applies them to the index
// (docs/design.md §13). Build it with New, add endpoints with Add, then Start it; Close stops
// every goroutine it started and waits for them. Every method is safe for concurrent use.
//
// Per stream, one goroutine applies batches in sequence order; each socket has one receive
// goroutine that never blocks on a stream. Matches never wait for ingestion beyond the index's
// own write lock, held for one event at a time.
type Subscriber struct {
	opts Options

	mu      sync.Mutex
	ctx     context.Context // nil until Start
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	closed  bool
	sockets map[sockKey]*socket
	streams map[streamKey]*stream

	unknownTopics atomic.Uint64
	lastTopic     atomic.Pointer[string]
	malformed     atomic.Uint64
	silenceMu     sync.Mutex // one silence check at a time
}

type sockKey struct {
	addr string
	bind bool
}

type streamKey struct {
	engine state.EngineID
	rank   int
}

// socket is one ZMQ SUB socket and the streams routed from it by topic.
type socket struct {
	key       sockKey
	routes    atomic.Pointer[map[string]*stream] // immutable; replaced on Add/Remove
	cancel    context.CancelFunc                 // nil until started
	connected atomic.Bool
	warn      *warner
}

// New validates opts and returns a Subscriber with no endpoints. Invalid options return an error
// wrapping state.ErrInvalidConfiguration that names the field. It starts no goroutine.
func New(opts Options) (*Subscriber, error) {
	if opts.Index == nil {
		return nil, fmt.Errorf("kvevents: Options.Index: nil: %w", state.ErrInvalidConfiguration)
	}
	switch {
	case opts.QueueBatches < 0:
		return nil, fmt.Errorf("kvevents: Options.QueueBatches: %d, must be >= 0: %w", opts.QueueBatches, state.ErrInvalidConfiguration)
	case opts.ReplayTimeout < 0:
		return nil, fmt.Errorf("kvevents: Options.ReplayTimeout: %v, must be >= 0: %w", opts.ReplayTimeout, state.ErrInvalidConfiguration)
	case opts.ReconnectMin < 0 || opts.ReconnectMax < 0:
		return nil, fmt.Errorf("kvevents: Options.ReconnectMin/Max: %v/%v, must be >= 0: %w", opts.ReconnectMin, opts.ReconnectMax, state.ErrInvalidConfiguration)
	case opts.WarnInterval < 0:
		return nil, fmt.Errorf("kvevents: Options.WarnInterval: %v, must be >= 0: %w", opts.WarnInterval, state.ErrInvalidConfiguration)
	case opts.SilenceTimeout < 0:
		return nil, fmt.Errorf("kvevents: Options.SilenceTimeout: %v, must be >= 0: %w", opts.SilenceTimeout, state.ErrInvalidConfiguration)
	}
	if opts.WarnInterval == 0 {
		opts.WarnInterval = defaultWarnInterval
	}
	if opts.SilenceTimeout == 0 {
		opts.SilenceTimeout = defaultSilenceTimeout
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.QueueBatches == 0 {
		opts.QueueBatches = defaultQueueBatches
	}
	if opts.ReplayTimeout == 0 {
		opts.ReplayTimeout = defaultReplayTimeout
	}
	if opts.ReconnectMin == 0 {
		opts.ReconnectMin = defaultReconnectMin
	}
	if opts.ReconnectMax == 0 {
		opts.ReconnectMax = max(defaultReconnectMax, opts.ReconnectMin)
	}
	if opts.ReconnectMin > opts.ReconnectMax {
		return nil, fmt.Errorf("kvevents: Options.ReconnectMin %v > ReconnectMax %v: %w", opts.ReconnectMin, opts.ReconnectMax, state.ErrInvalidConfiguration)
	}
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	var err error
	if opts.media, err = normalizeMedia(opts.Media); err != nil {
		return nil, err
	}
	if err = checkAdapterNames(opts.AdapterNames); err != nil {
		return nil, err
	}
	return &Subscriber{opts: opts, sockets: make(map[sockKey]*socket), streams: make(map[streamKey]*stream)}, nil
}

// ErrClosed is returned by Add and Start after Close.
var ErrClosed = errors.New("kvevents: subscriber closed")

// Add registers an endpoint; if the subscriber is started, it is followed at once. Errors: an
// invalid endpoint (empty engine, negative rank, empty or unsupported address) or one that
// repeats an (engine, rank) or an (address, bind, topic) already added wraps
// state.ErrInvalidConfiguration; ErrClosed after Close.
func (s *Subscriber) Add(ep Endpoint) error {
	switch {
	case ep.Engine == "":
		return fmt.Errorf("kvevents: Endpoint.Engine: empty: %w", state.ErrInvalidConfiguration)
	case ep.DPRank < 0:
		return fmt.Errorf("kvevents: Endpoint.DPRank: %d, must be >= 0: %w", ep.DPRank, state.ErrInvalidConfiguration)
	case ep.RankStart < 0:
		return fmt.Errorf("kvevents: Endpoint.RankStart: %d, must be >= 0: %w", ep.RankStart, state.ErrInvalidConfiguration)
	case !validAddress(ep.Address):
		return fmt.Errorf("kvevents: Endpoint.Address: %q, want tcp://, ipc:// or inproc://: %w", ep.Address, state.ErrInvalidConfiguration)
	case ep.ReplayAddress != "" && !validAddress(ep.ReplayAddress):
		return fmt.Errorf("kvevents: Endpoint.ReplayAddress: %q, want tcp://, ipc:// or inproc://: %w", ep.ReplayAddress, state.ErrInvalidConfiguration)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return ErrClosed
	}
	sk := streamKey{ep.Engine, ep.DPRank}
	if _, dup := s.streams[sk]; dup {
		return fmt.Errorf("kvevents: engine %q rank %d added twice: %w", ep.Engine, ep.DPRank, state.ErrInvalidConfiguration)
	}
	key := sockKey{ep.Address, ep.Bind}
	so := s.sockets[key]
	if so != nil {
		if _, dup := (*so.routes.Load())[ep.Topic]; dup {
			return fmt.Errorf("kvevents: topic %q on %s used twice: %w", ep.Topic, ep.Address, state.ErrInvalidConfiguration)
		}
	}
	var rep replayer
	if ep.ReplayAddress != "" {
		rep = &zmqReplayer{addr: ep.ReplayAddress, timeout: s.opts.ReplayTimeout, log: zap.NewStdLog(s.opts.Logger.Named("zmq4"))}
	}
	st := newStream(ep, &s.opts, rep, s.reporter(ep))
	s.streams[sk] = st
	newSocket := so == nil
	if newSocket {
		so = &socket{key: key, warn: newWarner(s.opts.Logger.With(zap.String("address", key.addr), zap.Bool("bind", key.bind)), &s.opts)}
		so.routes.Store(&map[string]*stream{})
		s.sockets[key] = so
	}
	routes := make(map[string]*stream, len(*so.routes.Load())+1)
	for k, v := range *so.routes.Load() {
		routes[k] = v
	}
	routes[ep.Topic] = st
	so.routes.Store(&routes)
	if s.ctx != nil {
		s.startStream(st)
		if newSocket {
			s.startSocket(so)
		}
	}
	return nil
}

func validAddress(a string) bool {
	for _, p := range []string{"tcp://", "ipc://", "inproc://"} {
		if strings.HasPrefix(a, p) && len(a) > len(p) {
			return true
		}
	}
	return false
}

// Remove stops following every stream of engine and forgets them; their untrusted marks are
// cleared, their blocks stay in the index (call Index.RemoveEngine, or the Router's RemoveEngine,
// to drop them). A socket left with no stream is closed. Removing an unknown engine is a no-op.
func (s *Subscriber) Remove(engine state.EngineID) {
	s.mu.Lock()
	var stopped []*stream
	for key, so := range s.sockets {
		routes := map[string]*stream{}
		for topic, st := range *so.routes.Load() {
			if st.ep.Engine == engine {
				stopped = append(stopped, st)
				continue
			}
			routes[topic] = st
		}
		so.routes.Store(&routes)
		if len(routes) == 0 {
			if so.cancel != nil {
				so.cancel()
			}
			delete(s.sockets, key)
		}
	}
	for _, st := range stopped {
		delete(s.streams, streamKey{st.ep.Engine, st.ep.DPRank})
	}
	s.mu.Unlock()
	for _, st := range stopped {
		st.stop()
	}
}

// Start starts following every endpoint added so far (and those added later) until ctx is done
// or Close is called. Errors: ErrClosed after Close; calling it twice wraps
// state.ErrInvalidConfiguration.
func (s *Subscriber) Start(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return ErrClosed
	}
	if s.ctx != nil {
		return fmt.Errorf("kvevents: Start called twice: %w", state.ErrInvalidConfiguration)
	}
	s.ctx, s.cancel = context.WithCancel(ctx)
	for _, st := range s.streams {
		s.startStream(st)
	}
	for _, so := range s.sockets {
		s.startSocket(so)
	}
	if s.opts.Dispatched != nil {
		ctx := s.ctx
		s.wg.Go(func() {
			t := time.NewTicker(max(s.opts.SilenceTimeout/4, time.Millisecond))
			defer t.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
					s.CheckSilence()
				}
			}
		})
	}
	return nil
}

// CheckSilence applies the silence rule of Options.Dispatched to every stream at Options.Now
// (docs/design.md §13.1). A started subscriber calls it every SilenceTimeout/4; hosts that drive
// the clock may call it too. Without Options.Dispatched it does nothing.
func (s *Subscriber) CheckSilence() {
	if s.opts.Dispatched == nil {
		return
	}
	s.mu.Lock()
	streams := make([]*stream, 0, len(s.streams))
	for _, st := range s.streams {
		streams = append(streams, st)
	}
	s.mu.Unlock()
	s.silenceMu.Lock()
	defer s.silenceMu.Unlock()
	now := s.opts.Now()
	for _, st := range streams {
		st.checkSilence(now, s.opts.SilenceTimeout, func(since time.Time) bool { return s.opts.Dispatched(st.ep.Engine, st.ep.DPRank, since) })
	}
}

// Close stops every goroutine the subscriber started, closes its sockets and waits for them. The
// streams' untrusted marks are cleared (the subscriber no longer claims anything about them).
// Idempotent.
func (s *Subscriber) Close() error {
	s.mu.Lock()
	s.closed = true
	if s.cancel != nil {
		s.cancel()
	}
	streams := make([]*stream, 0, len(s.streams))
	for _, st := range s.streams {
		streams = append(streams, st)
	}
	s.mu.Unlock()
	s.wg.Wait()
	for _, st := range streams {
		st.stop() // its goroutine has returned: this only clears the mark for good
	}
	return nil
}

// Stats returns every stream's counters.
func (s *Subscriber) Stats() Stats {
	s.mu.Lock()
	out := Stats{Streams: make([]StreamStats, 0, len(s.streams))}
	for _, so := range s.sockets {
		for _, st := range *so.routes.Load() {
			ss := st.stats()
			ss.Connected = so.connected.Load()
			out.Streams = append(out.Streams, ss)
		}
	}
	s.mu.Unlock()
	slices.SortFunc(out.Streams, func(a, b StreamStats) int {
		return cmp.Or(cmp.Compare(a.Engine, b.Engine), cmp.Compare(a.DPRank, b.DPRank))
	})
	out.UnknownTopics = s.unknownTopics.Load()
	if t := s.lastTopic.Load(); t != nil {
		out.LastUnknownTopic = *t
	}
	out.MalformedMessages = s.malformed.Load()
	return out
}

func (s *Subscriber) reporter(ep Endpoint) func(*StreamError) {
	log := s.opts.Logger
	on := s.opts.OnError
	return func(err *StreamError) {
		if ce := log.Check(zap.DebugLevel, "kvevents: refused"); ce != nil {
			ce.Write(zap.String("engine", string(ep.Engine)), zap.Int("dp_rank", ep.DPRank), zap.Uint64("seq", err.Seq), zap.Error(err.Err))
		}
		if on != nil {
			on(err)
		}
	}
}

// startStream starts st's apply goroutine. Callers hold s.mu and s.ctx is set.
func (s *Subscriber) startStream(st *stream) {
	ctx, cancel := context.WithCancel(s.ctx)
	st.cancel = cancel
	st.done = make(chan struct{})
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer close(st.done)
		st.run(ctx)
	}()
}

// startSocket starts so's receive goroutine. Callers hold s.mu and s.ctx is set.
func (s *Subscriber) startSocket(so *socket) {
	ctx, cancel := context.WithCancel(s.ctx)
	so.cancel = cancel
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.receive(ctx, so)
	}()
}

// receive owns one ZMQ SUB socket: it dials (or binds) with backoff, subscribes to every topic,
// and routes each message to its stream's queue without blocking.
func (s *Subscriber) receive(ctx context.Context, so *socket) {
	log := s.opts.Logger.With(zap.String("address", so.key.addr), zap.Bool("bind", so.key.bind))
	stdlog := zap.NewStdLog(s.opts.Logger.Named("zmq4"))
	backoff := s.opts.ReconnectMin
	for ctx.Err() == nil {
		sctx, scancel := context.WithCancel(ctx)
		sock := zmq4.NewSub(sctx, zmq4.WithDialerMaxRetries(0), zmq4.WithDialerTimeout(s.opts.ReconnectMax), zmq4.WithLogger(stdlog))
		err := sock.SetOption(zmq4.OptionSubscribe, "")
		if err == nil {
			if so.key.bind {
				err = sock.Listen(so.key.addr)
			} else {
				err = sock.Dial(so.key.addr)
			}
		}
		if err != nil {
			_ = sock.Close()
			scancel()
			if ce := log.Check(zap.DebugLevel, "kvevents: connect failed"); ce != nil {
				ce.Write(zap.Error(err), zap.Duration("retry_in", backoff))
			}
			if !sleep(ctx, jitter(backoff)) {
				return
			}
			backoff = min(2*backoff, s.opts.ReconnectMax)
			continue
		}
		so.connected.Store(true)
		log.Debug("kvevents: connected")
		for errs := 0; ; {
			msg, err := sock.Recv()
			if err != nil {
				if ctx.Err() != nil {
					break
				}
				// A bound socket outlives its peers: one peer leaving is not the socket's end.
				if errs++; so.key.bind && errs < 100 {
					continue
				}
				if ce := log.Check(zap.DebugLevel, "kvevents: connection lost"); ce != nil {
					ce.Write(zap.Error(err))
				}
				break
			}
			errs = 0
			backoff = s.opts.ReconnectMin
			s.route(so, msg.Frames)
		}
		so.connected.Store(false)
		closeAndDrain(sock)
		scancel()
		if !sleep(ctx, jitter(backoff)) {
			return
		}
		backoff = min(2*backoff, s.opts.ReconnectMax)
	}
}

// route hands one message to its stream.
func (s *Subscriber) route(so *socket, frames [][]byte) {
	routes := *so.routes.Load()
	m, err := kvwire.ParseMessage(frames)
	if err != nil {
		s.malformed.Add(1)
		if len(frames) > 0 {
			if st := routes[string(frames[0])]; st != nil {
				st.frames.Add(1)
				st.report(&StreamError{Engine: st.ep.Engine, DPRank: st.ep.DPRank, Err: err})
			}
		}
		return
	}
	st := routes[string(m.Topic)]
	if st == nil {
		s.unknownTopic(so, routes, m.Topic)
		return
	}
	st.enqueue(item{seq: m.Seq, payload: m.Payload})
}

// unknownTopic counts and warns about a message on topic, which no stream of so names.
func (s *Subscriber) unknownTopic(so *socket, routes map[string]*stream, topic []byte) {
	s.unknownTopics.Add(1)
	noteTopic(&s.lastTopic, topic)
	if len(routes) == 1 {
		for _, st := range routes {
			st.unknown.Add(1)
			noteTopic(&st.lastTopic, topic)
		}
	}
	held, ok := so.warn.allow(warnTopic)
	if !ok {
		return
	}
	expected := make([]string, 0, len(routes))
	for t, st := range routes {
		expected = append(expected, fmt.Sprintf("%q (engine %s rank %d)", t, st.ep.Engine, st.ep.DPRank))
	}
	slices.Sort(expected)
	so.warn.log.Warn("kvevents: message on a topic no endpoint of this address names; check the engines' KV-event topic",
		zap.String("topic", string(topic)), zap.Strings("expected", expected), zap.Uint64("suppressed", held))
}

// noteTopic stores topic in p unless p already holds it.
func noteTopic(p *atomic.Pointer[string], topic []byte) {
	if old := p.Load(); old == nil || *old != string(topic) {
		t := string(topic)
		p.Store(&t)
	}
}

// closeAndDrain closes sock and then receives until the socket has reported its closure 64 times
// in a row. zmq4's per-connection reader goroutine hands each message to the socket through an
// unbuffered send that does not watch the socket's context (go-zeromq/zmq4 msgio.go,
// qreader.listen), so a message in flight when the socket closes would leave that goroutine
// blocked for ever; after Close, each Recv takes a pending message or reports the closure with
// equal chance, so 64 closures in a row leave a pending message with probability 2^-64.
func closeAndDrain(sock zmq4.Socket) {
	_ = sock.Close()
	for closed := 0; closed < 64; {
		if _, err := sock.Recv(); err != nil {
			closed++
		} else {
			closed = 0
		}
	}
}

// jitter adds up to 25% to d.
func jitter(d time.Duration) time.Duration {
	if d <= 0 {
		return d
	}
	return d + time.Duration(rand.Int64N(int64(d)/4+1))
}

// sleep waits d or until ctx is done; it reports whether ctx is still live.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
