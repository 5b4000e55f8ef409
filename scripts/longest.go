//go:build ignore

// Longest lists the product's longest functions and fails when one is too
// long or too deeply nested. `make lint` runs it through scripts/longest.sh.
//
// The product is the root module's Go files: not the lab or the e2e tests
// (modules of their own), not tests, not generated code. A function's
// length is the lines between its braces, as golangci-lint's revive counts
// them. Its depth is how far its deepest statement is nested in blocks that
// control flow opens: an if's or else's body, a for's or range's, a case's.
// An else-if is one level, not two. A function literal starts at depth 0
// and its lines count towards the function that holds it.
package main

import (
	"flag"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

type function struct {
	name  string
	where string
	lines int
	depth int
}

func main() {
	top := flag.Int("top", 15, "how many of the longest functions to print")
	maxLines := flag.Int("max-lines", 100, "fail when a function is longer")
	maxDepth := flag.Int("max-depth", 4, "fail when a function is nested deeper")
	flag.Parse()

	found, err := collect(".")
	if err != nil {
		fmt.Fprintln(os.Stderr, "longest:", err)
		os.Exit(2)
	}
	sort.Slice(found, func(i, j int) bool {
		if found[i].lines != found[j].lines {
			return found[i].lines > found[j].lines
		}
		return found[i].where < found[j].where
	})
	fmt.Printf("%5s %5s  %s\n", "lines", "depth", "function")
	for i, f := range found {
		if i == *top {
			break
		}
		fmt.Printf("%5d %5d  %s (%s)\n", f.lines, f.depth, f.name, f.where)
	}

	failed := false
	for _, f := range found {
		if f.lines > *maxLines {
			fmt.Fprintf(os.Stderr, "longest: %s (%s) is %d lines; the limit is %d\n", f.name, f.where, f.lines, *maxLines)
			failed = true
		}
		if f.depth > *maxDepth {
			fmt.Fprintf(os.Stderr, "longest: %s (%s) is nested %d deep; the limit is %d\n", f.name, f.where, f.depth, *maxDepth)
			failed = true
		}
	}
	if failed {
		os.Exit(1)
	}
}

// collect parses the product's Go files under root.
func collect(root string) ([]function, error) {
	var found []function
	fset := token.NewFileSet()
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if path != root && skipDir(path) {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		file, err := parser.ParseFile(fset, path, nil, parser.ParseComments)
		if err != nil {
			return err
		}
		if ast.IsGenerated(file) || ignored(file) {
			return nil
		}
		for _, decl := range file.Decls {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok || fn.Body == nil {
				continue
			}
			pos := fset.Position(fn.Pos())
			found = append(found, function{
				name:  name(fn),
				where: fmt.Sprintf("%s:%d", pos.Filename, pos.Line),
				lines: fset.Position(fn.Body.End()).Line - fset.Position(fn.Body.Pos()).Line - 1,
				depth: depth(fn.Body),
			})
		}
		return nil
	})
	return found, err
}

// skipDir leaves out the other modules, hidden directories and testdata.
func skipDir(path string) bool {
	base := filepath.Base(path)
	if strings.HasPrefix(base, ".") || base == "testdata" || base == "scripts" {
		return true
	}
	_, err := os.Stat(filepath.Join(path, "go.mod"))
	return err == nil
}

// ignored reports a file built by no build of the product (a go:build
// ignore file like this one).
func ignored(file *ast.File) bool {
	for _, group := range file.Comments {
		if group.Pos() > file.Package {
			break
		}
		for _, c := range group.List {
			if strings.HasPrefix(c.Text, "//go:build") && strings.Contains(c.Text, "ignore") {
				return true
			}
		}
	}
	return false
}

func name(fn *ast.FuncDecl) string {
	if fn.Recv == nil || len(fn.Recv.List) == 0 {
		return fn.Name.Name
	}
	t := fn.Recv.List[0].Type
	if star, ok := t.(*ast.StarExpr); ok {
		t = star.X
	}
	if index, ok := t.(*ast.IndexExpr); ok {
		t = index.X
	}
	if index, ok := t.(*ast.IndexListExpr); ok {
		t = index.X
	}
	if id, ok := t.(*ast.Ident); ok {
		return id.Name + "." + fn.Name.Name
	}
	return fn.Name.Name
}

// depth is the deepest nesting of control flow in a function's body.
func depth(body *ast.BlockStmt) int {
	deepest := 0
	var walk func(n ast.Node, level int)
	walk = func(n ast.Node, level int) {
		if level > deepest {
			deepest = level
		}
		ast.Inspect(n, func(c ast.Node) bool {
			if c == n {
				return true
			}
			switch s := c.(type) {
			case *ast.FuncLit:
				walk(s.Body, 0)
				return false
			case *ast.IfStmt:
				walkIf(s, level, walk)
				return false
			case *ast.ForStmt:
				walk(s.Body, level+1)
				return false
			case *ast.RangeStmt:
				walk(s.Body, level+1)
				return false
			case *ast.CaseClause:
				walk(&ast.BlockStmt{List: s.Body}, level+1)
				return false
			case *ast.CommClause:
				walk(&ast.BlockStmt{List: s.Body}, level+1)
				return false
			}
			return true
		})
	}
	walk(body, 0)
	return deepest
}

// walkIf walks an if, its else-ifs and its else at one level.
func walkIf(s *ast.IfStmt, level int, walk func(ast.Node, int)) {
	for {
		walk(s.Body, level+1)
		switch e := s.Else.(type) {
		case *ast.IfStmt:
			s = e
			continue
		case *ast.BlockStmt:
			walk(e, level+1)
		}
		return
	}
}
