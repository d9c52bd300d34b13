package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"math/rand/v2"
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
	"github.com/enginepick/enginepick/kvindex/kvevents"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

// restartablePublisher is a vLLM-style KV-event publisher (PUB socket and ROUTER replay socket)
// that can be stopped and started again on the same addresses, numbering its batches from 0 again,
// as a restarted engine's publisher does.
type restartablePublisher struct {
	t            *testing.T
	addr, replay string
	mu           sync.Mutex
	pub, router  zmq4.Socket
	batches      [][]byte // the replay buffer: batches numbered base, base+1, …
	base         uint64
	wg           sync.WaitGroup
}

func newRestartablePublisher(t *testing.T) *restartablePublisher {
	p := &restartablePublisher{t: t, addr: fmt.Sprintf("tcp://127.0.0.1:%d", freePort(t)),
		replay: fmt.Sprintf("tcp://127.0.0.1:%d", freePort(t))}
	p.start()
	t.Cleanup(p.stop)
	return p
}

// start listens on the publisher's addresses with an empty replay buffer (sequence 0 next).
func (p *restartablePublisher) start() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.pub, p.router, p.batches, p.base = zmq4.NewPub(context.Background()), zmq4.NewRouter(context.Background()), nil, 0
	require.NoError(p.t, p.pub.Listen(p.addr))
	require.NoError(p.t, p.router.Listen(p.replay))
	router := p.router
	p.wg.Go(func() {
		for {
			msg, err := router.Recv()
			if err != nil {
				return
			}
			if len(msg.Frames) != 3 {
				continue
			}
			start := binary.BigEndian.Uint64(msg.Frames[2])
			p.mu.Lock()
			for seq := max(start, p.base); seq < p.base+uint64(len(p.batches)); seq++ {
				_ = router.SendMulti(zmq4.NewMsgFrom(msg.Frames[0], []byte{}, be64(seq), p.batches[seq-p.base]))
			}
			p.mu.Unlock()
			_ = router.SendMulti(zmq4.NewMsgFrom(msg.Frames[0], []byte{}, be64(^uint64(0)), []byte{}))
		}
	})
}

// stop closes both sockets; a stopped publisher can be started again.
func (p *restartablePublisher) stop() {
	p.mu.Lock()
	pub, router := p.pub, p.router
	p.pub, p.router = nil, nil
	p.mu.Unlock()
	if pub != nil {
		_ = pub.Close()
		_ = router.Close()
	}
	p.wg.Wait()
}

// forget empties the replay buffer (as a bounded buffer that moved on would); numbering goes on.
func (p *restartablePublisher) forget() {
	p.mu.Lock()
	p.base += uint64(len(p.batches))
	p.batches = nil
	p.mu.Unlock()
}

// publish sends one batch of BlockStored events with the next sequence number.
func (p *restartablePublisher) publish(events ...any) {
	raw, err := msgpack.Marshal([]any{float64(time.Now().UnixNano()) / 1e9, events, 0})
	require.NoError(p.t, err)
	p.mu.Lock()
	defer p.mu.Unlock()
	seq := p.base + uint64(len(p.batches))
	p.batches = append(p.batches, raw)
	require.NoError(p.t, p.pub.SendMulti(zmq4.NewMsgFrom([]byte(""), be64(seq), raw)))
}

// faultPrompt is a prompt whose blocks an engine publishes: its text, the full blocks' tokens as
// the fake engines tokenize it, and engine block hashes for them.
type faultPrompt struct {
	text   string
	tokens []uint32
	hashes []uint64
}

func newFaultPrompt(word string, hashBase uint64) faultPrompt {
	text := strings.Repeat(word+" is routed by prefix. ", 8)
	tokens := fakeengine.Tokens(text)
	full := len(tokens) / faultBlock * faultBlock
	p := faultPrompt{text: text, tokens: tokens[:full], hashes: make([]uint64, full/faultBlock)}
	for i := range p.hashes {
		p.hashes[i] = hashBase + uint64(i)
	}
	return p
}

func (p faultPrompt) stored() map[string]any { return blockStored(p.hashes, p.tokens, faultBlock) }

const faultBlock = 4

// faultCounts is what the background clients saw during one phase.
type faultCounts struct {
	status    map[int]int
	truncated int // 200 streams that ended without [DONE] (the engine was cut off)
	left      int // streams the client abandoned after the first event
}

// faultTraffic is the background load: clients sending chat requests (half streamed, one stream
// in ten abandoned by its client after the first event) until stopped, counting outcomes per phase.
type faultTraffic struct {
	t       *testing.T
	url     string
	mu      sync.Mutex
	prompts []string // guarded by mu
	counts  *faultCounts
	stop    chan struct{}
	once    sync.Once
	wg      sync.WaitGroup
}

func (tr *faultTraffic) phase() *faultCounts {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	old := tr.counts
	tr.counts = &faultCounts{status: map[int]int{}}
	return old
}

func (tr *faultTraffic) record(f func(c *faultCounts)) {
	tr.mu.Lock()
	f(tr.counts)
	tr.mu.Unlock()
}

func (tr *faultTraffic) start(clients int) {
	tr.stop = make(chan struct{})
	tr.t.Cleanup(func() { tr.once.Do(func() { close(tr.stop) }); tr.wg.Wait() })
	tr.phase()
	for i := range clients {
		tr.wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(i), 5))
			client := &http.Client{Timeout: 20 * time.Second}
			for {
				select {
				case <-tr.stop:
					return
				default:
				}
				tr.one(client, rng)
			}
		})
	}
}

func (tr *faultTraffic) one(client *http.Client, rng *rand.Rand) {
	stream := rng.IntN(2) == 0
	abandon := stream && rng.IntN(10) == 0
	tr.mu.Lock()
	text := tr.prompts[rng.IntN(len(tr.prompts))]
	tr.mu.Unlock()
	body := fmt.Sprintf(`{"model":"m","stream":%v,"messages":[{"role":"user","content":%q}],"max_tokens":8}`, stream, text)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, tr.url+"/v1/chat/completions", strings.NewReader(body))
	require.NoError(tr.t, err)
	resp, err := client.Do(req)
	if err != nil {
		tr.t.Errorf("the gateway did not answer: %v", err)
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !stream {
		_, _ = io.Copy(io.Discard, resp.Body)
		tr.record(func(c *faultCounts) { c.status[resp.StatusCode]++ })
		return
	}
	r := bufio.NewReader(resp.Body)
	first, err := r.ReadString('\n')
	if abandon && err == nil && strings.HasPrefix(first, "data: ") {
		cancel() // the client leaves mid-stream
		tr.record(func(c *faultCounts) { c.status[resp.StatusCode]++; c.left++ })
		return
	}
	rest, _ := io.ReadAll(r)
	complete := strings.HasSuffix(first+string(rest), "data: [DONE]\n\n")
	tr.record(func(c *faultCounts) {
		c.status[resp.StatusCode]++
		if !complete {
			c.truncated++
		}
	})
}

// setPrompts replaces the prompts the clients draw from, for requests sent from now on.
func (tr *faultTraffic) setPrompts(prompts ...string) {
	tr.mu.Lock()
	tr.prompts = prompts
	tr.mu.Unlock()
}

func (tr *faultTraffic) finish() *faultCounts {
	tr.once.Do(func() { close(tr.stop) })
	tr.wg.Wait()
	return tr.phase()
}

// engineDispatches sums gateway_dispatches_total of one plain engine over every reason.
func engineDispatches(t *testing.T, g *gateway, engine string) float64 {
	t.Helper()
	mfs, err := g.server.Metrics().Registry().Gather()
	require.NoError(t, err)
	var n float64
	for _, mf := range mfs {
		if mf.GetName() != "gateway_dispatches_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetName() == "engine" && lp.GetValue() == engine {
					n += m.GetCounter().GetValue()
				}
			}
		}
	}
	return n
}

const idleLoad = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"

// TestFaultsEndToEnd runs the gateway on loopback in front of three fake vLLM engines (load polled
// from /metrics, KV events from a and b over ZMQ, cache-aware routing) under background traffic
// from 8 clients, and injects, one after the other: engine a killed in the middle of streams and
// restarted at its address; b's KV-event publisher restarted (its sequence back to 0, a different
// cache content); c no longer reporting load, then reporting again; every engine killed, then
// restarted. Clients abandon one stream in ten throughout. It checks, per phase: the gateway keeps
// answering, with 503 only while no engine is healthy and 502 only for requests already sent to an
// engine as it died; no request reaches an engine while its breaker is open; a cut stream ends
// without [DONE] and its guard is released; the index and the load table recover within one
// freshness window (2 s); and at the end every guard is released. (The gateway has no affinity
// store, so a Redis outage is not part of this test: docs/RELIABILITY.md §4.4.)
func TestFaultsEndToEnd(t *testing.T) {
	const freshness = 2 * time.Second
	a, b, c := newEngine(t), newEngine(t), newEngine(t)
	for _, e := range []*fakeengine.Engine{a, b, c} {
		e.SetLoad(idleLoad)
	}
	pubA, pubB := newRestartablePublisher(t), newRestartablePublisher(t)
	g, gwSrv := startGateway(t,
		"--engine=url="+a.URL()+",model=m,kind=vllm,kv_events="+pubA.addr+",kv_replay="+pubA.replay,
		"--engine=url="+b.URL()+",model=m,kind=vllm,kv_events="+pubB.addr+",kv_replay="+pubB.replay,
		"--engine=url="+c.URL()+",model=m,kind=vllm",
		"--policy=cache_aware", fmt.Sprintf("--block-tokens=%d", faultBlock), "--min-matched-tokens=16",
		"--load-interval=100ms", "--load-timeout=100ms", "--freshness="+freshness.String(),
		"--probe-interval=20ms", "--breaker-failures=1")
	idA, idB, idC := state.EngineID(a.URL()), state.EngineID(b.URL()), state.EngineID(c.URL())
	engineOf := func(id state.EngineID) interface{ Healthy() bool } {
		e, ok := g.registry.Lookup(id)
		require.True(t, ok)
		return e
	}
	loadKnown := func(id state.EngineID) bool { _, ok := g.table.Snapshot().Load(id); return ok }
	held := func(id state.EngineID, p faultPrompt) int {
		return g.index.Match(g.index.Hasher().Keys(p.tokens)).Blocks(id)
	}

	pa, pb, pb2 := newFaultPrompt("alpha", 1000), newFaultPrompt("bravo", 2000), newFaultPrompt("charlie", 3000)
	began := time.Now()
	require.Eventually(t, func() bool {
		pubA.publish(pa.stored())
		pubB.publish(pb.stored())
		return held(idA, pa) == len(pa.hashes) && held(idB, pb) == len(pb.hashes) &&
			loadKnown(idA) && loadKnown(idB) && loadKnown(idC)
	}, 20*time.Second, 20*time.Millisecond, "the gateway learns a's and b's blocks and every engine's load")
	t.Logf("start-up: blocks and load known after %v", time.Since(began).Round(time.Millisecond))

	tr := &faultTraffic{t: t, url: gwSrv.URL, prompts: []string{pa.text, pb.text, pb2.text, "hello", "what is a router?"}}
	tr.start(8)
	time.Sleep(500 * time.Millisecond)
	warm := tr.phase()
	t.Logf("warm-up: %v, %d abandoned", warm.status, warm.left)
	assert.Positive(t, warm.status[http.StatusOK])
	assert.Equal(t, warm.status[http.StatusOK], sum(warm.status), "only 200 while every engine is up")
	assert.Zero(t, warm.truncated)

	// 1. Engine a is killed with streams open, then restarted at its address.
	gate := make(chan struct{})
	a.SetChunks([]string{"data: {\"a\":1}\n\n", "data: [DONE]\n\n"}, gate, false)
	resp := post(t, context.Background(), gwSrv.URL+"/v1/chat/completions",
		fmt.Sprintf(`{"model":"m","stream":true,"messages":[{"role":"user","content":%q}]}`, pa.text), nil)
	first, err := bufio.NewReader(resp.Body).ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "data: {\"a\":1}\n", first, "a's prefix sends its stream to a")
	require.Positive(t, g.inflight.Count(idA))
	killed := time.Now()
	a.Kill()
	rest, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	assert.NotContains(t, string(rest), "[DONE]", "the cut stream ends without [DONE]")
	require.Eventually(t, func() bool { return !engineOf(idA).Healthy() }, 5*time.Second, time.Millisecond, "a's breaker opens")
	require.Eventually(t, func() bool { return g.inflight.Count(idA) == 0 }, 5*time.Second, time.Millisecond,
		"every guard on a is released")
	dispatchedToA := engineDispatches(t, g, a.URL())
	time.Sleep(time.Second)
	assert.Equal(t, dispatchedToA, engineDispatches(t, g, a.URL()), "nothing is dispatched to a while it is down")
	aAddr := strings.TrimPrefix(a.URL(), "http://")
	a2, err := fakeengine.NewAt(aAddr)
	require.NoError(t, err)
	t.Cleanup(a2.Close)
	a2.SetLoad(idleLoad)
	restarted := time.Now()
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.True(c, engineOf(idA).Healthy(), "a's breaker closed")
		assert.True(c, loadKnown(idA), "a's load known")
	}, freshness, time.Millisecond, "a is healthy and its load known again within one freshness window")
	t.Logf("a: down %v; healthy with known load %v after its restart", restarted.Sub(killed).Round(time.Millisecond), time.Since(restarted).Round(time.Millisecond))
	require.Eventually(t, func() bool { return len(a2.Requests()) > 0 }, 10*time.Second, 10*time.Millisecond, "a takes traffic again")
	kill := tr.phase()
	t.Logf("a killed and restarted: %v, %d truncated, %d abandoned", kill.status, kill.truncated, kill.left)
	assert.Zero(t, kill.status[http.StatusServiceUnavailable], "no 503 while b and c are up")
	assert.Equal(t, sum(kill.status), kill.status[http.StatusOK]+kill.status[http.StatusBadGateway])
	assert.LessOrEqual(t, kill.status[http.StatusBadGateway]+kill.truncated, 8, "only requests already on a when it died fail")

	// 2. b's KV-event publisher restarts: its sequence starts again at 0 and the engine's cache is
	// now pb2, not pb. The subscriber sees the regression, clears b and rebuilds it.
	// The engine has been publishing for a while: its last sequence number is well above what the
	// restarted publisher numbers its first batches (the subscriber sees the sequence go back, or a
	// gap its replay cannot fill; either way it clears the rank).
	// The restarted engine no longer holds pb, so no client asks for pb from here on: a request for
	// pb routed to b after the clear would make b hold pb again, legitimately, through the
	// gateway's route-time placement (docs/design.md §9.10), and the check below could not tell
	// that from a clear that never happened.
	tr.setPrompts(pa.text, pb2.text, "hello", "what is a router?")
	for range 100 {
		pubB.publish(pb.stored())
	}
	require.Eventually(t, func() bool { return streamOf(g, idB).LastSeq >= 100 }, 10*time.Second, 5*time.Millisecond)
	pubB.stop()
	require.Eventually(t, func() bool { return !streamOf(g, idB).Connected }, 10*time.Second, 5*time.Millisecond)
	pubB.start()
	restarted = time.Now()
	var st kvevents.StreamStats
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		pubB.publish(pb2.stored())
		st = streamOf(g, idB)
		assert.Positive(c, st.Regressions, "the subscriber saw b's sequence go back")
		assert.True(c, st.Trusted, "b's stream is in step again")
		assert.Equal(c, len(pb2.hashes), held(idB, pb2), "b holds the blocks its restarted publisher announces")
		assert.Zero(c, held(idB, pb), "b no longer holds what it held before the restart")
	}, freshness, 20*time.Millisecond, "b's index entries are rebuilt from the restarted stream within one freshness window")
	t.Logf("b's publisher: index rebuilt %v after its restart (regressions %d, gaps %d, replays %d, resyncs %d)",
		time.Since(restarted).Round(time.Millisecond), st.Regressions, st.Gaps, st.Replays, st.Resyncs)
	restart := tr.phase()
	t.Logf("b's publisher restarted: %v", restart.status)
	assert.Equal(t, sum(restart.status), restart.status[http.StatusOK], "only 200")

	// 3. c stops reporting load (its endpoint answers 404), then reports again.
	c.SetLoad("")
	stopped := time.Now()
	var snap loadmon.Snapshot
	require.Eventually(t, func() bool {
		snap = g.table.Snapshot()
		_, ok := snap.Load(idC)
		return !ok
	}, freshness+time.Second, time.Millisecond, "c's load is unknown once its last report is older than the freshness")
	t.Logf("c: load unknown %v after it stopped reporting (freshness %v)", time.Since(stopped).Round(time.Millisecond), freshness)
	// Its last report stood until it was older than the freshness, and not longer. (Measured from
	// the report, not from SetLoad: on a loaded machine a poll can also time out before c stops.)
	last, ok := snap.Reported(idC)
	require.True(t, ok, "c's last report is kept for diagnostics")
	assert.Greater(t, snap.CapturedAt().Sub(last.ReportedAt), freshness, "its last report stood until it was stale")
	time.Sleep(500 * time.Millisecond)
	c.SetLoad(idleLoad)
	resumed := time.Now()
	require.Eventually(t, func() bool { return loadKnown(idC) }, freshness, time.Millisecond, "known again at its next poll")
	t.Logf("c: load known %v after it reported again", time.Since(resumed).Round(time.Millisecond))
	quiet := tr.phase()
	t.Logf("c silent: %v", quiet.status)
	assert.Equal(t, sum(quiet.status), quiet.status[http.StatusOK], "only 200: unknown load is not an outage")

	// 4. Every engine dies: 503 once no breaker is closed, 200 again after the restarts.
	a2.Kill()
	b.Kill()
	c.Kill()
	require.Eventually(t, func() bool {
		return !engineOf(idA).Healthy() && !engineOf(idB).Healthy() && !engineOf(idC).Healthy()
	}, 10*time.Second, time.Millisecond, "every breaker opens")
	time.Sleep(200 * time.Millisecond) // requests sent before the last breaker opened finish (502)
	tr.phase()
	time.Sleep(500 * time.Millisecond)
	down := tr.phase()
	t.Logf("everything down: %v", down.status)
	assert.Positive(t, down.status[http.StatusServiceUnavailable])
	assert.Equal(t, sum(down.status), down.status[http.StatusServiceUnavailable], "only 503 while nothing is healthy")
	for _, addr := range []string{aAddr, strings.TrimPrefix(b.URL(), "http://"), strings.TrimPrefix(c.URL(), "http://")} {
		e, err := fakeengine.NewAt(addr)
		require.NoError(t, err)
		t.Cleanup(e.Close)
		e.SetLoad(idleLoad)
	}
	require.Eventually(t, func() bool {
		return engineOf(idA).Healthy() && engineOf(idB).Healthy() && engineOf(idC).Healthy()
	}, 5*time.Second, time.Millisecond, "every engine is back")
	time.Sleep(100 * time.Millisecond) // requests selected before the last breaker closed finish (503)
	tr.phase()
	time.Sleep(300 * time.Millisecond)
	back := tr.finish()
	t.Logf("back up: %v", back.status)
	assert.Positive(t, back.status[http.StatusOK])
	assert.Equal(t, sum(back.status), back.status[http.StatusOK], "only 200 once an engine is healthy again")

	// Every guard released, on every engine.
	for _, id := range []state.EngineID{idA, idB, idC} {
		assert.Eventually(t, func() bool { return g.inflight.Count(id) == 0 }, 5*time.Second, time.Millisecond, "in-flight of %s", id)
	}
	close(gate)
}

func streamOf(g *gateway, id state.EngineID) kvevents.StreamStats {
	for _, s := range g.kv.sub.Stats().Streams {
		if s.Engine == id {
			return s
		}
	}
	return kvevents.StreamStats{}
}

func sum(m map[int]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}
