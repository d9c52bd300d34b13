// Package enginepick decides which inference engine (a vLLM or SGLang server) serves each LLM
// request. A host keeps its own engine registry and HTTP transport; it builds a Router from
// per-model bucket resolvers, calls Router.Select for a complete selection (one plain engine, or a
// prefill + decode pair from one bucket), dispatches to the selected engines and releases the
// Dispatch when the response ends.
//
// The root package owns the Router: the model → resolver lookup (an unknown model is 404), the
// per-request prefix-lookup memo, the in-flight guards of a successful selection, and the removal
// of an engine's router-side state (RemoveEngine). The packages underneath can be used on their
// own: state (vocabulary and the registry interfaces), loadmon (engine load and in-flight
// counters), kvindex (the KV-block prefix index), affinity (session and sticky bindings, in memory
// or, through affinity/redisstore, in Redis), admission (per-engine caps), policy (the selection
// policies), and bucket (length buckets, engine groups and the bucket loop).
// docs/design.md states every routing rule; docs/performance.md the measured costs.
//
// enginepick is not a proxy or a gateway: it does not forward requests, retry them, tokenize
// prompts, run health checks, discover engines or decode engine event streams. The host does, and
// tells enginepick what it learned through the registry, loadmon.Table and kvindex.Index.
package enginepick
