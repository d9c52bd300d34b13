package testengine

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"
)

// errAborted ends the requests a Restart or Close cuts off.
var errAborted = errors.New("testengine: request aborted: the engine restarted or closed")

type seqState uint8

const (
	seqWaiting seqState = iota
	seqRunning
	seqDone
)

// seq is one request on a rank.
type seq struct {
	tokens    []uint32 // the prompt, then each output token as it is generated
	promptLen int
	maxTokens int
	hashes    []uint64 // hashes of the full blocks, the prompt's from the start, the output's when cached
	blocks    []int    // the physical blocks, in order: the hit blocks, then the new ones
	cached    int      // leading blocks cached (findable by hash)
	hitTokens int      // prompt tokens served from the prefix cache
	priority  int64    // the body's priority (SchedulingPolicy "priority"): lower is served first
	state     seqState
	admitted  chan struct{} // closed on admission
}

func newSeq(prompt []uint32, maxTokens, blockSize int) *seq {
	tokens := make([]uint32, len(prompt), len(prompt)+maxTokens)
	copy(tokens, prompt)
	return &seq{tokens: tokens, promptLen: len(prompt), maxTokens: maxTokens,
		hashes: BlockHashes(prompt, blockSize), admitted: make(chan struct{})}
}

// rankCounters are a rank's cumulative counts, reset by Restart.
type rankCounters struct {
	promptTokens, generationTokens, cacheHits uint64
}

// rank is one data-parallel rank: vLLM's scheduler and block pool, reduced to what a router sees.
// A request waits, in FIFO order or by priority (Options.SchedulingPolicy), until fewer than
// MaxNumSeqs run and the pool can give it the blocks of its prompt and its max_tokens output
// (reserved at once: the engine never preempts, so vLLM's preemption of the lowest priority never
// arises); the waiting queue's head blocks the ones behind it, as in vLLM's scheduler.
type rank struct {
	id   int
	opts *Options
	pub  *publisher // nil without KV events

	mu       sync.Mutex
	pool     *pool
	waiting  []*seq
	running  int
	inflight int  // requests between run's start and end
	paused   bool // sleeping: no admission
	cleared  bool // sleeping and the cache cleared
	life     context.Context
	kill     context.CancelFunc
	changed  chan struct{} // closed and replaced at every change of running, inflight or paused
	counts   rankCounters
}

func newRank(id int, opts *Options, pub *publisher) *rank {
	r := &rank{id: id, opts: opts, pub: pub, pool: newPool(opts.NumBlocks), changed: make(chan struct{})}
	r.life, r.kill = context.WithCancel(context.Background())
	return r
}

// notify wakes the waiters of changed. Called with mu held.
func (r *rank) notify() {
	close(r.changed)
	r.changed = make(chan struct{})
}

// waitUntil waits until cond (called with mu held) holds, ctx is done or abort is closed (nil:
// never). It returns with mu held when cond holds, and without it otherwise.
func (r *rank) waitUntil(ctx context.Context, abort <-chan struct{}, cond func() bool) error {
	r.mu.Lock()
	for !cond() {
		ch := r.changed
		r.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		case <-abort:
			return errAborted
		}
		r.mu.Lock()
	}
	return nil
}

// load is vLLM's data-parallel balancing score of the rank: waiting × 4 + running.
func (r *rank) load() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.waiting)*4 + r.running
}

// run runs a request: it waits for admission, then for the prefill of the uncached prompt tokens,
// and hands each output piece to emit as it is generated, DecodePerToken apart. It returns ctx's
// error when the caller leaves, errAborted on Restart or Close, or emit's error; the request's
// blocks are released in every case.
func (r *rank) run(ctx context.Context, s *seq, emit func(piece string) error) error {
	r.mu.Lock()
	life := r.life
	if life.Err() != nil {
		r.mu.Unlock()
		return errAborted
	}
	r.inflight++
	i := len(r.waiting)
	if r.opts.SchedulingPolicy == "priority" { // behind the requests of its priority or lower
		for i > 0 && r.waiting[i-1].priority > s.priority {
			i--
		}
	}
	r.waiting = slices.Insert(r.waiting, i, s)
	r.admit()
	r.notify()
	r.mu.Unlock()
	defer r.end(s)

	wait := func(d time.Duration) error {
		if d <= 0 {
			if life.Err() != nil {
				return errAborted
			}
			return nil
		}
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		case <-life.Done():
			return errAborted
		}
	}
	select {
	case <-s.admitted:
	case <-ctx.Done():
		return ctx.Err()
	case <-life.Done():
		return errAborted
	}
	if err := wait(time.Duration(s.promptLen-s.hitTokens) * r.opts.PrefillPerToken); err != nil {
		return err
	}
	for j, piece := range Generate(s.tokens[:s.promptLen], s.maxTokens) {
		if j > 0 {
			if err := wait(r.opts.DecodePerToken); err != nil {
				return err
			}
		}
		r.mu.Lock()
		s.tokens = append(s.tokens, TokenID(piece))
		// The KV of every token before this one is now computed: a block they fill is cached.
		r.publish(r.cacheBlocks(s, len(s.tokens)-1))
		r.counts.generationTokens++
		r.mu.Unlock()
		if err := emit(piece); err != nil {
			return err
		}
	}
	return nil
}

// end takes a finished, failed or abandoned request off the rank.
func (r *rank) end(s *seq) {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch s.state {
	case seqWaiting:
		r.waiting = slices.DeleteFunc(r.waiting, func(w *seq) bool { return w == s })
	case seqRunning:
		r.pool.release(s.blocks)
		r.running--
	}
	s.state = seqDone
	r.inflight--
	r.admit()
	r.notify()
}

// admit admits waiting requests in queue order while the running cap and the free blocks allow.
// Admission is vLLM's scheduling of a prefill: the longest cached prefix of the prompt is taken
// (at most promptLen − 1 tokens, since the last prompt token must be computed), the other blocks
// are allocated (evicting cached blocks from the head of the free queue), and the prompt's full
// blocks are cached at once. The batch published holds a BlockRemoved per evicted block, then one
// BlockStored for the new prompt blocks. Called with mu held.
func (r *rank) admit() {
	bs := r.opts.BlockSize
	for !r.paused && r.life.Err() == nil && r.running < r.opts.MaxNumSeqs && len(r.waiting) > 0 {
		s := r.waiting[0]
		hits := r.pool.hits(s.hashes, (s.promptLen-1)/bs)
		need := (s.promptLen+s.maxTokens+bs-1)/bs - len(hits)
		if !r.pool.canAllocate(need, hits) {
			return
		}
		r.pool.use(hits)
		ids, evicted := r.pool.allocate(need)
		s.blocks = append(hits, ids...)
		s.cached, s.hitTokens = len(hits), len(hits)*bs
		r.waiting = slices.Delete(r.waiting, 0, 1)
		r.running++
		s.state = seqRunning
		events := make([]event, 0, len(evicted)+1)
		for _, h := range evicted {
			events = append(events, event{kind: blockRemoved, hashes: []uint64{h}})
		}
		r.publish(append(events, r.cacheBlocks(s, s.promptLen)...))
		r.counts.promptTokens += uint64(s.promptLen)
		r.counts.cacheHits += uint64(s.hitTokens)
		close(s.admitted)
	}
}

// cacheBlocks caches the request's full blocks among its first computed tokens that are not
// cached yet, and returns their BlockStored event (none when there are none). Called with mu held.
func (r *rank) cacheBlocks(s *seq, computed int) []event {
	bs := r.opts.BlockSize
	full := computed / bs
	if full <= s.cached {
		return nil
	}
	ev := event{kind: blockStored, tokens: s.tokens[s.cached*bs : full*bs]}
	parent := rootHash
	if s.cached > 0 {
		parent = s.hashes[s.cached-1]
		ev.parent, ev.hasParent = parent, true
	}
	for i := s.cached; i < full; i++ {
		tokens := s.tokens[i*bs : (i+1)*bs]
		if i == len(s.hashes) {
			s.hashes = append(s.hashes, chainHash(parent, tokens))
		}
		h := s.hashes[i]
		info := Block{Hash: h, Tokens: tokens, Prefix: s.tokens[:(i+1)*bs]}
		if i > 0 {
			info.Parent, info.HasParent = parent, true
		}
		r.pool.cache(s.blocks[i], info)
		ev.hashes = append(ev.hashes, h)
		parent = h
	}
	s.cached = full
	return []event{ev}
}

// publish sends events as one batch unless the rank is being restarted or closed. Called with mu
// held, which keeps the batches in the order of the changes they describe.
func (r *rank) publish(events []event) {
	if r.pub != nil && len(events) > 0 && r.life.Err() == nil {
		r.pub.publish(events)
	}
}

// sleep pauses admission, waits for the running requests to end, then empties the cache and
// publishes AllBlocksCleared (vLLM's /sleep resets the prefix cache). Waiting requests stay queued
// until wakeUp. When ctx ends first, admission stays paused and the cache is kept.
func (r *rank) sleep(ctx context.Context) error {
	r.mu.Lock()
	r.paused = true
	life := r.life
	r.mu.Unlock()
	if err := r.waitUntil(ctx, life.Done(), func() bool { return r.running == 0 }); err != nil {
		return err
	}
	defer r.mu.Unlock()
	if !r.cleared {
		r.pool.clear()
		r.cleared = true
		r.publish([]event{{kind: allBlocksCleared}})
	}
	return nil
}

// wakeUp resumes admission.
func (r *rank) wakeUp() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.paused, r.cleared = false, false
	r.admit()
	r.notify()
}

// stop cuts every request off (run returns errAborted) and waits until all have ended.
func (r *rank) stop() {
	r.mu.Lock()
	r.kill()
	r.notify()
	r.mu.Unlock()
	_ = r.waitUntil(context.Background(), nil, func() bool { return r.inflight == 0 })
	r.mu.Unlock()
}

// restart stops the rank and starts it again empty, as a restarted engine process: an empty
// cache, no requests, zero counters, the publisher numbering from FirstSeq with an empty replay
// buffer on the same endpoints.
func (r *rank) restart() {
	r.stop()
	r.mu.Lock()
	defer r.mu.Unlock()
	r.pool = newPool(r.opts.NumBlocks)
	r.waiting, r.running, r.paused, r.cleared, r.counts = nil, 0, false, false, rankCounters{}
	if r.pub != nil {
		r.pub.reset()
	}
	r.life, r.kill = context.WithCancel(context.Background())
	r.notify()
}
