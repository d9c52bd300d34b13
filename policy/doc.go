// Package policy defines how one engine is chosen from one engine group's candidates: the Policy
// interface, the Request facts a policy may read, the Pick it returns, the error taxonomy the
// bucket loop branches on, and the concrete policies: RoundRobin, Random, PowerOfN, LeastLoad
// (least_load), CacheAware, SessionAware and Sticky.
//
// A policy owns its selection, its within-group fallback, its admission checks and its state
// dependencies, which it receives at construction in a Config (docs/design.md §1).
//
// Every policy type has a Builder, which names it in the configuration, owns its options block
// (decoding and validation) and builds it from the state a Router shares (Env). The built-in types
// are registered; a host adds its own with Register and names it in the configuration like a
// built-in one (ExampleRegister; docs/design.md §14.2).
// It never chooses a bucket, crosses a PD role, or substitutes an engine after admission rejects
// the one it chose. The package does not filter candidates (bucket.EngineGroup hands a policy its
// exact candidates), does not keep load, prefix or affinity state (loadmon, kvindex and affinity do) and does not
// dispatch.
package policy
