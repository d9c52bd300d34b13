package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/enginepick/enginepick/state"
)

// TestStreamRootParentZero: a publisher following llm-d's convention sends parent_block_hash 0
// (not nil) for a block at the start of a prompt. The chain is stored in both encodings, and a
// block the rank really holds under engine hash 0 stays a parent.
func TestStreamRootParentZero(t *testing.T) {
	t.Parallel()
	forms := map[string]func(hashes []uint64, parent any, tokens []uint32, medium any) any{
		"array": func(h []uint64, p any, tok []uint32, m any) any { return storedArray(h, p, tok, m) },
		"map":   func(h []uint64, p any, tok []uint32, m any) any { return storedMap(h, p, tok, m) },
	}
	for name, stored := range forms {
		t.Run(name, func(t *testing.T) {
			f := newStreamFixture(t, nil, nil)
			f.send(0, stored([]uint64{11}, uint64(0), prompt(1, 1), "GPU"))
			f.send(1, stored([]uint64{12, 13}, uint64(11), prompt(1, 3)[testBlock:], "GPU"))
			require.Empty(t, f.errs)
			assert.Equal(t, 3, f.held(1, 3), "the chain rooted at parent 0 is stored")

			// A block whose engine hash really is 0, then a child naming it.
			f.send(2, stored([]uint64{0}, nil, prompt(2, 1), "GPU"))
			f.send(3, stored([]uint64{21}, uint64(0), prompt(2, 2)[testBlock:], "GPU"))
			require.Empty(t, f.errs)
			assert.Equal(t, 2, f.held(2, 2), "parent 0 is the held block 0, not a root")
			assert.Zero(t, f.held(3, 1))
			st := f.stats()
			assert.EqualValues(t, 5, st.StoredBlocks)
			assert.Zero(t, st.Rejected)
		})
	}
}

// replayServer is a ROUTER replay socket that answers each request ["", start] (as the ROUTER
// sees it, [identity, "", start]) with reply(start): the frames of every message it sends after
// the identity.
func replayServer(t *testing.T, reply func(start uint64) [][][]byte) string {
	t.Helper()
	addr := freeAddr(t)
	router := zmq4.NewRouter(context.Background())
	require.NoError(t, router.Listen(addr))
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			msg, err := router.Recv()
			if err != nil {
				return
			}
			if len(msg.Frames) != 3 || len(msg.Frames[2]) != 8 {
				continue
			}
			id := msg.Frames[0]
			for _, frames := range reply(binary.BigEndian.Uint64(msg.Frames[2])) {
				_ = router.SendMulti(zmq4.NewMsgFrom(append([][]byte{id}, frames...)...))
			}
		}
	})
	t.Cleanup(func() { _ = router.Close(); wg.Wait() })
	return addr
}

// TestReplayReplyShapes: vLLM's replay socket answers ["", seq, payload] and ends with
// ["", −1, ""]; llm-d's answers ["", topic, seq, payload] and ends with ["", "", −1, ""]. Both
// replay; any other shape is ErrFrames.
func TestReplayReplyShapes(t *testing.T) {
	t.Parallel()
	empty := []byte{}
	batches := func(withTopic bool) func(uint64) [][][]byte {
		return func(start uint64) [][][]byte {
			var out [][][]byte
			for seq := start; seq < 3; seq++ {
				f := [][]byte{empty, be64(seq), []byte{byte('a' + seq)}}
				if withTopic {
					f = [][]byte{empty, []byte("kv@sim"), be64(seq), []byte{byte('a' + seq)}}
				}
				out = append(out, f)
			}
			end := [][]byte{empty, be64(endSeq), empty}
			if withTopic {
				end = [][]byte{empty, empty, be64(endSeq), empty}
			}
			return append(out, end)
		}
	}
	bad := func(frames ...[]byte) func(uint64) [][][]byte {
		return func(uint64) [][][]byte { return [][][]byte{frames} }
	}
	for _, tc := range []struct {
		name  string
		reply func(uint64) [][][]byte
		want  []string // "seq:payload" received, when the replay succeeds
	}{
		{"vLLM", batches(false), []string{"1:b", "2:c"}},
		{"llm-d with topic", batches(true), []string{"1:b", "2:c"}},
		{"five frames", bad(empty, []byte("kv"), be64(1), []byte("x"), []byte("y")), nil},
		{"topic form without the empty delimiter", bad([]byte("d"), []byte("kv"), be64(1), []byte("x")), nil},
		{"short sequence frame", bad(empty, []byte("kv"), []byte{1, 2}, []byte("x")), nil},
		{"one frame", bad(empty), nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addr := replayServer(t, tc.reply)
			r := &zmqReplayer{addr: addr, timeout: 5 * time.Second, log: log.New(io.Discard, "", 0)}
			var got []string
			err := r.replay(context.Background(), 1, func(seq uint64, payload []byte) {
				got = append(got, fmt.Sprintf("%d:%s", seq, payload))
			})
			if tc.want == nil {
				var de *DecodeError
				require.ErrorAs(t, err, &de)
				assert.ErrorIs(t, err, ErrFrames)
				assert.Empty(t, got)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, got)
		})
	}
}

// TestSubscriberReplaysWithTopicFrames: a batch lost on the PUB socket is refilled from a replay
// socket answering in llm-d's shape; the rank keeps its blocks (no clear). The first block names
// parent 0, as llm-d's publishers do for a root.
func TestSubscriberReplaysWithTopicFrames(t *testing.T) {
	addr := freeAddr(t)
	pub := newGoPublisher(t, addr, true, "")
	defer pub.close()
	lost := payload(t, 0, block(1, 1))
	replay := replayServer(t, func(start uint64) [][][]byte {
		var out [][][]byte
		if start <= 1 {
			out = append(out, [][]byte{{}, []byte("kv"), be64(1), lost})
		}
		return append(out, [][]byte{{}, {}, be64(endSeq), {}})
	})
	x := newIndex(t, "")
	sub := newSubscriber(t, x, nil, Endpoint{Engine: eng, Address: addr, Topic: "kv", ReplayAddress: replay})
	handshake(t, sub, pub)
	pub.publish("kv", 0, payload(t, 0, storedArray([]uint64{1001}, uint64(0), prompt(1, 1), "GPU")), false)
	pub.publish("kv", 2, payload(t, 0, block(1, 2)), false)
	require.Eventually(t, func() bool { st := streamStats(sub, eng); return st.Batches == 2 && st.Trusted }, 10*time.Second, 5*time.Millisecond)
	assert.Equal(t, 3, held(x, eng, 1, 3), "replayed batch 1 applied, nothing cleared")
	st := streamStats(sub, eng)
	assert.EqualValues(t, 1, st.Gaps)
	assert.EqualValues(t, 1, st.Replays)
	assert.Zero(t, st.ReplayFailures)
	assert.Zero(t, st.Rejected)
}

// fakeClock is a settable clock.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{t: time.Unix(1_767_225_600, 0)} } // local time, as time.Unix(0, n) reads back

func (c *fakeClock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }

func (c *fakeClock) advance(d time.Duration) { c.mu.Lock(); c.t = c.t.Add(d); c.mu.Unlock() }

// warnings returns the Warn entries logged with msg, each as its context map.
func warnings(logs *observer.ObservedLogs, msg string) []map[string]any {
	var out []map[string]any
	for _, e := range logs.FilterMessage(msg).All() {
		if e.Level == zap.WarnLevel {
			out = append(out, e.ContextMap())
		}
	}
	return out
}

// TestStreamCountersAndWarnings runs a scripted stream through the receive and apply paths and
// checks every counter it moves, and that each failure kind is warned about once per interval,
// naming the engine, the DP rank and the cause.
func TestStreamCountersAndWarnings(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	core, logs := observer.New(zap.DebugLevel)
	rep := &fakeReplayer{payloads: map[uint64][]byte{}}
	f := newStreamFixture(t, rep, func(o *Options) { o.Now, o.Logger, o.WarnInterval = clock.now, zap.New(core), time.Minute })
	unknownParent := func(base uint64) []any {
		return storedArray(hashRange(base, 1), uint64(12345), prompt(9, 2)[testBlock:], "GPU")
	}

	f.send(0, block(1, 0))
	assert.Equal(t, clock.now(), f.stats().LastBatchAt)
	clock.advance(time.Second)
	f.send(1, unknownParent(50), storedArray(hashRange(60, 1), nil, prompt(6, 1), "TAPE"), block(1, 1))
	clock.advance(time.Second)
	f.send(2, unknownParent(70)) // warned about within the minute: held back
	f.sendRaw(3, []byte{0xc1})   // malformed: rank cleared, next batch rebases
	f.send(4, block(2, 0))
	rep.seqs = []uint64{5, 6}
	rep.payloads[5] = payload(t, 0, block(2, 1))
	rep.payloads[6] = payload(t, 0, block(2, 2))
	f.send(7, block(2, 3)) // gap 5–6, replayed
	assert.Equal(t, 4, f.held(2, 4))
	rep.seqs, rep.err = nil, errors.New("connection refused")
	f.send(9, block(3, 0)) // gap 8, replay fails: cleared, rebased on 9
	f.send(0, block(4, 0)) // restart
	clock.advance(time.Minute)
	f.send(1, unknownParent(80)) // a minute later: warned again, with one held back

	st := f.stats()
	assert.Equal(t, map[string]uint64{"unknown_parent": 3, "block_size": 0, "unknown_medium": 1, "unknown_adapter": 0,
		"duplicate_hash": 0, "key_conflict": 0, "other": 0}, st.Refused)
	assert.EqualValues(t, 4, st.Rejected)
	assert.EqualValues(t, 9, st.Batches)
	assert.EqualValues(t, 1, st.Malformed)
	assert.EqualValues(t, 2, st.Gaps)
	assert.EqualValues(t, 1, st.Regressions)
	assert.EqualValues(t, 4, st.Resyncs, "malformed, two gaps, restart")
	assert.EqualValues(t, 1, st.Replays)
	assert.EqualValues(t, 1, st.ReplayFailures)
	assert.EqualValues(t, 2, st.ReplayedBatches)
	assert.EqualValues(t, 3, st.RankClears, "malformed, failed replay, restart")
	assert.Zero(t, st.Clears, "no AllBlocksCleared event")
	assert.Equal(t, clock.now(), st.LastBatchAt)
	assert.True(t, st.Trusted)
	assert.Equal(t, 1, f.held(4, 1))

	refusedWarns := warnings(logs, "kvevents: event refused")
	require.Len(t, refusedWarns, 3, "unknown parent, unknown medium, unknown parent a minute later")
	assert.Equal(t, map[string]any{"engine": eng, "dp_rank": int64(0), "reason": "unknown_parent", "seq": uint64(1),
		"error": refusedWarns[0]["error"], "suppressed": uint64(0)}, refusedWarns[0])
	assert.Equal(t, "unknown_medium", refusedWarns[1]["reason"])
	assert.Equal(t, "unknown_parent", refusedWarns[2]["reason"])
	assert.Equal(t, uint64(1), refusedWarns[2]["suppressed"], "seq 2's refusal was held back")
	assert.Len(t, warnings(logs, "kvevents: malformed batch"), 1)
	resync := warnings(logs, "kvevents: batches lost, resynchronising")
	require.Len(t, resync, 1, "the second gap falls within the minute")
	assert.Equal(t, "gap", resync[0]["cause"])
	assert.Equal(t, uint64(5), resync[0]["missing_from_seq"])
	restart := warnings(logs, "kvevents: publisher restarted, rebuilding the rank")
	require.Len(t, restart, 1)
	assert.Equal(t, map[string]any{"engine": eng, "dp_rank": int64(0), "expected_seq": uint64(10), "seq": uint64(0), "suppressed": uint64(0)}, restart[0])
	clears := warnings(logs, "kvevents: rank cleared after a loss")
	require.Len(t, clears, 1)
	assert.Equal(t, "malformed", clears[0]["cause"])
	replay := warnings(logs, "kvevents: replay failed")
	require.Len(t, replay, 1)
	assert.Equal(t, eng, replay[0]["engine"])
	assert.Contains(t, replay[0]["error"], "connection refused")
}

// TestSubscriberUnknownTopic: batches on a topic the endpoint does not name (a wrong kv_topic) are
// counted on the stream and the subscriber, the topic seen is kept, and a warning names it with
// the topic expected.
func TestSubscriberUnknownTopic(t *testing.T) {
	addr := freeAddr(t)
	pub := newGoPublisher(t, addr, true, "")
	defer pub.close()
	core, logs := observer.New(zap.WarnLevel)
	x := newIndex(t, "")
	sub := newSubscriber(t, x, func(o *Options) { o.Logger = zap.New(core) }, Endpoint{Engine: eng, Address: addr, Topic: "kv"})
	seq := uint64(0)
	require.Eventually(t, func() bool {
		pub.publish("kv@vllm", seq, payload(t, 0, block(1, int(seq))), false)
		seq++
		return streamStats(sub, eng).UnknownTopics > 0
	}, 10*time.Second, 20*time.Millisecond)
	st := streamStats(sub, eng)
	assert.Equal(t, "kv@vllm", st.LastUnknownTopic)
	assert.Zero(t, st.Batches)
	assert.Zero(t, held(x, eng, 1, 1))
	stats := sub.Stats()
	assert.Equal(t, "kv@vllm", stats.LastUnknownTopic)
	// Messages published before the one counted may still arrive: the totals agree once they have.
	assert.Eventually(t, func() bool {
		return streamStats(sub, eng).UnknownTopics == sub.Stats().UnknownTopics
	}, 5*time.Second, 10*time.Millisecond, "the subscriber's total is its one stream's")
	w := warnings(logs, "kvevents: message on a topic no endpoint of this address names; check the engines' KV-event topic")
	require.Len(t, w, 1, "once per interval")
	assert.Equal(t, "kv@vllm", w[0]["topic"])
	assert.Equal(t, addr, w[0]["address"])
	assert.Equal(t, []any{`"kv" (engine http://engine-a:8000 rank 0)`}, w[0]["expected"])
}

// dispatchLog is a fake Options.Dispatched: the times requests were sent to each engine rank.
type dispatchLog struct {
	mu sync.Mutex
	at map[string][]time.Time
}

func (d *dispatchLog) add(engine string, at time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.at == nil {
		d.at = map[string][]time.Time{}
	}
	d.at[engine] = append(d.at[engine], at)
}

func (d *dispatchLog) dispatched(engine state.EngineID, _ int, since time.Time) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, t := range d.at[string(engine)] {
		if !t.Before(since) {
			return true
		}
	}
	return false
}

// TestSilenceRule: a stream with no batch for SilenceTimeout after a request was sent to its
// engine is untrusted, in its stats and in the index, until a batch arrives; an idle engine's
// silence costs it nothing.
func TestSilenceRule(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	start := clock.now()
	core, logs := observer.New(zap.WarnLevel)
	var d dispatchLog
	x := newIndex(t, "")
	sub, err := New(Options{Index: x, Now: clock.now, Logger: zap.New(core), Dispatched: d.dispatched, SilenceTimeout: 30 * time.Second})
	require.NoError(t, err)
	defer sub.Close()
	for _, e := range []string{"idle", "busy"} {
		require.NoError(t, sub.Add(Endpoint{Engine: state.EngineID(e), Address: "inproc://" + e}))
	}
	at := func(d time.Duration) { clock.advance(start.Add(d).Sub(clock.now())); sub.CheckSilence() }
	marks := func(e string) (stats, index bool) {
		return streamStats(sub, state.EngineID(e)).Trusted, trusted(x, state.EngineID(e))
	}
	check := func(e string, want bool, msg string) {
		t.Helper()
		s, i := marks(e)
		assert.Equal(t, want, s, "%s: stats: %s", e, msg)
		assert.Equal(t, want, i, "%s: index: %s", e, msg)
	}

	at(time.Hour) // nothing sent anywhere for an hour
	check("idle", true, "idle for an hour")
	check("busy", true, "idle for an hour")

	d.add("busy", start.Add(time.Hour+time.Second))
	at(time.Hour + 2*time.Second) // the check sees the dispatch: the timeout runs from here
	at(time.Hour + 31*time.Second)
	check("busy", true, "29 s after the dispatch was seen")
	at(time.Hour + 32*time.Second)
	check("busy", false, "30 s after the dispatch was seen, no batch")
	check("idle", true, "never sent a request")
	st := streamStats(sub, "busy")
	assert.True(t, st.Silent)
	assert.EqualValues(t, 1, st.Silences)
	w := warnings(logs, "kvevents: no batch since requests were sent to the engine; its blocks are untrusted until one arrives")
	require.Len(t, w, 1)
	assert.Equal(t, "busy", w[0]["engine"])
	at(time.Hour + 10*time.Minute)
	assert.EqualValues(t, 1, streamStats(sub, "busy").Silences, "still the same silence")

	sub.mu.Lock()
	busy := sub.streams[streamKey{"busy", 0}]
	sub.mu.Unlock()
	busy.enqueue(item{seq: 0, payload: payload(t, 0, block(1, 0))})
	check("busy", true, "a batch arrived")
	assert.False(t, streamStats(sub, "busy").Silent)
	assert.Equal(t, clock.now(), streamStats(sub, "busy").LastBatchAt)

	// A dispatch answered by a batch within the timeout is not a silence.
	d.add("busy", start.Add(11*time.Minute))
	at(11*time.Minute + time.Second)
	clock.advance(time.Second)
	busy.enqueue(item{seq: 1, payload: payload(t, 0, block(1, 1))})
	at(time.Hour * 2)
	check("busy", true, "the dispatch was followed by a batch")
	assert.EqualValues(t, 1, streamStats(sub, "busy").Silences)
}
