package config_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/config"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/metrics"
	"github.com/enginepick/enginepick/state"
)

// TestNewFollowsKVEvents checks that New follows an engine's KV-event publisher into the shared
// index (docs/design.md §13.1, §14.5): a BlockStored batch published by the engine makes the
// cache-aware policy pick it; a sequence gap shows in the metrics; RemoveEngine stops the stream;
// Close stops the subscriber.
func TestNewFollowsKVEvents(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := "tcp://" + l.Addr().String()
	require.NoError(t, l.Close())
	pub := zmq4.NewPub(context.Background())
	require.NoError(t, pub.Listen(addr)) // the engine binds, as vLLM and SGLang do by default
	defer pub.Close()

	cfg := mustParse(t, fmt.Sprintf(`
kv: {block_tokens: 4}
engines:
  - {id: e1, model: m, kv_events: {endpoint: "%s", topic: kv}}
  - {id: e2, model: m}
models: [{id: m, buckets: [{id: a, groups: {plain: {policy: {type: cache_aware, cache_aware: {min_matched_tokens: 8}}}}}]}]
`, addr))
	reg := prometheus.NewRegistry()
	obs, err := metrics.New(reg, metrics.Options{})
	require.NoError(t, err)
	r, err := config.New(cfg, nil, config.WithHealthInterval(0), config.WithObserver(obs))
	require.NoError(t, err)
	defer r.Close()

	send := func(topic string, seq uint64, payload []byte) {
		s := make([]byte, 8)
		binary.BigEndian.PutUint64(s, seq)
		require.NoError(t, pub.SendMulti(zmq4.NewMsgFrom([]byte(topic), s, payload)))
	}
	// The subscriber's connection may take a moment (ZMQ's slow joiner): probe on another topic
	// until it counts one.
	require.Eventually(t, func() bool {
		send("probe", 0, []byte{0x90})
		return r.KVEventStats().UnknownTopics > 0
	}, 10*time.Second, 20*time.Millisecond)

	tokens := []uint32{1, 2, 3, 4, 5, 6, 7, 8}
	batch := func(hashes []uint64, tokens []uint32) []byte {
		ev := []any{"BlockStored", hashes, nil, tokens, 4, nil, "GPU"}
		b, err := msgpack.Marshal([]any{1789095808.83, []any{ev}, 0})
		require.NoError(t, err)
		return b
	}
	send("kv", 0, batch([]uint64{101, 102}, tokens))
	require.Eventually(t, func() bool {
		return r.Index().Match(r.Index().Hasher().Keys(tokens)).Blocks("e1") == 2
	}, 10*time.Second, 5*time.Millisecond)
	// A prompt extending the published blocks by a token: the engine serves both blocks from its
	// cache, 8 tokens, the hit gate.
	req := &bucket.Request{Model: "m", TokenIDs: append(tokens[:8:8], 9), Signals: bucket.Signals{InputTokens: 9}}
	for range 3 {
		d, err := r.Select(context.Background(), req)
		require.NoError(t, err)
		assert.Equal(t, "e1", string(d.Selection.Plain.Engine.ID()))
		assert.Equal(t, label.ReasonCacheCandidate, d.Selection.Plain.Reason)
		d.Release()
	}

	// A store chained to a block the engine never reported is refused, with its reason.
	orphan := []any{"BlockStored", []uint64{301}, uint64(999), []uint32{7, 7, 7, 7}, 4, nil, "GPU"}
	raw, err := msgpack.Marshal([]any{1789095808.83, []any{orphan}, 0})
	require.NoError(t, err)
	send("kv", 1, raw)
	send("kv", 5, batch([]uint64{201}, []uint32{9, 9, 9, 9})) // seq 2–4 lost: a gap
	require.Eventually(t, func() bool {
		st := r.KVEventStats().Streams
		return len(st) == 1 && st[0].Gaps == 1
	}, 10*time.Second, 5*time.Millisecond)
	one := map[string]float64{"dp_rank=0,engine=e1": 1}
	zero := map[string]float64{"dp_rank=0,engine=e1": 0}
	assert.Equal(t, one, scrapeFamily(t, reg, "enginepick_kv_event_gaps_total"))
	// Without a replay socket the gap starts one recovery: the rank's blocks are cleared.
	assert.Equal(t, one, scrapeFamily(t, reg, "enginepick_kv_event_resyncs_total"))
	assert.Equal(t, one, scrapeFamily(t, reg, "enginepick_kv_event_rank_clears_total"))
	assert.Equal(t, map[string]float64{
		"dp_rank=0,engine=e1,reason=unknown_parent": 1, "dp_rank=0,engine=e1,reason=block_size": 0,
		"dp_rank=0,engine=e1,reason=unknown_medium": 0, "dp_rank=0,engine=e1,reason=unknown_adapter": 0,
		"dp_rank=0,engine=e1,reason=duplicate_hash": 0, "dp_rank=0,engine=e1,reason=key_conflict": 0,
		"dp_rank=0,engine=e1,reason=other": 0,
	}, scrapeFamily(t, reg, "enginepick_kv_event_refused_events_total"))
	assert.Equal(t, map[string]float64{"dp_rank=0,engine=e1,result=ok": 0, "dp_rank=0,engine=e1,result=failed": 0},
		scrapeFamily(t, reg, "enginepick_kv_event_replays_total"))
	for _, fam := range []string{"replayed_batches_total", "publisher_restarts_total", "malformed_batches_total", "stream_silent"} {
		assert.Equal(t, zero, scrapeFamily(t, reg, "enginepick_kv_event_"+fam), fam)
	}
	st := r.KVEventStats().Streams[0]
	assert.Equal(t, map[string]float64{"dp_rank=0,engine=e1": float64(st.LastBatchAt.UnixNano()) / 1e9},
		scrapeFamily(t, reg, "enginepick_kv_event_last_batch_timestamp_seconds"))
	require.NotZero(t, st.UnknownTopics, "the probes")
	assert.Equal(t, "probe", st.LastUnknownTopic)
	assert.Equal(t, map[string]float64{"dp_rank=0,engine=e1": float64(st.UnknownTopics)},
		scrapeFamily(t, reg, "enginepick_kv_event_unknown_topic_messages_total"))

	r.RemoveEngine("e1")
	assert.Empty(t, r.KVEventStats().Streams, "RemoveEngine stops the engine's streams")
}

// scrapeFamily returns one family's series as "l1=v1,l2=v2" → value.
func scrapeFamily(t *testing.T, reg *prometheus.Registry, name string) map[string]float64 {
	t.Helper()
	fams, err := reg.Gather()
	require.NoError(t, err)
	out := map[string]float64{}
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			key := ""
			for i, l := range m.GetLabel() {
				if i > 0 {
					key += ","
				}
				key += l.GetName() + "=" + l.GetValue()
			}
			v := m.GetCounter().GetValue() + m.GetGauge().GetValue()
			out[key] = v
		}
	}
	return out
}

// TestNewKVEventsSilentEngineIsUntrusted checks New's wiring of the KV-event silence rule
// (docs/design.md §13.1): an engine whose publisher sends nothing (here a wrong address; a wrong
// topic looks the same) stays trusted while idle, and is untrusted, with a warning, once
// the default kvevents.Options.SilenceTimeout (30 s) has passed since CheckHealth first saw a request sent to it.
func TestNewKVEventsSilentEngineIsUntrusted(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := "tcp://" + l.Addr().String()
	require.NoError(t, l.Close()) // nobody publishes there
	var mu sync.Mutex
	now := time.Unix(1_700_000_000, 0)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
	core, logs := observer.New(zap.WarnLevel)
	cfg := mustParse(t, fmt.Sprintf(`
kv: {block_tokens: 4}
engines:
  - {id: e1, model: m, kv_events: {endpoint: "%s", topic: kv}}
models: [{id: m, buckets: [{id: a, groups: {plain: {policy: {type: cache_aware}}}}]}]
`, addr))
	r, err := config.New(cfg, nil, config.WithHealthInterval(0), config.WithClock(clock), config.WithLogger(zap.New(core)))
	require.NoError(t, err)
	defer r.Close()

	advance(time.Hour)
	r.CheckHealth()
	require.Len(t, r.KVEventStats().Streams, 1)
	assert.True(t, r.KVEventStats().Streams[0].Trusted, "idle for an hour")
	assert.Empty(t, r.Index().Stats().Untrusted)

	d, err := r.Select(context.Background(), &bucket.Request{Model: "m", TokenIDs: []uint32{1, 2, 3, 4}, Signals: bucket.Signals{InputTokens: 4}})
	require.NoError(t, err)
	d.Release()
	advance(time.Second)
	r.CheckHealth() // sees the dispatch
	advance(30*time.Second - time.Second)
	r.CheckHealth()
	assert.Empty(t, r.Index().Stats().Untrusted, "a second short of the timeout")
	advance(time.Second)
	r.CheckHealth()
	st := r.KVEventStats().Streams[0]
	assert.True(t, st.Silent)
	assert.False(t, st.Trusted)
	assert.Equal(t, []state.EngineID{"e1"}, r.Index().Stats().Untrusted)
	assert.Equal(t, 1, logs.FilterMessage("kvevents: no batch since requests were sent to the engine; its blocks are untrusted until one arrives").Len())
	assert.Equal(t, 1, logs.FilterMessageSnippet("does not trust some engines").Len())
}

// TestNewKVEventsNameAdaptersByID: kv.adapter_ids names the adapter of a BlockStored that carries
// only a lora_id (SGLang's form), so a request for the adapter hits its blocks and a base-model
// request does not.
func TestNewKVEventsNameAdaptersByID(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := "tcp://" + l.Addr().String()
	require.NoError(t, l.Close())
	pub := zmq4.NewPub(context.Background())
	require.NoError(t, pub.Listen(addr))
	defer pub.Close()
	cfg := mustParse(t, fmt.Sprintf(`
kv: {block_tokens: 4, adapter_ids: {sql-lora: 7}}
engines:
  - {id: e1, model: m, kv_events: {endpoint: "%s", topic: kv}}
  - {id: e2, model: m}
models:
  - id: m
    adapters: [sql-lora]
    buckets: [{id: a, groups: {plain: {policy: {type: cache_aware, cache_aware: {min_matched_tokens: 8}}}}}]
`, addr))
	r, err := config.New(cfg, nil, config.WithHealthInterval(0))
	require.NoError(t, err)
	defer r.Close()
	send := func(topic string, seq uint64, payload []byte) {
		s := make([]byte, 8)
		binary.BigEndian.PutUint64(s, seq)
		require.NoError(t, pub.SendMulti(zmq4.NewMsgFrom([]byte(topic), s, payload)))
	}
	require.Eventually(t, func() bool {
		send("probe", 0, []byte{0x90})
		return r.KVEventStats().UnknownTopics > 0
	}, 10*time.Second, 20*time.Millisecond)
	tokens := []uint32{1, 2, 3, 4, 5, 6, 7, 8}
	ev := []any{"BlockStored", []uint64{101, 102}, nil, tokens, 4, 7} // SGLang's fields: lora_id last
	b, err := msgpack.Marshal([]any{1789095808.83, []any{ev}, 0})
	require.NoError(t, err)
	send("kv", 0, b)
	require.Eventually(t, func() bool { st := r.KVEventStats().Streams; return len(st) == 1 && st[0].StoredBlocks == 2 }, 10*time.Second, 5*time.Millisecond)
	for _, tc := range []struct {
		adapter, reason string
	}{{"sql-lora", label.ReasonCacheCandidate}, {"", label.ReasonNoCacheCandidate}} {
		req := &bucket.Request{Model: "m", Adapter: tc.adapter, TokenIDs: append(tokens[:8:8], 9), Signals: bucket.Signals{InputTokens: 9}}
		d, err := r.Select(context.Background(), req)
		require.NoError(t, err)
		assert.Equal(t, tc.reason, d.Selection.Plain.Reason, "adapter %q", tc.adapter)
		if tc.adapter != "" {
			assert.Equal(t, "e1", string(d.Selection.Plain.Engine.ID()))
		}
		d.Release()
	}
}
