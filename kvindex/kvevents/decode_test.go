package kvevents

import (
	"encoding/binary"
	"errors"
	"math"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/internal/kvwire"
)

// TestDecodeFormsAgree: every encoding a publisher has used for one batch decodes to the same
// Batch: tagged arrays with all of today's fields (trailing nils), SGLang's and early vLLM's
// five-field arrays, arrays longer than today's field list, tagged maps with unknown keys, and
// the batch itself as a 3-element array, a 2-element array or a map.
func TestDecodeFormsAgree(t *testing.T) {
	t.Parallel()
	hashes := []uint64{math.MaxUint64 - 1, 7} // an unsigned hash above 2^63, as vLLM publishes
	toks := prompt(1, 2)
	want := kvwire.Batch{Timestamp: 1789095808.83, DPRank: 0, HasDPRank: true, Events: []kvwire.Event{
		{Kind: kvwire.KindStored, BlockHashes: hashes, ParentHash: 5, HasParent: true, TokenIDs: toks, BlockSize: testBlock, Medium: "GPU"},
		{Kind: kvwire.KindRemoved, BlockHashes: []uint64{7}, Medium: "GPU"},
		{Kind: kvwire.KindCleared},
	}}
	cases := []struct {
		name  string
		batch any
	}{
		{"array events, array batch", []any{1789095808.83, []any{
			storedArray(hashes, 5, toks, "GPU"), removedArray([]uint64{7}, "GPU"), clearedArray()}, 0}},
		{"five-field arrays (SGLang, vLLM v0.9) with medium appended", []any{1789095808.83, []any{
			[]any{"BlockStored", hashes, 5, toks, testBlock, nil, "GPU"}, []any{"BlockRemoved", []uint64{7}, "GPU"}, []any{"AllBlocksCleared"}}, 0}},
		{"arrays longer than today's field list", []any{1789095808.83, []any{
			append(storedArray(hashes, 5, toks, "GPU"), "locality", []any{1, 2}, map[string]any{"x": 1}),
			[]any{"BlockRemoved", []uint64{7}, "GPU", 0, "full_attention", "extra"},
			[]any{"AllBlocksCleared", nil, 3}}, 0}},
		{"map events with unknown keys", []any{1789095808.83, []any{
			func() map[string]any {
				m := storedMap(hashes, 5, toks, "GPU")
				m["extra_keys"] = []any{nil, []any{"abc", 3}}
				m["group_idx"] = 0
				m["kv_cache_spec_kind"] = "full_attention"
				m["session_id"] = "s1"
				return m
			}(),
			map[string]any{"type": "BlockRemoved", "block_hashes": []uint64{7}, "medium": "GPU", "future": true},
			map[string]any{"type": "AllBlocksCleared"}}, 0}},
		{"map batch", map[string]any{"ts": 1789095808.83, "data_parallel_rank": 0, "events": []any{
			storedMap(hashes, 5, toks, "GPU"), removedArray([]uint64{7}, "GPU"), clearedArray()}}},
		{"map batch with SGLang's rank key", map[string]any{"ts": 1789095808.83, "attn_dp_rank": 0, "events": []any{
			storedMap(hashes, 5, toks, "GPU"), removedArray([]uint64{7}, "GPU"), clearedArray()}}},
	}
	d := kvwire.NewDecoder()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var got kvwire.Batch
			require.NoError(t, d.Decode(mustMarshal(t, tc.batch), &got))
			for i := range got.Events { // group fields are not part of want
				got.Events[i].HasGroupIdx, got.Events[i].GroupIdx, got.Events[i].SpecKind = false, 0, ""
			}
			assert.Equal(t, want, got)
		})
	}

	t.Run("two-element batch has no rank", func(t *testing.T) {
		var got kvwire.Batch
		require.NoError(t, d.Decode(payload(t, nil, clearedArray()), &got))
		assert.False(t, got.HasDPRank)
		assert.Equal(t, []kvwire.Event{{Kind: kvwire.KindCleared}}, got.Events)
	})
}

// TestDecodeHashForms: signed (SGLang), unsigned (vLLM) and raw-bytes block hashes are kept as
// opaque 64-bit IDs; bytes reduce to the integer vLLM would have published (the low 64 bits).
func TestDecodeHashForms(t *testing.T) {
	t.Parallel()
	digest := make([]byte, 32)
	for i := range digest {
		digest[i] = byte(i + 1)
	}
	cases := []struct {
		name string
		hash any
		want uint64
	}{
		{"unsigned above 2^63", uint64(1 << 63), 1 << 63},
		{"signed negative is bit-cast", int64(-2), math.MaxUint64 - 1},
		{"small positive", 9, 9},
		{"32-byte digest: its last 8 bytes", digest, binary.BigEndian.Uint64(digest[24:])},
		{"3 bytes", []byte{1, 2, 3}, 0x010203},
	}
	d := kvwire.NewDecoder()
	for _, tc := range cases {
		var b kvwire.Batch
		raw := []any{1.0, []any{[]any{"BlockRemoved", []any{tc.hash}}}}
		require.NoError(t, d.Decode(mustMarshal(t, raw), &b), tc.name)
		assert.Equal(t, []uint64{tc.want}, b.Events[0].BlockHashes, tc.name)
	}
}

// TestDecodeFieldsAndGroups: adapter, group and spec-kind fields; bigram token cells; the
// main-group rule.
func TestDecodeFieldsAndGroups(t *testing.T) {
	t.Parallel()
	d := kvwire.NewDecoder()
	var b kvwire.Batch
	ev := []any{"BlockStored", []uint64{1}, nil, []any{[]int{10, 11}, []int{11, 12}, []int{12, 13}, []int{13, 14}},
		testBlock, 7, "CPU", "sql-lora", nil, 2, "sliding_window", 128}
	require.NoError(t, d.Decode(mustMarshal(t, []any{1, []any{ev}, 3}), &b))
	got := b.Events[0]
	assert.Equal(t, []uint32{10, 11, 12, 13}, got.TokenIDs, "bigram cells keep their first token")
	assert.Equal(t, "CPU", got.Medium)
	assert.Equal(t, "sql-lora", got.LoRAName)
	assert.True(t, got.HasLoRAID)
	assert.EqualValues(t, 7, got.LoRAID)
	assert.True(t, got.HasGroupIdx)
	assert.Equal(t, 2, got.GroupIdx)
	assert.Equal(t, "sliding_window", got.SpecKind)
	assert.Equal(t, 3, b.DPRank)
	assert.False(t, got.MainGroup())

	for _, tc := range []struct {
		ev   kvwire.Event
		main bool
	}{
		{kvwire.Event{}, true},
		{kvwire.Event{HasGroupIdx: true}, true},
		{kvwire.Event{HasGroupIdx: true, GroupIdx: 1}, false},
		{kvwire.Event{SpecKind: "full_attention"}, true},
		{kvwire.Event{SpecKind: "mla_attention"}, true},
		{kvwire.Event{SpecKind: "sink_full_attention"}, true},
		{kvwire.Event{SpecKind: "mamba"}, false},
		{kvwire.Event{SpecKind: "full_attention", HasGroupIdx: true, GroupIdx: 1}, false},
	} {
		assert.Equal(t, tc.main, tc.ev.MainGroup(), "%+v", tc.ev)
	}
}

// TestDecodeBadInput: truncated, garbage and mistyped payloads are typed errors, never panics.
func TestDecodeBadInput(t *testing.T) {
	t.Parallel()
	good := payload(t, 0, storedArray(hashRange(0, 2), nil, prompt(1, 2), "GPU"), removedArray([]uint64{1}, nil))
	cases := []struct {
		name string
		raw  []byte
	}{
		{"empty", nil},
		{"garbage", []byte{0xc1, 0xff, 0x00}},
		{"a number", mustMarshal(t, 5)},
		{"batch of one element", mustMarshal(t, []any{1.0})},
		{"events nil", mustMarshal(t, []any{1.0, nil})},
		{"events a string", mustMarshal(t, []any{1.0, "x"})},
		{"timestamp a string", mustMarshal(t, []any{"x", []any{}})},
		{"negative rank", mustMarshal(t, []any{1.0, []any{}, -1})},
		{"map batch without events", mustMarshal(t, map[string]any{"ts": 1.0})},
		{"empty event", mustMarshal(t, []any{1.0, []any{[]any{}}})},
		{"event tag not a string", mustMarshal(t, []any{1.0, []any{[]any{5}}})},
		{"event a number", mustMarshal(t, []any{1.0, []any{5}})},
		{"event map without type", mustMarshal(t, []any{1.0, []any{map[string]any{"block_hashes": []int{1}}}})},
		{"BlockStored without tokens", mustMarshal(t, []any{1.0, []any{[]any{"BlockStored", []int{1}, nil}}})},
		{"BlockStored with nil hashes", mustMarshal(t, []any{1.0, []any{[]any{"BlockStored", nil, nil, []int{1}}}})},
		{"BlockRemoved without hashes", mustMarshal(t, []any{1.0, []any{[]any{"BlockRemoved"}}})},
		{"hash a float", mustMarshal(t, []any{1.0, []any{[]any{"BlockRemoved", []any{1.5}}}})},
		{"hash nil", mustMarshal(t, []any{1.0, []any{[]any{"BlockRemoved", []any{nil}}}})},
		{"hash empty bytes", mustMarshal(t, []any{1.0, []any{[]any{"BlockRemoved", []any{[]byte{}}}}})},
		{"negative token", mustMarshal(t, []any{1.0, []any{[]any{"BlockStored", []int{1}, nil, []int{1, -2, 3, 4}}}})},
		{"token above 2^32", mustMarshal(t, []any{1.0, []any{[]any{"BlockStored", []int{1}, nil, []int64{1, 1 << 32, 3, 4}}}})},
		{"token a string", mustMarshal(t, []any{1.0, []any{[]any{"BlockStored", []int{1}, nil, []any{"a"}}}})},
		{"medium a number", mustMarshal(t, []any{1.0, []any{storedArray([]uint64{1}, nil, prompt(1, 1), 5)}})},
		{"block_size negative", mustMarshal(t, []any{1.0, []any{[]any{"BlockStored", []int{1}, nil, []int{1, 2, 3, 4}, -4}}})},
		{"array header claiming 2^32-1 elements", []byte{0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff}},
		{"trailing bytes", append(append([]byte{}, good...), 0xc0)},
	}
	for cut := range len(good) {
		cases = append(cases, struct {
			name string
			raw  []byte
		}{"truncated", good[:cut]})
	}
	d := kvwire.NewDecoder()
	var b kvwire.Batch
	for _, tc := range cases {
		err := d.Decode(tc.raw, &b)
		require.Error(t, err, "%s: %x", tc.name, tc.raw)
		assert.ErrorIs(t, err, ErrPayload, tc.name)
		var de *DecodeError
		assert.True(t, errors.As(err, &de), tc.name)
	}
	require.NoError(t, d.Decode(good, &b), "the decoder is usable after errors")
	assert.Len(t, b.Events, 2)
}

// TestParseMessage: the three frames, and wrong frame counts or sequence widths as ErrFrames.
func TestParseMessage(t *testing.T) {
	t.Parallel()
	seq := make([]byte, 8)
	binary.BigEndian.PutUint64(seq, 1<<62)
	m, err := kvwire.ParseMessage([][]byte{[]byte("kv"), seq, {0x90}})
	require.NoError(t, err)
	assert.Equal(t, kvwire.Message{Topic: []byte("kv"), Seq: 1 << 62, Payload: []byte{0x90}}, m)

	for _, frames := range [][][]byte{
		nil,
		{[]byte("kv")},
		{[]byte("kv"), seq},
		{[]byte("kv"), seq, {0x90}, {0x90}},
		{[]byte("kv"), seq[:7], {0x90}},
		{[]byte("kv"), append(seq, 0), {0x90}},
	} {
		_, err := kvwire.ParseMessage(frames)
		assert.ErrorIs(t, err, ErrFrames, "%d frames", len(frames))
		var de *DecodeError
		assert.True(t, errors.As(err, &de))
	}
}

// TestDecodeReusesBuffers: a steady stream of 64-block batches decodes without allocating (the
// kvwire.Batch's slices and the decoder's scratch are reused), in both event encodings.
func TestDecodeReusesBuffers(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts differ under -race")
	}
	for _, form := range []string{"array", "map"} {
		raw := batch64(t, form, 16)
		d := kvwire.NewDecoder()
		var b kvwire.Batch
		require.NoError(t, d.Decode(raw, &b))
		allocs := testing.AllocsPerRun(100, func() {
			if err := d.Decode(raw, &b); err != nil {
				t.Fatal(err)
			}
		})
		assert.Zero(t, allocs, form)
	}
}

// batch64 is one BlockStored of 64 blocks of blockTokens tokens (1,024 tokens at vLLM's default
// 16), in the given event encoding.
func batch64(t testing.TB, form string, blockTokens int) []byte {
	toks := make([]uint32, 64*blockTokens)
	for i := range toks {
		toks[i] = uint32(i*7919) % 151_000 // token IDs of a real vocabulary's range
	}
	ev := []any{"BlockStored", hashRange(1<<40, 64), uint64(1 << 40), toks, blockTokens, nil, "GPU", nil, nil, nil, nil, nil}
	if form == "map" {
		return payload(t, 0, map[string]any{"type": "BlockStored", "block_hashes": hashRange(1<<40, 64),
			"parent_block_hash": uint64(1 << 40), "token_ids": toks, "block_size": blockTokens, "lora_id": nil,
			"medium": "GPU", "lora_name": nil})
	}
	return payload(t, 0, ev)
}

// TestDecodeTokenEncodings: every msgpack integer width a publisher may use for a token ID decodes
// to the same value (the inline fast path and the library path agree), and the fast path hands
// over to the library at a bigram cell or an invalid value mid-list.
func TestDecodeTokenEncodings(t *testing.T) {
	t.Parallel()
	enc := func(code byte, v uint64, width int) []byte {
		out := []byte{code}
		for i := width - 1; i >= 0; i-- {
			out = append(out, byte(v>>(8*i)))
		}
		return out
	}
	cases := []struct {
		name string
		cell []byte
		want uint32
		ok   bool
	}{
		{"fixint 0", []byte{0x00}, 0, true},
		{"fixint 127", []byte{0x7f}, 127, true},
		{"uint8 255", enc(0xcc, 255, 1), 255, true},
		{"int8 5", enc(0xd0, 5, 1), 5, true},
		{"int8 -1", enc(0xd0, 0xff, 1), 0, false},
		{"negative fixint", []byte{0xff}, 0, false},
		{"uint16 65535", enc(0xcd, 65535, 2), 65535, true},
		{"int16 300", enc(0xd1, 300, 2), 300, true},
		{"int16 negative", enc(0xd1, 0x8000, 2), 0, false},
		{"uint32 max", enc(0xce, math.MaxUint32, 4), math.MaxUint32, true},
		{"int32 70000", enc(0xd2, 70000, 4), 70000, true},
		{"int32 negative", enc(0xd2, 0x8000_0000, 4), 0, false},
		{"uint64 max uint32", enc(0xcf, math.MaxUint32, 8), math.MaxUint32, true},
		{"uint64 2^32", enc(0xcf, 1<<32, 8), 0, false},
		{"int64 12", enc(0xd3, 12, 8), 12, true},
		{"int64 -1", enc(0xd3, math.MaxUint64, 8), 0, false},
		{"bigram pair", []byte{0x92, 0x07, 0x08}, 7, true},
		{"float", enc(0xcb, 0, 8), 0, false},
	}
	d := kvwire.NewDecoder()
	for _, tc := range cases {
		// [1, [["BlockStored", [1], nil, [9, cell, 9, 9]]]]
		raw := []byte{0x92, 0x01, 0x91, 0x94, 0xab}
		raw = append(raw, "BlockStored"...)
		raw = append(raw, 0x91, 0x01, 0xc0, 0x94, 0x09)
		raw = append(raw, tc.cell...)
		raw = append(raw, 0x09, 0x09)
		var b kvwire.Batch
		err := d.Decode(raw, &b)
		if !tc.ok {
			assert.ErrorIs(t, err, ErrPayload, tc.name)
			continue
		}
		require.NoError(t, err, tc.name)
		assert.Equal(t, []uint32{9, tc.want, 9, 9}, b.Events[0].TokenIDs, tc.name)
	}
}

// TestDecoderKeepsNoMemoryFromHugeLengthClaims is the reproduction of a memory growth the fuzzer
// found (FuzzDecode's worker died after ~25,000 inputs): a value the decoder skips (an unknown map
// key's value) whose header claims 2 GiB made the msgpack library grow its scratch buffer by its
// allocation step (1 MiB) and keep it, on every such payload, in a kvwire.Decoder that a stream reuses for
// its lifetime. A publisher sending garbage could grow it without bound. 200 such payloads must
// leave the reused kvwire.Decoder holding no more than a fresh one does.
func TestDecoderKeepsNoMemoryFromHugeLengthClaims(t *testing.T) {
	// {"x": ext32 of 0x7fffffff bytes (type 1), body missing}; then, for the other skipped kinds,
	// bin32 and str32.
	payloads := [][]byte{
		{0x81, 0xa1, 'x', 0xc9, 0x7f, 0xff, 0xff, 0xff, 0x01},
		{0x81, 0xa1, 'x', 0xc6, 0x7f, 0xff, 0xff, 0xff},
		{0x81, 0xa1, 'x', 0xdb, 0x7f, 0xff, 0xff, 0xff},
	}
	d := kvwire.NewDecoder()
	var b kvwire.Batch
	heap := func() uint64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	before := heap()
	for i := range 200 {
		err := d.Decode(payloads[i%len(payloads)], &b)
		require.ErrorIs(t, err, ErrPayload)
	}
	after := heap()
	// A valid batch still decodes with the same kvwire.Decoder.
	require.NoError(t, d.Decode(mustMarshal(t, []any{1.5, []any{clearedArray()}}), &b))
	require.Len(t, b.Events, 1)
	runtime.KeepAlive(d)
	assert.Less(t, int64(after)-int64(before), int64(4<<20), "heap growth after 200 payloads claiming 2 GiB: %d bytes", int64(after)-int64(before))
}

// TestDecodeVLLMMessage: a vLLM batch as its publisher frames it, [topic, sequence, payload], the
// payload in the array-like encoding with a BlockStored of two 2-token blocks and a BlockRemoved;
// a message without its sequence frame is ErrFrames.
func TestDecodeVLLMMessage(t *testing.T) {
	t.Parallel()
	raw := mustMarshal(t, []any{1789095808.83, []any{
		[]any{"BlockStored", []uint64{0xfeedface00000001, 0xfeedface00000002}, nil, []int{1, 2, 3, 4}, 2, nil, "GPU", nil, nil, 0, "full_attention"},
		[]any{"BlockRemoved", []int64{-7}, "CPU"},
	}, 0})
	m, err := kvwire.ParseMessage([][]byte{[]byte("kv-events"), {0, 0, 0, 0, 0, 0, 0, 42}, raw})
	require.NoError(t, err)
	var b kvwire.Batch
	require.NoError(t, kvwire.NewDecoder().Decode(m.Payload, &b))
	assert.Equal(t, "kv-events", string(m.Topic))
	assert.Equal(t, uint64(42), m.Seq)
	assert.Equal(t, 0, b.DPRank)
	require.Len(t, b.Events, 2)
	st, rm := b.Events[0], b.Events[1]
	assert.Equal(t, kvwire.KindStored, st.Kind)
	assert.Equal(t, "BlockStored", st.Kind.String())
	assert.Equal(t, []uint64{0xfeedface00000001, 0xfeedface00000002}, st.BlockHashes)
	assert.False(t, st.HasParent)
	assert.Equal(t, []uint32{1, 2, 3, 4}, st.TokenIDs)
	assert.Equal(t, "GPU", st.Medium)
	assert.True(t, st.MainGroup())
	assert.Equal(t, "BlockRemoved", rm.Kind.String())
	assert.Equal(t, []uint64{0xfffffffffffffff9}, rm.BlockHashes)
	assert.False(t, rm.HasParent)
	assert.Empty(t, rm.TokenIDs)
	assert.Equal(t, "CPU", rm.Medium)
	assert.True(t, rm.MainGroup())

	_, err = kvwire.ParseMessage([][]byte{[]byte("kv-events"), raw})
	require.ErrorIs(t, err, ErrFrames)
	assert.EqualError(t, err, "kvevents: malformed message frames: 2 frames, want 3 (topic, sequence, payload)")
}
