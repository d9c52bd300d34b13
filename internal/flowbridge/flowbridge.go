// Package flowbridge gives the module's own packages a driven form of flow control: the
// Controller's queue run by its caller's event loop instead of blocked goroutines, so that the
// replay (package internal/sim) runs the library's flow control in virtual time on one goroutine.
// It is not part of any package's API.
//
// A driven request waits as one that called flowcontrol.Controller.Wait, in the same queue and
// order, but holds no goroutine: its attempts run when the driver calls Drive, and its end is a
// callback. One goroutine drives a Controller; the Controller's Notify then only marks the queue
// for the next Drive. Blocking and driven requests should not share a model's queue: a blocked
// request's turn is its own goroutine's, a driven one's waits for Drive.
//
// Package flowcontrol sets Submit, Drive and SetClock, and package enginepick Select and
// Controller, when they are initialised, so they are never nil once those packages are imported.
// This package cannot name their types (they import it): c is always a *flowcontrol.Controller, r
// a flowcontrol.Request, router an *enginepick.Router, req a *bucket.Request and d an
// *enginepick.Dispatch; anything else panics.
package flowbridge

import (
	"context"
	"time"

	"github.com/enginepick/enginepick/state"
)

var (
	// BelowTop reports whether a request of the priority waits in a band of c below its highest:
	// false with a single band.
	BelowTop func(c any, priority int) bool

	// Submit is c.Wait(ctx, r, attempt) for a driven request, without a context: the first
	// attempt runs at once, as in Wait; when the request has to wait, later attempts run in Drive.
	// done is called once with what Wait would return (nil: served), from Submit or from Drive.
	// A band's TTL is measured on the Controller's clock (SetClock) and ends the wait at the first
	// Drive at or after the deadline.
	Submit func(c any, r any, attempt func() (saturated bool, class uint64, err error), done func(error))

	// Drive runs the model's waiting driven requests until none is eligible: it first ends those
	// whose band's TTL has passed, then runs the turns Notify and the attempts before it granted,
	// in the queue's order, each with its attempt on the calling goroutine, and calls the done of
	// every request that left (served, refused for good, displaced, timed out).
	Drive func(c any, model state.ModelID)

	// SetClock replaces c's clock (time.Now): attained service decays, and Retry-After hints and
	// driven requests' deadlines are measured, on it. Call it before any request.
	SetClock func(c any, now func() time.Time)

	// Select is router.Select(ctx, req) for a driven request under the router's flow control:
	// done receives the dispatch (d nil on an error) or the error Select would return, once, from
	// Select or from a later Drive of the router's Controller. req must not change until then.
	// The router's Observer is not called, and a refusal on reports that later go stale arms no
	// timer: the driver's next load report wakes the queue. Without flow control, done is called
	// before Select returns.
	Select func(router any, ctx context.Context, req any, done func(d any, err error))

	// Controller returns router's flow control (enginepick.Options.FlowControl, as a
	// *flowcontrol.Controller), and false when it has none.
	Controller func(router any) (c any, ok bool)
)

// LimitPrefilling is the Limit of the rejection of an engine that still prefills a dispatch of
// the router, for a request flow control holds off such engines (WithPrefillHold).
const LimitPrefilling = "prefilling"

// LimitTopBandSlot is the Limit of the rejection of an engine whose in-flight requests (Observed)
// leave only its cap's (Cap) last slot, the top band's, for a request below the top band
// (HeldCap).
const LimitTopBandSlot = "top_band_slot"

type prefillHoldKey struct{}

// WithPrefillHold returns ctx marked for a selection whose request flow control holds off engines
// still prefilling a dispatch of the router (a request below the top band, docs/design.md §17), so
// that a policy that reads the mark (PrefillHold) refuses those engines as admission would.
func WithPrefillHold(ctx context.Context) context.Context {
	return context.WithValue(ctx, prefillHoldKey{}, true)
}

// HeldCap is the in-flight cap a request below flow control's top band (WithPrefillHold) is held
// to on an engine whose cap is n: n − 1 when n ≥ 2, the last slot being left to the top band
// (docs/design.md §17); n otherwise.
func HeldCap(n uint64) uint64 {
	if n >= 2 {
		return n - 1
	}
	return n
}

// PrefillHold reports whether ctx carries WithPrefillHold's mark; false for a nil ctx.
func PrefillHold(ctx context.Context) bool {
	if ctx == nil {
		return false
	}
	held, _ := ctx.Value(prefillHoldKey{}).(bool)
	return held
}
