//go:build e2e

package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tetherproxy/tether/bench"
	"github.com/tetherproxy/tether/internal/testenv"
)

// TestBenchSmoke runs the whole benchmark suite at its smoke scale, so the
// suite cannot rot, and checks what must hold whatever the machine: every
// table filled, nothing failing where nothing fails, and sticky routing
// keeping conversations together better than random routing.
func TestBenchSmoke(t *testing.T) {
	redisBin, err := exec.LookPath("redis-server")
	testenv.Require(t, "redis-server", err)
	var log strings.Builder
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	rep, err := bench.Run(ctx, bench.Options{
		TetherBin: tetherBin, EnvoyBin: testenv.EnvoyBin(t), RedisBin: redisBin,
		Scale: bench.Smoke, Seed: 7, Log: &log,
	})
	if err != nil {
		t.Fatalf("%v\n%s", err, log.String())
	}
	if len(rep.Overhead) != 3 || len(rep.Quality) != 4 || len(rep.Churn) != 8 {
		t.Fatalf("tables: %d overhead, %d quality, %d churn rows", len(rep.Overhead), len(rep.Quality), len(rep.Churn))
	}
	for _, o := range rep.Overhead {
		if o.Throughput <= 0 || o.Failed != 0 || o.Dropped != 0 || o.P50 <= 0 {
			t.Errorf("overhead %+v", o)
		}
		if (o.Name == "Envoy alone") != (o.TetherCPUPerRequest == 0) {
			t.Errorf("overhead %s: tether CPU per request %v", o.Name, o.TetherCPUPerRequest)
		}
	}
	for _, c := range rep.Churn {
		// The killed instance answers nothing while it is down, and the
		// rest of the fleet takes its traffic.
		if c.Phase == "instance killed" && (c.VictimServed != 0 || c.Requests == 0) {
			t.Errorf("churn %+v", c)
		}
	}
	byName := map[string]bench.QualityRow{}
	for _, q := range rep.Quality {
		byName[q.Policy] = q
		if q.Requests == 0 || q.Failed > q.Requests/20 || q.TTFTP50 <= 0 || q.GPUBusy <= 0 {
			t.Errorf("quality %+v", q)
		}
	}
	sticky, random := byName["tether sticky"], byName["tether random"]
	if sticky.Continuity <= random.Continuity || sticky.HitRate < random.HitRate {
		t.Errorf("sticky (continuity %.2f, hit %.2f) not ahead of random (%.2f, %.2f)", sticky.Continuity, sticky.HitRate, random.Continuity, random.HitRate)
	}
	dir := t.TempDir()
	charts, err := rep.Charts(filepath.Join(dir, "charts"))
	if err != nil || len(charts) != 2 {
		t.Fatalf("charts %v: %v", charts, err)
	}
	for _, c := range charts {
		if fi, err := os.Stat(c); err != nil || fi.Size() < 1000 {
			t.Errorf("chart %s: %v", c, err)
		}
	}
	md := rep.Markdown(bench.Meta{Command: "test", Commit: "test", Machine: "test"}, charts)
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
