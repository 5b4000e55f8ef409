package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"

	"github.com/tetherproxy/tether/lab/simulator"
)

// regimesOf parses --regime: names, comma-separated, or all.
func regimesOf(list string) ([]simulator.Regime, error) {
	var out []simulator.Regime
	for name := range strings.SplitSeq(list, ",") {
		name = strings.TrimSpace(name)
		if strings.EqualFold(name, "all") {
			out = append(out, simulator.Regimes()...)
			continue
		}
		r, err := simulator.LookupRegime(name)
		if err != nil {
			return nil, fmt.Errorf("--regime: %w", err)
		}
		out = append(out, r)
	}
	return out, nil
}

// runRegimes runs every policy in every regime and prints one Markdown
// table per regime; with --charts, the day's minute-by-minute charts.
func runRegimes(ctx context.Context, stdout, stderr io.Writer, fl *simulateFlags, regimes []simulator.Regime, policies []simulator.Policy, base simulator.Options) error {
	started := time.Now()
	var errs []error
	for _, rg := range regimes {
		o, err := rg.Apply(base)
		if err != nil {
			return err
		}
		o.Series = fl.charts != "" && rg.Name == "day"
		for _, p := range policies {
			po := o
			po.Policy = p
			if err := po.Validate(); err != nil {
				return fmt.Errorf("regime %s: %w", rg.Name, err)
			}
		}
		results, err := simulateAll(ctx, stderr, fl, policies, o)
		if len(results) > 0 {
			if werr := writeRegimeTable(stdout, rg, results); werr != nil {
				return werr
			}
			if o.Series {
				paths, cerr := dayCharts(fl.charts, results)
				if cerr != nil {
					return fmt.Errorf("--charts: %w", cerr)
				}
				for _, p := range paths {
					fmt.Fprintf(stdout, "chart: %s\n", p)
				}
				fmt.Fprintln(stdout)
			}
		}
		if err != nil {
			errs = append(errs, err)
			break
		}
	}
	fmt.Fprintf(stdout, "%d regimes × %d policies in %s\n", len(regimes), len(policies), time.Since(started).Round(100*time.Millisecond))
	return errors.Join(errs...)
}

// regimeColumn is one regime-specific column of a table.
type regimeColumn struct {
	head string
	cell func(r *simulator.Result) string
}

func count(n int) string { return fmt.Sprint(n) }

var (
	colMoved      = regimeColumn{"sessions moved", func(r *simulator.Result) string { return count(r.Regime.Moved) }}
	colDisplaced  = regimeColumn{"sessions displaced", func(r *simulator.Result) string { return count(r.Regime.Displaced) }}
	colSwitches   = regimeColumn{"mid-conversation model switches", func(r *simulator.Result) string { return count(r.Regime.ModelSwitches) }}
	colRefused    = regimeColumn{"refused (no instance of its version)", func(r *simulator.Result) string { return count(r.Regime.Refused) }}
	colFailed     = regimeColumn{"failed with their instance", func(r *simulator.Result) string { return count(r.Regime.Failed) }}
	colLost       = regimeColumn{"requests lost", func(r *simulator.Result) string { return count(r.Regime.Lost) }}
	colQueued     = regimeColumn{"waited behind a prefill", func(r *simulator.Result) string { return pct(r.Regime.QueuedShare) }}
	colTogether   = regimeColumn{"fan-out on its turn's instance", func(r *simulator.Result) string { return pct(r.Regime.FanOutTogetherShare) }}
	colFailOpen   = regimeColumn{"carried by fail-open", func(r *simulator.Result) string { return count(r.Regime.FailOpen) }}
	colTenant     = regimeColumn{"tenant TTFT p99", func(r *simulator.Result) string { return simMs(r.Regime.BurstTTFT.P99) }}
	colOthers     = regimeColumn{"others' TTFT p99", func(r *simulator.Result) string { return simMs(r.Regime.OthersTTFT.P99) }}
	colContinuity = regimeColumn{"continuity", func(r *simulator.Result) string { return pct(r.Summary.Continuity) }}
)

// regimeColumns are the columns a regime's table adds to the common ones.
func regimeColumns(name string) []regimeColumn {
	switch name {
	case "steady", "kv-pressure", "shared-documents":
		return []regimeColumn{colQueued, colContinuity, colLost}
	case "autoscale":
		return []regimeColumn{colMoved, colDisplaced, colLost}
	case "upgrade":
		return []regimeColumn{colSwitches, colRefused, colDisplaced, colLost}
	case "failures":
		return []regimeColumn{colFailed, colDisplaced, colMoved, colLost}
	case "burst":
		return []regimeColumn{colTenant, colOthers, colLost}
	case "agents":
		return []regimeColumn{colTogether, colLost}
	case "outage":
		return []regimeColumn{colFailOpen, colMoved, colLost}
	}
	return []regimeColumn{colMoved, colDisplaced, colSwitches, colLost}
}

func pct(x float64) string { return fmt.Sprintf("%.1f%%", 100*x) }

// writeRegimeTable prints a regime's table in Markdown, with what its
// load was against the fleet's capacity.
func writeRegimeTable(w io.Writer, rg simulator.Regime, results []*simulator.Result) error {
	st := results[0].Settings
	ref := results[0]
	for _, r := range results {
		if r.Settings.Policy == simulator.Sticky {
			ref = r
		}
	}
	fmt.Fprintf(w, "### %s\n\n%s.\n\n", rg.Name, rg.What)
	fmt.Fprintf(w, "%d × %s (mean %.1f up), %.0f requests/s, %s measured after a %s warmup, think times ×%g, seed %d; ",
		st.Instances, st.Profile, ref.Regime.MeanInstances, st.Rate, st.Duration-st.Scenario.Warmup, st.Scenario.Warmup, st.ThinkScale, st.Seed)
	fmt.Fprintf(w, "under tether sticky the instances spent %.0f%% of their time prefilling and %.0f%% busy; %.0f conversations in progress",
		100*ref.PrefillLoad, 100*ref.GPUBusy, ref.Regime.ActiveConversations)
	if ref.Regime.KVConversations > 0 {
		fmt.Fprintf(w, " for %.0f the KV caches keep (%d each): %.2f×", ref.Regime.KVConversations, st.Cache.MaxConversations, ref.Regime.KVPressure)
	}
	fmt.Fprintln(w, ".")
	fmt.Fprintln(w)
	cols := regimeColumns(rg.Name)
	head := "| policy | KV hit | of oracle | of bound | TTFT p50 | TTFT p99 | GPU-s per 1k output | GPU-time imbalance |"
	rule := "|---|---:|---:|---:|---:|---:|---:|---:|"
	for _, c := range cols {
		head += " " + c.head + " |"
		rule += "---:|"
	}
	fmt.Fprintln(w, head)
	fmt.Fprintln(w, rule)
	oracle := oracleResult(results)
	for _, r := range results {
		s := r.Summary
		line := fmt.Sprintf("| %s | %.1f%% | %s | %s | %s | %s | %.2f | %.2f |", r.Settings.Label, 100*s.KVHitRate,
			shareOf(s.KVHitRate, oracle), shareOf(s.KVHitRate, r.InfiniteCacheBound),
			simMs(s.TTFB.P50), simMs(s.TTFB.P99), r.GPUSecondsPer1kOutput, r.GPUImbalance)
		for _, c := range cols {
			line += " " + c.cell(r) + " |"
		}
		fmt.Fprintln(w, line)
	}
	if b, ok := boundRange(results); ok {
		fmt.Fprintf(w, "| infinite-cache bound | %s | | 100%% | | | | |%s\n", b, strings.Repeat(" |", len(cols)))
	}
	fmt.Fprintln(w)
	return nil
}

// dayCharts draws the day's minutes, one line per policy: KV hit rate,
// TTFT p99, and the instances up.
func dayCharts(dir string, results []*simulator.Result) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	type chart struct {
		file, title, ylabel string
		value               func(m simulator.Minute) float64
		policies            bool // one line per policy (else the fleet's, once)
		percent             bool // the axis runs 0 to 100
	}
	charts := []chart{
		{"day-kv-hit-rate.png", "A day in the life: KV-cache hit rate per minute", "cached / prompt tokens (%)",
			func(m simulator.Minute) float64 { return 100 * m.KVHitRate }, true, true},
		{"day-ttft-p99.png", "A day in the life: P99 time to first token per minute", "milliseconds",
			func(m simulator.Minute) float64 { return float64(m.TTFTP99) / float64(time.Millisecond) }, true, false},
		{"day-instances.png", "A day in the life: instances up per minute", "instances",
			func(m simulator.Minute) float64 { return float64(m.Instances) }, false, false},
	}
	var out []string
	for _, c := range charts {
		p := plot.New()
		p.Title.Text = c.title
		p.X.Label.Text = "minute"
		p.Y.Label.Text = c.ylabel
		p.Legend.Top, p.Legend.Left = true, true
		if c.percent {
			p.Y.Min, p.Y.Max = 0, 100
		}
		var lines []any
		for _, r := range results {
			pts := make(plotter.XYs, len(r.Series))
			for i, m := range r.Series {
				pts[i].X, pts[i].Y = m.Start.Minutes(), c.value(m)
			}
			lines = append(lines, r.Settings.Label, pts)
			if !c.policies {
				break
			}
		}
		if err := plotutil.AddLines(p, lines...); err != nil {
			return out, err
		}
		path := filepath.Join(dir, c.file)
		if err := p.Save(8*vg.Inch, 4*vg.Inch, path); err != nil {
			return out, err
		}
		out = append(out, path)
	}
	return out, nil
}
