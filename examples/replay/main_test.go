package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"image/color"
	"image/png"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/vg"

	"github.com/enginepick/enginepick/internal/sim"
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
		code int // exit status: 2 for a command-line mistake, 1 for other failures
	}{
		{"zero engines", []string{"-engines", "0"}, sim.ErrEmptyFleet, 2},
		{"negative limit", []string{"-limit", "-1"}, state.ErrInvalidConfiguration, 2},
		{"bad -pd syntax", []string{"-pd", "4x4"}, sim.ErrBadPDSpec, 2},
		{"PD with zero decode engines", []string{"-pd", "4:0"}, sim.ErrIncompletePD, 2},
		{"-pd and -engines", []string{"-pd", "2:2", "-engines", "4"}, errFleetFlags, 2},
		{"unknown policy", []string{"-policies", "round_robin,fastest"}, sim.ErrUnknownPolicy, 2},
		{"policy listed twice", []string{"-policies", "random,power_of_two,random"}, sim.ErrDuplicatePolicy, 2},
		{"empty policy list", []string{"-policies", ""}, sim.ErrNoPolicy, 2},
		{"blank policy list", []string{"-policies", " , "}, sim.ErrNoPolicy, 2},
		{"zero speed", []string{"-speed", "0"}, errBadSpeed, 2},
		{"negative speed", []string{"-speed", "-1"}, errBadSpeed, 2},
		{"NaN speed", []string{"-speed", "NaN"}, errBadSpeed, 2},
		{"infinite speed", []string{"-speed", "+Inf"}, errBadSpeed, 2},
		{"negative infinite speed", []string{"-speed", "-Inf"}, errBadSpeed, 2},
		{"negative warmup", []string{"-warmup", "-1s"}, nil, 2},
		{"warmup past the last arrival", []string{"-warmup", "1000h"}, state.ErrInvalidConfiguration, 2},
		{"stray argument", []string{"extra"}, nil, 2},
		{"unsorted trace file", []string{"-trace", unsorted}, sim.ErrUnsorted, 1},
		{"missing trace file", []string{"-trace", filepath.Join(t.TempDir(), "nope.jsonl")}, os.ErrNotExist, 2},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var out, stderr bytes.Buffer
			err := run(context.Background(), append([]string{"-limit", "10"}, tc.args...), &out, &stderr, false)
			require.Error(t, err, "run(%q)", tc.args)
			if tc.want != nil {
				assert.ErrorIs(t, err, tc.want, "run(%q)", tc.args)
			}
			assert.Empty(t, out.String(), "no partial report")
			stderr.Reset()
			assert.Equal(t, tc.code, exitCode(err, &stderr), "exit status of run(%q) = %v", tc.args, err)
			msg := stderr.String()
			assert.Equal(t, 1, strings.Count(msg, "replay:"), "one prefix, one line: %q", msg)
			assert.Equal(t, 1, strings.Count(msg, "\n"), "one line: %q", msg)
		})
	}
}

// TestErrorMessages pins what a user sees on stderr for the mistakes of the user trial: each
// message once, with one "replay:" prefix, and the numbers or names that were wrong.
func TestErrorMessages(t *testing.T) {
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"-engines", "5", "-pd", "2:2"}, "replay: -engines and -pd are exclusive: give one fleet\n"},
		{[]string{"-pd", "2:0"}, `replay: sim: PD spec "2:0": decode engines must be >= 1: invalid configuration` + "\n"},
		{[]string{"-pd", "0:3"}, `replay: sim: PD spec "0:3": prefill engines must be >= 1: invalid configuration` + "\n"},
		{[]string{"-pd", "2x2"}, `replay: sim: PD spec "2x2": must be P:D, prefill and decode engine counts separated by a colon: invalid configuration` + "\n"},
		{[]string{"-policies", "round_robin,round_robin"}, `replay: sim: Config.Policies: policy "round_robin" listed twice: invalid configuration` + "\n"},
		{[]string{"-policies", ""}, "replay: sim: Config.Policies: no policy given: invalid configuration\n"},
		{[]string{"-speed", "0"}, "replay: -speed 0: must be a positive finite number\n"},
		{[]string{"-speed", "NaN"}, "replay: -speed NaN: must be a positive finite number\n"},
		{[]string{"-warmup", "-2s"}, "replay: -warmup -2s: must not be negative\n"},
		{[]string{"a", "b"}, `replay: unexpected arguments ["a" "b"]` + "\n"},
		{[]string{"-admission", `{"max_waitin": 4}`}, `replay: -admission: limits field "max_waitin": unknown field: want one of max_running_requests, max_waiting_requests, max_kv_tokens, max_pending_prefill_tokens, max_inflight_requests` + "\n"},
		{[]string{"-admission", `{"max_waiting_requests": "x"}`}, `replay: -admission: limits field "max_waiting_requests": bad value "x": want a non-negative integer` + "\n"},
		{[]string{"-admission", `{"max_kv_tokens": -1}`}, `replay: -admission: limits field "max_kv_tokens": bad value -1: want a non-negative integer` + "\n"},
		{[]string{"-admission", `[1]`}, `replay: -admission: limits: bad value [1]: want a JSON object with fields max_running_requests, max_waiting_requests, max_kv_tokens, max_pending_prefill_tokens, max_inflight_requests` + "\n"},
	}
	for _, tc := range cases {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var out, stderr bytes.Buffer
			err := run(context.Background(), append([]string{"-limit", "10"}, tc.args...), &out, &stderr, false)
			stderr.Reset()
			exitCode(err, &stderr)
			assert.Equal(t, tc.want, stderr.String(), "stderr of run(%q)", tc.args)
		})
	}
}

// TestFlagSyntaxErrorsPrintOnce checks that a flag the flag set cannot parse is reported once,
// by the flag set with the usage, and that main then exits with status 2 without repeating it.
func TestFlagSyntaxErrorsPrintOnce(t *testing.T) {
	cases := []struct {
		args []string
		want string // the flag package's message
	}{
		{[]string{"-seed", "-3"}, `invalid value "-3" for flag -seed: parse error`},
		{[]string{"-engines", "many"}, `invalid value "many" for flag -engines: parse error`},
		{[]string{"-fastest"}, "flag provided but not defined: -fastest"},
	}
	for _, tc := range cases {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var out, stderr bytes.Buffer
			err := run(context.Background(), tc.args, &out, &stderr, false)
			require.Error(t, err)
			var ue *usageError
			require.ErrorAs(t, err, &ue, "run(%q) = %v", tc.args, err)
			assert.Equal(t, 2, exitCode(err, &stderr), "exit status")
			assert.Equal(t, 1, strings.Count(stderr.String(), tc.want), "printed once:\n%s", stderr.String())
			assert.Contains(t, stderr.String(), "Usage: replay [flags]", "with the usage")
			assert.Empty(t, out.String())
		})
	}
}

func TestExitCode(t *testing.T) {
	var stderr bytes.Buffer
	assert.Equal(t, 0, exitCode(nil, &stderr), "success")
	assert.Equal(t, 0, exitCode(flag.ErrHelp, &stderr), "-help")
	assert.Empty(t, stderr.String(), "nothing printed for success or -help")
	assert.Equal(t, 1, exitCode(context.Canceled, &stderr), "a failure that is not a usage error")
	assert.Equal(t, "replay: context canceled\n", stderr.String())
	stderr.Reset()
	assert.Equal(t, 130, exitCode(errInterrupted, &stderr), "interrupted")
	assert.Equal(t, "replay: interrupted\n", stderr.String())
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
	assert.ErrorIs(t, err, state.ErrUnknownField)
}

// chartReport is a small hand-built report: three policies, one with a perfectly even load
// (imbalance 1) and an infinite-cache ceiling above every hit rate.
func chartReport(ceiling float64) *sim.Report {
	return &sim.Report{Trace: "tiny", Requests: 1234, Speed: 2, Fleet: sim.Fleet{Plain: 4},
		InfiniteCacheHitRate: ceiling,
		Results: []sim.PolicyResult{
			{Policy: "round_robin", HitRate: 0.05, Imbalance: 1, TTFTSamples: []float64{0.1, 0.2, 0.4}},
			{Policy: "power_of_two", HitRate: 0.06, Imbalance: 1.1, TTFTSamples: []float64{0.1, 0.3}},
			{Policy: "cache_aware", HitRate: 0.25, Imbalance: 1.2, TTFTSamples: []float64{0.05, 0.1}},
		}}
}

// pixelsOf renders p and counts the pixels of exactly colour c.
func pixelsOf(t *testing.T, p *plot.Plot, c color.Color) int {
	t.Helper()
	w, err := p.WriterTo(8*vg.Inch, 4.5*vg.Inch, "png")
	require.NoError(t, err)
	var buf bytes.Buffer
	_, err = w.WriteTo(&buf)
	require.NoError(t, err)
	img, err := png.Decode(&buf)
	require.NoError(t, err)
	want := color.RGBAModel.Convert(c)
	n := 0
	for y := img.Bounds().Min.Y; y < img.Bounds().Max.Y; y++ {
		for x := img.Bounds().Min.X; x < img.Bounds().Max.X; x++ {
			if color.RGBAModel.Convert(img.At(x, y)) == want {
				n++
			}
		}
	}
	return n
}

func TestCharts(t *testing.T) {
	rep := chartReport(0.3)
	builders := map[string]func(*sim.Report) (*plot.Plot, error){
		plotTTFT: ttftCDF, plotHitRate: hitRate, plotImbalance: imbalanceBars,
	}
	for name, build := range builders {
		p, err := build(rep)
		require.NoError(t, err, name)
		assert.Contains(t, p.Title.Text, "1234 requests", "%s: the title gives the request count", name)
	}

	t.Run("hit rate: percent ticks and the infinite-cache ceiling", func(t *testing.T) {
		p, err := hitRate(rep)
		require.NoError(t, err)
		assert.Equal(t, 0.0, p.Y.Min)
		assert.GreaterOrEqual(t, p.Y.Max, 30.0, "the ceiling (30 %%) is inside the axis")
		labelled := 0
		for _, tick := range p.Y.Tick.Marker.Ticks(p.Y.Min, p.Y.Max) {
			if tick.Label != "" {
				labelled++
				assert.True(t, strings.HasSuffix(tick.Label, " %"), "tick label %q is a percentage", tick.Label)
			}
		}
		assert.Positive(t, labelled, "the y axis has labelled ticks")
		assert.Greater(t, pixelsOf(t, p, ceilingColor), 100, "the ceiling line is drawn")

		none, err := hitRate(chartReport(0))
		require.NoError(t, err)
		assert.Zero(t, pixelsOf(t, none, ceilingColor), "no ceiling line for a trace without hash IDs")
	})

	t.Run("imbalance: the axis starts at 0, with distinct labels", func(t *testing.T) {
		for _, top := range []float64{1, 1.02, 1.08, 1.2, 2.5, 14} {
			rep := chartReport(0.3)
			rep.Results[2].Imbalance = top
			p, err := imbalanceBars(rep)
			require.NoError(t, err)
			assert.Equal(t, 0.0, p.Y.Min, "top %v", top)
			assert.Greater(t, p.Y.Max, top, "the largest imbalance fits")
			ticks := p.Y.Tick.Marker.Ticks(p.Y.Min, p.Y.Max)
			checkTicks(t, p.Y.Min, p.Y.Max, ticks)
			assert.Equal(t, "0", ticks[0].Label, "top %v", top)
		}
	})

	t.Run("a report with nothing routed still plots", func(t *testing.T) {
		empty := &sim.Report{Trace: "none", Requests: 0, Speed: 1, Fleet: sim.Fleet{Plain: 1},
			Results: []sim.PolicyResult{{Policy: "random"}}}
		require.NoError(t, writePlots(filepath.Join(t.TempDir(), "plots"), empty))
	})
}
