// Package loadsource reads engines' own load endpoints into a loadmon.Table: vLLM's Prometheus
// page (GET /metrics), SGLang's GET /get_load and GET /v1/loads. It holds one parser per format,
// each turning a response body into per-DP-rank loadmon.Report values, and a Poller that fetches
// every engine's endpoint on an interval (with a timeout and jitter) and records each successful
// poll in the table as one all-or-nothing batch. Each Format constant names the series or fields
// it reads and its upstream source.
//
// The rules are docs/design.md §13 and §6: a failed, malformed or timed-out poll records nothing,
// so the engine's load goes stale and then unknown, never zero; a rank missing from a page is not
// refreshed, so the engine becomes unknown by the all-ranks rule once that rank's last report is
// stale (at once if it never reported). Parsers reject missing, NaN, infinite, negative and
// non-integral counts with an error wrapping ErrMalformed.
//
// Package loadsource is not a metrics scraper: it keeps only the load figures routing reads and
// ignores every other series or field. It does not decide how many DP ranks an engine has: the
// host declares that with loadmon.Table.Expect (discovery), and the Poller only checks pages
// against it.
package loadsource
