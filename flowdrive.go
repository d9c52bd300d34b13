package enginepick

import (
	"context"
	"fmt"
	"time"

	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/flowcontrol"
	"github.com/enginepick/enginepick/internal/flowbridge"
)

// flowAttempt is one request's selection under flow control: each try is an attempt of
// flowcontrol.Controller.Wait (Router.selectFlow) or of a driven request (flowbridge.Select).
type flowAttempt struct {
	r       *Router
	ctx     context.Context
	req     *bucket.Request
	at      *time.Time
	buckets []*bucket.Bucket
	class   uint64 // classOf the request
	wake    bool   // arm the stale wake on a refusal by the detector

	d        *Dispatch
	last     error // the last refusal
	finished bool  // a try ended the wait
}

func (r *Router) newFlowAttempt(ctx context.Context, res *bucket.Resolver, req *bucket.Request, at *time.Time) *flowAttempt {
	buckets, _ := res.Resolve(req.Signals) // an error shows in the selection
	return &flowAttempt{r: r, ctx: ctx, req: req, at: at, buckets: buckets, class: classOf(buckets, req)}
}

// request is what the Controller knows of the request.
func (a *flowAttempt) request() flowcontrol.Request {
	return flowcontrol.Request{Model: a.req.Model, Priority: a.req.Priority, Flow: a.req.Flow,
		Cost: cost(a.req), Class: a.class}
}

// try is one attempt: refused (saturated) when the detector finds the fleet saturated for the
// request, with the request's class, or when the selection's *bucket.ExhaustedError holds an
// admission rejection, with a class of the buckets and the rejected engines (refusalClass);
// otherwise the selection's outcome, its dispatch in d.
func (a *flowAttempt) try() (bool, uint64, error) {
	if err := a.ctx.Err(); err != nil {
		return false, 0, err // the wait ended: with the last refusal, in result
	}
	if stale, ok := a.r.saturated(a.buckets, a.req.Model); ok {
		if a.wake {
			a.r.wakeWhenStale(stale)
		}
		a.last = errDetectorSaturated
		return true, a.class, nil
	}
	var err error
	if a.d, err = a.r.selectOnce(a.ctx, a.req, a.at); err != nil {
		if ex, ok := err.(*bucket.ExhaustedError); ok && len(ex.Rejections) > 0 {
			a.last = err
			return true, refusalClass(a.buckets, ex.Rejections), nil
		}
	}
	a.finished = true
	return false, 0, err
}

// result is the outcome of the wait that ended with err: the dispatch, or err with the last
// refusal, logged.
func (a *flowAttempt) result(err error) (*Dispatch, error) {
	if err != nil {
		if !a.finished && a.last != nil {
			err = fmt.Errorf("%w; last refusal: %w", err, a.last)
		}
		a.r.logFailure(a.req, err)
		return nil, err
	}
	return a.d, nil
}

func init() {
	flowbridge.Select = func(router any, ctx context.Context, req any, done func(any, error)) {
		router.(*Router).selectDriven(ctx, req.(*bucket.Request), done)
	}
	flowbridge.Controller = func(router any) (any, bool) {
		fc := router.(*Router).fc
		return fc, fc != nil
	}
}

// selectDriven is Select for a driven request (flowbridge.Select).
func (r *Router) selectDriven(ctx context.Context, req *bucket.Request, done func(any, error)) {
	finish := func(d *Dispatch, err error) {
		if d == nil {
			done(nil, err) // a nil interface, not a nil *Dispatch
			return
		}
		done(d, nil)
	}
	res, ok := (*bucket.Resolver)(nil), false
	if req != nil {
		res, ok = r.resolvers[req.Model]
	}
	if r.fc == nil || !ok {
		finish(r.selectFlow(ctx, req, nil))
		return
	}
	if ctx == nil {
		ctx = context.Background()
	}
	a := r.newFlowAttempt(ctx, res, req, nil)
	flowbridge.Submit(r.fc, a.request(), a.try, func(err error) { finish(a.result(err)) })
}
