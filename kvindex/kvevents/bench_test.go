package kvevents

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/enginepick/enginepick/internal/kvwire"
	"github.com/enginepick/enginepick/kvindex"
)

// Figures: docs/performance.md, "kvindex/kvevents". Run with
//
//	go test -run '^$' -bench . -benchmem -cpu 1 ./kvindex/kvevents/
//
// -cpu 1 is the "one core" of the end-to-end target: the publisher, the receive goroutine, the
// apply goroutine and the benchmark loop share one P.

const benchBlockTokens = 16 // vLLM's default block size

// BenchmarkDecode64 decodes one BlockStored batch of 64 blocks of 16 tokens (1,024 token IDs), in
// the legacy array encoding and the current map encoding; tokens=library decodes every token
// through the msgpack library instead of the inline path (the baseline of the inline path).
// events/s is batches per second (one event per batch); blocks/s is 64 times that.
func BenchmarkDecode64(b *testing.B) {
	for _, c := range []struct {
		form    string
		library bool
	}{{"array", false}, {"map", false}, {"array", true}} {
		name := "form=" + c.form
		if c.library {
			name += ",tokens=library"
		}
		b.Run(name, func(b *testing.B) {
			raw := batch64(b, c.form, benchBlockTokens)
			d := kvwire.NewDecoder()
			d.NoFast = c.library
			var batch kvwire.Batch
			b.SetBytes(int64(len(raw)))
			b.ReportAllocs()
			for b.Loop() {
				if err := d.Decode(raw, &batch); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "events/s")
			b.ReportMetric(64*float64(b.N)/b.Elapsed().Seconds(), "blocks/s")
		})
	}
}

// eventRing is a ring of pre-encoded batches for one engine: even entries store a 64-block chain
// (a distinct prompt per pair), odd entries remove it, so the index stays bounded however long
// the benchmark runs. Each batch moves 64 blocks.
type eventRing struct {
	payloads [][]byte
	stores   []kvindex.StoreEvent
	removes  [][]uint64
}

func newEventRing(b *testing.B, pairs int) *eventRing {
	r, err := makeEventRing(pairs)
	require.NoError(b, err)
	return r
}

func makeEventRing(pairs int) (*eventRing, error) {
	r := &eventRing{}
	for p := range pairs {
		toks := make([]uint32, 64*benchBlockTokens)
		for i := range toks {
			toks[i] = uint32(p*1_000_003+i*7919) % 151_000
		}
		hashes := hashRange(uint64(p)<<20, 64)
		store, err := msgpack.Marshal([]any{1789095808.83, []any{
			[]any{"BlockStored", hashes, nil, toks, benchBlockTokens, nil, "GPU", nil, nil, nil, nil, nil}}, 0})
		if err != nil {
			return nil, err
		}
		remove, err := msgpack.Marshal([]any{1789095808.83, []any{[]any{"BlockRemoved", hashes, "GPU", nil}}, 0})
		if err != nil {
			return nil, err
		}
		r.payloads = append(r.payloads, store, remove)
		r.stores = append(r.stores, kvindex.StoreEvent{Engine: eng, BlockHashes: hashes, TokenIDs: toks, Tier: kvindex.TierDevice})
		r.removes = append(r.removes, hashes)
	}
	return r, nil
}

func benchIndex(b *testing.B) *kvindex.Index {
	h, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: benchBlockTokens})
	require.NoError(b, err)
	x, err := kvindex.NewIndex(h, kvindex.Options{})
	require.NoError(b, err)
	return x
}

// BenchmarkIndexOnly is the baseline: the ring's events applied to the index directly, already
// decoded (kvindex's own rate, measured in the same run).
func BenchmarkIndexOnly(b *testing.B) {
	r := newEventRing(b, 512)
	x := benchIndex(b)
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		k := i % (2 * len(r.stores))
		if k%2 == 0 {
			if err := x.Store(r.stores[k/2]); err != nil {
				b.Fatal(err)
			}
		} else if err := x.Remove(eng, 0, r.removes[k/2], 0); err != nil {
			b.Fatal(err)
		}
		i++
	}
	b.ReportMetric(64*float64(b.N)/b.Elapsed().Seconds(), "blocks/s")
}

// BenchmarkDecodeApply decodes each batch of the ring and applies it through the stream's
// applier: everything a subscriber does per batch except the socket.
func BenchmarkDecodeApply(b *testing.B) {
	r := newEventRing(b, 512)
	x := benchIndex(b)
	sub, err := New(Options{Index: x})
	require.NoError(b, err)
	a := newApplier(eng, 0, &sub.opts)
	d := kvwire.NewDecoder()
	var batch kvwire.Batch
	var c counters
	report := func(e *StreamError) { b.Fatal(e) }
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		if err := d.Decode(r.payloads[i%len(r.payloads)], &batch); err != nil {
			b.Fatal(err)
		}
		a.apply(&batch, uint64(i), &c, report)
		i++
	}
	b.ReportMetric(64*float64(b.N)/b.Elapsed().Seconds(), "blocks/s")
}

// BenchmarkZMQToIndex is the end-to-end path: a zmq4 PUB socket on loopback TCP sends the ring's
// batches (vLLM framing, one sequence number per batch) to a Subscriber that decodes and applies
// them to the index. The publisher keeps at most half a queue of batches in flight, so nothing is
// dropped; the benchmark fails if any batch is lost or refused. blocks/s counts stored plus
// removed blocks.
func BenchmarkZMQToIndex(b *testing.B) {
	r := newEventRing(b, 512)
	x := benchIndex(b)
	addr := "tcp://127.0.0.1:0"
	pub := zmq4.NewPub(context.Background())
	require.NoError(b, pub.Listen(addr))
	defer pub.Close()
	addr = "tcp://" + pub.Addr().String()

	sub, err := New(Options{Index: x, OnError: func(e *StreamError) { panic(e) }})
	require.NoError(b, err)
	require.NoError(b, sub.Add(Endpoint{Engine: eng, Address: addr, Topic: "kv"}))
	require.NoError(b, sub.Start(context.Background()))
	defer sub.Close()
	st := sub.streams[streamKey{eng, 0}]
	deadline := time.Now().Add(10 * time.Second)
	for sub.Stats().UnknownTopics == 0 {
		require.True(b, time.Now().Before(deadline), "no subscription")
		_ = pub.SendMulti(zmq4.NewMsgFrom([]byte("probe"), be64(0), []byte{0x90}))
		time.Sleep(5 * time.Millisecond)
	}

	window := uint64(defaultQueueBatches / 2)
	var seq uint64
	b.ReportAllocs()
	cpu0 := cpuTime(b)
	b.ResetTimer()
	for range b.N {
		for seq >= window && seq-window >= st.stats().Batches {
			time.Sleep(20 * time.Microsecond)
		}
		if err := pub.SendMulti(zmq4.NewMsgFrom([]byte("kv"), be64(seq), r.payloads[seq%uint64(len(r.payloads))])); err != nil {
			b.Fatal(err)
		}
		seq++
	}
	for st.stats().Batches < seq {
		time.Sleep(20 * time.Microsecond)
	}
	b.StopTimer()
	cpu := cpuTime(b) - cpu0
	s := st.stats()
	if s.Gaps+s.Drops+s.Rejected+s.Malformed != 0 {
		b.Fatalf("lost or refused batches: %+v", s)
	}
	blocks := float64(s.StoredBlocks + s.RemovedBlocks)
	b.ReportMetric(blocks/b.Elapsed().Seconds(), "blocks/s")
	// CPU time of the whole process (publisher included), so that the figure holds on a machine
	// shared with other work, where wall-clock rates fall with the CPU share the process gets.
	b.ReportMetric(blocks/cpu.Seconds(), "blocks/cpu-s")
}

// cpuTime is the process's user + system CPU time so far.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	require.NoError(b, syscall.Getrusage(syscall.RUSAGE_SELF, &ru))
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// benchPublisherEnv makes the test binary run as BenchmarkZMQToIndexSubscriberOnly's publisher.
const benchPublisherEnv = "KVEVENTS_BENCH_PUBLISHER"

// runBenchPublisher is the child process of BenchmarkZMQToIndexSubscriberOnly: it binds a zmq4
// PUB socket at addr, sends probe messages until it reads "go", then, for each line "send N", sends
// the next N batches of the event ring (topic "kv", consecutive sequence numbers). It exits at the
// end of its input.
func runBenchPublisher(addr string) int {
	r, err := makeEventRing(512)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	pub := zmq4.NewPub(context.Background())
	defer pub.Close()
	if err := pub.Listen(addr); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	cmds := make(chan string)
	go func() {
		defer close(cmds)
		sc := bufio.NewScanner(os.Stdin)
		for sc.Scan() {
			cmds <- sc.Text()
		}
	}()
	for started := false; !started; {
		select {
		case c := <-cmds:
			started = c == "go"
		case <-time.After(5 * time.Millisecond):
			_ = pub.SendMulti(zmq4.NewMsgFrom([]byte("probe"), be64(0), []byte{0x90}))
		}
	}
	var seq uint64
	for c := range cmds {
		var n int
		if _, err := fmt.Sscanf(c, "send %d", &n); err != nil {
			continue
		}
		for range n {
			if err := pub.SendMulti(zmq4.NewMsgFrom([]byte("kv"), be64(seq), r.payloads[seq%uint64(len(r.payloads))])); err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 1
			}
			seq++
		}
	}
	return 0
}

// BenchmarkZMQToIndexSubscriberOnly is BenchmarkZMQToIndex with the publisher in a child process
// (this test binary, re-run as a publisher), so that the benchmark process holds only the
// subscriber side: zmq4's reader, the receive and apply goroutines, the index. With -cpu 1 that
// side has one P; blocks/cpu-s divides by this process's CPU time alone. The publisher sends in
// chunks of 128 batches, at most half a queue ahead of what has been applied.
func BenchmarkZMQToIndexSubscriberOnly(b *testing.B) {
	x := benchIndex(b)
	addr := freeAddrB(b)
	exe, err := os.Executable()
	require.NoError(b, err)
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), benchPublisherEnv+"="+addr)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	require.NoError(b, err)
	require.NoError(b, cmd.Start())
	defer func() { _ = stdin.Close(); _ = cmd.Wait() }()

	sub, err := New(Options{Index: x, ReconnectMin: 10 * time.Millisecond, OnError: func(e *StreamError) { panic(e) }})
	require.NoError(b, err)
	require.NoError(b, sub.Add(Endpoint{Engine: eng, Address: addr, Topic: "kv"}))
	require.NoError(b, sub.Start(context.Background()))
	defer sub.Close()
	st := sub.streams[streamKey{eng, 0}]
	deadline := time.Now().Add(20 * time.Second)
	for sub.Stats().UnknownTopics == 0 {
		require.True(b, time.Now().Before(deadline), "no probe from the publisher")
		time.Sleep(5 * time.Millisecond)
	}
	_, err = io.WriteString(stdin, "go\n")
	require.NoError(b, err)

	const chunk = 128
	window := uint64(defaultQueueBatches / 2)
	var sent uint64
	b.ReportAllocs()
	cpu0 := cpuTime(b)
	b.ResetTimer()
	for sent < uint64(b.N) {
		for sent >= window && sent-window >= st.stats().Batches {
			time.Sleep(50 * time.Microsecond)
		}
		n := min(chunk, uint64(b.N)-sent)
		_, err := fmt.Fprintf(stdin, "send %d\n", n)
		require.NoError(b, err)
		sent += n
	}
	for st.stats().Batches < sent {
		time.Sleep(50 * time.Microsecond)
	}
	b.StopTimer()
	cpu := cpuTime(b) - cpu0
	s := st.stats()
	if s.Gaps+s.Drops+s.Rejected+s.Malformed != 0 {
		b.Fatalf("lost or refused batches: %+v", s)
	}
	blocks := float64(s.StoredBlocks + s.RemovedBlocks)
	b.ReportMetric(blocks/b.Elapsed().Seconds(), "blocks/s")
	b.ReportMetric(blocks/cpu.Seconds(), "blocks/cpu-s")
}

func freeAddrB(b *testing.B) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(b, err)
	addr := l.Addr().String()
	require.NoError(b, l.Close())
	return "tcp://" + addr
}
