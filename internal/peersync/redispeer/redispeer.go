// Package redispeer runs a peersync.Core over Redis pub/sub: each router replica publishes its
// batches on one channel per deployment and folds in its peers' (docs/design.md §6, "Router
// replicas"). Package config builds it from the replicas block.
//
// Pub/sub delivers a message at most once and keeps nothing: a batch lost while a replica is
// disconnected is a gap, which peersync already handles (the peer's dispatches stop counting and
// count again from the next starts). A stream would replay what a replica missed, but a
// dispatch's start is only worth the lease it counts for, so nothing here needs the replay.
//
// It is not a general pub/sub client: it knows one channel and the Core's batches.
package redispeer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/enginepick/enginepick/internal/peersync"
	"github.com/enginepick/enginepick/state"
)

// Defaults of Options.
const (
	// DefaultFlushInterval is how often pending deltas are published.
	DefaultFlushInterval = 5 * time.Millisecond
	// minBackoff and maxBackoff bound the wait between two connection attempts while the broker
	// is unreachable; the cap keeps the resumption within a second of the broker's return.
	minBackoff = 25 * time.Millisecond
	maxBackoff = 250 * time.Millisecond
	// commandTimeout bounds one connection attempt and one PUBLISH.
	commandTimeout = time.Second
	// maxHeld is how many deltas wait for the broker while it is unreachable: they are published
	// when it returns, so that peers count the dispatches started meanwhile. Once more wait, all
	// those waiting are dropped (Stats.Unpublished), which bounds the memory an outage holds.
	maxHeld = 1024
)

// Options configures a Peer.
type Options struct {
	// Redis is the broker's address, credentials and database. Required; New copies it and sets
	// its own timeouts and retries.
	Redis *redis.Options
	// Channel is the pub/sub channel every replica of the deployment shares. Required.
	Channel string
	// FlushInterval is how often pending deltas are published; 0 means DefaultFlushInterval. A
	// heartbeat goes every lease ÷ 4 (peersync.Core.Lease), which must be at least FlushInterval.
	FlushInterval time.Duration
	// Logger receives one warning when the broker becomes unreachable and one message when
	// sharing resumes. Nil means zap.NewNop().
	Logger *zap.Logger
}

// Peer shares one Core's deltas over Redis. Run does the work; Stats is safe for concurrent use.
type Peer struct {
	core      *peersync.Core
	redis     redis.Options
	channel   string
	flush     time.Duration
	heartbeat time.Duration
	log       *zap.Logger

	pub         atomic.Pointer[redis.Client] // the connected session's client; nil while down
	up          atomic.Bool
	unpublished atomic.Uint64 // deltas flushed while down or whose PUBLISH failed
}

// Stats are a Peer's counters.
type Stats struct {
	// Up reports whether the replica is subscribed to the channel: sharing works.
	Up bool
	// Peers is the number of peers whose dispatches count.
	Peers int
	// Sent are the deltas published; Received the peers' deltas applied.
	Sent, Received uint64
	// Dropped are the peers' deltas dropped, by peersync.Reason; Unpublished this replica's
	// deltas never published: dropped while the broker was unreachable (more than 1,024 held),
	// or in a PUBLISH that failed.
	Dropped     [peersync.NumReasons]uint64
	Unpublished uint64
}

// New returns a Peer that shares core's deltas. Errors (wrapping state.ErrInvalidConfiguration):
// a nil core or Options.Redis, an empty Channel, a negative FlushInterval, or a heartbeat
// (lease ÷ 4) shorter than FlushInterval.
func New(core *peersync.Core, opts Options) (*Peer, error) {
	if opts.FlushInterval == 0 {
		opts.FlushInterval = DefaultFlushInterval
	}
	switch {
	case core == nil || opts.Redis == nil:
		return nil, fmt.Errorf("redispeer: a Core and Redis options are required: %w", state.ErrInvalidConfiguration)
	case opts.Channel == "":
		return nil, fmt.Errorf("redispeer: empty channel: %w", state.ErrInvalidConfiguration)
	case opts.FlushInterval < 0:
		return nil, fmt.Errorf("redispeer: flush interval %v is negative: %w", opts.FlushInterval, state.ErrInvalidConfiguration)
	case core.Lease()/4 < opts.FlushInterval:
		return nil, fmt.Errorf("redispeer: lease %v is less than 4 flush intervals (%v): %w", core.Lease(), opts.FlushInterval, state.ErrInvalidConfiguration)
	}
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	p := &Peer{core: core, redis: *opts.Redis, channel: opts.Channel, flush: opts.FlushInterval,
		heartbeat: core.Lease() / 4, log: opts.Logger}
	// No retries: a failed command is counted and the next flush comes a few milliseconds later.
	// One dial attempt per command, so that a PUBLISH that races the broker's loss fails at once.
	p.redis.MaxRetries, p.redis.DialerRetries = -1, 1
	p.redis.DialTimeout, p.redis.ReadTimeout, p.redis.WriteTimeout = commandTimeout, commandTimeout, commandTimeout
	return p, nil
}

// Run shares the deltas until ctx is done: it subscribes to the channel and folds every peer
// batch into the Core, and publishes this replica's pending deltas every flush interval, with a
// heartbeat every lease ÷ 4. A peer silent for the lease stops counting (peersync.Core.Expire).
//
// The subscription is the broker's health: a replica is up while subscribed, and a lease without
// any message (its own heartbeats come back to it) counts as a loss. While down it runs on its own
// view: the peers are forgotten (peersync.Core.Forget), its deltas wait for the broker (once
// more than 1,024 wait, they are dropped), and it reconnects every 25 to 250 ms, so sharing resumes well
// within a second of the broker's return. Each connection uses a new client, so that no dial
// failure of an earlier one delays the next.
func (p *Peer) Run(ctx context.Context) {
	var wg sync.WaitGroup
	wg.Go(func() { p.publish(ctx) })
	backoff := minBackoff
	logged := false // the current outage was logged
	for ctx.Err() == nil {
		c := redis.NewClient(&p.redis)
		wasUp, err := p.session(ctx, c)
		p.down()
		_ = c.Close()
		if ctx.Err() != nil {
			break
		}
		if wasUp {
			backoff, logged = minBackoff, false
		}
		if !logged {
			logged = true
			p.log.Warn("router replicas: the broker is unreachable; routing on this replica's own view until it returns",
				zap.String("channel", p.channel), zap.String("redis", p.redis.Addr), zap.Error(err))
		}
		select {
		case <-ctx.Done():
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, maxBackoff)
	}
	wg.Wait()
}

// session subscribes with c and folds the peers' batches until the connection fails or ctx ends.
// It reports whether the subscription was confirmed, and the error that ended it.
func (p *Peer) session(ctx context.Context, c *redis.Client) (wasUp bool, err error) {
	ps := c.Subscribe(ctx)
	defer ps.Close()
	stop := context.AfterFunc(ctx, func() { _ = ps.Close() }) // unblocks ReceiveTimeout
	defer stop()
	subCtx, cancel := context.WithTimeout(ctx, commandTimeout)
	err = ps.Subscribe(subCtx, p.channel)
	cancel()
	if err != nil {
		return false, err
	}
	for {
		// Our own heartbeats come back every lease ÷ 4: a lease of silence is a lost broker.
		msg, err := ps.ReceiveTimeout(ctx, p.core.Lease())
		if err != nil {
			return wasUp, err
		}
		switch m := msg.(type) {
		case *redis.Subscription:
			if m.Kind == "subscribe" && !wasUp {
				wasUp = true
				p.pub.Store(c)  // first: the publisher's drop path would take the Resync with it
				p.core.Resync() // what the peers published before this subscription is lost to it
				if !p.up.Swap(true) {
					p.log.Info("router replicas: sharing with peers", zap.String("channel", p.channel))
				}
			}
		case *redis.Message:
			// A batch that does not decode is counted by the Core (peersync.ReasonMalformed).
			_ = p.core.Receive([]byte(m.Payload), time.Now())
		}
	}
}

// down marks the broker unreachable: nothing is published, and the peers are forgotten.
func (p *Peer) down() {
	p.pub.Store(nil)
	p.up.Store(false)
	p.core.Forget()
}

// publish flushes the Core every flush interval until ctx is done: to the broker while up; while
// down it holds the deltas for the broker's return, dropping them all once more than maxHeld wait. It expires
// silent peers every heartbeat.
func (p *Peer) publish(ctx context.Context) {
	t := time.NewTicker(p.flush)
	defer t.Stop()
	var lastBeat time.Time
	for {
		var now time.Time
		select {
		case <-ctx.Done():
			return
		case now = <-t.C:
		}
		beat := now.Sub(lastBeat) >= p.heartbeat
		if beat {
			p.core.Expire(now)
		}
		c := p.pub.Load()
		if c == nil {
			if p.core.PendingDeltas() > maxHeld {
				_, n := p.core.FlushDeltas(false) // a gap: peers count this replica afresh
				p.unpublished.Add(uint64(n))
			}
			continue
		}
		msg, n := p.core.FlushDeltas(beat)
		if msg == nil {
			continue
		}
		if beat {
			lastBeat = now
		}
		if err := c.Publish(ctx, p.channel, msg).Err(); err != nil {
			p.unpublished.Add(uint64(n))
			if !errors.Is(err, context.Canceled) {
				p.log.Debug("router replicas: publish failed", zap.Error(err))
			}
		}
	}
}

// Stats returns the Peer's counters.
func (p *Peer) Stats() Stats {
	sent, received, _ := p.core.Counts()
	st := Stats{Up: p.up.Load(), Received: received, Dropped: p.core.Drops(), Unpublished: p.unpublished.Load()}
	st.Sent = sent - min(sent, st.Unpublished)
	st.Peers, _ = p.core.Peers()
	return st
}
