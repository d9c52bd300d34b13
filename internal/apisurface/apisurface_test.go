package apisurface_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/internal/apisurface"
)

// ceiling is the most exported identifiers the module's public packages may have. Lower it as the
// surface shrinks; never raise it without a reason the reviewer accepts.
const ceiling = 451

func TestModuleSurfaceCeiling(t *testing.T) {
	t.Parallel()
	pkgs, err := apisurface.Count(filepath.Join("..", ".."))
	require.NoError(t, err)
	for _, p := range pkgs {
		t.Logf("%4d %s", len(p.Exports), p.Dir)
	}
	total := apisurface.Total(pkgs)
	t.Logf("%4d total", total)
	assert.LessOrEqual(t, total, ceiling, "exported identifiers outside internal/ and examples/ (go run ./internal/apisurface/cmd/apisurface -v lists them)")
	for _, p := range pkgs {
		assert.NotRegexp(t, `(^|/)(internal|examples|testdata)(/|$)`, p.Dir)
	}
}

func writeFiles(t *testing.T, root string, files map[string]string) {
	t.Helper()
	for name, text := range files {
		path := filepath.Join(root, filepath.FromSlash(name))
		require.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
		require.NoError(t, os.WriteFile(path, []byte(text), 0o600))
	}
}

func TestCount(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	writeFiles(t, root, map[string]string{
		"go.mod": "module example.com/m\n\ngo 1.26\n",
		"m.go": `package m

// Exported package-level names, one count each; fields and interface methods do not count.
type T struct{ Field int; hidden int }
type I interface{ Method() }
type G[K comparable] struct{}
type (
	A = int
	b int
)
const (
	C1, C2 = 1, 2
	c3     = 3
)
var V, v = 1, 2
func F() {}
func f() {}

// Methods count on exported receivers only.
func (T) M1()        {}
func (*T) M2()       {}
func (T) m3()        {}
func (G[K]) GM()     {}
func (*G[K]) GP()    {}
func (b) BM()        {}
func (*b) BP()       {}
`,
		"m_test.go":           "package m\n\nfunc TestOnly() {}\n",
		"m_ext_test.go":       "package m_test\n\nvar External = 1\n",
		"other.go":            "//go:build nosuchtag\n\npackage m\n\nfunc Tagged() {}\n",
		"sub/sub.go":          "package sub\n\nfunc S() {}\n",
		"sub/internal/x/x.go": "package x\n\nfunc X() {}\n",
		"internal/y/y.go":     "package y\n\nfunc Y() {}\n",
		"examples/e/e.go":     "package main\n\nfunc E() {}\n",
		"cmd/tool/main.go":    "package main\n\nfunc Main() {}\n",
		"sub/testdata/t.go":   "package t\n\nfunc T() {}\n",
		".hidden/h.go":        "package h\n\nfunc H() {}\n",
		"_skip/s.go":          "package s\n\nfunc S() {}\n",
		"nested/go.mod":       "module example.com/n\n\ngo 1.26\n",
		"nested/n.go":         "package n\n\nfunc N() {}\n",
		"empty/README.md":     "no Go here\n",
		"testsonly/x_test.go": "package testsonly\n\nfunc X() {}\n",
	})
	pkgs, err := apisurface.Count(root)
	require.NoError(t, err)
	assert.Equal(t, []apisurface.Package{
		{Dir: ".", Name: "m", Exports: []string{"A", "C1", "C2", "F", "G", "G.GM", "G.GP", "I", "T", "T.M1", "T.M2", "V"}},
		{Dir: "sub", Name: "sub", Exports: []string{"S"}},
	}, pkgs)
	assert.Equal(t, 13, apisurface.Total(pkgs))
}

func TestCountParseError(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	writeFiles(t, root, map[string]string{"go.mod": "module example.com/m\n", "bad.go": "package m\n\nfunc {\n"})
	pkgs, err := apisurface.Count(root)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "bad.go")
	assert.Nil(t, pkgs)
}
