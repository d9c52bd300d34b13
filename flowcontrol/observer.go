package flowcontrol

import (
	"context"
	"errors"
	"time"

	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/state"
)

// Observer receives what flow control does with the requests it queues or refuses, for metrics
// (package metrics implements it; config.New passes its observer on when it implements this).
//
// ObserveFlow is called synchronously on the request's goroutine, outside the Controller's locks:
// keep it cheap, non-blocking and safe for concurrent use. A request served at its first attempt
// reports nothing; one refused at once reports one Event; one that waits reports two, from the
// same goroutine: when it starts waiting, then when it leaves the queue.
type Observer interface {
	ObserveFlow(e Event)
}

// Event is one request starting to wait, leaving the queue, or refused without waiting.
type Event struct {
	// Model is the request's model; Band is the priority of the band it waits in (Config.Bands),
	// Flow its flow, as the host set it (an unbounded value: see Observer's implementations).
	Model state.ModelID
	Band  int
	Flow  string
	// Outcome is empty when the request starts waiting. After a wait it is "served" (its attempt
	// dispatched it), "failed" (its attempt ended with another error), "displaced", "expired" (the
	// band's TTL) or "canceled" (the caller's context ended: canceled or past its deadline). A
	// request refused without waiting has "queue_full" or "sheddable".
	Outcome string
	// Waited is the time from the start of the wait to its end, on the Controller's clock; 0 when
	// Outcome is empty or the request did not wait.
	Waited time.Duration
}

// refused reports a request refused without waiting (err, a *RejectedError), when observed.
func (c *Controller) refused(r *Request, b *Band, err error) {
	var rej *RejectedError
	if c.obs != nil && errors.As(err, &rej) {
		c.obs.ObserveFlow(Event{Model: r.Model, Band: b.Priority, Flow: r.Flow, Outcome: rej.Reason})
	}
}

// observedWait is q.wait reported to the Observer: the start of the wait and its end.
func (c *Controller) observedWait(ctx context.Context, q *queue, w *waiter, b *Band, r *Request, attempt func() (bool, uint64, error)) error {
	start := c.now()
	c.obs.ObserveFlow(Event{Model: r.Model, Band: b.Priority, Flow: r.Flow})
	err := q.wait(ctx, w, b, attempt)
	c.obs.ObserveFlow(Event{Model: r.Model, Band: b.Priority, Flow: r.Flow, Outcome: waitOutcome(err), Waited: c.now().Sub(start)})
	return err
}

// waitOutcome is Event.Outcome of a wait that ended with err.
func waitOutcome(err error) string {
	var rej *RejectedError
	switch {
	case err == nil:
		return label.FlowServed
	case errors.As(err, &rej):
		return rej.Reason
	case errors.Is(err, ErrTimeout):
		return label.FlowExpired
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return label.FlowCanceled
	}
	return label.FlowFailed
}
