package sim_test

import (
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/internal/sim"
)

// traceFile returns the path of a trace file of the module (internal/sim/traces), seen from the package
// directory the tests run in.
func traceFile(name string) string { return filepath.Join("traces", name) }

// embeddedJSONL returns the embedded conversation trace, decompressed, read from the package
// directory (the test's working directory).
func embeddedJSONL(tb testing.TB) []byte {
	tb.Helper()
	gz, err := os.ReadFile(traceFile("mooncake_conversation.jsonl.gz"))
	require.NoError(tb, err)
	zr, err := gzip.NewReader(bytes.NewReader(gz))
	require.NoError(tb, err)
	data, err := io.ReadAll(zr)
	require.NoError(tb, err)
	return data
}

func conversation(tb testing.TB) *sim.Trace {
	tb.Helper()
	tr, err := sim.MooncakeConversation()
	require.NoError(tb, err)
	require.NotNil(tb, tr)
	return tr
}

func seq(from, to uint64) []uint64 {
	var out []uint64
	for v := from; v <= to; v++ {
		out = append(out, v)
	}
	return out
}

func TestMooncakeConversation(t *testing.T) {
	t.Parallel()
	tr := conversation(t)
	assert.Equal(t, "mooncake_conversation", tr.Name)
	assert.Equal(t, sim.FormatMooncake, tr.Format)
	assert.True(t, tr.Start.IsZero(), "Start = %v, want zero for Mooncake", tr.Start)
	require.Len(t, tr.Requests, 12031)

	// First and last lines of kvcache-ai/Mooncake `FAST25-release/traces/conversation_trace.jsonl`.
	assert.Equal(t, sim.Request{
		Index: 0, Line: 1, Arrival: 0, InputTokens: 6758, OutputTokens: 500, HashIDs: seq(0, 13),
	}, tr.Requests[0])
	assert.Equal(t, sim.Request{
		Index: 12030, Line: 12031, Arrival: 3536999 * time.Millisecond, InputTokens: 20774, OutputTokens: 508,
		HashIDs: append([]uint64{0}, seq(182750, 182789)...),
	}, tr.Requests[12030])

	// docs/traces.md: every conversation request starts with block 0, the shared system prompt.
	for i, r := range tr.Requests {
		require.NotEmpty(t, r.HashIDs, "request %d", i)
		require.Zero(t, r.HashIDs[0], "request %d: first hash ID", i)
		require.Equal(t, i, r.Index)
		require.Equal(t, i+1, r.Line)
	}
}

// TestMooncakeConversationIsUpstream checks that the embedded trace is the upstream file unchanged:
// the SHA-256 of kvcache-ai/Mooncake FAST25-release/traces/conversation_trace.jsonl, as NOTICE
// states it.
func TestMooncakeConversationIsUpstream(t *testing.T) {
	t.Parallel()
	sum := sha256.Sum256(embeddedJSONL(t))
	assert.Equal(t, "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df", hex.EncodeToString(sum[:]))
}

func TestMooncakeConversationReturnsFreshCopies(t *testing.T) {
	t.Parallel()
	a := conversation(t)
	a.Requests[0].HashIDs[0] = 99
	a.Requests[1].InputTokens = -1
	a.Requests = a.Requests[:1]
	b := conversation(t)
	require.Len(t, b.Requests, 12031)
	assert.Equal(t, uint64(0), b.Requests[0].HashIDs[0])
	assert.Equal(t, 7322, b.Requests[1].InputTokens)
}

func TestTraceClone(t *testing.T) {
	t.Parallel()
	orig := &sim.Trace{Name: "x", Format: sim.FormatMooncake, Requests: []sim.Request{
		{InputTokens: 600, HashIDs: []uint64{1, 2}},
		{Index: 1, InputTokens: 0, HashIDs: []uint64{}},
		{Index: 2, InputTokens: 5}, // nil HashIDs, as in an Azure trace
	}}
	c := orig.Clone()
	require.Equal(t, orig, c)
	assert.NotNil(t, c.Requests[1].HashIDs, "empty HashIDs must stay non-nil")
	assert.Nil(t, c.Requests[2].HashIDs, "nil HashIDs must stay nil")
	c.Requests[0].HashIDs[0] = 7
	c.Requests[0].InputTokens = 1
	assert.Equal(t, uint64(1), orig.Requests[0].HashIDs[0])
	assert.Equal(t, 600, orig.Requests[0].InputTokens)
	assert.Nil(t, (*sim.Trace)(nil).Clone())
}

// anyOccurrenceHits is the non-prefix oracle: a block hits when its hash ID occurred in any
// earlier request, whatever happened to the blocks before it.
func anyOccurrenceHits(tr *sim.Trace) (hits, blocks int64) {
	seen := map[uint64]bool{}
	for _, r := range tr.Requests {
		for _, h := range r.HashIDs {
			blocks++
			if seen[h] {
				hits++
			}
		}
		for _, h := range r.HashIDs {
			seen[h] = true
		}
	}
	return hits, blocks
}

func TestInfiniteCacheConversation(t *testing.T) {
	t.Parallel()
	tr := conversation(t)
	got := tr.InfiniteCache()
	assert.Equal(t, sim.CacheStats{Blocks: 288500, HitBlocks: 105710, Tokens: 144793823, HitTokens: 54098411}, got)
	// docs/traces.md: an infinite cache hits 36.64 % of blocks.
	assert.InDelta(t, 105710.0/288500.0, tr.InfiniteCacheHitRatio(), 1e-15)
	assert.Equal(t, 3664.0, math.Round(tr.InfiniteCacheHitRatio()*10000), "block hit ratio %v, README 36.64 %%", tr.InfiniteCacheHitRatio())
	assert.InDelta(t, 54098411.0/144793823.0, tr.InfiniteCacheTokenHitRatio(), 1e-15)
	assert.Equal(t, 3736.0, math.Round(tr.InfiniteCacheTokenHitRatio()*10000))

	// Chained hash IDs make the prefix and the any-occurrence definitions agree on this trace.
	hits, blocks := anyOccurrenceHits(tr)
	assert.Equal(t, got.HitBlocks, hits)
	assert.Equal(t, got.Blocks, blocks)

	var inputTokens int64
	for _, r := range tr.Requests {
		inputTokens += int64(r.InputTokens)
	}
	assert.Equal(t, inputTokens, got.Tokens, "Tokens must equal the sum of InputTokens")
}

func TestInfiniteCacheRules(t *testing.T) {
	t.Parallel()
	req := func(in int, ids ...uint64) sim.Request { return sim.Request{InputTokens: in, HashIDs: ids} }
	tests := []struct {
		name string
		reqs []sim.Request
		want sim.CacheStats
	}{
		{
			name: "first request never hits",
			reqs: []sim.Request{req(1024, 0, 1)},
			want: sim.CacheStats{Blocks: 2, Tokens: 1024},
		},
		{
			name: "shared prefix hits, partial last block weighted by its size",
			reqs: []sim.Request{req(1000, 0, 1), req(700, 0, 1)},
			want: sim.CacheStats{Blocks: 4, HitBlocks: 2, Tokens: 1700, HitTokens: 700},
		},
		{
			name: "a miss ends the prefix: later seen IDs do not hit",
			reqs: []sim.Request{req(1024, 0, 1), req(1536, 0, 5, 1)},
			want: sim.CacheStats{Blocks: 5, HitBlocks: 1, Tokens: 2560, HitTokens: 512},
		},
		{
			name: "blocks of the same request do not hit each other",
			reqs: []sim.Request{req(1024, 3, 3)},
			want: sim.CacheStats{Blocks: 2, Tokens: 1024},
		},
		{
			name: "equal arrival times count in file order",
			reqs: []sim.Request{req(10, 4), req(10, 4), req(10, 4)},
			want: sim.CacheStats{Blocks: 3, HitBlocks: 2, Tokens: 30, HitTokens: 20},
		},
		{
			name: "no hash IDs (Azure): all zero",
			reqs: []sim.Request{{InputTokens: 900}, {Index: 1, InputTokens: 900}},
			want: sim.CacheStats{},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			tr := &sim.Trace{Requests: tt.reqs}
			got := tr.InfiniteCache()
			assert.Equal(t, tt.want, got)
			assert.Equal(t, got.BlockHitRatio(), tr.InfiniteCacheHitRatio())
			assert.Equal(t, got.TokenHitRatio(), tr.InfiniteCacheTokenHitRatio())
		})
	}
	assert.Zero(t, sim.CacheStats{}.BlockHitRatio())
	assert.Zero(t, sim.CacheStats{}.TokenHitRatio())
}

// commonPrefix returns the number of equal leading elements of a and b.
func commonPrefix[T comparable](a, b []T) int {
	n := 0
	for n < min(len(a), len(b)) && a[n] == b[n] {
		n++
	}
	return n
}

func TestTokenIDsGolden(t *testing.T) {
	t.Parallel()
	// The mapping is part of the contract (replay results must stay comparable); these values
	// pin it.
	tests := []struct {
		name string
		req  sim.Request
		want []uint32
	}{
		{"hash ID 0", sim.Request{InputTokens: 4, HashIDs: []uint64{0}}, []uint32{82175, 79067, 119289, 19427}},
		{"no hash IDs, index 0", sim.Request{InputTokens: 4}, []uint32{63950, 74206, 52382, 11325}},
		{"no hash IDs, index 1", sim.Request{Index: 1, InputTokens: 4}, []uint32{84287, 25838, 59203, 58471}},
	}
	for _, tt := range tests {
		assert.Equal(t, tt.want, tt.req.TokenIDs(), tt.name)
	}
}

func TestTokenIDsPrefixSharing(t *testing.T) {
	t.Parallel()
	tr := conversation(t)
	tests := []struct {
		a, b         int
		sharedBlocks int
	}{
		{a: 0, b: 1, sharedBlocks: 1},     // only the system-prompt block 0
		{a: 66, b: 133, sharedBlocks: 5},  // [0, 1541, 1542, 1543, 1544], then different
		{a: 0, b: 12030, sharedBlocks: 1}, // first and last request
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("requests=%d,%d", tt.a, tt.b), func(t *testing.T) {
			ra, rb := tr.Requests[tt.a], tr.Requests[tt.b]
			require.Equal(t, tt.sharedBlocks, commonPrefix(ra.HashIDs, rb.HashIDs))
			ta, tb := ra.TokenIDs(), rb.TokenIDs()
			require.Len(t, ta, ra.InputTokens)
			require.Len(t, tb, rb.InputTokens)
			shared := tt.sharedBlocks * sim.MooncakeBlockTokens
			require.Greater(t, min(len(ta), len(tb)), shared, "test needs tokens after the shared prefix")
			assert.Equal(t, ta[:shared], tb[:shared], "first %d tokens must be shared", shared)
			end := min(len(ta), len(tb), shared+sim.MooncakeBlockTokens)
			assert.NotEqual(t, ta[shared:end], tb[shared:end], "block %d must differ", tt.sharedBlocks)
			assert.Less(t, commonPrefix(ta, tb), shared+8, "shared token prefix must end at the block boundary")
		})
	}
}

func TestTokenIDsLastBlockCut(t *testing.T) {
	t.Parallel()
	r := conversation(t).Requests[0] // 6758 tokens = 13 full blocks + 102
	full := sim.Request{InputTokens: len(r.HashIDs) * sim.MooncakeBlockTokens, HashIDs: r.HashIDs}
	got, whole := r.TokenIDs(), full.TokenIDs()
	require.Len(t, got, 6758)
	assert.Equal(t, whole[:6758], got)
	// Each block is the run of its hash ID alone, wherever it sits.
	for i, h := range r.HashIDs {
		alone := sim.Request{Index: 12345, InputTokens: sim.MooncakeBlockTokens, HashIDs: []uint64{h}}
		end := min((i+1)*sim.MooncakeBlockTokens, len(got))
		assert.Equal(t, alone.TokenIDs()[:end-i*sim.MooncakeBlockTokens], got[i*sim.MooncakeBlockTokens:end], "block %d", i)
	}
}

func TestTokenIDsDistinctAcrossHashIDs(t *testing.T) {
	t.Parallel()
	tr := conversation(t)
	// The first 8 tokens (136 bits) of every hash ID's run in the trace are distinct.
	owner := map[[8]uint32]uint64{}
	var buf []uint32
	for _, r := range tr.Requests {
		for _, h := range r.HashIDs {
			buf = (&sim.Request{InputTokens: 8, HashIDs: []uint64{h}}).AppendTokenIDs(buf[:0])
			key := [8]uint32(buf)
			if prev, ok := owner[key]; ok && prev != h {
				t.Fatalf("hash IDs %d and %d start with the same 8 tokens %v", prev, h, key)
			}
			owner[key] = h
		}
	}
	assert.Len(t, owner, 182790, "unique hash IDs in the trace (traces research: 182,790)")
}

func TestTokenIDsVocabRange(t *testing.T) {
	t.Parallel()
	tr := conversation(t)
	var buf []uint32
	for _, r := range tr.Requests[:300] {
		buf = r.AppendTokenIDs(buf[:0])
		for i, id := range buf {
			if id >= sim.VocabSize { // a plain check: testify per token is too slow
				t.Fatalf("request %d token %d = %d, want < VocabSize %d", r.Index, i, id, sim.VocabSize)
			}
		}
	}
	buf = (&sim.Request{Index: 3, InputTokens: 100000}).AppendTokenIDs(buf[:0])
	var maxID uint32
	for _, id := range buf {
		maxID = max(maxID, id)
	}
	assert.Less(t, maxID, uint32(sim.VocabSize))
	assert.Greater(t, maxID, uint32(sim.VocabSize*99/100), "IDs should span the vocabulary")
}

func TestTokenIDsRequestStreams(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		req     sim.Request
		wantLen int
		// check compares the result with other token streams.
		check func(t *testing.T, got []uint32)
	}{
		{
			name: "no hash IDs: different indexes share no block", req: sim.Request{Index: 7, InputTokens: 1024}, wantLen: 1024,
			check: func(t *testing.T, got []uint32) {
				other := (&sim.Request{Index: 8, InputTokens: 1024}).TokenIDs()
				assert.Less(t, commonPrefix(got, other), 4)
			},
		},
		{
			name: "no hash IDs: same index, same tokens", req: sim.Request{Index: 7, InputTokens: 1024, OutputTokens: 3}, wantLen: 1024,
			check: func(t *testing.T, got []uint32) {
				assert.Equal(t, got, (&sim.Request{Index: 7, InputTokens: 1024}).TokenIDs())
			},
		},
		{
			name: "fewer hash IDs than blocks: the rest from the index stream", req: sim.Request{Index: 2, InputTokens: 700, HashIDs: []uint64{9}}, wantLen: 700,
			check: func(t *testing.T, got []uint32) {
				assert.Equal(t, (&sim.Request{InputTokens: 512, HashIDs: []uint64{9}}).TokenIDs(), got[:512])
				assert.Equal(t, (&sim.Request{Index: 2, InputTokens: 188}).TokenIDs(), got[512:])
			},
		},
		{
			name: "surplus hash IDs are ignored", req: sim.Request{InputTokens: 100, HashIDs: []uint64{9, 10, 11}}, wantLen: 100,
			check: func(t *testing.T, got []uint32) {
				assert.Equal(t, (&sim.Request{InputTokens: 512, HashIDs: []uint64{9}}).TokenIDs()[:100], got)
			},
		},
		{name: "zero input tokens", req: sim.Request{InputTokens: 0, HashIDs: []uint64{}}, wantLen: 0},
		{name: "negative input tokens", req: sim.Request{InputTokens: -5, HashIDs: []uint64{1}}, wantLen: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got := tt.req.TokenIDs()
			require.Len(t, got, tt.wantLen)
			if tt.check != nil {
				tt.check(t, got)
			}
		})
	}
}

func TestAppendTokenIDs(t *testing.T) { // not parallel: AllocsPerRun forbids it
	r := sim.Request{InputTokens: 1000, HashIDs: []uint64{0, 1}}
	prefix := []uint32{1, 2, 3}
	got := r.AppendTokenIDs(prefix)
	require.Len(t, got, 1003)
	assert.Equal(t, []uint32{1, 2, 3}, got[:3], "AppendTokenIDs must keep dst's contents")
	assert.Equal(t, r.TokenIDs(), got[3:])

	buf := make([]uint32, 0, 1000)
	allocs := testing.AllocsPerRun(100, func() { buf = r.AppendTokenIDs(buf[:0]) })
	assert.Zero(t, allocs, "AppendTokenIDs with enough capacity must not allocate")
}

type readerCase struct {
	name      string
	input     string
	wantErr   error // a sentinel; nil means the input is valid
	wantLine  int
	wantField string
}

// checkReaderCase runs one reader case: a valid input yields a trace; an invalid one a nil trace
// and a *TraceError with the expected line, field and sentinel.
func checkReaderCase(t *testing.T, read func(io.Reader) (*sim.Trace, error), tt readerCase) *sim.Trace {
	t.Helper()
	tr, err := read(strings.NewReader(tt.input))
	if tt.wantErr == nil {
		require.NoError(t, err, "input %q", tt.input)
		require.NotNil(t, tr)
		return tr
	}
	require.Error(t, err, "input %q", tt.input)
	assert.Nil(t, tr, "no partial trace on error")
	assert.ErrorIs(t, err, tt.wantErr, "input %q: got %v", tt.input, err)
	var te *sim.TraceError
	require.ErrorAs(t, err, &te)
	assert.Equal(t, tt.wantLine, te.Line, "input %q: error %v", tt.input, err)
	assert.Equal(t, tt.wantField, te.Field, "input %q: error %v", tt.input, err)
	return nil
}

const (
	mcOK   = `{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}`
	mcOK10 = `{"timestamp": 10, "input_length": 600, "output_length": 5, "hash_ids": [0, 2]}`
)

func TestReadMooncakeErrors(t *testing.T) {
	t.Parallel()
	line := func(ts, in, out, ids string) string {
		return `{"timestamp": ` + ts + `, "input_length": ` + in + `, "output_length": ` + out + `, "hash_ids": ` + ids + `}`
	}
	long := `{"timestamp": 20, "input_length": 512, "output_length": 5, "hash_ids": [1], "pad": "` +
		strings.Repeat("x", sim.MaxMooncakeLineBytes) + `"}`
	tests := []readerCase{
		{name: "empty input", input: "", wantErr: sim.ErrEmptyTrace, wantLine: 1},
		{name: "blank line", input: mcOK + "\n\n" + mcOK10 + "\n", wantErr: sim.ErrMalformed, wantLine: 2},
		{name: "whitespace-only line", input: mcOK + "\n  \t\n", wantErr: sim.ErrMalformed, wantLine: 2},
		{name: "invalid JSON", input: mcOK + "\n" + mcOK10 + "\n{\"timestamp\": 1,", wantErr: sim.ErrMalformed, wantLine: 3},
		{name: "trailing data after the object", input: mcOK + " {}", wantErr: sim.ErrMalformed, wantLine: 1},
		{name: "two objects on one line", input: mcOK + mcOK10, wantErr: sim.ErrMalformed, wantLine: 1},
		{name: "array instead of object", input: "[1, 2]", wantErr: sim.ErrMalformed, wantLine: 1},
		{name: "number instead of object", input: "5", wantErr: sim.ErrMalformed, wantLine: 1},
		{name: "null line", input: "null", wantErr: sim.ErrMissingField, wantLine: 1, wantField: "timestamp"},
		{name: "empty object", input: mcOK + "\n{}", wantErr: sim.ErrMissingField, wantLine: 2, wantField: "timestamp"},
		{name: "missing timestamp", input: `{"input_length": 1, "output_length": 1, "hash_ids": [0]}`, wantErr: sim.ErrMissingField, wantLine: 1, wantField: "timestamp"},
		{name: "missing input_length", input: `{"timestamp": 1, "output_length": 1, "hash_ids": [0]}`, wantErr: sim.ErrMissingField, wantLine: 1, wantField: "input_length"},
		{name: "missing output_length", input: `{"timestamp": 1, "input_length": 1, "hash_ids": [0]}`, wantErr: sim.ErrMissingField, wantLine: 1, wantField: "output_length"},
		{name: "missing hash_ids", input: `{"timestamp": 1, "input_length": 1, "output_length": 1}`, wantErr: sim.ErrMissingField, wantLine: 1, wantField: "hash_ids"},
		{name: "null timestamp", input: line("null", "1", "1", "[0]"), wantErr: sim.ErrMissingField, wantLine: 1, wantField: "timestamp"},
		{name: "null hash_ids", input: line("1", "1", "1", "null"), wantErr: sim.ErrMissingField, wantLine: 1, wantField: "hash_ids"},
		{name: "float timestamp", input: line("1.5", "1", "1", "[0]"), wantErr: sim.ErrMalformed, wantLine: 1, wantField: "timestamp"},
		{name: "integral float timestamp", input: line("1.0", "1", "1", "[0]"), wantErr: sim.ErrMalformed, wantLine: 1, wantField: "timestamp"},
		{name: "exponent input_length", input: line("1", "1e3", "1", "[0, 1]"), wantErr: sim.ErrMalformed, wantLine: 1, wantField: "input_length"},
		{name: "string output_length", input: line("1", "1", `"1"`, "[0]"), wantErr: sim.ErrMalformed, wantLine: 1, wantField: "output_length"},
		{name: "bool input_length", input: line("1", "true", "1", "[0]"), wantErr: sim.ErrMalformed, wantLine: 1, wantField: "input_length"},
		{name: "hash_ids not an array", input: line("1", "1", "1", "0"), wantErr: sim.ErrMalformed, wantLine: 1, wantField: "hash_ids"},
		{name: "hash_ids object", input: line("1", "1", "1", `{"a": 0}`), wantErr: sim.ErrMalformed, wantLine: 1, wantField: "hash_ids"},
		{name: "float hash ID", input: line("1", "1", "1", "[0.5]"), wantErr: sim.ErrMalformed, wantLine: 1, wantField: "hash_ids"},
		{name: "string hash ID", input: line("1", "1", "1", `["0"]`), wantErr: sim.ErrMalformed, wantLine: 1, wantField: "hash_ids"},
		{name: "string hash ID with comma", input: line("1", "1", "1", `["0,1"]`), wantErr: sim.ErrMalformed, wantLine: 1, wantField: "hash_ids"},
		{name: "nested hash ID array", input: line("1", "600", "1", "[[0, 1]]"), wantErr: sim.ErrMalformed, wantLine: 1, wantField: "hash_ids"},
		{name: "null hash ID", input: line("1", "1", "1", "[null]"), wantErr: sim.ErrMalformed, wantLine: 1, wantField: "hash_ids"},
		{name: "negative timestamp", input: line("-1", "1", "1", "[0]"), wantErr: sim.ErrNegative, wantLine: 1, wantField: "timestamp"},
		{name: "negative input_length", input: mcOK + "\n" + line("5", "-512", "1", "[]"), wantErr: sim.ErrNegative, wantLine: 2, wantField: "input_length"},
		{name: "negative output_length", input: line("1", "1", "-1", "[0]"), wantErr: sim.ErrNegative, wantLine: 1, wantField: "output_length"},
		{name: "negative hash ID", input: line("1", "1", "1", "[-3]"), wantErr: sim.ErrNegative, wantLine: 1, wantField: "hash_ids"},
		{name: "hugely negative timestamp", input: line("-99999999999999999999", "1", "1", "[0]"), wantErr: sim.ErrNegative, wantLine: 1, wantField: "timestamp"},
		{name: "input_length above MaxTraceTokens", input: line("1", "10000001", "1", "[0]"), wantErr: sim.ErrOutOfRange, wantLine: 1, wantField: "input_length"},
		{name: "output_length above MaxTraceTokens", input: line("1", "1", "10000001", "[0]"), wantErr: sim.ErrOutOfRange, wantLine: 1, wantField: "output_length"},
		{name: "output_length beyond int64", input: line("1", "1", "9223372036854775808", "[0]"), wantErr: sim.ErrOutOfRange, wantLine: 1, wantField: "output_length"},
		{name: "timestamp above MaxArrival", input: line("31536000001", "1", "1", "[0]"), wantErr: sim.ErrOutOfRange, wantLine: 1, wantField: "timestamp"},
		{name: "hash ID beyond uint64", input: line("1", "1", "1", "[18446744073709551616]"), wantErr: sim.ErrOutOfRange, wantLine: 1, wantField: "hash_ids"},
		{name: "line longer than MaxMooncakeLineBytes", input: mcOK + "\n" + long + "\n", wantErr: sim.ErrOutOfRange, wantLine: 2},
		{name: "too few hash IDs", input: line("1", "513", "1", "[0]"), wantErr: sim.ErrHashIDMismatch, wantLine: 1, wantField: "hash_ids"},
		{name: "too many hash IDs", input: line("1", "512", "1", "[0, 1]"), wantErr: sim.ErrHashIDMismatch, wantLine: 1, wantField: "hash_ids"},
		{name: "input 0 with a hash ID", input: line("1", "0", "1", "[0]"), wantErr: sim.ErrHashIDMismatch, wantLine: 1, wantField: "hash_ids"},
		{name: "input 1 without hash IDs", input: line("1", "1", "1", "[]"), wantErr: sim.ErrHashIDMismatch, wantLine: 1, wantField: "hash_ids"},
		{name: "timestamp decreases", input: mcOK10 + "\n" + mcOK10 + "\n" + mcOK, wantErr: sim.ErrUnsorted, wantLine: 3, wantField: "timestamp"},

		{name: "valid: unknown fields ignored", input: `{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0], "session": "x", "extra": [1, {"a": null}]}`},
		{name: "valid: CRLF and no final newline", input: mcOK + "\r\n" + mcOK10},
		{name: "valid: equal timestamps", input: mcOK10 + "\n" + mcOK10 + "\n"},
		{name: "valid: input 0 with no hash IDs", input: line("0", "0", "0", "[]")},
		{name: "valid: input 0 with spaced empty array", input: line("0", "0", "0", "[ \t ]")},
		{name: "valid: whitespace inside the array", input: line("0", "513", "1", "[ 0 ,\t18446744073709551615 ]")},
		{name: "valid: negative zero", input: line("-0", "-0", "-0", "[]")},
		{name: "valid: exactly the limits", input: line("31536000000", "10000000", "10000000", "["+strings.Repeat("7,", 19531)+"8]")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			checkReaderCase(t, sim.ReadMooncake, tt)
		})
	}
}

func TestReadMooncakeValues(t *testing.T) {
	t.Parallel()
	input := `{"timestamp": 0, "input_length": 1000, "output_length": 7, "hash_ids": [5, 6]}
{"timestamp": 250, "input_length": 0, "output_length": 3, "hash_ids": []}
{"timestamp": 250, "input_length": 512, "output_length": 0, "hash_ids": [18446744073709551615], "x": 1}
`
	tr, err := sim.ReadMooncake(strings.NewReader(input))
	require.NoError(t, err)
	assert.Equal(t, &sim.Trace{Format: sim.FormatMooncake, Requests: []sim.Request{
		{Index: 0, Line: 1, Arrival: 0, InputTokens: 1000, OutputTokens: 7, HashIDs: []uint64{5, 6}},
		{Index: 1, Line: 2, Arrival: 250 * time.Millisecond, InputTokens: 0, OutputTokens: 3, HashIDs: []uint64{}},
		{Index: 2, Line: 3, Arrival: 250 * time.Millisecond, InputTokens: 512, OutputTokens: 0, HashIDs: []uint64{math.MaxUint64}},
	}}, tr)
	assert.NotNil(t, tr.Requests[1].HashIDs, "a Mooncake request's HashIDs are non-nil")

	// Appending to one request's HashIDs must not overwrite the next request's.
	_ = append(tr.Requests[0].HashIDs, 99)
	assert.Equal(t, []uint64{math.MaxUint64}, tr.Requests[2].HashIDs)
}

// errReader returns data, then err.
type errReader struct {
	data []byte
	err  error
}

func (r *errReader) Read(p []byte) (int, error) {
	if len(r.data) == 0 {
		return 0, r.err
	}
	n := copy(p, r.data)
	r.data = r.data[n:]
	return n, nil
}

func TestReadersReportReaderErrors(t *testing.T) {
	t.Parallel()
	boom := errors.New("boom")
	tests := []struct {
		name     string
		read     func(io.Reader) (*sim.Trace, error)
		data     string
		wantLine int
	}{
		{"mooncake", sim.ReadMooncake, mcOK + "\n" + mcOK10 + "\n", 3},
		{"azure", sim.ReadAzure, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,1,1\n", 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			tr, err := tt.read(&errReader{data: []byte(tt.data), err: boom})
			assert.Nil(t, tr)
			assert.ErrorIs(t, err, boom)
			var te *sim.TraceError
			require.ErrorAs(t, err, &te)
			assert.Equal(t, tt.wantLine, te.Line)
		})
	}
}

const azureHeader = "TIMESTAMP,ContextTokens,GeneratedTokens\n"

func TestReadAzureErrors(t *testing.T) {
	t.Parallel()
	row := func(ts, in, out string) string { return ts + "," + in + "," + out + "\n" }
	const t0, t1 = "2023-11-16 18:15:46.6805900", "2023-11-16 18:15:46.7325900"
	tests := []readerCase{
		{name: "empty input", input: "", wantErr: sim.ErrEmptyTrace, wantLine: 1},
		{name: "header only", input: azureHeader, wantErr: sim.ErrEmptyTrace, wantLine: 2},
		{name: "header and empty lines only", input: azureHeader + "\n\n", wantErr: sim.ErrEmptyTrace, wantLine: 2},
		{name: "lower-case header", input: "timestamp,contexttokens,generatedtokens\n" + row(t0, "1", "1"), wantErr: sim.ErrHeaderMismatch, wantLine: 1},
		{name: "header with an extra column", input: "TIMESTAMP,ContextTokens,GeneratedTokens,X\n" + row(t0, "1", "1"), wantErr: sim.ErrHeaderMismatch, wantLine: 1},
		{name: "header missing a column", input: "TIMESTAMP,ContextTokens\n" + row(t0, "1", "1"), wantErr: sim.ErrHeaderMismatch, wantLine: 1},
		{name: "no header", input: row(t0, "1", "1"), wantErr: sim.ErrHeaderMismatch, wantLine: 1},
		{name: "byte-order mark", input: "\ufeff" + azureHeader + row(t0, "1", "1"), wantErr: sim.ErrHeaderMismatch, wantLine: 1},
		{name: "row with two fields", input: azureHeader + row(t0, "1", "1") + t1 + ",1\n", wantErr: sim.ErrMalformed, wantLine: 3},
		{name: "row with four fields", input: azureHeader + t0 + ",1,1,1\n", wantErr: sim.ErrMalformed, wantLine: 2},
		{name: "bare quote", input: azureHeader + row(t0, "1", "1") + row(t1, `1"2`, "1"), wantErr: sim.ErrMalformed, wantLine: 3},
		{name: "unparsable timestamp", input: azureHeader + row("2023-11-16T18:15:46Z", "1", "1"), wantErr: sim.ErrMalformed, wantLine: 2, wantField: "TIMESTAMP"},
		{name: "timestamp without seconds", input: azureHeader + row("2023-11-16 18:15", "1", "1"), wantErr: sim.ErrMalformed, wantLine: 2, wantField: "TIMESTAMP"},
		{name: "float tokens", input: azureHeader + row(t0, "1.5", "1"), wantErr: sim.ErrMalformed, wantLine: 2, wantField: "ContextTokens"},
		{name: "plus sign", input: azureHeader + row(t0, "1", "+1"), wantErr: sim.ErrMalformed, wantLine: 2, wantField: "GeneratedTokens"},
		{name: "space before number", input: azureHeader + row(t0, " 1", "1"), wantErr: sim.ErrMalformed, wantLine: 2, wantField: "ContextTokens"},
		{name: "empty tokens field", input: azureHeader + row(t0, "", "1"), wantErr: sim.ErrMalformed, wantLine: 2, wantField: "ContextTokens"},
		{name: "negative ContextTokens", input: azureHeader + row(t0, "1", "1") + row(t1, "-4", "1"), wantErr: sim.ErrNegative, wantLine: 3, wantField: "ContextTokens"},
		{name: "negative GeneratedTokens", input: azureHeader + row(t0, "1", "-4"), wantErr: sim.ErrNegative, wantLine: 2, wantField: "GeneratedTokens"},
		{name: "ContextTokens above MaxTraceTokens", input: azureHeader + row(t0, "10000001", "1"), wantErr: sim.ErrOutOfRange, wantLine: 2, wantField: "ContextTokens"},
		{name: "GeneratedTokens beyond uint64", input: azureHeader + row(t0, "1", "99999999999999999999"), wantErr: sim.ErrOutOfRange, wantLine: 2, wantField: "GeneratedTokens"},
		{name: "arrival above MaxArrival", input: azureHeader + row(t0, "1", "1") + row("2024-11-16 18:15:46.6805901", "1", "1"), wantErr: sim.ErrOutOfRange, wantLine: 3, wantField: "TIMESTAMP"},
		{name: "arrival beyond time.Duration", input: azureHeader + row("0001-01-01 00:00:00", "1", "1") + row("9999-01-01 00:00:00", "1", "1"), wantErr: sim.ErrOutOfRange, wantLine: 3, wantField: "TIMESTAMP"},
		{name: "timestamp decreases", input: azureHeader + row(t0, "1", "1") + row(t1, "1", "1") + row(t0, "1", "1"), wantErr: sim.ErrUnsorted, wantLine: 4, wantField: "TIMESTAMP"},
		{name: "earlier than the first row", input: azureHeader + row(t1, "1", "1") + row(t0, "1", "1"), wantErr: sim.ErrUnsorted, wantLine: 3, wantField: "TIMESTAMP"},
		{name: "line number after empty lines", input: azureHeader + "\n" + row(t0, "1", "1") + "\n\n" + row(t1, "x", "1"), wantErr: sim.ErrMalformed, wantLine: 6, wantField: "ContextTokens"},

		{name: "valid: CRLF, no final newline", input: "TIMESTAMP,ContextTokens,GeneratedTokens\r\n" + t0 + ",4808,10\r\n" + t1 + ",3180,8"},
		{name: "valid: quoted fields", input: azureHeader + `"` + t0 + `","1","2"` + "\n"},
		{name: "valid: no fraction, equal times", input: azureHeader + row("2023-11-16 18:15:46", "0", "0") + row("2023-11-16 18:15:46", "1", "1")},
		{name: "valid: exactly MaxArrival", input: azureHeader + row("2023-01-01 00:00:00", "1", "1") + row("2024-01-01 00:00:00", "10000000", "10000000")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			checkReaderCase(t, sim.ReadAzure, tt)
		})
	}
}

func TestReadAzureValues(t *testing.T) {
	t.Parallel()
	input := "TIMESTAMP,ContextTokens,GeneratedTokens\r\n" +
		"2023-11-16 18:17:03.9799600,4808,10\r\n" +
		"\r\n" +
		"2023-11-16 18:17:04.0319600,3180,8\r\n" +
		"2023-11-16 18:17:04.0319600,0,0\r\n"
	tr, err := sim.ReadAzure(strings.NewReader(input))
	require.NoError(t, err)
	assert.Equal(t, &sim.Trace{
		Format: sim.FormatAzure,
		Start:  time.Date(2023, 11, 16, 18, 17, 3, 979960000, time.UTC),
		Requests: []sim.Request{
			{Index: 0, Line: 2, Arrival: 0, InputTokens: 4808, OutputTokens: 10},
			{Index: 1, Line: 4, Arrival: 52 * time.Millisecond, InputTokens: 3180, OutputTokens: 8},
			{Index: 2, Line: 5, Arrival: 52 * time.Millisecond, InputTokens: 0, OutputTokens: 0},
		},
	}, tr)
}

func TestReadAzureTraces(t *testing.T) {
	t.Parallel()
	at := func(h, m, s, ns int) time.Time { return time.Date(2023, 11, 16, h, m, s, ns, time.UTC) }
	tests := []struct {
		file      string
		wantRows  int
		wantFirst [2]int // ContextTokens, GeneratedTokens of the first row
		wantLast  [2]int // the same for the last row
		wantStart time.Time
		wantEnd   time.Time // the last row's TIMESTAMP
	}{
		{"azure_llm_2023_code.csv.gz", 8819, [2]int{4808, 10}, [2]int{549, 173}, at(18, 17, 3, 979960000), at(19, 14, 19, 928016000)},
		{"azure_llm_2023_conv.csv.gz", 19366, [2]int{374, 44}, [2]int{197, 183}, at(18, 15, 46, 680590000), at(19, 14, 8, 402527000)},
	}
	for _, tt := range tests {
		t.Run(tt.file, func(t *testing.T) {
			t.Parallel()
			tr, err := sim.ReadTraceFile(traceFile(tt.file))
			require.NoError(t, err)
			assert.Equal(t, sim.FormatAzure, tr.Format)
			assert.Equal(t, strings.TrimSuffix(tt.file, ".csv.gz"), tr.Name)
			require.Len(t, tr.Requests, tt.wantRows)
			assert.Equal(t, tt.wantStart, tr.Start)
			first, last := tr.Requests[0], tr.Requests[len(tr.Requests)-1]
			assert.Equal(t, sim.Request{Index: 0, Line: 2, InputTokens: tt.wantFirst[0], OutputTokens: tt.wantFirst[1]}, first)
			assert.Equal(t, sim.Request{Index: tt.wantRows - 1, Line: tt.wantRows + 1, Arrival: tt.wantEnd.Sub(tt.wantStart),
				InputTokens: tt.wantLast[0], OutputTokens: tt.wantLast[1]}, last)
			for _, r := range tr.Requests {
				require.Nil(t, r.HashIDs)
			}
			assert.Equal(t, sim.CacheStats{}, tr.InfiniteCache())
		})
	}
}

func TestReadTraceFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	jsonl := []byte(mcOK + "\n" + mcOK10 + "\n")
	csvData := []byte(azureHeader + "2023-11-16 18:15:46.6805900,1,1\n")
	gz := func(data []byte) []byte {
		var buf bytes.Buffer
		zw := gzip.NewWriter(&buf)
		_, err := zw.Write(data)
		require.NoError(t, err)
		require.NoError(t, zw.Close())
		return buf.Bytes()
	}
	tests := []struct {
		file       string
		data       []byte
		wantFormat sim.Format
		wantName   string
		wantErr    error
	}{
		{file: "a.jsonl", data: jsonl, wantFormat: sim.FormatMooncake, wantName: "a"},
		{file: "b.jsonl.gz", data: gz(jsonl), wantFormat: sim.FormatMooncake, wantName: "b"},
		{file: "c.JSON", data: jsonl, wantFormat: sim.FormatMooncake, wantName: "c"},
		{file: "d.csv", data: csvData, wantFormat: sim.FormatAzure, wantName: "d"},
		{file: "e.csv.gz", data: gz(csvData), wantFormat: sim.FormatAzure, wantName: "e"},
		{file: "f.trace", data: append([]byte("\n  "), jsonl...), wantErr: sim.ErrMalformed}, // sniffed as Mooncake, blank first line
		{file: "g.trace", data: jsonl, wantFormat: sim.FormatMooncake, wantName: "g"},
		{file: "h", data: csvData, wantFormat: sim.FormatAzure, wantName: "h"},
		{file: "i.gz", data: gz(csvData), wantFormat: sim.FormatAzure, wantName: "i"},
		{file: "j.txt", data: []byte("hello\n"), wantErr: sim.ErrUnknownFormat},
		{file: "k.txt", data: nil, wantErr: sim.ErrUnknownFormat},
		{file: "l.csv", data: jsonl, wantErr: sim.ErrMalformed}, // the extension decides: CSV, with a bare quote
		{file: "m.jsonl", data: []byte(mcOK + "\n" + `{"timestamp": 1}` + "\n"), wantErr: sim.ErrMissingField},
	}
	for _, tt := range tests {
		require.NoError(t, os.WriteFile(filepath.Join(dir, tt.file), tt.data, 0o600))
	}
	for _, tt := range tests {
		t.Run(tt.file, func(t *testing.T) {
			t.Parallel()
			tr, err := sim.ReadTraceFile(filepath.Join(dir, tt.file))
			if tt.wantErr != nil {
				assert.ErrorIs(t, err, tt.wantErr)
				assert.Nil(t, tr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.wantFormat, tr.Format)
			assert.Equal(t, tt.wantName, tr.Name)
		})
	}

	t.Run("missing file", func(t *testing.T) {
		t.Parallel()
		tr, err := sim.ReadTraceFile(filepath.Join(dir, "absent.jsonl"))
		assert.Nil(t, tr)
		assert.ErrorIs(t, err, fs.ErrNotExist)
	})
	t.Run("line number through the path wrapper", func(t *testing.T) {
		t.Parallel()
		_, err := sim.ReadTraceFile(filepath.Join(dir, "m.jsonl"))
		var te *sim.TraceError
		require.ErrorAs(t, err, &te)
		assert.Equal(t, 2, te.Line)
		assert.Equal(t, "input_length", te.Field)
	})
	t.Run("embedded trace, gzip", func(t *testing.T) {
		t.Parallel()
		tr, err := sim.ReadTraceFile(traceFile("mooncake_conversation.jsonl.gz"))
		require.NoError(t, err)
		assert.Equal(t, "mooncake_conversation", tr.Name)
		assert.Equal(t, conversation(t), tr)
	})
}

func TestTraceErrorMessage(t *testing.T) {
	t.Parallel()
	tests := []struct {
		err  *sim.TraceError
		want string
	}{
		{&sim.TraceError{Line: 3, Field: "input_length", Err: sim.ErrNegative}, "sim: trace line 3: input_length: negative value"},
		{&sim.TraceError{Line: 1, Err: sim.ErrEmptyTrace}, "sim: trace line 1: trace has no requests"},
	}
	for _, tt := range tests {
		assert.Equal(t, tt.want, tt.err.Error())
		assert.Equal(t, tt.err.Err, errors.Unwrap(tt.err))
	}
}

func ExampleRequest_AppendTokenIDs() {
	// Two Mooncake requests that share their first two prefix blocks (hash IDs 0 and 1).
	a := sim.Request{InputTokens: 1300, HashIDs: []uint64{0, 1, 2}}
	b := sim.Request{InputTokens: 1100, HashIDs: []uint64{0, 1, 3}}
	buf := make([]uint32, 0, 4096)
	buf = a.AppendTokenIDs(buf)
	buf = b.AppendTokenIDs(buf)
	ta, tb := buf[:1300], buf[1300:]
	shared := 0
	for shared < len(tb) && ta[shared] == tb[shared] {
		shared++
	}
	fmt.Println(len(ta), len(tb), shared)
	// Output: 1300 1100 1024
}

func ExampleReadMooncake() {
	input := `{"timestamp": 0, "input_length": 1000, "output_length": 20, "hash_ids": [0, 1]}
{"timestamp": 40, "input_length": 1200, "output_length": 30, "hash_ids": [0, 1, 2]}
{"timestamp": 40, "input_length": 700, "output_length": 10, "hash_ids": [0, 3]}
{"timestamp": 25, "input_length": 10, "output_length": 1, "hash_ids": [0]}
`
	_, err := sim.ReadMooncake(strings.NewReader(input))
	var te *sim.TraceError
	if errors.As(err, &te) && errors.Is(err, sim.ErrUnsorted) {
		fmt.Println("unsorted at line", te.Line)
	}

	tr, err := sim.ReadMooncake(strings.NewReader(strings.Join(strings.Split(input, "\n")[:3], "\n")))
	if err != nil {
		fmt.Println(err)
		return
	}
	s := tr.InfiniteCache()
	fmt.Printf("%d requests, last at %v\n", len(tr.Requests), tr.Requests[2].Arrival)
	fmt.Printf("blocks %d/%d, tokens %d/%d\n", s.HitBlocks, s.Blocks, s.HitTokens, s.Tokens)
	// Output:
	// unsorted at line 4
	// 3 requests, last at 40ms
	// blocks 3/7, tokens 1536/2900
}

func BenchmarkReadMooncake(b *testing.B) {
	data := embeddedJSONL(b)
	lines := bytes.SplitAfter(data, []byte{'\n'})
	for _, n := range []int{1000, 12031} {
		input := bytes.Join(lines[:n], nil)
		b.Run(fmt.Sprintf("requests=%d", n), func(b *testing.B) {
			b.SetBytes(int64(len(input)))
			b.ReportAllocs()
			for b.Loop() {
				tr, err := sim.ReadMooncake(bytes.NewReader(input))
				if err != nil || len(tr.Requests) != n {
					b.Fatalf("ReadMooncake = %d requests, %v; want %d", len(tr.Requests), err, n)
				}
			}
		})
	}
}

func BenchmarkReadAzure(b *testing.B) {
	gz, err := os.ReadFile(traceFile("azure_llm_2023_conv.csv.gz"))
	require.NoError(b, err)
	zr, err := gzip.NewReader(bytes.NewReader(gz))
	require.NoError(b, err)
	input, err := io.ReadAll(zr)
	require.NoError(b, err)
	b.SetBytes(int64(len(input)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := sim.ReadAzure(bytes.NewReader(input)); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkMooncakeConversation measures the per-call cost after the first: a deep copy of the
// parsed embedded trace.
func BenchmarkMooncakeConversation(b *testing.B) {
	conversation(b)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := sim.MooncakeConversation(); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkAppendTokenIDs(b *testing.B) {
	for _, in := range []int{512, 6758, 126195} {
		r := sim.Request{InputTokens: in, HashIDs: make([]uint64, (in+511)/512)}
		for i := range r.HashIDs {
			r.HashIDs[i] = uint64(i)
		}
		buf := make([]uint32, 0, in)
		b.Run(fmt.Sprintf("tokens=%d", in), func(b *testing.B) {
			b.SetBytes(int64(4 * in))
			b.ReportAllocs()
			for b.Loop() {
				buf = r.AppendTokenIDs(buf[:0])
			}
		})
	}
}

func BenchmarkInfiniteCache(b *testing.B) {
	tr := conversation(b)
	b.ReportAllocs()
	for b.Loop() {
		tr.InfiniteCache()
	}
}
