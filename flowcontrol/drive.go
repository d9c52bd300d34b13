package flowcontrol

import (
	"time"

	"github.com/enginepick/enginepick/internal/flowbridge"
	"github.com/enginepick/enginepick/state"
)

// The driven form of the queue (package internal/flowbridge): a request without a goroutine,
// whose turns the driver runs.
func init() {
	flowbridge.Submit = func(c any, r any, attempt func() (bool, uint64, error), done func(error)) {
		c.(*Controller).submit(r.(Request), attempt, done)
	}
	flowbridge.Drive = func(c any, model state.ModelID) { c.(*Controller).drive(model) }
	flowbridge.BelowTop = func(c any, priority int) bool { return c.(*Controller).belowTop(priority) }
	flowbridge.SetClock = func(c any, now func() time.Time) { c.(*Controller).now = now }
}

// submit is Wait for a driven request (flowbridge.Submit), reported to the Observer as Wait is.
func (c *Controller) submit(r Request, attempt func() (bool, uint64, error), done func(error)) {
	var ev *Event // the wait's start, once the request waits
	var start time.Time
	end := done
	if c.obs != nil {
		end = func(err error) {
			if ev != nil {
				ev.Outcome, ev.Waited = waitOutcome(err), c.now().Sub(start)
				c.obs.ObserveFlow(*ev)
			}
			done(err)
		}
	}
	q, w, err := c.enter(&r, attempt, end)
	switch {
	case w == nil:
		done(err)
	case c.obs != nil:
		ev, start = &Event{Model: r.Model, Band: c.bands[w.fq.band].Priority, Flow: r.Flow}, c.now()
		c.obs.ObserveFlow(*ev)
	}
	q.flush()
}

// drive runs the model's driven requests (flowbridge.Drive).
func (c *Controller) drive(model state.ModelID) {
	v, ok := c.queues.Load(model)
	if !ok {
		return
	}
	q := v.(*queue)
	q.mu.Lock()
	q.expireLocked()
	q.mu.Unlock()
	q.flush()
	for {
		q.mu.Lock()
		w := q.holder
		if w == nil || w.done == nil {
			q.mu.Unlock()
			return
		}
		q.mu.Unlock()
		saturated, class, err := w.attempt()
		q.mu.Lock()
		left := q.turnEndedLocked(w, saturated, class, err)
		q.mu.Unlock()
		if left {
			w.done(err)
		}
		q.flush()
	}
}

// expireLocked ends the driven requests whose deadline has passed on the Controller's clock. A
// band's requests arrive in deadline order, so each band's scan stops at its first driven request
// still in time.
func (q *queue) expireLocked() {
	var now time.Time
	for i := range q.bands {
		b := &q.c.bands[i]
		if b.TTL <= 0 {
			continue
		}
		for w := q.bands[i].first; w != nil; {
			next := w.bnext
			if w.done != nil {
				if now.IsZero() {
					now = q.c.now()
				}
				if now.Before(w.deadline) {
					break
				}
				q.removeLocked(w)
				if q.holder == w {
					q.holder = nil
					q.busy.Store(false)
				}
				q.ended = append(q.ended, ending{w, timeoutError(b)})
			}
			w = next
		}
	}
	q.advanceLocked()
}

// flush calls the done of the driven requests that left the queue, outside its lock.
func (q *queue) flush() {
	for {
		q.mu.Lock()
		ended := q.ended
		q.ended = nil
		q.mu.Unlock()
		if len(ended) == 0 {
			return
		}
		for _, e := range ended {
			e.w.done(e.err)
		}
	}
}
