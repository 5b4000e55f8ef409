// Package config reads tether's TOML configuration, fills in defaults and
// validates it. Errors name the key and the bad value.
//
// One file per section holds its type, its defaults and its validation
// (server.go, redis.go, routing.go with rules.go, identity.go,
// instances.go, envoy.go, audit.go, tls.go); load.go decodes the file and
// files.go reads what it names on this host.
//
// Whether a key was set is never recorded beside it: Parse decodes the file
// onto Default(), so a key the file leaves out keeps its default and a key
// it sets wins, even when set to 0, "" or false. A pointer field is the one
// way of saying "unset" and is kept only where a value inherits from
// another layer: Envoy's outlier detection and circuit breakers (built-in
// defaults ← the section ← the instance's override) and
// tls.require_client_cert (follows tls.client_ca_file).
package config

import (
	"errors"
	"fmt"
	"regexp"
	"sort"
)

// Config is the whole file.
type Config struct {
	Server    Server     `toml:"server"`
	Redis     Redis      `toml:"redis"`
	Routing   Routing    `toml:"routing"`
	Identity  Identity   `toml:"identity"`
	Instances []Instance `toml:"instances"`
	// Engines says how tether reads the instances' engines ([engines]).
	Engines Engines `toml:"engines"`
	// Versions split new sessions between model versions ([[versions]]).
	Versions []Version `toml:"versions"`

	XDS              XDS              `toml:"xds"`
	Envoy            Envoy            `toml:"envoy"`
	OutlierDetection OutlierDetection `toml:"outlier_detection"`
	CircuitBreakers  CircuitBreakers  `toml:"circuit_breakers"`

	// Audit is the routing audit: a record per decision ([audit]).
	Audit Audit `toml:"audit"`

	// TLS secures the ext_proc and xDS gRPC servers ([tls]), and says how
	// the Envoy configuration tether generates connects to them ([tls.envoy]).
	TLS TLS `toml:"tls"`
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
		Audit:    defaultAudit(),
		TLS:      defaultTLS(),
	}
}

// reporter records that key holds the bad value val, and why.
type reporter func(key string, val any, why string)

// Validate checks every value. It expects defaults to be filled in (Parse
// and Default do; code that adds an instance calls its SetDefaults).
func (c *Config) Validate() error {
	var errs []error
	bad := func(key string, val any, why string) {
		errs = append(errs, fmt.Errorf("%s = %v: %s", key, quote(val), why))
	}
	c.validateServer(bad)
	c.validateRedis(bad)
	c.validateRouting(bad)
	c.validateIdentity(bad)
	c.validateEngines(bad)
	c.validateInstances(bad)
	c.validateEnvoy(bad)
	c.validateAudit(bad)
	c.validateTLS(bad)
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
