// Package loadmon holds what enginepick knows about engine load. Start with NewTable, the
// engine-reported load (per engine and DP rank, with freshness and the all-ranks rule) a host
// feeds with Table.Report, and NewInFlight, the router-local in-flight counters and their dispatch
// guards. Policies read a Table through its immutable per-pick Snapshot and compare engines with
// Observe and ComparePressure.
//
// The rules are docs/design.md §6:
// missing, stale or rank-incomplete reports are unknown, never zero; a snapshot is taken once per
// pick and reused by that pick's admission; in-flight guards are acquired at dispatch and released
// idempotently, safely across engine removal and re-adding.
//
// Package loadmon does not poll or subscribe to engines: the host, or the subpackage
// loadmon/loadsource (which polls vLLM's and SGLang's load endpoints, docs/design.md §13.2), feeds
// reports into a Table. It does not rank engines either; policies do, with the comparisons here.
package loadmon
