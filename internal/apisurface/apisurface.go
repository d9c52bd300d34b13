// Package apisurface counts the exported identifiers of a module's public packages: the size of
// the API a user can reach.
//
// The rule, per package (the non-test .go files that build for the current GOOS and GOARCH):
//
//   - every exported package-level type, function, constant and variable counts once (each name of
//     a grouped or multi-name declaration is one identifier);
//   - every exported method whose receiver's base type is an exported type of the package counts
//     once; methods of unexported types do not count, even when an exported function returns such
//     a type or an exported type embeds it;
//   - struct fields and interface methods do not count (they belong to their type).
//
// Packages under internal/ or examples/, testdata directories, directories whose name starts with
// '.' or '_', and nested modules are not public and are not visited. Package main is not counted.
package apisurface

import (
	"go/ast"
	"go/build"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// Package is the count of one package.
type Package struct {
	Dir     string   // slash-separated, relative to the module root; "." for the root package
	Name    string   // package name
	Exports []string // the counted identifiers, methods as Type.Method, sorted
}

// Count walks the module rooted at dir and returns the public packages in Dir order with their
// exported identifiers. It returns an error when a directory cannot be read or a file does not
// parse.
func Count(dir string) ([]Package, error) {
	var out []Package
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() {
			return nil
		}
		rel, err := filepath.Rel(dir, path)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		if rel != "." {
			name := d.Name()
			if strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_") || name == "testdata" ||
				rel == "internal" || rel == "examples" || strings.HasSuffix(rel, "/internal") {
				return filepath.SkipDir
			}
			if _, err := os.Stat(filepath.Join(path, "go.mod")); err == nil {
				return filepath.SkipDir // a nested module
			}
		}
		p, err := countDir(path)
		if err != nil || p == nil {
			return err
		}
		p.Dir = rel
		out = append(out, *p)
		return nil
	})
	return out, err
}

// countDir counts the package in one directory; nil when it holds no public package.
func countDir(dir string) (*Package, error) {
	ctx := build.Default
	ctx.CgoEnabled = false
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	fset := token.NewFileSet()
	var files []*ast.File
	for _, e := range entries {
		name := e.Name()
		if e.IsDir() || !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
			continue
		}
		if ok, err := ctx.MatchFile(dir, name); err != nil {
			return nil, err
		} else if !ok {
			continue
		}
		f, err := parser.ParseFile(fset, filepath.Join(dir, name), nil, parser.SkipObjectResolution)
		if err != nil {
			return nil, err
		}
		files = append(files, f)
	}
	if len(files) == 0 || files[0].Name.Name == "main" {
		return nil, nil
	}
	exportedTypes := map[string]bool{}
	for _, f := range files {
		for _, decl := range f.Decls {
			if g, ok := decl.(*ast.GenDecl); ok && g.Tok == token.TYPE {
				for _, s := range g.Specs {
					if n := s.(*ast.TypeSpec).Name; n.IsExported() {
						exportedTypes[n.Name] = true
					}
				}
			}
		}
	}
	p := &Package{Name: files[0].Name.Name}
	for _, f := range files {
		for _, decl := range f.Decls {
			switch d := decl.(type) {
			case *ast.FuncDecl:
				if !d.Name.IsExported() {
					continue
				}
				if d.Recv == nil {
					p.Exports = append(p.Exports, d.Name.Name)
				} else if recv := receiverType(d.Recv.List[0].Type); exportedTypes[recv] {
					p.Exports = append(p.Exports, recv+"."+d.Name.Name)
				}
			case *ast.GenDecl:
				for _, s := range d.Specs {
					switch s := s.(type) {
					case *ast.TypeSpec:
						if s.Name.IsExported() {
							p.Exports = append(p.Exports, s.Name.Name)
						}
					case *ast.ValueSpec:
						for _, n := range s.Names {
							if n.IsExported() {
								p.Exports = append(p.Exports, n.Name)
							}
						}
					}
				}
			}
		}
	}
	slices.Sort(p.Exports)
	return p, nil
}

// receiverType returns the base type name of a method receiver: T for T, *T, T[K] and *T[K].
func receiverType(e ast.Expr) string {
	for {
		switch t := e.(type) {
		case *ast.StarExpr:
			e = t.X
		case *ast.IndexExpr:
			e = t.X
		case *ast.IndexListExpr:
			e = t.X
		case *ast.ParenExpr:
			e = t.X
		case *ast.Ident:
			return t.Name
		default:
			return ""
		}
	}
}

// Total is the number of identifiers over pkgs.
func Total(pkgs []Package) int {
	n := 0
	for _, p := range pkgs {
		n += len(p.Exports)
	}
	return n
}
