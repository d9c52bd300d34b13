package sim_test

import (
	"bytes"
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/internal/sim"
)

// readerSentinels are the causes a reader may wrap for input from a reader that never fails.
var readerSentinels = []error{
	sim.ErrEmptyTrace, sim.ErrUnsorted, sim.ErrNegative, sim.ErrOutOfRange, sim.ErrHashIDMismatch,
	sim.ErrMalformed, sim.ErrMissingField, sim.ErrHeaderMismatch,
}

// checkRejected asserts the error contract: a nil trace and a *TraceError whose line is within
// the input (or one past its last line) and that wraps one of the sentinels.
func checkRejected(t *testing.T, data []byte, tr *sim.Trace, err error) {
	t.Helper()
	require.Nil(t, tr, "no partial trace on error %v", err)
	var te *sim.TraceError
	require.ErrorAs(t, err, &te, "error %v is not a *TraceError", err)
	lines := bytes.Count(data, []byte{'\n'}) + 1
	require.True(t, te.Line >= 1 && te.Line <= lines+1, "error line %d outside [1, %d]: %v", te.Line, lines+1, err)
	known := false
	for _, s := range readerSentinels {
		known = known || errors.Is(err, s)
	}
	require.True(t, known, "error %v wraps no sentinel", err)
}

// checkAccepted asserts the invariants every request of an accepted trace satisfies.
func checkAccepted(t *testing.T, tr *sim.Trace, format sim.Format) {
	t.Helper()
	require.NotNil(t, tr)
	require.Equal(t, format, tr.Format)
	require.NotEmpty(t, tr.Requests)
	var prev time.Duration
	prevLine := 0
	for i, r := range tr.Requests {
		require.Equal(t, i, r.Index)
		require.Greater(t, r.Line, prevLine, "request %d: lines must increase", i)
		prevLine = r.Line
		require.True(t, r.Arrival >= prev && r.Arrival <= sim.MaxArrival, "request %d: arrival %v after %v", i, r.Arrival, prev)
		prev = r.Arrival
		require.True(t, r.InputTokens >= 0 && r.InputTokens <= sim.MaxTraceTokens, "request %d: input %d", i, r.InputTokens)
		require.True(t, r.OutputTokens >= 0 && r.OutputTokens <= sim.MaxTraceTokens, "request %d: output %d", i, r.OutputTokens)
		if format == sim.FormatMooncake {
			require.NotNil(t, r.HashIDs, "request %d", i)
			require.Len(t, r.HashIDs, (r.InputTokens+sim.MooncakeBlockTokens-1)/sim.MooncakeBlockTokens, "request %d", i)
			require.Zero(t, r.Arrival%time.Millisecond, "request %d: Mooncake arrivals are whole ms", i)
		} else {
			require.Nil(t, r.HashIDs, "request %d", i)
		}
		if r.InputTokens <= 4096 {
			ids := r.TokenIDs()
			require.Len(t, ids, r.InputTokens)
			for j, id := range ids {
				if id >= sim.VocabSize {
					t.Fatalf("request %d token %d = %d, want < %d", i, j, id, sim.VocabSize)
				}
			}
		}
	}
	stats := tr.InfiniteCache()
	require.LessOrEqual(t, stats.HitBlocks, stats.Blocks)
	require.LessOrEqual(t, stats.HitTokens, stats.Tokens)
}

// splitJSONL splits data as bufio.ScanLines does: on '\n', dropping one trailing '\r' and the
// empty piece after a final newline.
func splitJSONL(data []byte) [][]byte {
	lines := bytes.Split(data, []byte{'\n'})
	if len(lines) > 0 && len(lines[len(lines)-1]) == 0 {
		lines = lines[:len(lines)-1]
	}
	for i, l := range lines {
		lines[i] = bytes.TrimSuffix(l, []byte{'\r'})
	}
	return lines
}

func FuzzReadMooncake(f *testing.F) {
	// Valid: the first two lines of the conversation trace.
	f.Add([]byte(`{"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]}
{"timestamp": 0, "input_length": 7322, "output_length": 490, "hash_ids": [0, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]}
`))
	// Valid: empty prompt, CRLF, unknown field, no final newline.
	f.Add([]byte("{\"timestamp\": 3, \"input_length\": 0, \"output_length\": 1, \"hash_ids\": []}\r\n{\"x\": {}, \"timestamp\": 3, \"input_length\": 512, \"output_length\": 0, \"hash_ids\": [18446744073709551615]}"))
	// Valid: whitespace and negative zero.
	f.Add([]byte(`{ "timestamp" : -0 , "input_length" : 513 , "output_length" : 2 , "hash_ids" : [ 1 , 2 ] }`))
	// Empty input, a blank line, truncated JSON.
	f.Add([]byte(""))
	f.Add([]byte("\n"))
	f.Add([]byte(`{"timestamp": 0, "input_length": 1,`))
	// Wrong types: float, exponent, string, nested array, null.
	f.Add([]byte(`{"timestamp": 1.5, "input_length": 1e3, "output_length": "1", "hash_ids": [[0]]}`))
	f.Add([]byte(`{"timestamp": null, "input_length": 1, "output_length": 1, "hash_ids": [null]}`))
	// Out of range, negative, mismatched hash IDs, unsorted.
	f.Add([]byte(`{"timestamp": 0, "input_length": 10000001, "output_length": 1, "hash_ids": [0]}`))
	f.Add([]byte(`{"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": [-1]}`))
	f.Add([]byte(`{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [0]}`))
	f.Add([]byte("{\"timestamp\": 9, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}\n{\"timestamp\": 8, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}"))
	// Not an object.
	f.Add([]byte(`[{"timestamp": 0}]`))

	f.Fuzz(func(t *testing.T, data []byte) {
		tr, err := sim.ReadMooncake(bytes.NewReader(data))
		if err != nil {
			checkRejected(t, data, tr, err)
			return
		}
		checkAccepted(t, tr, sim.FormatMooncake)

		// Independent decoding of each line's values with encoding/json's own integer handling.
		// Keys are matched as encoding/json matches them (case-insensitively, the last duplicate
		// winning: the documented rule), so each field's raw value is taken first and only the
		// value that wins is decoded: a typed struct would fail on a losing duplicate of the wrong
		// type ({"hash_ids": 0, "hash_ids": [...]}, testdata/fuzz/FuzzReadMooncake/d754261c626fbb05).
		lines := splitJSONL(data)
		require.Len(t, tr.Requests, len(lines))
		for i, line := range lines {
			var raw struct {
				Timestamp, InputLength, OutputLength, HashIDs json.RawMessage
			}
			require.NoError(t, json.Unmarshal(line, &struct {
				Timestamp    *json.RawMessage `json:"timestamp"`
				InputLength  *json.RawMessage `json:"input_length"`
				OutputLength *json.RawMessage `json:"output_length"`
				HashIDs      *json.RawMessage `json:"hash_ids"`
			}{&raw.Timestamp, &raw.InputLength, &raw.OutputLength, &raw.HashIDs}), "line %d accepted by ReadMooncake", i+1)
			var rec struct {
				Timestamp    int64
				InputLength  int
				OutputLength int
				HashIDs      []uint64
			}
			require.NoError(t, json.Unmarshal(raw.Timestamp, &rec.Timestamp), "line %d timestamp", i+1)
			require.NoError(t, json.Unmarshal(raw.InputLength, &rec.InputLength), "line %d input_length", i+1)
			require.NoError(t, json.Unmarshal(raw.OutputLength, &rec.OutputLength), "line %d output_length", i+1)
			require.NoError(t, json.Unmarshal(raw.HashIDs, &rec.HashIDs), "line %d hash_ids", i+1)
			r := tr.Requests[i]
			require.Equal(t, i+1, r.Line)
			require.Equal(t, time.Duration(rec.Timestamp)*time.Millisecond, r.Arrival)
			require.Equal(t, rec.InputLength, r.InputTokens)
			require.Equal(t, rec.OutputLength, r.OutputTokens)
			require.Equal(t, rec.HashIDs, r.HashIDs)
		}

		// Round trip through a canonical encoding.
		var buf bytes.Buffer
		for _, r := range tr.Requests {
			ids, err := json.Marshal(r.HashIDs)
			require.NoError(t, err)
			fmt.Fprintf(&buf, `{"timestamp": %d, "input_length": %d, "output_length": %d, "hash_ids": %s}`+"\n",
				r.Arrival.Milliseconds(), r.InputTokens, r.OutputTokens, ids)
		}
		again, err := sim.ReadMooncake(&buf)
		require.NoError(t, err)
		assert.Equal(t, tr, again)
	})
}

func FuzzReadAzure(f *testing.F) {
	const header = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
	// Valid: the first rows of the code and conversation traces, CRLF as in the files.
	f.Add([]byte("TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:17:03.9799600,4808,10\r\n2023-11-16 18:17:04.0319600,3180,8"))
	f.Add([]byte(header + "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n"))
	// Valid: quoted fields, empty lines, no fraction, zero lengths.
	f.Add([]byte(header + "\n\"2023-11-16 18:15:46\",\"0\",\"0\"\n\n"))
	// Empty input, header only, wrong header.
	f.Add([]byte(""))
	f.Add([]byte(header))
	f.Add([]byte("timestamp,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,1\n"))
	// Wrong field count, bare quote, bad timestamp, bad numbers.
	f.Add([]byte(header + "2023-11-16 18:15:46,1\n"))
	f.Add([]byte(header + "2023-11-16 18:15:46,1\"2,1\n"))
	f.Add([]byte(header + "2023-13-16 18:15:46,1,1\n"))
	f.Add([]byte(header + "2023-11-16 18:15:46,-1,1.5\n"))
	f.Add([]byte(header + "2023-11-16 18:15:46,10000001,99999999999999999999\n"))
	// Unsorted, and an arrival beyond MaxArrival.
	f.Add([]byte(header + "2023-11-16 18:15:47,1,1\n2023-11-16 18:15:46,1,1\n"))
	f.Add([]byte(header + "2023-11-16 18:15:46,1,1\n2099-11-16 18:15:46,1,1\n"))

	f.Fuzz(func(t *testing.T, data []byte) {
		tr, err := sim.ReadAzure(bytes.NewReader(data))
		if err != nil {
			checkRejected(t, data, tr, err)
			return
		}
		checkAccepted(t, tr, sim.FormatAzure)

		// Independent reading with encoding/csv and strconv.
		rows, err := csv.NewReader(bytes.NewReader(data)).ReadAll()
		require.NoError(t, err)
		require.Len(t, rows, len(tr.Requests)+1)
		require.Equal(t, []string{"TIMESTAMP", "ContextTokens", "GeneratedTokens"}, rows[0])
		for i, row := range rows[1:] {
			r := tr.Requests[i]
			in, err := strconv.Atoi(row[1])
			require.NoError(t, err)
			out, err := strconv.Atoi(row[2])
			require.NoError(t, err)
			require.Equal(t, in, r.InputTokens)
			require.Equal(t, out, r.OutputTokens)
			at, err := time.Parse(time.DateTime, row[0])
			require.NoError(t, err)
			require.Equal(t, at.Sub(tr.Start), r.Arrival)
			require.False(t, strings.HasPrefix(row[1], "+"), "a plus sign must be rejected")
		}
	})
}
