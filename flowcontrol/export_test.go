package flowcontrol

import (
	"maps"
	"time"

	"github.com/enginepick/enginepick/state"
)

// SetClock replaces the clock of attained service and dispatch rates; call it before any Wait.
func SetClock(c *Controller, now func() time.Time) { c.now = now }

// Queued returns how many requests of the model wait.
func Queued(c *Controller, m state.ModelID) int {
	v, ok := c.queues.Load(m)
	if !ok {
		return 0
	}
	return int(v.(*queue).waiting.Load())
}

// BandOf returns the priority of the band a request of priority p waits in.
func BandOf(c *Controller, p int) int { return c.bands[c.band(p)].Priority }

// Enqueued returns how many requests of the model were ever queued.
func Enqueued(c *Controller, m state.ModelID) uint64 {
	v, ok := c.queues.Load(m)
	if !ok {
		return 0
	}
	q := v.(*queue)
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.seq
}

// Classes returns the model's waiting requests per class.
func Classes(c *Controller, m state.ModelID) map[uint64]int {
	v, ok := c.queues.Load(m)
	if !ok {
		return nil
	}
	q := v.(*queue)
	q.mu.Lock()
	defer q.mu.Unlock()
	return maps.Clone(q.classes)
}
