package kvindex_test

import (
	"context"
	"flag"
	"fmt"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/internal/cputime"
	"github.com/enginepick/enginepick/internal/sim"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// The production-scale workload (docs/performance.md, "kvindex at production scale"): the
// Mooncake conversation trace embedded in package sim, each 512-token trace block turned into 512
// token IDs by sim.Request.AppendTokenIDs (a splitmix64 stream seeded by the block's hash_id),
// 16-token blocks, 16 engines, request i stored for engine i mod 16 in trace order as one
// StoreEvent carrying the request's full blocks and their token IDs. The queries are the first
// 8,192 tokens of every request of at least 8,192 tokens, in trace order, after the whole trace
// is ingested.
//
// The full workload takes about a minute to build and 1.5 GB of memory, so it runs only when
// asked for:
//
//	go test -run '^$' -bench BenchmarkScale -benchtime 1x -kvscale full ./kvindex/
//
// Without -kvscale full the same benchmarks run on the first scaleSmallRequests requests, and
// TestScaleSmall checks that workload's results on every go test run.
var kvScale = flag.String("kvscale", "small",
	"BenchmarkScale workload: small (the first 400 requests of the Mooncake conversation trace) or full (all 12,031; about a minute and 1.5 GB)")

const (
	scaleBlockTokens   = 16
	scaleEngines       = 16
	scaleQueryTokens   = 8192
	scaleSmallRequests = 400
	// scaleMaxBlocks sizes Options.MaxBlocks above the full workload's 5,662,916 blocks, so that
	// nothing is evicted (package documentation, "Sizing MaxBlocks").
	scaleMaxBlocks = 8 << 20
	// scaleCappedBlocks is the cap of the full workload's capped ingest
	// (BenchmarkScale/ingest-capped; the small workload's is a third of its blocks): below the
	// full workload's blocks, so that its second half evicts as it stores.
	scaleCappedBlocks = 2 << 20
)

// The full workload's counts (the issue that defined it states them; TestScaleWorkloadCounts
// recomputes them from the trace's hash IDs).
const (
	fullBlockAdds = 9_044_013
	fullBlocks    = 5_662_916
	fullPairs     = 8_129_648
	fullRequests  = 12_031
	fullQueries   = 5_412
)

// scaleWorkload is the workload's requests and the fixed parts of every run over them.
type scaleWorkload struct {
	name    string
	reqs    []sim.Request
	hasher  kvindex.Hasher
	engines []state.EngineID
	queries []int // indexes into reqs of the requests with at least scaleQueryTokens tokens
}

var (
	scaleOnce  = map[string]*sync.Once{"small": new(sync.Once), "full": new(sync.Once)}
	scaleLoads = map[string]*scaleWorkload{}
	scaleErrs  = map[string]error{}
)

func loadScale(tb testing.TB, name string) *scaleWorkload {
	tb.Helper()
	once, ok := scaleOnce[name]
	if !ok {
		tb.Fatalf("-kvscale %q: want small or full", name)
	}
	once.Do(func() { scaleLoads[name], scaleErrs[name] = buildScaleWorkload(name) })
	require.NoError(tb, scaleErrs[name])
	return scaleLoads[name]
}

func buildScaleWorkload(name string) (*scaleWorkload, error) {
	tr, err := sim.MooncakeConversation()
	if err != nil {
		return nil, err
	}
	h, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: scaleBlockTokens})
	if err != nil {
		return nil, err
	}
	w := &scaleWorkload{name: name, reqs: tr.Requests, hasher: h}
	if name == "small" {
		w.reqs = w.reqs[:scaleSmallRequests]
	}
	for e := range scaleEngines {
		w.engines = append(w.engines, state.EngineID(fmt.Sprintf("http://10.0.0.%d:8000", e+1)))
	}
	for i := range w.reqs {
		if w.reqs[i].InputTokens >= scaleQueryTokens {
			w.queries = append(w.queries, i)
		}
	}
	return w, nil
}

// scaleEvents builds the StoreEvents of a range of requests, reusing its buffers. The engine's
// own block hashes are opaque to the index; here block j of the 512-token trace block with hash
// ID h gets splitmix64(h·32 + j) mixed with a per-engine salt, so equal blocks of one engine get
// equal hashes (a re-stored block is never an alias; trace hash IDs name whole prefixes) and
// computing them costs no xxhash, which the index's own hashing in Store would share.
type scaleEvents struct {
	w      *scaleWorkload
	tokens []uint32
	hashes []uint64
}

func (s *scaleEvents) event(i int) kvindex.StoreEvent {
	r := &s.w.reqs[i]
	s.tokens = r.AppendTokenIDs(s.tokens[:0])
	nb := len(s.tokens) / scaleBlockTokens
	s.tokens = s.tokens[:nb*scaleBlockTokens]
	e := i % scaleEngines
	salt := uint64(e+1) * 0x9E3779B97F4A7C15
	s.hashes = s.hashes[:0]
	const per = sim.MooncakeBlockTokens / scaleBlockTokens
	for b := range nb {
		s.hashes = append(s.hashes, splitmix64(r.HashIDs[b/per]*per+uint64(b%per))^salt)
	}
	return kvindex.StoreEvent{Engine: s.w.engines[e], BlockHashes: s.hashes, TokenIDs: s.tokens, Tier: kvindex.TierDevice}
}

func splitmix64(z uint64) uint64 {
	z += 0x9E3779B97F4A7C15
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
	z = (z ^ (z >> 27)) * 0x94D049BB133111EB
	return z ^ (z >> 31)
}

// queryTokens writes query q's first scaleQueryTokens token IDs into dst.
func (w *scaleWorkload) queryTokens(dst []uint32, q int) []uint32 {
	return w.reqs[w.queries[q]].AppendTokenIDs(dst[:0])[:scaleQueryTokens]
}

// scaleIngest is the result of storing a range of requests into an index.
type scaleIngest struct {
	blockAdds int
	storeTime time.Duration // inside Store only
	storeCPU  time.Duration // the process's CPU time over the Store loops (0 where unknown)
	faults    int64         // the process's minor page faults over the Store loops
	heapBytes uint64        // heap growth over the build, after GC
}

// ingest stores requests [from, to) into x, timing each Store call alone (wall time), and the
// process's CPU time over batches of Stores whose events were built beforehand, so that the CPU
// figure counts Store (and the garbage collector's work for it) and nothing else.
func (w *scaleWorkload) ingest(tb testing.TB, x *kvindex.Index, from, to int) scaleIngest {
	var r scaleIngest
	const batch = 64
	evs := make([]kvindex.StoreEvent, 0, batch)
	var tokens []uint32
	var hashes []uint64
	for b := from; b < to; b += batch {
		evs, tokens, hashes = evs[:0], tokens[:0], hashes[:0]
		var s scaleEvents
		s.w = w
		for i := b; i < min(to, b+batch); i++ {
			ev := s.event(i)
			t0, h0 := len(tokens), len(hashes)
			tokens = append(tokens, ev.TokenIDs...)
			hashes = append(hashes, ev.BlockHashes...)
			ev.TokenIDs, ev.BlockHashes = nil, nil
			evs = append(evs, ev)
			evs[len(evs)-1].TokenIDs = tokens[t0:len(tokens):len(tokens)]
			evs[len(evs)-1].BlockHashes = hashes[h0:len(hashes):len(hashes)]
		}
		// Re-slice after the appends above may have moved the arrays.
		t, h := 0, 0
		for i := range evs {
			nt, nh := len(evs[i].TokenIDs), len(evs[i].BlockHashes)
			evs[i].TokenIDs, evs[i].BlockHashes = tokens[t:t+nt:t+nt], hashes[h:h+nh:h+nh]
			t, h = t+nt, h+nh
		}
		cpu0, f0 := cputime.Process(), cputime.MinorFaults()
		for i, ev := range evs {
			start := time.Now()
			err := x.Store(ev)
			r.storeTime += time.Since(start)
			if err != nil {
				tb.Fatalf("request %d: %v", b+i, err)
			}
			r.blockAdds += len(ev.BlockHashes)
		}
		r.storeCPU += cputime.Process() - cpu0
		r.faults += cputime.MinorFaults() - f0
	}
	return r
}

// hugeBytes returns the process's anonymous memory backed by transparent huge pages
// (AnonHugePages of /proc/self/smaps_rollup; 0 where that file does not exist).
func hugeBytes() int64 {
	b, err := os.ReadFile("/proc/self/smaps_rollup")
	if err != nil {
		return 0
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "AnonHugePages:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			if err == nil {
				return kb << 10
			}
		}
	}
	return 0
}

func heapAlloc() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// scaleIndex is a built index of the whole workload, shared by the query benchmarks.
type scaleIndex struct {
	x      *kvindex.Index
	ingest scaleIngest
	blocks int // Stats().Blocks after ingest
}

var (
	scaleIndexOnce = map[string]*sync.Once{"small": new(sync.Once), "full": new(sync.Once)}
	scaleIndexes   = map[string]*scaleIndex{}
)

func (w *scaleWorkload) newIndex(tb testing.TB) *kvindex.Index {
	x, err := kvindex.NewIndex(w.hasher, kvindex.Options{MaxBlocks: scaleMaxBlocks})
	require.NoError(tb, err)
	return x
}

// presizedOptions are the workload's Options with the tables sized for it up front: ExpectedBlocks
// its distinct blocks, ExpectedHolderBlocks its (block, engine) pairs over the engines, rounded up,
// as an operator would set them from the fleet's KV capacity (package
// documentation, "Sizing MaxBlocks").
func (w *scaleWorkload) presizedOptions() kvindex.Options {
	c := countsFromHashIDs(w.reqs)
	return kvindex.Options{MaxBlocks: scaleMaxBlocks, ExpectedBlocks: c[1], ExpectedHolderBlocks: (c[2] + scaleEngines - 1) / scaleEngines}
}

// cappedBlocks is the capped ingest's MaxBlocks: scaleCappedBlocks for the full workload, a third
// of the small one's blocks, so that both evict.
func (w *scaleWorkload) cappedBlocks() int {
	if w.name == "full" {
		return scaleCappedBlocks
	}
	return countsFromHashIDs(w.reqs)[1] / 3
}

// cappedOptions are the Options of the capped ingest: MaxBlocks cappedBlocks, and the tables sized
// for a full index: ExpectedBlocks the cap, ExpectedHolderBlocks the cap's share of (block, engine)
// pairs per engine at the workload's engines per block.
func (w *scaleWorkload) cappedOptions() kvindex.Options {
	c, limit := countsFromHashIDs(w.reqs), w.cappedBlocks()
	perHolder := int(float64(limit) * float64(c[2]) / float64(c[1]) / scaleEngines)
	return kvindex.Options{MaxBlocks: limit, ExpectedBlocks: limit, ExpectedHolderBlocks: perHolder}
}

func (w *scaleWorkload) index(tb testing.TB) *scaleIndex {
	scaleIndexOnce[w.name].Do(func() {
		before := heapAlloc()
		x := w.newIndex(tb)
		in := w.ingest(tb, x, 0, len(w.reqs))
		in.heapBytes = heapAlloc() - before
		scaleIndexes[w.name] = &scaleIndex{x: x, ingest: in, blocks: x.Stats().Blocks}
	})
	si := scaleIndexes[w.name]
	if si == nil {
		tb.Fatal("building the index failed earlier")
	}
	return si
}

// pairs returns the index's (block, engine) pairs: every engine's device blocks.
func pairs(x *kvindex.Index) int {
	n := 0
	for _, es := range x.Stats().Engines() {
		n += es.DeviceBlocks
	}
	return n
}

// queryTimer records one duration per query and reports their distribution. Medians are over
// the query set, each query once (run with -benchtime 1x for one cold pass).
type queryTimer struct {
	durs   []time.Duration // wall time per query
	cpus   []time.Duration // the thread's CPU time per query, with the clock reads' own cost
	allocs uint64
	faults int64
	ms     runtime.MemStats
}

func (t *queryTimer) start() {
	runtime.ReadMemStats(&t.ms)
	t.allocs = t.ms.Mallocs
	t.faults = cputime.MinorFaults()
}

// measure runs one query's operation, recording its wall and thread CPU time.
func (t *queryTimer) measure(op func()) {
	c0 := cputime.Thread()
	start := time.Now()
	op()
	t.durs = append(t.durs, time.Since(start))
	t.cpus = append(t.cpus, cputime.Thread()-c0)
}

// clockCost is the median thread CPU time measure records for an empty operation: the cost of
// the clock reads themselves, subtracted from the per-query CPU figures.
func clockCost() time.Duration {
	var t queryTimer
	for range 1001 {
		t.measure(func() {})
	}
	slices.Sort(t.cpus)
	return t.cpus[len(t.cpus)/2]
}

func (t *queryTimer) report(b *testing.B) {
	faults := cputime.MinorFaults() - t.faults
	if c := slices.Clone(t.cpus); len(c) > 0 && c[0] > 0 {
		slices.Sort(c)
		cost := clockCost()
		b.ReportMetric(float64((c[len(c)/2] - cost).Nanoseconds()), "cpu-ns/op") // median
		b.ReportMetric(float64((c[len(c)*9/10] - cost).Nanoseconds()), "p90-cpu-ns")
		b.ReportMetric(float64(cost.Nanoseconds()), "clock-ns")
	}
	runtime.ReadMemStats(&t.ms)
	allocs := t.ms.Mallocs - t.allocs
	d := slices.Clone(t.durs)
	slices.Sort(d)
	q := func(p float64) float64 { return float64(d[min(len(d)-1, int(p*float64(len(d))))].Nanoseconds()) }
	var sum time.Duration
	for _, v := range d {
		sum += v
	}
	b.ReportMetric(q(0.5), "ns/op") // the median query replaces the per-iteration mean
	b.ReportMetric(float64(sum.Nanoseconds())/float64(len(d)), "mean-ns")
	b.ReportMetric(q(0.9), "p90-ns")
	b.ReportMetric(q(0.99), "p99-ns")
	b.ReportMetric(float64(allocs)/float64(len(d)), "allocs/query")
	b.ReportMetric(float64(faults)/float64(len(d)), "faults/query")
	b.ReportMetric(float64(len(d)), "queries")
}

// BenchmarkScale runs the production-scale workload (see kvScale). Every sub-benchmark iteration
// is one pass over the workload; run it with -benchtime 1x so that each query runs once, cold.
// ns/op is the median per query (per request for ingest); the other metrics are named.
func BenchmarkScale(b *testing.B) {
	w := loadScale(b, *kvScale)
	// The ingest variants (docs/performance.md, "Pre-sizing, and the cost of fresh memory"): the
	// tables growing from small or sized up front (-presized); the first index the process builds,
	// whose memory is fresh, or one built after an identical index was built and dropped, so that
	// the heap already has its memory mapped (-rebuilt); and an index capped at cappedBlocks,
	// filled with the first half of the trace and timed over the second half, where it evicts as
	// much as it stores (-capped: the steady state of a full index). The first variant a process
	// runs is the only one on fresh memory: run each alone for that figure.
	presized := w.presizedOptions()
	capped := kvindex.Options{MaxBlocks: w.cappedBlocks()}
	cappedPresized := w.cappedOptions()
	half := len(w.reqs) / 2
	for _, ingest := range []struct {
		name    string
		opts    kvindex.Options
		rebuild bool
		from    int // requests [0, from) are stored before the timed part
	}{
		{"ingest", kvindex.Options{MaxBlocks: scaleMaxBlocks}, false, 0},
		{"ingest-presized", presized, false, 0},
		{"ingest-rebuilt", kvindex.Options{MaxBlocks: scaleMaxBlocks}, true, 0},
		{"ingest-presized-rebuilt", presized, true, 0},
		{"ingest-capped", capped, false, half},
		{"ingest-capped-presized", cappedPresized, false, half},
	} {
		b.Run(ingest.name, func(b *testing.B) {
			var in scaleIngest
			var st kvindex.Stats
			var x *kvindex.Index
			var newCPU time.Duration
			for b.Loop() {
				x = nil
				if ingest.rebuild {
					y, err := kvindex.NewIndex(w.hasher, ingest.opts)
					require.NoError(b, err)
					w.ingest(b, y, 0, len(w.reqs))
					runtime.KeepAlive(y)
				}
				before := heapAlloc()
				c0 := cputime.Process()
				var err error
				x, err = kvindex.NewIndex(w.hasher, ingest.opts)
				require.NoError(b, err)
				newCPU = cputime.Process() - c0
				if ingest.from > 0 {
					w.ingest(b, x, 0, ingest.from)
					newCPU = 0
				}
				// The timed part carries a profiler label, so that a -cpuprofile of a -rebuilt or
				// -capped variant can be narrowed to it (go tool pprof -tagfocus phase=timed).
				pprof.Do(context.Background(), pprof.Labels("phase", "timed"), func(context.Context) {
					in = w.ingest(b, x, ingest.from, len(w.reqs))
				})
				in.heapBytes = heapAlloc() - before
				st = x.Stats()
			}
			if ingest.from > 0 && st.EvictedBlocks == 0 {
				b.Fatalf("%s evicted nothing: the cap is not below the workload's blocks", ingest.name)
			}
			p := pairs(x)
			b.ReportMetric(float64(in.storeTime.Nanoseconds())/float64(in.blockAdds), "ns/op")
			b.ReportMetric(float64(in.blockAdds)/in.storeTime.Seconds()/1e6, "M-blocks/s")
			if in.storeCPU > 0 {
				b.ReportMetric(float64(in.blockAdds)/in.storeCPU.Seconds()/1e6, "M-blocks/cpu-s")
			}
			b.ReportMetric(float64(in.heapBytes)/float64(p), "B/pair")
			b.ReportMetric(float64(in.heapBytes)/(1<<20), "heap-MiB")
			b.ReportMetric(float64(in.blockAdds), "block-adds")
			b.ReportMetric(float64(st.Blocks), "blocks")
			b.ReportMetric(float64(p), "pairs")
			if in.storeCPU > 0 {
				// NewIndex's CPU time counted too: a pre-sized index allocates its key table there.
				b.ReportMetric(float64(in.blockAdds)/(in.storeCPU+newCPU).Seconds()/1e6, "M-blocks/cpu-s-with-new")
			}
			b.ReportMetric(float64(newCPU.Microseconds()), "NewIndex-cpu-µs")
			b.ReportMetric(float64(in.faults), "faults")
			b.ReportMetric(float64(st.EvictedBlocks), "evicted")
			b.ReportMetric(float64(hugeBytes())/(1<<20), "huge-MiB")
			runtime.KeepAlive(x)
		})
	}
	queries := func(name string, op func(q int, tokens []uint32, t *queryTimer)) {
		b.Run(name, func(b *testing.B) {
			w.index(b)
			var t queryTimer
			tokens := make([]uint32, 0, scaleQueryTokens+512)
			runtime.LockOSThread() // cputime.Thread reads this thread's clock
			defer runtime.UnlockOSThread()
			for b.Loop() {
				t.durs, t.cpus = t.durs[:0], t.cpus[:0]
				t.start()
				for q := range w.queries {
					tokens = w.queryTokens(tokens, q)
					op(q, tokens, &t)
				}
			}
			t.report(b)
		})
	}
	h := w.hasher
	keys := make([]uint64, 0, scaleQueryTokens/scaleBlockTokens)
	var m kvindex.Matches
	queries("hash", func(_ int, tokens []uint32, t *queryTimer) {
		t.measure(func() { keys = h.AppendKeys(keys[:0], tokens) })
	})
	var llmd *llmdHasher
	queries("hash-llmd", func(_ int, tokens []uint32, t *queryTimer) {
		if llmd == nil {
			var err error
			llmd, err = newLLMDHasher(scaleBlockTokens, "m")
			require.NoError(b, err)
		}
		var k []uint64
		t.measure(func() { k = llmd.keys(tokens) })
		if len(k) != scaleQueryTokens/scaleBlockTokens {
			b.Fatalf("llm-d-style hashing: %d keys", len(k))
		}
	})
	queries("lookup", func(_ int, tokens []uint32, t *queryTimer) {
		x := w.index(b).x
		keys = h.AppendKeys(keys[:0], tokens)
		t.measure(func() { x.MatchInto(keys, &m) })
	})
	queries("hash+lookup", func(_ int, tokens []uint32, t *queryTimer) {
		x := w.index(b).x
		t.measure(func() { x.MatchTokensInto(tokens, &m) })
	})
	// pick-noplace first: it leaves the index as it found it, while pick records route-time
	// placements (approximate entries) in it, as a default CacheAware does.
	for _, place := range []bool{false, true} {
		var pk *scalePicker
		name := "pick"
		if !place {
			name = "pick-noplace"
		}
		queries(name, func(_ int, tokens []uint32, t *queryTimer) {
			if pk == nil {
				pk = newScalePicker(b, w, w.index(b).x, place)
			}
			req := pk.request(tokens)
			var err error
			t.measure(func() { _, err = pk.p.Pick(context.Background(), pk.group, req) })
			if err != nil {
				b.Fatal(err)
			}
		})
	}
	// Drop pick's placements, so that a next -count finds the index as ingest left it (when a
	// query benchmark built it: ingest alone does not).
	if si := scaleIndexes[w.name]; si != nil {
		si.x.Expire(time.Now().Add(120*time.Second + time.Hour))
		if got := si.x.Stats().Blocks; got != si.blocks {
			b.Fatalf("after expiring the placements: %d blocks, ingest left %d", got, si.blocks)
		}
	}
	// The writer at the rates a fleet produces KV blocks: the benchmark's 16 engines, each an
	// H100-class engine prefilling an 8B model without pause (sim.DefaultEngineModel: 24,600
	// uncached tokens per second, so 1,538 blocks per second each), and 40 times that, a fleet of
	// 640 such engines behind one router.
	for _, paced := range []struct {
		name string
		rate float64 // block-adds per second
	}{
		{"concurrent-16-engines", fleetBlockRate(16)},
		{"concurrent-640-engines", fleetBlockRate(640)},
	} {
		b.Run(paced.name, func(b *testing.B) {
			for b.Loop() {
				r := w.concurrentPaced(b, 2, paced.rate)
				r.reportReaders(b)
				b.ReportMetric(r.writerBlocks*1e6, "writer-blocks/s")
				b.ReportMetric(paced.rate, "target-blocks/s")
				b.ReportMetric(float64(r.longestAlone.Microseconds()), "longest-alone-µs")
				b.ReportMetric(float64(r.longestWithWriter.Microseconds()), "longest-with-writer-µs")
			}
		})
	}
	// An engine restarts: clearing its rank 0 (AllBlocksCleared) on a fresh index of the whole
	// trace, beside 2 readers.
	b.Run("clear-engine", func(b *testing.B) {
		for b.Loop() {
			r := w.clearBeside(b, 2)
			b.ReportMetric(float64(r.clear.Microseconds())/1e3, "clear-ms")
			b.ReportMetric(float64(r.pairs), "pairs-cleared")
			b.ReportMetric(float64(r.longestAlone.Microseconds()), "longest-alone-µs")
			b.ReportMetric(float64(r.longestDuring.Microseconds()), "longest-during-clear-µs")
			b.ReportMetric(100*r.during/r.alone, "%-of-alone")
		}
	})
	// The writer flat out, the readers and the writer locked to their threads (which the CPU
	// figures need), and then as a router runs them: goroutines, not locked (wall-clock figures
	// only).
	for _, v := range []struct {
		name   string
		locked bool
	}{{"concurrent", true}, {"concurrent-goroutines", false}} {
		b.Run(v.name, func(b *testing.B) {
			for b.Loop() {
				r := w.concurrent(b, 2, v.locked)
				r.reportReaders(b)
				b.ReportMetric(r.writerBlocks, "writer-M-blocks/s")
				// The same readers beside a busy goroutine that touches nothing: the share of the
				// machine a third CPU-bound goroutine leaves them, whatever it does.
				b.ReportMetric(100*r.withBusy/r.alone, "%-of-alone-beside-busy")
				b.ReportMetric(100*r.withWriter/r.withBusy, "%-writer-of-busy")
				if r.aloneCPU > 0 {
					b.ReportMetric(r.aloneCPU, "alone-lookups/cpu-s")
					b.ReportMetric(r.withWriterCPU, "writer-lookups/cpu-s")
					b.ReportMetric(100*r.withWriterCPU/r.aloneCPU, "%-of-alone-cpu")
					b.ReportMetric(r.writerBlocksCPU, "writer-M-blocks/cpu-s")
					b.ReportMetric(100*r.withBusyCPU/r.aloneCPU, "%-of-alone-cpu-beside-busy")
				}
			}
		})
	}

}

// scalePicker is a cache-aware policy over the workload's 16 engines, with fresh load reports
// (waiting queues of 0–3 requests), the queue gate on, and admission caps, as a production
// prefill group would have.
type scalePicker struct {
	p     policy.Policy
	group []state.Engine
	req   policy.Request
	// cur is the request of the current pick: reused, as a Router reuses its pooled requests, so
	// that the benchmark does not count a request allocation of its own (Policy.Pick takes it
	// through an interface, where it escapes).
	cur policy.Request
}

// place false disables route-time placements (docs/design.md §9.10).
func newScalePicker(tb testing.TB, w *scaleWorkload, x *kvindex.Index, place bool) *scalePicker {
	load := loadmon.NewTable()
	sp := &scalePicker{}
	for i, id := range w.engines {
		sp.group = append(sp.group, state.NewStaticEngine(id, "m", state.StagePrefill))
		require.NoError(tb, load.Report(loadmon.Report{Engine: id, WaitingRequests: uint64(i % 4), RunningRequests: 8,
			KVCapacityTokens: 1 << 20, Native: &loadmon.NativeLoad{MaxRunningRequests: 256, WaitingUncachedTokens: uint64(i * 300)}}))
	}
	slices.SortFunc(sp.group, func(a, b state.Engine) int {
		switch {
		case a.ID() < b.ID():
			return -1
		case a.ID() > b.ID():
			return 1
		}
		return 0
	})
	src, err := kvindex.NewLocalSource(x)
	require.NoError(tb, err)
	limit := uint64(8)
	sp.p, err = policy.NewCacheAware(policy.Config{Load: load, InFlight: loadmon.NewInFlight(nil),
		Admission: admission.Limits{MaxRunningRequests: admission.Cap(256), MaxInFlightRequests: admission.Cap(256)}},
		policy.CacheAwareOptions{Source: src, EngineQueueLimit: &limit, DisableRoutePlacements: !place})
	require.NoError(tb, err)
	sp.req = policy.Request{Model: "m", Stage: state.StagePrefill, BucketID: "b"}
	return sp
}

func (sp *scalePicker) request(tokens []uint32) *policy.Request {
	sp.cur = sp.req
	sp.cur.TokenIDs = tokens
	sp.cur.InputTokens = uint64(len(tokens))
	return &sp.cur
}

type concurrentResult struct {
	alone, withWriter float64 // lookups per second, all readers together
	writerBlocks      float64 // M block-adds per second
	lookupsAlone      int64
	lookupsWithWriter int64
	// CPU cores the process used in each phase (0 where unknown): a third busy goroutine on a
	// 2-core machine leaves the readers 2/3 of the CPU at best.
	coresAlone, coresWithWriter float64
	// Lookups per second of the readers' own CPU time, and the writer's block-adds per second of
	// its CPU time (0 where unknown): what a writer costs each lookup (cache misses, atomic
	// reference bits), apart from the share of the machine each phase got. Time a reader spends
	// blocked on the lock is not CPU time, so the wall-clock ratio is the one that counts it.
	aloneCPU, withWriterCPU, writerBlocksCPU float64
	// The control phase: the readers beside a goroutine that only keeps a core busy (no memory,
	// no lock) for as long as the writer ran; lookups per wall second and per reader CPU-second.
	withBusy, withBusyCPU float64
	lookupsWithBusy       int64
	// The longest lookup alone and beside the writer (concurrentPaced only).
	longestAlone, longestWithWriter time.Duration
}

// queryKeys returns the query set's keys, hashed.
func (w *scaleWorkload) queryKeys() [][]uint64 {
	var keys [][]uint64
	tokens := make([]uint32, 0, scaleQueryTokens+512)
	for q := range w.queries {
		tokens = w.queryTokens(tokens, q)
		keys = append(keys, w.hasher.Keys(tokens))
	}
	return keys
}

// readStats is what readLoop's readers did: lookups, their CPU time (0 unless the readers were
// locked to their threads), and the longest lookup (0 unless each was timed).
type readStats struct {
	lookups int64
	cpu     time.Duration
	longest time.Duration
}

// readLoop runs readers goroutines, each matching the queries' keys in turn from its own starting
// point, until stop is closed. With lock, each reader is locked to its thread to read its CPU clock
// (which makes every park and wake-up on the index's lock a switch of threads; a router's
// goroutines are not locked); without, each lookup is timed instead, for the longest.
func readLoop(x *kvindex.Index, keys [][]uint64, readers int, lock bool, stop <-chan struct{}) readStats {
	var n, cpu atomic.Int64
	longest := make([]time.Duration, readers) // each reader's, read after wg.Wait
	var wg sync.WaitGroup
	for r := range readers {
		wg.Go(func() {
			if lock {
				runtime.LockOSThread()
				defer runtime.UnlockOSThread()
				c0 := cputime.Thread()
				defer func() { cpu.Add(int64(cputime.Thread() - c0)) }()
			}
			var m kvindex.Matches
			i := r * len(keys) / readers
			for {
				select {
				case <-stop:
					return
				default:
				}
				if lock {
					x.MatchInto(keys[i%len(keys)], &m)
				} else {
					t0 := time.Now()
					x.MatchInto(keys[i%len(keys)], &m)
					longest[r] = max(longest[r], time.Since(t0))
				}
				n.Add(1)
				i++
			}
		})
	}
	<-stop
	wg.Wait()
	return readStats{lookups: n.Load(), cpu: time.Duration(cpu.Load()), longest: slices.Max(longest)}
}

// concurrent builds an index of the first half of the trace, then measures the readers' lookups
// per second alone, while one writer stores the second half (its events prepared beforehand, so it
// does nothing but Store), and beside a busy goroutine that touches nothing (the control), the
// three phases taking turns (concurrentRounds).
func (w *scaleWorkload) concurrent(tb testing.TB, readers int, locked bool) concurrentResult {
	half := len(w.reqs) / 2
	x := w.newIndex(tb)
	w.ingest(tb, x, 0, half)
	keys := w.queryKeys()
	// Prepare the writer's events.
	var evs []kvindex.StoreEvent
	var s scaleEvents
	s.w = w
	blocks := 0
	for i := half; i < len(w.reqs); i++ {
		ev := s.event(i)
		ev.TokenIDs = slices.Clone(ev.TokenIDs)
		ev.BlockHashes = slices.Clone(ev.BlockHashes)
		evs = append(evs, ev)
		blocks += len(ev.BlockHashes)
	}
	run := func(stop <-chan struct{}) (int64, time.Duration) {
		st := readLoop(x, keys, readers, locked, stop)
		return st.lookups, st.cpu
	}
	// The three phases take turns in concurrentRounds rounds, each round storing the next part
	// of the writer's events, so that a change in what the shared machine gives the process
	// falls on all three alike: the readers alone (for as long as the round's writer will take,
	// estimated from the last round), the readers beside the writer, and the control, the
	// readers beside a goroutine that keeps a core as busy as the writer did for as long as it
	// took but touches no memory and takes no lock. What the readers lose to the control is the
	// machine's share, not the index's cost.
	var r concurrentResult
	var aloneWall, writerWall, busyWall, aloneCores, writerCores time.Duration
	var aloneRead, writerRead, busyRead, writerTime, writerCPU time.Duration
	perBlock := 300 * time.Nanosecond // the first round's estimate of the writer's time per block
	for round := range concurrentRounds {
		part := evs[round*len(evs)/concurrentRounds : (round+1)*len(evs)/concurrentRounds]
		partBlocks := 0
		for _, ev := range part {
			partBlocks += len(ev.BlockHashes)
		}
		stop := make(chan struct{})
		d := max(100*time.Millisecond, time.Duration(partBlocks)*perBlock)
		go func() { time.Sleep(d); close(stop) }()
		start, cpu0 := time.Now(), cputime.Process()
		n, cpu := run(stop)
		r.lookupsAlone += n
		aloneRead += cpu
		aloneWall += time.Since(start)
		aloneCores += cputime.Process() - cpu0

		stop = make(chan struct{})
		var wt, wc time.Duration
		go func() {
			if locked {
				runtime.LockOSThread()
				defer runtime.UnlockOSThread()
			}
			c0, s0 := cputime.Thread(), time.Now()
			for _, ev := range part {
				if err := x.Store(ev); err != nil {
					panic(err)
				}
			}
			wt = time.Since(s0)
			if locked {
				wc = cputime.Thread() - c0
			}
			close(stop)
		}()
		start, cpu0 = time.Now(), cputime.Process()
		n, cpu = run(stop)
		r.lookupsWithWriter += n
		writerRead += cpu
		writerWall += time.Since(start)
		writerCores += cputime.Process() - cpu0
		writerTime += wt
		writerCPU += wc
		perBlock = wt / time.Duration(max(1, partBlocks))

		// The control stops when the timer sets spin, and the round waits for it to have
		// stopped, so that it never runs into the next round's readers-alone phase.
		stop = make(chan struct{})
		var spin atomic.Bool
		spun := make(chan struct{})
		go func() {
			defer close(spun)
			if locked {
				runtime.LockOSThread()
				defer runtime.UnlockOSThread()
			}
			z := uint64(1)
			for !spin.Load() {
				for range 1024 {
					z = splitmix64(z)
				}
			}
			busySink.Store(z)
		}()
		go func() { time.Sleep(wt); spin.Store(true); close(stop) }()
		start = time.Now()
		n, cpu = run(stop)
		busyWall += time.Since(start)
		<-spun
		r.lookupsWithBusy += n
		busyRead += cpu
	}
	r.alone = float64(r.lookupsAlone) / aloneWall.Seconds()
	r.withWriter = float64(r.lookupsWithWriter) / writerWall.Seconds()
	r.withBusy = float64(r.lookupsWithBusy) / busyWall.Seconds()
	r.coresAlone = aloneCores.Seconds() / aloneWall.Seconds()
	r.coresWithWriter = writerCores.Seconds() / writerWall.Seconds()
	r.writerBlocks = float64(blocks) / writerTime.Seconds() / 1e6
	if aloneRead > 0 && writerRead > 0 && busyRead > 0 && writerCPU > 0 {
		r.aloneCPU = float64(r.lookupsAlone) / aloneRead.Seconds()
		r.withWriterCPU = float64(r.lookupsWithWriter) / writerRead.Seconds()
		r.withBusyCPU = float64(r.lookupsWithBusy) / busyRead.Seconds()
		r.writerBlocksCPU = float64(blocks) / writerCPU.Seconds() / 1e6
	}
	return r
}

// fleetBlockRate is the rate, in block-adds per second, at which engines H100-class engines
// prefilling an 8B model without pause create KV blocks of the workload's size: each prefills
// sim.DefaultPrefillLinearTokensPerSecond uncached tokens per second (the attention term only
// lowers it), and every scaleBlockTokens of them make a block the engine reports as stored.
func fleetBlockRate(engines int) float64 {
	return float64(engines) * sim.DefaultPrefillLinearTokensPerSecond / scaleBlockTokens
}

// pacedRound is the wall time of one round of concurrentPaced.
const pacedRound = 500 * time.Millisecond

// concurrentPaced is concurrent with the writer storing at rate block-adds per second (sleeping
// between events when ahead) instead of as fast as it can: what a router's lookups keep beside a
// fleet's real event flow. Each of concurrentRounds rounds runs the readers alone for pacedRound,
// then beside the writer storing the next rate × pacedRound blocks of the second half's events
// over pacedRound (fewer rounds when the second half runs out, as the small workload's does at
// the higher rate; the last round's phases then last as long as its blocks take); the first half
// is stored before. The control phase is left out: a paced
// writer keeps no core busy. writerBlocks is the rate the writer kept, in M block-adds per
// second of its wall time.
func (w *scaleWorkload) concurrentPaced(tb testing.TB, readers int, rate float64) concurrentResult {
	half := len(w.reqs) / 2
	x := w.newIndex(tb)
	w.ingest(tb, x, 0, half)
	keys := w.queryKeys()
	var s scaleEvents
	s.w = w
	next := half
	var r concurrentResult
	var aloneWall, writerWall, aloneCores, writerCores time.Duration
	var blocks int
	budget := int(rate * pacedRound.Seconds())
	for round := range concurrentRounds {
		var part []kvindex.StoreEvent
		partBlocks := 0
		for ; next < len(w.reqs) && partBlocks < budget; next++ {
			ev := s.event(next)
			ev.TokenIDs = slices.Clone(ev.TokenIDs)
			ev.BlockHashes = slices.Clone(ev.BlockHashes)
			part = append(part, ev)
			partBlocks += len(ev.BlockHashes)
		}
		if len(part) == 0 {
			if round == 0 {
				tb.Fatalf("no second half to store")
			}
			break // the small workload's second half runs out at the higher rate
		}
		stop := make(chan struct{})
		phase := time.Duration(float64(partBlocks) / rate * 1e9) // pacedRound but in the last round
		go func() { time.Sleep(phase); close(stop) }()
		start, cpu0 := time.Now(), cputime.Process()
		st := readLoop(x, keys, readers, false, stop)
		r.lookupsAlone += st.lookups
		r.longestAlone = max(r.longestAlone, st.longest)
		aloneWall += time.Since(start)
		aloneCores += cputime.Process() - cpu0

		stop = make(chan struct{})
		var wt time.Duration
		go func() {
			s0 := time.Now()
			done := 0
			for _, ev := range part {
				if ahead := time.Duration(float64(done)/rate*1e9) - time.Since(s0); ahead > 0 {
					time.Sleep(ahead)
				}
				if err := x.Store(ev); err != nil {
					panic(err)
				}
				done += len(ev.BlockHashes)
			}
			wt = time.Since(s0)
			if rest := time.Duration(float64(done)/rate*1e9) - wt; rest > 0 {
				time.Sleep(rest) // the phase lasts as long as the blocks take at rate
			}
			close(stop)
		}()
		start, cpu0 = time.Now(), cputime.Process()
		st = readLoop(x, keys, readers, false, stop)
		r.lookupsWithWriter += st.lookups
		r.longestWithWriter = max(r.longestWithWriter, st.longest)
		writerWall += time.Since(start)
		writerCores += cputime.Process() - cpu0
		blocks += partBlocks
	}
	r.alone = float64(r.lookupsAlone) / aloneWall.Seconds()
	r.withWriter = float64(r.lookupsWithWriter) / writerWall.Seconds()
	r.coresAlone = aloneCores.Seconds() / aloneWall.Seconds()
	r.coresWithWriter = writerCores.Seconds() / writerWall.Seconds()
	r.writerBlocks = float64(blocks) / writerWall.Seconds() / 1e6
	return r
}

// reportReaders reports what every concurrent benchmark measures of the readers and the process:
// lookups per second alone and beside the writer, their ratio, and the cores used in each phase.
func (r *concurrentResult) reportReaders(b *testing.B) {
	b.ReportMetric(r.alone, "alone-lookups/s")
	b.ReportMetric(r.withWriter, "writer-lookups/s")
	b.ReportMetric(100*r.withWriter/r.alone, "%-of-alone")
	b.ReportMetric(r.coresAlone, "cores-alone")
	b.ReportMetric(r.coresWithWriter, "cores-with-writer")
}

// clearResult is what clearBeside measures.
type clearResult struct {
	clear                       time.Duration // Clear's wall time
	pairs                       int           // the (block, engine) pairs it dropped
	alone, during               float64       // the readers' lookups per second alone, during the Clear
	longestAlone, longestDuring time.Duration // the longest lookup alone, during the Clear
}

// clearBeside builds an index of the whole trace, runs readers alone for a while (pacedRound),
// and then clears the first engine's rank 0 while they run: the readers' lookups per second and
// longest lookup over the Clear (the lookups in flight when it returns count).
func (w *scaleWorkload) clearBeside(tb testing.TB, readers int) clearResult {
	x := w.newIndex(tb)
	w.ingest(tb, x, 0, len(w.reqs))
	keys := w.queryKeys()
	var r clearResult
	stop := make(chan struct{})
	go func() { time.Sleep(pacedRound); close(stop) }()
	start := time.Now()
	st := readLoop(x, keys, readers, false, stop)
	r.alone = float64(st.lookups) / time.Since(start).Seconds()
	r.longestAlone = st.longest

	before := pairs(x)
	stop = make(chan struct{})
	var t0 time.Time
	go func() {
		time.Sleep(time.Millisecond) // the readers are running
		t0 = time.Now()
		if err := x.Clear(w.engines[0], 0); err != nil {
			panic(err)
		}
		r.clear = time.Since(t0)
		close(stop)
	}()
	st = readLoop(x, keys, readers, false, stop)
	r.during = float64(st.lookups) / time.Since(t0).Seconds()
	r.longestDuring = st.longest
	r.pairs = before - pairs(x)
	if r.pairs <= 0 {
		tb.Fatalf("the Clear dropped %d pairs", r.pairs)
	}
	return r
}

// concurrentRounds is how many turns the concurrent benchmark's three phases take.
const concurrentRounds = 8

// busySink keeps the control goroutine's loop from being optimised away.
var busySink atomic.Uint64

// TestScaleWorkloadCounts recomputes the full workload's counts from the trace's hash IDs alone
// (countsFromHashIDs), without building the index, so it runs on every go test.
func TestScaleWorkloadCounts(t *testing.T) {
	t.Parallel()
	tr, err := sim.MooncakeConversation()
	require.NoError(t, err)
	require.Len(t, tr.Requests, fullRequests)
	queries := 0
	for _, r := range tr.Requests {
		if r.InputTokens >= scaleQueryTokens {
			queries++
		}
	}
	assert.Equal(t, [3]int{fullBlockAdds, fullBlocks, fullPairs}, countsFromHashIDs(tr.Requests), "block-adds, unique blocks, (block, engine) pairs")
	assert.Equal(t, fullQueries, queries, "queries")
}

// TestScaleIndexCounts builds the workload's index and checks its counts: with -kvscale full the
// issue's figures, otherwise the small workload's, recomputed from the hash IDs as above.
func TestScaleIndexCounts(t *testing.T) {
	w := loadScale(t, *kvScale)
	if testing.Short() && w.name == "full" {
		t.Skip("full workload in -short mode")
	}
	si := w.index(t)
	st := si.x.Stats()
	want := [3]int{fullBlockAdds, fullBlocks, fullPairs}
	if w.name == "small" {
		want = countsFromHashIDs(w.reqs)
	}
	assert.Equal(t, want[0], si.ingest.blockAdds, "block-adds")
	assert.Equal(t, want[1], st.Blocks, "unique blocks")
	assert.Equal(t, want[2], pairs(si.x), "(block, engine) pairs")
	assert.Zero(t, st.EvictedBlocks)
}

// countsFromHashIDs returns the block-adds, unique blocks and (block, engine) pairs of storing
// reqs as the workload does, from their hash IDs alone: a full 16-token block is identified by
// the hash ID of the 512-token trace block it lies in (hash IDs name whole prefixes) and its
// position in it.
func countsFromHashIDs(reqs []sim.Request) [3]int {
	const per = sim.MooncakeBlockTokens / scaleBlockTokens
	maxBlocks := map[uint64]int{}
	maxPairs := map[[2]uint64]int{}
	adds := 0
	for i, r := range reqs {
		nb := r.InputTokens / scaleBlockTokens
		adds += nb
		for j, id := range r.HashIDs {
			k := min(per, nb-j*per)
			if k <= 0 {
				break
			}
			maxBlocks[id] = max(maxBlocks[id], k)
			pk := [2]uint64{id, uint64(i % scaleEngines)}
			maxPairs[pk] = max(maxPairs[pk], k)
		}
	}
	out := [3]int{adds, 0, 0}
	for _, k := range maxBlocks {
		out[1] += k
	}
	for _, k := range maxPairs {
		out[2] += k
	}
	return out
}

// TestScaleSmall runs every measured operation of BenchmarkScale on the small workload and checks
// its results against a brute-force answer: each query's Match, MatchTokensInto and the pick's
// choice, and the concurrent run's progress.
func TestScaleSmall(t *testing.T) {
	w := loadScale(t, "small")
	x := w.index(t).x
	ref := newPrefixModel(w)
	var m, mt kvindex.Matches
	pk := newScalePicker(t, w, x, true)
	tokens := make([]uint32, 0, scaleQueryTokens+512)
	for q := range w.queries {
		tokens = w.queryTokens(tokens, q)
		keys := w.hasher.Keys(tokens)
		x.MatchInto(keys, &m)
		want := ref.match(keys)
		require.Equal(t, want, m.Engines, "query %d", q)
		x.MatchTokensInto(tokens, &mt)
		require.Equal(t, want, mt.Engines, "query %d tokens", q)
		got, err := pk.p.Pick(context.Background(), pk.group, pk.request(tokens))
		require.NoError(t, err)
		if len(want) > 0 && want[0].Blocks*scaleBlockTokens >= 1024 {
			assert.Equal(t, "cache_candidate", got.Reason, "query %d", q)
		}
	}
	if testing.Short() {
		return
	}
	r := w.concurrent(t, 2, true)
	assert.Positive(t, r.lookupsAlone)
	assert.Positive(t, r.lookupsWithWriter)
	assert.Positive(t, r.lookupsWithBusy)
}

// prefixModel answers matches by brute force: per engine, the set of keys it stored.
type prefixModel struct {
	held map[state.EngineID]map[uint64]bool
}

func newPrefixModel(w *scaleWorkload) *prefixModel {
	pm := &prefixModel{held: map[state.EngineID]map[uint64]bool{}}
	var s scaleEvents
	s.w = w
	for i := range w.reqs {
		ev := s.event(i)
		set := pm.held[ev.Engine]
		if set == nil {
			set = map[uint64]bool{}
			pm.held[ev.Engine] = set
		}
		for _, k := range w.hasher.Keys(ev.TokenIDs) {
			set[k] = true
		}
	}
	return pm
}

func (pm *prefixModel) match(keys []uint64) []kvindex.EngineMatch {
	var out []kvindex.EngineMatch
	for e, set := range pm.held {
		n := 0
		for n < len(keys) && set[keys[n]] {
			n++
		}
		if n > 0 {
			out = append(out, kvindex.EngineMatch{Engine: e, Blocks: n})
		}
	}
	slices.SortFunc(out, func(a, b kvindex.EngineMatch) int {
		if a.Blocks != b.Blocks {
			return b.Blocks - a.Blocks
		}
		if a.Engine < b.Engine {
			return -1
		}
		return 1
	})
	return out
}
