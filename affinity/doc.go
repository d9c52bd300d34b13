// Package affinity holds scoped affinity bindings: which engine a session or a routing key is
// bound to, within one (model, bucket, stage) scope, with idle expiry, engine invalidation and the
// atomic first-bind and replace that router replicas need to agree (docs/design.md §12).
//
// Start with NewMemoryStore for one router process (run its Run method for the sweep, and set
// Options.MaxBindings when session or routing keys come from untrusted clients), or
// affinity/redisstore for router replicas; give the store to policy.NewSessionAware or
// policy.NewSticky.
//
// A binding records a preferred placement, not a successful execution, and the store decides
// nothing: policy.NewSessionAware and policy.NewSticky decide when a binding is reused, created or
// replaced, and only after admission passed. The store never sees candidates, load or admission.
//
// Two implementations satisfy [Store]: [MemoryStore], for one router process (its expiry order is
// a google/btree, so a sweep touches only expired bindings), and affinity/redisstore, for several
// router replicas sharing bindings through Redis or Redis Cluster. The conformance suite in
// affinity/affinitytest runs against both, and against a host's own Store.
//
// It is not a cache of engine state, a session store for request bodies or conversation history,
// nor a load balancer: it maps a scope to an engine ID and nothing else.
package affinity
