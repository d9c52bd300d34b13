package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"gonum.org/v1/plot"
)

// Subprocess mode: when childEnv is set, the test binary runs main with the arguments JSON-encoded
// in childEnv and prints childReady on stderr when the replay starts.
const (
	childEnv   = "REPLAY_TEST_MAIN_ARGS"
	childReady = "replay-test: replay starting"
)

func TestMain(m *testing.M) {
	if args, ok := os.LookupEnv(childEnv); ok {
		var list []string
		if err := json.Unmarshal([]byte(args), &list); err != nil {
			fmt.Fprintln(os.Stderr, "bad", childEnv, err)
			os.Exit(3)
		}
		os.Args = append([]string{"replay"}, list...)
		replayStarting = func() { fmt.Fprintln(os.Stderr, childReady) }
		main()
		return
	}
	// Replays run policies in goroutines; every one must have returned when the tests end.
	goleak.VerifyTestMain(m)
}

func TestHelpStartsWithParagraph(t *testing.T) {
	var out, stderr bytes.Buffer
	err := run(context.Background(), []string{"-h"}, &out, &stderr, false)
	require.ErrorIs(t, err, flag.ErrHelp)
	assert.Equal(t, 0, exitCode(err, io.Discard))
	help := stderr.String()
	require.True(t, strings.HasPrefix(help, usageText), "help starts with the usage paragraph:\n%s", help)
	paragraphs := strings.Split(strings.TrimSpace(usageText), "\n\n")
	require.Len(t, paragraphs, 3, "usage line, one paragraph, the flags heading")
	assert.Equal(t, "Usage: replay [flags]", paragraphs[0])
	assert.True(t, strings.HasPrefix(paragraphs[1], "replay shows, offline, what a routing configuration does to real traffic"))
	for _, term := range []string{"hit rate", "TTFT", "E2E", "imbalance", "prefill util", "busy", "rejected", "too long", "n/a", "warning:", "overloaded"} {
		assert.Contains(t, paragraphs[1], term, "the paragraph explains %q", term)
	}
	assert.Equal(t, "Flags:", paragraphs[2])
	for _, name := range []string{"-trace", "-engines", "-pd", "-policies", "-speed", "-limit", "-seed", "-json", "-plot", "-admission"} {
		assert.Regexp(t, `(?m)^  `+name+`\b`, help[len(usageText):], "flag %s listed after the paragraph", name)
	}
	assert.Empty(t, out.String())
}

// TestPathsCheckedBeforeReplay: a -trace or -plot that cannot be used is one line on stderr and
// exit status 2, before anything is replayed.
func TestPathsCheckedBeforeReplay(t *testing.T) {
	dir := t.TempDir()
	empty := filepath.Join(dir, "empty.jsonl")
	require.NoError(t, os.WriteFile(empty, nil, 0o644))
	missing := filepath.Join(dir, "missing.jsonl")
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"directory as trace", []string{"-trace", dir}, "replay: -trace " + dir + ": is a directory, want a trace file\n"},
		{"empty trace", []string{"-trace", empty}, "replay: -trace " + empty + ": file is empty\n"},
		{"missing trace", []string{"-trace", missing}, "replay: -trace " + missing + ": no such file or directory\n"},
		{"file as plot directory", []string{"-plot", empty}, "replay: -plot " + empty + ": is not a directory\n"},
		{"plot directory under a file", []string{"-plot", filepath.Join(empty, "sub")},
			"replay: -plot " + filepath.Join(empty, "sub") + ": mkdir " + empty + ": not a directory\n"},
	}
	// An unwritable directory: chmod does not stop root, and /sys refuses new files even to root.
	if os.Geteuid() != 0 {
		ro := filepath.Join(dir, "read-only")
		require.NoError(t, os.Mkdir(ro, 0o555))
		cases = append(cases, struct {
			name string
			args []string
			want string
		}{"unwritable plot directory", []string{"-plot", ro}, "replay: -plot " + ro + ": cannot write: permission denied\n"})
	} else if st, err := os.Stat("/sys/kernel"); err == nil && st.IsDir() {
		cases = append(cases, struct {
			name string
			args []string
			want string
		}{"unwritable plot directory", []string{"-plot", "/sys/kernel"}, "replay: -plot /sys/kernel: cannot write: permission denied\n"})
	} else {
		t.Log("no unwritable directory available: skipping that case")
	}
	started := 0
	replayStarting = func() { started++ }
	defer func() { replayStarting = nil }()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var out, stderr bytes.Buffer
			err := run(context.Background(), append([]string{"-limit", "10", "-policies", "random"}, tc.args...), &out, &stderr, false)
			require.Error(t, err)
			assert.Empty(t, stderr.String(), "nothing replayed, nothing printed before main")
			assert.Equal(t, 2, exitCode(err, &stderr), "exit status")
			assert.Equal(t, tc.want, stderr.String())
			assert.Empty(t, out.String())
		})
	}
	assert.Zero(t, started, "no replay started")
	assert.Equal(t, []string{"empty.jsonl"}, dirNames(t, dir), "the write check leaves nothing behind")

	// A writable -plot directory passes the check and is left as it was.
	plots := filepath.Join(dir, "plots")
	require.NoError(t, checkPlotDir(plots))
	assert.Empty(t, dirNames(t, plots))
}

func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	names := []string{}
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
}

func TestInterruptedBeforeOrDuringReplay(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var out, stderr bytes.Buffer
	err := run(ctx, []string{"-limit", "100"}, &out, &stderr, false)
	require.ErrorIs(t, err, errInterrupted)
	assert.Empty(t, out.String())
	stderr.Reset()
	assert.Equal(t, 130, exitCode(err, &stderr))
	assert.Equal(t, "replay: interrupted\n", stderr.String())

	// Cancelled once the replay has started.
	ctx, cancel = context.WithCancel(context.Background())
	defer cancel()
	replayStarting = cancel
	defer func() { replayStarting = nil }()
	err = run(ctx, []string{"-limit", "100"}, &out, &stderr, false)
	require.ErrorIs(t, err, errInterrupted)
	assert.Empty(t, out.String())
}

// TestSIGINT runs the command in a subprocess (this test binary in main mode), lets the full
// default replay start and sends SIGINT: the process prints "replay: interrupted" and exits with
// status 130 within seconds, with nothing on stdout.
func TestSIGINT(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a subprocess replaying the whole trace")
	}
	args, err := json.Marshal([]string{})
	require.NoError(t, err)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+string(args))
	var stdout bytes.Buffer
	cmd.Stdout = &stdout
	stderrPipe, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	defer func() { _ = cmd.Process.Kill() }()

	sc := bufio.NewScanner(stderrPipe)
	var before []string
	ready := false
	for sc.Scan() {
		if sc.Text() == childReady {
			ready = true
			break
		}
		before = append(before, sc.Text())
	}
	require.True(t, ready, "the child never started replaying; stderr: %q", before)
	time.Sleep(100 * time.Millisecond) // inside the replay's event loops
	sent := time.Now()
	require.NoError(t, cmd.Process.Signal(syscall.SIGINT))
	rest, err := io.ReadAll(stderrPipe)
	require.NoError(t, err)

	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err = <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("the replay did not stop within 60 s of SIGINT")
	}
	elapsed := time.Since(sent)
	var ee *exec.ExitError
	require.True(t, errors.As(err, &ee), "exit: %v; stderr %q", err, rest)
	assert.Equal(t, 130, ee.ExitCode(), "stderr %q", rest)
	assert.Equal(t, "replay: interrupted\n", string(rest))
	assert.Empty(t, stdout.String(), "no partial report")
	assert.Less(t, elapsed, 10*time.Second, "stops promptly")
}

// TestAllRejectedPrintsNA: a policy whose requests admission all rejected prints n/a, not 0.00 s.
func TestAllRejectedPrintsNA(t *testing.T) {
	args := []string{"-limit", "200", "-engines", "2", "-policies", "round_robin", "-admission", `{"max_waiting_requests": 0}`}
	var out, stderr bytes.Buffer
	require.NoError(t, run(context.Background(), args, &out, &stderr, false))
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	assert.Equal(t, "round_robin  n/a       n/a       n/a  n/a  n/a      n/a  n/a        n/a        n/a           n/a   200       0",
		lines[len(lines)-1], "table:\n%s", out.String())
	assert.NotContains(t, out.String(), "0.00 s")

	out.Reset()
	require.NoError(t, run(context.Background(), append(args, "-json"), &out, &stderr, false))
	var rep struct {
		Results []map[string]json.RawMessage `json:"results"`
	}
	require.NoError(t, json.Unmarshal(out.Bytes(), &rep))
	assert.Equal(t, "null", string(rep.Results[0]["ttft"]))
	assert.Equal(t, "null", string(rep.Results[0]["hit_rate"]))
}

// TestOverloadWarning: 2 engines at 4× on 300 requests cannot keep up, and the report says so
// under the table (and on stderr with -json); 16 engines keep up and print no warning.
func TestOverloadWarning(t *testing.T) {
	args := []string{"-limit", "300", "-policies", "round_robin,cache_aware"}
	var out, stderr bytes.Buffer
	require.NoError(t, run(context.Background(), append(args, "-engines", "2"), &out, &stderr, false))
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	require.GreaterOrEqual(t, len(lines), 2)
	for i, policy := range []string{"round_robin", "cache_aware"} {
		line := lines[len(lines)-2+i]
		assert.True(t, strings.HasPrefix(line, "warning: "+policy+": overloaded: requests awaiting their first token grew from "), line)
	}

	out.Reset()
	stderr.Reset()
	require.NoError(t, run(context.Background(), append(args, "-engines", "2", "-json"), &out, &stderr, false))
	assert.Equal(t, 2, strings.Count(stderr.String(), "warning: "), stderr.String())
	assert.NotContains(t, out.String(), "warning")

	out.Reset()
	stderr.Reset()
	require.NoError(t, run(context.Background(), append(args, "-engines", "16"), &out, &stderr, false))
	assert.NotContains(t, out.String(), "warning")
	assert.NotContains(t, stderr.String(), "warning")
}

// TestErrorPrefixOnce: a trace error reads "replay: sim: …" with each prefix once.
func TestErrorPrefixOnce(t *testing.T) {
	path := filepath.Join(t.TempDir(), "unsorted.jsonl")
	require.NoError(t, os.WriteFile(path, []byte(
		`{"timestamp": 10, "input_length": 1, "output_length": 1, "hash_ids": [1]}`+"\n"+
			`{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [2]}`+"\n"), 0o644))
	var out, stderr bytes.Buffer
	err := run(context.Background(), []string{"-trace", path}, &out, &stderr, false)
	assert.Equal(t, 1, exitCode(err, &stderr))
	assert.Equal(t, "replay: sim: read trace "+path+": trace line 2: timestamp: timestamp decreases: 5 ms after 10 ms\n", stderr.String())
}

// checkTicks asserts that ticks cover [lo, hi] in ascending order with distinct labels, each
// label reading as its tick's value, and 4 to 11 of them.
func checkTicks(t *testing.T, lo, hi float64, ticks []plot.Tick) {
	t.Helper()
	require.NotEmpty(t, ticks)
	assert.GreaterOrEqual(t, len(ticks), 4, "[%v, %v]: %v", lo, hi, ticks)
	assert.LessOrEqual(t, len(ticks), 11, "[%v, %v]: %v", lo, hi, ticks)
	seen := map[string]bool{}
	for i, tk := range ticks {
		require.NotEmpty(t, tk.Label, "[%v, %v]: tick %v unlabelled", lo, hi, tk.Value)
		assert.False(t, seen[tk.Label], "[%v, %v]: label %q twice in %v", lo, hi, tk.Label, ticks)
		seen[tk.Label] = true
		v, err := strconv.ParseFloat(tk.Label, 64)
		require.NoError(t, err, tk.Label)
		assert.InDelta(t, tk.Value, v, 1e-9*max(1, hi-lo), "[%v, %v]: label %q for %v", lo, hi, tk.Label, tk.Value)
		assert.GreaterOrEqual(t, tk.Value, lo-1e-9*(hi-lo))
		assert.LessOrEqual(t, tk.Value, hi+1e-9*(hi-lo))
		if i > 0 {
			assert.Greater(t, tk.Value, ticks[i-1].Value)
		}
	}
}

func TestLinearTicks(t *testing.T) {
	for _, r := range [][2]float64{{0, 1.15}, {0, 1.173}, {0, 1.242}, {0, 2.87}, {0, 16.1}, {0, 0.0123}, {1, 1.1},
		{1, 1.02}, {0, 1}, {0, 4}, {0, 40}, {0, 39.9}, {0, 100}, {0.5, 0.51}, {-3, 7}, {0, 1234567}} {
		ticks := linearTicks{}.Ticks(r[0], r[1])
		checkTicks(t, r[0], r[1], ticks)
	}
	assert.Equal(t, []plot.Tick{{Value: 0, Label: "0"}, {Value: 0.2, Label: "0.2"}, {Value: 0.4, Label: "0.4"},
		{Value: 0.6000000000000001, Label: "0.6"}, {Value: 0.8, Label: "0.8"}, {Value: 1, Label: "1.0"}},
		linearTicks{}.Ticks(0, 1.15))
	assert.Equal(t, []plot.Tick{{Value: 1, Label: "1"}}, linearTicks{}.Ticks(1, 1), "empty range")

	// plot.DefaultTicks, which the imbalance axis used before, repeats labels on a narrow range.
	labels := map[string]int{}
	for _, tk := range (plot.DefaultTicks{}).Ticks(1, 1.1) {
		if tk.Label != "" {
			labels[tk.Label]++
		}
	}
	assert.Equal(t, 2, labels["1.1"], "the reason for linearTicks: %v", labels)
}
