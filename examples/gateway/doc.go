// Command gateway is an OpenAI-compatible HTTP gateway that routes requests to vLLM and SGLang
// engines with an enginepick.Router: POST /v1/chat/completions and /v1/completions (streams
// relayed as they arrive), plain and PD (prefill/decode) engines, load polled from the engines'
// own endpoints, GET /metrics, GET /healthz and GET /debug/kv (the prefix index and KV-event
// streams, as JSON). Run
//
//	go run ./examples/gateway --engine url=http://127.0.0.1:8000,model=llama,kind=vllm
//
// and see --help for every flag, or give the engines in a YAML file with --engines-file, or run it
// from a routing configuration file (the files under examples/configs, which examples/replay
// -config replays too) with --config.
//
// # Choices
//
// The prompt is tokenized through an engine's POST /tokenize (else its length is taken as body
// bytes ÷ 4, without token IDs, so cache-aware groups route it by load). PD legs share one
// bootstrap_room and are sent concurrently, the prefill leg detached from the client; each leg's
// in-flight guard is released when it ends (Dispatch.ReleaseStage), the dispatch with
// Dispatch.Done when both have. A circuit breaker per engine counts only failures the engine
// alone causes (a refused connection, failed health probes).
//
// With a flow_control block in the --config file (docs/design.md §17), a request the engines
// cannot take waits in the gateway until a dispatch ends, and the client leaving ends the wait.
// Its band is the integer header x-enginepick-priority (absent: 0); its flow, the fairness key,
// the header x-enginepick-flow, else the body's OpenAI "user" field. A rejection (queue full,
// displaced, sheddable band) is a 429 with Retry-After in whole seconds, rounded up; a band's ttl
// ending the wait is a 503. With --engine-priority the band, negated, goes to vLLM engines as the
// body's "priority" field, for engines run with --scheduling-policy priority (lower values first).
//
// With models[].adapters in the --config file (docs/design.md §18), a request whose "model" is a
// LoRA adapter is routed on its base model's buckets for the adapter and forwarded unchanged;
// GET /v1/models lists each adapter with its base model as parent.
package main
