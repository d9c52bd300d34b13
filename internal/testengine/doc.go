// Package testengine is an in-process stand-in for a vLLM server, for end-to-end tests of the
// router and the example gateway and for trying the gateway without GPUs. It serves over real
// sockets on 127.0.0.1 what a vLLM OpenAI server serves: POST /v1/completions and
// /v1/chat/completions (JSON or server-sent events, with usage and the prefix cache's cached
// tokens), GET /v1/models, POST /tokenize, GET /health, GET /metrics in vLLM's Prometheus names,
// POST /sleep and /wake_up; and it publishes its KV-cache events over ZMQ as vLLM's
// ZmqEventPublisher does, with a replay socket.
//
// Behind the endpoints each data-parallel rank runs a small model of vLLM's scheduler and block
// pool: a running-request cap with a waiting queue in FIFO or priority order (vLLM's
// --scheduling-policy and the request's priority field), prefill time per uncached prompt token
// and decode time per output token, and a prefix cache of full KV blocks with chained hashes and
// vLLM's eviction order. Everything but the clock is deterministic: the tokenizer, the chat
// template, the generated text and the block hashes are pure functions of their input.
//
// It is not a model: the generated words are drawn from a fixed list. It is not a benchmark
// either: the timings are configured, not measured.
package testengine
