package skipcheck_test

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/internal/skipcheck"
)

// ev renders one test2json event line.
func ev(action, pkg, test, output string) string {
	m := map[string]string{"Action": action, "Package": pkg}
	if test != "" {
		m["Test"] = test
	}
	if output != "" {
		m["Output"] = output
	}
	b, err := json.Marshal(m)
	if err != nil {
		panic(err)
	}
	return string(b) + "\n"
}

// skipped is the event sequence of a test that logs a reason and skips.
func skipped(pkg, test, why string) string {
	return ev("run", pkg, test, "") +
		ev("output", pkg, test, "=== RUN   "+test+"\n") +
		ev("output", pkg, test, "    x_test.go:9: "+why+"\n") +
		ev("output", pkg, test, "--- SKIP: "+test+" (0.00s)\n") +
		ev("skip", pkg, test, "")
}

func passed(pkg, test string) string {
	return ev("run", pkg, test, "") +
		ev("output", pkg, test, "=== RUN   "+test+"\n") +
		ev("output", pkg, test, "--- PASS: "+test+" (0.00s)\n") +
		ev("pass", pkg, test, "")
}

func pkgPass(pkg string) string {
	return ev("output", pkg, "", "PASS\n") + ev("output", pkg, "", "ok  \t"+pkg+"\t0.01s\n") + ev("pass", pkg, "", "")
}

const (
	pa = "example.com/m/a"
	pb = "example.com/m/b"
)

func TestCheck(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		stream    string
		allow     []skipcheck.Test
		require   []skipcheck.Test
		wantOK    bool
		wantRes   skipcheck.Result
		wantLines []string // lines the report must contain
	}{
		{
			name:    "all pass",
			stream:  passed(pa, "TestA") + pkgPass(pa) + passed(pb, "TestB") + pkgPass(pb),
			wantOK:  true,
			wantRes: skipcheck.Result{Passed: 2},
			wantLines: []string{"ok  \texample.com/m/a\t0.01s", "ok  \texample.com/m/b\t0.01s",
				"2 passed, 0 failed, 0 skipped"},
		},
		{
			name:    "allowed skip",
			stream:  skipped(pa, "TestA", "needs the race detector off") + passed(pa, "TestB") + pkgPass(pa),
			allow:   []skipcheck.Test{{Package: pa, Name: "TestA"}},
			wantOK:  true,
			wantRes: skipcheck.Result{Passed: 1, Skips: []skipcheck.Skip{{Test: skipcheck.Test{Package: pa, Name: "TestA"}, Reason: "x_test.go:9: needs the race detector off", Allowed: true}}},
			wantLines: []string{"SKIP example.com/m/a TestA (allowed): x_test.go:9: needs the race detector off",
				"1 passed, 0 failed, 1 skipped"},
		},
		{
			name:    "skip outside the allowlist",
			stream:  skipped(pa, "TestA", "file not found") + pkgPass(pa),
			allow:   []skipcheck.Test{{Package: pb, Name: "TestA"}}, // same name, other package
			wantRes: skipcheck.Result{Skips: []skipcheck.Skip{{Test: skipcheck.Test{Package: pa, Name: "TestA"}, Reason: "x_test.go:9: file not found"}}, Stale: []skipcheck.Test{{Package: pb, Name: "TestA"}}},
			wantLines: []string{"SKIP example.com/m/a TestA (NOT IN THE ALLOWLIST): x_test.go:9: file not found",
				"STALE allowlist entry, the test did not skip: example.com/m/b TestA"},
		},
		{
			name: "subtest skip is named by its full name",
			stream: ev("run", pa, "TestA", "") + skipped(pa, "TestA/latency", "CPU-bound") + passed(pa, "TestA/hit") +
				ev("output", pa, "TestA", "--- PASS: TestA (0.00s)\n") + ev("pass", pa, "TestA", "") + pkgPass(pa),
			allow:   []skipcheck.Test{{Package: pa, Name: "TestA"}},
			wantRes: skipcheck.Result{Passed: 2, Skips: []skipcheck.Skip{{Test: skipcheck.Test{Package: pa, Name: "TestA/latency"}, Reason: "x_test.go:9: CPU-bound"}}, Stale: []skipcheck.Test{{Package: pa, Name: "TestA"}}},
		},
		{
			name:    "stale entry: the allowed test passed",
			stream:  passed(pa, "TestA") + pkgPass(pa),
			allow:   []skipcheck.Test{{Package: pa, Name: "TestA"}},
			wantRes: skipcheck.Result{Passed: 1, Stale: []skipcheck.Test{{Package: pa, Name: "TestA"}}},
		},
		{
			name: "failed test prints its output",
			stream: ev("run", pa, "TestA", "") + ev("output", pa, "TestA", "=== RUN   TestA\n") +
				ev("output", pa, "TestA", "    a_test.go:3: got 1, want 2\n") +
				ev("output", pa, "TestA", "--- FAIL: TestA (0.00s)\n") + ev("fail", pa, "TestA", "") +
				ev("output", pa, "", "FAIL\n") + ev("output", pa, "", "FAIL\texample.com/m/a\t0.01s\n") + ev("fail", pa, "", ""),
			wantRes:   skipcheck.Result{Failed: []skipcheck.Test{{Package: pa, Name: "TestA"}}, FailedPackages: []string{pa}},
			wantLines: []string{"    a_test.go:3: got 1, want 2", "--- FAIL: TestA (0.00s)", "FAIL example.com/m/a TestA", "FAIL package example.com/m/a"},
		},
		{
			name: "panic: the unfinished test's output is printed when the package fails",
			stream: ev("run", pa, "TestA", "") + ev("output", pa, "TestA", "=== RUN   TestA\n") +
				ev("output", pa, "TestA", "panic: boom\n") +
				ev("output", pa, "", "FAIL\texample.com/m/a\t0.01s\n") + ev("fail", pa, "", ""),
			wantRes:   skipcheck.Result{FailedPackages: []string{pa}},
			wantLines: []string{"panic: boom", "FAIL package example.com/m/a"},
		},
		{
			name: "build failure",
			stream: `{"ImportPath":"example.com/m/a [example.com/m/a.test]","Action":"build-output","Output":"a/a.go:1:1: syntax error\n"}` + "\n" +
				`{"ImportPath":"example.com/m/a [example.com/m/a.test]","Action":"build-fail"}` + "\n",
			wantRes:   skipcheck.Result{FailedPackages: []string{"example.com/m/a [example.com/m/a.test]"}},
			wantLines: []string{"a/a.go:1:1: syntax error"},
		},
		{
			name:      "text that is not an event is copied",
			stream:    "go: downloading example.com/x v1.0.0\n" + passed(pa, "TestA") + pkgPass(pa),
			wantOK:    true,
			wantRes:   skipcheck.Result{Passed: 1},
			wantLines: []string{"go: downloading example.com/x v1.0.0"},
		},
		{
			name:    "required tests passed",
			stream:  passed(pa, "TestA") + pkgPass(pa) + passed(pb, "TestA") + pkgPass(pb),
			require: []skipcheck.Test{{Package: pa, Name: "TestA"}, {Package: pb, Name: "TestA"}},
			wantOK:  true,
			wantRes: skipcheck.Result{Passed: 2},
		},
		{
			name:   "required test skipped, absent or failed",
			stream: skipped(pa, "TestA", "slow") + passed(pa, "TestB") + pkgPass(pa),
			allow:  []skipcheck.Test{{Package: pa, Name: "TestA"}},
			require: []skipcheck.Test{{Package: pa, Name: "TestA"}, {Package: pa, Name: "TestB"},
				{Package: pa, Name: "TestRenamed"}},
			wantRes: skipcheck.Result{Passed: 1,
				Skips:   []skipcheck.Skip{{Test: skipcheck.Test{Package: pa, Name: "TestA"}, Reason: "x_test.go:9: slow", Allowed: true}},
				Missing: []skipcheck.Test{{Package: pa, Name: "TestA"}, {Package: pa, Name: "TestRenamed"}}},
			wantLines: []string{"MISSING required test, it did not pass: example.com/m/a TestRenamed"},
		},
		{
			name:    "package without tests",
			stream:  ev("output", pa, "", "?   \texample.com/m/a\t[no test files]\n") + ev("skip", pa, "", ""),
			wantOK:  true,
			wantRes: skipcheck.Result{},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var out bytes.Buffer
			res, err := skipcheck.Check(strings.NewReader(tt.stream), &out, tt.allow, tt.require)
			require.NoError(t, err)
			assert.Equal(t, tt.wantRes, *res)
			assert.Equal(t, tt.wantOK, res.OK())
			for _, l := range tt.wantLines {
				assert.Contains(t, strings.Split(out.String(), "\n"), l)
			}
			assert.NotContains(t, strings.Split(out.String(), "\n"), "PASS", "the bare PASS lines are dropped")
		})
	}
}

func TestParseList(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		text    string
		want    []skipcheck.Test
		wantErr string
	}{
		{name: "empty", text: "", want: nil},
		{
			name: "comments and entries",
			text: "# why\n\nexample.com/m/a TestA # the race detector\n  example.com/m/b   TestB/sub  \n",
			want: []skipcheck.Test{{Package: pa, Name: "TestA"}, {Package: pb, Name: "TestB/sub"}},
		},
		{name: "one field", text: "# x\nexample.com/m/a\n", wantErr: "line 2: want an import path and a test name, got 1 fields"},
		{name: "three fields", text: "example.com/m/a TestA why\n", wantErr: "line 1: want an import path and a test name, got 3 fields"},
		{name: "duplicate", text: "example.com/m/a TestA\nexample.com/m/a TestA # again\n", wantErr: "line 2: example.com/m/a TestA listed twice"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := skipcheck.ParseList(strings.NewReader(tt.text))
			if tt.wantErr != "" {
				assert.EqualError(t, err, tt.wantErr)
				assert.Nil(t, got)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
		})
	}
}
