package bench

import (
	"context"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/tetherproxy/tether/lab/simulator"
)

func TestChurnPhasesOf(t *testing.T) {
	series := []simulator.Minute{
		{OK: 9, Lost: 1, PromptTokens: 100, CachedTokens: 50},
		{OK: 5, PromptTokens: 100, CachedTokens: 20},
		{OK: 5},
		{OK: 4, PromptTokens: 100, CachedTokens: 60},
		{OK: 1, Lost: 2, PromptTokens: 100, CachedTokens: 0}, // the drain: with the last phase
	}
	want := []Sim{
		{Ran: true, Requests: 10, HitRate: 0.5},
		{Ran: true, Requests: 5, HitRate: 0.2},
		{Ran: true, Requests: 5},
		{Ran: true, Requests: 7, HitRate: 0.3},
	}
	if diff := cmp.Diff(want, churnPhasesOf(series, 4)); diff != "" {
		t.Error(diff)
	}
}

func TestCrossCheck(t *testing.T) {
	sims := []Sim{{Ran: true, HitRate: 0.40}, {}, {Ran: true, HitRate: 0.50}}
	for _, tc := range []struct {
		name  string
		bench []float64
		want  CrossCheck
		says  string
	}{
		{"within", []float64{0.42, 0.9, 0.49}, CrossCheck{Rows: 2, Widest: 2, Within: true}, "Every phase is within 3 points of the simulator's hit rate (the widest gap +2.0 points)"},
		{"on the bound", []float64{0.43, 0.9, 0.50}, CrossCheck{Rows: 2, Widest: 3, Within: true}, "within 3 points"},
		{"beyond", []float64{0.41, 0.9, 0.45}, CrossCheck{Rows: 2, Widest: -5, Within: false}, "Not every phase is within 3 points of the simulator's hit rate: the widest gap is -5.0 points"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := crossCheck(tc.bench, sims)
			if diff := cmp.Diff(tc.want, got, cmp.Comparer(func(a, b float64) bool { return a-b < 1e-9 && b-a < 1e-9 })); diff != "" {
				t.Error(diff)
			}
			if v := got.verdict("phase"); !strings.Contains(v, tc.says) {
				t.Errorf("verdict %q, want %q in it", v, tc.says)
			}
		})
	}
	if v := crossCheck(nil, nil).verdict("phase"); v != "" {
		t.Errorf("no simulated row: verdict %q, want none", v)
	}
}

// The simulator's side of the churn at smoke scale: each policy's four
// phases get figures, the ninth instance's phase has requests, a policy
// the simulator does not emulate gets none.
func TestCrossCheckChurnSimulates(t *testing.T) {
	opts := Options{Scale: Smoke, Seed: 1}
	var rows []ChurnRow
	for _, p := range []string{policyRingHash.name, policySticky.name, "tether something else"} {
		for _, ph := range []string{"steady", "instance killed", "instance restored", "instance added"} {
			rows = append(rows, ChurnRow{Policy: p, Phase: ph, HitRate: 0.5})
		}
	}
	if err := crossCheckChurn(context.Background(), opts, rows); err != nil {
		t.Fatal(err)
	}
	for i, r := range rows {
		simulated := i < 8
		if r.Sim.Ran != simulated || simulated && r.Sim.Requests == 0 {
			t.Errorf("%s, %s: %+v", r.Policy, r.Phase, r.Sim)
		}
	}
	// The same schedule, run again, gives the same figures: the
	// simulation is deterministic, so a bench report's columns are too.
	again := append([]ChurnRow(nil), rows...)
	if err := crossCheckChurn(context.Background(), opts, again); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(rows, again); diff != "" {
		t.Error(diff)
	}
	if c := (&Report{Churn: rows}).ChurnCrossCheck(); c.Rows != 8 {
		t.Errorf("cross-check over %d rows, want 8", c.Rows)
	}
}
