package bench

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/tetherproxy/tether/config"
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

// The documents scenario is the shared-documents regime's on the bench's
// fleet, rate and duration, the same for every policy: the replay, the
// fleet's caches and the cache-aware row's [content] all come from it.
func TestDocsSimOptions(t *testing.T) {
	opts := Options{Scale: Full, Seed: 3}
	regime := simulator.SharedDocuments(simOptions(opts, simulator.Sticky))
	for name, p := range docsSimPolicies {
		o := docsSimOptions(opts, p)
		if o.Policy != p || o.Rate != Full.DocsRate || o.Duration != Full.DocsDuration || o.Instances != 8 {
			t.Errorf("%s: policy %s, rate %g, duration %v, %d instances", name, o.Policy, o.Rate, o.Duration, o.Instances)
		}
		if diff := cmp.Diff(regime.Workload, o.Workload); diff != "" {
			t.Errorf("%s: workload (-regime +documents):\n%s", name, diff)
		}
		if o.Cache != regime.Cache || o.Cache.CapacityTokens != simulator.SharedDocumentsKVTokens {
			t.Errorf("%s: cache %+v, want the regime's %+v", name, o.Cache, regime.Cache)
		}
	}
	var c config.Config
	policyCacheAware(regime).edit(&c)
	if !c.Content.Enabled || c.Content.CacheTokens != simulator.SharedDocumentsKVTokens || c.Content != simulator.CacheAwareContent(regime.Cache) {
		t.Errorf("cache-aware [content] %+v", c.Content)
	}
}

func TestDocumentsMarkdown(t *testing.T) {
	r := &Report{Started: time.Unix(0, 0), Scale: Smoke, Documents: []QualityRow{
		{Policy: "Envoy ring hash", HitRate: 0.13, Sim: Sim{Ran: true, HitRate: 0.12}},
		{Policy: "tether cache-aware", HitRate: 0.57, Sim: Sim{Ran: true, HitRate: 0.58},
			ContentResults: map[string]float64{"placed": 90, "short": 10}},
	}}
	md := r.Markdown(Meta{Command: "cmd", Commit: "abc", Machine: "m"}, nil)
	for _, want := range []string{"### Routing quality: shared documents", "caches hold 12288 tokens each", "`block_bytes = 64`",
		"| Envoy ring hash | 13.0% |", "| – | 12.0% | +1.0 |", "| 100: placed 90, short 10 | 58.0% | -1.0 |",
		"Every policy is within 3 points of the simulator's hit rate (the widest gap +1.0 points)."} {
		if !strings.Contains(md, want) {
			t.Errorf("markdown lacks %q", want)
		}
	}
}
