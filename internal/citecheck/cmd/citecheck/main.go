// Command citecheck fails when a .go or .md file of the repository cites a path or a section that
// does not exist in it, names an upstream file without its repository, or cites a document outside
// the repository. Usage:
//
//	go run ./internal/citecheck/cmd/citecheck [repository root, default .]
//
// It prints one file:line line per finding and exits 1 when there is any, 2 on a usage or read
// error. The rules are in the citecheck package documentation.
package main

import (
	"fmt"
	"os"

	"github.com/enginepick/enginepick/internal/citecheck"
)

func main() {
	os.Exit(run(os.Args[1:]))
}

func run(args []string) int {
	root := "."
	switch len(args) {
	case 0:
	case 1:
		root = args[0]
	default:
		fmt.Fprintln(os.Stderr, "usage: citecheck [repository root]")
		return 2
	}
	findings, err := citecheck.Check(os.DirFS(root))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	for _, f := range findings {
		fmt.Println(f)
	}
	if len(findings) > 0 {
		fmt.Fprintf(os.Stderr, "citecheck: %d citation(s) do not resolve\n", len(findings))
		return 1
	}
	return 0
}
