package kvevents

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/kvindex"
)

const eng = "http://engine-a:8000"

// fakeReplayer serves buffered payloads like vLLM's replay socket: every batch numbered start or
// later, in order; then err.
type fakeReplayer struct {
	seqs     []uint64
	payloads map[uint64][]byte
	err      error
	starts   []uint64
	during   func() // called before the first batch is served
}

func (r *fakeReplayer) replay(_ context.Context, start uint64, fn func(uint64, []byte)) error {
	r.starts = append(r.starts, start)
	if r.during != nil {
		r.during()
	}
	for _, s := range r.seqs {
		if s >= start {
			fn(s, r.payloads[s])
		}
	}
	return r.err
}

type streamFixture struct {
	t    *testing.T
	x    *kvindex.Index
	s    *stream
	errs []*StreamError
	mu   sync.Mutex
}

func newStreamFixture(t *testing.T, rep replayer, mod func(*Options)) *streamFixture {
	f := &streamFixture{t: t, x: newIndex(t, "")}
	o := Options{Index: f.x, OnError: func(e *StreamError) { f.mu.Lock(); f.errs = append(f.errs, e); f.mu.Unlock() }}
	if mod != nil {
		mod(&o)
	}
	sub, err := New(o)
	require.NoError(t, err)
	f.s = newStream(Endpoint{Engine: eng, Address: "tcp://127.0.0.1:1"}, &sub.opts, rep, o.OnError)
	return f
}

// block is a BlockStored of block i of prompt p, chained to block i-1 (engine hashes p*1000+i+1).
func block(p, i int) []any {
	var parent any
	if i > 0 {
		parent = uint64(p*1000 + i)
	}
	return storedArray([]uint64{uint64(p*1000 + i + 1)}, parent, prompt(p, i+1)[i*testBlock:], "GPU")
}

// send receives one batch as the socket's receive goroutine does and applies it as the apply
// goroutine does.
func (f *streamFixture) send(seq uint64, events ...any) {
	f.t.Helper()
	f.sendRaw(seq, payload(f.t, 0, events...))
}

func (f *streamFixture) sendRaw(seq uint64, raw []byte) {
	f.t.Helper()
	f.s.enqueue(item{seq: seq, payload: raw})
	f.s.handle(context.Background(), <-f.s.queue)
	f.s.publish()
}

func (f *streamFixture) held(p, n int) int { return held(f.x, eng, p, n) }

func (f *streamFixture) stats() StreamStats { return f.s.stats() }

// TestStreamInOrder: batches numbered from 0 or from 1 apply in order with no gap.
func TestStreamInOrder(t *testing.T) {
	t.Parallel()
	for _, first := range []uint64{0, 1} {
		f := newStreamFixture(t, nil, nil)
		for i := range 3 {
			f.send(first+uint64(i), block(1, i))
		}
		assert.Equal(t, 3, f.held(1, 3), "first=%d", first)
		st := f.stats()
		assert.Zero(t, st.Gaps+st.Resyncs+st.Regressions, "first=%d", first)
		assert.EqualValues(t, 3, st.Batches)
		assert.EqualValues(t, 3, st.StoredBlocks)
		assert.True(t, st.Trusted)
		assert.True(t, trusted(f.x, eng))
	}
}

// TestStreamGapWithoutReplay: a forward gap without a replay socket clears the rank (the lost
// batch may have removed blocks) and rebases on the batch that revealed it.
func TestStreamGapWithoutReplay(t *testing.T) {
	t.Parallel()
	f := newStreamFixture(t, nil, nil)
	f.send(0, block(1, 0))
	f.send(1, block(1, 1))
	require.Equal(t, 2, f.held(1, 2))
	// seq 2 (say, the removal of block 1) is lost.
	f.send(3, block(2, 0))
	assert.Zero(t, f.held(1, 2), "the rank was cleared")
	assert.Equal(t, 1, f.held(2, 1), "the batch after the gap was applied")
	f.send(4, block(2, 1))
	assert.Equal(t, 2, f.held(2, 2))
	st := f.stats()
	assert.EqualValues(t, 1, st.Gaps)
	assert.EqualValues(t, 1, st.Resyncs)
	assert.True(t, st.Trusted)
	assert.True(t, trusted(f.x, eng))
}

// TestStreamGapReplayed: a forward gap is refilled from the replay socket; the engine is
// untrusted while the replay runs; batches the replay already applied are skipped when they
// arrive live.
func TestStreamGapReplayed(t *testing.T) {
	t.Parallel()
	rep := &fakeReplayer{payloads: map[uint64][]byte{}}
	f := newStreamFixture(t, rep, nil)
	rep.during = func() {
		assert.False(t, trusted(f.x, eng), "untrusted during the replay")
		src, err := kvindex.NewLocalSource(f.x)
		require.NoError(t, err)
		r, err := src.Lookup(context.Background(), kvindex.Query{TokenIDs: prompt(1, 2)})
		require.NoError(t, err)
		assert.Equal(t, kvindex.OutcomeMiss, r.Outcome, "cache-aware routing sees nothing of it")
	}
	f.send(0, block(1, 0))
	f.send(1, block(1, 1))
	// The publisher sent 2 (remove block 1), 3 (store prompt 2 block 0) and 4; the subscriber got
	// only 3, then 4 and 5 live.
	rep.seqs = []uint64{1, 2, 3, 4}
	rep.payloads[1] = payload(t, 0, block(1, 1))
	rep.payloads[2] = payload(t, 0, removedArray([]uint64{1002}, nil))
	rep.payloads[3] = payload(t, 0, block(2, 0))
	rep.payloads[4] = payload(t, 0, block(2, 1))
	f.send(3, block(2, 0))
	assert.Equal(t, []uint64{2}, rep.starts, "replay asked from the first missing batch")
	assert.Equal(t, 1, f.held(1, 2), "the replayed removal was applied")
	assert.Equal(t, 2, f.held(2, 2), "replayed 3 and 4 applied")
	f.send(4, block(2, 1))
	f.send(5, block(2, 2))
	assert.Equal(t, 3, f.held(2, 3))
	st := f.stats()
	assert.EqualValues(t, 1, st.Gaps)
	assert.EqualValues(t, 1, st.Replays)
	assert.EqualValues(t, 2, st.Duplicates, "live 3 and 4 had been replayed")
	assert.Zero(t, st.Rejected)
	assert.True(t, trusted(f.x, eng))
}

// TestStreamReplayCannotFillGap: when the replay buffer no longer holds the first missing batch,
// the rank is cleared and rebuilt from what the buffer holds.
func TestStreamReplayCannotFillGap(t *testing.T) {
	t.Parallel()
	rep := &fakeReplayer{payloads: map[uint64][]byte{}}
	f := newStreamFixture(t, rep, nil)
	f.send(0, block(1, 0))
	f.send(1, block(1, 1))
	rep.seqs = []uint64{5, 6}
	rep.payloads[5] = payload(t, 0, block(2, 0))
	rep.payloads[6] = payload(t, 0, block(2, 1))
	f.send(6, block(2, 1))
	assert.Zero(t, f.held(1, 2), "cleared: batches 2–4 are gone")
	assert.Equal(t, 2, f.held(2, 2))
	f.send(7, block(2, 2))
	assert.Equal(t, 3, f.held(2, 3))
	st := f.stats()
	assert.EqualValues(t, 1, st.Replays)
	assert.EqualValues(t, 1, st.Duplicates)
	assert.True(t, trusted(f.x, eng))
}

// TestStreamReplayFails: a replay error clears the rank and rebases; the error is reported.
func TestStreamReplayFails(t *testing.T) {
	t.Parallel()
	boom := errors.New("connection refused")
	rep := &fakeReplayer{err: boom}
	f := newStreamFixture(t, rep, nil)
	f.send(0, block(1, 0))
	f.send(5, block(2, 0))
	assert.Zero(t, f.held(1, 1))
	assert.Equal(t, 1, f.held(2, 1))
	st := f.stats()
	assert.EqualValues(t, 1, st.ReplayFailures)
	assert.True(t, st.Trusted)
	require.Len(t, f.errs, 1)
	assert.ErrorIs(t, f.errs[0], boom)
}

// TestStreamRegression: the sequence going back (a publisher restart) clears the rank and
// rebuilds it from the new stream.
func TestStreamRegression(t *testing.T) {
	t.Parallel()
	f := newStreamFixture(t, nil, nil)
	for i := range 4 {
		f.send(uint64(i), block(1, i))
	}
	f.send(0, block(2, 0))
	assert.Zero(t, f.held(1, 1), "the restarted engine's old blocks are gone")
	assert.Equal(t, 1, f.held(2, 1))
	f.send(1, block(2, 1))
	assert.Equal(t, 2, f.held(2, 2))
	st := f.stats()
	assert.EqualValues(t, 1, st.Regressions)
	assert.Zero(t, st.Gaps)
	assert.True(t, st.Trusted)
}

// TestStreamSequenceJump: a jump of 2^62 is a gap (clear, rebase); going back from there is a
// regression; the index stays consistent throughout.
func TestStreamSequenceJump(t *testing.T) {
	t.Parallel()
	f := newStreamFixture(t, nil, nil)
	f.send(0, block(1, 0))
	f.send(1<<62, block(2, 0))
	f.send(1<<62+1, block(2, 1))
	assert.Zero(t, f.held(1, 1))
	assert.Equal(t, 2, f.held(2, 2))
	f.send(2, block(3, 0))
	assert.Zero(t, f.held(2, 1))
	assert.Equal(t, 1, f.held(3, 1))
	st := f.stats()
	assert.EqualValues(t, 2, st.Gaps, "2^62, then 2 after a restart that skipped 0 and 1")
	assert.EqualValues(t, 1, st.Regressions)
	assert.EqualValues(t, 2, st.LastSeq)
	assert.True(t, st.Trusted)
}

// TestStreamFirstBatch: the first batch after the stream was added starts it in step whatever its
// number (vLLM numbers from 0, llm-d from 1, and a router joining a running publisher sees a later
// number): no gap, no replay, no clear. Going back to 0 or 1 later is a publisher restart: the
// rank is cleared and rebuilt from the new stream.
func TestStreamFirstBatch(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		first, restart uint64
	}{{0, 0}, {1, 1}, {500, 0}, {500, 1}, {1 << 62, 1}} {
		rep := &fakeReplayer{payloads: map[uint64][]byte{}}
		f := newStreamFixture(t, rep, nil)
		for i := range 3 {
			f.send(tc.first+uint64(i), block(1, i))
		}
		assert.Equal(t, 3, f.held(1, 3), "first %d", tc.first)
		st := f.stats()
		assert.Zero(t, st.Gaps+st.Resyncs+st.Regressions+st.Duplicates, "first %d", tc.first)
		assert.Empty(t, rep.starts, "first %d: no replay", tc.first)
		assert.True(t, st.Trusted)
		assert.True(t, trusted(f.x, eng))

		f.send(tc.restart, block(2, 0))
		f.send(tc.restart+1, block(2, 1))
		assert.Zero(t, f.held(1, 1), "first %d restart %d: the restarted engine's blocks are gone", tc.first, tc.restart)
		assert.Equal(t, 2, f.held(2, 2), "first %d restart %d", tc.first, tc.restart)
		st = f.stats()
		assert.EqualValues(t, 1, st.Regressions, "first %d restart %d", tc.first, tc.restart)
		assert.EqualValues(t, 1, st.Resyncs, "first %d restart %d", tc.first, tc.restart)
		assert.Zero(t, st.Gaps, "first %d restart %d", tc.first, tc.restart)
		assert.Empty(t, rep.starts)
		assert.True(t, trusted(f.x, eng))
	}
}

// TestStreamRestartMissedFirstBatches: after a publisher restart, a first batch numbered above 1
// means batches of the new stream were missed: the replay is asked from 0.
func TestStreamRestartMissedFirstBatches(t *testing.T) {
	t.Parallel()
	rep := &fakeReplayer{payloads: map[uint64][]byte{}}
	f := newStreamFixture(t, rep, nil)
	for i := range 4 {
		f.send(uint64(100+i), block(1, i))
	}
	rep.seqs = []uint64{0, 1, 2}
	rep.payloads[0] = payload(t, 0, block(2, 0))
	rep.payloads[1] = payload(t, 0, block(2, 1))
	rep.payloads[2] = payload(t, 0, block(2, 2))
	f.send(2, block(2, 2))
	assert.Equal(t, []uint64{0}, rep.starts)
	assert.Zero(t, f.held(1, 1))
	assert.Equal(t, 3, f.held(2, 3))
	st := f.stats()
	assert.EqualValues(t, 1, st.Regressions)
	assert.EqualValues(t, 1, st.Gaps)
	assert.EqualValues(t, 1, st.Duplicates)
	assert.True(t, trusted(f.x, eng))
}

// TestStreamLostBatches: a payload that does not decode, or that names another DP rank, is a lost
// batch: the rank is cleared and untrusted until the next batch rebases it.
func TestStreamLostBatches(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		raw  func(t *testing.T) []byte
		want error
	}{
		{"garbage msgpack", func(*testing.T) []byte { return []byte{0xc1, 0x00} }, ErrPayload},
		{"truncated", func(t *testing.T) []byte { p := payload(t, 0, block(1, 1)); return p[:len(p)-3] }, ErrPayload},
		{"other DP rank", func(t *testing.T) []byte { return payload(t, 3, block(1, 1)) }, ErrRankMismatch},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newStreamFixture(t, nil, nil)
			f.send(0, block(1, 0))
			f.s.handle(context.Background(), item{seq: 1, payload: tc.raw(t)})
			f.s.publish()
			assert.Zero(t, f.held(1, 1), "cleared")
			assert.False(t, trusted(f.x, eng))
			assert.False(t, f.stats().Trusted)
			require.Len(t, f.errs, 1)
			assert.ErrorIs(t, f.errs[0], tc.want)
			f.send(2, block(2, 0))
			assert.Equal(t, 1, f.held(2, 1))
			assert.True(t, trusted(f.x, eng))
			st := f.stats()
			assert.EqualValues(t, 1, st.Malformed)
			assert.Zero(t, st.Gaps, "the rebase accepts the next number")
		})
	}
}

// TestStreamRefusedEvents: events the rules refuse are reported with typed errors and leave the
// index exactly as it was; the other events of the batch still apply.
func TestStreamRefusedEvents(t *testing.T) {
	t.Parallel()
	longHashes := storedArray(hashRange(50, 3), nil, prompt(5, 2), "GPU") // 3 hashes, 2 blocks of tokens
	wrongSize := storedArray(hashRange(60, 1), nil, prompt(6, 2)[:8], "GPU")
	wrongSize[4] = 8
	cases := []struct {
		name string
		ev   any
		want error
	}{
		{"block_size differs from the index's", wrongSize, kvindex.ErrBlockSizeMismatch},
		{"hash list longer than its token list", longHashes, kvindex.ErrBlockSizeMismatch},
		{"unknown medium", storedArray(hashRange(70, 1), nil, prompt(7, 1), "TAPE"), ErrUnknownMedium},
		{"adapter ID without a name", func() []any { e := storedArray(hashRange(90, 1), nil, prompt(9, 1), nil); e[5] = 4; return e }(), ErrUnknownAdapter},
		{"unknown parent", storedArray(hashRange(95, 1), uint64(12345), prompt(9, 2)[4:], "GPU"), kvindex.ErrUnknownParent},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newStreamFixture(t, nil, nil)
			f.send(0, block(1, 0))
			before := f.x.Stats()
			f.send(1, tc.ev, block(1, 1))
			require.Len(t, f.errs, 1)
			assert.ErrorIs(t, f.errs[0], tc.want)
			assert.EqualValues(t, 1, f.errs[0].Seq)
			assert.Equal(t, 2, f.held(1, 2), "the rest of the batch applied")
			after := f.x.Stats()
			assert.Equal(t, before.Blocks+1, after.Blocks, "only the valid event changed the index")
			assert.EqualValues(t, 1, f.stats().Rejected)
			assert.True(t, trusted(f.x, eng), "a refused event is not a lost batch")
		})
	}
	t.Run("block size mismatch is a *BlockSizeMismatchError", func(t *testing.T) {
		f := newStreamFixture(t, nil, nil)
		f.send(0, wrongSize)
		require.Len(t, f.errs, 1)
		var bs *BlockSizeMismatchError
		require.ErrorAs(t, f.errs[0], &bs)
		assert.Equal(t, BlockSizeMismatchError{EventBlockSize: 8, IndexBlockSize: testBlock}, *bs)
	})
}

// TestStreamAdaptersTiersAndGroups: a BlockStored naming a LoRA adapter (lora_name, or lora_id
// through Options.AdapterNames) is stored in the one index under the adapter, so that only the
// adapter's queries match it and base-model queries never do; media map to tiers, a removal
// finds every adapter's hashes, a lora_id without a name is refused, and non-main groups and
// placeholders are ignored.
func TestStreamAdaptersTiersAndGroups(t *testing.T) {
	t.Parallel()
	f := newStreamFixture(t, nil, func(o *Options) { o.AdapterNames = map[int64]string{7: "sql-lora"} })
	byName := storedArray(hashRange(100, 2), nil, prompt(1, 2), "CPU")
	byName[7] = "sql-lora"
	byID := storedArray(hashRange(200, 1), nil, prompt(2, 1), "cpu_pinned")
	byID[5] = 7
	unknownID := storedArray(hashRange(600, 1), nil, prompt(6, 1), nil)
	unknownID[5] = 8
	base := storedArray(hashRange(300, 1), nil, prompt(1, 1), nil)
	window := storedArray(hashRange(400, 1), nil, prompt(4, 1), nil)
	window[9], window[10] = 1, "sliding_window"
	placeholder := []any{"BlockStored", []uint64{500}, nil, []uint32{}, 0, nil, "CPU"}
	f.send(0, byName, byID, unknownID, base, window, placeholder)
	require.Len(t, f.errs, 1)
	assert.ErrorIs(t, f.errs[0], ErrUnknownAdapter, "lora_id 8 has no name")

	for _, tc := range []struct {
		adapter     string
		pattern, n  int
		want        int
		explanation string
	}{
		{"sql-lora", 1, 2, 2, "the adapter's blocks, by lora_name"},
		{"sql-lora", 2, 1, 1, "lora_id 7 is sql-lora"},
		{"", 1, 2, 1, "the base model matches its own block only"},
		{"", 2, 1, 0, "never an adapter's"},
		{"other", 1, 2, 0, "nor does another adapter"},
		{"", 6, 1, 0, "the refused event stored nothing"},
		{"", 4, 1, 0, "the sliding-window group is ignored"},
	} {
		assert.Equal(t, tc.want, heldUnder(t, f.x, tc.adapter, eng, tc.pattern, tc.n), "adapter %q prompt %d: %s", tc.adapter, tc.pattern, tc.explanation)
	}
	assert.Equal(t, 3, engineStats(f.x, eng).HostBlocks, "CPU and CPU_PINNED are host memory")
	assert.Equal(t, 1, engineStats(f.x, eng).DeviceBlocks, "no medium is the device")
	st := f.stats()
	assert.EqualValues(t, 2, st.Ignored)

	// One removal naming base and adapter hashes, and one the index does not hold.
	f.errs = nil
	f.send(1, removedArray([]uint64{101, 301, 999}, nil))
	assert.Zero(t, heldUnder(t, f.x, "sql-lora", eng, 1, 1))
	assert.Zero(t, heldUnder(t, f.x, "", eng, 1, 1))
	assert.Equal(t, 1, heldUnder(t, f.x, "sql-lora", eng, 2, 1))
	st = f.stats()
	assert.EqualValues(t, 2, st.RemovedBlocks)
	assert.EqualValues(t, 1, st.UnknownRemovals)
	require.Empty(t, f.errs)

	// AllBlocksCleared clears every adapter's blocks of the rank.
	f.send(2, clearedArray())
	assert.Zero(t, heldUnder(t, f.x, "sql-lora", eng, 2, 1))
	assert.EqualValues(t, 1, f.stats().Clears)
}

// TestStreamAdapterEventsNeedNoSetup: events naming an adapter go to its key space in the one
// index with no per-adapter configuration, and a LocalSource query for the adapter finds them
// while a base-model query does not.
func TestStreamAdapterEventsNeedNoSetup(t *testing.T) {
	t.Parallel()
	f := newStreamFixture(t, nil, nil)
	ev := storedMap(hashRange(100, 2), nil, prompt(1, 2), "GPU")
	ev["lora_name"] = "tenant-a"
	f.send(0, ev)
	require.Empty(t, f.errs)
	src, err := kvindex.NewLocalSource(f.x)
	require.NoError(t, err)
	for _, tc := range []struct {
		adapter string
		want    int
	}{{"tenant-a", 2}, {"", 0}, {"tenant-b", 0}} {
		r, err := src.Lookup(context.Background(), kvindex.Query{TokenIDs: prompt(1, 2), Adapter: tc.adapter})
		require.NoError(t, err)
		assert.Equal(t, tc.want, r.Blocks(eng), "adapter %q", tc.adapter)
	}
}

// TestStreamOverflow: a flood fills the bounded queue; further batches are dropped and counted,
// the engine is untrusted at once, and once the queue drains the stream resynchronises.
func TestStreamOverflow(t *testing.T) {
	t.Parallel()
	f := newStreamFixture(t, nil, func(o *Options) { o.QueueBatches = 4 })
	f.send(0, block(1, 0))
	for i := 1; i <= 100; i++ {
		f.s.enqueue(item{seq: uint64(i), payload: payload(t, 0, block(1, i))})
	}
	assert.EqualValues(t, 96, f.s.drops.Load())
	assert.False(t, trusted(f.x, eng), "untrusted as soon as a batch is dropped")
	assert.False(t, f.stats().Trusted)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); f.s.run(ctx) }()
	require.Eventually(t, func() bool { return !f.s.overflow.Load() }, 5*time.Second, time.Millisecond)
	f.s.enqueue(item{seq: 101, payload: payload(t, 0, block(2, 0))})
	require.Eventually(t, func() bool { return trusted(f.x, eng) }, 5*time.Second, time.Millisecond)
	cancel()
	<-done
	st := f.stats()
	assert.EqualValues(t, 96, st.Drops)
	assert.EqualValues(t, 1, st.Gaps)
	assert.EqualValues(t, 1, st.Resyncs)
	assert.True(t, st.Trusted)
	assert.Zero(t, f.held(1, 1), "cleared after the overflow")
	assert.Equal(t, 1, f.held(2, 1), "the first batch after the resync rebased the stream")
}

// TestStreamStoppedStaysTrusted: once a stream is stopped (its engine removed), a receiver still
// holding its route cannot mark the engine untrusted again by overflowing the dead queue.
func TestStreamStoppedStaysTrusted(t *testing.T) {
	t.Parallel()
	f := newStreamFixture(t, nil, func(o *Options) { o.QueueBatches = 1 })
	f.s.stop()
	for i := range 3 {
		f.s.enqueue(item{seq: uint64(i), payload: payload(t, 0, block(1, i))})
	}
	assert.EqualValues(t, 2, f.s.drops.Load())
	assert.True(t, trusted(f.x, eng))
}
