package kvevents

import (
	"sync"
	"time"

	"go.uber.org/zap"
)

// warnKind is one kind of warning, rate-limited on its own.
type warnKind int

// warnRefused + r is the kind of an event refused for refusal r.
const warnRefused warnKind = 0

const (
	warnMalformed warnKind = warnKind(numRefusals) + iota // a batch that did not decode, or named another rank
	warnResync                                            // batches lost: a recovery started
	warnRestart                                           // the publisher restarted
	warnClear                                             // the rank was cleared after a loss
	warnReplay                                            // a replay failed
	warnSilent                                            // no batch while the engine was sent requests
	warnTopic                                             // a message on a topic no stream of its socket names
	numWarnKinds
)

// warner logs each kind of warning at most once per interval and counts the ones it held back.
// Safe for concurrent use.
type warner struct {
	log   *zap.Logger
	now   func() time.Time
	every time.Duration

	mu   sync.Mutex
	last [numWarnKinds]time.Time
	held [numWarnKinds]uint64
}

func newWarner(log *zap.Logger, o *Options) *warner {
	return &warner{log: log, now: o.Now, every: o.WarnInterval}
}

// allow reports whether a warning of kind k may be logged now, and how many were held back since
// the last one.
func (w *warner) allow(k warnKind) (held uint64, ok bool) {
	if !w.log.Core().Enabled(zap.WarnLevel) {
		return 0, false
	}
	now := w.now()
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.last[k].IsZero() && now.Sub(w.last[k]) < w.every {
		w.held[k]++
		return 0, false
	}
	held, w.last[k], w.held[k] = w.held[k], now, 0
	return held, true
}

// warn logs msg at Warn level with fields and the count held back, if kind k allows it.
func (w *warner) warn(k warnKind, msg string, fields ...zap.Field) {
	if held, ok := w.allow(k); ok {
		w.log.Warn(msg, append(fields, zap.Uint64("suppressed", held))...)
	}
}
