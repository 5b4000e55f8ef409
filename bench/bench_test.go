package bench

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/tetherproxy/tether/loadgen"
	"github.com/tetherproxy/tether/sim/workload"
)

func TestChurnPhase(t *testing.T) {
	ms := time.Millisecond
	rec := func(conv string, turn int, start, lat time.Duration, out loadgen.Outcome, inst string, id workload.IdentityKind) loadgen.Record {
		return loadgen.Record{Conversation: conv, Turn: turn, Start: start, Latency: lat, Outcome: out, Instance: inst,
			Identity: id, PromptTokens: 100, CachedTokens: 50}
	}
	sess, anon := workload.IdentitySession, workload.IdentityAnonymous
	recs := []loadgen.Record{
		rec("a", 0, 0, 10*ms, loadgen.OK, "i1", sess),
		rec("a", 1, 90*ms, 20*ms, loadgen.OK, "i2", sess), // ends at 110: phase 2, moved
		rec("b", 0, 0, 10*ms, loadgen.OK, "i1", anon),
		rec("b", 1, 120*ms, 10*ms, loadgen.OK, "i3", anon),     // anonymous: not counted as moved
		rec("c", 0, 105*ms, 10*ms, loadgen.Failed, "", sess),   // failed in phase 2
		rec("d", 0, 130*ms, 0, loadgen.Dropped, "", sess),      // the load generator's: left out
		rec("e", 0, 140*ms, 10*ms, loadgen.OK, "victim", sess), // answered by the victim
		rec("e", 1, 160*ms, 10*ms, loadgen.OK, "victim", sess), // kept its instance
	}
	got := churnPhase("p", "two", "victim", recs, 100*ms, 200*ms)
	want := ChurnRow{Policy: "p", Phase: "two", Requests: 5, Failed: 1, Moved: 1, FollowUps: 2, VictimServed: 2, HitRate: 0.5}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Error(diff)
	}
	if first := churnPhase("p", "one", "victim", recs, 0, 100*ms); first.Requests != 2 || first.FollowUps != 0 {
		t.Errorf("phase one: %+v", first)
	}
}

func TestPercentileNearestRank(t *testing.T) {
	var d []time.Duration
	for i := 1; i <= 160; i++ {
		d = append(d, time.Duration(i))
	}
	for _, tc := range []struct {
		q    float64
		want time.Duration
	}{{0.5, 80}, {0.99, 159}, {1, 160}, {0.001, 1}} {
		if got := percentile(d, tc.q); got != tc.want {
			t.Errorf("p%v = %v, want %v", tc.q, got, tc.want)
		}
	}
	if percentile(nil, 0.5) != 0 {
		t.Error("empty input")
	}
}

func TestWriteInto(t *testing.T) {
	dir := t.TempDir()
	section := MarkerStart + "\nnew\n" + MarkerEnd + "\n"
	for _, tc := range []struct{ name, before, want string }{
		{"absent file", "", "\n\n" + section},
		{"no section yet", "# B\n\nkeep\n", "# B\n\nkeep\n\n" + section},
		{"section in the middle", "head\n" + MarkerStart + "\nold\n" + MarkerEnd + "\ntail\n", "head\n" + section + "tail\n"},
		{"file ends at the marker", "head\n" + MarkerStart + "\nold\n" + MarkerEnd, "head\n" + section},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "-"))
			if tc.before != "" {
				if err := os.WriteFile(p, []byte(tc.before), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			if err := WriteInto(p, section); err != nil {
				t.Fatal(err)
			}
			got, _ := os.ReadFile(p)
			if diff := cmp.Diff(tc.want, string(got)); diff != "" {
				t.Error(diff)
			}
		})
	}
}

func TestMarkdownHasEveryTable(t *testing.T) {
	r := &Report{Started: time.Unix(0, 0), Scale: Smoke,
		Overhead: []OverheadRow{{Name: "Envoy alone", P50: time.Millisecond, Throughput: 100}, {Name: "tether sticky", P50: 2 * time.Millisecond, Throughput: 50, TetherCPUPerRequest: 300 * time.Microsecond}},
		Quality:  []QualityRow{{Policy: "tether sticky", HitRate: 0.5}},
		Churn:    []ChurnRow{{Policy: "tether sticky", Phase: "steady"}},
	}
	md := r.Markdown(Meta{Command: "cmd", Commit: "abc", Machine: "m"}, []string{"docs/bench/x.png"})
	for _, want := range []string{MarkerStart, MarkerEnd, "### Overhead", "| tether sticky | 2.0 ms", "0.50 | 300 µs", "### Routing quality", "50.0%", "### Churn", "![x](docs/bench/x.png)", "commit abc"} {
		if !strings.Contains(md, want) {
			t.Errorf("markdown lacks %q", want)
		}
	}
}
