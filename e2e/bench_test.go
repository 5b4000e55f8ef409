//go:build e2e

package e2e

import (
	"context"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tetherproxy/tether/internal/testenv"
	"github.com/tetherproxy/tether/lab/bench"
	"github.com/tetherproxy/tether/lab/emulator"
	"github.com/tetherproxy/tether/lab/simulator"
	"github.com/tetherproxy/tether/lab/workload"
)

// TestBenchSmoke runs the whole benchmark suite at its smoke scale, so the
// suite cannot rot, and checks what must hold whatever the machine: every
// table filled, nothing failing where nothing fails, sticky routing
// keeping conversations together better than random routing, and adaptive
// routing spreading a hot spot that sticky routing keeps on one instance.
func TestBenchSmoke(t *testing.T) {
	redisBin, err := exec.LookPath("redis-server")
	testenv.Require(t, "redis-server", err)
	var log strings.Builder
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	rep, err := bench.Run(ctx, bench.Options{
		TetherBin: tetherBin, EnvoyBin: testenv.EnvoyBin(t), RedisBin: redisBin, LabBin: buildLab(t),
		Scale: bench.Smoke, Seed: 7, Log: &log,
	})
	if err != nil {
		t.Fatalf("%v\n%s", err, log.String())
	}
	if len(rep.Overhead) != 9 || len(rep.Quality) != 5 || len(rep.Hotspot) != 2+len(bench.Smoke.HotScrapeIntervals) || len(rep.Churn) != 8 || len(rep.Documents) != 3 {
		t.Fatalf("tables: %d overhead, %d quality, %d hot spot, %d churn, %d documents rows",
			len(rep.Overhead), len(rep.Quality), len(rep.Hotspot), len(rep.Churn), len(rep.Documents))
	}
	checkOverhead(t, rep)
	checkPaired(t, rep)
	checkBodies(t, rep)
	checkDocuments(t, rep.Documents)
	for _, c := range rep.Churn {
		// The killed instance answers nothing while it is down, and the
		// rest of the fleet takes its traffic.
		if c.Phase == "instance killed" && (c.VictimServed != 0 || c.Requests == 0) {
			t.Errorf("churn %+v", c)
		}
		// The simulator ran the same schedule beside it (at this scale
		// the gaps are the noise of a few dozen requests: not checked).
		if !c.Sim.Ran || c.Sim.Requests == 0 {
			t.Errorf("churn %s, %s: no simulator figures: %+v", c.Policy, c.Phase, c.Sim)
		}
	}
	byName := map[string]bench.QualityRow{}
	for _, q := range rep.Quality {
		byName[q.Policy] = q
		if q.Requests == 0 || q.Failed > q.Requests/20 || q.TTFTP50 <= 0 || q.GPUBusy <= 0 {
			t.Errorf("quality %+v", q)
		}
		// Tether decides only where it is on the request path.
		onPath := strings.HasPrefix(q.Policy, "tether ")
		if s := q.Spread; onPath != (q.Decisions > 0) || q.Spilled < 0 || q.Spilled > 1 ||
			s.MaxRequests == 0 || s.MinRequests > s.MaxRequests || s.Imbalance < 1 || s.QueueP50 > s.QueueP99 || s.QueueP99 > s.BusiestQueueP99 {
			t.Errorf("quality %s: decisions %d, spilled %.3f, spread %+v", q.Policy, q.Decisions, q.Spilled, q.Spread)
		}
	}
	sticky, random, adaptive := byName["tether sticky"], byName["tether random"], byName["tether adaptive"]
	if sticky.Continuity <= random.Continuity || sticky.HitRate < random.HitRate {
		t.Errorf("sticky (continuity %.2f, hit %.2f) not ahead of random (%.2f, %.2f)", sticky.Continuity, sticky.HitRate, random.Continuity, random.HitRate)
	}
	// Adaptive is sticky until an instance saturates.
	if adaptive.Continuity <= random.Continuity || sticky.Spilled != 0 || random.Spilled != 0 {
		t.Errorf("adaptive continuity %.2f against random %.2f; spilled: sticky %.3f, random %.3f",
			adaptive.Continuity, random.Continuity, sticky.Spilled, random.Spilled)
	}
	checkHotspot(t, rep.Hotspot)
	crossCheck(t, rep)
	dir := t.TempDir()
	charts, err := rep.Charts(filepath.Join(dir, "charts"))
	if err != nil || len(charts) != 3 {
		t.Fatalf("charts %v: %v", charts, err)
	}
	for _, c := range charts {
		if fi, err := os.Stat(c); err != nil || fi.Size() < 1000 {
			t.Errorf("chart %s: %v", c, err)
		}
	}
	md := rep.Markdown(bench.Meta{Command: "test", Commit: "test", Machine: "test"}, charts)
	for _, want := range []string{"### Overhead", "| configuration | one connection p50 |", "Redis commands per hit", "#### Overhead goals", "#### With a chat body"} {
		if !strings.Contains(md, want) {
			t.Errorf("report lacks %q", want)
		}
	}
	out := filepath.Join(dir, "BENCHMARKS.md")
	if err := os.WriteFile(out, []byte("# Benchmarks\n\nkept\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := bench.WriteInto(out, md); err != nil {
		t.Fatal(err)
	}
	if err := bench.WriteInto(out, md); err != nil { // a second run replaces, not appends
		t.Fatal(err)
	}
	b, _ := os.ReadFile(out)
	if strings.Count(string(b), bench.MarkerStart) != 1 || !strings.Contains(string(b), "kept") {
		t.Fatalf("BENCHMARKS.md after two writes:\n%s", b)
	}
	t.Logf("smoke report:\n%s", md)
}

// buildLab builds tether-lab, whose `bench floor` the bench starts, in the
// lab's module, as make build does.
func buildLab(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "tether-lab")
	build := exec.Command("go", "build", "-o", bin, "./cmd/tether-lab")
	build.Dir = "../lab"
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build tether-lab: %v\n%s", err, out)
	}
	return bin
}

// checkOverhead checks the overhead tables are filled and sane: every
// figure there, positive where it must be, and a goals block with each
// goal for each configuration on the path. Whether the goals are reached
// is the machine's business, not checked.
func checkOverhead(t *testing.T, rep *bench.Report) {
	t.Helper()
	sc := bench.Smoke
	for _, o := range rep.Overhead {
		if o.Failed != 0 || o.Dropped != 0 || o.Serial != sc.OverheadSerial || o.SerialP50 <= 0 || o.SerialP99 < o.SerialP50 ||
			o.P50 <= 0 || o.P99 < o.P50 || o.Throughput <= 0 || o.HitRequests <= 0 {
			t.Errorf("overhead %+v", o)
		}
		// The floor is off tether's path, on Envoy's ext_proc filter.
		// Envoy called it for every request rather than failing open (and
		// the bench checked, through Envoy, that its requests reached the
		// instances it named, or the run would have failed).
		if o.Floor && (o.OnPath || o.Store || o.Decisions < int(o.HitRequests)) {
			t.Errorf("overhead %s: on tether's path %v, %d requests answered by the floor of %d", o.Name, o.OnPath, o.Decisions, o.HitRequests)
		}
		// CPU: Envoy's on every row, tether's where it is on the path, the
		// floor process's on its rows. redis-server's may round to 0 when
		// a hit sends it nothing.
		if o.EnvoyCPUPerRequest <= 0 || o.OnPath != (o.TetherCPUPerRequest > 0) || o.Floor != (o.FloorCPUPerRequest > 0) ||
			o.RedisCPUPerRequest < 0 || (!o.Store && o.RedisCPUPerRequest != 0) {
			t.Errorf("overhead %s: CPU per request: Envoy %v, tether %v, floor %v, redis-server %v",
				o.Name, o.EnvoyCPUPerRequest, o.TetherCPUPerRequest, o.FloorCPUPerRequest, o.RedisCPUPerRequest)
		}
		// Every request of the hit loop had a decision, and every sticky
		// decision was a hit or, when redis-server did not answer within
		// redis.timeout (a loaded machine), degraded: counted, not failed.
		if o.OnPath && (o.Decisions < int(o.HitRequests) || o.Degraded < 0 || o.StoreErrors < 0) {
			t.Errorf("overhead %s: %d decisions for %d requests, degraded %d, store errors %d", o.Name, o.Decisions, o.HitRequests, o.Degraded, o.StoreErrors)
		}
		if o.Store {
			if hits := int(o.HitShare*float64(o.Decisions) + 0.5); hits == 0 || hits+o.Degraded < o.Decisions*99/100 || o.RedisCommandsPerRequest < 0 {
				t.Errorf("overhead %s: %d decisions, hits %.3f, degraded %d, Redis commands per hit %.3f",
					o.Name, o.Decisions, o.HitShare, o.Degraded, o.RedisCommandsPerRequest)
			}
		}
	}
	names := []string{}
	for _, o := range rep.Overhead {
		names = append(names, o.Name)
	}
	const client = ", OpenAI Python client's headers"
	if want := []string{"Envoy alone", "ext_proc floor", "tether random", "tether sticky", "tether sticky, outcomes observe", "tether sticky, outcomes inline",
		"Envoy alone" + client, "ext_proc floor" + client, "tether sticky" + client}; !slices.Equal(names, want) {
		t.Errorf("overhead rows %q, want %q", names, want)
	}
	goals := rep.OverheadGoals()
	per := map[string]int{}
	for _, g := range goals {
		per[g.Path]++
		if g.Figure() == "" || g.Target() == "" || math.IsNaN(g.Value) {
			t.Errorf("goal %+v", g)
		}
	}
	// Over Envoy alone, then over the floor of the same headers (4 goals).
	if per["tether random"] != 5+4 || per["tether sticky"] != 7+4 || per["tether sticky, outcomes observe"] != 7+4 || per["tether sticky, outcomes inline"] != 7+4 ||
		per["tether sticky"+client] != 7+4 || len(per) != 5 {
		t.Errorf("goals by configuration %v", per)
	}
	for _, g := range goals {
		t.Logf("goal %s, %s: %s %s (reached %v)", g.Path, g.What, g.Target(), g.Figure(), g.Reached)
	}
}

// checkPaired checks the floor and tether sticky measured in alternation:
// with the bench's headers and the client's, every slice of each side
// answered, nothing failed, and the goals over the floor judged on the
// sums.
func checkPaired(t *testing.T, rep *bench.Report) {
	t.Helper()
	if len(rep.Paired) != 2 || rep.Paired[0].Client != "" || rep.Paired[1].Client != "OpenAI Python client's headers" {
		t.Fatalf("paired rows %+v", rep.Paired)
	}
	for _, p := range rep.Paired {
		for _, s := range []bench.PairedSide{p.Floor, p.Tether} {
			if s.Failed != 0 || s.SerialP50 <= 0 || s.P50 <= 0 || s.Requests <= 0 || s.Throughput() <= 0 ||
				s.EnvoyCPUPerRequest <= 0 || s.RouterCPUPerRequest <= 0 {
				t.Errorf("paired %q: side %+v", p.Client, s)
			}
		}
		if len(p.RoundRatios) != p.Rounds || p.Rounds < 2 {
			t.Errorf("paired %q: %d rounds, ratios %v", p.Client, p.Rounds, p.RoundRatios)
		}
	}
	if goals := rep.PairedGoals(); len(goals) != 2*4 {
		t.Errorf("paired goals %+v", goals)
	}
}

// checkBodies checks the overhead rows with a chat body: each size through
// Envoy alone, tether with content off and on, nothing failing, and tether
// asking for the body of every request only with content on, placing
// most by prefix (every body shares its document).
func checkBodies(t *testing.T, rep *bench.Report) {
	t.Helper()
	sc := bench.Smoke
	if len(rep.Bodies) != 3*len(sc.BodySizes) {
		t.Fatalf("%d body rows for %d sizes", len(rep.Bodies), len(sc.BodySizes))
	}
	for i, b := range rep.Bodies {
		name := []string{"Envoy alone", "tether sticky, content off", "tether sticky, content on"}[i%3]
		if b.Name != name || b.BodyBytes != sc.BodySizes[i/3] || b.OnPath != (i%3 != 0) || b.Content != (i%3 == 2) {
			t.Errorf("body row %d: %s, %d bytes, on path %v, content %v", i, b.Name, b.BodyBytes, b.OnPath, b.Content)
		}
		if b.Failed != 0 || b.Dropped != 0 || b.Serial != sc.BodySerial || b.SerialP50 <= 0 || b.SerialP99 < b.SerialP50 ||
			b.P50 <= 0 || b.P99 < b.P50 || b.Throughput <= 0 || b.Requests <= 0 || b.EnvoyCPUPerRequest <= 0 || b.OnPath != (b.TetherCPUPerRequest > 0) {
			t.Errorf("body row %+v", b)
		}
		if b.OnPath && b.Decisions < int(b.Requests) {
			t.Errorf("%s: %d decisions for %d requests", b.Name, b.Decisions, b.Requests)
		}
		// Incomplete: a request the closed loop cancelled at its end, one
		// per connection at most.
		read, placed, cut := b.BodiesRead(), int(b.ContentResults["placed"]), int(b.ContentResults["incomplete"])
		if b.Content && (read < int(b.Requests) || placed < read/2 || cut > sc.OverheadWorkers || placed+int(b.ContentResults["identity"])+cut != read) ||
			!b.Content && read != 0 {
			t.Errorf("%s, %d bytes: %d requests, bodies read %d: %v", b.Name, b.BodyBytes, b.Requests, read, b.ContentResults)
		}
	}
}

// checkHotspot checks the hot-spot scenario: sticky routing keeps the hot
// tenant on one instance and never spills; adaptive spills it (it is the
// only saturated instance) and its first token comes sooner, whether it
// reads saturation from the engines' /metrics or from the header signals.
func checkHotspot(t *testing.T, rows []bench.HotspotRow) {
	t.Helper()
	by := map[string]bench.HotspotRow{}
	for _, h := range rows {
		by[h.Policy] = h
		for _, tr := range []bench.Traffic{h.Tenant, h.Others, h.All} {
			if tr.Requests == 0 || tr.Failed > tr.Requests/20 || tr.TTFTP50 <= 0 || tr.TTFTP99 < tr.TTFTP50 || tr.Instances == 0 {
				t.Errorf("hot spot %s: %+v", h.Policy, tr)
			}
		}
		if h.Decisions < h.All.Requests-h.All.Failed || h.Spread.MaxRequests == 0 {
			t.Errorf("hot spot %s: %d decisions for %d requests, spread %+v", h.Policy, h.Decisions, h.All.Requests, h.Spread)
		}
	}
	sticky := by["tether sticky"]
	if sticky.Tenant.Instances != 1 || sticky.Spilled != 0 || sticky.Tenant.Spilled != 0 {
		t.Errorf("sticky: hot tenant on %d instances, spilled %.3f (tenant %.3f)", sticky.Tenant.Instances, sticky.Spilled, sticky.Tenant.Spilled)
	}
	for name, adaptive := range by {
		if !strings.HasPrefix(name, "tether adaptive") {
			continue
		}
		if adaptive.Tenant.Requests != sticky.Tenant.Requests {
			t.Errorf("hot tenant sent %d requests under %s, %d under sticky: the schedule differs", adaptive.Tenant.Requests, name, sticky.Tenant.Requests)
		}
		if adaptive.Tenant.Instances < 2 || adaptive.Tenant.Spilled <= 0 || adaptive.Spilled <= 0 || adaptive.Spilled > 0.5 {
			t.Errorf("%s: hot tenant on %d instances, spilled %.3f (tenant %.3f)", name, adaptive.Tenant.Instances, adaptive.Spilled, adaptive.Tenant.Spilled)
		}
		if adaptive.Tenant.TTFTP50 >= sticky.Tenant.TTFTP50 || adaptive.Spread.BusiestQueueP99 >= sticky.Spread.BusiestQueueP99 {
			t.Errorf("%s did not relieve the hot spot: tenant TTFT p50 %v against sticky %v, busiest queue p99 %d against %d",
				name, adaptive.Tenant.TTFTP50, sticky.Tenant.TTFTP50, adaptive.Spread.BusiestQueueP99, sticky.Spread.BusiestQueueP99)
		}
	}
}

// crossCheck runs tether-lab simulate on the smoke scale's workload and checks
// it agrees with what the same workload measured through real Envoy: hit
// rates within a few points, continuity within a few more (the issue's
// cross-check of the discrete-event simulation).
func crossCheck(t *testing.T, rep *bench.Report) {
	t.Helper()
	sc := bench.Smoke
	for _, q := range rep.Quality {
		if q.Policy == "tether adaptive" {
			continue // the bench's adaptive settings are not the simulator's policy adaptive
		}
		p, ok := map[string]simulator.Policy{
			"Envoy round robin": simulator.RoundRobin, "Envoy ring hash": simulator.RingHash,
			"tether random": simulator.Random, "tether sticky": simulator.Sticky,
		}[q.Policy]
		if !ok {
			t.Fatalf("no simulated policy for %q", q.Policy)
		}
		res, err := simulator.Run(context.Background(), simulator.Options{
			Policy: p, Instances: 8, Zones: 2, Profile: emulator.ProfileA100(), TimeScale: sc.TimeScale,
			Workload: workload.Config{Seed: 7}, Rate: sc.Rate, Duration: sc.Duration, ThinkScale: sc.ThinkScale,
			Stream: true, Seed: 7,
		})
		if err != nil {
			t.Fatal(err)
		}
		hit, cont := res.Summary.KVHitRate, res.Summary.Continuity
		t.Logf("%s: hit rate %.1f%% real, %.1f%% simulated; continuity %.1f%% real, %.1f%% simulated",
			q.Policy, 100*q.HitRate, 100*hit, 100*q.Continuity, 100*cont)
		// Continuity of the random policies depends on which draws each run
		// makes; only the deterministic ones are compared on it.
		deterministic := p == simulator.Sticky || p == simulator.RingHash
		// At smoke scale a policy serves about a hundred requests at a time
		// scale of 0.05, so which blocks are ready when a prefill looks them
		// up moves with the machine's load: ring hash's real hit rate
		// ranged 43.8–48.4% over two runs of this same code (simulated
		// 49.9%). A model that breaks (the ring keyed otherwise, a cache
		// rule changed) moves it by 15 points or more.
		if math.Abs(hit-q.HitRate) > 0.08 || (deterministic && math.Abs(cont-q.Continuity) > 0.12) {
			t.Errorf("%s: simulation disagrees with the real run", q.Policy)
		}
	}
}

// checkDocuments checks the shared-documents rows: every row answered and
// cross-checked by the simulator (at this scale the gaps are the noise of
// a few dozen requests: logged, not checked), tether on the path only in
// its rows, and bodies read by the cache-aware row alone, most of them
// placing the request.
func checkDocuments(t *testing.T, rows []bench.QualityRow) {
	t.Helper()
	for _, q := range rows {
		t.Logf("documents %s: hit rate %.1f%% real, %.1f%% simulated; bodies read %v", q.Policy, 100*q.HitRate, 100*q.Sim.HitRate, q.ContentResults)
		if q.Requests == 0 || q.Failed > q.Requests/20 || q.TTFTP50 <= 0 || !q.Sim.Ran || q.Sim.Requests == 0 {
			t.Errorf("documents %+v", q)
		}
		if onPath := strings.HasPrefix(q.Policy, "tether "); onPath != (q.Decisions > 0) {
			t.Errorf("documents %s: %d decisions", q.Policy, q.Decisions)
		}
		if read := q.BodiesRead(); (q.Policy == "tether cache-aware") != (read > 0) {
			t.Errorf("documents %s: %d bodies read (%v)", q.Policy, read, q.ContentResults)
		}
	}
	if ca := rows[len(rows)-1]; ca.ContentResults["placed"] < float64(ca.BodiesRead())/2 {
		t.Errorf("documents %s: bodies read %v, want most placed", ca.Policy, ca.ContentResults)
	}
}
