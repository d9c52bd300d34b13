// Package enginepick decides which inference engine (a vLLM or SGLang server) serves each LLM
// request. A host keeps its own worker registry and HTTP transport; it builds a Router from
// per-model bucket resolvers, calls Router.Select for a complete selection (one plain engine, or a
// prefill + decode pair from one bucket), dispatches to the selected engines and releases the
// Dispatch when the response ends.
//
// The packages underneath can be used on their own: state (vocabulary and the registry
// interfaces), loadmon (engine load and in-flight counters), kvindex (the KV-block prefix index),
// admission (per-engine caps), policy (the selection policies), and bucket (length buckets, engine
// groups and the bucket loop). docs/design.md explains every routing rule.
//
// enginepick does not forward requests, tokenize, run health checks or discover engines.
package enginepick
