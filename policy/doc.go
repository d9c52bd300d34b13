// Package policy defines how one engine is chosen from one engine group's candidates: the Policy
// interface, the Request facts a policy may read, the Pick it returns, the error taxonomy the
// bucket loop branches on, and the concrete policies: RoundRobin, Random, PowerOfN, LeastLoad
// (least_load), CacheAware, SessionAware and Sticky.
//
// A policy owns its selection, its within-group fallback, its admission checks and its state
// dependencies, which it receives at construction in a Config (docs/design.md §1).
// It never chooses a bucket, crosses a PD role, or substitutes an engine after admission rejects
// the one it chose. The package does not filter candidates (bucket.EngineGroup hands a policy its
// exact candidates), does not keep load, prefix or affinity state (loadmon, kvindex and affinity do) and does not
// dispatch.
package policy
