// Package skipcheck reads the JSON event stream of `go test -json` (cmd/test2json), prints a short
// report (package results, the output of failed tests, every skip with its reason) and checks each
// skipped test against an allowlist, so that a test which stops running in CI is noticed. It can
// also require a list of tests to have passed.
//
// A test list (the allowlist, the required tests) is text, one entry a line: a package import path
// and a test name (a subtest as Parent/Sub, spelled as `go test -v` prints it), separated by
// spaces. A '#' starts a comment, which should say why the test may skip and what runs it instead.
// An entry names the test exactly; there are no patterns.
package skipcheck

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
)

// Test names one test of one package.
type Test struct {
	Package string // import path
	Name    string // "TestX" or "TestX/sub"
}

// String returns the test as a test list spells it: "<import path> <name>".
func (t Test) String() string { return t.Package + " " + t.Name }

// Skip is a test that skipped, with the lines it logged (the reason) and whether the allowlist
// names it.
type Skip struct {
	Test
	// Reason is what the test logged, its lines joined by " | "; empty when it logged nothing.
	Reason string
	// Allowed is true when the allowlist names the test.
	Allowed bool
}

// Result is what Check found in one stream.
type Result struct {
	Passed int    // tests (and subtests) that passed
	Failed []Test // tests that failed, in the order the stream reported them
	// FailedPackages are the packages that failed to build or whose test binary failed.
	FailedPackages []string
	Skips          []Skip // in the order the stream reported them
	// Stale are allowlist entries whose test did not skip (it passed, failed or did not run).
	Stale []Test
	// Missing are required tests that did not pass (they failed, skipped or did not run).
	Missing []Test
}

// OK reports whether the stream shows no failure, no skip outside the allowlist, no stale entry
// and no missing required test.
func (r *Result) OK() bool {
	if len(r.Failed) > 0 || len(r.FailedPackages) > 0 || len(r.Stale) > 0 || len(r.Missing) > 0 {
		return false
	}
	for _, s := range r.Skips {
		if !s.Allowed {
			return false
		}
	}
	return true
}

// ParseList reads a test list (see the package documentation). It returns an error naming the
// line of a malformed entry (not exactly two fields) or of a duplicate.
func ParseList(r io.Reader) ([]Test, error) {
	var out []Test
	seen := map[Test]bool{}
	sc := bufio.NewScanner(r)
	for line := 1; sc.Scan(); line++ {
		text, _, _ := strings.Cut(sc.Text(), "#")
		fields := strings.Fields(text)
		if len(fields) == 0 {
			continue
		}
		if len(fields) != 2 {
			return nil, fmt.Errorf("line %d: want an import path and a test name, got %d fields", line, len(fields))
		}
		t := Test{Package: fields[0], Name: fields[1]}
		if seen[t] {
			return nil, fmt.Errorf("line %d: %s listed twice", line, t)
		}
		seen[t] = true
		out = append(out, t)
	}
	return out, sc.Err()
}

// event is one line of `go test -json` output (cmd/test2json).
type event struct {
	Action     string
	Package    string
	Test       string
	Output     string
	ImportPath string // build events
}

// Check reads a `go test -json` stream from r, writes the report to w and returns what it found:
// skips are checked against allow, and every test of require must have passed. Lines that are not
// JSON events (a build error printed before the stream) are copied to w. It returns an error only
// when r or w fails.
func Check(r io.Reader, w io.Writer, allow, require []Test) (*Result, error) {
	allowed := make(map[Test]bool, len(allow))
	for _, t := range allow {
		allowed[t] = true
	}
	res := &Result{}
	skipped, passed := map[Test]bool{}, map[Test]bool{}
	pending := map[Test]*strings.Builder{} // output of tests still running
	var werr error
	printf := func(format string, args ...any) {
		if werr == nil {
			_, werr = fmt.Fprintf(w, format, args...)
		}
	}
	flush := func(pkg string) { // the package ended: print what its unfinished tests logged
		var names []Test
		for t := range pending {
			if t.Package == pkg {
				names = append(names, t)
			}
		}
		slices.SortFunc(names, func(a, b Test) int { return strings.Compare(a.Name, b.Name) })
		for _, t := range names {
			printf("%s", pending[t].String())
			delete(pending, t)
		}
	}

	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 16<<20)
	for sc.Scan() {
		line := sc.Bytes()
		var e event
		if len(line) == 0 || line[0] != '{' || json.Unmarshal(line, &e) != nil || e.Action == "" {
			printf("%s\n", line)
			continue
		}
		switch {
		case e.Action == "build-output":
			printf("%s", e.Output)
		case e.Action == "build-fail":
			res.FailedPackages = append(res.FailedPackages, e.ImportPath)
		case e.Test == "":
			switch e.Action {
			case "output":
				if e.Output != "PASS\n" {
					printf("%s", e.Output)
				}
			case "fail":
				flush(e.Package)
				if !slices.Contains(res.FailedPackages, e.Package) {
					res.FailedPackages = append(res.FailedPackages, e.Package)
				}
			case "pass", "skip":
				flush(e.Package)
			}
		default:
			t := Test{Package: e.Package, Name: e.Test}
			switch e.Action {
			case "output":
				b := pending[t]
				if b == nil {
					b = &strings.Builder{}
					pending[t] = b
				}
				b.WriteString(e.Output)
			case "pass":
				res.Passed++
				passed[t] = true
				delete(pending, t)
			case "fail":
				res.Failed = append(res.Failed, t)
				if b := pending[t]; b != nil {
					printf("%s", b.String())
				}
				delete(pending, t)
			case "skip":
				s := Skip{Test: t, Reason: reason(pending[t]), Allowed: allowed[t]}
				res.Skips = append(res.Skips, s)
				skipped[t] = true
				delete(pending, t)
			}
		}
	}
	if err := sc.Err(); err != nil {
		return res, err
	}
	for _, pkg := range packagesOf(pending) {
		flush(pkg)
	}
	for _, t := range allow {
		if !skipped[t] {
			res.Stale = append(res.Stale, t)
		}
	}
	for _, t := range require {
		if !passed[t] {
			res.Missing = append(res.Missing, t)
		}
	}

	printf("\n%d passed, %d failed, %d skipped\n", res.Passed, len(res.Failed), len(res.Skips))
	for _, s := range res.Skips {
		mark := "allowed"
		if !s.Allowed {
			mark = "NOT IN THE ALLOWLIST"
		}
		printf("SKIP %s (%s): %s\n", s.Test, mark, s.Reason)
	}
	for _, t := range res.Stale {
		printf("STALE allowlist entry, the test did not skip: %s\n", t)
	}
	for _, t := range res.Missing {
		printf("MISSING required test, it did not pass: %s\n", t)
	}
	for _, t := range res.Failed {
		printf("FAIL %s\n", t)
	}
	for _, p := range res.FailedPackages {
		printf("FAIL package %s\n", p)
	}
	return res, werr
}

// reason returns what a skipped test logged, without the "=== RUN" and "--- SKIP" lines, on one
// line.
func reason(b *strings.Builder) string {
	if b == nil {
		return ""
	}
	var parts []string
	for line := range strings.Lines(b.String()) {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "=== ") || strings.HasPrefix(line, "--- ") {
			continue
		}
		parts = append(parts, line)
	}
	return strings.Join(parts, " | ")
}

func packagesOf(pending map[Test]*strings.Builder) []string {
	var out []string
	for t := range pending {
		if !slices.Contains(out, t.Package) {
			out = append(out, t.Package)
		}
	}
	slices.Sort(out)
	return out
}
