package testengine

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/enginepick/enginepick/internal/kvwire"
)

// wireEvent is a decoded KV event, whatever its encoding.
type wireEvent struct {
	Type      string
	Hashes    []uint64
	Parent    any // nil, or the parent's hash as uint64
	Tokens    []uint32
	BlockSize int
	Medium    string
}

// wireBatch is a decoded batch.
type wireBatch struct {
	Seq    uint64
	Events []wireEvent
	Rank   any // nil when absent, else the rank as int
}

// decodeBatch decodes a payload generically, checking the shape of its encoding (arrays or maps).
func decodeBatch(t *testing.T, payload []byte, enc Encoding) wireBatch {
	t.Helper()
	d := msgpack.NewDecoder(bytes.NewReader(payload))
	d.UseLooseInterfaceDecoding(true)
	var v any
	require.NoError(t, d.Decode(&v))
	var b wireBatch
	var evs []any
	if enc == EncodingArray {
		arr, ok := v.([]any)
		require.True(t, ok, "batch %T, want an array", v)
		require.Contains(t, []int{2, 3}, len(arr))
		_, ok = arr[0].(float64)
		require.True(t, ok, "ts %T", arr[0])
		evs = arr[1].([]any)
		if len(arr) == 3 {
			b.Rank = int(u64(t, arr[2]))
		}
	} else {
		m, ok := v.(map[string]any)
		require.True(t, ok, "batch %T, want a map", v)
		_, ok = m["ts"].(float64)
		require.True(t, ok, "ts %T", m["ts"])
		evs = m["events"].([]any)
		if r, ok := m["data_parallel_rank"]; ok {
			b.Rank = int(u64(t, r))
		}
	}
	for _, raw := range evs {
		var ev wireEvent
		if enc == EncodingArray {
			a := raw.([]any)
			ev.Type = a[0].(string)
			switch ev.Type {
			case "BlockStored":
				require.Len(t, a, 7)
				ev.Hashes, ev.Parent, ev.Tokens = hashesOf(t, a[1]), parentOf(t, a[2]), tokensOf(t, a[3])
				ev.BlockSize, ev.Medium = int(u64(t, a[4])), a[6].(string)
				assert.Nil(t, a[5], "lora_id")
			case "BlockRemoved":
				require.Len(t, a, 3)
				ev.Hashes, ev.Medium = hashesOf(t, a[1]), a[2].(string)
			default:
				require.Len(t, a, 1)
			}
		} else {
			m := raw.(map[string]any)
			ev.Type = m["type"].(string)
			switch ev.Type {
			case "BlockStored":
				require.Len(t, m, 8)
				ev.Hashes, ev.Parent, ev.Tokens = hashesOf(t, m["block_hashes"]), parentOf(t, m["parent_block_hash"]), tokensOf(t, m["token_ids"])
				ev.BlockSize, ev.Medium = int(u64(t, m["block_size"])), m["medium"].(string)
				assert.Nil(t, m["lora_id"])
				assert.Nil(t, m["lora_name"])
			case "BlockRemoved":
				require.Len(t, m, 3)
				ev.Hashes, ev.Medium = hashesOf(t, m["block_hashes"]), m["medium"].(string)
			default:
				require.Len(t, m, 1)
			}
		}
		b.Events = append(b.Events, ev)
	}
	return b
}

func u64(t *testing.T, v any) uint64 {
	t.Helper()
	switch x := v.(type) {
	case int64:
		require.GreaterOrEqual(t, x, int64(0))
		return uint64(x)
	case uint64:
		return x
	}
	require.Failf(t, "not an integer", "%T %v", v, v)
	return 0
}

func hashesOf(t *testing.T, v any) []uint64 {
	var out []uint64
	for _, h := range v.([]any) {
		out = append(out, u64(t, h))
	}
	return out
}

func tokensOf(t *testing.T, v any) []uint32 {
	var out []uint32
	for _, x := range v.([]any) {
		out = append(out, uint32(u64(t, x)))
	}
	return out
}

func parentOf(t *testing.T, v any) any {
	if v == nil {
		return nil
	}
	return u64(t, v)
}

// closeSock closes a zmq4 socket and drains it until its goroutines have returned.
func closeSock(s zmq4.Socket) {
	_ = s.Close()
	for closed := 0; closed < 64; {
		if _, err := s.Recv(); err != nil {
			closed++
		} else {
			closed = 0
		}
	}
}

// replayFrames asks the replay socket at addr for the batches from start and returns each reply's
// frames after the empty delimiter, the end marker included.
func replayFrames(t *testing.T, addr string, start uint64) [][][]byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s := zmq4.NewDealer(ctx, zmq4.WithLogger(quietLog))
	defer closeSock(s)
	require.NoError(t, s.Dial(addr))
	require.NoError(t, s.SendMulti(zmq4.NewMsgFrom([]byte{}, be64(start))))
	var out [][][]byte
	for {
		msg, err := s.Recv()
		require.NoError(t, err)
		require.NotEmpty(t, msg.Frames)
		require.Empty(t, msg.Frames[0], "the empty delimiter")
		f := msg.Frames[1:]
		out = append(out, f)
		if len(f) >= 2 && len(f[len(f)-2]) == 8 && binary.BigEndian.Uint64(f[len(f)-2]) == endSeq {
			return out
		}
	}
}

// replayBatches returns rank's buffered batches from the replay socket, decoded (vLLM framing).
func replayBatches(t *testing.T, e *Engine, rank int) []wireBatch {
	t.Helper()
	o := e.Options().KVEvents
	var out []wireBatch
	frames := replayFrames(t, e.ReplayEndpoint(rank), o.FirstSeq)
	for _, f := range frames[:len(frames)-1] {
		require.Len(t, f, 2)
		b := decodeBatch(t, f[1], o.Encoding)
		b.Seq = binary.BigEndian.Uint64(f[0])
		out = append(out, b)
	}
	return out
}

func stored(hashes []uint64, parent any, tokens []uint32, blockSize int) wireEvent {
	return wireEvent{Type: "BlockStored", Hashes: hashes, Parent: parent, Tokens: tokens, BlockSize: blockSize, Medium: "GPU"}
}

func removed(h uint64) wireEvent {
	return wireEvent{Type: "BlockRemoved", Hashes: []uint64{h}, Medium: "GPU"}
}

// idsPrompt is a completions body with a token-ID prompt.
func idsPrompt(ids []uint32, maxTokens int) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = fmt.Sprint(id)
	}
	return fmt.Sprintf(`{"prompt":[%s],"max_tokens":%d}`, strings.Join(s, ","), maxTokens)
}

func seqIDs(from, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(from + i)
	}
	return out
}

// Every option of the encoding shows on the wire: maps or tagged arrays, the root parent as nil or
// 0, the first sequence number, the rank field; and the current decoder reads every variant.
func TestKVEventEncodings(t *testing.T) {
	for _, tc := range []struct {
		name string
		kv   KVEventsOptions
	}{
		{"vllm map", KVEventsOptions{}},
		{"legacy arrays", KVEventsOptions{Encoding: EncodingArray}},
		{"root parent 0, seq from 1", KVEventsOptions{RootParentZero: true, FirstSeq: 1}},
		{"arrays without rank", KVEventsOptions{Encoding: EncodingArray, OmitDPRank: true}},
		{"map without rank", KVEventsOptions{OmitDPRank: true, Topic: "kv@127.0.0.1@test-model"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := start(t, Options{BlockSize: 4, KVEvents: tc.kv})
			prompt := seqIDs(1, 9) // 2 full blocks
			require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(prompt, 4), nil, nil))
			out := Tokenize(strings.Join(Generate(prompt, 4), ""))
			all := append(prompt, out...)
			h := BlockHashes(all, 4) // 13 tokens; 12 computed: 3 blocks
			var root any
			if tc.kv.RootParentZero {
				root = uint64(0)
			}
			var rank any = 0
			if tc.kv.OmitDPRank {
				rank = nil
			}
			want := []wireBatch{
				{Seq: tc.kv.FirstSeq, Rank: rank, Events: []wireEvent{stored(h[:2], root, prompt[:8], 4)}},
				{Seq: tc.kv.FirstSeq + 1, Rank: rank, Events: []wireEvent{stored(h[2:3], h[1], all[8:12], 4)}},
			}
			assert.Equal(t, want, replayBatches(t, e, 0))
			assert.Equal(t, tc.kv.FirstSeq+2, e.Stats(0).NextSeq)

			// The project's decoder reads it.
			frames := replayFrames(t, e.ReplayEndpoint(0), 0)
			var b kvwire.Batch
			require.NoError(t, kvwire.NewDecoder().Decode(frames[0][1], &b))
			require.Len(t, b.Events, 1)
			assert.Equal(t, kvwire.KindStored, b.Events[0].Kind)
			assert.Equal(t, h[:2], b.Events[0].BlockHashes)
			assert.Equal(t, prompt[:8], b.Events[0].TokenIDs)
			assert.Equal(t, !tc.kv.OmitDPRank, b.HasDPRank)
		})
	}
}

// The replay socket answers in either framing, from any start, and keeps only the latest
// ReplayBufferSize batches.
func TestReplay(t *testing.T) {
	for name, format := range map[string]ReplayFormat{"vllm": ReplayVLLM, "topic": ReplayTopic} {
		t.Run(name, func(t *testing.T) {
			e := start(t, Options{BlockSize: 4, KVEvents: KVEventsOptions{ReplayFormat: format, ReplayBufferSize: 3, Topic: "kv@a@m"}})
			for i := range 5 { // one batch each: 4 tokens, 1 output token
				require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(seqIDs(100*(i+1), 4), 1), nil, nil))
			}
			require.Equal(t, uint64(5), e.Stats(0).NextSeq)
			for _, tc := range []struct {
				start uint64
				want  []uint64
			}{{0, []uint64{2, 3, 4}}, {3, []uint64{3, 4}}, {5, nil}, {endSeq - 1, nil}} {
				frames := replayFrames(t, e.ReplayEndpoint(0), tc.start)
				var seqs []uint64
				for i, f := range frames {
					last := i == len(frames)-1
					if format == ReplayTopic {
						require.Len(t, f, 3)
						topic := "kv@a@m"
						if last {
							topic = ""
						}
						assert.Equal(t, topic, string(f[0]))
						f = f[1:]
					}
					require.Len(t, f, 2)
					seq := binary.BigEndian.Uint64(f[0])
					if last {
						assert.Equal(t, endSeq, seq)
						assert.Empty(t, f[1])
						continue
					}
					seqs = append(seqs, seq)
					b := decodeBatch(t, f[1], EncodingMap)
					require.Len(t, b.Events, 1)
					prompt := seqIDs(100*int(seq+1), 4)
					assert.Equal(t, stored(BlockHashes(prompt, 4), nil, prompt, 4), b.Events[0])
				}
				assert.Equal(t, tc.want, seqs, "from %d", tc.start)
			}
		})
	}
}

// The PUB socket sends [topic, sequence, payload], numbered one by one, the payload the one the
// replay socket keeps; DropBatches makes it skip one.
func TestPublishedFrames(t *testing.T) {
	e := start(t, Options{BlockSize: 4, KVEvents: KVEventsOptions{Topic: "kv@host@test-model", FirstSeq: 1}})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sub := zmq4.NewSub(ctx, zmq4.WithLogger(quietLog))
	defer closeSock(sub)
	require.NoError(t, sub.Dial(e.KVEndpoint(0)))
	require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, ""))
	got := make(chan zmq4.Msg, 1000)
	go func() {
		for {
			msg, err := sub.Recv()
			if err != nil {
				close(got)
				return
			}
			got <- msg
		}
	}()
	// A subscriber misses what is published before it is connected: publish until one arrives.
	var first zmq4.Msg
	for deadline := time.Now().Add(10 * time.Second); first.Frames == nil; {
		require.True(t, time.Now().Before(deadline), "no message arrived")
		require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(seqIDs(int(e.Stats(0).NextSeq)*10, 4), 1), nil, nil))
		select {
		case first = <-got:
		case <-time.After(20 * time.Millisecond):
		}
	}
	for i := range 3 {
		require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(seqIDs(1000+10*i, 4), 1), nil, nil))
	}
	msgs := []zmq4.Msg{first}
	for len(msgs) < 4 {
		select {
		case m := <-got:
			msgs = append(msgs, m)
		case <-time.After(10 * time.Second):
			require.FailNow(t, "missing messages")
		}
	}
	// A dropped batch is numbered and kept for replay, but never sent.
	e.DropBatches(0, 1)
	for i := range 2 {
		require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(seqIDs(2000+10*i, 4), 1), nil, nil))
	}
	var after zmq4.Msg
	select {
	case after = <-got:
	case <-time.After(10 * time.Second):
		require.FailNow(t, "missing message")
	}
	buffered := replayFrames(t, e.ReplayEndpoint(0), 1)
	start := binary.BigEndian.Uint64(msgs[0].Frames[1])
	require.Len(t, after.Frames, 3)
	assert.Equal(t, start+5, binary.BigEndian.Uint64(after.Frames[1]), "batch %d was dropped", start+4)
	require.Len(t, buffered, int(start+5)+1, "the replay buffer holds batches 1 to %d, the dropped one included, and the end marker", start+5)
	assert.Equal(t, be64(start+4), buffered[start+3][0])
	for i, m := range msgs {
		require.Len(t, m.Frames, 3)
		assert.Equal(t, "kv@host@test-model", string(m.Frames[0]))
		require.Len(t, m.Frames[1], 8)
		seq := binary.BigEndian.Uint64(m.Frames[1])
		assert.Equal(t, start+uint64(i), seq)
		assert.Equal(t, buffered[seq-1][1], m.Frames[2], "batch %d", seq)
		assert.Equal(t, buffered[seq-1][0], m.Frames[1])
	}
}
