package main

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/tetherproxy/tether/internal/syncbuf"
	"github.com/tetherproxy/tether/lab/bench"
)

// TestBenchFloorServes runs `bench floor` as the bench starts it: it logs
// the ready line the bench reads, with both addresses, answers GET
// /requests on its admin address, and stops when its context ends (as on
// SIGTERM) without an error.
func TestBenchFloorServes(t *testing.T) {
	root := newRootCmd()
	var out syncbuf.Buffer
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetArgs([]string{"bench", "floor", "--cluster", "inst-a", "--cluster", "inst-b"})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- root.ExecuteContext(ctx) }()

	var ready struct{ Message, Extproc, Admin string }
	for deadline := time.Now().Add(10 * time.Second); ready.Message != bench.FloorReadyMessage; {
		if time.Now().After(deadline) {
			t.Fatalf("no ready line in 10s:\n%s", out.String())
		}
		time.Sleep(10 * time.Millisecond)
		line, _, _ := strings.Cut(out.String(), "\n")
		_ = json.Unmarshal([]byte(line), &ready)
	}
	if !strings.HasPrefix(ready.Extproc, "127.0.0.1:") || !strings.HasPrefix(ready.Admin, "127.0.0.1:") {
		t.Errorf("ready line %+v: want both addresses on loopback", ready)
	}
	resp, err := http.Get("http://" + ready.Admin + "/requests")
	if err != nil {
		t.Fatal(err)
	}
	var c bench.FloorCount
	err = json.NewDecoder(resp.Body).Decode(&c)
	resp.Body.Close()
	if err != nil || c.Requests != 0 {
		t.Errorf("GET /requests: %+v, %v; want 0 requests", c, err)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("stopped with %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("did not stop")
	}
}

func TestBenchFloorWantsAClusterAndLoopback(t *testing.T) {
	for _, args := range [][]string{
		{"bench", "floor"},
		{"bench", "floor", "--cluster", "inst-a", "--listen", "0.0.0.0:0"},
	} {
		if _, err := runLab(t, args...); err == nil {
			t.Errorf("%q served", args)
		}
	}
}
