package flowcontrol

import (
	"container/heap"
	"context"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/enginepick/enginepick/internal/label"
)

// queue is one model's waiting requests.
//
// The pass: a waiting request is tried only when it holds the turn (holder), which one request
// holds at a time. advanceLocked gives the turn to the first eligible request in order; a refused
// request marks its class refused for the current epoch (Notify increments it), which makes the
// class's other requests ineligible until the next Notify. The pass ends when no request is
// eligible, and the next Notify starts another.
type queue struct {
	c       *Controller
	epoch   atomic.Uint64 // capacity events (Notify)
	waiting atomic.Int64  // len of the queue, readable without mu
	busy    atomic.Bool   // holder != nil, readable without mu

	mu      sync.Mutex
	bands   []band // as c.bands
	n       int
	seq     uint64
	holder  *waiter
	classes map[uint64]int // waiting requests per class
	refused map[uint64]struct{}
	// refusedEpoch is the epoch refused belongs to; a newer epoch empties it.
	refusedEpoch uint64

	// Attained service is kept scaled: a flow's service is flow.service × 2^−(now−base)/halfLife,
	// so that decay changes no flow's order and only a charge needs arithmetic. dispatched is the
	// dispatches, decayed the same way (RetryAfter's rate); anyDispatch, whether there was one.
	flows       map[string]*flow
	base        time.Time
	dispatched  float64
	anyDispatch bool
	sweepAt     int

	ended []ending // driven requests that left, for their done (Drive)
}

// band is one band's waiting requests of a queue.
type band struct {
	n           int
	active      flowHeap // flows with waiting requests in the band, least service ÷ weight first
	first, last *waiter  // arrival order, for displacement
}

// flow is one fairness key's state in a queue.
type flow struct {
	weight  float64
	service float64  // scaled, see queue
	qs      []*flowQ // per band, nil until used
	active  int      // bands where the flow has waiting requests
}

// flowQ is one flow's waiting requests in one band, first come first served.
type flowQ struct {
	f          *flow
	band       int
	head, tail *waiter
	idx        int // in the band's heap, −1 when empty
	// byClass holds the same requests by class, each class's oldest first, so that the first
	// request of a class not refused is found without walking past the refused ones.
	byClass map[uint64]*seqHeap
}

type signal uint8

const (
	sigTurn signal = iota + 1
	sigDisplaced
)

// waiter is one waiting request: a blocked Wait (ch), or a driven request (Drive: attempt, done).
type waiter struct {
	req          Request // its Class is its last refusal's class (Request.Class before one)
	fq           *flowQ
	seq          uint64
	prev, next   *waiter // in fq
	bprev, bnext *waiter // in the band's arrival order
	ch           chan signal
	queued       bool
	turnEpoch    uint64
	cidx         int   // in its flowQ's heap of its class
	tries        int   // attempts of the turn it holds
	displaced    error // set before sigDisplaced

	attempt  func() (bool, uint64, error)
	done     func(error)
	deadline time.Time // its band's TTL, on the Controller's clock; zero: none
}

// ending is a driven request that left the queue, and its outcome.
type ending struct {
	w   *waiter
	err error
}

func newQueue(c *Controller) *queue {
	q := &queue{c: c, bands: make([]band, len(c.bands)), classes: map[uint64]int{}, refused: map[uint64]struct{}{},
		flows: map[string]*flow{}, base: c.now(), sweepAt: 1024}
	return q
}

// wait is a queued request's loop: its turns, its end.
func (q *queue) wait(ctx context.Context, w *waiter, b *Band, attempt func() (bool, uint64, error)) error {
	var expired <-chan time.Time
	if b.TTL > 0 {
		t := time.NewTimer(b.TTL)
		defer t.Stop()
		expired = t.C
	}
	for {
		select {
		case s := <-w.ch:
			if s == sigDisplaced {
				return w.displaced
			}
			saturated, class, err := attempt()
			q.mu.Lock()
			left := q.turnEndedLocked(w, saturated, class, err)
			q.mu.Unlock()
			if left {
				return err
			}
		case <-ctx.Done():
			return q.leave(w, fmt.Errorf("flowcontrol: gave up waiting: %w", ctx.Err()))
		case <-expired:
			return q.leave(w, timeoutError(b))
		}
	}
}

// timeoutError is the end of a wait that reached band b's TTL.
func timeoutError(b *Band) error {
	return fmt.Errorf("%w after %v in band %d", ErrTimeout, b.TTL, b.Priority)
}

// turnEndedLocked applies the outcome of w's turn and passes the turn on: a request that was not
// refused leaves the queue (charged when served); a refused one keeps its place, takes the
// refusal's class, and that class is refused for the epoch of the turn. It reports whether w left.
func (q *queue) turnEndedLocked(w *waiter, saturated bool, class uint64, err error) bool {
	q.holder = nil
	q.busy.Store(false)
	if saturated {
		w.tries++
		again := w.tries < maxTries && q.movedLocked(w.req.Class, class, w.turnEpoch)
		q.reclassLocked(w, class)
		q.refusedLocked(class, w.turnEpoch)
		if again {
			q.grantLocked(w, w.tries)
			return false
		}
	} else {
		q.removeLocked(w)
		if err == nil {
			q.servedLocked(&w.req)
		}
	}
	q.advanceLocked()
	return !saturated
}

// leave removes a request whose wait ended, passing its turn on if it held it.
func (q *queue) leave(w *waiter, err error) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if !w.queued {
		return w.displaced // displaced meanwhile
	}
	q.removeLocked(w)
	if q.holder == w {
		q.holder = nil
		q.busy.Store(false)
		q.advanceLocked()
	}
	return err
}

// reclassLocked moves a queued request to class, keeping the count of waiting requests per class.
func (q *queue) reclassLocked(w *waiter, class uint64) {
	if w.req.Class == class {
		return
	}
	if q.classes[w.req.Class]--; q.classes[w.req.Class] == 0 {
		delete(q.classes, w.req.Class)
	}
	w.fq.unclass(w)
	w.req.Class = class
	w.fq.class(w)
	q.classes[class]++
}

// refusedLocked records that a request of class was refused at epoch; a refusal from an older
// epoch (capacity may have freed since) records nothing.
func (q *queue) refusedLocked(class, epoch uint64) {
	cur := q.epoch.Load()
	if epoch != cur {
		return
	}
	if q.refusedEpoch != cur {
		clear(q.refused)
		q.refusedEpoch = cur
	}
	q.refused[class] = struct{}{}
}

// isRefused reports whether class was refused in the current epoch.
func (q *queue) isRefused(class uint64) bool {
	if q.refusedEpoch != q.epoch.Load() {
		return false
	}
	_, ok := q.refused[class]
	return ok
}

// maxTries bounds the attempts of one turn, and of an arrival's first try (movedLocked).
const maxTries = 64

// movedLocked reports whether a request refused with class, after its last refusal with prev, is
// tried again at once: the refusal named other engines than before (a policy that does not read
// admission, round-robin say, picked another engine) and no request was refused with class in
// epoch, the current one. A refusal that repeats, or that another request met first in this pass,
// ends the turn.
func (q *queue) movedLocked(prev, class, epoch uint64) bool {
	return class != prev && epoch == q.epoch.Load() && !q.isRefused(class)
}

// advanceLocked gives the turn to the next eligible request, unless one holds it.
func (q *queue) advanceLocked() {
	if q.holder != nil || q.n == 0 {
		return
	}
	if w := q.nextLocked(); w != nil {
		q.grantLocked(w, 0)
	}
}

// grantLocked gives w the turn, its tries-th attempt in a row.
func (q *queue) grantLocked(w *waiter, tries int) {
	q.holder = w
	q.busy.Store(true)
	w.turnEpoch = q.epoch.Load()
	w.tries = tries
	if w.ch != nil {
		w.ch <- sigTurn // buffered, and empty: a queued request has no signal pending
	} // a driven request's turn is run by Drive
}

// nextLocked returns the first eligible request in order (band, least service ÷ weight, arrival),
// or nil when every waiting request's class was refused in this epoch.
func (q *queue) nextLocked() *waiter {
	if q.refusedEpoch != q.epoch.Load() || len(q.refused) == 0 {
		for i := range q.bands {
			if b := &q.bands[i]; b.n > 0 {
				return b.active[0].head
			}
		}
		return nil
	}
	blocked := true
	for class := range q.classes {
		if _, ok := q.refused[class]; !ok {
			blocked = false
			break
		}
	}
	if blocked {
		return nil
	}
	for i := range q.bands {
		var best *waiter
		var bestQ *flowQ
		for _, fq := range q.bands[i].active {
			if bestQ != nil && !fq.before(bestQ) {
				continue
			}
			var first *waiter // the flow's oldest request of a class not refused
			for class, h := range fq.byClass {
				if _, ok := q.refused[class]; !ok && (first == nil || (*h)[0].seq < first.seq) {
					first = (*h)[0]
				}
			}
			if first != nil {
				best, bestQ = first, fq
			}
		}
		if best != nil {
			return best
		}
	}
	return nil
}

// enqueueLocked queues the request in band bi. When the model's queue is full it displaces the
// newest request of the flow served last in the lowest band below bi, else, as when band bi is
// full, the newest request of the flow band bi serves last if the request's flow is served before
// it; it returns a *RejectedError when the request cannot be queued. With done set, the request is driven, with
// attempt as its turn.
func (q *queue) enqueueLocked(r *Request, bi int, attempt func() (bool, uint64, error), done func(error)) (*waiter, error) {
	cfg := &q.c.bands[bi]
	f := q.flowLocked(r.Flow)
	bandFull := cfg.MaxQueued > 0 && q.bands[bi].n >= cfg.MaxQueued
	if bandFull || q.n >= q.c.maxQueued {
		var v *waiter
		if !bandFull {
			v = q.victimLocked(bi)
		}
		if v == nil {
			v = q.fairVictimLocked(bi, f)
		}
		if v == nil {
			return nil, q.rejectedLocked(label.FlowQueueFull, bi)
		}
		vb := v.fq.band
		q.removeLocked(v)
		v.displaced = q.rejectedLocked(label.FlowDisplaced, vb)
		if v.ch != nil {
			v.ch <- sigDisplaced
		} else {
			q.ended = append(q.ended, ending{v, v.displaced})
		}
	}
	if f.qs[bi] == nil {
		f.qs[bi] = &flowQ{f: f, band: bi, idx: -1, byClass: map[uint64]*seqHeap{}}
	}
	fq := f.qs[bi]
	q.seq++
	w := &waiter{req: *r, fq: fq, seq: q.seq, queued: true}
	if done == nil {
		w.ch = make(chan signal, 1)
	} else {
		w.attempt, w.done = attempt, done
		if ttl := cfg.TTL; ttl > 0 {
			w.deadline = q.c.now().Add(ttl)
		}
	}
	if fq.tail == nil {
		fq.head, fq.tail = w, w
		heap.Push(&q.bands[bi].active, fq)
		f.active++
	} else {
		w.prev, fq.tail.next = fq.tail, w
		fq.tail = w
	}
	fq.class(w)
	b := &q.bands[bi]
	if b.last == nil {
		b.first, b.last = w, w
	} else {
		w.bprev, b.last.bnext = b.last, w
		b.last = w
	}
	b.n++
	q.n++
	q.waiting.Add(1)
	q.classes[r.Class]++
	return w, nil
}

// victimLocked returns the request a full queue displaces for an arrival of band bi: in the lowest
// band below bi that has one, the newest request of the flow the band serves last; or nil. The
// request holding the turn is never displaced, nor counts (lastFlowLocked).
func (q *queue) victimLocked(bi int) *waiter {
	for i := len(q.bands) - 1; i > bi; i-- {
		if fq := q.lastFlowLocked(i); fq != nil {
			return q.newestLocked(fq)
		}
	}
	return nil
}

// fairVictimLocked returns the newest request of the flow that band bi serves last, when flow f
// is served before it; or nil.
func (q *queue) fairVictimLocked(bi int, f *flow) *waiter {
	last := q.lastFlowLocked(bi)
	if last == nil || last.f == f || !(f.service/f.weight < last.f.service/last.f.weight) {
		return nil
	}
	return q.newestLocked(last)
}

// lastFlowLocked returns the flow band bi serves last (the most attained service ÷ weight) among
// those with a request that does not hold the turn, or nil when there is none.
func (q *queue) lastFlowLocked(bi int) *flowQ {
	var last *flowQ
	for _, fq := range q.bands[bi].active {
		if (last == nil || last.before(fq)) && q.newestLocked(fq) != nil {
			last = fq
		}
	}
	return last
}

// newestLocked returns fq's newest request that does not hold the turn, or nil.
func (q *queue) newestLocked(fq *flowQ) *waiter {
	for w := fq.tail; w != nil; w = w.prev {
		if w != q.holder {
			return w
		}
	}
	return nil
}

// removeLocked takes a queued request out of the queue.
func (q *queue) removeLocked(w *waiter) {
	fq := w.fq
	b := &q.bands[fq.band]
	fq.unclass(w)
	if w.prev != nil {
		w.prev.next = w.next
	} else {
		fq.head = w.next
	}
	if w.next != nil {
		w.next.prev = w.prev
	} else {
		fq.tail = w.prev
	}
	switch {
	case fq.head == nil:
		heap.Remove(&b.active, fq.idx)
		fq.f.active--
	case w.prev == nil:
		heap.Fix(&b.active, fq.idx) // a new head: a new tie-break
	}
	if w.bprev != nil {
		w.bprev.bnext = w.bnext
	} else {
		b.first = w.bnext
	}
	if w.bnext != nil {
		w.bnext.bprev = w.bprev
	} else {
		b.last = w.bprev
	}
	w.prev, w.next, w.bprev, w.bnext = nil, nil, nil, nil
	w.queued = false
	b.n--
	q.n--
	q.waiting.Add(-1)
	if q.classes[w.req.Class]--; q.classes[w.req.Class] == 0 {
		delete(q.classes, w.req.Class)
	}
}

// servedDirect charges a request served at its first attempt. When its class was refused in this
// epoch, capacity freed without a Notify: it starts a pass.
func (q *queue) servedDirect(r *Request) {
	q.mu.Lock()
	q.servedLocked(r)
	if q.n > 0 && q.isRefused(r.Class) {
		q.epoch.Add(1)
		q.advanceLocked()
	}
	q.mu.Unlock()
}

// servedLocked charges the request's cost to its flow and counts the dispatch.
func (q *queue) servedLocked(r *Request) {
	s := q.scaleLocked()
	f := q.flowLocked(r.Flow)
	f.service += float64(max(r.Cost, 1)) * s
	q.dispatched += s
	q.anyDispatch = true
	if f.active > 0 {
		for _, fq := range f.qs {
			if fq != nil && fq.idx >= 0 {
				heap.Fix(&q.bands[fq.band].active, fq.idx)
			}
		}
	}
}

// renormalizeAt bounds the scale's exponent: beyond it every scaled value is divided by 2^k.
const renormalizeAt = 512

// scaleLocked returns 2^((now − base) ÷ halfLife), renormalizing the scaled values first when the
// exponent grows past renormalizeAt.
func (q *queue) scaleLocked() float64 {
	x := float64(q.c.now().Sub(q.base)) / float64(q.c.halfLife)
	if x > renormalizeAt {
		k := math.Floor(x)
		d := math.Exp2(-k)
		for _, f := range q.flows {
			f.service *= d
		}
		q.dispatched *= d
		q.base = q.base.Add(time.Duration(k * float64(q.c.halfLife)))
		x -= k
	}
	return math.Exp2(x)
}

// flowLocked returns the flow of key, creating it; creating one past sweepAt first forgets the
// idle flows whose service has decayed below one token.
func (q *queue) flowLocked(key string) *flow {
	if f := q.flows[key]; f != nil {
		return f
	}
	if len(q.flows) >= q.sweepAt {
		s := q.scaleLocked()
		for k, f := range q.flows {
			if f.active == 0 && f.service < s {
				delete(q.flows, k)
			}
		}
		q.sweepAt = max(1024, 2*len(q.flows))
	}
	w := 1.0
	if q.c.weight != nil {
		if v := q.c.weight(key); v > 0 && !math.IsInf(v, 0) {
			w = v
		}
	}
	f := &flow{weight: w, qs: make([]*flowQ, len(q.bands))}
	q.flows[key] = f
	return f
}

// rejectedLocked builds the rejection of a request of band bi, with its retry hint.
func (q *queue) rejectedLocked(reason string, bi int) *RejectedError {
	ahead := 0
	for i := 0; i <= bi; i++ {
		ahead += q.bands[i].n
	}
	retry := time.Second
	if q.anyDispatch && ahead > 0 {
		// A steady rate λ of dispatches keeps the decayed count at λ × halfLife ÷ ln 2. Clamped
		// in float seconds: after a long idle period the rate is near 0 (or 0), the wait beyond
		// any Duration.
		rate := q.dispatched / q.scaleLocked() * math.Ln2 / q.c.halfLife.Seconds()
		secs := min(max(math.Ceil(float64(ahead)/rate), 1), 60) // whole seconds, as Retry-After
		retry = time.Duration(secs) * time.Second
	}
	return &RejectedError{Reason: reason, Priority: q.c.bands[bi].Priority, RetryAfter: retry}
}

// before reports whether fq is served before o: less attained service ÷ weight, then the older
// head.
func (fq *flowQ) before(o *flowQ) bool {
	a, b := fq.f.service/fq.f.weight, o.f.service/o.f.weight
	if a != b {
		return a < b
	}
	return fq.head.seq < o.head.seq
}

// flowHeap orders a band's active flows (container/heap).
type flowHeap []*flowQ

func (h flowHeap) Len() int           { return len(h) }
func (h flowHeap) Less(i, j int) bool { return h[i].before(h[j]) }
func (h flowHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].idx, h[j].idx = i, j
}
func (h *flowHeap) Push(x any) {
	fq := x.(*flowQ)
	fq.idx = len(*h)
	*h = append(*h, fq)
}
func (h *flowHeap) Pop() any {
	old := *h
	fq := old[len(old)-1]
	old[len(old)-1] = nil
	fq.idx = -1
	*h = old[:len(old)-1]
	return fq
}

// class adds w to fq's heap of its class.
func (fq *flowQ) class(w *waiter) {
	h := fq.byClass[w.req.Class]
	if h == nil {
		h = &seqHeap{}
		fq.byClass[w.req.Class] = h
	}
	heap.Push(h, w)
}

// unclass removes w from fq's heap of its class, and the heap when it empties.
func (fq *flowQ) unclass(w *waiter) {
	h := fq.byClass[w.req.Class]
	heap.Remove(h, w.cidx)
	if h.Len() == 0 {
		delete(fq.byClass, w.req.Class)
	}
}

// seqHeap orders one flow's requests of one class, the oldest first (container/heap).
type seqHeap []*waiter

func (h seqHeap) Len() int           { return len(h) }
func (h seqHeap) Less(i, j int) bool { return h[i].seq < h[j].seq }
func (h seqHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].cidx, h[j].cidx = i, j
}
func (h *seqHeap) Push(x any) {
	w := x.(*waiter)
	w.cidx = len(*h)
	*h = append(*h, w)
}
func (h *seqHeap) Pop() any {
	old := *h
	w := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return w
}
