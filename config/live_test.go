package config

import (
	"reflect"
	"slices"
	"testing"
)

// TestrestartKeys: the tags give the restart-only keys, a section's tag
// covering its keys and a key's own tag winning inside it.
func TestRestartKeys(t *testing.T) {
	keys := restartKeys()
	for _, want := range []string{
		"server.extproc_addr", "redis.url", "identity.session_header", "routing.cluster_header",
		"routing.failure_threshold", "engines.scrape_interval", "xds.addr", "audit.enabled", "tls.cert_file",
	} {
		if !slices.Contains(keys, want) {
			t.Errorf("%s is not restart-only", want)
		}
	}
	for _, live := range []string{"routing.mode", "routing.idle_timeout", "engines.default", "tls.envoy.ca_file", "envoy.retries", "instances"} {
		if slices.Contains(keys, live) {
			t.Errorf("%s is restart-only, want live", live)
		}
	}
}

// TestRunningKeepsrestartKeys: a live edit changes the live keys, keeps
// every restart-only one at its start value, and is reported by
// RestartChanges.
func TestRunningKeepsrestartKeys(t *testing.T) {
	start := Default()
	next := start
	next.Routing.Mode = ModeRandom
	next.Routing.ClusterHeader = "x-other-cluster"
	next.Server.LogLevel = "debug"
	next.Engines.Default = EngineVLLM
	next.Engines.ScrapeInterval = Dur(2 * start.Engines.ScrapeInterval.D)
	run, held, err := Running(start, start, next)
	if err != nil || held != "" {
		t.Fatalf("Running: %v, held %q", err, held)
	}
	if run.Routing.Mode != ModeRandom || run.Engines.Default != EngineVLLM {
		t.Errorf("live keys not applied: mode %s, engines.default %s", run.Routing.Mode, run.Engines.Default)
	}
	if run.Routing.ClusterHeader != start.Routing.ClusterHeader || run.Server.LogLevel != start.Server.LogLevel ||
		run.Engines.ScrapeInterval != start.Engines.ScrapeInterval {
		t.Errorf("restart-only keys changed: %q %q %v", run.Routing.ClusterHeader, run.Server.LogLevel, run.Engines.ScrapeInterval)
	}
	got := RestartChanges(start, next)
	want := []string{"server.log_level", "routing.cluster_header", "engines.scrape_interval"}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("RestartChanges = %v, want %v", got, want)
	}
}

// TestRunningRefuses: an edit valid on its own but not with what tether
// keeps until a restart is refused (the tier header named as the routing
// header tether still runs with, which Envoy strips from every request).
func TestRunningRefuses(t *testing.T) {
	start := Default()
	next := start
	next.Routing.ClusterHeader = "x-new-cluster"
	next.Routing.TierHeader = DefaultClusterHeader
	if err := next.Validate(); err != nil {
		t.Fatalf("next alone: %v", err)
	}
	if _, _, err := Running(start, start, next); err == nil {
		t.Fatal("Running accepted a tier header that is the routing header tether runs with")
	}
}

// restartKeys lists the restart-only keys, as `section.key` (an array of
// tables' keys under the array's name, as docs/config.md names them).
func restartKeys() []string {
	var keys []string
	walkKeys(reflect.TypeFor[Config](), "", false, func(key string, _ []int, restart bool) {
		if restart {
			keys = append(keys, key)
		}
	})
	return keys
}
