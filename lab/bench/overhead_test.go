package bench

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

func TestParseStatCPU(t *testing.T) {
	for _, tc := range []struct {
		name, stat string
		want       float64
		err        bool
	}{
		{name: "plain", stat: "1234 (envoy) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 125 0 0 20 0 12 0 5000 0 0\n", want: 3.75},
		{name: "spaces and parentheses in the name", stat: "7 (tether (x) y) R 1 7 7 0 -1 0 0 0 0 0 7 3 0 0 20 0 1 0 1 0 0", want: 0.1},
		{name: "zero", stat: "7 (redis-server) S 1 7 7 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 1 0 0", want: 0},
		{name: "no name", stat: "7 redis-server S 1", err: true},
		{name: "short", stat: "7 (redis-server) S 1 7 7 0 -1 0 0 0 0 0 7", err: true},
		{name: "not a number", stat: "7 (x) S 1 7 7 0 -1 0 0 0 0 0 7 -3 0 0 20 0 1 0 1 0 0", err: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseStatCPU(tc.stat)
			if (err != nil) != tc.err || got != tc.want {
				t.Errorf("parseStatCPU = %v, %v; want %v, error %v", got, err, tc.want, tc.err)
			}
		})
	}
}

func TestCPUSecondsOfThisProcess(t *testing.T) {
	// The test binary has used some CPU by now, and /proc says so.
	if _, err := cpuSeconds(os.Getpid()); err != nil {
		t.Skipf("no /proc: %v", err)
	}
	var n int
	for end := time.Now().Add(30 * time.Millisecond); time.Now().Before(end); {
		n++ // burn CPU for /proc to count
	}
	got, err := cpuSeconds(os.Getpid())
	if err != nil || got <= 0 || n == 0 {
		t.Errorf("cpuSeconds(self) = %v, %v", got, err)
	}
}

func TestParseCommandStats(t *testing.T) {
	info := "# Commandstats\r\n" +
		"cmdstat_get:calls=12,usec=40,usec_per_call=3.33,rejected_calls=0,failed_calls=0\r\n" +
		"cmdstat_client|setinfo:calls=2,usec=1,usec_per_call=0.50,rejected_calls=0,failed_calls=0\r\n" +
		"cmdstat_info:calls=5,usec=100,usec_per_call=20.00,rejected_calls=0,failed_calls=0\r\n"
	got, err := parseCommandStats(info)
	if err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(map[string]float64{"get": 12, "client|setinfo": 2}, got); d != "" {
		t.Errorf("commandstats (-want +got):\n%s", d)
	}
	if _, err := parseCommandStats("cmdstat_get:usec=1\r\n"); err == nil {
		t.Error("a line without calls parsed")
	}
}

func TestCommandsPerRequest(t *testing.T) {
	// 10 s loaded, 1000 requests; an idle 5 s saw 4 pings, so 8 are
	// background in the loaded window.
	loaded := map[string]float64{"ping": 8, "evalsha": 1000}
	idle := map[string]float64{"ping": 4}
	by, total := commandsPerRequest(loaded, 10*time.Second, idle, 5*time.Second, 1000)
	if d := cmp.Diff(map[string]float64{"evalsha": 1}, by); d != "" || total != 1 {
		t.Errorf("by command (-want +got):\n%s\ntotal %v", d, total)
	}
	// Nothing but background: zero, never below.
	if _, total := commandsPerRequest(map[string]float64{"ping": 3}, time.Second, map[string]float64{"ping": 5}, time.Second, 10); total != 0 {
		t.Errorf("total %v, want 0", total)
	}
}

func TestOverheadGoals(t *testing.T) {
	ms, us := time.Millisecond, time.Microsecond
	base := OverheadRow{Name: "Envoy alone", SerialP50: ms, SerialP99: 2 * ms, P50: ms, P99: 3 * ms, Throughput: 1000, EnvoyCPUPerRequest: 40 * us}
	random := OverheadRow{Name: "tether random", OnPath: true, SerialP50: ms + 300*us, SerialP99: 3*ms + 1*us, P50: ms + 301*us, P99: 4 * ms,
		Throughput: 750, TetherCPUPerRequest: 20 * us}
	sticky := OverheadRow{Name: "tether sticky", OnPath: true, Store: true, SerialP50: ms + 200*us, SerialP99: 2*ms + 500*us, P50: ms + 2*ms, P99: 10 * ms,
		Throughput: 749, TetherCPUPerRequest: 40 * us, RedisCPUPerRequest: 10*us + 400, RedisCommandsPerRequest: 0.004}
	r := &Report{Scale: Full, Overhead: []OverheadRow{base, random, sticky}}
	type row struct {
		Path, What, Target, Figure string
		Reached                    bool
	}
	var got []row
	for _, g := range r.OverheadGoals() {
		got = append(got, row{g.Path, g.What, g.Target(), g.Figure(), g.Reached})
	}
	want := []row{
		{"tether random", "added p50, one connection", "≤ 0.30 ms", "0.30 ms", true},
		{"tether random", "added p99, one connection", "≤ 1.00 ms", "1.00 ms", true}, // 1.001 ms shows, and is judged, as 1.00
		{"tether random", "added p50, at 300 requests/s", "≤ 0.30 ms", "0.30 ms", true},
		{"tether random", "added p99, at 300 requests/s", "≤ 1.00 ms", "1.00 ms", true},
		{"tether random", "throughput at 32 connections vs Envoy alone", "≥ 0.75×", "0.75×", true},
		{"tether sticky", "added p50, one connection", "≤ 0.30 ms", "0.20 ms", true},
		{"tether sticky", "added p99, one connection", "≤ 1.00 ms", "0.50 ms", true},
		{"tether sticky", "added p50, at 300 requests/s", "≤ 0.30 ms", "2.00 ms", false},
		{"tether sticky", "added p99, at 300 requests/s", "≤ 1.00 ms", "7.00 ms", false},
		{"tether sticky", "throughput at 32 connections vs Envoy alone", "≥ 0.75×", "0.75×", true}, // 0.749
		{"tether sticky", "tether + redis-server CPU per sticky hit", "≤ 50 µs", "50 µs", true},
		{"tether sticky", "Redis commands per sticky hit", "= 0.00", "0.00", true},
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("goals (-want +got):\n%s", d)
	}

	// Missed by a figure past the shown precision.
	sticky.TetherCPUPerRequest, sticky.RedisCommandsPerRequest, sticky.Throughput = 41*us, 1, 740
	r.Overhead[2] = sticky
	for _, g := range r.OverheadGoals()[9:] {
		if g.Reached {
			t.Errorf("%s %s: reached at %s", g.Path, g.What, g.Figure())
		}
	}
	// Envoy alone slower than tether: no verdict, not reached.
	sticky.SerialP99 = base.SerialP99 - 100*us
	r.Overhead[2] = sticky
	if g := r.OverheadGoals()[6]; g.What != "added p99, one connection" || g.Reached || !g.NoVerdict {
		t.Errorf("added p99 below zero: %+v", g)
	}
	// Without Envoy alone there is nothing to compare with.
	if g := (&Report{Overhead: []OverheadRow{sticky}}).OverheadGoals(); g != nil {
		t.Errorf("goals without a baseline: %v", g)
	}
}

// TestOverheadGoalsOverTheFloor: each row on the path is judged against
// Envoy alone and the floor of its own headers; the floor's goals follow
// its goals over Envoy alone, a row faster than the floor reaches the
// latency goal, a row without Envoy alone of its headers has none, and
// without the floor's Envoy CPU there is no CPU goal.
func TestOverheadGoalsOverTheFloor(t *testing.T) {
	ms, us := time.Millisecond, time.Microsecond
	row := func(name, client string, onPath, floor bool, serial, p50 time.Duration, tput float64, envoy time.Duration) OverheadRow {
		return OverheadRow{Name: name, Client: client, OnPath: onPath, Floor: floor, SerialP50: serial, SerialP99: 2 * serial,
			P50: p50, P99: 2 * p50, Throughput: tput, EnvoyCPUPerRequest: envoy}
	}
	r := &Report{Scale: Full, Overhead: []OverheadRow{
		row("alone", "", false, false, ms, ms, 1000, 40*us),
		row("floor", "", false, true, 1400*us, 1500*us, 500, 100*us),
		row("tether", "", true, false, 1500*us, 1610*us, 450, 110*us),
		row("alone, client", "client", false, false, 2*ms, 2*ms, 900, 50*us),
		row("floor, client", "client", false, true, 2600*us, 3*ms, 400, 120*us),
		row("tether, client", "client", true, false, 2400*us, 3*ms, 352, 134*us),
		row("tether, other client", "other", true, false, ms, ms, 1, us),
	}}
	type goal struct {
		Path, What, Bound, Figure string
		Reached                   bool
	}
	var got []goal
	for _, g := range r.OverheadGoals() {
		if g.Path == "tether, client" || strings.Contains(g.What, "floor") {
			got = append(got, goal{g.Path, g.What, g.BoundFigure(), g.Figure(), g.Reached})
		}
	}
	want := []goal{
		{"tether", "added p50 over the floor, one connection", "–", "0.10 ms", true},
		{"tether", "added p50 over the floor, at 300 requests/s", "–", "0.11 ms", false},
		{"tether", "throughput vs the floor", "–", "0.90×", true},
		{"tether", "Envoy CPU per request vs the floor", "–", "1.10×", true},
		// Bounds from the floor with the same headers, over Envoy alone
		// with them.
		{"tether, client", "added p50, one connection", "0.60 ms", "0.40 ms", false},
		{"tether, client", "added p99, one connection", "1.20 ms", "0.80 ms", true},
		{"tether, client", "added p50, at 300 requests/s", "1.00 ms", "1.00 ms", false},
		{"tether, client", "added p99, at 300 requests/s", "2.00 ms", "2.00 ms", false},
		{"tether, client", "throughput at 32 connections vs Envoy alone", "0.44×", "0.39×", false},
		{"tether, client", "added p50 over the floor, one connection", "–", "-0.20 ms", true},
		{"tether, client", "added p50 over the floor, at 300 requests/s", "–", "0.00 ms", true},
		{"tether, client", "throughput vs the floor", "–", "0.88×", false},
		{"tether, client", "Envoy CPU per request vs the floor", "–", "1.12×", false},
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("goals (-want +got):\n%s", d)
	}
	r.Overhead[1].EnvoyCPUPerRequest = 0
	for _, g := range r.OverheadGoals() {
		if g.Path == "tether" && strings.HasPrefix(g.What, "Envoy CPU") {
			t.Errorf("a CPU goal over a floor whose CPU was not measured: %+v", g)
		}
	}
}

// TestProfilePath: a profile is named after its configuration and never
// overwrites an earlier one of the same name.
func TestProfilePath(t *testing.T) {
	dir := t.TempDir()
	first := profilePath(dir, "tether sticky, outcomes observe")
	if want := filepath.Join(dir, "tether-sticky-outcomes-observe.pprof"); first != want {
		t.Fatalf("profilePath = %s, want %s", first, want)
	}
	if err := os.WriteFile(first, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if second := profilePath(dir, "tether sticky, outcomes observe"); second == first || filepath.Dir(second) != dir {
		t.Fatalf("second profile %s, first %s", second, first)
	}
}

func TestPairedGoalsAndMarkdown(t *testing.T) {
	ms, us := time.Millisecond, time.Microsecond
	side := func(serial, p50 time.Duration, n int64, envoy time.Duration) PairedSide {
		return PairedSide{SerialP50: serial, P50: p50, Requests: n, Took: 10 * time.Second, EnvoyCPUPerRequest: envoy, RouterCPUPerRequest: 50 * us}
	}
	r := &Report{Scale: Full, Overhead: []OverheadRow{{Name: "Envoy alone"}}, Paired: []PairedRow{
		{Rounds: 2, Floor: side(ms, ms, 10_000, 100*us), Tether: side(ms+100*us, ms-50*us, 9_000, 110*us), RoundRatios: []float64{0.95, 0.85}},
		{Client: "client", Rounds: 2, Floor: side(ms, ms, 10_000, 100*us), Tether: side(ms+101*us, ms, 8_940, 111*us), RoundRatios: []float64{0.9, 0.88}},
	}}
	type goal struct {
		Path, What, Figure string
		Reached            bool
	}
	var got []goal
	for _, g := range r.PairedGoals() {
		got = append(got, goal{g.Path, g.What, g.Figure(), g.Reached})
	}
	const name = "tether sticky, in alternation with the floor"
	want := []goal{
		{name, "added p50 over the floor, one connection", "0.10 ms", true},
		{name, "added p50 over the floor, at 300 requests/s", "-0.05 ms", true},
		{name, "throughput vs the floor", "0.90×", true},
		{name, "Envoy CPU per request vs the floor", "1.10×", true},
		{name + ", client", "added p50 over the floor, one connection", "0.10 ms", true}, // 0.101 judged as shown
		{name + ", client", "added p50 over the floor, at 300 requests/s", "0.00 ms", true},
		{name + ", client", "throughput vs the floor", "0.89×", false},
		{name + ", client", "Envoy CPU per request vs the floor", "1.11×", false},
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("paired goals (-want +got):\n%s", d)
	}
	md := r.Markdown(Meta{}, nil)
	for _, s := range []string{
		"#### Beside the floor, in alternation",
		"| the bench's | tether sticky | 1.10 ms | 0.95 ms | 900/s | 110 µs | 50 µs | 0 |",
		"| client | tether ÷ floor, round by round | | | 0.88–0.90 (median 0.90) | | | |",
		"| " + name + ", client | throughput vs the floor | ≥ 0.90× | 0.89× | no |",
	} {
		if !strings.Contains(md, s) {
			t.Errorf("markdown lacks %q", s)
		}
	}
}
