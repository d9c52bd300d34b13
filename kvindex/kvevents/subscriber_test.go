package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/enginepick/enginepick/internal/kvbridge"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/state"
)

// TestMain fails the package's tests if any goroutine outlives them. zmq4's PUB socket, used only
// by the tests' publishers, leaves its writer goroutine waiting on a condition variable after
// Close (go-zeromq/zmq4 pub.go, pubMWriter.run); the subscriber creates no PUB socket.
func TestMain(m *testing.M) {
	if addr := os.Getenv(benchPublisherEnv); addr != "" {
		os.Exit(runBenchPublisher(addr))
	}
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}

// goPublisher is a vLLM-style publisher built on zmq4: a PUB socket sending
// [topic, seq (8 bytes big-endian), payload] and, optionally, a ROUTER replay socket that answers
// [identity, "", start] with every buffered batch from start on and the −1 end marker.
type goPublisher struct {
	t      *testing.T
	pub    zmq4.Socket
	router zmq4.Socket
	mu     sync.Mutex
	buffer map[uint64][]byte
	order  []uint64
	wg     sync.WaitGroup
}

func newGoPublisher(t *testing.T, addr string, bind bool, replayAddr string) *goPublisher {
	t.Helper()
	p := &goPublisher{t: t, buffer: map[uint64][]byte{}}
	p.pub = zmq4.NewPub(context.Background(), zmq4.WithDialerRetry(10*time.Millisecond), zmq4.WithDialerMaxRetries(-1))
	if bind {
		require.NoError(t, p.pub.Listen(addr))
	} else {
		require.NoError(t, p.pub.Dial(addr))
	}
	if replayAddr != "" {
		p.router = zmq4.NewRouter(context.Background())
		require.NoError(t, p.router.Listen(replayAddr))
		p.wg.Add(1)
		go p.serveReplay()
	}
	return p
}

func (p *goPublisher) serveReplay() {
	defer p.wg.Done()
	for {
		msg, err := p.router.Recv()
		if err != nil {
			return
		}
		if len(msg.Frames) != 3 {
			continue
		}
		id, start := msg.Frames[0], binary.BigEndian.Uint64(msg.Frames[2])
		p.mu.Lock()
		for _, seq := range p.order {
			if seq >= start {
				_ = p.router.SendMulti(zmq4.NewMsgFrom(id, []byte{}, be64(seq), p.buffer[seq]))
			}
		}
		p.mu.Unlock()
		_ = p.router.SendMulti(zmq4.NewMsgFrom(id, []byte{}, be64(endSeq), []byte{}))
	}
}

func be64(v uint64) []byte {
	b := make([]byte, 8)
	binary.BigEndian.PutUint64(b, v)
	return b
}

// publish buffers the batch for replay and, unless lost, sends it.
func (p *goPublisher) publish(topic string, seq uint64, raw []byte, lost bool) {
	p.t.Helper()
	p.mu.Lock()
	p.buffer[seq] = raw
	p.order = append(p.order, seq)
	p.mu.Unlock()
	if !lost {
		require.NoError(p.t, p.pub.SendMulti(zmq4.NewMsgFrom([]byte(topic), be64(seq), raw)))
	}
}

func (p *goPublisher) close() {
	_ = p.pub.Close()
	if p.router != nil {
		_ = p.router.Close()
	}
	p.wg.Wait()
}

// handshake sends probe messages on an unused topic until the subscriber has received one, so that
// the batches that follow are not lost to ZMQ's slow-joiner window.
func handshake(t *testing.T, sub *Subscriber, pubs ...*goPublisher) {
	t.Helper()
	before := sub.Stats().UnknownTopics
	require.Eventually(t, func() bool {
		for _, p := range pubs {
			_ = p.pub.SendMulti(zmq4.NewMsgFrom([]byte("probe"), be64(0), []byte{0x90}))
		}
		return sub.Stats().UnknownTopics >= before+uint64(len(pubs))
	}, 10*time.Second, 20*time.Millisecond)
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	return "tcp://" + addr
}

func newSubscriber(t *testing.T, x *kvindex.Index, mod func(*Options), eps ...Endpoint) *Subscriber {
	t.Helper()
	o := Options{Index: x, ReconnectMin: 10 * time.Millisecond, ReconnectMax: 100 * time.Millisecond}
	if mod != nil {
		mod(&o)
	}
	sub, err := New(o)
	require.NoError(t, err)
	for _, ep := range eps {
		require.NoError(t, sub.Add(ep))
	}
	require.NoError(t, sub.Start(context.Background()))
	t.Cleanup(func() { _ = sub.Close() })
	return sub
}

func streamStats(sub *Subscriber, engine state.EngineID) StreamStats {
	for _, s := range sub.Stats().Streams {
		if s.Engine == engine {
			return s
		}
	}
	return StreamStats{}
}

// TestSubscriberDialsPublisher: an engine that binds (vLLM's default) is dialed; batches in both
// encodings reach the index; malformed frames are counted.
func TestSubscriberDialsPublisher(t *testing.T) {
	addr := freeAddr(t)
	pub := newGoPublisher(t, addr, true, "")
	defer pub.close()
	x := newIndex(t, "")
	sub := newSubscriber(t, x, nil, Endpoint{Engine: eng, Address: addr, Topic: "kv"})
	handshake(t, sub, pub)
	assert.True(t, streamStats(sub, eng).Connected)

	for i := range 6 {
		ev := any(block(1, i))
		if i%2 == 1 {
			ev = storedMap([]uint64{uint64(1000 + i + 1)}, uint64(1000+i), prompt(1, i+1)[i*testBlock:], "GPU")
		}
		pub.publish("kv", uint64(i), payload(t, 0, ev), false)
	}
	require.Eventually(t, func() bool { return held(x, eng, 1, 6) == 6 }, 10*time.Second, 5*time.Millisecond)

	require.NoError(t, pub.pub.SendMulti(zmq4.NewMsgFrom([]byte("kv"), be64(6))))
	require.Eventually(t, func() bool { return sub.Stats().MalformedMessages == 1 }, 10*time.Second, 5*time.Millisecond)
	st := streamStats(sub, eng)
	assert.EqualValues(t, 6, st.StoredBlocks)
	assert.EqualValues(t, 1, st.Malformed)
	assert.Zero(t, st.Gaps)
}

// TestSubscriberBindsForDialingEngines: engines that dial out share one bound address and are told
// apart by their exact topic; a topic that merely starts like a known one is not routed.
func TestSubscriberBindsForDialingEngines(t *testing.T) {
	addr := freeAddr(t)
	x := newIndex(t, "")
	sub := newSubscriber(t, x, nil,
		Endpoint{Engine: "http://a", Address: addr, Bind: true, Topic: "a"},
		Endpoint{Engine: "http://b", Address: addr, Bind: true, Topic: "b"})
	pa := newGoPublisher(t, addr, false, "")
	defer pa.close()
	pb := newGoPublisher(t, addr, false, "")
	defer pb.close()
	handshake(t, sub, pa, pb)

	pa.publish("a", 0, payload(t, 0, block(1, 0), block(1, 1)), false)
	pb.publish("b", 0, payload(t, 0, block(2, 0)), false)
	pb.publish("ab", 1, payload(t, 0, block(3, 0)), false)
	require.Eventually(t, func() bool {
		return held(x, "http://a", 1, 2) == 2 && held(x, "http://b", 2, 1) == 1
	}, 10*time.Second, 5*time.Millisecond)
	require.Eventually(t, func() bool { return sub.Stats().UnknownTopics >= 3 }, 10*time.Second, 5*time.Millisecond)
	assert.Zero(t, held(x, "http://a", 3, 1)+held(x, "http://b", 3, 1), "topic \"ab\" is neither a nor b")
}

// TestSubscriberReconnectsAfterRestart: the publisher goes away and comes back on the same address
// numbering from 0 again: the subscriber reconnects with backoff, sees the regression, and
// rebuilds the rank.
func TestSubscriberReconnectsAfterRestart(t *testing.T) {
	addr := freeAddr(t)
	pub := newGoPublisher(t, addr, true, "")
	x := newIndex(t, "")
	sub := newSubscriber(t, x, nil, Endpoint{Engine: eng, Address: addr})
	handshake(t, sub, pub)
	for i := range 3 {
		pub.publish("", uint64(i), payload(t, 0, block(1, i)), false)
	}
	require.Eventually(t, func() bool { return held(x, eng, 1, 3) == 3 }, 10*time.Second, 5*time.Millisecond)
	pub.close()
	require.Eventually(t, func() bool { return !streamStats(sub, eng).Connected }, 10*time.Second, 5*time.Millisecond)

	pub = newGoPublisher(t, addr, true, "")
	defer pub.close()
	handshake(t, sub, pub)
	pub.publish("", 0, payload(t, 0, block(2, 0)), false)
	require.Eventually(t, func() bool { return held(x, eng, 2, 1) == 1 }, 10*time.Second, 5*time.Millisecond)
	assert.Zero(t, held(x, eng, 1, 1), "the restarted engine's old blocks were cleared")
	st := streamStats(sub, eng)
	assert.EqualValues(t, 1, st.Regressions)
	assert.True(t, st.Trusted)
}

// TestSubscriberReplaysFromRouter: a batch lost on the PUB socket is fetched from the publisher's
// ROUTER replay socket with vLLM's protocol.
func TestSubscriberReplaysFromRouter(t *testing.T) {
	addr, replay := freeAddr(t), freeAddr(t)
	pub := newGoPublisher(t, addr, true, replay)
	defer pub.close()
	x := newIndex(t, "")
	sub := newSubscriber(t, x, nil, Endpoint{Engine: eng, Address: addr, Topic: "kv", ReplayAddress: replay})
	handshake(t, sub, pub)
	pub.publish("kv", 0, payload(t, 0, block(1, 0)), false)
	pub.publish("kv", 1, payload(t, 0, block(1, 1)), true)
	pub.publish("kv", 2, payload(t, 0, block(1, 2)), false)
	require.Eventually(t, func() bool { return held(x, eng, 1, 3) == 3 }, 10*time.Second, 5*time.Millisecond)
	require.Eventually(t, func() bool { st := streamStats(sub, eng); return st.Batches == 2 && st.Trusted }, 10*time.Second, 5*time.Millisecond)
	st := streamStats(sub, eng)
	assert.EqualValues(t, 1, st.Gaps)
	assert.EqualValues(t, 1, st.Replays)
	assert.EqualValues(t, 1, st.Duplicates, "batch 2, which revealed the gap, had been replayed")
	assert.True(t, trusted(x, eng))
}

// TestSubscriberLifecycle: validation errors, Start twice, Add after Start and after Close,
// Remove, and Close stopping every goroutine (TestMain checks for leaks).
func TestSubscriberLifecycle(t *testing.T) {
	x := newIndex(t, "")
	_, err := New(Options{})
	assert.ErrorIs(t, err, state.ErrInvalidConfiguration)
	for _, o := range []Options{
		{Index: x, QueueBatches: -1},
		{Index: x, ReplayTimeout: -1},
		{Index: x, ReconnectMin: time.Second, ReconnectMax: time.Millisecond},
		{Index: x, Media: map[string]kvindex.Tier{"GPU": 0}},
		{Index: x, AdapterNames: map[int64]string{7: ""}},
	} {
		_, err := New(o)
		assert.ErrorIs(t, err, state.ErrInvalidConfiguration, "%+v", o)
	}

	sub, err := New(Options{Index: x})
	require.NoError(t, err)
	addr := freeAddr(t)
	for _, ep := range []Endpoint{
		{Address: addr},
		{Engine: "e", DPRank: -1, Address: addr},
		{Engine: "e", Address: "http://x"},
		{Engine: "e", Address: addr, ReplayAddress: "x"},
	} {
		assert.ErrorIs(t, sub.Add(ep), state.ErrInvalidConfiguration, "%+v", ep)
	}
	require.NoError(t, sub.Add(Endpoint{Engine: "e", Address: addr, Topic: "t"}))
	assert.ErrorIs(t, sub.Add(Endpoint{Engine: "e", Address: freeAddr(t)}), state.ErrInvalidConfiguration, "same engine and rank")
	assert.ErrorIs(t, sub.Add(Endpoint{Engine: "f", Address: addr, Topic: "t"}), state.ErrInvalidConfiguration, "same address and topic")

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	require.NoError(t, sub.Start(ctx))
	assert.ErrorIs(t, sub.Start(ctx), state.ErrInvalidConfiguration)
	require.NoError(t, sub.Add(Endpoint{Engine: "f", Address: addr, Topic: "u"}), "Add after Start")
	assert.Len(t, sub.Stats().Streams, 2)
	require.NoError(t, kvbridge.MarkUntrusted(x, "f", 0))
	sub.Remove("f")
	assert.Len(t, sub.Stats().Streams, 1)
	assert.True(t, trusted(x, "f"), "Remove clears the stream's mark")
	require.NoError(t, sub.Close())
	require.NoError(t, sub.Close())
	assert.True(t, errors.Is(sub.Add(Endpoint{Engine: "g", Address: addr}), ErrClosed))
	assert.True(t, errors.Is(sub.Start(ctx), ErrClosed))
}

// TestSubscriberStopsOnContext: canceling Start's context stops every goroutine the subscriber
// started, without Close.
func TestSubscriberStopsOnContext(t *testing.T) {
	addr := freeAddr(t)
	pub := newGoPublisher(t, addr, true, "")
	defer pub.close()
	sub, err := New(Options{Index: newIndex(t, ""), ReconnectMin: 10 * time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, sub.Add(Endpoint{Engine: eng, Address: addr}))
	require.NoError(t, sub.Add(Endpoint{Engine: "http://b", Address: freeAddr(t)})) // nobody there: reconnect loop
	ctx, cancel := context.WithCancel(context.Background())
	require.NoError(t, sub.Start(ctx))
	handshake(t, sub, pub)
	cancel()
	done := make(chan struct{})
	go func() { sub.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("goroutines still running 10 s after the context was canceled")
	}
	require.NoError(t, sub.Close())
}
