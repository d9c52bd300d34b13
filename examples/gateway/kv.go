package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/kvindex/kvevents"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

// kvFeed follows the engines' KV-event publishers into the prefix index through one
// kvevents.Subscriber (docs/design.md §13).
type kvFeed struct {
	sub *kvevents.Subscriber
}

// newKVFeed returns nil when no engine names a KV-event endpoint. An endpoint without the
// cache-aware index is an error: the events would have nowhere to go. Rank r of an engine with
// several DP ranks is followed on the rank-0 endpoint's port + r, as vLLM and SGLang publish, or
// on its own endpoint and topic when the engine lists its ranks; its batches name the global rank
// dp_rank_start + r.
//
// A stream whose engine rank was sent requests (inflight) and that then publishes nothing for
// kvevents.Options.SilenceTimeout (30 s) is untrusted until its next batch (docs/design.md §13.1).
func newKVFeed(specs []engineSpec, index *kvindex.Index, inflight *loadmon.InFlight, log *zap.Logger) (*kvFeed, error) {
	var endpoints []kvevents.Endpoint
	ranks := map[state.EngineID]int{}
	for _, s := range specs {
		ranks[state.EngineID(strings.TrimRight(s.URL, "/"))] = s.ranks()
		if s.KVEvents == "" && (len(s.Ranks) == 0 || s.Ranks[0].KVEvents == "") {
			continue
		}
		if index == nil {
			return nil, fmt.Errorf("engine %s: kv_events needs --policy=cache_aware (the prefix index): %w", s.URL, state.ErrInvalidConfiguration)
		}
		for r := range s.ranks() {
			addr, topic, replay, offset := s.KVEvents, s.KVTopic, s.KVReplay, r
			if len(s.Ranks) > 0 { // the rank's own publisher (checkRanks: every rank has one)
				rs := s.Ranks[r]
				addr, topic, replay, offset = rs.KVEvents, rs.KVTopic, rs.KVReplay, 0
			}
			addr, err := offsetPort(addr, offset)
			if err != nil {
				return nil, fmt.Errorf("engine %s: kv_events: %w", s.URL, err)
			}
			ep := kvevents.Endpoint{Engine: state.EngineID(strings.TrimRight(s.URL, "/")), DPRank: r, RankStart: s.DPRankStart,
				Address: addr, Bind: s.KVBind, Topic: topic}
			if replay != "" {
				if ep.ReplayAddress, err = offsetPort(replay, offset); err != nil {
					return nil, fmt.Errorf("engine %s: kv_replay: %w", s.URL, err)
				}
			}
			endpoints = append(endpoints, ep)
		}
	}
	if len(endpoints) == 0 {
		return nil, nil
	}
	sub, err := kvevents.New(kvevents.Options{Index: index, Logger: log,
		Dispatched: func(engine state.EngineID, rank int, since time.Time) bool {
			// A dispatch naming the rank; for an engine of one rank, any dispatch to it.
			n, _ := inflight.DispatchedSince(engine, rank, since)
			if n == 0 && ranks[engine] <= 1 {
				n, _ = inflight.DispatchedSince(engine, -1, since)
			}
			return n > 0
		}})
	if err != nil {
		return nil, err
	}
	for _, ep := range endpoints {
		if err := sub.Add(ep); err != nil {
			_ = sub.Close()
			return nil, err
		}
	}
	return &kvFeed{sub: sub}, nil
}

// offsetPort adds rank to the port of a tcp:// endpoint; rank 0 returns it unchanged.
func offsetPort(addr string, rank int) (string, error) {
	if rank == 0 {
		return addr, nil
	}
	u, err := url.Parse(addr)
	if err != nil || u.Scheme != "tcp" || u.Port() == "" {
		return "", fmt.Errorf("%q: ranks above 0 need a tcp://host:port endpoint: %w", addr, state.ErrInvalidConfiguration)
	}
	port, err := strconv.Atoi(u.Port())
	if err != nil || port+rank > 65535 {
		return "", fmt.Errorf("%q: port + rank %d out of range: %w", addr, rank, state.ErrInvalidConfiguration)
	}
	host := u.Hostname()
	if strings.Contains(host, ":") {
		host = "[" + host + "]"
	}
	return fmt.Sprintf("tcp://%s:%d", host, port+rank), nil
}

// run follows the publishers until ctx is done.
func (k *kvFeed) run(ctx context.Context) error {
	if err := k.sub.Start(ctx); err != nil {
		return err
	}
	<-ctx.Done()
	return nil
}

func (k *kvFeed) close() { _ = k.sub.Close() }

// register exports the subscriber's per-stream counters.
func (k *kvFeed) register(reg *prometheus.Registry) { reg.MustRegister(kvCollector{k.sub}) }

type kvCollector struct{ sub *kvevents.Subscriber }

var (
	kvLabels        = []string{"engine", "dp_rank"}
	kvEventsDesc    = prometheus.NewDesc("gateway_kv_events_total", "KV events decoded from the stream.", kvLabels, nil)
	kvGapsDesc      = prometheus.NewDesc("gateway_kv_gaps_total", "Forward sequence jumps (lost batches) in the stream.", kvLabels, nil)
	kvResyncDesc    = prometheus.NewDesc("gateway_kv_resyncs_total", "Recoveries started (gap, restart, overflow, malformed batch).", kvLabels, nil)
	kvDropsDesc     = prometheus.NewDesc("gateway_kv_drops_total", "Batches dropped because the stream's queue was full.", kvLabels, nil)
	kvTrustDesc     = prometheus.NewDesc("gateway_kv_stream_trusted", "1 when the stream is in step with its publisher and not silent.", kvLabels, nil)
	kvRefusedDesc   = prometheus.NewDesc("gateway_kv_refused_events_total", "Events refused, by reason (kvevents.StreamStats.Refused).", append(kvLabels, "reason"), nil)
	kvTopicDesc     = prometheus.NewDesc("gateway_kv_unknown_topic_messages_total", "Messages on the stream's address with a topic no endpoint names (a wrong kv_topic); the log names the topic.", kvLabels, nil)
	kvReplaysDesc   = prometheus.NewDesc("gateway_kv_replays_total", "Replay exchanges with the publisher's replay socket, by result (ok, failed).", append(kvLabels, "result"), nil)
	kvReplayedDesc  = prometheus.NewDesc("gateway_kv_replayed_batches_total", "Batches recovered from replays.", kvLabels, nil)
	kvRestartsDesc  = prometheus.NewDesc("gateway_kv_publisher_restarts_total", "Times the stream's sequence went back (a publisher restart).", kvLabels, nil)
	kvClearsDesc    = prometheus.NewDesc("gateway_kv_rank_clears_total", "Times the rank's blocks were cleared after a loss.", kvLabels, nil)
	kvMalformedDesc = prometheus.NewDesc("gateway_kv_malformed_batches_total", "Messages or batches that did not decode, or named another DP rank.", kvLabels, nil)
	kvSilentDesc    = prometheus.NewDesc("gateway_kv_stream_silent", "1 while the stream is untrusted for publishing nothing since its engine was sent requests.", kvLabels, nil)
	kvLastDesc      = prometheus.NewDesc("gateway_kv_last_batch_timestamp_seconds", "Unix time the stream's last batch arrived; absent before the first.", kvLabels, nil)
)

func (c kvCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{kvEventsDesc, kvGapsDesc, kvResyncDesc, kvDropsDesc, kvTrustDesc, kvRefusedDesc, kvTopicDesc,
		kvReplaysDesc, kvReplayedDesc, kvRestartsDesc, kvClearsDesc, kvMalformedDesc, kvSilentDesc, kvLastDesc} {
		ch <- d
	}
}

func (c kvCollector) Collect(ch chan<- prometheus.Metric) {
	counter := func(d *prometheus.Desc, v uint64, l ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), l...)
	}
	gauge := func(d *prometheus.Desc, v float64, l ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, l...)
	}
	b2f := func(b bool) float64 {
		if b {
			return 1
		}
		return 0
	}
	for _, s := range c.sub.Stats().Streams {
		e, r := string(s.Engine), strconv.Itoa(s.DPRank)
		counter(kvEventsDesc, s.Events, e, r)
		counter(kvGapsDesc, s.Gaps, e, r)
		counter(kvResyncDesc, s.Resyncs, e, r)
		counter(kvDropsDesc, s.Drops, e, r)
		gauge(kvTrustDesc, b2f(s.Trusted), e, r)
		for reason, n := range s.Refused {
			counter(kvRefusedDesc, n, e, r, reason)
		}
		counter(kvTopicDesc, s.UnknownTopics, e, r)
		counter(kvReplaysDesc, s.Replays, e, r, "ok")
		counter(kvReplaysDesc, s.ReplayFailures, e, r, "failed")
		counter(kvReplayedDesc, s.ReplayedBatches, e, r)
		counter(kvRestartsDesc, s.Regressions, e, r)
		counter(kvClearsDesc, s.RankClears, e, r)
		counter(kvMalformedDesc, s.Malformed, e, r)
		gauge(kvSilentDesc, b2f(s.Silent), e, r)
		if !s.LastBatchAt.IsZero() {
			gauge(kvLastDesc, float64(s.LastBatchAt.UnixNano())/1e9, e, r)
		}
	}
}

// kvDebug is GET /debug/kv's answer: the index's blocks per engine DP rank and each KV-event
// stream's state and counters.
type kvDebug struct {
	// Index is nil without the cache-aware index.
	Index *kvDebugIndex `json:"index"`
	// Streams has one entry per followed (engine, DP rank), sorted.
	Streams []kvDebugStream `json:"streams"`
	// UnknownTopicMessages counts messages whose topic no endpoint of their address names;
	// LastUnknownTopic is the last such topic.
	UnknownTopicMessages uint64 `json:"unknown_topic_messages"`
	LastUnknownTopic     string `json:"last_unknown_topic"`
}

// kvDebugIndex is GET /debug/kv's view of the index: Blocks counts distinct blocks (a block
// several engines hold counts once), while each rank's figures count the blocks that rank holds.
type kvDebugIndex struct {
	Blocks            int           `json:"blocks"`
	ApproximateBlocks int           `json:"approximate_blocks"`
	EvictedBlocks     uint64        `json:"evicted_blocks"`
	Ranks             []kvDebugRank `json:"ranks"`
}

type kvDebugRank struct {
	Engine            string `json:"engine"`
	DPRank            int    `json:"dp_rank"`
	DeviceBlocks      int    `json:"device_blocks"`
	HostBlocks        int    `json:"host_blocks"`
	DiskBlocks        int    `json:"disk_blocks"`
	ExternalBlocks    int    `json:"external_blocks"`
	ApproximateBlocks int    `json:"approximate_blocks"`
	Trusted           bool   `json:"trusted"`
}

type kvDebugStream struct {
	Engine    string `json:"engine"`
	DPRank    int    `json:"dp_rank"`
	Connected bool   `json:"connected"`
	Trusted   bool   `json:"trusted"`
	Silent    bool   `json:"silent"`
	// LastBatchAt is RFC 3339; null before the first batch.
	LastBatchAt      *time.Time        `json:"last_batch_at"`
	LastSeq          uint64            `json:"last_seq"`
	Batches          uint64            `json:"batches"`
	Events           uint64            `json:"events"`
	StoredBlocks     uint64            `json:"stored_blocks"`
	RemovedBlocks    uint64            `json:"removed_blocks"`
	Refused          map[string]uint64 `json:"refused_events"`
	Gaps             uint64            `json:"gaps"`
	Restarts         uint64            `json:"publisher_restarts"`
	Resyncs          uint64            `json:"resyncs"`
	Replays          uint64            `json:"replays"`
	ReplayFailures   uint64            `json:"replay_failures"`
	ReplayedBatches  uint64            `json:"replayed_batches"`
	RankClears       uint64            `json:"rank_clears"`
	Malformed        uint64            `json:"malformed_batches"`
	Drops            uint64            `json:"drops"`
	Silences         uint64            `json:"silences"`
	UnknownTopics    uint64            `json:"unknown_topic_messages"`
	LastUnknownTopic string            `json:"last_unknown_topic"`
}

// withKVDebug serves GET /debug/kv (a kvDebug in JSON) from index (nil: none) and stats, and
// hands every other request to next.
func withKVDebug(next http.Handler, index *kvindex.Index, stats func() kvevents.Stats) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/", next)
	mux.HandleFunc("GET /debug/kv", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(kvDebugOf(index, stats()))
	})
	return mux
}

func kvDebugOf(index *kvindex.Index, st kvevents.Stats) kvDebug {
	out := kvDebug{Streams: []kvDebugStream{}, UnknownTopicMessages: st.UnknownTopics, LastUnknownTopic: st.LastUnknownTopic}
	if index != nil {
		is := index.Stats()
		out.Index = &kvDebugIndex{Blocks: is.Blocks, ApproximateBlocks: is.ApproximateBlocks, EvictedBlocks: is.EvictedBlocks, Ranks: []kvDebugRank{}}
		for _, r := range is.Ranks {
			out.Index.Ranks = append(out.Index.Ranks, kvDebugRank{Engine: string(r.Engine), DPRank: r.DPRank, DeviceBlocks: r.DeviceBlocks,
				HostBlocks: r.HostBlocks, DiskBlocks: r.DiskBlocks, ExternalBlocks: r.ExternalBlocks, ApproximateBlocks: r.ApproximateBlocks,
				Trusted: !r.Untrusted})
		}
	}
	for _, s := range st.Streams {
		d := kvDebugStream{Engine: string(s.Engine), DPRank: s.DPRank, Connected: s.Connected, Trusted: s.Trusted, Silent: s.Silent,
			LastSeq: s.LastSeq, Batches: s.Batches, Events: s.Events, StoredBlocks: s.StoredBlocks, RemovedBlocks: s.RemovedBlocks,
			Refused: s.Refused, Gaps: s.Gaps, Restarts: s.Regressions, Resyncs: s.Resyncs, Replays: s.Replays,
			ReplayFailures: s.ReplayFailures, ReplayedBatches: s.ReplayedBatches, RankClears: s.RankClears, Malformed: s.Malformed,
			Drops: s.Drops, Silences: s.Silences, UnknownTopics: s.UnknownTopics, LastUnknownTopic: s.LastUnknownTopic}
		if !s.LastBatchAt.IsZero() {
			at := s.LastBatchAt.UTC()
			d.LastBatchAt = &at
		}
		out.Streams = append(out.Streams, d)
	}
	return out
}
