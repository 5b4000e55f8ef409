package plan

import (
	"regexp"
	"strings"
	"testing"
	"time"
	_ "time/tzdata" // rule time zones on hosts without zoneinfo

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/fleet"
)

const policyExample = `
[routing]
mode = "hybrid"
max_sticky_duration = 3600
idle_timeout = "20m"
adaptive_sticky = 1
version_affinity = "strict"
canary_by_header = "x-canary"
bounded_load_epsilon = 0.5
tier_header = "x-tier"
saturation_inflight = 8
saturation_queue_depth = 0
saturation_waiting = 7
saturation_kv_usage = 0.9

[[routing.rules]]
name = "premium-peak"
path_prefix = "/v1/chat"
header = "x-plan"
value = "pro"
tiers = ["gold", "platinum"]
hours = "22:00-06:00"
days = ["fri", "sat"]
timezone = "Europe/Paris"
mode = "adaptive"
idle_timeout = "2h"
priority = "high"
version = "v2"

[[routing.rules]]
name = "batch"
header = "x-client"
regex = "^batch-[0-9]+$"
mode = "random"
priority = "normal"

[[routing.rules]]
name = "weekend"
days = ["sun"]
mode = "sticky"

[[routing.rules]]
name = "keep"
hours = "09:00-17:00"

[[versions]]
name = "v1"
weight = 9

[[versions]]
name = "v2"
weight = 1
canary = true

[[instances]]
name = "a"
address = "10.0.0.1:8000"
zone = "z1"
version = "v1"
weight = 2

[[instances]]
name = "b"
address = "10.0.0.2:8000"
version = "v2"
capacity = "spot"
kv_sessions = 64
`

func TestPolicy(t *testing.T) {
	cfg, err := config.Parse([]byte(policyExample))
	if err != nil {
		t.Fatal(err)
	}
	paris, err := time.LoadLocation("Europe/Paris")
	if err != nil {
		t.Fatal(err)
	}
	want := affinity.Policy{
		Mode:     affinity.Hybrid,
		Lifetime: bindings.Lifetime{Idle: 20 * time.Minute, Max: time.Hour},
		Rules: []affinity.Rule{
			{
				Name: "premium-peak", PathPrefix: "/v1/chat", Header: "x-plan", Value: "pro", Tiers: []string{"gold", "platinum"},
				Window: &affinity.Window{From: 22 * time.Hour, To: 6 * time.Hour, Days: []time.Weekday{time.Friday, time.Saturday}, Location: paris},
				Mode:   affinity.Adaptive, Idle: 2 * time.Hour, Priority: affinity.High, Version: "v2",
			},
			{Name: "batch", Header: "x-client", Regex: regexp.MustCompile(`^batch-[0-9]+$`), Mode: affinity.Random, Priority: affinity.Normal},
			// A sticky rule under adaptive_sticky = 1 is adaptive.
			{Name: "weekend", Window: &affinity.Window{To: 24 * time.Hour, Days: []time.Weekday{time.Sunday}, Location: time.UTC}, Mode: affinity.Adaptive},
			{Name: "keep", Window: &affinity.Window{From: 9 * time.Hour, To: 17 * time.Hour, Location: time.UTC}},
		},
		Versions:        []affinity.VersionWeight{{Name: "v1", Weight: 9}, {Name: "v2", Weight: 1, Canary: true}},
		VersionAffinity: affinity.Strict,
		CanaryHeader:    "x-canary",
		Epsilon:         0.5,
		Saturation:      affinity.Saturation{InFlight: 8, QueueDepth: 0, Waiting: 7, KVUsage: 0.9, Stale: config.DefaultStaleness},
		TierHeader:      "x-tier",
		Fallback:        affinity.Gradual,
		Content: affinity.Content{Enabled: true, MinBlocks: 4, BlockTokens: config.DefaultBlockBytes / config.CharsPerToken,
			QueuedTokens: config.DefaultQueuedTokens, RunningTokens: config.DefaultRunningTokens},
	}
	opts := cmp.Options{
		cmpopts.IgnoreUnexported(affinity.Policy{}),
		cmp.Comparer(func(a, b *regexp.Regexp) bool {
			return a == nil && b == nil || a != nil && b != nil && a.String() == b.String()
		}),
		cmp.Comparer(func(a, b *time.Location) bool {
			return a == nil && b == nil || a != nil && b != nil && a.String() == b.String()
		}),
	}
	if d := cmp.Diff(want, mustPolicy(t, cfg), opts); d != "" {
		t.Errorf("policy (-want +got):\n%s", d)
	}

	// The translated window is the one the operator meant: Friday 23:30 and
	// the small hours of Sunday (Saturday's night) in Paris, not Sunday night.
	w := mustPolicy(t, cfg).Rules[0].Window
	for at, in := range map[string]bool{
		"2025-06-06T23:30:00+02:00": true, "2025-06-08T05:59:00+02:00": true,
		"2025-06-08T23:30:00+02:00": false, "2025-06-06T21:30:00Z": true, "2025-06-06T12:00:00+02:00": false,
	} {
		ts, err := time.Parse(time.RFC3339, at)
		if err != nil {
			t.Fatal(err)
		}
		if got := w.Contains(ts); got != in {
			t.Errorf("window contains %s = %v, want %v", at, got, in)
		}
	}
}

func TestPolicyFallback(t *testing.T) {
	for _, f := range []string{"gradual", "random", "none"} {
		c := config.Default()
		c.Routing.FallbackPolicy = f
		if got := mustPolicy(t, c).Fallback; string(got) != f {
			t.Errorf("fallback_policy %q became %q", f, got)
		}
	}
}

func TestPolicyDefaults(t *testing.T) {
	p := mustPolicy(t, config.Default())
	want := affinity.Policy{
		Mode:            affinity.Sticky,
		Lifetime:        bindings.Lifetime{Idle: config.DefaultIdleTimeout, Max: config.DefaultMaxStickyDuration},
		VersionAffinity: affinity.Prefer,
		Epsilon:         config.DefaultEpsilon,
		Saturation: affinity.Saturation{QueueDepth: config.DefaultQueueDepth, Waiting: config.DefaultWaiting,
			KVUsage: config.DefaultKVUsage, Stale: config.DefaultStaleness},
		TierHeader: config.DefaultTierHeader,
		Fallback:   affinity.Gradual,
		Content: affinity.Content{Enabled: true, MinBlocks: config.DefaultMinMatchBytes / config.DefaultBlockBytes,
			BlockTokens: config.DefaultBlockBytes / config.CharsPerToken, QueuedTokens: config.DefaultQueuedTokens, RunningTokens: config.DefaultRunningTokens},
	}
	if d := cmp.Diff(want, p, cmpopts.IgnoreUnexported(affinity.Policy{})); d != "" {
		t.Errorf("policy (-want +got):\n%s", d)
	}
}

func TestPolicyMode(t *testing.T) {
	tests := []struct {
		mode   string
		sticky int
		want   affinity.Mode
	}{
		{config.ModeSticky, 1, affinity.Sticky},
		{config.ModeSticky, 0, affinity.Random},
		{config.ModeRandom, 1, affinity.Random},
		{config.ModeRandom, 0, affinity.Random},
		{config.ModeHybrid, 1, affinity.Hybrid},
		{config.ModeHybrid, 0, affinity.Random},
	}
	for _, tc := range tests {
		c := config.Default()
		c.Routing.Mode, c.Routing.StickyEnabled = tc.mode, tc.sticky
		if got := mustPolicy(t, c).Mode; got != tc.want {
			t.Errorf("mode %s, sticky_enabled %d: %s, want %s", tc.mode, tc.sticky, got, tc.want)
		}
	}
	for va, want := range map[string]affinity.VersionAffinity{"strict": affinity.Strict, "prefer": affinity.Prefer, "none": affinity.AnyVersion} {
		c := config.Default()
		c.Routing.VersionAffinity = va
		if got := mustPolicy(t, c).VersionAffinity; got != want {
			t.Errorf("version_affinity %s: %s, want %s", va, got, want)
		}
	}
}

func TestInstances(t *testing.T) {
	cfg, err := config.Parse([]byte(policyExample))
	if err != nil {
		t.Fatal(err)
	}
	want := []fleet.Instance{
		{Name: "a", Address: "10.0.0.1:8000", Zone: "z1", Version: "v1", Weight: 2, KVSessions: config.DefaultKVSessions, Capacity: config.CapacityOnDemand},
		{Name: "b", Address: "10.0.0.2:8000", Version: "v2", Weight: 1, KVSessions: 64, Capacity: fleet.Spot},
	}
	if d := cmp.Diff(want, Instances(cfg)); d != "" {
		t.Errorf("instances (-want +got):\n%s", d)
	}
	// An instance built in code (the admin API, tests) leaves kv_sessions
	// 0, which config.Validate fills in.
	built := config.Default()
	built.Instances = []config.Instance{{Name: "c", Address: "10.0.0.3:8000"}}
	if err := built.Validate(); err != nil {
		t.Fatal(err)
	}
	if got := Instances(built)[0].KVSessions; got != config.DefaultKVSessions {
		t.Errorf("kv_sessions %d, want the default %d", got, config.DefaultKVSessions)
	}
}

func TestPolicyRefusesUnvalidatedRule(t *testing.T) {
	c := config.Default()
	c.Routing.Rules = []config.Rule{{Name: "r", Header: "x", Regex: "(["}}
	if _, err := policy(c); err == nil || !strings.Contains(err.Error(), "routing.rules[0] (r)") {
		t.Errorf("Policy of an invalid rule: %v, want an error naming it", err)
	}
}

func TestStickyDisabledTurnsRulesRandom(t *testing.T) {
	c := config.Default()
	c.Routing.StickyEnabled = 0
	c.Routing.Rules = []config.Rule{{Name: "r", PathPrefix: "/", Mode: config.ModeSticky}}
	if p := mustPolicy(t, c); p.Mode != affinity.Random || p.Rules[0].Mode != affinity.Random {
		t.Errorf("sticky_enabled = 0: mode %s, rule mode %s; want random for both", p.Mode, p.Rules[0].Mode)
	}
}

func mustPolicy(t *testing.T, c config.Config) affinity.Policy {
	t.Helper()
	p, err := policy(c)
	if err != nil {
		t.Fatal(err)
	}
	return p
}
