package kvindex

import (
	"bufio"
	"compress/gzip"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"runtime"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/cespare/xxhash/v2"

	"github.com/enginepick/enginepick/state"
)

// Benchmarks against llm-d-kv-cache, the best-known existing Go index (328 µs to hash 8,192 tokens,
// ~990 µs for a 512-block lookup, 0.78 M block-adds/s, 734 bytes per (block, engine)). Run with
//
//	go test -run x -bench . -benchmem ./kvindex/
//
// docs/performance.md records the figures and the exact commands.

const benchBlock = 16

func benchHasher(b *testing.B) Hasher {
	h, err := NewHasher(HasherConfig{BlockTokens: benchBlock})
	if err != nil {
		b.Fatal(err)
	}
	return h
}

// mix is a deterministic token generator (splitmix64 finalizer).
func mix(v uint64) uint32 {
	v ^= v >> 30
	v *= 0xBF58476D1CE4E5B9
	v ^= v >> 27
	v *= 0x94D049BB133111EB
	v ^= v >> 31
	return uint32(v)
}

// tokensOf appends n deterministic tokens of stream id.
func tokensOf(dst []uint32, id uint64, n int) []uint32 {
	for i := range n {
		dst = append(dst, mix(id<<20|uint64(i)))
	}
	return dst
}

// BenchmarkHash: one chained key per 16-token block (llm-d-kv-cache: 328 µs for 8,192 tokens).
func BenchmarkHash(b *testing.B) {
	h := benchHasher(b)
	for _, n := range []int{512, 2048, 8192, 32768} {
		b.Run(fmt.Sprintf("tokens=%d", n), func(b *testing.B) {
			tokens := tokensOf(nil, 1, n)
			dst := make([]uint64, 0, n/benchBlock)
			b.SetBytes(int64(4 * n))
			b.ReportAllocs()
			for b.Loop() {
				dst = h.AppendKeys(dst[:0], tokens)
			}
		})
	}
}

// BenchmarkHashAlternatives compares the chaining forms considered (hash.go explains the choice):
// "chosen" hashes each block's content and folds it in with XXH64's merge step; "serial-digest"
// runs XXH64 over le64(parent) ‖ tokens, so each block's whole digest waits for the previous key;
// "stream-digest" streams one digest over the whole prompt and takes its Sum64 at every block
// boundary (one pass, no chaining step; docs/performance.md); "content-only" is the floor, one
// xxhash.Sum64 per block and nothing else.
func BenchmarkHashAlternatives(b *testing.B) {
	h := benchHasher(b)
	tokens := tokensOf(nil, 1, 8192)
	dst := make([]uint64, 0, 512)
	b.Run("chosen", func(b *testing.B) {
		b.SetBytes(4 * 8192)
		for b.Loop() {
			dst = h.AppendKeys(dst[:0], tokens)
		}
	})
	b.Run("serial-digest", func(b *testing.B) {
		b.SetBytes(4 * 8192)
		var buf [8 + 4*benchBlock]byte
		for b.Loop() {
			dst = dst[:0]
			key := h.root
			for t := tokens; len(t) >= benchBlock; t = t[benchBlock:] {
				binary.LittleEndian.PutUint64(buf[:8], key)
				copy(buf[8:], unsafe.Slice((*byte)(unsafe.Pointer(&t[0])), 4*benchBlock))
				key = xxhash.Sum64(buf[:])
				dst = append(dst, key)
			}
		}
	})
	b.Run("stream-digest", func(b *testing.B) {
		// One xxhash.Digest streamed over the whole prompt, its Sum64 taken at every block
		// boundary: keys that chain by construction (each is the XXH64 of the whole prefix).
		b.SetBytes(4 * 8192)
		bytes := unsafe.Slice((*byte)(unsafe.Pointer(&tokens[0])), 4*len(tokens))
		var d xxhash.Digest
		for b.Loop() {
			dst = dst[:0]
			d.Reset()
			for t := bytes; len(t) >= 4*benchBlock; t = t[4*benchBlock:] {
				_, _ = d.Write(t[:4*benchBlock])
				dst = append(dst, d.Sum64())
			}
		}
	})
	b.Run("content-only", func(b *testing.B) {
		// The floor: one xxhash.Sum64 per 64-byte block and nothing else.
		b.SetBytes(4 * 8192)
		for b.Loop() {
			dst = dst[:0]
			for t := tokens; len(t) >= benchBlock; t = t[benchBlock:] {
				dst = append(dst, xxhash.Sum64(unsafe.Slice((*byte)(unsafe.Pointer(&t[0])), 4*benchBlock)))
			}
		}
	})
}

// fleet is a realistic tree: 64 engines holding 10,000 blocks each. Every engine holds a shared
// 64-block system prompt; 16 documents of 192 blocks follow it, each engine holding two; the rest
// of each engine's blocks are its own 256-block conversations branching off its documents.
type fleet struct {
	x     *Index
	h     Hasher
	query []uint64 // 512 blocks: system ‖ document ‖ engine 0's first conversation
}

const (
	fleetEngines   = 64
	fleetBlocks    = 10_000
	fleetSystem    = 64
	fleetDoc       = 192
	fleetDocs      = 16
	fleetConvBlock = 256
)

var (
	fleetOnce sync.Once
	fleetVal  *fleet
	fleetErr  error
)

var engineIDs = func() []state.EngineID {
	ids := make([]state.EngineID, 1024)
	for e := range ids {
		ids[e] = state.EngineID(fmt.Sprintf("http://10.0.%d.%d:8000", e/256, e%256))
	}
	return ids
}()

func engineID(e int) state.EngineID { return engineIDs[e] }

// storeChain stores tokens as one event of engine e, chained under parent (engine hash, 0 for
// none), with engine hashes derived from the index's keys, and returns the last block's hash.
func storeChain(x *Index, e int, rank int, parent uint64, parentKey uint64, tokens []uint32, keyBuf *[]uint64, hashBuf *[]uint64) (uint64, uint64, error) {
	h := x.Hasher()
	*keyBuf = h.appendFrom((*keyBuf)[:0], parentKey, tokens)
	*hashBuf = (*hashBuf)[:0]
	salt := uint64(e+1) * 0x9E3779B97F4A7C15
	for _, k := range *keyBuf {
		*hashBuf = append(*hashBuf, k^salt)
	}
	ev := StoreEvent{Engine: engineID(e), DPRank: rank, BlockHashes: *hashBuf, TokenIDs: tokens, Tier: TierDevice}
	if parent != 0 {
		ev.HasParent, ev.ParentHash = true, parent
	}
	if err := x.Store(ev); err != nil {
		return 0, 0, err
	}
	n := len(*hashBuf)
	return (*hashBuf)[n-1], (*keyBuf)[n-1], nil
}

func buildFleet() (*fleet, error) {
	h, err := NewHasher(HasherConfig{BlockTokens: benchBlock})
	if err != nil {
		return nil, err
	}
	x, err := NewIndex(h, Options{MaxBlocks: 1 << 23})
	if err != nil {
		return nil, err
	}
	system := tokensOf(nil, 1, fleetSystem*benchBlock)
	docs := make([][]uint32, fleetDocs)
	for d := range docs {
		docs[d] = tokensOf(append([]uint32(nil), system...), uint64(100+d), fleetDoc*benchBlock)
	}
	var keys, hs []uint64
	var conv []uint32
	f := &fleet{x: x, h: h}
	for e := range fleetEngines {
		held := fleetSystem
		var docHash, docKey [2]uint64
		for i, d := range []int{e % fleetDocs, (e + 5) % fleetDocs} {
			if docHash[i], docKey[i], err = storeChain(x, e, 0, 0, h.root, docs[d], &keys, &hs); err != nil {
				return nil, err
			}
			held += fleetDoc
		}
		for c := 0; held < fleetBlocks; c++ {
			n := min(fleetConvBlock, fleetBlocks-held)
			conv = tokensOf(conv[:0], uint64(1_000_000+e*1000+c), n*benchBlock)
			if _, _, err = storeChain(x, e, 0, docHash[c%2], docKey[c%2], conv, &keys, &hs); err != nil {
				return nil, err
			}
			held += n
			if e == 0 && c == 0 {
				f.query = h.Keys(append(append([]uint32(nil), docs[0]...), conv...))
			}
		}
	}
	if len(f.query) != 512 {
		return nil, fmt.Errorf("query has %d blocks", len(f.query))
	}
	return f, nil
}

func getFleet(b *testing.B) *fleet {
	fleetOnce.Do(func() { fleetVal, fleetErr = buildFleet() })
	if fleetErr != nil {
		b.Fatal(fleetErr)
	}
	return fleetVal
}

// BenchmarkMatch512: a 512-block query against 64 engines × 10,000 blocks (llm-d-kv-cache: ~990 µs).
// "deep" is held completely by one engine, to depth 256 by its document's other engines and to
// depth 64 by everyone; "shallow" diverges after the system prompt.
func BenchmarkMatch512(b *testing.B) {
	f := getFleet(b)
	var m matches
	f.x.matchInto(f.query, &m)
	if m.Engines[0].Blocks != 512 || len(m.Engines) != fleetEngines {
		b.Fatalf("unexpected match: %d engines, top %v", len(m.Engines), m.Engines[0])
	}
	b.Logf("tree: %d blocks; deep query: %d engines, top %v, second %v", f.x.Stats().Blocks, len(m.Engines), m.Engines[0], m.Engines[1])
	shallow := f.h.Keys(append(tokensOf(nil, 1, fleetSystem*benchBlock), tokensOf(nil, 999, (512-fleetSystem)*benchBlock)...))
	for _, c := range []struct {
		name string
		keys []uint64
	}{{"deep", f.query}, {"shallow", shallow}} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				f.x.matchInto(c.keys, &m)
			}
		})
	}
	b.Run("hash+match", func(b *testing.B) {
		tokens := append(append([]uint32(nil), tokensOf(nil, 1, fleetSystem*benchBlock)...), tokensOf(nil, 5, 448*benchBlock)...)
		keys := make([]uint64, 0, 512)
		b.ReportAllocs()
		for b.Loop() {
			keys = f.h.AppendKeys(keys[:0], tokens)
			f.x.matchInto(keys, &m)
		}
	})
}

// BenchmarkMatchParallel measures Match throughput with every core matching, with and without a
// writer applying events at the same time (the RWMutex choice in doc.go).
func BenchmarkMatchParallel(b *testing.B) {
	f := getFleet(b)
	for _, writer := range []bool{false, true} {
		b.Run(fmt.Sprintf("writer=%v", writer), func(b *testing.B) {
			stop := make(chan struct{})
			var wg sync.WaitGroup
			var written int
			if writer {
				wg.Go(func() {
					var keys, hs []uint64
					conv := tokensOf(nil, 77, 32*benchBlock)
					for {
						select {
						case <-stop:
							return
						default:
						}
						last, _, err := storeChain(f.x, fleetEngines, 0, 0, f.h.root, conv, &keys, &hs)
						if err != nil || last == 0 {
							panic(err)
						}
						if err := f.x.Remove(engineID(fleetEngines), 0, hs, 0); err != nil {
							panic(err)
						}
						written += 64
					}
				})
			}
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				var m matches
				for pb.Next() {
					f.x.matchInto(f.query, &m)
				}
			})
			close(stop)
			wg.Wait()
			if writer {
				b.ReportMetric(float64(written)/b.Elapsed().Seconds(), "writer-blocks/s")
			}
		})
	}
}

// BenchmarkMatchMooncake loads the Mooncake conversation trace into 16 engines (requests
// round-robin; each hash_id is 512 deterministic tokens, 32 blocks of 16) and matches a
// 512-block query taken from a late request. The trace is the one embedded in package sim
// (internal/sim/traces/mooncake_conversation.jsonl.gz), read from the file because sim imports kvindex.
func BenchmarkMatchMooncake(b *testing.B) {
	f, err := os.Open("../internal/sim/traces/mooncake_conversation.jsonl.gz")
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	file, err := gzip.NewReader(f)
	if err != nil {
		b.Fatal(err)
	}
	h := benchHasher(b)
	x, err := NewIndex(h, Options{MaxBlocks: 1 << 24})
	if err != nil {
		b.Fatal(err)
	}
	const engines = 16
	var tokens []uint32
	var keys, hs []uint64
	var query []uint64
	requests, stored := 0, 0
	start := time.Now()
	sc := bufio.NewScanner(file)
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for sc.Scan() {
		var rec struct {
			HashIDs []uint64 `json:"hash_ids"`
		}
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			b.Fatal(err)
		}
		tokens = tokens[:0]
		for _, id := range rec.HashIDs {
			tokens = tokensOf(tokens, id+1, 512)
		}
		if _, _, err := storeChain(x, requests%engines, 0, 0, h.root, tokens, &keys, &hs); err != nil {
			b.Fatal(err)
		}
		stored += len(hs)
		if len(rec.HashIDs) >= 16 {
			query = h.Keys(tokens[:8192])
		}
		requests++
	}
	if err := sc.Err(); err != nil {
		b.Fatal(err)
	}
	build := time.Since(start)
	st := x.Stats()
	var m matches
	x.matchInto(query, &m)
	b.Logf("%d requests, %d (block, engine) stores in %v (%.1f M/s incl. hashing and JSON); %d blocks; query: %d engines, top %v",
		requests, stored, build.Round(time.Millisecond), float64(stored)/build.Seconds()/1e6, st.Blocks, len(m.Engines), m.Engines)
	b.ReportAllocs()
	for b.Loop() {
		x.matchInto(query, &m)
	}
}

// makeEvent builds the StoreEvent engine e would publish for tokens under parent (an engine hash
// and its block key; hash 0 for none), with engine hashes derived from the index's keys.
func makeEvent(h Hasher, e int, parent, parentKey uint64, tokens []uint32) StoreEvent {
	keys := h.appendFrom(nil, parentKey, tokens)
	salt := uint64(e+1) * 0x9E3779B97F4A7C15
	ev := StoreEvent{Engine: engineID(e), BlockHashes: make([]uint64, len(keys)), TokenIDs: tokens, Tier: TierDevice}
	for i, k := range keys {
		ev.BlockHashes[i] = k ^ salt
	}
	if parent != 0 {
		ev.HasParent, ev.ParentHash = true, parent
	}
	return ev
}

// BenchmarkEvents measures event application on one goroutine, the index's own hashing included
// (events carry tokens; the fake engine's hashes are prepared beforehand). "store+remove" stores
// a 64-block event under a shared 8-block prefix and removes it again: the steady state of an
// engine whose cache turns over (llm-d-kv-cache: 0.78 M block-adds/s; stores and removals both count).
// "store" stores 64-block prompts, 4,096 distinct ones in turn from 16 engines, into an index
// capped at 128 Ki blocks, so every event also evicts 64 least recently used blocks and most
// table probes miss the CPU caches.
func BenchmarkEvents(b *testing.B) {
	h := benchHasher(b)
	const blocks = 64
	b.Run("store+remove", func(b *testing.B) {
		x, err := NewIndex(h, Options{})
		if err != nil {
			b.Fatal(err)
		}
		prefix := makeEvent(h, 0, 0, h.root, tokensOf(nil, 1, 8*benchBlock))
		if err := x.Store(prefix); err != nil {
			b.Fatal(err)
		}
		prefixKey := h.Keys(prefix.TokenIDs)[7]
		events := make([]StoreEvent, 256)
		for i := range events {
			events[i] = makeEvent(h, 0, prefix.BlockHashes[7], prefixKey, tokensOf(nil, uint64(i+10), blocks*benchBlock))
		}
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			ev := events[i%len(events)]
			if err := x.Store(ev); err != nil {
				b.Fatal(err)
			}
			if err := x.Remove(ev.Engine, 0, ev.BlockHashes, 0); err != nil {
				b.Fatal(err)
			}
			i++
		}
		b.ReportMetric(float64(2*blocks*i)/b.Elapsed().Seconds(), "blocks/s")
	})
	b.Run("store", func(b *testing.B) {
		events := make([]StoreEvent, 4096)
		for i := range events {
			events[i] = makeEvent(h, i%16, 0, h.root, tokensOf(nil, 1<<32+uint64(i), blocks*benchBlock))
		}
		x, err := NewIndex(h, Options{MaxBlocks: 1 << 17})
		if err != nil {
			b.Fatal(err)
		}
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			if err := x.Store(events[i%len(events)]); err != nil {
				b.Fatal(err)
			}
			i++
		}
		b.ReportMetric(float64(blocks*i)/b.Elapsed().Seconds(), "blocks/s")
	})
}

// BenchmarkMemory reports the heap bytes per (block, holder) of an index of 1 M blocks (target
// ≤ 100), measured with runtime.MemStats.HeapAlloc around the build: "holders=1" gives every block
// one holder (the worst case: node costs are not shared), "holders=4" stores each prompt for four
// engines.
func BenchmarkMemory(b *testing.B) {
	h := benchHasher(b)
	const total = 1 << 20
	const blocks = 64
	for _, holders := range []int{1, 4} {
		b.Run(fmt.Sprintf("holders=%d", holders), func(b *testing.B) {
			var perPair float64
			var keys, hs []uint64
			tokens := make([]uint32, 0, blocks*benchBlock)
			for b.Loop() {
				var before, after runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&before)
				x, err := NewIndex(h, Options{MaxBlocks: total})
				if err != nil {
					b.Fatal(err)
				}
				for p := 0; p < total/blocks; p++ {
					tokens = tokensOf(tokens[:0], uint64(p+7), blocks*benchBlock)
					for e := range holders {
						if _, _, err := storeChain(x, e, 0, 0, h.root, tokens, &keys, &hs); err != nil {
							b.Fatal(err)
						}
					}
				}
				runtime.GC()
				runtime.ReadMemStats(&after)
				if got := x.Stats().Blocks; got != total {
					b.Fatalf("%d blocks", got)
				}
				perPair = float64(after.HeapAlloc-before.HeapAlloc) / float64(total*holders)
				runtime.KeepAlive(x)
			}
			b.ReportMetric(perPair, "B/block-holder")
		})
	}
}
