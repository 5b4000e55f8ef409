package config

import (
	"fmt"
	"net/netip"
	"regexp"
	"slices"
	"strings"
	"time"
)

// Discovery finds instances beside the static [[instances]] ([discovery]).
type Discovery struct {
	// DNS follows the addresses behind DNS names, one group a name
	// ([[discovery.dns]]).
	DNS []DNSGroup `toml:"dns"`
}

// DNSGroup is the engines behind one DNS name: a Kubernetes headless
// Service or a compose service. Every address the name resolves to is an
// instance with the group's attributes, named by Instance.
type DNSGroup struct {
	// Name names the group. It starts the name of every instance found.
	Name string `toml:"name"`
	// Host is the DNS name resolved, for A and AAAA records.
	Host string `toml:"host"`
	// Port is the engines' port. A and AAAA records carry no port.
	Port int `toml:"port"`
	// Interval is how often Host is resolved again.
	Interval Duration `toml:"interval"`
	// RemoveAfter is how many answers in a row must leave an address out
	// before its instance leaves. An answer adds an address at once.
	RemoveAfter int `toml:"remove_after"`

	// The attributes every instance found gets, as in [[instances]].
	Zone       string  `toml:"zone"`
	Version    string  `toml:"version"`
	Weight     float64 `toml:"weight"`
	KVSessions int     `toml:"kv_sessions"`
	Capacity   string  `toml:"capacity"`
	Engine     string  `toml:"engine"`
	// MetricsPort is the port of the engines' /metrics when it is not
	// Port, as when a sidecar serves them. 0 means Port.
	MetricsPort int `toml:"metrics_port"`
}

// Defaults and bounds of a [[discovery.dns]] group.
const (
	DefaultDiscoveryInterval = 5 * time.Second
	MinDiscoveryInterval     = time.Second
	MaxDiscoveryInterval     = 5 * time.Minute
	DefaultRemoveAfter       = 3
	MaxRemoveAfter           = 100
	// MaxDiscovered bounds the addresses one group takes from an answer.
	// Past it, the lowest addresses in byte order are taken. So the set
	// stays the same whatever order the answer lists them in.
	MaxDiscovered = 256
)

// groupName leaves room in an instance's 63 characters for the longest
// IPv6 address (39) and port (5), with their two dashes.
var groupName = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,14}[a-z0-9])?$`)

// dnsHost is a DNS name: labels of letters, digits, '-' and '_' (SRV-style
// names), with an optional final dot.
var dnsHost = regexp.MustCompile(`^([A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?\.)*[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?\.?$`)

// setDefaults fills in the group's unset interval and remove_after, and
// the attributes an instance fills in. A [[discovery.dns]] entry starts
// from zero, so zero is unset there.
func (g *DNSGroup) setDefaults() {
	if g.Interval.D == 0 {
		g.Interval = Dur(DefaultDiscoveryInterval)
	}
	if g.RemoveAfter == 0 {
		g.RemoveAfter = DefaultRemoveAfter
	}
	in := Instance{Version: g.Version, Weight: g.Weight, KVSessions: g.KVSessions, Capacity: g.Capacity}
	in.setDefaults()
	g.Version, g.Weight, g.KVSessions, g.Capacity = in.Version, in.Weight, in.KVSessions, in.Capacity
}

// Instance is the instance at ap, with the group's attributes. Its name is
// <group>-<address>-<port>, the address with '.' and ':' written '-'. So
// 10.0.0.5:8000 in group vllm is vllm-10-0-0-5-8000, and [fd00::5]:8000
// is vllm-fd00--5-8000. The name stays while the address does.
func (g DNSGroup) Instance(ap netip.AddrPort) Instance {
	addr := strings.NewReplacer(".", "-", ":", "-").Replace(ap.Addr().String())
	in := Instance{
		Name: fmt.Sprintf("%s-%s-%d", g.Name, addr, ap.Port()), Address: ap.String(),
		Zone: g.Zone, Version: g.Version, Weight: g.Weight, KVSessions: g.KVSessions,
		Capacity: g.Capacity, Engine: g.Engine,
	}
	if g.MetricsPort != 0 {
		in.MetricsURL = "http://" + netip.AddrPortFrom(ap.Addr(), uint16(g.MetricsPort)).String() + "/metrics"
	}
	return in
}

func (c *Config) validateDiscovery(bad reporter) {
	names := map[string]int{}
	targets := map[string]int{}
	for i, g := range c.Discovery.DNS {
		key := fmt.Sprintf("discovery.dns[%d]", i)
		if !groupName.MatchString(g.Name) {
			bad(key+".name", g.Name, "want 1-16 lower-case letters, digits or '-', starting and ending with a letter or digit")
		} else if j, dup := names[g.Name]; dup {
			bad(key+".name", g.Name, fmt.Sprintf("duplicate of discovery.dns[%d]", j))
		} else {
			names[g.Name] = i
		}
		if len(g.Host) > 254 || !dnsHost.MatchString(g.Host) {
			bad(key+".host", g.Host, "want a DNS name, such as vllm.inference.svc.cluster.local.")
		}
		if g.Port < 1 || g.Port > 65535 {
			bad(key+".port", g.Port, "want a port from 1 to 65535")
		}
		target := fmt.Sprintf("%s:%d", strings.ToLower(strings.TrimSuffix(g.Host, ".")), g.Port)
		if j, dup := targets[target]; dup {
			bad(key+".host", g.Host, fmt.Sprintf("with port %d, the same endpoints as discovery.dns[%d]", g.Port, j))
		} else {
			targets[target] = i
		}
		if d := g.Interval.D; d < MinDiscoveryInterval || d > MaxDiscoveryInterval {
			bad(key+".interval", g.Interval, fmt.Sprintf("want %s to %s", MinDiscoveryInterval, MaxDiscoveryInterval))
		}
		if g.RemoveAfter < 1 || g.RemoveAfter > MaxRemoveAfter {
			bad(key+".remove_after", g.RemoveAfter, fmt.Sprintf("want 1 to %d lookups", MaxRemoveAfter))
		}
		if g.MetricsPort < 0 || g.MetricsPort > 65535 {
			bad(key+".metrics_port", g.MetricsPort, "want 0 (the engines' port) or a port from 1 to 65535")
			g.MetricsPort = 0
		} else if g.MetricsPort != 0 && c.engineOf(Instance{Engine: g.Engine}) == EngineGeneric {
			bad(key+".metrics_port", g.MetricsPort, `a generic engine is not scraped; set the group's engine to "vllm" or "sglang"`)
			g.MetricsPort = 0
		}
		if g.Port >= 1 && g.Port <= 65535 {
			// The attributes, checked as an instance's: the address is any.
			in := g.Instance(netip.AddrPortFrom(netip.AddrFrom4([4]byte{192, 0, 2, 1}), uint16(g.Port)))
			c.validateInstance(key, in, bad)
		}
	}
}

// WithDiscovered returns c with found, the instances discovery found,
// after its [[instances]]. An instance found is left out when an instance
// before it has its name or its address: the [[instances]] of the file win
// over every group, and an earlier group over a later one. left lists
// those left out. The result is validated. An error means it is invalid,
// and c stays as it is.
func (c Config) WithDiscovered(found []Instance) (merged Config, left []Instance, err error) {
	names, addrs := map[string]bool{}, map[netip.AddrPort]bool{}
	have := func(in Instance) bool {
		ap, err := netip.ParseAddrPort(in.Address)
		if err == nil {
			ap = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
		}
		dup := names[in.Name] || (err == nil && addrs[ap])
		names[in.Name] = true
		if err == nil {
			addrs[ap] = true
		}
		return dup
	}
	for _, in := range c.Instances {
		have(in)
	}
	merged = c
	merged.Instances = slices.Clip(slices.Clone(c.Instances))
	for _, in := range found {
		if have(in) {
			left = append(left, in)
			continue
		}
		merged.Instances = append(merged.Instances, in)
	}
	if err := merged.Validate(); err != nil {
		return c, nil, err
	}
	return merged, left, nil
}
