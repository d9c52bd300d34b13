package metrics

import (
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/enginepick/enginepick/flowcontrol"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/state"
)

// flowOther labels the flows the configuration does not name: flows are host keys (tenants, API
// keys) of unbounded cardinality.
const flowOther = "other"

// flowMetrics are the flow-control families (flowcontrol.Observer).
type flowMetrics struct {
	queued   *prometheus.GaugeVec     // model_id, band
	wait     *prometheus.HistogramVec // model_id, band
	requests *prometheus.CounterVec   // model_id, band, flow, outcome
	named    atomic.Pointer[map[string]bool]
	bands    sync.Map // flowKey{model, band, ""} → *bandObs
	flows    sync.Map // flowKey → *flowObs
}

type flowKey struct {
	model state.ModelID
	band  int
	flow  string
}

// flowObs holds one model's, band's and flow's counters, in label.FlowOutcomes order.
type flowObs [len(label.FlowOutcomes)]prometheus.Counter

// bandObs holds one model's and band's pre-resolved series.
type bandObs struct {
	queued prometheus.Gauge
	wait   prometheus.Observer
}

func newFlowMetrics(ns string) *flowMetrics {
	return &flowMetrics{
		queued: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "flow_control_queued_requests",
			Help: "Requests waiting in the router's flow control, by model and band (the band's priority)."}, []string{"model_id", "band"}),
		wait: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: "flow_control_wait_seconds",
			Help:    "Time requests served after waiting spent in the flow-control queue, by model and band.",
			Buckets: requestSecondsBuckets}, []string{"model_id", "band"}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "flow_control_requests_total",
			Help: "Requests flow control queued or refused, by model, band, flow (a flow flow_control.flow_weights names, else other) and outcome: served, failed, displaced, expired or canceled after waiting; queue_full or sheddable without waiting."},
			[]string{"model_id", "band", "flow", "outcome"}),
	}
}

// band returns the model's and band's series.
func (f *flowMetrics) band(m state.ModelID, band int) *bandObs {
	k := flowKey{model: m, band: band}
	if v, ok := f.bands.Load(k); ok {
		return v.(*bandObs)
	}
	b := strconv.Itoa(band)
	v, _ := f.bands.LoadOrStore(k, &bandObs{queued: f.queued.WithLabelValues(string(m), b), wait: f.wait.WithLabelValues(string(m), b)})
	return v.(*bandObs)
}

// outcome returns the counter of an outcome of the model's, band's and flow's requests.
func (f *flowMetrics) outcome(m state.ModelID, band int, flow, outcome string) prometheus.Counter {
	if named := f.named.Load(); named == nil || !(*named)[flow] {
		flow = flowOther
	}
	k := flowKey{m, band, flow}
	v, ok := f.flows.Load(k)
	if !ok {
		var cs flowObs
		b := strconv.Itoa(band)
		for i, o := range label.FlowOutcomes {
			cs[i] = f.requests.WithLabelValues(string(m), b, flow, o)
		}
		v, _ = f.flows.LoadOrStore(k, &cs)
	}
	for i, o := range label.FlowOutcomes {
		if o == outcome {
			return v.(*flowObs)[i]
		}
	}
	return nil
}

// ObserveFlow implements flowcontrol.Observer: a request starting to wait raises the band's queue
// gauge and one leaving lowers it; each outcome is counted, and the wait of a request served
// after waiting observed.
func (p *observer) ObserveFlow(e flowcontrol.Event) {
	f := p.flow
	if e.Outcome == "" {
		f.band(e.Model, e.Band).queued.Inc()
		return
	}
	if e.Outcome != label.FlowQueueFull && e.Outcome != label.FlowSheddable { // it had waited
		b := f.band(e.Model, e.Band)
		b.queued.Dec()
		if e.Outcome == label.FlowServed {
			b.wait.Observe(e.Waited.Seconds())
		}
	}
	if c := f.outcome(e.Model, e.Band, e.Flow, e.Outcome); c != nil {
		c.Inc()
	}
}

// nameFlows sets the flows labelled by name: those the configuration gives a weight.
func (f *flowMetrics) nameFlows(weights map[string]float64) {
	named := make(map[string]bool, len(weights))
	for k := range weights {
		named[k] = true
	}
	f.named.Store(&named)
}
