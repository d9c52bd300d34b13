// Package flowcontrol queues requests in the router while the fleet is saturated, and hands the
// capacity that frees up to them in order: priority bands first, fair shares between flows
// within a band, first come first served within a flow (docs/design.md §17).
//
// Start with New and pass the Controller to enginepick.Options.FlowControl: Router.Select then
// waits instead of failing with 503 when admission rejects every candidate or the saturation
// detector (Controller.Saturated) finds every candidate engine at its thresholds, and resumes when
// a dispatch ends or a load report arrives. With two or more bands, a request below the top band
// also leaves the last slot of an engine's in-flight cap (of 2 or more) to the top band, and
// avoids an engine still prefilling a request of the Router until its first token. Hosts set
// bucket.Request.Priority and Flow per request; a wait ends with the dispatch, the caller's
// context error, ErrTimeout (a band's TTL) or a *RejectedError (queue full, displaced,
// sheddable), which bucket.StatusCode maps to 499/504, 503 and 429.
//
// Controller.Wait and Notify are the mechanism underneath, for hosts that run bucket.Select
// themselves. The queue's structure follows llm-d's flow controller (priority bands, then flows,
// then requests: llm-d/llm-d-inference-scheduler `pkg/epp/flowcontrol/controller/controller.go`);
// waiting costs no CPU: a waiting request is its caller's goroutine, blocked on a channel.
package flowcontrol
