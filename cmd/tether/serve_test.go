package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestCPUProfile: --cpuprofile writes a profile at stop, and a path it
// cannot create is an error naming the flag, before anything starts.
func TestCPUProfile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "cpu.pprof")
	stop, err := startCPUProfile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Size() == 0 {
		t.Fatalf("profile %s: %v, %v", path, fi, err)
	}
	if _, err := startCPUProfile(filepath.Join(t.TempDir(), "missing", "cpu.pprof")); err == nil || !strings.Contains(err.Error(), "--cpuprofile") {
		t.Fatalf("a path in a missing directory: %v, want an error naming --cpuprofile", err)
	}
}
