package metrics

import (
	"slices"
	"strconv"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/enginepick/enginepick/config"
	"github.com/enginepick/enginepick/internal/peersync"
	"github.com/enginepick/enginepick/internal/peersync/redispeer"
	"github.com/enginepick/enginepick/kvindex"
)

// stateCollector reads the attached Router's shared state at scrape time. It reports nothing
// until a Router is attached.
type stateCollector struct {
	router   atomic.Pointer[config.Router]
	replicas atomic.Pointer[redispeer.Peer] // nil without a replicas block

	inflight     *prometheus.Desc
	loadFresh    *prometheus.Desc
	loadAge      *prometheus.Desc
	polls        *prometheus.Desc
	pollFailures *prometheus.Desc
	indexBlocks  *prometheus.Desc
	indexApprox  *prometheus.Desc
	indexEvicted *prometheus.Desc
	engineBlocks *prometheus.Desc
	trusted      *prometheus.Desc
	kvGaps       *prometheus.Desc
	kvResyncs    *prometheus.Desc
	kvDrops      *prometheus.Desc
	kvEvents     *prometheus.Desc
	kvConnected  *prometheus.Desc
	kvInStep     *prometheus.Desc
	kvRefused    *prometheus.Desc
	kvTopics     *prometheus.Desc
	kvReplays    *prometheus.Desc
	kvReplayed   *prometheus.Desc
	kvRestarts   *prometheus.Desc
	kvClears     *prometheus.Desc
	kvMalformed  *prometheus.Desc
	kvSilent     *prometheus.Desc
	kvLastBatch  *prometheus.Desc
	bindings     *prometheus.Desc
	bindEvicted  *prometheus.Desc
	repSent      *prometheus.Desc
	repReceived  *prometheus.Desc
	repDropped   *prometheus.Desc
	repUp        *prometheus.Desc
	repPeers     *prometheus.Desc
}

// unpublishedReason labels this replica's deltas that never reached the broker, next to the
// peersync.Reason labels of the peers' deltas dropped.
const unpublishedReason = "unpublished"

// bindingCounter is the in-memory affinity store's view (affinity.MemoryStore): its bindings and
// how many the binding cap evicted. A remote store does not implement it, and reports neither.
type bindingCounter interface {
	Len() int
	Evicted() uint64
}

func newStateCollector(ns string) *stateCollector {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(ns, "", name), help, labels, nil)
	}
	return &stateCollector{
		inflight: d("inflight_requests",
			"Requests this router dispatched to the engine whose Dispatch has not ended, per engine of the registry.", "model_id", "engine"),
		loadFresh: d("load_report_fresh",
			"1 when the engine has a fresh, complete load report (every DP rank within the freshness), else 0: its load is unknown.", "model_id", "engine"),
		loadAge: d("load_report_age_seconds",
			"Age of the engine's last complete load report (its oldest rank's), fresh or not; absent when it never completed one.", "model_id", "engine"),
		polls: d("load_polls_total",
			"Polls of the engine's load endpoint by the router's poller.", "engine"),
		pollFailures: d("load_poll_failures_total",
			"Failed polls of the engine's load endpoint (transport, status, malformed page, missing ranks).", "engine"),
		indexBlocks: d("kv_index_blocks",
			"Blocks (tree nodes) in the KV-block prefix index, including interior blocks kept for a held descendant; approximate entries are not blocks."),
		indexApprox: d("kv_index_approximate_blocks",
			"Approximate (route-time) block entries in the KV-block index."),
		indexEvicted: d("kv_index_evicted_blocks_total",
			"Blocks the KV-block index evicted under its block cap."),
		engineBlocks: d("kv_index_engine_blocks",
			"Blocks the index records the engine holding, over its DP ranks, by tier (device, host, disk, external, approximate).", "engine", "tier"),
		trusted: d("kv_index_engine_trusted",
			"1 when the index trusts the engine's blocks, 0 while its KV-event stream is resynchronising (lookups ignore its blocks).", "engine"),
		kvGaps: d("kv_event_gaps_total",
			"Forward jumps in a KV-event stream's sequence (lost batches), per engine and DP rank.", "engine", "dp_rank"),
		kvResyncs: d("kv_event_resyncs_total",
			"Recoveries a KV-event stream started (after a gap, a publisher restart, an overflow).", "engine", "dp_rank"),
		kvDrops: d("kv_event_drops_total",
			"KV-event batches dropped because the stream's queue was full.", "engine", "dp_rank"),
		kvEvents: d("kv_events_total",
			"KV events decoded from the stream.", "engine", "dp_rank"),
		kvConnected: d("kv_event_stream_connected",
			"1 when the stream's socket is connected (or bound).", "engine", "dp_rank"),
		kvInStep: d("kv_event_stream_in_step",
			"1 when the stream is in step with its publisher and not silent, 0 from a detected loss until it has resynchronised and while silent.", "engine", "dp_rank"),
		kvRefused: d("kv_event_refused_events_total",
			"KV events refused, by reason (unknown_parent, block_size, unknown_medium, unknown_adapter, duplicate_hash, key_conflict, other).", "engine", "dp_rank", "reason"),
		kvTopics: d("kv_event_unknown_topic_messages_total",
			"Messages on the stream's address whose topic no endpoint names (a wrong topic), when the stream is its address's only one; the warning log names the topic.", "engine", "dp_rank"),
		kvReplays: d("kv_event_replays_total",
			"Replay exchanges with the publisher's replay socket, by result (ok, failed).", "engine", "dp_rank", "result"),
		kvReplayed: d("kv_event_replayed_batches_total",
			"KV-event batches recovered from replays.", "engine", "dp_rank"),
		kvRestarts: d("kv_event_publisher_restarts_total",
			"Times the stream's sequence went back (a publisher restart).", "engine", "dp_rank"),
		kvClears: d("kv_event_rank_clears_total",
			"Times the subscriber cleared the rank's blocks after a loss.", "engine", "dp_rank"),
		kvMalformed: d("kv_event_malformed_batches_total",
			"KV-event messages or batches that did not decode, or named another DP rank.", "engine", "dp_rank"),
		kvSilent: d("kv_event_stream_silent",
			"1 while the stream is untrusted for publishing nothing since its engine was sent requests.", "engine", "dp_rank"),
		kvLastBatch: d("kv_event_last_batch_timestamp_seconds",
			"Unix time the stream's last batch arrived; absent before the first.", "engine", "dp_rank"),
		bindings: d("affinity_bindings",
			"Session and sticky bindings the in-memory affinity store holds, expired ones not yet swept included."),
		bindEvicted: d("affinity_evicted_bindings_total",
			"Live bindings the in-memory affinity store evicted, least recently used first, to stay within its binding cap (affinity.max_bindings)."),
		repSent: d("replica_deltas_sent_total",
			"Dispatch changes and route-time placements this router replica published to its peers."),
		repReceived: d("replica_deltas_received_total",
			"Peer replicas' dispatch changes and placements applied to this router's view."),
		repDropped: d("replica_deltas_dropped_total",
			"Deltas dropped, by reason: peers' (duplicate, unknown_engine, unknown_dispatch, refused_placement, malformed) and this replica's never published (unpublished, while the broker was unreachable).", "reason"),
		repUp: d("replica_broker_up",
			"1 while this router replica is subscribed to the replicas' broker channel (sharing works), 0 while it decides on its own view."),
		repPeers: d("replica_peers",
			"Peer router replicas whose dispatches count in this router's view."),
	}
}

// Describe implements prometheus.Collector.
func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.inflight, c.loadFresh, c.loadAge, c.polls, c.pollFailures, c.indexBlocks,
		c.indexApprox, c.indexEvicted, c.engineBlocks, c.trusted, c.kvGaps, c.kvResyncs, c.kvDrops, c.kvEvents, c.kvConnected, c.kvInStep,
		c.kvRefused, c.kvTopics, c.kvReplays, c.kvReplayed, c.kvRestarts, c.kvClears, c.kvMalformed, c.kvSilent, c.kvLastBatch, c.bindings, c.bindEvicted,
		c.repSent, c.repReceived, c.repDropped, c.repUp, c.repPeers} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	r := c.router.Load()
	if r == nil {
		return
	}
	if tab := r.LoadTable(); tab != nil {
		s := tab.Snapshot()
		now := s.CapturedAt()
		for _, m := range r.Models() {
			for _, e := range r.Registry().Engines(m) {
				if e == nil {
					continue
				}
				id := string(e.ID())
				ch <- prometheus.MustNewConstMetric(c.inflight, prometheus.GaugeValue, float64(r.InFlight().Count(e.ID())), string(m), id)
				fresh := 0.0
				if _, ok := s.Load(e.ID()); ok {
					fresh = 1
				}
				ch <- prometheus.MustNewConstMetric(c.loadFresh, prometheus.GaugeValue, fresh, string(m), id)
				if l, ok := s.Reported(e.ID()); ok {
					ch <- prometheus.MustNewConstMetric(c.loadAge, prometheus.GaugeValue, now.Sub(l.ReportedAt).Seconds(), string(m), id)
				}
			}
		}
	}
	for _, st := range r.LoadPollStats() {
		ch <- prometheus.MustNewConstMetric(c.polls, prometheus.CounterValue, float64(st.Polls), string(st.Engine))
		ch <- prometheus.MustNewConstMetric(c.pollFailures, prometheus.CounterValue, float64(st.Failures), string(st.Engine))
	}
	for _, st := range r.KVEventStats().Streams {
		e, rk := string(st.Engine), strconv.Itoa(st.DPRank)
		counter := func(d *prometheus.Desc, v uint64, extra ...string) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), append([]string{e, rk}, extra...)...)
		}
		gauge := func(d *prometheus.Desc, v float64) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, e, rk)
		}
		counter(c.kvGaps, st.Gaps)
		counter(c.kvResyncs, st.Resyncs)
		counter(c.kvDrops, st.Drops)
		counter(c.kvEvents, st.Events)
		gauge(c.kvConnected, b2f(st.Connected))
		gauge(c.kvInStep, b2f(st.Trusted))
		for reason, n := range st.Refused {
			counter(c.kvRefused, n, reason)
		}
		counter(c.kvTopics, st.UnknownTopics)
		counter(c.kvReplays, st.Replays, "ok")
		counter(c.kvReplays, st.ReplayFailures, "failed")
		counter(c.kvReplayed, st.ReplayedBatches)
		counter(c.kvRestarts, st.Regressions)
		counter(c.kvClears, st.RankClears)
		counter(c.kvMalformed, st.Malformed)
		gauge(c.kvSilent, b2f(st.Silent))
		if !st.LastBatchAt.IsZero() {
			gauge(c.kvLastBatch, float64(st.LastBatchAt.UnixNano())/1e9)
		}
	}
	if p := c.replicas.Load(); p != nil {
		st := p.Stats()
		ch <- prometheus.MustNewConstMetric(c.repSent, prometheus.CounterValue, float64(st.Sent))
		ch <- prometheus.MustNewConstMetric(c.repReceived, prometheus.CounterValue, float64(st.Received))
		for reason, n := range st.Dropped {
			ch <- prometheus.MustNewConstMetric(c.repDropped, prometheus.CounterValue, float64(n), peersync.Reason(reason).String())
		}
		ch <- prometheus.MustNewConstMetric(c.repDropped, prometheus.CounterValue, float64(st.Unpublished), unpublishedReason)
		ch <- prometheus.MustNewConstMetric(c.repUp, prometheus.GaugeValue, b2f(st.Up))
		ch <- prometheus.MustNewConstMetric(c.repPeers, prometheus.GaugeValue, float64(st.Peers))
	}
	if bc, ok := r.AffinityStore().(bindingCounter); ok {
		ch <- prometheus.MustNewConstMetric(c.bindings, prometheus.GaugeValue, float64(bc.Len()))
		ch <- prometheus.MustNewConstMetric(c.bindEvicted, prometheus.CounterValue, float64(bc.Evicted()))
	}
	if x := r.Index(); x != nil {
		st := x.Stats()
		ch <- prometheus.MustNewConstMetric(c.indexBlocks, prometheus.GaugeValue, float64(st.Blocks))
		ch <- prometheus.MustNewConstMetric(c.indexApprox, prometheus.GaugeValue, float64(st.ApproximateBlocks))
		ch <- prometheus.MustNewConstMetric(c.indexEvicted, prometheus.CounterValue, float64(st.EvictedBlocks))
		// Per engine: its ranks' blocks summed (st.Ranks is sorted by engine).
		for i := 0; i < len(st.Ranks); {
			id := st.Ranks[i].Engine
			var sum kvindex.RankStats
			for ; i < len(st.Ranks) && st.Ranks[i].Engine == id; i++ {
				r := &st.Ranks[i]
				sum.DeviceBlocks += r.DeviceBlocks
				sum.HostBlocks += r.HostBlocks
				sum.DiskBlocks += r.DiskBlocks
				sum.ExternalBlocks += r.ExternalBlocks
				sum.ApproximateBlocks += r.ApproximateBlocks
			}
			for _, t := range []struct {
				tier string
				n    int
			}{{kvindex.TierDevice.String(), sum.DeviceBlocks}, {kvindex.TierHost.String(), sum.HostBlocks}, {kvindex.TierDisk.String(), sum.DiskBlocks},
				{kvindex.TierExternal.String(), sum.ExternalBlocks}, {"approximate", sum.ApproximateBlocks}} {
				ch <- prometheus.MustNewConstMetric(c.engineBlocks, prometheus.GaugeValue, float64(t.n), string(id), t.tier)
			}
			trusted := 1.0
			if slices.Contains(st.Untrusted, id) {
				trusted = 0
			}
			ch <- prometheus.MustNewConstMetric(c.trusted, prometheus.GaugeValue, trusted, string(id))
		}
	}
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
