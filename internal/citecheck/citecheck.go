// Package citecheck verifies that the repository's citations resolve. It scans the comments of
// every .go file and the whole text of every .md file, finds the repository paths they cite
// (docs/design.md, kvindex/index.go, internal/sim/traces, or a bare file name, which resolves next to the
// citing file or at the root) and the
// numbered sections they cite (docs/design.md §9.3), and reports each one that does not exist.
//
// A path attributed to an upstream repository, written as owner/repo followed by the backticked
// path (sgl-project/sglang `experimental/sgl-router/src/policies_reorg/cache_aware.rs`), is not
// checked locally; several backticked paths after one owner/repo share the attribution, and so
// does a Markdown table row whose previous cell is owner/repo. A path with an upstream file
// extension (.rs, .py, .proto) and no attribution is reported, as are the forms that name the
// team's design corpus, which users of the module do not have, and relative paths that leave the
// repository.
//
// It is a CI tool (internal/citecheck/cmd/citecheck), not part of the library: it knows nothing
// about routing and is not imported by any enginepick package.
package citecheck

import (
	"bytes"
	"fmt"
	"go/scanner"
	"go/token"
	"io/fs"
	"path"
	"regexp"
	"slices"
	"strings"
)

// Finding is one citation that does not resolve.
type Finding struct {
	// File is the citing file, slash-separated and relative to the repository root.
	File string
	// Line is the 1-based line of the citation in File.
	Line int
	// Cite is the cited text as written (a path, a path with a section, or a forbidden form).
	Cite string
	// Reason says why it does not resolve.
	Reason string
}

// String formats the finding as file:line: reason: cite, the form editors and CI logs link.
func (f Finding) String() string {
	return fmt.Sprintf("%s:%d: %s: %s", f.File, f.Line, f.Reason, f.Cite)
}

// Reasons reported in Finding.Reason.
const (
	ReasonMissing    = "cited path does not exist in the repository"
	ReasonSection    = "cited section does not exist"
	ReasonOutside    = "cites a document outside the repository"
	ReasonUnassigned = "upstream file cited without its repository (write owner/repo `path`)"
)

// pathExts are the file extensions that make a slash-separated token a file path. localExts are
// the ones a bare file name (no slash) is checked for; upstreamExts never exist in this repository
// and must be attributed.
var (
	pathExts = map[string]bool{
		".go": true, ".md": true, ".mod": true, ".sum": true, ".jsonl": true, ".json": true,
		".gz": true, ".csv": true, ".yaml": true, ".yml": true, ".toml": true, ".txt": true,
		".sh": true, ".rs": true, ".py": true, ".proto": true, ".pdf": true,
	}
	localExts    = map[string]bool{".go": true, ".md": true}
	upstreamExts = map[string]bool{".rs": true, ".py": true, ".proto": true}
)

// forbidden are the citation forms that point outside the repository whatever follows them: the
// team's design corpus and the shared folder beside the checkout.
var forbidden = []*regexp.Regexp{
	regexp.MustCompile(`(?:^|[^\w./-])((?:research|seeds)/[\w.-]+(?:/[\w.-]+)*)`),
	regexp.MustCompile(`(?:^|[^\w./-])((?:ARCHITECTURE|STYLE)\.md)\b`),
	regexp.MustCompile(`(?:^|[^\w./-])(traces/README\.md)\b`),
	regexp.MustCompile(`(?:^|[^\w.-])(/work/[\w./-]*)`),
}

var (
	// run is a maximal run of path characters; classify decides whether it is a path.
	run = regexp.MustCompile(`[A-Za-z0-9_.\-/]+`)
	// repoToken is owner/repo at the end of the text before an attributed path.
	repoToken = regexp.MustCompile(`(?:^|[^\w./-])([A-Za-z0-9][\w.-]*/[\w.-]+)$`)
	// backticked is a backticked span at the end of the text before a path in a list.
	backticked = regexp.MustCompile("`[^`\n]+`$")
	// sections is the run of § numbers after a cited Markdown file.
	sections = regexp.MustCompile(`^[\x60)]?[ \t]*((?:§\d+(?:\.\d+)*(?:[ \t]*(?:,|and|or|–|-|to)?[ \t]*))+)`)
	// sectionNum is one § number.
	sectionNum = regexp.MustCompile(`§(\d+(?:\.\d+)*)`)
	// heading is a numbered Markdown heading: "## 9. Cache-aware" or "### 9.3 Queue gate".
	heading = regexp.MustCompile(`(?m)^#{1,6}[ \t]+(\d+(?:\.\d+)*)\.?[ \t]`)
)

// Checker checks the files of one repository. Its zero value is not usable; use New.
type Checker struct {
	fsys     fs.FS
	top      map[string]bool            // top-level entries of the repository
	headings map[string]map[string]bool // Markdown file → its numbered sections
}

// New returns a Checker for the repository whose root is fsys.
func New(fsys fs.FS) (*Checker, error) {
	entries, err := fs.ReadDir(fsys, ".")
	if err != nil {
		return nil, fmt.Errorf("citecheck: read repository root: %w", err)
	}
	c := &Checker{fsys: fsys, top: map[string]bool{}, headings: map[string]map[string]bool{}}
	for _, e := range entries {
		c.top[e.Name()] = true
	}
	return c, nil
}

// Check walks the repository and checks every .go and .md file outside hidden directories,
// testdata and vendor. Findings are sorted by file and line.
func Check(fsys fs.FS) ([]Finding, error) {
	c, err := New(fsys)
	if err != nil {
		return nil, err
	}
	var out []Finding
	err = fs.WalkDir(fsys, ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if d.IsDir() {
			if p != "." && (strings.HasPrefix(name, ".") || name == "testdata" || name == "vendor") {
				return fs.SkipDir
			}
			return nil
		}
		if ext := path.Ext(name); ext != ".go" && ext != ".md" {
			return nil
		}
		src, err := fs.ReadFile(fsys, p)
		if err != nil {
			return err
		}
		out = append(out, c.File(p, src)...)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("citecheck: %w", err)
	}
	slices.SortStableFunc(out, func(a, b Finding) int {
		if a.File != b.File {
			return strings.Compare(a.File, b.File)
		}
		return a.Line - b.Line
	})
	return out, nil
}

// File checks one file's citations: the comments of a .go file, the whole text of a .md file.
// file is its slash-separated path relative to the repository root.
func (c *Checker) File(file string, src []byte) []Finding {
	var out []Finding
	for _, b := range blocks(file, src) {
		out = append(out, c.block(file, b)...)
	}
	return out
}

// textBlock is a run of text and the source line of each of its lines.
type textBlock struct {
	text  string
	lines []int // lines[i] is the source line of the block's line i
}

// line returns the source line of byte offset off of the block.
func (b textBlock) line(off int) int {
	return b.lines[strings.Count(b.text[:off], "\n")]
}

// blocks splits a file into the text checked: a .md file is one block; in a .go file each run of
// line comments on consecutive lines is a block (so a citation wrapped across comment lines is
// read whole), and so is each general comment.
func blocks(file string, src []byte) []textBlock {
	if path.Ext(file) != ".go" {
		n := bytes.Count(src, []byte("\n")) + 1
		lines := make([]int, n)
		for i := range lines {
			lines[i] = i + 1
		}
		return []textBlock{{text: string(src), lines: lines}}
	}
	fset := token.NewFileSet()
	tf := fset.AddFile(file, -1, len(src))
	var s scanner.Scanner
	s.Init(tf, src, nil, scanner.ScanComments)
	var out []textBlock
	var cur *textBlock
	lastLine := -1
	for {
		pos, tok, lit := s.Scan()
		if tok == token.EOF {
			break
		}
		if tok != token.COMMENT {
			continue
		}
		line := fset.Position(pos).Line
		if strings.HasPrefix(lit, "/*") {
			body := strings.TrimSuffix(strings.TrimPrefix(lit, "/*"), "*/")
			b := textBlock{text: body}
			for i := range strings.Count(body, "\n") + 1 {
				b.lines = append(b.lines, line+i)
			}
			out = append(out, b)
			cur, lastLine = nil, -1
			continue
		}
		body := strings.TrimPrefix(lit, "//")
		if cur != nil && line == lastLine+1 {
			cur.text += "\n" + body
			cur.lines = append(cur.lines, line)
		} else {
			out = append(out, textBlock{text: body, lines: []int{line}})
			cur = &out[len(out)-1]
		}
		lastLine = line
	}
	return out
}

// block checks one block of text.
func (c *Checker) block(file string, b textBlock) []Finding {
	var out []Finding
	report := func(off int, cite, reason string) {
		out = append(out, Finding{File: file, Line: b.line(off), Cite: cite, Reason: reason})
	}
	for _, re := range forbidden {
		for _, m := range re.FindAllStringSubmatchIndex(b.text, -1) {
			report(m[2], strings.TrimRight(b.text[m[2]:m[3]], ".-"), ReasonOutside)
		}
	}
	consumed := map[int]bool{} // offsets of § references that follow a cited file
	for _, m := range run.FindAllStringIndex(b.text, -1) {
		start, end := m[0], m[1]
		tok := b.text[start:end]
		if start > 0 && strings.ContainsRune(":@~$", rune(b.text[start-1])) {
			continue // a URL, an address, a home or variable path: not a repository path
		}
		cite, ok := c.classify(tok)
		if !ok {
			continue
		}
		if c.attributed(b.text[:start]) {
			continue
		}
		if forbiddenForm(cite) {
			continue // already reported
		}
		if upstreamExts[path.Ext(cite)] {
			report(start, cite, ReasonUnassigned)
			continue
		}
		resolved, ok := c.resolve(file, cite)
		if !ok {
			reason := ReasonMissing
			if strings.HasPrefix(path.Join(path.Dir(file), cite), "..") {
				reason = ReasonOutside
			}
			report(start, cite, reason)
			continue
		}
		if path.Ext(resolved) != ".md" {
			continue
		}
		rest := b.text[end:]
		sm := sections.FindStringSubmatchIndex(rest)
		if sm == nil {
			continue
		}
		for _, n := range sectionNum.FindAllStringSubmatchIndex(rest[sm[2]:sm[3]], -1) {
			off := end + sm[2] + n[0]
			consumed[off] = true
			num := rest[sm[2]+n[2] : sm[2]+n[3]]
			if !c.hasSection(resolved, num) {
				report(off, cite+" §"+num, ReasonSection)
			}
		}
	}
	// A Markdown file with numbered sections may refer to its own sections by bare §N.
	if path.Ext(file) == ".md" && len(c.sections(file)) > 0 {
		for _, n := range sectionNum.FindAllStringSubmatchIndex(b.text, -1) {
			if consumed[n[0]] {
				continue
			}
			num := b.text[n[2]:n[3]]
			if !c.hasSection(file, num) {
				report(n[0], "§"+num, ReasonSection)
			}
		}
	}
	return out
}

// forbiddenForm reports whether a path token is one of the forbidden forms on its own.
func forbiddenForm(cite string) bool {
	for _, re := range forbidden {
		if re.MatchString(cite) {
			return true
		}
	}
	return false
}

// classify decides whether a run of path characters is a cited path and returns it cleaned of
// sentence punctuation, a leading "./" and a trailing "/..." or "/".
func (c *Checker) classify(tok string) (string, bool) {
	tok = strings.TrimRight(tok, ".-")
	tok = strings.TrimSuffix(tok, "/")
	for strings.HasPrefix(tok, "./") {
		tok = tok[2:]
	}
	if tok == "" || strings.HasPrefix(tok, "/") || strings.Contains(tok, "//") {
		return "", false
	}
	ext := path.Ext(tok)
	if !strings.Contains(tok, "/") {
		// A bare name needs a stem: ".go" alone names an extension, not a file.
		return tok, !strings.HasPrefix(tok, ".") && (localExts[ext] || upstreamExts[ext])
	}
	if pathExts[ext] {
		return tok, true
	}
	first, _, _ := strings.Cut(tok, "/")
	if first == ".." {
		return tok, true
	}
	return tok, c.top[first]
}

// attributed reports whether the text before a path ends with an upstream attribution:
// owner/repo, then the path, possibly after other backticked paths of the same list or a
// Markdown table cell separator.
func (c *Checker) attributed(before string) bool {
	s := strings.TrimSuffix(before, "`")
	for {
		t := strings.TrimRight(s, " \t\n|,;")
		for _, w := range []string{" and", " or", "\nand", "\nor"} {
			t = strings.TrimSuffix(t, w)
		}
		t = strings.TrimRight(t, " \t\n|,;")
		if loc := backticked.FindStringIndex(t); loc != nil && loc[0] < len(t) {
			s = t[:loc[0]]
			continue
		}
		s = t
		break
	}
	m := repoToken.FindStringSubmatch(s)
	if m == nil {
		return false
	}
	repo := m[1]
	first, _, _ := strings.Cut(repo, "/")
	return !c.top[first] && !pathExts[path.Ext(repo)]
}

// resolve finds a cited path relative to the citing file's directory, then to the root, and
// returns the repository path that exists.
func (c *Checker) resolve(file, cite string) (string, bool) {
	for _, p := range []string{path.Join(path.Dir(file), cite), path.Clean(cite)} {
		if p == ".." || strings.HasPrefix(p, "../") {
			continue
		}
		if _, err := fs.Stat(c.fsys, p); err == nil {
			return p, true
		}
	}
	return "", false
}

// sections returns the numbered sections of a Markdown file, read once.
func (c *Checker) sections(file string) map[string]bool {
	if s, ok := c.headings[file]; ok {
		return s
	}
	s := map[string]bool{}
	if src, err := fs.ReadFile(c.fsys, file); err == nil {
		for _, m := range heading.FindAllStringSubmatch(string(src), -1) {
			s[m[1]] = true
		}
	}
	c.headings[file] = s
	return s
}

// hasSection reports whether the Markdown file has the numbered section num.
func (c *Checker) hasSection(file, num string) bool { return c.sections(file)[num] }
