package plan

import (
	"slices"
	"strings"
	"testing"
	"time"

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

func testConfig() config.Config {
	c := config.Default()
	c.Instances = []config.Instance{{Name: "a", Address: "127.0.0.1:1", Version: "v1", Weight: 1}}
	return c
}

// TestFromConfigPinned: what a running tether keeps until a restart
// reaches the decider's side and Envoy's alike, and a configuration that
// is valid alone but not with it is refused.
func TestFromConfigPinned(t *testing.T) {
	cfg := testConfig()
	cfg.Routing.ClusterHeader = "x-edited-cluster"
	cfg.Identity.SessionHeader = "x-edited-session"
	pin := PinnedOf(testConfig())
	p, err := FromConfig(cfg, Options{Pinned: &pin})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ what, got, want string }{
		{"Envoy's cluster header", p.Envoy.ClusterHeader, pin.ClusterHeader},
		{"ext_proc's cluster header", p.ExtProc.ClusterHeader, pin.ClusterHeader},
		{"Envoy's first hash header", p.Envoy.HashPolicy[0].Name, pin.Identity.SessionHeader},
		{"the identity's session header", p.Identity.SessionHeader, pin.Identity.SessionHeader},
	} {
		if c.got != c.want {
			t.Errorf("%s %q, want the pinned %q", c.what, c.got, c.want)
		}
	}
	if p.Pinned != pin {
		t.Errorf("plan pinned %+v, want %+v", p.Pinned, pin)
	}
	unpinned, err := FromConfig(cfg, Options{})
	if err != nil || unpinned.Envoy.ClusterHeader != "x-edited-cluster" || unpinned.Pinned != PinnedOf(cfg) {
		t.Errorf("without pins: cluster header %q, pinned %+v, %v; want the file's", unpinned.Envoy.ClusterHeader, unpinned.Pinned, err)
	}

	clash := cfg
	clash.Routing.Rules = []config.Rule{{Name: "old-header", Header: pin.ClusterHeader, Mode: config.ModeRandom}}
	if _, err := FromConfig(clash, Options{}); err != nil {
		t.Fatalf("test setup: valid alone: %v", err)
	}
	_, err = FromConfig(clash, Options{Pinned: &pin})
	if err == nil || !strings.Contains(err.Error(), "routing.rules[0].header") || !strings.Contains(err.Error(), "until a restart") {
		t.Errorf("a rule on the pinned cluster header: %v, want refused naming routing.rules[0].header", err)
	}
	bad := testConfig()
	bad.Routing.Mode = "sometimes"
	if _, err := FromConfig(bad, Options{}); err == nil || !strings.Contains(err.Error(), "routing.mode") {
		t.Errorf("invalid mode: %v, want an error naming routing.mode", err)
	}
}

// TestEnvoyExtProcEndpoints: envoy.extproc_endpoints, else the replicas
// the caller names, else server.extproc_addr.
func TestEnvoyExtProcEndpoints(t *testing.T) {
	cfg := testConfig()
	for _, tc := range []struct {
		file, opt, want []string
	}{
		{nil, nil, []string{cfg.Server.ExtProcAddr}},
		{nil, []string{"10.0.0.9:50051"}, []string{"10.0.0.9:50051"}},
		{[]string{"10.0.0.7:50051"}, []string{"10.0.0.9:50051"}, []string{"10.0.0.7:50051"}},
	} {
		c := cfg
		c.Envoy.ExtProcEndpoints = tc.file
		s, err := Envoy(c, Options{ExtProc: tc.opt})
		if err != nil || !slices.Equal(s.ExtProc, tc.want) {
			t.Errorf("file %v, options %v: %v, %v; want %v", tc.file, tc.opt, s.ExtProc, err, tc.want)
		}
	}
}

// TestEnginesPinnedAndInstances: how engines are scraped, and how old a
// reading may be, stay as tether started; which instances are scraped
// follows the file (engines.default, an instance's engine).
func TestEnginesPinnedAndInstances(t *testing.T) {
	start := config.Default()
	start.Instances = []config.Instance{{Name: "a", Address: "10.0.0.1:8000"}, {Name: "b", Address: "10.0.0.2:8000", Engine: config.EngineSGLang}}
	for i := range start.Instances {
		start.Instances[i].SetDefaults()
	}
	edit := start
	edit.Engines.Default = config.EngineVLLM
	edit.Engines.Staleness = config.Dur(30 * time.Second)
	edit.Engines.ScrapeInterval = config.Dur(5 * time.Second)
	pin := PinnedOf(start)
	p, err := FromConfig(edit, Options{Pinned: &pin})
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
