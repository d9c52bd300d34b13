// Package metrics exports what an enginepick Router decides, what became of its dispatches and
// the state its policies share, as Prometheus metrics on github.com/prometheus/client_golang
// (docs/design.md §15). New builds the enginepick.Observer on the host's prometheus.Registerer;
// pass it to config.New with config.WithObserver.
//
// Every label value is bounded: configured model, bucket and engine IDs, stage and policy names,
// reason and decision labels, admission limit names; never a per-request value. An unknown model
// is labelled with the empty model_id.
//
// The package is separate so that hosts that do not use Prometheus link none of it. It is not a
// metrics framework: it knows enginepick's events and nothing else, and registers nothing
// globally.
package metrics
