// Package gw is the HTTP side of the example gateway: the engine registry the Router reads (with a
// small circuit breaker per engine and a health prober that checks an engine after a failure its
// request could have caused and closes an open breaker again), prompt tokenization through the
// engines' /tokenize endpoint with a body-size estimate as fallback, and the OpenAI-compatible
// handler that selects engines with an enginepick.Router and relays the engine's response,
// including server-sent-event streams and PD (prefill/decode) dispatch.
//
// It is an example's internal package: its API serves examples/gateway and its tests, not other
// modules. The rules it applies are docs/design.md §1 (request flow), §3 (PD), §13.2 (load
// sources) and §16 (errors and HTTP status).
package gw
