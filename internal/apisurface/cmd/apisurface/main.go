// Command apisurface prints the number of exported identifiers of each public package of the
// module and the total, by the rule of package apisurface. Usage:
//
//	go run ./internal/apisurface/cmd/apisurface [-v] [module root, default .]
//
// -v lists the identifiers. It exits 2 on a usage, read or parse error.
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/enginepick/enginepick/internal/apisurface"
)

func main() {
	os.Exit(run(os.Args[1:]))
}

func run(args []string) int {
	fs := flag.NewFlagSet("apisurface", flag.ContinueOnError)
	verbose := fs.Bool("v", false, "list the identifiers of each package")
	if err := fs.Parse(args); err != nil || fs.NArg() > 1 {
		fmt.Fprintln(os.Stderr, "usage: apisurface [-v] [module root]")
		return 2
	}
	root := "."
	if fs.NArg() == 1 {
		root = fs.Arg(0)
	}
	pkgs, err := apisurface.Count(root)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	for _, p := range pkgs {
		fmt.Printf("%5d  %s\n", len(p.Exports), p.Dir)
		if *verbose {
			for _, id := range p.Exports {
				fmt.Printf("       %s\n", id)
			}
		}
	}
	fmt.Printf("%5d  total\n", apisurface.Total(pkgs))
	return 0
}
