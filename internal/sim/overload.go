package sim

import "time"

// OverloadWindow is the fraction of the arrival span, at its end, whose backlog Overload compares
// with the backlog over the whole span: the last 10 %.
const OverloadWindow = 0.1

// backlogWindow accumulates backlog samples.
type backlogWindow struct {
	sum, n int64
}

func (w *backlogWindow) add(v int) { w.sum += int64(v); w.n++ }

func (w *backlogWindow) mean() float64 {
	if w.n == 0 {
		return 0
	}
	return float64(w.sum) / float64(w.n)
}

// sampleBacklog records the backlog at a load-report tick inside the arrival span.
func (r *run) sampleBacklog() {
	first, last := r.reqs[0].arrival, r.reqs[len(r.reqs)-1].arrival
	if r.now < first || r.now > last {
		return
	}
	r.backlogAll.add(r.backlog)
	if r.now >= first+time.Duration((1-OverloadWindow)*float64(last-first)) {
		r.backlogEnd.add(r.backlog)
	}
}

// Thresholds of the overload criterion (see Overload).
const (
	// OverloadGrowth is how much larger the backlog over the last OverloadWindow of the arrival
	// span must be than over the whole span: 1.25, a quarter larger. A fleet that keeps up holds
	// a steady backlog (ratio about 1); one that does not accumulates a backlog growing roughly
	// linearly, whose last-10 % mean is nearly twice its whole-span mean.
	OverloadGrowth = 1.25
	// OverloadBacklogPerEngine is the backlog, in requests per plain (PD: prefill) engine, over the
	// last OverloadWindow of the arrival span from which a growing backlog counts: 4, so that a
	// few requests in prefill on a lightly loaded fleet never count, however they fluctuate.
	OverloadBacklogPerEngine = 4.0
)

// Overload tells whether a policy run kept up with the trace. The backlog is the number of
// requests arrived that have not had their first token yet (waiting under flow control, queued
// or prefilling; PD: until their KV reached the decode engine), sampled at every load report
// (Config.ReportInterval of virtual time) from the first to the last arrival.
//
// A run is overloaded when, over the last OverloadWindow (10 %) of the arrival span, the mean
// backlog is at least OverloadGrowth (1.25) times its mean over the whole span and at least
// OverloadBacklogPerEngine (4) requests per plain (PD: prefill) engine: queues were still growing
// when the trace ended, so the fleet could not keep up and the TTFT figures measure queueing
// behind that backlog more than routing. Requests rejected by admission never join the backlog:
// an overloaded fleet with caps shows as rejections instead. A span with no report inside its last
// 10 % (under about 10 report intervals long) is never overloaded.
type Overload struct {
	// MeanBacklog is the mean backlog over the arrival span, in requests.
	MeanBacklog float64 `json:"mean_backlog"`
	// EndBacklog is the mean backlog over the last OverloadWindow of the arrival span, in requests.
	EndBacklog float64 `json:"end_backlog"`
	// Overloaded applies the criterion above.
	Overloaded bool `json:"overloaded"`
}

// overload applies the criterion to a finished run.
func (r *run) overload() Overload {
	o := Overload{MeanBacklog: r.backlogAll.mean(), EndBacklog: r.backlogEnd.mean()}
	o.Overloaded = r.backlogEnd.n > 0 && o.EndBacklog >= OverloadGrowth*o.MeanBacklog &&
		o.EndBacklog >= OverloadBacklogPerEngine*float64(len(r.front))
	return o
}
