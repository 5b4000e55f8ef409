package plan

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/config"
)

func TestRandomSourceIsReproducible(t *testing.T) {
	a, b := randomSource(7), randomSource(7)
	for i := 0; i < 10; i++ {
		if a() != b() {
			t.Fatal("same seed, different draws")
		}
	}
	if a, b := randomSource(0)(), randomSource(0)(); a == b {
		t.Fatal("unseeded sources agree")
	}
}

func testConfig(t *testing.T) config.Config {
	t.Helper()
	c := config.Default()
	c.Instances = []config.Instance{{Name: "a", Address: "127.0.0.1:1", Version: "v1", Weight: 1}}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	return c
}

// TestFromConfigRunning: what a running tether keeps until a restart
// (config.Running) reaches the decider's side and Envoy's alike.
func TestFromConfigRunning(t *testing.T) {
	start := testConfig(t)
	edit := start
	edit.Routing.ClusterHeader = "x-edited-cluster"
	edit.Identity.SessionHeader = "x-edited-session"
	edit.Routing.IdleTimeout = config.Dur(time.Hour)
	run, _, err := config.Running(start, start, edit)
	if err != nil {
		t.Fatal(err)
	}
	p, err := FromConfig(run, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ what, got, want string }{
		{"Envoy's cluster header", p.Envoy.ClusterHeader, start.Routing.ClusterHeader},
		{"ext_proc's cluster header", p.ExtProc.ClusterHeader, start.Routing.ClusterHeader},
		{"Envoy's first hash header", p.Envoy.HashPolicy[0].Name, start.Identity.SessionHeader},
		{"the identity's session header", p.Identity.SessionHeader, start.Identity.SessionHeader},
	} {
		if c.got != c.want {
			t.Errorf("%s %q, want the start's %q", c.what, c.got, c.want)
		}
	}
	if p.Policy.Lifetime.Idle != time.Hour {
		t.Errorf("idle timeout %v, want the edit's hour (a live key)", p.Policy.Lifetime.Idle)
	}
}

// TestFromConfigRefusesUnvalidated: a rule config.Validate did not
// resolve is an error, not a rule that matches everything.
func TestFromConfigRefusesUnvalidated(t *testing.T) {
	c := testConfig(t)
	c.Routing.Rules = []config.Rule{{Name: "batch", Header: "x-client", Regex: "^batch-"}}
	if _, err := FromConfig(c, Options{}); err == nil || !strings.Contains(err.Error(), "config.Validate") {
		t.Errorf("an unresolved rule: %v, want an error", err)
	}
}

// TestEnvoyExtProcEndpoints: envoy.extproc_endpoints, else the replicas
// the caller names, else server.extproc_addr.
func TestEnvoyExtProcEndpoints(t *testing.T) {
	cfg := testConfig(t)
	for _, tc := range []struct {
		file, opt, want []string
	}{
		{nil, nil, []string{cfg.Server.ExtProcAddr}},
		{nil, []string{"10.0.0.9:50051"}, []string{"10.0.0.9:50051"}},
		{[]string{"10.0.0.7:50051"}, []string{"10.0.0.9:50051"}, []string{"10.0.0.7:50051"}},
	} {
		c := cfg
		c.Envoy.ExtProcEndpoints = tc.file
		p, err := FromConfig(c, Options{ExtProc: tc.opt})
		if err != nil || !slices.Equal(p.Envoy.ExtProc, tc.want) {
			t.Errorf("file %v, options %v: %v, %v; want %v", tc.file, tc.opt, p.Envoy.ExtProc, err, tc.want)
		}
	}
}

// TestEnginesRunningAndInstances: how engines are scraped, and how old a
// reading may be, stay as tether started; which instances are scraped
// follows the file (engines.default, an instance's engine).
func TestEnginesRunningAndInstances(t *testing.T) {
	start := config.Default()
	start.Instances = []config.Instance{{Name: "a", Address: "10.0.0.1:8000"}, {Name: "b", Address: "10.0.0.2:8000", Engine: config.EngineSGLang}}
	edit := start
	edit.Engines.Default = config.EngineVLLM
	edit.Engines.Staleness = config.Dur(30 * time.Second)
	edit.Engines.ScrapeInterval = config.Dur(5 * time.Second)
	for _, c := range []*config.Config{&start, &edit} {
		if err := c.Validate(); err != nil {
			t.Fatal(err)
		}
	}
	run, _, err := config.Running(start, start, edit)
	if err != nil {
		t.Fatal(err)
	}
	p, err := FromConfig(run, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if p.Policy.Saturation.Stale != config.DefaultStaleness || p.Scrape.Interval != config.DefaultScrapeInterval || p.Scrape.Staleness != config.DefaultStaleness {
		t.Errorf("after a live edit: staleness %v, scrape %+v; want the start's", p.Policy.Saturation.Stale, p.Scrape)
	}
	want := []struct{ engine, url string }{{"vllm", "http://10.0.0.1:8000/metrics"}, {"sglang", "http://10.0.0.2:8000/metrics"}}
	for i, in := range p.Instances {
		if in.Engine != want[i].engine || in.MetricsURL != want[i].url {
			t.Errorf("instance %s: engine %q at %q, want %q at %q", in.Name, in.Engine, in.MetricsURL, want[i].engine, want[i].url)
		}
	}
	p, err = FromConfig(start, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if in := p.Instances[0]; in.Engine != "" || in.MetricsURL != "" {
		t.Errorf("a generic instance: engine %q at %q, want neither (not scraped)", in.Engine, in.MetricsURL)
	}
}

// TestMode: the three mode keys add up in one place.
func TestMode(t *testing.T) {
	for _, tc := range []struct {
		mode             string
		sticky, adaptive int
		rule             string
		want, wantRule   affinity.Mode
	}{
		{config.ModeSticky, 1, 0, config.ModeSticky, affinity.Sticky, affinity.Sticky},
		{config.ModeSticky, 0, 0, config.ModeSticky, affinity.Random, affinity.Random}, // the global switch to random
		{config.ModeSticky, 1, 1, config.ModeSticky, affinity.Adaptive, affinity.Adaptive},
		{config.ModeSticky, 0, 1, config.ModeAdaptive, affinity.Random, affinity.Random},
		{config.ModeRandom, 1, 1, config.ModeSticky, affinity.Random, affinity.Adaptive},
		{config.ModeRandom, 1, 0, config.ModeAdaptive, affinity.Random, affinity.Adaptive},
		{config.ModeHybrid, 1, 0, config.ModeRandom, affinity.Hybrid, affinity.Random},
		{config.ModeHybrid, 1, 1, "", affinity.Hybrid, ""},
		{config.ModeHybrid, 0, 1, config.ModeSticky, affinity.Random, affinity.Random},
	} {
		r := config.Routing{Mode: tc.mode, StickyEnabled: tc.sticky, AdaptiveSticky: tc.adaptive}
		if got, rule := Mode(r), ruleMode(r, tc.rule); got != tc.want || rule != tc.wantRule {
			t.Errorf("mode %s, sticky_enabled %d, adaptive_sticky %d, rule %q: %s and %q, want %s and %q",
				tc.mode, tc.sticky, tc.adaptive, tc.rule, got, rule, tc.want, tc.wantRule)
		}
	}
}

// TestLimitsLayer: an instance's outlier detection and circuit breakers
// are its section's with the keys its own tables set over them; the pools
// take the sections'.
func TestLimitsLayer(t *testing.T) {
	c, err := config.Parse([]byte(`
[outlier_detection]
consecutive_gateway_failure = 2
[outlier_detection.instances.a]
consecutive_5xx = 9
[circuit_breakers]
max_requests = 100
[circuit_breakers.instances.a]
max_connections = 7
[[instances]]
name = "a"
address = "10.0.0.1:1"
[[instances]]
name = "b"
address = "10.0.0.2:1"
`))
	if err != nil {
		t.Fatal(err)
	}
	a, b, pool := limits(c, "a"), limits(c, "b"), limits(c, "")
	if a.Outlier.Consecutive5xx != 9 || b.Outlier.Consecutive5xx != 5 || pool.Outlier.Consecutive5xx != 5 ||
		a.Outlier.ConsecutiveGatewayFailure != 2 || b.Outlier.ConsecutiveGatewayFailure != 2 {
		t.Errorf("outlier: a %+v, b %+v, pool %+v", a.Outlier, b.Outlier, pool.Outlier)
	}
	if a.Outlier.BaseEjectionTime != 30*time.Second {
		t.Errorf("a key neither table sets: %v, want the default", a.Outlier.BaseEjectionTime)
	}
	if a.Breakers.MaxConnections != 7 || b.Breakers.MaxConnections != 256 || a.Breakers.MaxRequests != 100 || b.Breakers.MaxRequests != 100 {
		t.Errorf("breakers: a %+v, b %+v", a.Breakers, b.Breakers)
	}
	// The layering writes no shared state: the section is as it was.
	if *c.OutlierDetection.Consecutive5xx != 5 {
		t.Error("limits changed the section")
	}
}
