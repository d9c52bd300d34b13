package config

import (
	"slices"

	"go.uber.org/zap"

	"github.com/enginepick/enginepick/kvindex/kvevents"
	"github.com/enginepick/enginepick/loadmon/loadsource"
	"github.com/enginepick/enginepick/state"
)

// degradedChecks is what CheckHealth watches, fixed by New.
type degradedChecks struct {
	// polled are the engines with a load endpoint, whose load is expected to stay fresh.
	polled []state.EngineID
	// reportedCaps are the models with a policy that reads reported load: an admission cap on a
	// reported metric, or a cache-aware queue gate. Sorted, unique.
	reportedCaps []state.ModelID
}

// checkHealth looks for degraded state and warns about it through the logger, each message at most
// once per warn interval (docs/design.md §15):
//
//   - engines with a load endpoint whose load is unknown (stale, missing or rank-incomplete);
//   - models whose policies read reported load (caps on reported metrics, a queue gate) while no
//     engine of the model has a fresh report: the caps fail open and the gate is inert;
//   - engines the KV-block index does not trust (a KV-event stream lost its place, or fell silent
//     while the engine was sent requests), whose blocks cache-aware lookups ignore until they
//     resynchronise.
//
// It first applies the KV-event subscriber's silence rule (kvevents.Subscriber.CheckSilence).
// New runs it every WithHealthInterval. Apart from the silence rule, it reads shared state only.
func (r *Router) checkHealth() {
	if r.kvSub != nil {
		r.kvSub.CheckSilence()
	}
	if load := r.LoadTable(); load != nil {
		snap := load.Snapshot()
		var stale []string
		for _, id := range r.degraded.polled {
			if _, ok := snap.Load(id); !ok {
				stale = append(stale, string(id))
			}
		}
		if len(stale) > 0 {
			if ce := r.warn.Check(zap.WarnLevel, "load reports are stale or missing for polled engines: their load is unknown, so pressure comparisons fall back to in-flight counts and caps on reported metrics fail open"); ce != nil {
				ce.Write(zap.Strings("engines", stale), zap.Duration("freshness", load.Freshness()))
			}
		}
		var blind []string
		for _, m := range r.degraded.reportedCaps {
			engines := r.Registry().Engines(m)
			if len(engines) == 0 || slices.ContainsFunc(engines, func(e state.Engine) bool {
				_, ok := snap.Load(e.ID())
				return ok
			}) {
				continue
			}
			blind = append(blind, string(m))
		}
		if len(blind) > 0 {
			if ce := r.warn.Check(zap.WarnLevel, "no engine has a fresh load report, but admission caps on reported metrics or a queue gate are configured: the caps fail open and the queue gate is inert"); ce != nil {
				ce.Write(zap.Strings("models", blind))
			}
		}
	}
	if x := r.Index(); x != nil {
		if bad := x.Stats().Untrusted; len(bad) > 0 {
			ids := make([]string, len(bad))
			for i, id := range bad {
				ids[i] = string(id)
			}
			if ce := r.warn.Check(zap.WarnLevel, "the KV-block index does not trust some engines (their KV-event stream lost its place or fell silent): cache-aware lookups ignore their blocks until they resynchronise"); ce != nil {
				ce.Write(zap.Strings("engines", ids))
			}
		}
	}
}

// RemoveEngine drops the engine's KV-event streams, then forgets its router-side state as
// enginepick.Router.RemoveEngine does.
func (r *Router) RemoveEngine(id state.EngineID) {
	if r.kvSub != nil {
		r.kvSub.Remove(id)
	}
	r.Router.RemoveEngine(id)
}

// Close stops every service New started (load poller, KV-event subscriber, the in-memory affinity
// store's sweeper, degraded-state checks, the sharing with router replicas) and waits for their
// goroutines to exit. The Router keeps selecting with the state it has: loads go stale (unknown,
// never zero), and peers' dispatches no longer change. Close is idempotent and returns nil.
func (r *Router) Close() error {
	if r.svc == nil {
		return nil
	}
	r.svc.once.Do(func() {
		r.svc.cancel()
		if r.kvSub != nil {
			_ = r.kvSub.Close()
		}
		r.svc.wg.Wait()
		if r.share != nil {
			r.share.Close()
		}
		if r.ownClient != nil {
			r.ownClient.CloseIdleConnections()
		}
	})
	return nil
}

// Config returns the configuration the Router was built from (the *Config passed to New, never
// nil). Do not modify it.
func (r *Router) Config() *Config { return r.config }

// KVEventStats returns the counters of the KV-event subscriber (gaps, resynchronisations, drops,
// refused events, unknown topics, silence, trust, per engine and DP rank; docs/design.md §13.1);
// empty when no engine has a kv_events publisher.
func (r *Router) KVEventStats() kvevents.Stats {
	if r.kvSub == nil {
		return kvevents.Stats{}
	}
	return r.kvSub.Stats()
}

// kvStreams counts the KV-event streams followed.
func (r *Router) kvStreams() int {
	if r.kvSub == nil {
		return 0
	}
	return len(r.kvSub.Stats().Streams)
}

// LoadPollStats returns the counters of the load poller, one entry per engine with a load
// endpoint; nil when there is none.
func (r *Router) LoadPollStats() []loadsource.TargetStats {
	if r.poller == nil {
		return nil
	}
	return r.poller.Stats()
}
