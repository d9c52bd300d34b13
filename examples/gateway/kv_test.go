package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/enginepick/enginepick/examples/gateway/internal/fakeengine"
	"github.com/enginepick/enginepick/state"
)

// publisher is a vLLM-style KV-event publisher: a bound PUB socket sending
// [topic, 8-byte big-endian sequence, msgpack [ts, events, dp_rank]] and a ROUTER replay socket
// answering [identity, "", start] with the buffered batches from start and the −1 end marker.
type publisher struct {
	pub, router zmq4.Socket
	mu          sync.Mutex
	batches     [][]byte
	wg          sync.WaitGroup
}

func freePort(t *testing.T) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// newPublisher is a publisher on ports the system chose (listening on port 0, so that no parallel
// test can take them between their choice and the bind), with its two addresses.
func newPublisher(t *testing.T) (p *publisher, addr, replay string) {
	p = newPublisherOn(t, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
	port := func(a net.Addr) string { return fmt.Sprintf("tcp://127.0.0.1:%d", a.(*net.TCPAddr).Port) }
	return p, port(p.pub.Addr()), port(p.router.Addr())
}

// newPublisherOn is newPublisher bound to the given addresses.
func newPublisherOn(t *testing.T, addr, replay string) *publisher {
	p := &publisher{pub: zmq4.NewPub(context.Background()), router: zmq4.NewRouter(context.Background())}
	require.NoError(t, p.pub.Listen(addr))
	require.NoError(t, p.router.Listen(replay))
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			msg, err := p.router.Recv()
			if err != nil {
				return
			}
			if len(msg.Frames) != 3 {
				continue
			}
			start := binary.BigEndian.Uint64(msg.Frames[2])
			p.mu.Lock()
			for seq := start; seq < uint64(len(p.batches)); seq++ {
				_ = p.router.SendMulti(zmq4.NewMsgFrom(msg.Frames[0], []byte{}, be64(seq), p.batches[seq]))
			}
			p.mu.Unlock()
			_ = p.router.SendMulti(zmq4.NewMsgFrom(msg.Frames[0], []byte{}, be64(^uint64(0)), []byte{}))
		}
	}()
	t.Cleanup(func() {
		_ = p.pub.Close()
		_ = p.router.Close()
		p.wg.Wait()
	})
	return p
}

func be64(v uint64) []byte {
	b := make([]byte, 8)
	binary.BigEndian.PutUint64(b, v)
	return b
}

// publish sends one batch with the next sequence number.
func (p *publisher) publish(t *testing.T, events ...any) {
	raw, err := msgpack.Marshal([]any{float64(time.Now().UnixNano()) / 1e9, events, 0})
	require.NoError(t, err)
	p.mu.Lock()
	seq := uint64(len(p.batches))
	p.batches = append(p.batches, raw)
	p.mu.Unlock()
	require.NoError(t, p.pub.SendMulti(zmq4.NewMsgFrom([]byte(""), be64(seq), raw)))
}

// blockStored is vLLM's BlockStored in its current map form.
func blockStored(hashes []uint64, tokens []uint32, blockSize int) map[string]any {
	return map[string]any{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": nil,
		"token_ids": tokens, "block_size": blockSize, "lora_id": nil, "medium": "GPU"}
}

// A repeated long prompt lands on the engine that published its blocks over ZMQ: the gateway
// tokenizes the prompt through /tokenize, hashes it like the events' tokens and the cache-aware
// policy picks the holder every time.
func TestRepeatedPromptLandsOnTheEngineThatPublishedItsBlocks(t *testing.T) {
	t.Parallel()
	a, b := newEngine(t), newEngine(t)
	pub, addr, replay := newPublisher(t)
	const block = 4
	text := strings.Repeat("the quick brown fox jumps over the lazy dog. ", 3) // 135 bytes → 33 full blocks
	g, gwSrv := startGateway(t,
		"--engine=url="+a.URL()+",model=m,kind=vllm,load=none",
		"--engine=url="+b.URL()+",model=m,kind=vllm,load=none,kv_events="+addr+",kv_replay="+replay,
		"--block-tokens=4", "--min-matched-tokens=64")
	tokens := fakeengine.Tokens(text)
	full := len(tokens) / block * block
	hashes := make([]uint64, full/block)
	for i := range hashes {
		hashes[i] = uint64(1000 + i)
	}
	keys := g.index.Hasher().Keys(tokens)
	require.Eventually(t, func() bool {
		pub.publish(t, blockStored(hashes, tokens[:full], block))
		st := g.kv.sub.Stats().Streams
		return len(st) == 1 && st[0].Trusted && g.index.Match(keys).Blocks(state.EngineID(b.URL())) == len(hashes)
	}, 10*time.Second, 20*time.Millisecond, "the gateway's index learns b's blocks from its events")
	// Publishing has stopped: wait until the subscriber has handled the last batch and is in step,
	// so no late batch or resync changes the index during the requests.
	pub.mu.Lock()
	last := uint64(len(pub.batches) - 1)
	pub.mu.Unlock()
	require.Eventually(t, func() bool {
		st := g.kv.sub.Stats().Streams[0]
		return st.LastSeq == last && st.Trusted && g.index.Match(keys).Blocks(state.EngineID(b.URL())) == len(hashes)
	}, 10*time.Second, 10*time.Millisecond)

	chatOK(t, gwSrv.URL, text, 6)
	assert.Len(t, b.Requests(), 6, "every repeat goes to the holder")
	assert.Empty(t, a.Requests())
	assert.Equal(t, float64(6), dispatches(t, g, b.URL(), "cache_candidate"))

	// A short, unrelated prompt has no holder: the load fallback may pick either engine.
	resp := post(t, context.Background(), gwSrv.URL+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, nil)
	resp.Body.Close()
	assert.Equal(t, float64(1), dispatches(t, g, a.URL(), "no_cache_candidate")+dispatches(t, g, b.URL(), "no_cache_candidate"))
}

// dispatches reads gateway_dispatches_total for a plain engine and reason.
func dispatches(t *testing.T, g *gateway, engine, reason string) float64 {
	t.Helper()
	mfs, err := g.server.Metrics().Registry().Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "gateway_dispatches_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			l := map[string]string{}
			for _, lp := range m.GetLabel() {
				l[lp.GetName()] = lp.GetValue()
			}
			if l["engine"] == engine && l["reason"] == reason {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

// chatOK sends the same chat request with content text n times through the gateway at base and
// requires a 200 for each.
func chatOK(t *testing.T, base, text string, n int) {
	t.Helper()
	body := fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":%q}],"max_tokens":8}`, text)
	for range n {
		resp := post(t, context.Background(), base+"/v1/chat/completions", body, nil)
		_, _ = io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
	}
}

// A publisher on another topic than the engine's kv_topic is seen: its messages are counted on
// the engine's stream with the topic kept, in the metrics and in GET /debug/kv; a publisher on
// the right topic fills the index, which GET /debug/kv lists per engine DP rank.
func TestKVFeedIsVisible(t *testing.T) {
	t.Parallel()
	a, b := newEngine(t), newEngine(t)
	pa, addrA, _ := newPublisher(t)
	pb, addrB, _ := newPublisher(t)
	g, gwSrv := startGateway(t,
		"--engine=url="+a.URL()+",model=m,kind=vllm,load=none,kv_events="+addrA,
		"--engine=url="+b.URL()+",model=m,kind=vllm,load=none,kv_events="+addrB+",kv_topic=kv",
		"--block-tokens=4")
	stream := func(engine string) kvDebugStream {
		for _, s := range debugKV(t, gwSrv.URL).Streams {
			if s.Engine == engine {
				return s
			}
		}
		return kvDebugStream{}
	}
	// b publishes on "" while the gateway expects "kv".
	require.Eventually(t, func() bool {
		pb.publish(t, blockStored([]uint64{1}, []uint32{1, 2, 3, 4}, 4))
		return stream(b.URL()).UnknownTopics > 0
	}, 10*time.Second, 20*time.Millisecond)
	// The last probes may still be on their way: the metric and the endpoint agree once they land.
	require.Eventually(t, func() bool {
		return float64(stream(b.URL()).UnknownTopics) == gatewayMetric(t, g, "gateway_kv_unknown_topic_messages_total", b.URL())
	}, 10*time.Second, 20*time.Millisecond)
	sb := stream(b.URL())
	assert.Equal(t, "", sb.LastUnknownTopic)
	assert.Zero(t, sb.Batches)
	assert.Nil(t, sb.LastBatchAt)
	assert.True(t, sb.Trusted, "no request was sent to b: its silence costs nothing")

	tokens := []uint32{1, 2, 3, 4, 5, 6, 7, 8}
	require.Eventually(t, func() bool {
		pa.publish(t, blockStored([]uint64{11, 12}, tokens, 4))
		return g.index.Match(g.index.Hasher().Keys(tokens)).Blocks(state.EngineID(a.URL())) == 2
	}, 10*time.Second, 20*time.Millisecond)
	d := debugKV(t, gwSrv.URL)
	require.NotNil(t, d.Index)
	assert.Equal(t, []kvDebugRank{{Engine: a.URL(), DPRank: 0, DeviceBlocks: 2, Trusted: true}}, d.Index.Ranks)
	sa := stream(a.URL())
	assert.True(t, sa.Trusted)
	assert.NotNil(t, sa.LastBatchAt)
	assert.Zero(t, sa.UnknownTopics)
	assert.Equal(t, map[string]uint64{"unknown_parent": 0, "block_size": 0, "unknown_medium": 0, "unknown_adapter": 0,
		"duplicate_hash": 0, "key_conflict": 0, "other": 0}, sa.Refused)
	require.Eventually(t, func() bool {
		at := stream(a.URL()).LastBatchAt
		return at != nil && float64(at.UnixNano())/1e9 == gatewayMetric(t, g, "gateway_kv_last_batch_timestamp_seconds", a.URL())
	}, 10*time.Second, 20*time.Millisecond)
}

// debugKV gets GET /debug/kv.
func debugKV(t *testing.T, base string) kvDebug {
	t.Helper()
	resp, err := http.Get(base + "/debug/kv")
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	var d kvDebug
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&d))
	return d
}

// gatewayMetric reads one series of a gateway_kv_* family for an engine's rank 0.
func gatewayMetric(t *testing.T, g *gateway, name, engine string) float64 {
	t.Helper()
	mfs, err := g.server.Metrics().Registry().Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			l := map[string]string{}
			for _, lp := range m.GetLabel() {
				l[lp.GetName()] = lp.GetValue()
			}
			if l["engine"] == engine && l["dp_rank"] == "0" {
				return m.GetCounter().GetValue() + m.GetGauge().GetValue()
			}
		}
	}
	t.Fatalf("no %s for %s", name, engine)
	return 0
}
