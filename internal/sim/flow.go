package sim

import (
	"fmt"
	"slices"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/flowcontrol"
	"github.com/enginepick/enginepick/internal/flowbridge"
)

// resolveFlowControl validates Config.FlowControl and sets rc.flowControl, Bands and Weight filled.
func (rc *resolved) resolveFlowControl() error {
	if rc.FlowControl == nil {
		return nil
	}
	if rc.routing != nil {
		return &configError{msg: "sim: Config.FlowControl with Config.Routing: the file's flow_control block configures flow control",
			errs: []error{ErrRoutingConflict}}
	}
	cfg := *rc.FlowControl
	if cfg.Bands == nil {
		var prios []int
		for i := range rc.requests {
			prios = append(prios, rc.requests[i].Priority)
		}
		slices.Sort(prios)
		for _, p := range slices.Compact(prios) {
			cfg.Bands = append(cfg.Bands, flowcontrol.Band{Priority: p})
		}
	}
	if cfg.Weight == nil && len(rc.Trace.Tenants) > 0 {
		weights := map[string]float64{}
		for _, t := range rc.Trace.Tenants {
			weights[t.Name] = t.Weight
		}
		cfg.Weight = func(flow string) float64 { return weights[flow] } // 0 (not listed) means 1
	}
	if _, err := flowcontrol.New(cfg); err != nil {
		return wrapf(err, "Config.FlowControl")
	}
	rc.flowControl = &cfg
	return nil
}

// flowControlled reports whether the routers run flow control: Config.FlowControl, or a Routing
// file's flow_control block.
func (rc *resolved) flowControlled() bool {
	return rc.flowControl != nil || (rc.routing != nil && rc.routing.cfg.FlowControl != nil)
}

// newController builds a replica's flow-control Controller on the run's virtual clock.
func (r *run) newController() (*flowcontrol.Controller, error) {
	fc, err := flowcontrol.New(*r.rc.flowControl)
	if err != nil {
		return nil, err
	}
	flowbridge.SetClock(fc, r.clock)
	return fc, nil
}

// selectFlow routes request q under its replica's flow control: the selection's end, at once or
// when a later drive serves the request, goes to routed.
func (r *run) selectFlow(q *reqState, req *bucket.Request) {
	flowbridge.Select(q.replica.router, r.ctx, req, func(d any, err error) {
		if q.routed {
			r.fail(fmt.Errorf("sim: request %d routed twice (simulator bug)", q.pos))
			return
		}
		q.routed = true
		dispatch, _ := d.(*enginepick.Dispatch)
		if err := r.routed(q, dispatch, err); err != nil {
			r.fail(err)
		}
	})
}

// drive runs every replica's waiting requests whose turn has come (flowbridge.Drive): after each
// event, so that capacity an event freed goes to the queue at the event's time.
func (r *run) drive() error {
	for _, rep := range r.replicas {
		flowbridge.Drive(rep.fc, r.model)
	}
	return r.err
}

// fail records the first error of a callback, which the event loop returns.
func (r *run) fail(err error) {
	if r.err == nil {
		r.err = err
	}
}
