package file

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tetherproxy/tether/audit"
	"github.com/tetherproxy/tether/audit/audittest"
)

// rec is the i-th record of a test.
func rec(i int) audit.Record {
	return audit.Record{RequestID: fmt.Sprintf("req-%d", i), Decision: "hit"}
}

func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		if e.Name() != lockName {
			out = append(out, e.Name())
		}
	}
	return out
}

// TestFileSinkForgetFromAnotherProcess: `tether audit forget` rewrites the
// files while the serving tether appends to them; the server's later
// records go to the new file, not to the unlinked old one.
func TestFileSinkForgetFromAnotherProcess(t *testing.T) {
	ctx := context.Background()
	sealer := audittest.Sealer(t)
	dir := t.TempDir()
	server := newFileSinkT(t, Config{Dir: dir, Retention: audit.MaxRetention})
	cli := newFileSinkT(t, Config{Dir: dir, Retention: audit.MaxRetention})
	write := func(users ...string) {
		t.Helper()
		for _, u := range users {
			r := audit.Record{RequestID: audit.NewRequestID(), DecisionTime: time.Now().UTC(), Decision: "bind"}
			sealer.Attach(&r, u)
			if err := server.Write(ctx, []audit.Record{r}); err != nil {
				t.Fatal(err)
			}
		}
	}
	write("alice", "bob")
	if n, err := cli.Delete(ctx, sealer.Pseudonym("alice")); err != nil || n != 1 {
		t.Fatalf("forget alice: %d, %v", n, err)
	}
	write("bob", "carol")
	for user, want := range map[string]int{"alice": 0, "bob": 2, "carol": 1} {
		got, err := cli.Export(ctx, sealer.Pseudonym(user))
		if err != nil || len(got) != want {
			t.Errorf("%s: %d records (%v), want %d", user, len(got), err, want)
		}
	}
}

func newFileSinkT(t *testing.T, cfg Config) *Sink {
	t.Helper()
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func TestFileSinkRetentionRefused(t *testing.T) {
	for _, d := range []time.Duration{0, -time.Hour, time.Hour, 31 * 24 * time.Hour, audit.MaxRetention + time.Second} {
		if _, err := New(Config{Dir: t.TempDir(), Retention: d}); err == nil {
			t.Errorf("retention %v accepted", d)
		}
	}
	if err := audit.CheckRetention(31 * 24 * time.Hour); err == nil || !strings.Contains(err.Error(), "30 days") {
		t.Errorf("CheckRetention(31 days) = %v", err)
	}
	if err := audit.CheckRetention(audit.MaxRetention); err != nil {
		t.Errorf("CheckRetention(30 days) = %v", err)
	}
}

func TestFileSinkRotationAndRetention(t *testing.T) {
	ctx := context.Background()
	dir := filepath.Join(t.TempDir(), "audit")
	clk := audittest.NewClock(time.Date(2026, 3, 1, 23, 0, 0, 0, time.UTC))
	s := newFileSinkT(t, Config{Dir: dir, Retention: 2 * 24 * time.Hour, Now: clk.Now})
	if fi, err := os.Stat(dir); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("dir: %v %v", fi, err)
	}
	write := func(i int) {
		t.Helper()
		if err := s.Write(ctx, []audit.Record{rec(i)}); err != nil {
			t.Fatal(err)
		}
	}
	write(1)
	clk.Add(2 * time.Hour) // 2 March 01:00: a new file
	write(2)
	want := []string{"audit-2026-03-01.jsonl", "audit-2026-03-02.jsonl"}
	if got := dirNames(t, dir); !slices.Equal(got, want) {
		t.Fatalf("files %v, want %v", got, want)
	}
	for _, n := range want {
		if fi, _ := os.Stat(filepath.Join(dir, n)); fi.Mode().Perm() != 0o600 {
			t.Fatalf("%s mode %v, want 0600", n, fi.Mode().Perm())
		}
	}
	clk.Add(22 * time.Hour) // 2 March 23:00: 1 March began 47 h ago, kept
	write(3)
	if got := dirNames(t, dir); !slices.Equal(got, want) {
		t.Fatalf("files %v, want %v", got, want)
	}
	clk.Add(2 * time.Hour) // 3 March 01:00: rotation removes 1 March (49 h)
	write(4)
	want = []string{"audit-2026-03-02.jsonl", "audit-2026-03-03.jsonl"}
	if got := dirNames(t, dir); !slices.Equal(got, want) {
		t.Fatalf("after rotation: files %v, want %v", got, want)
	}
	_ = s.Close()

	// On open: an expired file (and a stray temporary file) are removed.
	clk.Add(47 * time.Hour) // 5 March 00:00: 3 March began 48 h ago
	if err := os.WriteFile(filepath.Join(dir, ".audit-123.tmp"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	s2 := newFileSinkT(t, Config{Dir: dir, Retention: 2 * 24 * time.Hour, Now: clk.Now})
	if got := dirNames(t, dir); len(got) != 0 {
		t.Fatalf("after open: files %v, want none", got)
	}
	// Prune, as the Writer calls it on an idle sink.
	if err := s2.Write(ctx, []audit.Record{rec(5)}); err != nil {
		t.Fatal(err)
	}
	clk.Add(48 * time.Hour)
	if err := s2.Prune(ctx); err != nil {
		t.Fatal(err)
	}
	if got := dirNames(t, dir); len(got) != 0 {
		t.Fatalf("after prune: files %v, want none", got)
	}
}

func TestFileSinkDeleteExport(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	clk := audittest.NewClock(time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC))
	s := newFileSinkT(t, Config{Dir: dir, Retention: 7 * 24 * time.Hour, Now: clk.Now})
	sealer := audittest.Sealer(t)
	mk := func(i int, user string) audit.Record {
		r := rec(i)
		r.DecisionTime = clk.Now()
		sealer.Attach(&r, user)
		return r
	}
	if err := s.Write(ctx, []audit.Record{mk(1, "alice"), mk(2, "bob"), mk(3, "alice")}); err != nil {
		t.Fatal(err)
	}
	clk.Add(24 * time.Hour)
	if err := s.Write(ctx, []audit.Record{mk(4, "alice"), mk(5, "")}); err != nil {
		t.Fatal(err)
	}
	alice := sealer.Pseudonym("alice")
	got, err := s.Export(ctx, alice)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, r := range got {
		u, err := sealer.UserID(r)
		if err != nil || u != "alice" {
			t.Fatalf("export %s: %q, %v", r.RequestID, u, err)
		}
		ids = append(ids, r.RequestID)
	}
	if !slices.Equal(ids, []string{"req-1", "req-3", "req-4"}) {
		t.Fatalf("export ids %v", ids)
	}
	n, err := s.Delete(ctx, alice)
	if err != nil || n != 3 {
		t.Fatalf("Delete = %d, %v; want 3", n, err)
	}
	if got, _ := s.Export(ctx, alice); len(got) != 0 {
		t.Fatalf("after delete, export has %d", len(got))
	}
	if got, _ := s.Export(ctx, sealer.Pseudonym("bob")); len(got) != 1 {
		t.Fatalf("bob's records: %d, want 1", len(got))
	}
	// Writes go on, to the renamed file; permissions stay 0600.
	if err := s.Write(ctx, []audit.Record{mk(6, "carol")}); err != nil {
		t.Fatal(err)
	}
	for _, n := range dirNames(t, dir) {
		fi, _ := os.Stat(filepath.Join(dir, n))
		if fi.Mode().Perm() != 0o600 || strings.HasSuffix(n, ".tmp") {
			t.Fatalf("%s mode %v", n, fi.Mode().Perm())
		}
	}
	b, _ := os.ReadFile(filepath.Join(dir, "audit-2026-03-02.jsonl"))
	if lines := strings.Count(string(b), "\n"); lines != 2 {
		t.Fatalf("today's file has %d lines, want 2:\n%s", lines, b)
	}
}
