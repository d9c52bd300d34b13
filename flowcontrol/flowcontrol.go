package flowcontrol

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

// Defaults of Config's zero values.
const (
	defaultMaxQueued      = 4096
	defaultHalfLife       = 60 * time.Second
	defaultQueueThreshold = 5
	defaultKVThreshold    = 0.8
)

// Config configures a Controller. The zero value is usable: one band of priority 0, at most
// 4,096 waiting requests per model, a 60 s half-life, every flow of weight 1, and the detector's
// thresholds at 5 waiting requests and 80 % KV usage (docs/design.md §17).
type Config struct {
	// Bands are the priority bands, in any order; priorities must be distinct. A request waits in
	// the band of the highest priority at or below its own, or in the lowest band when its
	// priority is below every band's. Empty means one band of priority 0 with Band's defaults.
	Bands []Band
	// MaxQueued bounds the waiting requests of one model, every band together. When it is
	// reached, an arrival displaces the newest waiting request of the flow served last in the
	// lowest band below its own; with no lower band waiting, as in a full band (Band.MaxQueued),
	// the newest request of the flow its band serves last, when the arrival's flow is served
	// before it; otherwise the arrival is rejected. A request whose selection attempt is running
	// is never displaced: the flows and bands are chosen among the others. 0 means 4,096.
	MaxQueued int
	// HalfLife is the half-life of a flow's attained service: a token served counts 1 at once,
	// ½ after HalfLife. 0 means 60 s.
	HalfLife time.Duration
	// Weight returns a flow's weight: its share of service relative to the other flows of its
	// band (a flow of weight 2 is served twice the tokens of a flow of weight 1). It is called
	// when a flow is first seen (and again after an idle flow was forgotten). Nil, or a result
	// that is not finite and > 0, means 1.
	Weight func(flow string) float64
	// QueueThreshold is the saturation detector's waiting-request threshold: an engine is
	// saturated when every DP rank's fresh report shows at least this many waiting requests, or
	// KV usage at KVThreshold. 0 means 5; math.MaxUint64 turns the queue test off.
	QueueThreshold uint64
	// KVThreshold is the detector's KV usage threshold, a fraction of the rank's KV capacity.
	// 0 means 0.8; a value above 1 turns the KV test off. Negative or NaN is invalid.
	KVThreshold float64
	// Observer, when set, receives every request that starts waiting, leaves the queue or is
	// refused (Observer). Nil means none, at no cost.
	Observer Observer
}

// Band is one priority band's settings. Bands are served strictly: a request of a lower band is
// served only when no request of a higher band can be.
type Band struct {
	// Priority orders bands: higher first. It is the value bucket.Request.Priority names.
	Priority int
	// TTL bounds a request's wait in this band; when it passes, the wait ends with ErrTimeout. 0
	// means no bound but the caller's context.
	TTL time.Duration
	// MaxQueued bounds this band's waiting requests per model; an arrival beyond it displaces
	// the newest request of the flow the band serves last when its own flow is served before it,
	// and is rejected ("queue_full") otherwise. 0 means only Config.MaxQueued bounds the band.
	MaxQueued int
	// Sheddable bands never wait: a request the fleet cannot serve at once is rejected
	// ("sheddable").
	Sheddable bool
}

// Request is what the Controller knows of one request.
type Request struct {
	// Model is the request's model: requests wait and compete only with requests of their model.
	Model state.ModelID
	// Priority selects the band (Config.Bands).
	Priority int
	// Flow is the fairness key (a tenant, an API key); empty is a flow like any other.
	Flow string
	// Cost is the service the request receives, in tokens (enginepick charges the prompt plus the
	// expected output); 0 counts as 1.
	Cost uint64
	// Class groups requests that one saturation blocks alike (enginepick: the same buckets and
	// affinity keys) until their first refusal; a refused request then takes the refusal's class
	// (Wait). After a request of a class was refused, its class's other waiting requests are not
	// tried again until capacity may have freed (Notify): a pass over the queue costs one attempt
	// per blocked class, not per waiting request.
	Class uint64
}

// Controller holds the waiting requests of every model. Safe for concurrent use; it starts no
// goroutine and needs no closing. One Controller may serve several Routers.
type Controller struct {
	bands     []Band // by Priority, highest first
	maxQueued int
	halfLife  time.Duration
	weight    func(string) float64
	queueTh   uint64
	kvTh      float64
	obs       Observer
	now       func() time.Time
	queues    sync.Map // state.ModelID → *queue
}

// New validates cfg and returns a Controller. Duplicate band priorities, a negative MaxQueued,
// HalfLife, band TTL or band MaxQueued, or a negative or NaN KVThreshold is an error wrapping
// state.ErrInvalidConfiguration.
func New(cfg Config) (*Controller, error) {
	bands := slices.Clone(cfg.Bands)
	if len(bands) == 0 {
		bands = []Band{{}}
	}
	slices.SortFunc(bands, func(a, b Band) int { return cmp.Compare(b.Priority, a.Priority) })
	for i, b := range bands {
		if i > 0 && b.Priority == bands[i-1].Priority {
			return nil, fmt.Errorf("flowcontrol: two bands of priority %d: %w", b.Priority, state.ErrInvalidConfiguration)
		}
		if b.TTL < 0 || b.MaxQueued < 0 {
			return nil, fmt.Errorf("flowcontrol: band %d: negative TTL %v or MaxQueued %d: %w", b.Priority, b.TTL, b.MaxQueued, state.ErrInvalidConfiguration)
		}
	}
	if cfg.MaxQueued < 0 || cfg.HalfLife < 0 {
		return nil, fmt.Errorf("flowcontrol: negative MaxQueued %d or HalfLife %v: %w", cfg.MaxQueued, cfg.HalfLife, state.ErrInvalidConfiguration)
	}
	if cfg.KVThreshold < 0 || math.IsNaN(cfg.KVThreshold) {
		return nil, fmt.Errorf("flowcontrol: KVThreshold %v, want >= 0: %w", cfg.KVThreshold, state.ErrInvalidConfiguration)
	}
	c := &Controller{bands: bands, maxQueued: cmp.Or(cfg.MaxQueued, defaultMaxQueued), halfLife: cmp.Or(cfg.HalfLife, defaultHalfLife),
		weight: cfg.Weight, queueTh: cmp.Or(cfg.QueueThreshold, defaultQueueThreshold), kvTh: cmp.Or(cfg.KVThreshold, defaultKVThreshold),
		obs: cfg.Observer, now: time.Now}
	return c, nil
}

// Saturated reports whether the saturation detector finds an engine saturated by its load: every
// DP rank (the engine itself when it has one) has at least Config.QueueThreshold waiting requests
// or a KV usage fraction of at least Config.KVThreshold. A nil load (unknown or stale:
// loadmon.Snapshot.Load's false) is not saturated: like admission's caps on reported metrics, the
// detector fails open, and in-flight caps still bound the engine (docs/design.md §17). The report
// is read as it is, without the dispatches since.
func (c *Controller) Saturated(load *loadmon.EngineLoad) bool {
	if load == nil {
		return false
	}
	if len(load.RankLoads) == 0 {
		return c.rankSaturated(load)
	}
	for _, r := range load.RankLoads {
		if !c.rankSaturated(r) {
			return false
		}
	}
	return true
}

func (c *Controller) rankSaturated(l *loadmon.EngineLoad) bool {
	if l.WaitingRequests >= c.queueTh {
		return true
	}
	f, ok := l.KVUsageFraction()
	return ok && f >= c.kvTh
}

// Wait runs attempt for the request, and waits and runs it again while it reports saturation,
// until it does not, the wait ends, or the request is rejected. attempt tries to serve the request
// (enginepick: one selection); it returns saturated when the fleet cannot serve it now (the
// request then waits), with the refusal's class, and otherwise the outcome: a nil error when it
// was served, which charges its Cost to its flow. The refusal's class groups the requests that
// refusal blocks alike (enginepick: the buckets and the engines that refused); a refused request
// takes it as its class (Request.Class) until its next refusal. attempt runs on the caller's goroutine, one attempt of a model's waiting
// requests at a time, in order: bands by priority, then the flow with the least attained service ÷
// weight, then first come first served; it never runs under the Controller's locks.
//
// A request runs its first attempt at once unless waiting requests of its model are being tried
// (it then waits for its turn). After a refusal it waits until Notify, its turn, and runs attempt
// again; a refusal leaves it in its place. A refusal whose class differs from the request's last
// and that no request met since the last Notify is followed at once by another attempt, up to 64
// in a row: the request's next attempt may pick elsewhere (round-robin), and what freed goes to
// the first request in order.
//
// Wait returns attempt's error (nil: served); a *RejectedError when the request is rejected
// (sheddable, queue full) or displaced; an error wrapping ErrTimeout
// when its band's TTL passes; ctx's error when ctx ends first. A request that leaves holds nothing
// and leaves no goroutine. A nil ctx means context.Background().
func (c *Controller) Wait(ctx context.Context, r Request, attempt func() (saturated bool, class uint64, err error)) error {
	if ctx == nil {
		ctx = context.Background()
	}
	q, w, err := c.enter(&r, attempt, nil)
	if w == nil {
		return err
	}
	b := &c.bands[w.fq.band]
	if c.obs != nil {
		return c.observedWait(ctx, q, w, b, &r, attempt)
	}
	return q.wait(ctx, w, b, attempt)
}

// enter runs a request's first attempt at once unless waiting requests of its model are being
// tried, and queues it when that attempt is refused or did not run. It returns the queued request,
// or a nil waiter and the outcome when the request did not wait (a refusal reported to the
// Observer). With done set, the request is driven (Drive): it has no channel, and done receives
// its end.
func (c *Controller) enter(r *Request, attempt func() (bool, uint64, error), done func(error)) (*queue, *waiter, error) {
	q := c.queue(r.Model)
	bi := c.band(r.Priority)
	b := &c.bands[bi]
	epoch := q.epoch.Load()
	busy := q.busy.Load()
	queued := *r // with the last refusal's class
	for n := 0; !busy; n++ {
		saturated, class, err := attempt()
		if !saturated {
			if err == nil {
				q.servedDirect(r)
			}
			return q, nil, err
		}
		q.mu.Lock()
		again := n+1 < maxTries && q.movedLocked(queued.Class, class, epoch)
		q.refusedLocked(class, epoch)
		q.mu.Unlock()
		queued.Class = class
		if !again {
			break
		}
	}
	q.mu.Lock()
	var w *waiter
	var err error
	if b.Sheddable {
		err = q.rejectedLocked(label.FlowSheddable, bi)
	} else if w, err = q.enqueueLocked(&queued, bi, attempt, done); err == nil {
		if !busy {
			q.refusedLocked(queued.Class, epoch)
		}
		q.advanceLocked()
	}
	q.mu.Unlock()
	if err != nil {
		c.refused(r, b, err)
		return q, nil, err
	}
	return q, w, nil
}

// Notify tells the Controller that capacity for the model's requests may have freed: a dispatch
// ended, a load report arrived, an engine changed. Its waiting requests are tried again, in order.
// It is cheap when none waits (two atomic operations) and never blocks on an attempt.
func (c *Controller) Notify(model state.ModelID) {
	v, ok := c.queues.Load(model)
	if !ok {
		return
	}
	q := v.(*queue)
	q.epoch.Add(1)
	if q.waiting.Load() == 0 {
		return
	}
	q.mu.Lock()
	q.advanceLocked()
	q.mu.Unlock()
}

// queue returns the model's queue, creating it.
func (c *Controller) queue(model state.ModelID) *queue {
	if v, ok := c.queues.Load(model); ok {
		return v.(*queue)
	}
	v, _ := c.queues.LoadOrStore(model, newQueue(c))
	return v.(*queue)
}

// belowTop reports whether a request of the priority waits in a band below the highest: false
// with a single band.
func (c *Controller) belowTop(priority int) bool {
	return c.band(priority) > 0
}

// band returns the index of the band a priority waits in.
func (c *Controller) band(priority int) int {
	for i := range c.bands {
		if c.bands[i].Priority <= priority {
			return i
		}
	}
	return len(c.bands) - 1
}

// ErrTimeout ends a wait that reached its band's TTL (HTTP 503, bucket.StatusCode).
var ErrTimeout = errors.New("flowcontrol: wait timed out")

// RejectedError reports a request that flow control refused to queue or pushed out of the queue
// (HTTP 429, bucket.StatusCode).
type RejectedError struct {
	// Reason is "queue_full" (the model's queue, or the request's band, was full), "displaced"
	// (the request waited and a request of a higher band, or of a flow served before its own,
	// took its place in a full queue) or
	// "sheddable" (the request's band is sheddable and the fleet could not serve it at once).
	Reason string
	// Priority is the priority of the band the request was in.
	Priority int
	// RetryAfter is a hint for the client's Retry-After: the time the model's waiting requests of
	// this band and above take to be served at the recent dispatch rate, rounded up to whole
	// seconds, between 1 s and 1 min (1 s before the model's first dispatch).
	RetryAfter time.Duration
}

// Error implements error.
func (e *RejectedError) Error() string {
	return fmt.Sprintf("flowcontrol: rejected (%s) in band %d, retry after %v", e.Reason, e.Priority, e.RetryAfter)
}
