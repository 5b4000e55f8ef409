//go:build e2e

package e2e

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	"github.com/tetherproxy/tether/internal/testenv"
)

// TestPrometheusSeesContinuity: a real Prometheus scrapes tether while
// sessions talk through Envoy, and the continuity it computes from
// tether's metrics is the continuity the test computes from the answers:
// a follow-up (every turn after a session's first) keeps it when the
// instance that answered it is the one that answered the turn before.
// Draining an instance halfway moves its sessions, which breaks
// continuity for exactly their next turn.
func TestPrometheusSeesContinuity(t *testing.T) {
	rds := testenv.RedisServer(t)
	cfg := baseConfig(rds.URL(), startFleet(t, 4))
	tt := startTether(t, cfg)
	envoy := startEnvoy(t, cfg, tt.extproc)
	root, err := testenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	prom := testenv.PrometheusServer(t, fmt.Sprintf(`
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: [%q]
scrape_configs:
  - job_name: tether
    static_configs:
      - targets: [%q]
`, filepath.Join(root, "deploy", "prometheus", "alerts.yml"), tt.admin))

	const sessions, turns, drainAt = 40, 6, 3
	answers := make([][]answer, sessions)
	talk := func(from, to int) {
		parallel(sessions, 8, func(s int) {
			for turn := from; turn < to; turn++ {
				answers[s] = append(answers[s], chat(t, envoy, map[string]string{"x-session-id": fmt.Sprintf("prom-%d", s)}))
			}
		})
	}
	talk(0, drainAt)
	// Drain the instance holding the most sessions: each of them moves
	// at its next turn.
	count := map[string]int{}
	for _, a := range answers {
		count[a[drainAt-1].instance]++
	}
	drained := ""
	for name, n := range count {
		if drained == "" || n > count[drained] {
			drained = name
		}
	}
	body := fmt.Sprintf(`{"instance":%q}`, drained)
	resp, err := http.Post("http://"+tt.admin+"/v1/sessions/drain", "application/json", bytes.NewBufferString(body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("drain %s: %s", drained, resp.Status)
	}
	// The drain reaches the decider with the next load sync (1 s); the
	// availability gauge shows when it has.
	waitFor(t, 5*time.Second, drained+" drained in tether's view", func() bool {
		return tt.metric(t, "tether_instance_available", fmt.Sprintf("upstream=%q", drained)) == 0
	})
	talk(drainAt, turns)

	followups, kept := 0, 0
	for s, as := range answers {
		for i, a := range as {
			if a.status != http.StatusOK || a.instance == "" {
				t.Fatalf("session %d turn %d: status %d from %q", s, i, a.status, a.instance)
			}
			if i == 0 {
				continue
			}
			followups++
			if a.instance == as[i-1].instance {
				kept++
			}
		}
	}
	if kept == followups || kept == 0 {
		t.Fatalf("%d of %d follow-ups kept continuity: the drain should break some and keep the rest", kept, followups)
	}
	want := float64(kept) / float64(followups)

	// Wait for a scrape that has every follow-up, then ask Prometheus.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var got map[string]float64
	waitFor(t, 20*time.Second, "Prometheus to scrape every follow-up", func() bool {
		got, err = prom.Query(ctx, `sum(tether_followups_total)`)
		return err == nil && valueOf(got) == float64(followups)
	})
	ratio, err := prom.Query(ctx, `sum(tether_followups_total{continuity="kept"}) / sum(tether_followups_total)`)
	if err != nil {
		t.Fatal(err)
	}
	if r := valueOf(ratio); r != want {
		t.Fatalf("Prometheus continuity %.4f, the test's %.4f (%d of %d follow-ups kept)", r, want, kept, followups)
	}
	t.Logf("continuity %.4f = %d/%d follow-ups, through Envoy and as Prometheus computes it from tether's metrics (%s drained with %d sessions)",
		want, kept, followups, drained, count[drained])

	// The shipped rules load and evaluate on tether's series: every rule
	// healthy once evaluated ("unknown" before). A ratio may have no
	// value yet (the rules skip 0/0 when the counters have not moved
	// within a scrape).
	var bad []string
	deadline := time.Now().Add(15 * time.Second)
	for bad = prom.UnhealthyRules(ctx, t); len(bad) > 0 && time.Now().Before(deadline); bad = prom.UnhealthyRules(ctx, t) {
		time.Sleep(200 * time.Millisecond)
	}
	if len(bad) > 0 {
		t.Fatalf("rules Prometheus did not evaluate cleanly: %v", bad)
	}

	// The moves are counted as migrations off the drained instance.
	moved, err := prom.Query(ctx, fmt.Sprintf(`sum(tether_session_migrations_total{upstream=%q,reason="drained"})`, drained))
	if err != nil {
		t.Fatal(err)
	}
	if m := valueOf(moved); int(m) != count[drained] {
		all, _ := prom.Query(ctx, `tether_session_migrations_total`)
		t.Errorf("Prometheus counts %v sessions migrated off %s, the test saw %d leave it; all migrations: %v", m, drained, count[drained], all)
	}
}

// valueOf is the value of a one-sample result.
func valueOf(res map[string]float64) float64 {
	for _, v := range res {
		return v
	}
	return -1
}
