package enginepick_test

// These tests hold README.md and docs/guide.md to the code: every Go block of either type-checks
// against this module and follows the error rules below, the README's package table lists exactly
// the module's packages, its dependency table lists exactly go.mod's requirements, and every
// Example and program either file names exists.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const modulePath = "github.com/enginepick/enginepick"

// stdImports are the standard packages a README block may use without an import line, by name.
var stdImports = map[string]string{
	"context": "context", "errors": "errors", "fmt": "fmt", "http": "net/http", "io": "io",
	"log": "log", "slog": "log/slog", "os": "os", "strings": "strings", "sync": "sync",
	"time": "time",
}

// mdBlock is one fenced code block of a Markdown file.
type mdBlock struct {
	lang string // the fence's info string, "" when none
	line int    // 1-based line of the block's first code line
	code string
}

// markdownBlocks returns every fenced code block of md, in order. A fence opens with ``` at the
// start of a line and closes with a line that is only ```.
func markdownBlocks(md string) ([]mdBlock, error) {
	var blocks []mdBlock
	lines := strings.Split(md, "\n")
	for i := 0; i < len(lines); i++ {
		if !strings.HasPrefix(lines[i], "```") {
			continue
		}
		lang := strings.TrimSpace(strings.TrimPrefix(lines[i], "```"))
		end := i + 1
		for end < len(lines) && strings.TrimSpace(lines[end]) != "```" {
			end++
		}
		if end == len(lines) {
			return nil, fmt.Errorf("line %d: code fence never closed", i+1)
		}
		blocks = append(blocks, mdBlock{lang: lang, line: i + 2, code: strings.Join(lines[i+1:end], "\n") + "\n"})
		i = end
	}
	return blocks, nil
}

// finding is one rule a README block breaks, at a position in the Markdown file.
type finding struct {
	pos  string // file:line:column
	rule string // one of the rule… constants
	msg  string
}

func (f finding) String() string { return f.pos + ": [" + f.rule + "] " + f.msg }

// The rules a README Go block must follow.
const (
	ruleSyntax      = "syntax"        // the block does not parse as Go declarations
	ruleCompile     = "compile"       // the block does not type-check
	ruleBlankError  = "blank-error"   // an error value assigned to _
	ruleDropError   = "drop-error"    // a call whose error result is ignored as a statement
	ruleOverwritten = "overwritten"   // an error variable assigned again before it was read
	ruleUnchecked   = "unchecked"     // an error variable assigned and never read afterwards
	ruleErrorToHTTP = "error-to-http" // an error's text written to an HTTP client
)

// snippetChecker type-checks README blocks against this module's packages.
type snippetChecker struct {
	file    string            // the Markdown file name, for positions
	imports map[string]string // package name → import path
	fset    *token.FileSet
	imp     types.Importer
	exports map[string]string // import path → compiler export data file
}

// newSnippetChecker lists the module's packages, whose names a block may use without an import.
func newSnippetChecker(t *testing.T, file string) *snippetChecker {
	t.Helper()
	pkgs := goListPackages(t)
	imports := make(map[string]string, len(stdImports)+len(pkgs))
	for name, path := range stdImports {
		imports[name] = path
	}
	for _, p := range pkgs {
		if p.Name != "main" {
			imports[p.Name] = p.ImportPath
		}
	}
	c := &snippetChecker{file: file, imports: imports, fset: token.NewFileSet(), exports: map[string]string{}}
	c.imp = importer.ForCompiler(c.fset, "gc", func(path string) (io.ReadCloser, error) {
		file, ok := c.exports[path]
		if !ok {
			return nil, fmt.Errorf("no export data for %q", path)
		}
		return os.Open(file)
	})
	return c
}

// prepared is a block turned into a Go file, or the finding that stopped it.
type prepared struct {
	file    *ast.File
	imports []string
	stop    []finding
}

// prepare parses a block. A block is either a whole Go file (it starts with a package clause and
// has its own imports) or top-level declarations, to which prepare adds a package clause and an
// import for each package name the block uses. Positions are in the Markdown file (a //line
// directive).
func (c *snippetChecker) prepare(b mdBlock) prepared {
	src := b.code
	lineDirective := fmt.Sprintf("//line %s:%d\n", c.file, b.line)
	if !strings.HasPrefix(strings.TrimSpace(src), "package ") {
		pre, err := parser.ParseFile(token.NewFileSet(), "", "package readme\n"+lineDirective+src, parser.SkipObjectResolution)
		if err != nil {
			return prepared{stop: []finding{{pos: c.file + ":" + fmt.Sprint(b.line), rule: ruleSyntax,
				msg: "a README Go block must be top-level declarations (functions, types) or a whole file: " + err.Error()}}}
		}
		used := map[string]bool{}
		ast.Inspect(pre, func(n ast.Node) bool {
			if sel, ok := n.(*ast.SelectorExpr); ok {
				if id, ok := sel.X.(*ast.Ident); ok && c.imports[id.Name] != "" {
					used[id.Name] = true
				}
			}
			return true
		})
		var head strings.Builder
		head.WriteString("package readme\n\nimport (\n")
		for _, name := range slices.Sorted(maps.Keys(used)) {
			fmt.Fprintf(&head, "\t%s %q\n", name, c.imports[name])
		}
		head.WriteString(")\n\n")
		src = head.String() + lineDirective + src
	} else {
		src = lineDirective + src
	}
	f, err := parser.ParseFile(c.fset, "snippet.go", src, parser.ParseComments|parser.SkipObjectResolution)
	if err != nil {
		return prepared{stop: []finding{{pos: c.file + ":" + fmt.Sprint(b.line), rule: ruleSyntax, msg: err.Error()}}}
	}
	var paths []string
	for _, spec := range f.Imports {
		if path, err := strconv.Unquote(spec.Path.Value); err == nil {
			paths = append(paths, path)
		}
	}
	return prepared{file: f, imports: paths}
}

// load builds the export data of the given packages and their dependencies that the checker does
// not have yet, with one go list -export. It uses the race setting of this test binary, so that
// the build cache `go test -race ./...` fills is reused, and builds only what the blocks import.
func (c *snippetChecker) load(paths []string) error {
	var missing []string
	for _, p := range paths {
		if _, ok := c.exports[p]; !ok && !slices.Contains(missing, p) {
			missing = append(missing, p)
		}
	}
	if len(missing) == 0 {
		return nil
	}
	args := []string{"list", "-export", "-deps", "-f", "{{if .Export}}{{.ImportPath}}={{.Export}}{{end}}"}
	if raceEnabled {
		args = append(args, "-race")
	}
	out, err := goCommand(append(args, missing...)...)
	if err != nil {
		return err
	}
	for line := range strings.Lines(out) {
		if path, file, ok := strings.Cut(strings.TrimSpace(line), "="); ok {
			c.exports[path] = file
		}
	}
	return nil
}

// checkAll checks every block, loading the export data of all their imports at once.
func (c *snippetChecker) checkAll(blocks []mdBlock) ([][]finding, error) {
	prep := make([]prepared, len(blocks))
	var paths []string
	for i, b := range blocks {
		prep[i] = c.prepare(b)
		paths = append(paths, prep[i].imports...)
	}
	if err := c.load(paths); err != nil {
		return nil, err
	}
	found := make([][]finding, len(blocks))
	for i := range blocks {
		found[i] = c.typeCheck(prep[i])
	}
	return found, nil
}

// check returns every rule the block breaks.
func (c *snippetChecker) check(b mdBlock) ([]finding, error) {
	found, err := c.checkAll([]mdBlock{b})
	if err != nil {
		return nil, err
	}
	return found[0], nil
}

// typeCheck type-checks a prepared block and applies the error rules.
func (c *snippetChecker) typeCheck(p prepared) []finding {
	if p.stop != nil {
		return p.stop
	}
	f := p.file
	var found []finding
	info := &types.Info{Types: map[ast.Expr]types.TypeAndValue{}, Defs: map[*ast.Ident]types.Object{},
		Uses: map[*ast.Ident]types.Object{}}
	conf := types.Config{Importer: c.imp, Error: func(err error) {
		if te, ok := err.(types.Error); ok {
			found = append(found, finding{pos: c.fset.Position(te.Pos).String(), rule: ruleCompile, msg: te.Msg})
			return
		}
		found = append(found, finding{pos: c.file, rule: ruleCompile, msg: err.Error()})
	}}
	_, _ = conf.Check("readme", c.fset, []*ast.File{f}, info) // every error goes to conf.Error
	if len(found) > 0 {
		return found
	}
	return c.lint(f, info)
}

// errorType is the predeclared error interface.
var errorType = types.Universe.Lookup("error").Type().Underlying().(*types.Interface)

func isError(t types.Type) bool {
	return t != nil && types.Implements(t, errorType)
}

// lint applies the error rules to a type-checked block.
func (c *snippetChecker) lint(f *ast.File, info *types.Info) []finding {
	var found []finding
	report := func(pos token.Pos, rule, msg string) {
		found = append(found, finding{pos: c.fset.Position(pos).String(), rule: rule, msg: msg})
	}
	typeOf := func(e ast.Expr) types.Type { return info.Types[e].Type }

	// blankTargets reports each blank identifier on the left that receives an error.
	blankTargets := func(lhs []ast.Expr, rhs []ast.Expr) {
		var results []types.Type
		if len(rhs) == 1 && len(lhs) > 1 {
			if tuple, ok := typeOf(rhs[0]).(*types.Tuple); ok {
				for v := range tuple.Variables() {
					results = append(results, v.Type())
				}
			}
		} else {
			for _, r := range rhs {
				results = append(results, typeOf(r))
			}
		}
		for i, l := range lhs {
			if id, ok := l.(*ast.Ident); ok && id.Name == "_" && i < len(results) && isError(results[i]) {
				report(id.Pos(), ruleBlankError, "an error is assigned to _: check it, or log it")
			}
		}
	}

	ast.Inspect(f, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.AssignStmt:
			blankTargets(n.Lhs, n.Rhs)
		case *ast.ValueSpec:
			lhs := make([]ast.Expr, len(n.Names))
			for i, id := range n.Names {
				lhs[i] = id
			}
			blankTargets(lhs, n.Values)
		case *ast.ExprStmt:
			call, ok := n.X.(*ast.CallExpr)
			if !ok || isPrint(call, info) {
				return true
			}
			t := typeOf(call)
			if tuple, ok := t.(*types.Tuple); ok && tuple.Len() > 0 {
				t = tuple.At(tuple.Len() - 1).Type()
			}
			if isError(t) {
				report(call.Pos(), ruleDropError, "the call's error result is ignored")
			}
		case *ast.CallExpr:
			for _, arg := range httpBodyArgs(n, info) {
				ast.Inspect(arg, func(m ast.Node) bool {
					if e, ok := m.(ast.Expr); ok && isError(typeOf(e)) {
						report(e.Pos(), ruleErrorToHTTP,
							"an error's text goes to the HTTP client; it may name internal engines: log the error and write a generic message")
						return false
					}
					return true
				})
			}
		}
		return true
	})

	// Error variables, per top-level function, in source order: each assignment must be read
	// before the next assignment and before the function ends.
	for _, decl := range f.Decls {
		fn, ok := decl.(*ast.FuncDecl)
		if !ok || fn.Body == nil {
			continue
		}
		type event struct {
			pos    token.Pos
			assign bool
		}
		events := map[types.Object][]event{}
		assigned := map[*ast.Ident]bool{}
		ast.Inspect(fn.Body, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.AssignStmt:
				for _, l := range n.Lhs {
					if id, ok := l.(*ast.Ident); ok {
						assigned[id] = true
					}
				}
			case *ast.ValueSpec:
				if len(n.Values) > 0 {
					for _, id := range n.Names {
						assigned[id] = true
					}
				}
			}
			return true
		})
		ast.Inspect(fn.Body, func(n ast.Node) bool {
			id, ok := n.(*ast.Ident)
			if !ok || id.Name == "_" {
				return true
			}
			obj := info.Defs[id]
			if obj == nil {
				obj = info.Uses[id]
			}
			v, ok := obj.(*types.Var)
			if !ok || v.IsField() || !isError(v.Type()) {
				return true
			}
			events[v] = append(events[v], event{pos: id.Pos(), assign: assigned[id]})
			return true
		})
		for v, evs := range events {
			sort.Slice(evs, func(i, j int) bool { return evs[i].pos < evs[j].pos })
			var pending token.Pos
			for _, e := range evs {
				if e.assign && pending.IsValid() {
					report(e.pos, ruleOverwritten, fmt.Sprintf("%s is assigned again before the error assigned at %s is checked",
						v.Name(), c.fset.Position(pending)))
				}
				if e.assign {
					pending = e.pos
				} else {
					pending = token.NoPos
				}
			}
			if pending.IsValid() {
				report(pending, ruleUnchecked, v.Name()+" is assigned and never checked afterwards")
			}
		}
	}
	sort.SliceStable(found, func(i, j int) bool { return found[i].pos < found[j].pos })
	return found
}

// isPrint reports whether call is a fmt print function, whose error result is conventionally
// ignored.
func isPrint(call *ast.CallExpr, info *types.Info) bool {
	fn := calledFunc(call, info)
	return fn != nil && fn.Pkg() != nil && fn.Pkg().Path() == "fmt" && strings.Contains(strings.ToLower(fn.Name()), "print")
}

// calledFunc returns the function or method a call calls, or nil.
func calledFunc(call *ast.CallExpr, info *types.Info) *types.Func {
	var id *ast.Ident
	switch f := call.Fun.(type) {
	case *ast.Ident:
		id = f
	case *ast.SelectorExpr:
		id = f.Sel
	default:
		return nil
	}
	fn, _ := info.Uses[id].(*types.Func)
	return fn
}

// httpBodyArgs returns the arguments of call that become the body of an HTTP response: the message
// of http.Error, what fmt.Fprint* or io.WriteString write to an http.ResponseWriter, and what a
// ResponseWriter's Write method writes.
func httpBodyArgs(call *ast.CallExpr, info *types.Info) []ast.Expr {
	fn := calledFunc(call, info)
	if fn == nil || fn.Pkg() == nil {
		return nil
	}
	isWriter := func(e ast.Expr) bool {
		t := info.Types[e].Type
		named, ok := t.(*types.Named)
		return ok && named.Obj().Pkg() != nil && named.Obj().Pkg().Path() == "net/http" && named.Obj().Name() == "ResponseWriter"
	}
	switch {
	case fn.Pkg().Path() == "net/http" && fn.Name() == "Error" && len(call.Args) == 3:
		return call.Args[1:2]
	case (fn.Pkg().Path() == "fmt" && strings.HasPrefix(fn.Name(), "Fprint") ||
		fn.Pkg().Path() == "io" && fn.Name() == "WriteString") && len(call.Args) > 0 && isWriter(call.Args[0]):
		return call.Args[1:]
	}
	if sel, ok := call.Fun.(*ast.SelectorExpr); ok && isWriter(sel.X) && fn.Name() == "Write" {
		return call.Args
	}
	return nil
}

// goPackage is one package of the module, as go list reports it.
type goPackage struct {
	ImportPath string
	Name       string
	Dir        string
}

func goListPackages(t *testing.T) []goPackage {
	t.Helper()
	pkgs, err := modulePackages()
	require.NoError(t, err)
	require.NotEmpty(t, pkgs)
	return pkgs
}

// modulePackages lists the module's packages once per test binary.
var modulePackages = sync.OnceValues(func() ([]goPackage, error) {
	out, err := goCommand("list", "-json", "./...")
	if err != nil {
		return nil, err
	}
	var pkgs []goPackage
	dec := json.NewDecoder(strings.NewReader(out))
	for dec.More() {
		var p goPackage
		if err := dec.Decode(&p); err != nil {
			return nil, fmt.Errorf("go list -json: %w", err)
		}
		pkgs = append(pkgs, p)
	}
	return pkgs, nil
})

// runGo runs the go command in the module root (this package's directory) and returns stdout.
func runGo(t *testing.T, args ...string) string {
	t.Helper()
	out, err := goCommand(args...)
	require.NoError(t, err)
	return out
}

// goCommand runs the go command in the module root (this package's directory) and returns stdout;
// the error carries stderr.
func goCommand(args ...string) (string, error) {
	goCmd, err := exec.LookPath("go")
	if err != nil {
		return "", fmt.Errorf("the README tests run the go command: %w", err)
	}
	cmd := exec.Command(goCmd, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("go %s: %w: %s", strings.Join(args, " "), err, stderr.String())
	}
	return stdout.String(), nil
}

func readREADME(t *testing.T) string {
	t.Helper()
	return readDoc(t, "README.md")
}

// checkedDocs are the Markdown files whose Go blocks and references the tests check: the README
// and the guide its Go walkthroughs moved to.
var checkedDocs = []string{"README.md", "docs/guide.md"}

func readDoc(t *testing.T, file string) string {
	t.Helper()
	md, err := os.ReadFile(file)
	require.NoError(t, err)
	return string(md)
}

// TestREADMEGoBlocks type-checks every Go block of README.md and docs/guide.md against this module
// and applies the error rules. Every fence must name its language, so that no Go code escapes the
// check. The README keeps at least its quick start; the two files together at least 8 blocks.
func TestREADMEGoBlocks(t *testing.T) {
	total := 0
	for _, file := range checkedDocs {
		blocks, err := markdownBlocks(readDoc(t, file))
		require.NoError(t, err, file)
		var goBlocks []mdBlock
		for _, b := range blocks {
			switch b.lang {
			case "go":
				goBlocks = append(goBlocks, b)
			case "":
				t.Errorf("%s:%d: a code fence without a language: label it (go, sh, text)", file, b.line-1)
			case "sh", "text":
			default:
				t.Errorf("%s:%d: code fence language %q: use go, sh or text", file, b.line-1, b.lang)
			}
		}
		found, err := newSnippetChecker(t, file).checkAll(goBlocks)
		require.NoError(t, err)
		for _, fs := range found {
			for _, f := range fs {
				t.Error(f)
			}
		}
		if file == "README.md" {
			assert.NotEmpty(t, goBlocks, "README.md keeps its Go quick start")
		}
		total += len(goBlocks)
	}
	assert.GreaterOrEqual(t, total, 8, "Go blocks checked in %v", checkedDocs)
}

// TestREADMECheckerRules feeds the checker blocks that break each rule, and one that breaks none,
// so that a checker that stopped looking would fail here.
func TestREADMECheckerRules(t *testing.T) {
	c := newSnippetChecker(t, "test.md")
	cases := []struct {
		name string
		code string
		want []string // rules, in position order
	}{
		{"clean", `
func good(w http.ResponseWriter, reg *state.StaticRegistry, load *loadmon.Table) error {
	if err := reg.Add(state.NewStaticEngine("http://e", "m", state.StagePlain)); err != nil {
		return err
	}
	err := load.Expect("http://e", 2)
	if err != nil {
		code := bucket.StatusCode(err)
		log.Printf("expect: %v", err)
		http.Error(w, http.StatusText(code), code)
		return err
	}
	fmt.Println("ok")
	peak, err := bucket.ExpectedPeak(1, 2)
	fmt.Fprintf(w, "peak %d", peak)
	return err
}`, nil},
		{"not declarations", `x := 1`, []string{ruleSyntax}},
		{"does not compile", `func f() int { return "x" }`, []string{ruleCompile}},
		{"undeclared placeholder", `func f() { use(promptTokens) }`, []string{ruleCompile, ruleCompile}},
		{"error to blank", `
func f(reg *state.StaticRegistry) {
	_ = reg.Add(nil)
}`, []string{ruleBlankError}},
		{"error result to blank", `
func f() int64 {
	peak, _ := bucket.ExpectedPeak(1, 2)
	return peak
}`, []string{ruleBlankError}},
		{"dropped error result", `
func f(load *loadmon.Table) {
	load.Expect("http://e", 2)
}`, []string{ruleDropError}},
		{"error overwritten", `
func f(load *loadmon.Table) error {
	err := load.Expect("http://a", 2)
	err = load.Expect("http://b", 2)
	return err
}`, []string{ruleOverwritten}},
		{"error never checked", `
func f(load *loadmon.Table) (int64, error) {
	peak, err := bucket.ExpectedPeak(1, 2)
	if err != nil {
		return 0, err
	}
	err = load.Expect("http://a", 2)
	return peak, nil
}`, []string{ruleUnchecked}},
		{"error text to client", `
func f(w http.ResponseWriter, err error) {
	http.Error(w, err.Error(), bucket.StatusCode(err))
}`, []string{ruleErrorToHTTP}},
		{"error formatted to client", `
func f(w http.ResponseWriter, err error) {
	fmt.Fprintf(w, "routing failed: %v", err)
}`, []string{ruleErrorToHTTP}},
		{"whole file", `package main

import "github.com/enginepick/enginepick/loadmon"

func main() { _ = loadmon.NewTable().Expect("http://e", 0) }`, []string{ruleBlankError}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			found, err := c.check(mdBlock{lang: "go", line: 10, code: strings.TrimPrefix(tc.code, "\n")})
			require.NoError(t, err)
			var rules []string
			for _, f := range found {
				rules = append(rules, f.rule)
				assert.True(t, strings.HasPrefix(f.pos, "test.md:"), "position %q is in the Markdown file", f.pos)
			}
			assert.Equal(t, tc.want, rules, "findings: %v", found)
		})
	}
}

// TestMarkdownBlocks checks the fence parser on positions, languages and an unclosed fence.
func TestMarkdownBlocks(t *testing.T) {
	blocks, err := markdownBlocks("text\n```go\nfunc f() {}\n```\n\n```sh\necho\n```\n")
	require.NoError(t, err)
	assert.Equal(t, []mdBlock{{lang: "go", line: 3, code: "func f() {}\n"}, {lang: "sh", line: 7, code: "echo\n"}}, blocks)
	_, err = markdownBlocks("```go\nfunc f() {}\n")
	assert.Error(t, err)
}

// readmeSection returns the text of the README section with the given "## " heading.
func readmeSection(t *testing.T, md, heading string) string {
	t.Helper()
	_, after, ok := strings.Cut(md, "\n## "+heading+"\n")
	require.True(t, ok, "README.md has a %q section", heading)
	if i := strings.Index(after, "\n## "); i >= 0 {
		after = after[:i]
	}
	return after
}

// tableFirstColumn returns the back-quoted first cell of every row of the section's table.
func tableFirstColumn(section string) []string {
	var cells []string
	re := regexp.MustCompile("^\\| `([^`]+)` \\|")
	for line := range strings.Lines(section) {
		if m := re.FindStringSubmatch(line); m != nil {
			cells = append(cells, m[1])
		}
	}
	sort.Strings(cells)
	return cells
}

// TestREADMEPackages checks that the package table lists exactly the module's library packages (by
// path relative to the module root; the root package is "enginepick"), and that every program
// under examples/ is named.
func TestREADMEPackages(t *testing.T) {
	md := readREADME(t)
	section := readmeSection(t, md, "Packages")
	var want []string
	for _, p := range goListPackages(t) {
		rel := strings.TrimPrefix(strings.TrimPrefix(p.ImportPath, modulePath), "/")
		switch {
		case rel == "":
			want = append(want, "enginepick")
		case p.Name == "main":
			assert.Contains(t, section, "`"+rel+"`", "README.md, Packages: name the program %s", rel)
		default:
			want = append(want, rel)
		}
	}
	assertSameRows(t, "package table (## Packages)", want, tableFirstColumn(section))
}

// assertSameRows reports the rows a README table lacks and the rows it has too many.
func assertSameRows(t *testing.T, table string, want, got []string) {
	t.Helper()
	for _, w := range want {
		if !slices.Contains(got, w) {
			t.Errorf("README.md %s: add a row for `%s`", table, w)
		}
	}
	for _, g := range got {
		if !slices.Contains(want, g) {
			t.Errorf("README.md %s: remove the row for `%s`, which does not exist", table, g)
		}
	}
}

// TestREADMEDependencies checks that the dependency table lists exactly the modules go.mod requires.
func TestREADMEDependencies(t *testing.T) {
	var mod struct{ Require []struct{ Path string } }
	require.NoError(t, json.Unmarshal([]byte(runGo(t, "mod", "edit", "-json")), &mod))
	var want []string
	for _, r := range mod.Require {
		want = append(want, r.Path)
	}
	assertSameRows(t, "dependency table (## Dependencies), from go.mod", want,
		tableFirstColumn(readmeSection(t, readREADME(t), "Dependencies")))
}

// TestREADMEReferences checks that every Example function and every examples/ directory README.md
// and docs/guide.md name exists, so that "run Example_x" never points at nothing.
func TestREADMEReferences(t *testing.T) {
	examples := map[string]bool{}
	err := filepath.WalkDir(".", func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return err
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		for _, decl := range f.Decls {
			if fn, ok := decl.(*ast.FuncDecl); ok && strings.HasPrefix(fn.Name.Name, "Example") {
				examples[fn.Name.Name] = true
			}
		}
		return nil
	})
	require.NoError(t, err)
	for _, file := range checkedDocs {
		md := readDoc(t, file)
		named := regexp.MustCompile(`\bExample[A-Za-z0-9_]*`).FindAllString(md, -1)
		require.NotEmpty(t, named, file)
		for _, name := range named {
			assert.True(t, examples[name], "%s names %s, which no _test.go file declares", file, name)
		}
		for _, dir := range regexp.MustCompile("`(examples/[a-z0-9/]+)`").FindAllStringSubmatch(md, -1) {
			info, err := os.Stat(dir[1])
			if assert.NoError(t, err, "%s names %s", file, dir[1]) {
				assert.True(t, info.IsDir(), "%s names %s as a directory", file, dir[1])
			}
		}
	}
}

// TestDocsBudget holds the reading budget of the documentation: the README under 15,000 bytes,
// README and docs/guide.md together at most 10,000 words, and all of docs/ at most 120,000 bytes
// (measurements belong in commit messages and the CHANGELOG, not in docs/).
func TestDocsBudget(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("README.md")
	require.NoError(t, err)
	assert.Less(t, len(readme), 15_000, "README.md bytes")
	guide, err := os.ReadFile(filepath.Join("docs", "guide.md"))
	require.NoError(t, err)
	assert.LessOrEqual(t, len(strings.Fields(string(readme)))+len(strings.Fields(string(guide))), 10_000,
		"README.md and docs/guide.md words")
	docs, err := filepath.Glob(filepath.Join("docs", "*.md"))
	require.NoError(t, err)
	var total int
	for _, f := range docs {
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		total += len(b)
	}
	assert.LessOrEqual(t, total, 120_000, "docs/*.md bytes")
}
