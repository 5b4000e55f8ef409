package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
)

// writeJSONFile writes v as indented JSON to path, or to stdout when path
// is "-" (the --json flag of loadgen and simulate).
func writeJSONFile(path string, stdout io.Writer, v any) error {
	encode := func(w io.Writer) error {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	}
	if path == "-" {
		return encode(stdout)
	}
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("--json: %w", err)
	}
	if err := encode(f); err != nil {
		_ = f.Close()
		return fmt.Errorf("--json %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("--json %s: %w", path, err)
	}
	return nil
}
