package config

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

const dnsGroup = `
[[discovery.dns]]
name = "vllm"
host = "vllm.inference.svc.cluster.local."
port = 8000
version = "v1"
engine = "vllm"
`

func TestDiscoveryDefaults(t *testing.T) {
	c, err := Parse([]byte(dnsGroup + "\n[[versions]]\nname = \"v1\"\nweight = 1\n[envoy]\ndefault_version = \"v1\"\n"))
	if err != nil {
		t.Fatalf("a group's version is a version some instance has, though none is found yet: %v", err)
	}
	want := DNSGroup{
		Name: "vllm", Host: "vllm.inference.svc.cluster.local.", Port: 8000,
		Interval: Dur(DefaultDiscoveryInterval), RemoveAfter: DefaultRemoveAfter,
		Version: "v1", Weight: 1, KVSessions: DefaultKVSessions, Capacity: CapacityOnDemand, Engine: EngineVLLM,
	}
	if diff := cmp.Diff([]DNSGroup{want}, c.Discovery.DNS); diff != "" {
		t.Errorf("group (-want +got):\n%s", diff)
	}
}

// TestDiscoveryBad: every error names the key and the value.
func TestDiscoveryBad(t *testing.T) {
	for _, tc := range []struct{ name, toml, want string }{
		{"empty name", `name = ""`, `discovery.dns[0].name = ""`},
		{"long name", `name = "a-group-name-too-long"`, `discovery.dns[0].name = "a-group-name-too-long": want 1-16`},
		{"upper-case name", `name = "VLLM"`, `discovery.dns[0].name = "VLLM"`},
		{"empty host", `host = ""`, `discovery.dns[0].host = "": want a DNS name`},
		{"host with a port", `host = "vllm:8000"`, `discovery.dns[0].host = "vllm:8000"`},
		{"no port", `port = 0`, `discovery.dns[0].port = 0: want a port from 1 to 65535`},
		{"port too high", `port = 70000`, `discovery.dns[0].port = 70000`},
		{"interval too short", `interval = "100ms"`, `discovery.dns[0].interval = 100ms: want 1s to 5m0s`},
		{"interval too long", `interval = "1h"`, `discovery.dns[0].interval = 1h0m0s: want 1s to 5m0s`},
		{"remove_after negative", `remove_after = -1`, `discovery.dns[0].remove_after = -1: want 1 to 100 lookups`},
		{"remove_after too many", `remove_after = 101`, `discovery.dns[0].remove_after = 101`},
		{"weight", `weight = -1`, `discovery.dns[0].weight = -1: want a number above 0`},
		{"kv_sessions", `kv_sessions = 200000`, `discovery.dns[0].kv_sessions = 200000`},
		{"capacity", `capacity = "cheap"`, `discovery.dns[0].capacity = "cheap": want "on-demand" or "spot"`},
		{"engine", `engine = "tgi"`, `discovery.dns[0].engine = "tgi"`},
		{"version", `version = "v 1"`, `discovery.dns[0].version = "v 1"`},
		{"metrics_port", `metrics_port = 70000`, `discovery.dns[0].metrics_port = 70000`},
		{"metrics_port of a generic engine", "engine = \"generic\"\nmetrics_port = 9000", `discovery.dns[0].metrics_port = 9000: a generic engine is not scraped`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// The bad key replaces the group's own, which TOML would refuse twice.
			key, _, _ := strings.Cut(tc.toml, " ")
			var lines []string
			for _, l := range strings.Split(dnsGroup, "\n") {
				if !strings.HasPrefix(l, key+" ") {
					lines = append(lines, l)
				}
			}
			_, err := Parse([]byte(strings.Join(lines, "\n") + "\n" + tc.toml + "\n"))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err = %v, want one naming %s", err, tc.want)
			}
		})
	}
}

func TestDiscoveryDuplicates(t *testing.T) {
	_, err := Parse([]byte(dnsGroup + dnsGroup))
	for _, want := range []string{
		`discovery.dns[1].name = "vllm": duplicate of discovery.dns[0]`,
		`discovery.dns[1].host = "vllm.inference.svc.cluster.local.": with port 8000, the same endpoints as discovery.dns[0]`,
	} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("err = %v, want %s", err, want)
		}
	}
}

// TestDiscoveredNames: a name is the group, the address with '.' and ':'
// as '-', and the port; the longest IPv6 address fits the longest group
// name in an instance name.
func TestDiscoveredNames(t *testing.T) {
	g := DNSGroup{Name: "vllm", Port: 8000, MetricsPort: 9090}
	for addr, want := range map[string]string{
		"10.0.0.5":                      "vllm-10-0-0-5-8000",
		"fd00::5":                       "vllm-fd00--5-8000",
		"2001:db8:85a3:1:2:8a2e:370:73": "vllm-2001-db8-85a3-1-2-8a2e-370-73-8000",
	} {
		in := g.Instance(netip.AddrPortFrom(netip.MustParseAddr(addr), 8000))
		if in.Name != want {
			t.Errorf("%s: name %q, want %q", addr, in.Name, want)
		}
		if !instanceName.MatchString(in.Name) {
			t.Errorf("%s: %q is not a valid instance name", addr, in.Name)
		}
	}
	long := DNSGroup{Name: strings.Repeat("a", 16), Port: 65535}
	in := long.Instance(netip.MustParseAddrPort("[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:65535"))
	if !instanceName.MatchString(in.Name) {
		t.Errorf("%q (%d characters) is not a valid instance name", in.Name, len(in.Name))
	}
	v6 := g.Instance(netip.MustParseAddrPort("[fd00::5]:8000"))
	if v6.Address != "[fd00::5]:8000" || v6.MetricsURL != "http://[fd00::5]:9090/metrics" {
		t.Errorf("address %q, metrics %q", v6.Address, v6.MetricsURL)
	}
}

// TestWithDiscovered: the file's [[instances]] win over what a group
// finds, by name or by address; an earlier group wins over a later one.
func TestWithDiscovered(t *testing.T) {
	c, err := Parse([]byte(dnsGroup + `
[[instances]]
name = "static"
address = "10.0.0.1:8000"
version = "v1"
`))
	if err != nil {
		t.Fatal(err)
	}
	g := c.Discovery.DNS[0]
	other := g
	other.Name = "other"
	found := []Instance{
		g.Instance(netip.MustParseAddrPort("10.0.0.1:8000")),          // the static one's address
		g.Instance(netip.MustParseAddrPort("10.0.0.2:8000")),          // taken
		other.Instance(netip.MustParseAddrPort("10.0.0.2:8000")),      // an earlier group's address
		other.Instance(netip.MustParseAddrPort("10.0.0.3:8000")),      // taken
		g.Instance(netip.MustParseAddrPort("[::ffff:10.0.0.3]:8000")), // the one before's, unmapped
	}
	merged, left, err := c.WithDiscovered(found)
	if err != nil {
		t.Fatal(err)
	}
	var names, leftNames []string
	for _, in := range merged.Instances {
		names = append(names, in.Name)
	}
	for _, in := range left {
		leftNames = append(leftNames, in.Name)
	}
	if diff := cmp.Diff([]string{"static", "vllm-10-0-0-2-8000", "other-10-0-0-3-8000"}, names); diff != "" {
		t.Errorf("merged (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]string{"vllm-10-0-0-1-8000", "other-10-0-0-2-8000", "vllm---ffff-10-0-0-3-8000"}, leftNames); diff != "" {
		t.Errorf("left out (-want +got):\n%s", diff)
	}
	if got := merged.Instances[1].MetricsURL; got != "http://10.0.0.2:8000/metrics" {
		t.Errorf("a discovered instance is resolved as a configured one: metrics_url %q", got)
	}
	if len(c.Instances) != 1 {
		t.Errorf("WithDiscovered changed c: %d instances", len(c.Instances))
	}
}
