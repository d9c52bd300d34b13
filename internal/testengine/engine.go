package testengine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// MaxRecordedRequests is how many of the latest inference requests Requests keeps.
const MaxRecordedRequests = 10_000

// Engine is a running test engine: an HTTP server and, per DP rank, a scheduler, a prefix cache
// and a KV-event publisher. Start one with Start and stop it with Close. Safe for concurrent use.
type Engine struct {
	opts   Options
	ranks  []*rank
	pubs   []*publisher
	srvs   []*http.Server // one, or one per rank with RankServers
	urls   []string       // per rank: the base URL of the server serving it
	ids    atomic.Uint64
	firsts int        // first tokens so far (Request.FirstToken); guarded by mu
	serve  chan error // each server's Serve result

	mu       sync.Mutex
	closed   bool
	handlers int           // handlers running
	conns    int           // HTTP connections open
	idle     chan struct{} // closed and replaced when handlers or conns drops
	requests []*Request
}

// Request is one inference request as the engine received and served it.
type Request struct {
	// Path is the request path (/v1/completions or /v1/chat/completions).
	Path string
	// Header is the request's header.
	Header http.Header
	// Body is the request's JSON body, field by field.
	Body map[string]json.RawMessage
	// Rank is the DP rank that served it.
	Rank int
	// PromptTokens and CachedTokens are the prompt's length and the part of it served from the
	// prefix cache (0 until the request was admitted).
	PromptTokens, CachedTokens int
	// CompletionTokens is the number of output tokens generated so far.
	CompletionTokens int
	// FirstToken is the request's place, from 1, among the engine's requests by the time of their
	// first output token; 0 before it.
	FirstToken int
	// Completed reports whether the whole answer was written.
	Completed bool
}

// RankStats is a rank's state at one instant.
type RankStats struct {
	// Running and Waiting are the requests running and waiting for admission.
	Running, Waiting int
	// UsedBlocks are the KV blocks running requests use; CachedBlocks the physical blocks the
	// prefix cache holds (used or free).
	UsedBlocks, CachedBlocks int
	// PromptTokens, CachedPromptTokens and GenerationTokens count the admitted requests' prompt
	// tokens, the part of those served from the prefix cache, and the tokens generated, since Start
	// or Restart.
	PromptTokens, CachedPromptTokens, GenerationTokens uint64
	// NextSeq is the sequence number the rank's next KV-event batch will carry (FirstSeq before the
	// first); 0 without KV events.
	NextSeq uint64
	// Sleeping reports whether admission is paused by Sleep.
	Sleeping bool
}

func (r *rank) stats() RankStats {
	r.mu.Lock()
	st := RankStats{Running: r.running, Waiting: len(r.waiting), UsedBlocks: r.pool.usedBlocks(),
		PromptTokens: r.counts.promptTokens, CachedPromptTokens: r.counts.cacheHits,
		GenerationTokens: r.counts.generationTokens, Sleeping: r.paused}
	for _, ids := range r.pool.byHash {
		st.CachedBlocks += len(ids)
	}
	r.mu.Unlock()
	if r.pub != nil {
		st.NextSeq = r.pub.nextSeq()
	}
	return st
}

// Start validates opts, binds the HTTP server and the ZMQ sockets and starts serving. Errors: an
// error wrapping ErrOptions for invalid options; a bind error when a given port is taken.
func Start(opts Options) (*Engine, error) {
	o, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	e := &Engine{opts: o, idle: make(chan struct{})}
	// The HTTP listeners first: a topic may name the address of the server serving its rank.
	fronts := []*frontend{{reg: prometheus.NewRegistry()}}
	if o.RankServers {
		fronts = make([]*frontend, o.DPRanks)
		for i := range fronts {
			fronts[i] = &frontend{reg: prometheus.NewRegistry(), fixed: true}
		}
	}
	var lns []net.Listener
	closeListeners := func() {
		for _, ln := range lns {
			_ = ln.Close()
		}
	}
	for i := range fronts {
		addr := o.Addr
		if i > 0 { // rank i's server: the next port after rank 0's when Addr names one
			base, port := lns[0].Addr().(*net.TCPAddr), 0
			if !strings.HasSuffix(o.Addr, ":0") {
				port = base.Port + i
			}
			addr = net.JoinHostPort(base.IP.String(), strconv.Itoa(port))
		}
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			closeListeners()
			return nil, fmt.Errorf("testengine: %w", err)
		}
		lns = append(lns, ln)
	}
	for r := range o.DPRanks {
		e.urls = append(e.urls, "http://"+lns[min(r, len(lns)-1)].Addr().String())
	}
	if !o.KVEvents.Disabled {
		topics := make([]string, o.DPRanks)
		for r := range topics {
			topics[r] = strings.NewReplacer("{rank}", strconv.Itoa(r), "{addr}", strings.TrimPrefix(e.urls[r], "http://")).Replace(o.KVEvents.Topic)
		}
		if e.pubs, err = startPublishers(&e.opts, topics); err != nil {
			closeListeners()
			return nil, err
		}
	}
	for r := range o.DPRanks {
		var pub *publisher
		if e.pubs != nil {
			pub = e.pubs[r]
		}
		e.ranks = append(e.ranks, newRank(r, &e.opts, pub))
	}
	if o.RankServers {
		for r, f := range fronts {
			f.ranks = e.ranks[r : r+1]
		}
	} else {
		fronts[0].ranks = e.ranks
	}
	e.serve = make(chan error, len(fronts))
	for i, f := range fronts {
		f.reg.MustRegister(collector{opts: &e.opts, ranks: f.ranks})
		srv := &http.Server{Handler: e.handler(f), ReadHeaderTimeout: 10 * time.Second, ConnState: e.connState}
		e.srvs = append(e.srvs, srv)
		go func() { e.serve <- srv.Serve(lns[i]) }()
	}
	return e, nil
}

// URL returns the engine's base URL, http://127.0.0.1:port: with RankServers, rank 0's server.
func (e *Engine) URL() string { return e.urls[0] }

// RankURL returns the base URL of the server serving rank: URL without RankServers. It panics for
// a rank outside [0, DPRanks).
func (e *Engine) RankURL(rank int) string {
	e.checkRank(rank)
	return e.urls[rank]
}

// Topic returns the topic of rank's KV events, its placeholders replaced. It panics for a rank
// outside [0, DPRanks).
func (e *Engine) Topic(rank int) string {
	e.checkRank(rank)
	if e.pubs == nil {
		return ""
	}
	return string(e.pubs[rank].topic)
}

// Options returns the engine's options with the defaults applied.
func (e *Engine) Options() Options { return e.opts }

// KVEndpoint returns the PUB endpoint of rank's KV events (tcp://127.0.0.1:port), or "" when
// the events are disabled. It panics for a rank outside [0, DPRanks).
func (e *Engine) KVEndpoint(rank int) string {
	e.checkRank(rank)
	if e.pubs == nil {
		return ""
	}
	return e.pubs[rank].addr
}

// ReplayEndpoint returns the replay (ROUTER) endpoint of rank, or "" without one. It panics for a
// rank outside [0, DPRanks).
func (e *Engine) ReplayEndpoint(rank int) string {
	e.checkRank(rank)
	if e.pubs == nil {
		return ""
	}
	return e.pubs[rank].replay
}

func (e *Engine) checkRank(rank int) {
	if rank < 0 || rank >= len(e.ranks) {
		panic(fmt.Sprintf("testengine: rank %d outside [0, %d)", rank, len(e.ranks)))
	}
}

// Blocks returns the KV blocks rank's prefix cache holds, one per hash, sorted by prefix length
// then hash. Their Tokens and Prefix share the engine's memory: read them, never modify them. It
// panics for a rank outside [0, DPRanks).
func (e *Engine) Blocks(rank int) []Block {
	e.checkRank(rank)
	r := e.ranks[rank]
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.pool.held()
}

// Stats returns rank's state. It panics for a rank outside [0, DPRanks).
func (e *Engine) Stats(rank int) RankStats {
	e.checkRank(rank)
	return e.ranks[rank].stats()
}

// Requests returns the latest inference requests received (at most MaxRecordedRequests), oldest
// first.
func (e *Engine) Requests() []Request {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]Request, len(e.requests))
	for i, r := range e.requests {
		out[i] = *r
	}
	return out
}

// record adds a request to the record and returns it; update changes it under the lock.
func (e *Engine) record(r *Request) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.requests) == MaxRecordedRequests {
		e.requests = append(e.requests[:0:0], e.requests[1:]...)
	}
	e.requests = append(e.requests, r)
}

func (e *Engine) update(f func()) {
	e.mu.Lock()
	defer e.mu.Unlock()
	f()
}

// DropBatches makes rank's publisher lose its next n batches: each is numbered and kept for
// replay but not sent, as a PUB socket drops messages past its high-water mark, so that a
// subscriber sees a gap. It panics for a rank outside [0, DPRanks) and does nothing without KV
// events.
func (e *Engine) DropBatches(rank, n int) {
	e.checkRank(rank)
	if e.pubs == nil {
		return
	}
	p := e.pubs[rank]
	p.mu.Lock()
	p.drop = max(n, 0)
	p.mu.Unlock()
}

// Restart restarts every rank as a restarted engine process would come back: the requests in
// flight are cut off (their connections closed without an answer), the prefix cache is empty,
// the counters are zero and each publisher numbers its next batch FirstSeq again, with an empty
// replay buffer, on the same endpoints. The HTTP server keeps its address. It publishes nothing:
// a subscriber learns of the restart from the sequence number. Restart after Close does nothing.
func (e *Engine) Restart() {
	e.mu.Lock()
	closed := e.closed
	e.mu.Unlock()
	if closed {
		return
	}
	for _, r := range e.ranks {
		r.restart()
	}
}

// Sleep is POST /sleep: every rank stops admitting requests, waits for its running requests to
// end, empties its prefix cache and publishes AllBlocksCleared. Requests that arrive meanwhile
// wait until WakeUp. It returns ctx's error if ctx ends first (admission stays paused), or an
// error when the engine restarts or closes meanwhile.
func (e *Engine) Sleep(ctx context.Context) error { return sleepRanks(ctx, e.ranks) }

// WakeUp is POST /wake_up: every rank admits requests again.
func (e *Engine) WakeUp() { wakeUpRanks(e.ranks) }

func sleepRanks(ctx context.Context, ranks []*rank) error {
	for _, r := range ranks {
		if err := r.sleep(ctx); err != nil {
			return err
		}
	}
	return nil
}

func wakeUpRanks(ranks []*rank) {
	for _, r := range ranks {
		r.wakeUp()
	}
}

// Close stops the engine: the HTTP server and its connections, every request in flight, and the
// ZMQ sockets. It returns when every goroutine the engine started has returned. Close after Close
// does nothing.
func (e *Engine) Close() error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	e.closed = true
	e.mu.Unlock()
	var err error
	for _, srv := range e.srvs {
		if cerr := srv.Close(); cerr != nil && err == nil {
			err = cerr
		}
	}
	for _, r := range e.ranks {
		r.stop()
	}
	e.mu.Lock()
	for e.handlers > 0 || e.conns > 0 {
		idle := e.idle
		e.mu.Unlock()
		<-idle
		e.mu.Lock()
	}
	e.mu.Unlock()
	for range e.srvs {
		if serr := <-e.serve; !errors.Is(serr, http.ErrServerClosed) && err == nil {
			err = serr
		}
	}
	e.closePublishers()
	return err
}

func (e *Engine) closePublishers() {
	for _, p := range e.pubs {
		p.close()
	}
}

// enter counts a handler in; it reports false once the engine is closing.
func (e *Engine) enter() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return false
	}
	e.handlers++
	return true
}

func (e *Engine) exit() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.handlers--
	close(e.idle)
	e.idle = make(chan struct{})
}

// connState counts the open connections, so that Close waits for their goroutines (a connection
// closed after an unread body lingers up to 500 ms in net/http).
func (e *Engine) connState(_ net.Conn, s http.ConnState) {
	e.mu.Lock()
	defer e.mu.Unlock()
	switch s {
	case http.StateNew:
		e.conns++
	case http.StateClosed, http.StateHijacked:
		e.conns--
		close(e.idle)
		e.idle = make(chan struct{})
	}
}
