package config

import (
	"errors"
	"fmt"
	"net/netip"
)

// Instance is one model server ([[instances]]). The admin API decodes it
// from JSON.
type Instance struct {
	Name    string  `toml:"name" json:"name"`
	Address string  `toml:"address" json:"address"`
	Zone    string  `toml:"zone" json:"zone"`
	Version string  `toml:"version" json:"version"`
	Weight  float64 `toml:"weight" json:"weight"`
	// KVSessions is how many conversations' KV cache the instance holds.
	// Placement never counts it overloaded below that. 0 means the
	// default.
	KVSessions int `toml:"kv_sessions" json:"kv_sessions"`
	// Capacity is "on-demand", the default, or "spot". A spot instance may
	// be reclaimed at short notice.
	Capacity string `toml:"capacity" json:"capacity"`
	// Pool is capacity's older name, still read. setDefaults takes it
	// into Capacity when Capacity is unset.
	Pool string `toml:"pool" json:"pool,omitempty"`
	// Engine is what serves the instance: "vllm", "sglang" or "generic".
	// "" follows engines.default. MetricsURL is where a vllm or sglang
	// engine serves its metrics. "" means http://<address>/metrics.
	// Validate fills both in.
	Engine     string `toml:"engine" json:"engine,omitempty"`
	MetricsURL string `toml:"metrics_url" json:"metrics_url,omitempty"`
}

// Defaults and bounds of an instance.
const (
	DefaultVersion    = "default"
	DefaultKVSessions = 20
	MaxKVSessions     = 100000
)

// An instance's capacity.
const (
	CapacityOnDemand = "on-demand"
	CapacitySpot     = "spot" // may be reclaimed at short notice
)

// setDefaults fills in the instance's unset version, weight, kv_sessions
// and capacity. Capacity comes from pool, its older name, when that is
// set. An entry of [[instances]], or a JSON instance, starts from zero. So
// zero is unset there. Validate calls setDefaults.
func (in *Instance) setDefaults() {
	if in.Version == "" {
		in.Version = DefaultVersion
	}
	if in.Weight == 0 {
		in.Weight = 1
	}
	if in.KVSessions == 0 {
		in.KVSessions = DefaultKVSessions
	}
	if in.Capacity == "" {
		in.Capacity = in.Pool
	}
	if in.Capacity == "" {
		in.Capacity = CapacityOnDemand
	}
}

func (c *Config) validateInstances(bad reporter) {
	seen := map[string]int{}
	for i, in := range c.Instances {
		key := fmt.Sprintf("instances[%d]", i)
		if !instanceName.MatchString(in.Name) {
			bad(key+".name", in.Name, "want 1-63 lower-case letters, digits, '.', '_' or '-', starting and ending with a letter or digit")
		} else if j, dup := seen[in.Name]; dup {
			bad(key+".name", in.Name, fmt.Sprintf("duplicate of instances[%d]", j))
		} else {
			seen[in.Name] = i
		}
		c.validateInstance(key, in, bad)
	}
}

// validateInstance checks the instance in at key, but its name: its
// address and attributes. [[discovery.dns]] checks a group's attributes
// with it too.
func (c *Config) validateInstance(key string, in Instance, bad reporter) {
	if err := ipPort(in.Address); err != nil {
		bad(key+".address", in.Address, err.Error())
	}
	if !versionName.MatchString(in.Version) {
		bad(key+".version", in.Version, "want 1-63 letters, digits, '.', '_' or '-'")
	}
	if !(in.Weight > 0) || in.Weight > 1e6 {
		bad(key+".weight", in.Weight, "want a number above 0 and at most 1e6")
	}
	// 0 is the default: kv_sessions left out. Parse and setDefaults
	// fill it in.
	if in.KVSessions < 0 || in.KVSessions > MaxKVSessions {
		bad(key+".kv_sessions", in.KVSessions, fmt.Sprintf("want 1 to %d", MaxKVSessions))
	}
	if in.Engine != "" && !validEngine(in.Engine) {
		bad(key+".engine", in.Engine, engineKinds)
	}
	if in.MetricsURL != "" {
		if why := checkMetricsURL(in.MetricsURL); why != "" {
			bad(key+".metrics_url", in.MetricsURL, why)
		} else if c.engineOf(in) == EngineGeneric {
			bad(key+".metrics_url", in.MetricsURL, `a generic engine is not scraped; set the instance's engine to "vllm" or "sglang"`)
		}
	}
	// "" is unset, as kv_sessions 0 is. setDefaults fills it in.
	capacity, capKey := in.Capacity, key+".capacity"
	if in.Pool != "" && (capacity == "" || capacity == in.Pool) {
		capacity, capKey = in.Pool, key+".pool" // the file said pool
	}
	switch {
	case capacity != "" && capacity != CapacityOnDemand && capacity != CapacitySpot:
		bad(capKey, capacity, `want "on-demand" or "spot"`)
	case in.Pool != "" && in.Capacity != "" && in.Pool != in.Capacity:
		bad(key+".pool", in.Pool, fmt.Sprintf("the older name of capacity, which says %q: set capacity alone", in.Capacity))
	}
}

// ipPort checks an upstream address. Envoy's static and EDS endpoints take
// an IP address, not a host name, and a real port.
func ipPort(s string) error {
	ap, err := netip.ParseAddrPort(s)
	if err != nil {
		return errors.New("want IP:port (host names are not resolved; use the instance's IP)")
	}
	if ap.Port() == 0 {
		return errors.New("want a port from 1 to 65535")
	}
	return nil
}
