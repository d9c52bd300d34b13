package enginepick_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"runtime"
	"runtime/metrics"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/kvindex/kvevents"
	"github.com/enginepick/enginepick/state"
)

// heapSampler records the peak of the Go heap's live and unswept objects
// (/memory/classes/heap/objects:bytes) every millisecond until stopped. It reads runtime/metrics,
// which does not stop the world.
type heapSampler struct {
	peak atomic.Uint64
	stop chan struct{}
	done chan struct{}
}

func startHeapSampler() *heapSampler {
	h := &heapSampler{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(h.done)
		s := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
		t := time.NewTicker(time.Millisecond)
		defer t.Stop()
		for {
			metrics.Read(s)
			if v := s[0].Value.Uint64(); v > h.peak.Load() {
				h.peak.Store(v)
			}
			select {
			case <-h.stop:
				return
			case <-t.C:
			}
		}
	}()
	return h
}

func (h *heapSampler) finish() uint64 {
	close(h.stop)
	<-h.done
	return h.peak.Load()
}

// liveHeap returns the heap in use after two collections: what is still referenced.
func liveHeap() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

const mib = 1 << 20

// floodPublisher is one engine's vLLM-style KV-event publisher on loopback: a zmq4 PUB socket
// sending [topic, seq, msgpack batch] as fast as it can, every block a fresh hash over fresh
// tokens, so that nothing the flood sends is ever a block the index already holds.
type floodPublisher struct {
	engine state.EngineID
	pub    zmq4.Socket
	addr   string
	seq    uint64
	hash   uint64
	token  uint32
}

const (
	floodBlockTokens    = 16
	floodBlocksPerEvent = 8
	floodEventsPerBatch = 8
	floodBlocksPerBatch = floodBlocksPerEvent * floodEventsPerBatch
	floodTokensPerEvent = floodBlocksPerEvent * floodBlockTokens
	floodEngines        = 4
)

// floodSize returns the index's block cap and how many times the cap the flood sends: 2^14 blocks
// and 16 times, or 2^12 and 4 times under -race or -short, where decoding is many times slower.
func floodSize() (capBlocks, multiple int) {
	if raceEnabled || testing.Short() {
		return 1 << 12, 4
	}
	return 1 << 14, 16
}

func newFloodPublisher(t *testing.T, engine state.EngineID, seed uint64) *floodPublisher {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := "tcp://" + l.Addr().String()
	require.NoError(t, l.Close())
	p := &floodPublisher{engine: engine, addr: addr, hash: seed << 40, token: uint32(seed) << 28}
	p.pub = zmq4.NewPub(context.Background())
	require.NoError(t, p.pub.Listen(addr))
	t.Cleanup(func() { _ = p.pub.Close() })
	return p
}

// batch encodes the next batch: floodEventsPerBatch BlockStored events of floodBlocksPerEvent new
// blocks each, in vLLM's array form [ts, events, dp_rank], written directly in msgpack so that the
// publisher is not the bottleneck. Every block has a new hash and new tokens (a counter), so every
// block's key is new.
func (p *floodPublisher) batch() ([]byte, error) {
	b := make([]byte, 0, 16+floodEventsPerBatch*(40+9*floodBlocksPerEvent+5*floodTokensPerEvent))
	b = append(b, 0x93, 0xcb)                                // [ts (float64), events, rank]
	b = binary.BigEndian.AppendUint64(b, 0x3ff0000000000000) // 1.0
	b = append(b, 0x90|floodEventsPerBatch)
	for range floodEventsPerBatch {
		b = append(b, 0x98, 0xab) // ["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, lora_name]
		b = append(b, "BlockStored"...)
		b = append(b, 0x90|floodBlocksPerEvent)
		for range floodBlocksPerEvent {
			p.hash++
			b = binary.BigEndian.AppendUint64(append(b, 0xcf), p.hash)
		}
		b = append(b, 0xc0, 0xdc) // no parent; tokens as array16
		b = binary.BigEndian.AppendUint16(b, floodTokensPerEvent)
		for range floodTokensPerEvent {
			p.token++
			b = binary.BigEndian.AppendUint32(append(b, 0xce), p.token)
		}
		b = append(b, floodBlockTokens, 0xc0, 0xa3, 'G', 'P', 'U', 0xc0)
	}
	return append(b, 0x00), nil // rank 0
}

func (p *floodPublisher) send(topic string, payload []byte) error {
	seq := make([]byte, 8)
	binary.BigEndian.PutUint64(seq, p.seq)
	p.seq++
	return p.pub.SendMulti(zmq4.NewMsgFrom([]byte(topic), seq, payload))
}

// flood sends n batches as fast as the socket takes them.
func (p *floodPublisher) flood(n int) error {
	for range n {
		b, err := p.batch()
		if err != nil {
			return err
		}
		if err := p.send("", b); err != nil {
			return err
		}
	}
	return nil
}

// TestEventFloodKeepsTheIndexUnderItsCap floods a kvevents.Subscriber, over loopback ZMQ from four
// engines at once, with KV events whose every block is new (fresh hashes over fresh tokens: an
// adversarial publisher, or a fleet whose prompts never repeat), 16 times the index's block cap in
// all (4 times under -race), as fast as the sockets take them. The index must hold at most
// MaxBlocks blocks once each event is applied (and at most one event's blocks more while one is
// being applied), and the heap still referenced once the flood has been applied must be what it
// was when the index first filled (the cap, not the flood, sets it), within 25 % and 4 MiB. Should
// the subscriber fall behind, its bounded queues drop batches (counted, then resynchronised), which
// is part of the bound. Not parallel: it measures the heap.
func TestEventFloodKeepsTheIndexUnderItsCap(t *testing.T) {
	h, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: floodBlockTokens})
	require.NoError(t, err)
	floodCapBlocks, floodMultipleOfTheCap := floodSize()
	x, err := kvindex.NewIndex(h, kvindex.Options{MaxBlocks: floodCapBlocks})
	require.NoError(t, err)
	sub, err := kvevents.New(kvevents.Options{Index: x, ReconnectMin: 10 * time.Millisecond, ReconnectMax: 100 * time.Millisecond})
	require.NoError(t, err)
	pubs := make([]*floodPublisher, floodEngines)
	for i := range pubs {
		pubs[i] = newFloodPublisher(t, state.EngineID(fmt.Sprintf("http://engine-%d", i)), uint64(i+1))
		require.NoError(t, sub.Add(kvevents.Endpoint{Engine: pubs[i].engine, Address: pubs[i].addr}))
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	require.NoError(t, sub.Start(ctx))
	defer func() { require.NoError(t, sub.Close()) }()

	// Wait until every stream is connected: probes on a topic no endpoint names are counted.
	require.Eventually(t, func() bool {
		for _, p := range pubs {
			_ = p.pub.SendMulti(zmq4.NewMsgFrom([]byte("probe"), make([]byte, 8), []byte{0x90}))
		}
		return sub.Stats().UnknownTopics >= floodEngines
	}, 30*time.Second, 20*time.Millisecond, "subscriber connected")

	var maxBlocks atomic.Int64
	stopWatch := make(chan struct{})
	var watch sync.WaitGroup
	watch.Go(func() {
		for {
			if b := int64(x.Stats().Blocks); b > maxBlocks.Load() {
				maxBlocks.Store(b)
			}
			select {
			case <-stopWatch:
				return
			case <-time.After(time.Millisecond):
			}
		}
	})

	// drain waits until every stream has handled the last batch its publisher sent, so that no
	// batch is left in a socket or a queue: one marker batch (one event of new blocks) per
	// stream, re-sent only if a stream has not moved for a second (its marker was dropped).
	drain := func() {
		t.Helper()
		lastSent := make([]time.Time, len(pubs))
		require.Eventually(t, func() bool {
			done := true
			stats := sub.Stats().Streams
			for i, p := range pubs {
				var st kvevents.StreamStats
				for _, s := range stats {
					if s.Engine == p.engine {
						st = s
					}
				}
				if st.Batches > 0 && st.LastSeq == p.seq-1 && !lastSent[i].IsZero() {
					continue
				}
				done = false
				if time.Since(lastSent[i]) > time.Second {
					b, err := p.batch()
					require.NoError(t, err)
					require.NoError(t, p.send("", b))
					lastSent[i] = time.Now()
				}
			}
			return done
		}, 2*time.Minute, 10*time.Millisecond, "every stream handled its publisher's last batch")
	}
	flood := func(blocks int) {
		t.Helper()
		var wg sync.WaitGroup
		errs := make([]error, len(pubs))
		for i, p := range pubs {
			wg.Go(func() { errs[i] = p.flood(blocks / floodEngines / floodBlocksPerBatch) })
		}
		wg.Wait()
		for _, err := range errs {
			require.NoError(t, err)
		}
		drain()
	}

	base := liveHeap()
	sampler := startHeapSampler()
	flood(floodCapBlocks) // fills the index once
	atCap := liveHeap()
	flood((floodMultipleOfTheCap - 1) * floodCapBlocks)
	peak := sampler.finish()
	after := liveHeap()
	close(stopWatch)
	watch.Wait()

	var stored, drops, batches uint64
	for _, s := range sub.Stats().Streams {
		stored += s.StoredBlocks
		drops += s.Drops
		batches += s.Batches
	}
	st := x.Stats()
	t.Logf("sent %d blocks in %d batches; applied %d blocks (%d batches dropped by full queues); index %d blocks (cap %d, max seen %d), %d evicted",
		floodMultipleOfTheCap*floodCapBlocks, floodMultipleOfTheCap*floodCapBlocks/floodBlocksPerBatch, stored, drops,
		st.Blocks, floodCapBlocks, maxBlocks.Load(), st.EvictedBlocks)
	t.Logf("heap: %.1f MiB before, %.1f MiB live at the cap, %.1f MiB live after the flood, %.1f MiB peak (live and garbage)",
		float64(base)/mib, float64(atCap)/mib, float64(after)/mib, float64(peak)/mib)

	// A Store applies its blocks, then evicts down to the cap: a reader in between sees at most
	// one event's new blocks above it. Once the writes have returned, the cap holds.
	assert.LessOrEqual(t, maxBlocks.Load(), int64(floodCapBlocks+floodBlocksPerEvent), "blocks seen while events were applied")
	assert.LessOrEqual(t, st.Blocks, floodCapBlocks, "blocks once every event was applied")
	assert.Greater(t, stored, uint64(2*floodCapBlocks), "the flood reached the index well past its cap")
	assert.Positive(t, st.EvictedBlocks, "the cap evicted")
	assert.LessOrEqual(t, after, atCap+atCap/4+4*mib, "live heap after a flood of %d× the cap, against the heap at the cap", floodMultipleOfTheCap)
}

// TestAffinityKeyFloodIsBoundedByTheIdleTimeout binds a flood of distinct session keys, one per
// millisecond of the store's clock, with a sweep every tenth of the idle timeout: the store never
// holds more than the keys of the last idle timeout plus one sweep interval, and the heap it holds
// after 200,000 keys is what it held after 50,000 (40,000 and 10,000 under -race): the idle
// timeout, not the length of the flood, sets it. Once the flood stops and the idle timeout passes, a sweep empties the store; the heap then
// keeps the store's peak-sized maps (Go maps do not shrink), not the flood. This is the only bound
// MemoryStore has: it has no cap on bindings (docs/RELIABILITY.md §6).
func TestAffinityKeyFloodIsBoundedByTheIdleTimeout(t *testing.T) {
	var ns atomic.Int64
	ns.Store(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	now := func() time.Time { return time.Unix(0, ns.Load()) }
	// One key per millisecond of the store's clock; a sweep every tenth of the idle timeout.
	idle, short, long := 5*time.Second, 50_000, 200_000
	if raceEnabled || testing.Short() {
		idle, short, long = time.Second, 10_000, 40_000
	}
	sweepEvery := int(idle/time.Millisecond) / 10
	store, err := affinity.NewMemoryStore(affinity.Options{IdleTimeout: idle, Now: now})
	require.NoError(t, err)
	ctx := context.Background()
	maxLen, key := 0, 0
	flood := func(n int) {
		t.Helper()
		for range n {
			scope := affinity.Scope{Namespace: "session", Model: "m", BucketID: "b", Key: fmt.Sprintf("flood-%08d", key)}
			_, err := store.Bind(ctx, scope, state.EngineID(fmt.Sprintf("http://engine-%d", key%8)))
			require.NoError(t, err)
			ns.Add(int64(time.Millisecond))
			if key++; key%sweepEvery == 0 {
				maxLen = max(maxLen, store.Len()) // the most the store holds: just before a sweep
				store.Sweep()
			}
		}
	}
	base := liveHeap()
	peak := startHeapSampler()
	flood(short)
	afterShort := liveHeap()
	flood(long - short)
	afterLong := liveHeap()
	peakHeap := peak.finish()
	// A binding lives idle / 1 ms binds; sweeps come every sweepEvery binds.
	bound := int(idle/time.Millisecond) + sweepEvery
	ns.Add(int64(idle))
	swept := store.Sweep()
	emptied := liveHeap()
	t.Logf("%d keys, one per ms, idle %v: at most %d bindings held (bound %d); heap %.1f MiB before, %.1f MiB after %d keys, %.1f MiB after %d, %.1f MiB once all expired and swept; peak heap %.1f MiB",
		key, idle, maxLen, bound, float64(base)/mib, float64(afterShort)/mib, short, float64(afterLong)/mib, long, float64(emptied)/mib, float64(peakHeap)/mib)
	assert.LessOrEqual(t, maxLen, bound, "bindings held during the flood")
	assert.LessOrEqual(t, afterLong, afterShort+afterShort/4+mib, "the heap after %d keys against the heap after %d", long, short)
	assert.Positive(t, swept)
	assert.Zero(t, store.Len(), "every binding expired and was swept")
	assert.LessOrEqual(t, emptied, afterLong, "nothing grows once the bindings are gone")
	runtime.KeepAlive(store)
}

// TestAffinityKeyFloodIsBoundedByMaxBindings floods a MemoryStore with a cap of 4,096 bindings and
// the default idle timeout (600 s: time alone would keep every key) with distinct session keys, as
// fast as one goroutine binds them: the store never holds more than its cap, every binding beyond
// it is an eviction, and the heap after 200,000 keys (40,000 under -race) is what it was after a
// quarter of them. It reports the peak heap during the flood.
func TestAffinityKeyFloodIsBoundedByMaxBindings(t *testing.T) {
	const maxBindings = 4096
	short, long := 50_000, 200_000
	if raceEnabled || testing.Short() {
		short, long = 10_000, 40_000
	}
	store, err := affinity.NewMemoryStore(affinity.Options{MaxBindings: maxBindings})
	require.NoError(t, err)
	ctx := context.Background()
	most, key := 0, 0
	flood := func(n int) {
		t.Helper()
		for range n {
			scope := affinity.Scope{Namespace: "session", Model: "m", BucketID: "b", Key: fmt.Sprintf("flood-%08d", key)}
			_, err := store.Bind(ctx, scope, state.EngineID(fmt.Sprintf("http://engine-%d", key%8)))
			require.NoError(t, err)
			if key++; key%256 == 0 {
				most = max(most, store.Len())
			}
		}
	}
	base := liveHeap()
	peak := startHeapSampler()
	flood(short)
	afterShort := liveHeap()
	flood(long - short)
	afterLong := liveHeap()
	peakHeap := peak.finish()
	t.Logf("%d keys, cap %d: at most %d bindings held, %d evicted; live heap %.1f MiB before, %.1f MiB after %d keys, %.1f MiB after %d; peak heap %.1f MiB",
		key, maxBindings, most, store.Evicted(), float64(base)/mib, float64(afterShort)/mib, short, float64(afterLong)/mib, long, float64(peakHeap)/mib)
	assert.LessOrEqual(t, most, maxBindings, "bindings held during the flood")
	assert.Equal(t, maxBindings, store.Len(), "the store is full, not emptied")
	assert.Equal(t, uint64(long-maxBindings), store.Evicted(), "every binding beyond the cap was evicted")
	assert.LessOrEqual(t, afterLong, afterShort+afterShort/4+mib, "the heap after %d keys against the heap after %d", long, short)
	runtime.KeepAlive(store)
}

// BenchmarkAffinityBindingBytes reports the heap one MemoryStore binding holds (bytes/binding),
// for 100,000 bindings with 16-byte keys: multiply by the bindings a flood can create within one
// idle timeout (rate × IdleTimeout) for the memory a key flood can claim.
func BenchmarkAffinityBindingBytes(b *testing.B) {
	const n = 100_000
	scopes := make([]affinity.Scope, n)
	for i := range scopes {
		scopes[i] = affinity.Scope{Namespace: "session", Model: "m", BucketID: "b", Key: fmt.Sprintf("flood-%010d", i)}
	}
	ctx := context.Background()
	var perBinding float64
	for b.Loop() {
		store, err := affinity.NewMemoryStore(affinity.Options{})
		require.NoError(b, err)
		before := liveHeap()
		for i := range scopes {
			if _, err := store.Bind(ctx, scopes[i], "http://engine-0"); err != nil {
				b.Fatal(err)
			}
		}
		perBinding = float64(liveHeap()-before) / n
		runtime.KeepAlive(store)
	}
	b.ReportMetric(perBinding, "bytes/binding")
}

// BenchmarkIndexFloodHeap stores 16 times an index's block cap of new blocks (8-block events with
// fresh hashes over fresh tokens, one engine, one writer) straight into kvindex.Index and reports
// the live heap once the index first filled (MiB-at-cap, and per block: B/block-at-cap), the live
// heap after the flood against it (after/at-cap), and the peak heap during the flood, garbage
// included (peak-MiB). Caps of 2^16 and 2^20 blocks; run with -benchtime 1x.
func BenchmarkIndexFloodHeap(b *testing.B) {
	for _, capBlocks := range []int{1 << 16, 1 << 20} {
		b.Run(fmt.Sprintf("cap=%d", capBlocks), func(b *testing.B) {
			h, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: floodBlockTokens})
			require.NoError(b, err)
			var atCap, after, peak uint64
			for b.Loop() {
				x, err := kvindex.NewIndex(h, kvindex.Options{MaxBlocks: capBlocks})
				require.NoError(b, err)
				base := liveHeap()
				sampler := startHeapSampler()
				hashes := make([]uint64, floodBlocksPerEvent)
				tokens := make([]uint32, floodTokensPerEvent)
				var hash uint64
				var token uint32
				store := func(blocks int) {
					for range blocks / floodBlocksPerEvent {
						for i := range hashes {
							hash++
							hashes[i] = hash
						}
						for i := range tokens {
							token++
							tokens[i] = token
						}
						if err := x.Store(kvindex.StoreEvent{Engine: "http://engine-0", BlockHashes: hashes, TokenIDs: tokens, Tier: kvindex.TierDevice}); err != nil {
							b.Fatal(err)
						}
					}
				}
				store(capBlocks)
				atCap = liveHeap() - base
				store(15 * capBlocks)
				after = liveHeap() - base
				peak = sampler.finish() - base
				if got := x.Stats().Blocks; got > capBlocks {
					b.Fatalf("index holds %d blocks, cap %d", got, capBlocks)
				}
				runtime.KeepAlive(x)
			}
			b.ReportMetric(float64(atCap)/mib, "MiB-at-cap")
			b.ReportMetric(float64(atCap)/float64(capBlocks), "B/block-at-cap")
			b.ReportMetric(float64(after)/float64(atCap), "after/at-cap")
			b.ReportMetric(float64(peak)/mib, "peak-MiB")
		})
	}
}
