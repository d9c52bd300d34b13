package sim

import (
	"container/heap"
	"time"
)

// eventKind says what an event does when it fires.
type eventKind uint8

const (
	// evTick: every engine reports its load; the next tick is scheduled while work remains.
	evTick eventKind = iota
	// evArrival: trace request arg arrives at the router.
	evArrival
	// evStep: engine arg's current step or run of decode steps ends, if ver is still its
	// segment version (a cut segment leaves a stale event behind).
	evStep
	// evTransfer: request arg's KV has reached its decode engine (PD).
	evTransfer
	// evShare: shared batch arg of replica ver reaches the other replicas (Config.ShareRouters).
	evShare
)

// event is one entry of the virtual-time queue. Events fire in (at, seq) order: seq is the order
// of scheduling, so simultaneous events fire first-scheduled first and the replay is
// deterministic.
type event struct {
	at   time.Duration
	seq  uint64
	kind eventKind
	arg  int32
	ver  uint64
}

// eventQueue is a min-heap of events for container/heap.
type eventQueue []event

func (q eventQueue) Len() int { return len(q) }
func (q eventQueue) Less(i, j int) bool {
	if q[i].at != q[j].at {
		return q[i].at < q[j].at
	}
	return q[i].seq < q[j].seq
}
func (q eventQueue) Swap(i, j int) { q[i], q[j] = q[j], q[i] }
func (q *eventQueue) Push(x any)   { *q = append(*q, x.(event)) }
func (q *eventQueue) Pop() any {
	old := *q
	e := old[len(old)-1]
	*q = old[:len(old)-1]
	return e
}

// schedule queues an event at time at.
func (r *run) schedule(at time.Duration, kind eventKind, arg int32, ver uint64) {
	r.seq++
	heap.Push(&r.events, event{at: at, seq: r.seq, kind: kind, arg: arg, ver: ver})
}
