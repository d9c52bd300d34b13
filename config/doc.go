// Package config builds an enginepick.Router from a strict YAML or JSON configuration and runs
// what keeps its shared state current. Load or Parse reads a Config (unknown fields and invalid
// values are an *Error naming the field's path and line); New validates it against the host's
// registry, builds the state the policies share once, builds each group's policy through its
// policy.Builder (the type's own options block), and starts the load poller, the KV-event
// subscriber, the in-memory affinity store's sweeper and the degraded-state checks, which
// Router.Close stops (docs/design.md §14).
//
// Hosts that assemble buckets and policies in code use enginepick.NewRouter instead and link none
// of this package's dependencies (ZMQ, msgpack, the Prometheus text parser).
package config
