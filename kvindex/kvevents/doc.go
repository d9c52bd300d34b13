// Package kvevents feeds a kvindex.Index from vLLM's and SGLang's KV-cache events.
//
// Start with New (the Index to feed), Add one Endpoint per engine DP rank (its ZMQ address and
// topic, and its replay address when the engine has one), then Start; Stats and the host's
// metrics show each stream's state. Engines publish events when started with KV events enabled
// (vLLM --kv-events-config, SGLang --kv-events-config).
//
// A Subscriber follows the ZMQ publishers and applies each (engine, DP rank) stream to the index
// in order. It decodes the message framing [topic, sequence, msgpack payload] and the payload in
// every encoding the engines have published (tagged arrays of any length and tagged maps; signed,
// unsigned and bytes block hashes), dials or binds per endpoint, reconnects with
// backoff, detects gaps and publisher restarts by sequence number, refills gaps from the
// publisher's replay socket or clears the rank, bounds each stream's queue, and marks an engine
// untrusted in the index (kvindex.Stats.Untrusted) while its view may be torn or its
// publisher is silent while the engine is sent requests. Every failure is counted
// (Subscriber.Stats) and warned about at a bounded rate. The recovery rules are docs/design.md
// §13.1.
//
// It does not reproduce engine block hashes (the index keys blocks by their token IDs, which
// BlockStored events carry), does not poll engine load (package loadmon), and does not discover
// engines: the host adds and removes endpoints.
//
// Costs are in docs/performance.md ("kvindex/kvevents").
//
// # Wire format
//
// The sources are vllm-project/vllm vllm/distributed/kv_events.py and sgl-project/sglang
// python/sglang/srt/disaggregation/kv_events.py. Each DP rank publishes on a ZMQ PUB socket, by
// default on the base port + rank; ranks run as separate servers list their own publisher, replay
// socket and topic, and with Endpoint.RankStart S the stream of rank r expects batches of global
// rank S + r. A message is three frames: topic, an 8-byte big-endian sequence number and a msgpack
// payload (else ErrFrames). A lost connection is redialled with backoff from Options.ReconnectMin
// to ReconnectMax (100 ms to 5 s).
//
// Both engines' payloads decode to BlockStored (applied with Index.Store), BlockRemoved (Remove)
// and AllBlocksCleared (Clear). Unknown fields and event types, KV-cache groups other than the
// full-attention group 0, and placeholders without tokens are skipped, filtered as
// ai-dynamo/dynamo lib/kv-router/src/zmq_wire.rs does. A malformed batch is ErrPayload before
// anything applies. Options.Media maps the event's medium to a tier (an unknown medium: a store is
// refused, a removal covers every tier); a BlockStored's LoRA adapter (lora_name, else lora_id
// through Options.AdapterNames) keys its blocks under the adapter; a foreign block_size or a
// lora_id without a name refuses the event (Options.OnError) and the rest of the batch applies.
package kvevents
