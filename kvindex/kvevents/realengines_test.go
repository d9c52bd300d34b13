package kvevents

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"log"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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
// socket answering in llm-d's shape; the rank keeps its blocks (no clear).
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
	pub.publish("kv", 0, payload(t, 0, block(1, 0)), false)
	pub.publish("kv", 2, payload(t, 0, block(1, 2)), false)
	require.Eventually(t, func() bool { st := streamStats(sub, eng); return st.Batches == 2 && st.Trusted }, 10*time.Second, 5*time.Millisecond)
	assert.Equal(t, 3, held(x, eng, 1, 3), "replayed batch 1 applied, nothing cleared")
	st := streamStats(sub, eng)
	assert.EqualValues(t, 1, st.Gaps)
	assert.EqualValues(t, 1, st.Replays)
	assert.Zero(t, st.ReplayFailures)
}
