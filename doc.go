// Package enginepick decides which inference engine (a vLLM or SGLang server) serves each LLM
// request. A host keeps its own engine registry and HTTP transport; it builds a Router from
// per-model bucket resolvers (NewRouter), calls Router.Select for a complete selection (one plain
// engine, or a prefill + decode pair from one bucket), dispatches to the selected engines and
// releases the Dispatch when the response ends.
//
// Start with package config to build a Router from a YAML or JSON file; it also runs what keeps
// the Router's state current (load pollers, KV-event subscribers, health checks). Use NewRouter
// directly to assemble the routing packages in code.
//
// This package is the runtime only: the Router (the model → resolver lookup, where an unknown
// model is 404; the per-request prefix-lookup memo; the in-flight guards of a successful
// selection; the removal of an engine's router-side state) and the Observer hooks. The packages
// underneath can be used on their own: state (vocabulary and the registry interfaces), loadmon
// (engine load and in-flight counters), kvindex (the KV-block prefix index), affinity (session and
// sticky bindings, in memory or, through affinity/redisstore, in Redis), admission (per-engine
// caps), policy (the selection policies) and bucket (length buckets, engine groups and the bucket
// loop). docs/design.md states every routing rule.
//
// It starts no goroutine, parses no file, runs no health check and decodes no engine event stream;
// package config, loadmon/loadsource and kvindex/kvevents do. enginepick is not a proxy or a
// gateway either: it does not forward requests, retry them, tokenize prompts or discover engines.
package enginepick
