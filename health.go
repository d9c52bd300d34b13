package enginepick

import (
	"slices"

	"go.uber.org/zap"

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

// CheckHealth looks for degraded state and warns about it through the logger, each message at most
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
// New runs it every WithHealthInterval; hosts may call it too. Apart from the silence rule, it
// reads shared state only.
func (r *Router) CheckHealth() {
	if r.kvSub != nil {
		r.kvSub.CheckSilence()
	}
	if r.load != nil {
		snap := r.load.Snapshot()
		var stale []string
		for _, id := range r.degraded.polled {
			if _, ok := snap.Load(id); !ok {
				stale = append(stale, string(id))
			}
		}
		if len(stale) > 0 {
			if ce := r.warn.Check(zap.WarnLevel, "load reports are stale or missing for polled engines: their load is unknown, so pressure comparisons fall back to in-flight counts and caps on reported metrics fail open"); ce != nil {
				ce.Write(zap.Strings("engines", stale), zap.Duration("freshness", r.load.Freshness()))
			}
		}
		var blind []string
		for _, m := range r.degraded.reportedCaps {
			engines := r.registry.Engines(m)
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
	if r.index != nil {
		if bad := r.index.Untrusted(); len(bad) > 0 {
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
