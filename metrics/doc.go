// Package metrics exports what an enginepick Router decides, what became of its dispatches and
// the state its policies share, as Prometheus metrics on github.com/prometheus/client_golang
// (docs/design.md §15). New builds the enginepick.Observer on the host's prometheus.Registerer;
// pass it to config.New with config.WithObserver.
//
// Every label value is bounded: configured model, bucket and engine IDs, stage and policy names,
// reason and decision labels, admission limit names, band priorities and configured flow names;
// never a per-request value. An unknown model is labelled with the empty model_id.
//
// # Metrics
//
// Names omit the enginepick_ prefix (Options.Namespace); labels are in parentheses. Counters end
// in _total; selection_duration_seconds, ttft_seconds, request_duration_seconds and the two
// _overlap_blocks series are histograms; the rest are gauges.
//
// Decisions, from the Observer:
//   - decisions_total (model_id, bucket, stage, policy, reason): which rule picked each engine
//     (the reasons: docs/design.md §15).
//   - selections_total (model_id, bucket): complete selections; selection_failures_total
//     (model_id, reason): failed ones, by enginepick.FailureReason (docs/design.md §15.1).
//   - selection_duration_seconds (model_id): 1 µs to 16 ms, ×4 per bucket; one selection in
//     Options.SelectTimingEvery (8 by default) is timed.
//   - cache_aware_decisions_total (model_id, decision): the cache-aware policy's hits, misses and
//     diversions (docs/design.md §9.8); it sums to decisions_total{policy="cache_aware"}.
//   - diverted_overlap_blocks, partially_diverted_overlap_blocks (model_id): the DivertedBlocks
//     of cache_worker_queued decisions and the ForfeitedBlocks of cache_hit ones.
//   - queue_gate_rejections_total, pressure_guard_overrides_total (model_id): the queue gate and
//     the pressure guard at work.
//   - admission_rejections_total (model_id, stage, limit): which cap rejects; "other" for a custom
//     admission.Checker's limits.
//
// Dispatch outcomes, from Dispatch.Done:
//   - ttft_seconds, request_duration_seconds (model_id, engine, stage, policy) and
//     dispatch_failures_total (model_id, reason).
//   - prompt_tokens_total (model_id, engine, cached_reported) and cached_prompt_tokens_total
//     (model_id, engine): the prompt and engine-reported cached tokens of plain or prefill engines
//     (cached ÷ prompt{cached_reported="true"} is the engines' own hit rate); output_tokens_total
//     (model_id, engine): of plain or decode engines.
//
// Flow control, from flowcontrol.Observer (docs/design.md §17; band is the band's priority):
//   - flow_control_queued_requests (model_id, band): requests waiting.
//   - flow_control_wait_seconds (model_id, band): the time waited by requests served after
//     waiting (10 ms to about 330 s).
//   - flow_control_requests_total (model_id, band, flow, outcome): requests queued or refused, by
//     outcome (served, failed, displaced, expired, canceled after waiting; queue_full, sheddable
//     without). Flows are host keys of unbounded cardinality: flow is a flow that
//     flow_control.flow_weights names, else "other".
//
// Shared state, read at each scrape once a Router is attached:
//   - inflight_requests (model_id, engine): this router's requests in flight.
//   - load_report_fresh, load_report_age_seconds (model_id, engine): whether the engine's load is
//     known, and its report's age; load_polls_total, load_poll_failures_total (engine): the load
//     pollers.
//   - kv_index_blocks, kv_index_approximate_blocks, kv_index_evicted_blocks_total: the KV-block
//     index; kv_index_engine_blocks (engine, tier) and kv_index_engine_trusted (engine): per
//     engine, trusted 0 while it resynchronises.
//   - kv_events_total, kv_event_gaps_total, kv_event_resyncs_total, kv_event_drops_total,
//     kv_event_replayed_batches_total, kv_event_publisher_restarts_total,
//     kv_event_rank_clears_total, kv_event_malformed_batches_total,
//     kv_event_unknown_topic_messages_total, kv_event_refused_events_total (+ reason) and
//     kv_event_replays_total (+ result), all (engine, dp_rank): the KV-event feed
//     (docs/design.md §13.1).
//   - kv_event_stream_connected, kv_event_stream_in_step, kv_event_stream_silent,
//     kv_event_last_batch_timestamp_seconds (engine, dp_rank): each stream's state.
//   - affinity_bindings, affinity_evicted_bindings_total: the in-memory affinity store.
//   - replica_deltas_sent_total, replica_deltas_received_total, replica_deltas_dropped_total
//     (reason), replica_broker_up, replica_peers: the sharing between router replicas, with a
//     replicas block (docs/design.md §6, "Router replicas").
//
// The package is separate so that hosts that do not use Prometheus link none of it. It is not a
// metrics framework: it knows enginepick's events and nothing else, and registers nothing
// globally.
package metrics
