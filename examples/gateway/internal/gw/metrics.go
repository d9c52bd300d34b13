package gw

import (
	"net/http"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// Metrics are the gateway's Prometheus series, on a registry of their own (no global state).
type Metrics struct {
	reg               *prometheus.Registry
	requests          *prometheus.CounterVec
	selectionFailures *prometheus.CounterVec
	dispatches        *prometheus.CounterVec
	upstreamFailures  *prometheus.CounterVec
	estimated         prometheus.Counter
}

// NewMetrics registers the gateway's series, and per engine of registry a health gauge, a breaker
// counter and probe counters, on reg.
func NewMetrics(reg *prometheus.Registry, registry *Registry) *Metrics {
	m := &Metrics{
		reg: reg,
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "gateway_requests_total",
			Help: "Inference requests by path and final HTTP status."}, []string{"path", "code"}),
		selectionFailures: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "gateway_selection_failures_total",
			Help: "Requests the Router could not place, by the status returned (bucket.StatusCode)."}, []string{"code"}),
		dispatches: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "gateway_dispatches_total",
			Help: "Requests sent to an engine, by stage, engine and the policy's reason label."}, []string{"stage", "engine", "reason"}),
		upstreamFailures: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "gateway_upstream_failures_total",
			Help: "Engine exchanges that failed, by engine and kind (connection, body_refused, timeout, no_answer, server_error, cut)."}, []string{"engine", "kind"}),
		estimated: prometheus.NewCounter(prometheus.CounterOpts{Name: "gateway_estimated_prompts_total",
			Help: "Prompts whose length was estimated from the body size because tokenization was unavailable."}),
	}
	reg.MustRegister(m.requests, m.selectionFailures, m.dispatches, m.upstreamFailures, m.estimated)
	for _, e := range registry.All() {
		labels := prometheus.Labels{"engine": string(e.ID())}
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "gateway_engine_healthy",
			Help: "1 when the engine's circuit breaker is closed.", ConstLabels: labels}, func() float64 {
			if e.Healthy() {
				return 1
			}
			return 0
		}))
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "gateway_breaker_opens_total",
			Help: "Times the engine's circuit breaker opened.", ConstLabels: labels}, func() float64 { return float64(e.Opens()) }))
		for _, result := range []string{"ok", "failed"} {
			reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "gateway_engine_probes_total",
				Help:        "Health probes of the engine that ended, by result (ok: answered 200).",
				ConstLabels: prometheus.Labels{"engine": string(e.ID()), "result": result}}, func() float64 {
				ok, failed := e.Probes()
				if result == "ok" {
					return float64(ok)
				}
				return float64(failed)
			}))
		}
	}
	return m
}

// Registry returns the Prometheus registry the metrics are on.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// Handler serves the registry in the Prometheus text format.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg})
}

func (m *Metrics) request(path string, code int) {
	if m != nil {
		m.requests.WithLabelValues(path, strconv.Itoa(code)).Inc()
	}
}

func (m *Metrics) selectionFailure(code int) {
	if m != nil {
		m.selectionFailures.WithLabelValues(strconv.Itoa(code)).Inc()
	}
}

func (m *Metrics) dispatch(stage state.Stage, p policy.Pick) {
	if m != nil {
		m.dispatches.WithLabelValues(stage.String(), string(p.Engine.ID()), p.Reason).Inc()
	}
}

func (m *Metrics) upstreamFailure(e *Engine, kind string) {
	if m != nil {
		m.upstreamFailures.WithLabelValues(string(e.ID()), kind).Inc()
	}
}

func (m *Metrics) estimate() {
	if m != nil {
		m.estimated.Inc()
	}
}
