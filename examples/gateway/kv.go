package main

import (
	"context"
	"fmt"
	"net/url"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/kvindex/kvevents"
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
func newKVFeed(specs []engineSpec, index *kvindex.Index, log *zap.Logger) (*kvFeed, error) {
	var endpoints []kvevents.Endpoint
	for _, s := range specs {
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
	sub, err := kvevents.New(kvevents.Options{Index: index, Logger: log})
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
	kvLabels     = []string{"engine", "dp_rank"}
	kvEventsDesc = prometheus.NewDesc("gateway_kv_events_total", "KV events decoded from the stream.", kvLabels, nil)
	kvGapsDesc   = prometheus.NewDesc("gateway_kv_gaps_total", "Forward sequence jumps (lost batches) in the stream.", kvLabels, nil)
	kvResyncDesc = prometheus.NewDesc("gateway_kv_resyncs_total", "Recoveries started (gap, restart, overflow).", kvLabels, nil)
	kvDropsDesc  = prometheus.NewDesc("gateway_kv_drops_total", "Batches dropped because the stream's queue was full.", kvLabels, nil)
	kvTrustDesc  = prometheus.NewDesc("gateway_kv_stream_trusted", "1 when the stream is in step with its publisher.", kvLabels, nil)
)

func (c kvCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{kvEventsDesc, kvGapsDesc, kvResyncDesc, kvDropsDesc, kvTrustDesc} {
		ch <- d
	}
}

func (c kvCollector) Collect(ch chan<- prometheus.Metric) {
	for _, s := range c.sub.Stats().Streams {
		l := []string{string(s.Engine), strconv.Itoa(s.DPRank)}
		trusted := 0.0
		if s.Trusted {
			trusted = 1
		}
		ch <- prometheus.MustNewConstMetric(kvEventsDesc, prometheus.CounterValue, float64(s.Events), l...)
		ch <- prometheus.MustNewConstMetric(kvGapsDesc, prometheus.CounterValue, float64(s.Gaps), l...)
		ch <- prometheus.MustNewConstMetric(kvResyncDesc, prometheus.CounterValue, float64(s.Resyncs), l...)
		ch <- prometheus.MustNewConstMetric(kvDropsDesc, prometheus.CounterValue, float64(s.Drops), l...)
		ch <- prometheus.MustNewConstMetric(kvTrustDesc, prometheus.GaugeValue, trusted, l...)
	}
}
