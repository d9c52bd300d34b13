package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestRunExitStatus(t *testing.T) {
	good := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(good, "docs"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(good, "docs", "a.md"), []byte("# A\n\n## 1. One\n"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(good, "README.md"), []byte("See docs/a.md §1.\n"), 0o644))
	assert.Equal(t, 0, run([]string{good}))

	bad := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(bad, "README.md"), []byte("See docs/missing.md.\n"), 0o644))
	assert.Equal(t, 1, run([]string{bad}))

	assert.Equal(t, 2, run([]string{good, bad}), "two arguments")
	assert.Equal(t, 2, run([]string{filepath.Join(bad, "nope")}), "unreadable root")
}
