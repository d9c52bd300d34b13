// Command skipcheck reads `go test -json` output on standard input, prints a short report and
// fails when a test failed, a test skipped without being named in the allowlist, an allowlist
// entry did not skip, or a test named with -require did not pass. Usage:
//
//	go test -json ./... | go run ./internal/skipcheck/cmd/skipcheck [-require LIST] ALLOWLIST
//
// It exits 1 on any such finding, 2 on a usage or read error. The list format is in the skipcheck
// package documentation; /dev/null is an empty list.
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/enginepick/enginepick/internal/skipcheck"
)

func main() {
	os.Exit(run(os.Args[1:]))
}

func run(args []string) int {
	fs := flag.NewFlagSet("skipcheck", flag.ContinueOnError)
	requireFile := fs.String("require", "", "file listing tests that must pass")
	if err := fs.Parse(args); err != nil || fs.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: go test -json ./... | skipcheck [-require LIST] ALLOWLIST")
		return 2
	}
	allow, err := readList(fs.Arg(0))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	var require []skipcheck.Test
	if *requireFile != "" {
		if require, err = readList(*requireFile); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
	}
	res, err := skipcheck.Check(os.Stdin, os.Stdout, allow, require)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	if !res.OK() {
		fmt.Fprintln(os.Stderr, "skipcheck: failed tests, skips outside the allowlist, stale entries or missing required tests (see above)")
		return 1
	}
	return 0
}

func readList(path string) ([]skipcheck.Test, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	list, err := skipcheck.ParseList(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return list, nil
}
