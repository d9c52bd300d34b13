package citecheck_test

import (
	"os"
	"strings"
	"testing"
	"testing/fstest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/internal/citecheck"
)

// The forms the checker must reject, assembled at run time so that this file itself cites
// nothing outside the repository.
var (
	corpusNote   = slash("research", "sgl-router.md")
	corpusSeed   = slash("seeds", "POLICY_DESIGN.md")
	corpusArch   = "ARCHITECTURE" + ".md"
	corpusStyle  = "STYLE" + ".md"
	corpusTraces = slash("traces", "README.md")
	outsideRel   = slash("..", "..", "elsewhere", "traces", "azure.csv")
	outsideAbs   = "/" + slash("work", "elsewhere", "x.md")
)

func slash(parts ...string) string { return strings.Join(parts, "/") }

// repo is a small repository: a design document with numbered sections, a package, a data
// directory.
func repo(extra map[string]string) fstest.MapFS {
	fsys := fstest.MapFS{
		"docs/design.md":  {Data: []byte("# Design\n\n## 1. Flow\n\n## 9. Cache\n\n### 9.3 Queue gate\n\nSee §9.3 and §1.\n")},
		"docs/notes.md":   {Data: []byte("# Notes\n\nNo numbered sections.\n")},
		"kvindex/hash.go": {Data: []byte("package kvindex\n")},
		"sim/traces/a.gz": {Data: []byte("x")},
		"README.md":       {Data: []byte("# r\n")},
	}
	for name, text := range extra {
		fsys[name] = &fstest.MapFile{Data: []byte(text)}
	}
	return fsys
}

func TestCheck(t *testing.T) {
	tests := []struct {
		name string
		file string
		text string
		want []citecheck.Finding // nil: the file cites nothing that fails
	}{
		{
			name: "existing paths, directories and sections resolve",
			file: "policy/p.go",
			text: "package policy\n\n// See docs/design.md §9.3, `docs/notes.md`, sim/traces and kvindex/hash.go.\n// Also (docs/design.md §1 and §9).\nvar X = 1\n",
		},
		{
			name: "bad path in a doc comment fails with file and line",
			file: "policy/p.go",
			text: "package policy\n\n// X follows docs/missing.md.\nvar X = 1\n",
			want: []citecheck.Finding{{File: "policy/p.go", Line: 3, Cite: "docs/missing.md", Reason: citecheck.ReasonMissing}},
		},
		{
			name: "bad path in Markdown fails",
			file: "docs/guide.md",
			text: "# Guide\n\nRead\n`kvindex/index.go` first.\n",
			want: []citecheck.Finding{{File: "docs/guide.md", Line: 4, Cite: "kvindex/index.go", Reason: citecheck.ReasonMissing}},
		},
		{
			name: "missing directory under a top-level directory fails",
			file: "README.md",
			text: "# R\n\nThe traces are in sim/tracez/.\n",
			want: []citecheck.Finding{{File: "README.md", Line: 3, Cite: "sim/tracez", Reason: citecheck.ReasonMissing}},
		},
		{
			name: "missing section fails, existing one passes",
			file: "policy/p.go",
			text: "package policy\n\n// Rules: docs/design.md §9.3 and §9.11.\nvar X = 1\n",
			want: []citecheck.Finding{{File: "policy/p.go", Line: 3, Cite: "docs/design.md §9.11", Reason: citecheck.ReasonSection}},
		},
		{
			name: "section of a backticked path",
			file: "docs/guide.md",
			text: "See `docs/design.md` §2.\n",
			want: []citecheck.Finding{{File: "docs/guide.md", Line: 1, Cite: "docs/design.md §2", Reason: citecheck.ReasonSection}},
		},
		{
			name: "bare section in a numbered document refers to itself",
			file: "docs/other.md",
			text: "# Other\n\n## 1. One\n\nSee §1 and §4.\n",
			want: []citecheck.Finding{{File: "docs/other.md", Line: 5, Cite: "§4", Reason: citecheck.ReasonSection}},
		},
		{
			name: "bare file name resolves next to the citing file",
			file: "kvindex/doc.go",
			text: "// Package kvindex: hash.go states the function; match.go does not exist.\npackage kvindex\n",
			want: []citecheck.Finding{{File: "kvindex/doc.go", Line: 1, Cite: "match.go", Reason: citecheck.ReasonMissing}},
		},
		{
			name: "the design corpus outside the repository is rejected",
			file: "policy/p.go",
			text: "package policy\n\n// From " + corpusNote + " §1.2 and " + corpusSeed + " §4,\n// " + corpusArch + " §3, " + corpusStyle + " and " + corpusTraces + ".\nvar X = 1\n",
			want: []citecheck.Finding{
				{File: "policy/p.go", Line: 3, Cite: corpusNote, Reason: citecheck.ReasonOutside},
				{File: "policy/p.go", Line: 3, Cite: corpusSeed, Reason: citecheck.ReasonOutside},
				{File: "policy/p.go", Line: 4, Cite: corpusArch, Reason: citecheck.ReasonOutside},
				{File: "policy/p.go", Line: 4, Cite: corpusStyle, Reason: citecheck.ReasonOutside},
				{File: "policy/p.go", Line: 4, Cite: corpusTraces, Reason: citecheck.ReasonOutside},
			},
		},
		{
			name: "relative paths that leave the repository are rejected",
			file: "sim/t.go",
			text: "package sim\n\n// Reads " + outsideRel + ".\nvar X = 1\n",
			want: []citecheck.Finding{{File: "sim/t.go", Line: 3, Cite: outsideRel, Reason: citecheck.ReasonOutside}},
		},
		{
			name: "an absolute path into the work folder is rejected",
			file: "docs/guide.md",
			text: "Copied from " + outsideAbs + ".\n",
			want: []citecheck.Finding{{File: "docs/guide.md", Line: 1, Cite: outsideAbs, Reason: citecheck.ReasonOutside}},
		},
		{
			name: "upstream paths attributed to a repository are not checked",
			file: "policy/p.go",
			text: "package policy\n\n// As sgl-project/sglang\n// `experimental/sgl-router/src/policies_reorg/cache_aware.rs` and `src/a.rs`, or\n// ai-dynamo/dynamo `lib/kv-router/src/radix_tree.rs`; kvcache-ai/Mooncake `FAST25-release/README.md`.\nvar X = 1\n",
		},
		{
			name: "table rows attribute through the previous cell",
			file: "docs/refs.md",
			text: "| repository | path |\n|---|---|\n| sgl-project/sglang | `experimental/sgl-router/POLICY_DESIGN.md` |\n",
		},
		{
			name: "upstream files without their repository are rejected",
			file: "kvindex/e.go",
			text: "package kvindex\n\n// ErrX is Dynamo's ParentBlockNotFound (radix_tree.rs, lib/kv-router/src/approx.rs).\nvar ErrX = 1\n",
			want: []citecheck.Finding{
				{File: "kvindex/e.go", Line: 3, Cite: "radix_tree.rs", Reason: citecheck.ReasonUnassigned},
				{File: "kvindex/e.go", Line: 3, Cite: "lib/kv-router/src/approx.rs", Reason: citecheck.ReasonUnassigned},
			},
		},
		{
			name: "a repository path is never an attribution",
			file: "docs/guide.md",
			text: "sim/traces `docs/nothing.md`\n",
			want: []citecheck.Finding{{File: "docs/guide.md", Line: 1, Cite: "docs/nothing.md", Reason: citecheck.ReasonMissing}},
		},
		{
			name: "URLs, import paths, code and string literals are not citations",
			file: "policy/p.go",
			text: "package policy\n\n// See https://github.com/a/b/blob/main/docs/none.md and github.com/enginepick/enginepick/kvindex.\nvar X = \"docs/none.md " + slash("research", "x.md") + "\"\n",
		},
		{
			name: "general comments are scanned",
			file: "policy/p.go",
			text: "package policy\n\n/*\nSee docs/none.md.\n*/\nvar X = 1\n",
			want: []citecheck.Finding{{File: "policy/p.go", Line: 4, Cite: "docs/none.md", Reason: citecheck.ReasonMissing}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fsys := repo(map[string]string{tt.file: tt.text})
			got, err := citecheck.Check(fsys)
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
		})
	}
}

func TestCheckSkipsHiddenTestdataAndVendor(t *testing.T) {
	fsys := repo(map[string]string{
		".git/x.md":               "docs/none.md",
		"kvindex/testdata/x.md":   "docs/none.md",
		"vendor/a/b.go":           "// docs/none.md\npackage b\n",
		"docs/ok.md":              "docs/design.md §9",
		"policy/notes.txt":        "docs/none.md",
		"policy/testdata_keep.md": "docs/none.md",
	})
	got, err := citecheck.Check(fsys)
	require.NoError(t, err)
	assert.Equal(t, []citecheck.Finding{{File: "policy/testdata_keep.md", Line: 1, Cite: "docs/none.md", Reason: citecheck.ReasonMissing}}, got)
}

func TestFindingString(t *testing.T) {
	f := citecheck.Finding{File: "policy/p.go", Line: 3, Cite: "docs/x.md", Reason: citecheck.ReasonMissing}
	assert.Equal(t, "policy/p.go:3: cited path does not exist in the repository: docs/x.md", f.String())
}

// The repository itself: every citation in it resolves. CI also runs the command.
func TestRepositoryCitationsResolve(t *testing.T) {
	got, err := citecheck.Check(os.DirFS("../.."))
	require.NoError(t, err)
	for _, f := range got {
		t.Error(f)
	}
}
