package config

import (
	"strings"
	"testing"
	"time"
	_ "time/tzdata" // rule time zones on hosts without zoneinfo

	"github.com/google/go-cmp/cmp"
)

// fleet has instances of versions v1 and v2, for the routing cases.
const fleet = `
[[instances]]
name = "a"
address = "10.0.0.1:8000"
version = "v1"

[[instances]]
name = "b"
address = "10.0.0.2:8000"
version = "v2"
capacity = "spot"
kv_sessions = 64
`

const routingExample = fleet + `
[routing]
mode = "hybrid"
adaptive_sticky = 1
version_affinity = "strict"
canary_by_header = "x-canary"
bounded_load_epsilon = 0.5
tier_header = "x-tier"
saturation_inflight = 8
saturation_queue_depth = 0
queue_depth_header = "x-queue"

[[routing.rules]]
name = "premium-peak"
path_prefix = "/v1/chat"
header = "x-plan"
value = "pro"
tiers = ["gold", "platinum"]
hours = "22:00-06:00"
days = ["mon", "fri"]
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

[[routing.rules]]
name = "weekend"
days = ["sat", "sun"]
mode = "sticky"

[[versions]]
name = "v1"
weight = 9

[[versions]]
name = "v2"
weight = 1
canary = true
`

func TestParseRouting(t *testing.T) {
	c, err := Parse([]byte(routingExample))
	if err != nil {
		t.Fatal(err)
	}
	r := c.Routing
	if r.Mode != ModeHybrid || r.AdaptiveSticky != 1 || r.VersionAffinity != VersionStrict || r.CanaryByHeader != "x-canary" ||
		r.BoundedLoadEpsilon != 0.5 || r.TierHeader != "x-tier" || r.SaturationInFlight != 8 || r.SaturationQueueDepth != 0 ||
		r.QueueDepthHeader != "x-queue" {
		t.Errorf("routing: %+v", r)
	}
	want := []Rule{
		{Name: "premium-peak", PathPrefix: "/v1/chat", Header: "x-plan", Value: "pro", Tiers: []string{"gold", "platinum"},
			Hours: "22:00-06:00", Days: []string{"mon", "fri"}, Timezone: "Europe/Paris",
			Mode: ModeAdaptive, IdleTimeout: Dur(2 * time.Hour), Priority: PriorityHigh, Version: "v2"},
		{Name: "batch", Header: "x-client", Regex: "^batch-[0-9]+$", Mode: ModeRandom},
		{Name: "weekend", Days: []string{"sat", "sun"}, Timezone: DefaultTimezone, Mode: ModeSticky},
	}
	if d := cmp.Diff(want, r.Rules, cmp.AllowUnexported(Duration{}), derived); d != "" {
		t.Errorf("rules (-want +got):\n%s", d)
	}
	wantVersions := []Version{{Name: "v1", Weight: 9}, {Name: "v2", Weight: 1, Canary: true}}
	if d := cmp.Diff(wantVersions, c.Versions); d != "" {
		t.Errorf("versions (-want +got):\n%s", d)
	}
	if a, b := c.Instances[0], c.Instances[1]; a.KVSessions != DefaultKVSessions || a.Capacity != CapacityOnDemand || b.KVSessions != 64 || b.Capacity != CapacitySpot {
		t.Errorf("instances: %+v %+v", a, b)
	}
}

func TestRoutingDefaults(t *testing.T) {
	for name, c := range map[string]Config{"Default": Default(), "Parse": must(t, fleet)} {
		r := c.Routing
		if r.AdaptiveSticky != 0 || r.VersionAffinity != VersionPrefer || r.CanaryByHeader != "" ||
			r.BoundedLoadEpsilon != DefaultEpsilon || r.TierHeader != "x-user-tier" || r.SaturationInFlight != 0 ||
			r.SaturationQueueDepth != DefaultQueueDepth || r.QueueDepthHeader != "x-queue-depth" || len(r.Rules) != 0 || len(c.Versions) != 0 {
			t.Errorf("%s: routing defaults %+v", name, r)
		}
	}
}

func must(t *testing.T, toml string) Config {
	t.Helper()
	c, err := Parse([]byte(toml))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestParseRoutingGood holds inputs near the edges that must be accepted.
func TestParseRoutingGood(t *testing.T) {
	tests := []struct {
		name, toml string
		check      func(Config) bool
	}{
		{"kv_sessions 0 is the default", "[[instances]]\nname = \"a\"\naddress = \"10.0.0.1:1\"\nkv_sessions = 0",
			func(c Config) bool { return c.Instances[0].KVSessions == DefaultKVSessions }},
		{"kv_sessions at the top", "[[instances]]\nname = \"a\"\naddress = \"10.0.0.1:1\"\nkv_sessions = 100000",
			func(c Config) bool { return c.Instances[0].KVSessions == MaxKVSessions }},
		{"queue depth 0 turns it off", "[routing]\nsaturation_queue_depth = 0",
			func(c Config) bool { return c.Routing.SaturationQueueDepth == 0 }},
		{"adaptive on queue depth alone", "[routing]\nadaptive_sticky = 1",
			func(c Config) bool {
				return c.Routing.AdaptiveSticky == 1 && c.Routing.SaturationQueueDepth == DefaultQueueDepth
			}},
		{"adaptive on in-flight alone", "[routing]\nadaptive_sticky = 1\nsaturation_inflight = 3\nsaturation_queue_depth = 0",
			func(c Config) bool { return c.Routing.SaturationInFlight == 3 }},
		{"rule version without [[versions]]", fleet + "[[routing.rules]]\nname = \"r\"\nversion = \"v2\"",
			func(c Config) bool { return c.Routing.Rules[0].Version == "v2" && len(c.Versions) == 0 }},
		{"header alone matches presence", "[[routing.rules]]\nname = \"r\"\nheader = \"x-batch\"",
			func(c Config) bool { return c.Routing.Rules[0].Header == "x-batch" }},
		{"rule header may be an identity header", "[[routing.rules]]\nname = \"r\"\nheader = \"authorization\"",
			func(c Config) bool { return true }},
		{"window until midnight", "[[routing.rules]]\nname = \"r\"\nhours = \"18:00-24:00\"",
			func(c Config) bool { return c.Routing.Rules[0].Timezone == "UTC" }},
		{"no timezone without a window", "[[routing.rules]]\nname = \"r\"\npath_prefix = \"/\"",
			func(c Config) bool { return c.Routing.Rules[0].Timezone == "" }},
		{"a version of weight 0", fleet + "[[versions]]\nname = \"v1\"\nweight = 1\n[[versions]]\nname = \"v2\"\ncanary = true",
			func(c Config) bool { return c.Versions[1].Weight == 0 }},
		{"epsilon at the top", "[routing]\nbounded_load_epsilon = 10",
			func(c Config) bool { return c.Routing.BoundedLoadEpsilon == 10 }},
		{"hybrid with rules", "[routing]\nmode = \"hybrid\"\n[[routing.rules]]\nname = \"r\"\nmode = \"sticky\"",
			func(c Config) bool { return c.Routing.Mode == ModeHybrid }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if c := must(t, tc.toml); !tc.check(c) {
				t.Errorf("parsed to %+v %+v", c.Routing, c.Instances)
			}
		})
	}
}

func TestParseRoutingBad(t *testing.T) {
	rule := func(body string) string { return fleet + "[[routing.rules]]\nname = \"r\"\n" + body }
	tests := []struct {
		name, toml string
		want       []string // every string must appear in the error
	}{
		// [routing]
		{"mode", "[routing]\nmode = \"roundrobin\"", []string{"routing.mode", `"roundrobin"`, "hybrid"}},
		{"adaptive is a rule mode", "[routing]\nmode = \"adaptive\"", []string{"routing.mode", `"adaptive"`}},
		{"hybrid without rules", "[routing]\nmode = \"hybrid\"", []string{"routing.mode", `"hybrid"`, "at least one"}},
		{"adaptive_sticky 2", "[routing]\nadaptive_sticky = 2", []string{"routing.adaptive_sticky", "2"}},
		{"adaptive without thresholds", "[routing]\nadaptive_sticky = 1\nsaturation_queue_depth = 0\nsaturation_waiting = 0\nsaturation_kv_usage = 0",
			[]string{"routing.adaptive_sticky", "saturation_inflight", "saturation_queue_depth", "saturation_waiting", "saturation_kv_usage"}},
		{"waiting negative", "[routing]\nsaturation_waiting = -1", []string{"routing.saturation_waiting", "-1"}},
		{"kv usage above 1", "[routing]\nsaturation_kv_usage = 1.5", []string{"routing.saturation_kv_usage", "1.5"}},
		{"kv usage negative", "[routing]\nsaturation_kv_usage = -0.1", []string{"routing.saturation_kv_usage", "-0.1"}},
		{"kv usage nan", "[routing]\nsaturation_kv_usage = nan", []string{"routing.saturation_kv_usage", "NaN"}},
		{"version_affinity", "[routing]\nversion_affinity = \"loose\"", []string{"routing.version_affinity", `"loose"`}},
		{"epsilon 0", "[routing]\nbounded_load_epsilon = 0", []string{"routing.bounded_load_epsilon", "0"}},
		{"epsilon negative", "[routing]\nbounded_load_epsilon = -0.1", []string{"routing.bounded_load_epsilon", "-0.1"}},
		{"epsilon too big", "[routing]\nbounded_load_epsilon = 11", []string{"routing.bounded_load_epsilon", "11"}},
		{"epsilon nan", "[routing]\nbounded_load_epsilon = nan", []string{"routing.bounded_load_epsilon", "NaN"}},
		{"epsilon inf", "[routing]\nbounded_load_epsilon = inf", []string{"routing.bounded_load_epsilon", "Inf"}},
		{"negative in-flight", "[routing]\nsaturation_inflight = -1", []string{"routing.saturation_inflight", "-1"}},
		{"negative queue depth", "[routing]\nsaturation_queue_depth = -1", []string{"routing.saturation_queue_depth", "-1"}},
		{"canary header is the auth header", "[routing]\ncanary_by_header = \"authorization\"",
			[]string{"routing.canary_by_header", `"authorization"`, "identity.auth_header"}},
		{"canary header is the cluster header", "[routing]\ncanary_by_header = \"x-tether-cluster\"",
			[]string{"routing.canary_by_header", "routing.cluster_header"}},
		{"canary header upper case", "[routing]\ncanary_by_header = \"X-Canary\"", []string{"routing.canary_by_header", `"X-Canary"`}},
		{"tier header is the session header", "[routing]\ntier_header = \"x-session-id\"",
			[]string{"routing.tier_header", "identity.session_header"}},
		{"tier header is the canary header", "[routing]\ntier_header = \"x-t\"\ncanary_by_header = \"x-t\"",
			[]string{"routing.canary_by_header", "routing.tier_header"}},
		{"queue depth header", "[routing]\nqueue_depth_header = \"Queue Depth\"", []string{"routing.queue_depth_header", `"Queue Depth"`}},

		// [[routing.rules]]
		{"empty rule name", fleet + "[[routing.rules]]\npath_prefix = \"/v1\"", []string{"routing.rules[0].name", `""`, "needs a name"}},
		{"bad rule name", rule("") + "\n[[routing.rules]]\nname = \"Peak Hours\"", []string{"routing.rules[1].name", `"Peak Hours"`}},
		{"duplicate rule name", rule("") + "\n[[routing.rules]]\nname = \"r\"", []string{"routing.rules[1].name", "duplicate of routing.rules[0]"}},
		{"path prefix without slash", rule(`path_prefix = "v1/chat"`), []string{"routing.rules[0].path_prefix", `"v1/chat"`}},
		{"upper-case header", rule(`header = "X-Plan"`), []string{"routing.rules[0].header", `"X-Plan"`}},
		{"header is the cluster header", rule(`header = "x-tether-cluster"`), []string{"routing.rules[0].header", "routing.cluster_header"}},
		{"value and regex", rule("header = \"x-plan\"\nvalue = \"pro\"\nregex = \"^p\""), []string{"routing.rules[0].regex", "not both"}},
		{"value without header", rule(`value = "pro"`), []string{"routing.rules[0].value", `"pro"`, "needs header"}},
		{"regex without header", rule(`regex = "^p"`), []string{"routing.rules[0].regex", "needs header"}},
		{"invalid regex", rule("header = \"x-plan\"\nregex = \"([\""), []string{`routing.rules[0].regex = "([": invalid regex`}},
		{"empty tier", rule(`tiers = ["gold", ""]`), []string{"routing.rules[0].tiers[1]", "empty"}},
		{"hours out of range", rule(`hours = "25:00-26:00"`), []string{"routing.rules[0].hours", `"25:00-26:00"`, "HH:MM-HH:MM"}},
		{"hours without minutes", rule(`hours = "9-17"`), []string{"routing.rules[0].hours", `"9-17"`}},
		{"hours one digit", rule(`hours = "9:00-17:00"`), []string{"routing.rules[0].hours"}},
		{"hours minute 60", rule(`hours = "09:60-17:00"`), []string{"routing.rules[0].hours"}},
		{"hours equal ends", rule(`hours = "09:00-09:00"`), []string{"routing.rules[0].hours", "same time"}},
		{"hours all day", rule(`hours = "00:00-24:00"`), []string{"routing.rules[0].hours", "same time"}},
		{"hours start at 24", rule(`hours = "24:00-06:00"`), []string{"routing.rules[0].hours"}},
		{"hours one end", rule(`hours = "09:00"`), []string{"routing.rules[0].hours"}},
		{"hours three ends", rule(`hours = "09:00-12:00-17:00"`), []string{"routing.rules[0].hours"}},
		{"day spelt out", rule(`days = ["monday"]`), []string{"routing.rules[0].days[0]", `"monday"`, "mon, tue"}},
		{"day upper case", rule(`days = ["mon", "Tue"]`), []string{"routing.rules[0].days[1]", `"Tue"`}},
		{"day twice", rule(`days = ["mon", "tue", "mon"]`), []string{"routing.rules[0].days[2]", "twice"}},
		{"days not a list", rule(`days = "mon"`), []string{"days"}},
		{"unknown timezone", rule("hours = \"09:00-17:00\"\ntimezone = \"Mars/Base\""), []string{"routing.rules[0].timezone", `"Mars/Base"`}},
		{"local timezone", rule("days = [\"mon\"]\ntimezone = \"Local\""), []string{"routing.rules[0].timezone", `"Local"`}},
		{"timezone path", rule("days = [\"mon\"]\ntimezone = \"../../etc/passwd\""), []string{"routing.rules[0].timezone"}},
		{"timezone without a window", rule(`timezone = "Europe/Paris"`), []string{"routing.rules[0].timezone", "needs hours or days"}},
		{"negative idle", rule(`idle_timeout = "-5s"`), []string{"routing.rules[0].idle_timeout", "-5s"}},
		{"tiny idle", rule(`idle_timeout = "10ms"`), []string{"routing.rules[0].idle_timeout", "10ms"}},
		{"rule mode", rule(`mode = "roundrobin"`), []string{"routing.rules[0].mode", `"roundrobin"`}},
		{"hybrid is not a rule mode", rule(`mode = "hybrid"`), []string{"routing.rules[0].mode", `"hybrid"`}},
		{"adaptive rule without thresholds", "[routing]\nsaturation_queue_depth = 0\nsaturation_waiting = 0\nsaturation_kv_usage = 0\n" + rule(`mode = "adaptive"`),
			[]string{"routing.rules[0].mode", `"adaptive"`, "saturation_inflight"}},
		{"priority", rule(`priority = "urgent"`), []string{"routing.rules[0].priority", `"urgent"`}},
		{"unknown version", rule(`version = "v9"`), []string{"routing.rules[0].version", `"v9"`, "unknown version"}},
		{"rule version without instances", "[[routing.rules]]\nname = \"r\"\nversion = \"default\"", []string{"routing.rules[0].version", "unknown version"}},
		{"unknown rule key", rule(`header_value = "x"`), []string{"routing.rules.header_value"}},
		{"every bad rule is reported", rule(`mode = "x"`) + "\n[[routing.rules]]\nname = \"s\"\npriority = \"y\"",
			[]string{"routing.rules[0].mode", "routing.rules[1].priority"}},

		// [[versions]]
		{"unknown version name", fleet + "[[versions]]\nname = \"v9\"\nweight = 1", []string{"versions[0].name", `"v9"`, "unknown version"}},
		{"bad version name", fleet + "[[versions]]\nname = \"v 1\"\nweight = 1", []string{"versions[0].name", `"v 1"`}},
		{"duplicate version", fleet + "[[versions]]\nname = \"v1\"\nweight = 1\n[[versions]]\nname = \"v1\"\nweight = 2",
			[]string{"versions[1].name", "duplicate of versions[0]"}},
		{"weights sum to zero", fleet + "[[versions]]\nname = \"v1\"\nweight = 0\n[[versions]]\nname = \"v2\"\nweight = 0",
			[]string{"versions = [0 0]", "weights sum to zero"}},
		{"weight left out", fleet + "[[versions]]\nname = \"v1\"", []string{"versions", "weights sum to zero"}},
		{"negative weight", fleet + "[[versions]]\nname = \"v1\"\nweight = -1\n[[versions]]\nname = \"v2\"\nweight = 1",
			[]string{"versions[0].weight", "-1"}},
		{"weight nan", fleet + "[[versions]]\nname = \"v1\"\nweight = nan", []string{"versions[0].weight", "NaN"}},
		{"weight inf", fleet + "[[versions]]\nname = \"v1\"\nweight = inf", []string{"versions[0].weight", "+Inf"}},
		{"weight too big", fleet + "[[versions]]\nname = \"v1\"\nweight = 2e6", []string{"versions[0].weight", "2e+06"}},
		{"unknown versions key", fleet + "[[versions]]\nname = \"v1\"\nweight = 1\nshare = 1", []string{"versions.share"}},
		{"versions without instances", "[[versions]]\nname = \"default\"\nweight = 1", []string{"versions[0].name", "unknown version"}},

		// [[instances]]
		{"pool", "[[instances]]\nname = \"a\"\naddress = \"10.0.0.1:1\"\npool = \"preemptible\"", []string{"instances[0].pool", `"preemptible"`}},
		{"capacity", "[[instances]]\nname = \"a\"\naddress = \"10.0.0.1:1\"\ncapacity = \"preemptible\"", []string{"instances[0].capacity", `"preemptible"`}},
		{"pool and capacity", "[[instances]]\nname = \"a\"\naddress = \"10.0.0.1:1\"\ncapacity = \"spot\"\npool = \"on-demand\"", []string{"instances[0].pool", "set capacity alone"}},
		{"kv_sessions negative", "[[instances]]\nname = \"a\"\naddress = \"10.0.0.1:1\"\nkv_sessions = -1", []string{"instances[0].kv_sessions", "-1"}},
		{"kv_sessions too big", "[[instances]]\nname = \"a\"\naddress = \"10.0.0.1:1\"\nkv_sessions = 100001", []string{"instances[0].kv_sessions", "100001"}},
		{"kv_sessions not a number", "[[instances]]\nname = \"a\"\naddress = \"10.0.0.1:1\"\nkv_sessions = \"many\"", []string{"kv_sessions"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.toml))
			if err == nil {
				t.Fatal("want an error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
}

func TestRuleWindow(t *testing.T) {
	paris, err := time.LoadLocation("Europe/Paris")
	if err != nil {
		t.Fatal(err)
	}
	h := time.Hour
	tests := []struct {
		name string
		rule Rule
		want *Window
	}{
		{"none", Rule{}, nil},
		{"office hours", Rule{Hours: "09:00-17:30"}, &Window{From: 9 * h, To: 17*h + 30*time.Minute, Location: time.UTC}},
		{"night wraps", Rule{Hours: "22:00-06:00", Days: []string{"fri", "sat"}, Timezone: "Europe/Paris"},
			&Window{From: 22 * h, To: 6 * h, Days: []time.Weekday{time.Friday, time.Saturday}, Location: paris}},
		{"until midnight", Rule{Hours: "18:00-24:00"}, &Window{From: 18 * h, To: 24 * h, Location: time.UTC}},
		{"ends at midnight", Rule{Hours: "18:00-00:00"}, &Window{From: 18 * h, To: 0, Location: time.UTC}},
		{"days only", Rule{Days: []string{"sun"}, Timezone: "UTC"}, &Window{To: 24 * h, Days: []time.Weekday{time.Sunday}, Location: time.UTC}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tc.rule.window()
			if err != nil {
				t.Fatal(err)
			}
			if d := cmp.Diff(tc.want, got, cmp.Comparer(func(a, b *time.Location) bool {
				return a == nil && b == nil || a != nil && b != nil && a.String() == b.String()
			})); d != "" {
				t.Errorf("window (-want +got):\n%s", d)
			}
		})
	}
	if _, err := (Rule{Hours: "9-17"}).window(); err == nil || !strings.Contains(err.Error(), `hours "9-17"`) {
		t.Errorf("bad hours: %v", err)
	}
	if _, err := (Rule{Days: []string{"mon", "xyz"}}).window(); err == nil || !strings.Contains(err.Error(), `days[1] "xyz"`) {
		t.Errorf("bad day: %v", err)
	}
}

func TestRulePattern(t *testing.T) {
	if re, err := (Rule{}).compile(); re != nil || err != nil {
		t.Errorf("no regex: %v %v", re, err)
	}
	re, err := (Rule{Regex: "^batch-[0-9]+$"}).compile()
	if err != nil || !re.MatchString("batch-12") || re.MatchString("xbatch-1") {
		t.Errorf("regex: %v %v", re, err)
	}
	if _, err := (Rule{Regex: "(["}).compile(); err == nil {
		t.Error("invalid regex compiled")
	}
}

func TestInstancesetDefaults(t *testing.T) {
	in := Instance{Name: "a", Address: "10.0.0.1:1", Pool: CapacitySpot}
	in.setDefaults()
	want := Instance{Name: "a", Address: "10.0.0.1:1", Version: DefaultVersion, Weight: 1, KVSessions: DefaultKVSessions,
		Capacity: CapacitySpot, Pool: CapacitySpot}
	if in != want {
		t.Errorf("got %+v, want %+v", in, want)
	}
	set := Instance{Version: "v2", Weight: 3, KVSessions: 7}
	set.setDefaults()
	if set.Version != "v2" || set.Weight != 3 || set.KVSessions != 7 {
		t.Errorf("setDefaults changed set fields: %+v", set)
	}
}

// TestValidateBuiltConfig: configs built in code (tests, the admin API)
// leave kv_sessions at 0, which Validate takes as the default.
func TestValidateBuiltConfig(t *testing.T) {
	c := Default()
	c.Instances = []Instance{{Name: "a", Address: "10.0.0.1:1", Version: "v1", Weight: 1}}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	c.Instances[0].Pool = "preemptible"
	c.Instances[0].KVSessions = -1
	err := c.Validate()
	if err == nil || !strings.Contains(err.Error(), "instances[0].pool") || !strings.Contains(err.Error(), "instances[0].kv_sessions") {
		t.Fatalf("err %v", err)
	}
}

func FuzzRuleWindow(f *testing.F) {
	for _, s := range []string{"09:00-17:00", "22:00-06:00", "18:00-24:00", "9-17", "24:00-01:00", "00:00-24:00", ""} {
		f.Add(s, "mon", "Europe/Paris")
	}
	f.Fuzz(func(t *testing.T, hours, day, zone string) {
		w, err := Rule{Hours: hours, Days: []string{day}, Timezone: zone}.window()
		if err != nil {
			return
		}
		if w.From < 0 || w.From >= 24*time.Hour || w.To < 0 || w.To > 24*time.Hour || w.From == w.To || w.Location == nil {
			t.Fatalf("%q %q %q: window %+v", hours, day, zone, w)
		}
	})
}

func TestReportHeaders(t *testing.T) {
	c := Default()
	if c.Routing.OOMHeader != "x-oom" || c.Routing.GPUUtilizationHeader != "x-gpu-utilization" {
		t.Fatalf("defaults: %q, %q", c.Routing.OOMHeader, c.Routing.GPUUtilizationHeader)
	}
	for _, tc := range []struct{ toml, want string }{
		{"[routing]\noom_header = \"X-OOM\"", "routing.oom_header"},
		{"[routing]\ngpu_utilization_header = \"x-queue-depth\"", "already used by routing.queue_depth_header"},
		{"[routing]\ngpu_utilization_header = \"bad header\"", "routing.gpu_utilization_header"},
	} {
		if _, err := Parse([]byte(tc.toml)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want one naming %q", tc.toml, err, tc.want)
		}
	}
}
