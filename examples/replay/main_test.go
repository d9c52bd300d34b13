package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/sim"
	"github.com/enginepick/enginepick/state"
)

func TestRunTableAndJSON(t *testing.T) {
	args := []string{"-limit", "150", "-engines", "4", "-policies", "round_robin, cache_aware", "-seed", "3"}
	var table, stderr bytes.Buffer
	require.NoError(t, run(context.Background(), args, &table, &stderr, false))
	assert.Contains(t, table.String(), "round_robin")
	assert.Contains(t, table.String(), "cache_aware")
	assert.Contains(t, stderr.String(), "replayed 150 requests × 2 policies")

	var js bytes.Buffer
	require.NoError(t, run(context.Background(), append(args, "-json"), &js, &stderr, false))
	var rep sim.Report
	require.NoError(t, json.Unmarshal(js.Bytes(), &rep))
	assert.Equal(t, 150, rep.Requests)
	assert.Equal(t, sim.Fleet{Plain: 4}, rep.Fleet)
	require.Len(t, rep.Results, 2)
	assert.Equal(t, "cache_aware", rep.Results[1].Policy)
}

func TestRunPDAndPlots(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "plots")
	var out, stderr bytes.Buffer
	err := run(context.Background(), []string{"-limit", "100", "-pd", "2:2", "-policies", "power_of_two,least_load",
		"-plot", dir}, &out, &stderr, false)
	require.NoError(t, err)
	assert.Contains(t, out.String(), "fleet 2P:2D")
	for _, name := range []string{plotTTFT, plotHitRate, plotImbalance} {
		st, err := os.Stat(filepath.Join(dir, name))
		require.NoError(t, err, name)
		assert.Positive(t, st.Size(), name)
	}
}

func TestRunTraceFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "tiny.csv")
	csv := "TIMESTAMP,ContextTokens,GeneratedTokens\n" +
		"2023-11-16 18:15:46.6805900,1200,20\n" +
		"2023-11-16 18:15:47.0000000,800,5\n"
	require.NoError(t, os.WriteFile(path, []byte(csv), 0o644))
	var out, stderr bytes.Buffer
	require.NoError(t, run(context.Background(), []string{"-trace", path, "-engines", "2", "-policies", "random"},
		&out, &stderr, false))
	assert.Contains(t, out.String(), "trace tiny: 2 requests")
}

func TestRunRejectsBadFlags(t *testing.T) {
	unsorted := filepath.Join(t.TempDir(), "unsorted.jsonl")
	require.NoError(t, os.WriteFile(unsorted, []byte(
		`{"timestamp": 10, "input_length": 1, "output_length": 1, "hash_ids": [1]}`+"\n"+
			`{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [2]}`+"\n"), 0o644))
	cases := []struct {
		name string
		args []string
		want error
	}{
		{"zero engines", []string{"-engines", "0"}, sim.ErrEmptyFleet},
		{"bad -pd syntax", []string{"-pd", "4x4"}, sim.ErrBadPDSpec},
		{"PD with zero decode engines", []string{"-pd", "4:0"}, sim.ErrIncompletePD},
		{"-pd and -engines", []string{"-pd", "2:2", "-engines", "4"}, errFleetFlags},
		{"unknown policy", []string{"-policies", "round_robin,fastest"}, sim.ErrUnknownPolicy},
		{"empty policy list", []string{"-policies", " , "}, sim.ErrUnknownPolicy},
		{"negative speed", []string{"-speed", "-1"}, state.ErrInvalidConfiguration},
		{"unsorted trace file", []string{"-trace", unsorted}, sim.ErrUnsorted},
		{"missing trace file", []string{"-trace", filepath.Join(t.TempDir(), "nope.jsonl")}, os.ErrNotExist},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var out, stderr bytes.Buffer
			err := run(context.Background(), append([]string{"-limit", "10"}, tc.args...), &out, &stderr, false)
			assert.ErrorIs(t, err, tc.want)
			assert.Empty(t, out.String(), "no partial report")
		})
	}
}

func TestRunAdmissionFlag(t *testing.T) {
	t.Parallel()
	var out, errOut bytes.Buffer
	args := []string{"-limit", "1500", "-policies", "round_robin", "-json"}
	require.NoError(t, run(context.Background(), args, &out, &errOut, false))
	var open, capped sim.Report
	require.NoError(t, json.Unmarshal(out.Bytes(), &open))
	out.Reset()
	require.NoError(t, run(context.Background(), append(args, "-admission", `{"max_waiting_requests": 1}`), &out, &errOut, false))
	require.NoError(t, json.Unmarshal(out.Bytes(), &capped))
	assert.Zero(t, open.Results[0].Rejected, "no caps: nothing rejected")
	assert.Positive(t, capped.Results[0].Rejected, "a cap of one waiting request rejects some requests")

	err := run(context.Background(), []string{"-admission", `{"max_waitin": 4}`}, &out, &errOut, false)
	assert.ErrorIs(t, err, admission.ErrUnknownField)
}
