package kvevents

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/internal/kvwire"
	"github.com/enginepick/enginepick/kvindex"
)

// FuzzDecode feeds arbitrary payloads to the decoder and, when they decode, to an index. Seeds
// (also under testdata/fuzz/FuzzDecode): each event encoding, the batch forms, every hash form,
// and payloads that once broke a decoder (a huge array header, trailing bytes).
//
// Properties: no panic; an error is a *DecodeError wrapping ErrPayload; decoding is
// deterministic and independent of the buffers a reused kvwire.Decoder and kvwire.Batch carry from earlier
// payloads; the inline token decoding agrees with the library's, value for value and error for
// error; a decoded batch applied to an index refuses or applies each event whole, so the
// index stays valid (its Stats can be read and a match run after every event).
func FuzzDecode(f *testing.F) {
	toks := prompt(1, 2)
	f.Add(payload(f, 0, storedArray(hashRange(0, 2), nil, toks, "GPU"), removedArray([]uint64{1}, nil), clearedArray()))
	f.Add(payload(f, nil, storedMap(hashRange(0, 2), nil, toks, "CPU")))
	f.Add(mustMarshal(f, map[string]any{"ts": 1.5, "events": []any{clearedArray()}, "data_parallel_rank": 1}))
	f.Add(mustMarshal(f, []any{1, []any{[]any{"BlockRemoved", []any{int64(-5), uint64(1 << 63), []byte{1, 2, 3}}}}}))
	f.Add(mustMarshal(f, []any{1, []any{[]any{"BlockStored", []int{1}, 9, []any{[]int{1, 2}, []int{2, 3}, []int{3, 4}, []int{4, 5}}, 4}}}))
	f.Add([]byte{0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{0x92, 0x01, 0x90, 0xc0})

	reused := kvwire.NewDecoder()
	var reusedBatch kvwire.Batch
	warm := payload(f, 0, storedArray(hashRange(100, 8), nil, prompt(2, 8), "GPU"))
	f.Fuzz(func(t *testing.T, raw []byte) {
		fresh := kvwire.NewDecoder()
		var b kvwire.Batch
		err := fresh.Decode(raw, &b)

		require.NoError(t, reused.Decode(warm, &reusedBatch))
		err2 := reused.Decode(raw, &reusedBatch)
		require.Equal(t, err == nil, err2 == nil, "a reused decoder agrees with a fresh one")
		oracle := kvwire.NewDecoder()
		oracle.NoFast = true
		var ob kvwire.Batch
		err3 := oracle.Decode(raw, &ob)
		require.Equal(t, err == nil, err3 == nil, "the inline token path agrees with the library's: %v / %v", err, err3)
		if err == nil {
			for i := range b.Events {
				require.Equal(t, normalize(b.Events[i]), normalize(ob.Events[i]), "event %d, library path", i)
			}
		}
		if err != nil {
			var de *DecodeError
			require.True(t, errors.As(err, &de), "error %v is a *DecodeError", err)
			require.ErrorIs(t, err, ErrPayload)
			return
		}
		require.Equal(t, len(b.Events), len(reusedBatch.Events))
		for i := range b.Events {
			require.Equal(t, normalize(b.Events[i]), normalize(reusedBatch.Events[i]), "event %d", i)
		}

		x := newIndex(t, "")
		o := Options{Index: x}
		o.media, _ = normalizeMedia(nil)
		a := newApplier("http://e", 0, &o)
		var c counters
		for i := range b.Events {
			if err := a.event(&b.Events[i], &c); err != nil {
				var ee *kvindex.EventError
				var bs *BlockSizeMismatchError
				require.True(t, errors.As(err, &ee) || errors.As(err, &bs) ||
					errors.Is(err, ErrUnknownMedium) || errors.Is(err, ErrUnknownAdapter), "typed error: %v", err)
			}
			_ = x.Stats()
			_ = x.Match(x.Hasher().Keys(b.Events[i].TokenIDs))
		}
	})
}

// normalize makes nil and empty slices compare equal.
func normalize(e kvwire.Event) kvwire.Event {
	if len(e.BlockHashes) == 0 {
		e.BlockHashes = nil
	}
	if len(e.TokenIDs) == 0 {
		e.TokenIDs = nil
	}
	return e
}
