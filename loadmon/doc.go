// Package loadmon holds what enginepick knows about engine load: the engine-reported load table
// (per engine and DP rank, with freshness and the all-ranks rule), the immutable per-pick Snapshot,
// the router-local in-flight counters and their dispatch guards, and the stage pressure
// comparisons the load-aware policies share.
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
