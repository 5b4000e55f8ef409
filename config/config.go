// Package config reads tether's TOML configuration, fills in defaults and
// validates it. Errors name the key and the bad value.
//
// One file per section holds its type, its defaults and its validation:
// server.go, redis.go, routing.go with rules.go, identity.go,
// instances.go, envoy.go, audit.go and tls.go. load.go decodes the file.
// files.go reads what it names on this host.
//
// Whether a key was set is never recorded beside it. Parse decodes the
// file onto Default(). So a key the file leaves out keeps its default. A
// key it sets wins, even when set to 0, "" or false.
//
// A pointer field is the one way of saying "unset". It is kept only where
// a value inherits from another layer:
//   - Envoy's outlier detection and circuit breakers: built-in defaults ←
//     the section ← the instance's override;
//   - tls.require_client_cert, which follows tls.client_ca_file.
package config

import (
	"errors"
	"fmt"
	"regexp"
	"slices"
	"sort"
)

// Config is the whole file.
type Config struct {
	Server    Server     `toml:"server" reload:"restart"`
	Redis     Redis      `toml:"redis" reload:"restart"`
	Routing   Routing    `toml:"routing"`
	Identity  Identity   `toml:"identity" reload:"restart"`
	Instances []Instance `toml:"instances"`
	// Discovery finds more instances behind DNS names ([discovery]).
	Discovery Discovery `toml:"discovery" reload:"restart"`
	// Engines says how tether reads the instances' engines ([engines]).
	Engines Engines `toml:"engines" reload:"restart"`
	// Versions split new sessions between model versions ([[versions]]).
	Versions []Version `toml:"versions"`

	XDS              XDS              `toml:"xds" reload:"restart"`
	Envoy            Envoy            `toml:"envoy"`
	OutlierDetection OutlierDetection `toml:"outlier_detection"`
	CircuitBreakers  CircuitBreakers  `toml:"circuit_breakers"`

	// Content is cache-aware placement ([content]).
	Content Content `toml:"content"`

	// Audit is the routing audit, a record per decision ([audit]).
	Audit Audit `toml:"audit" reload:"restart"`

	// TLS secures the ext_proc and xDS gRPC servers ([tls]). It also says
	// how the Envoy configuration tether generates connects to them
	// ([tls.envoy]).
	TLS TLS `toml:"tls" reload:"restart"`
}

// Default returns a configuration with every default filled in and no
// instances. Parse decodes a file onto it.
func Default() Config {
	return Config{
		Server:   defaultServer(),
		Redis:    defaultRedis(),
		Routing:  defaultRouting(),
		Identity: defaultIdentity(),
		Engines:  defaultEngines(),
		XDS:      defaultXDS(),
		Envoy:    defaultEnvoy(),
		// Every cluster's outlier detection and circuit breakers. An
		// instance's own table overrides the keys it sets.
		OutlierDetection: OutlierDetection{OutlierSettings: defaultOutlier()},
		CircuitBreakers:  CircuitBreakers{CircuitBreakerSettings: defaultCircuitBreakers()},
		Audit:            defaultAudit(),
		TLS:              defaultTLS(),
		Content:          defaultContent(),
	}
}

// reporter records that key holds the bad value val, and why.
type reporter func(key string, val any, why string)

// Validate fills in the defaults of each [[instances]],
// [[discovery.dns]] and [[routing.rules]] entry. Such an entry starts from zero, not from a
// default, so its zero values count as left out. Validate then checks
// every value. Last, complete resolves what the keys leave to be derived,
// so that what runs reads fields only.
//
// A configuration is checked and resolved here, once per load. Parse calls
// Validate, and so does code that builds or edits a Config before handing
// it on. Validate writes into copies of the instances and rules, never
// into arrays another Config shares.
func (c *Config) Validate() error {
	c.Instances = slices.Clone(c.Instances)
	for i := range c.Instances {
		c.Instances[i].setDefaults()
	}
	c.Discovery.DNS = slices.Clone(c.Discovery.DNS)
	for i := range c.Discovery.DNS {
		c.Discovery.DNS[i].setDefaults()
	}
	c.Routing.Rules = slices.Clone(c.Routing.Rules)
	for i := range c.Routing.Rules {
		c.Routing.Rules[i].setDefaults()
	}
	err := c.validate((*Config).validateServer, (*Config).validateRedis, (*Config).validateRouting,
		(*Config).validateIdentity, (*Config).validateEngines, (*Config).validateInstances,
		(*Config).validateDiscovery,
		(*Config).validateEnvoy, (*Config).validateAudit, (*Config).validateTLS, (*Config).validateContent)
	if err != nil {
		return err
	}
	c.complete()
	return nil
}

// complete fills in what the keys of a valid configuration resolve to:
//   - each instance's engine, engines.default when it names none;
//   - for an engine tether scrapes, its metrics URL,
//     http://<address>/metrics when it names none;
//   - each rule's compiled regex and parsed window.
func (c *Config) complete() {
	for i := range c.Instances {
		in := &c.Instances[i]
		in.Engine = c.engineOf(*in)
		if in.Engine != EngineGeneric && in.MetricsURL == "" {
			in.MetricsURL = "http://" + in.Address + "/metrics"
		}
	}
	for i := range c.Routing.Rules {
		r := &c.Routing.Rules[i]
		r.Pattern, _ = r.compile()
		r.Window, _ = r.window()
	}
}

// validateEnvoyTLS checks [tls] alone. It tells whether a [tls.envoy] edit
// fits the [tls] tether runs with (Running).
func (c *Config) validateEnvoyTLS() error { return c.validate((*Config).validateTLS) }

// validate runs the given section checks and joins what they report.
func (c *Config) validate(sections ...func(*Config, reporter)) error {
	var errs []error
	bad := func(key string, val any, why string) {
		errs = append(errs, fmt.Errorf("%s = %v: %s", key, quote(val), why))
	}
	for _, check := range sections {
		check(c, bad)
	}
	return errors.Join(errs...)
}

// Names several sections check.
var (
	headerName   = regexp.MustCompile(`^[a-z0-9][a-z0-9-]*$`)
	versionName  = regexp.MustCompile(`^[A-Za-z0-9._-]{1,63}$`)
	envName      = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
	instanceName = regexp.MustCompile(`^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$`)
)

func quote(v any) string {
	if s, ok := v.(string); ok {
		return fmt.Sprintf("%q", s)
	}
	return fmt.Sprint(v)
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
