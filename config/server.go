package config

import (
	"fmt"
	"net"
	"time"
)

// Server holds listen addresses and logging.
type Server struct {
	ExtProcAddr string `toml:"extproc_addr"`
	AdminAddr   string `toml:"admin_addr"`
	// DebugHeaders adds x-tether-instance and x-tether-decision to responses.
	DebugHeaders bool   `toml:"debug_headers"`
	LogLevel     string `toml:"log_level"`
	// DrainDelay is how long tether keeps taking new ext_proc streams after
	// SIGTERM. Meanwhile it reports itself not ready and not serving. So
	// Envoy's health checks take the replica out before its listener
	// closes. 0 closes the listener at once.
	DrainDelay Duration `toml:"drain_delay"`
	// DrainTimeout bounds how long SIGTERM waits for open ext_proc streams.
	DrainTimeout Duration `toml:"drain_timeout"`
	// The admin API's bearer token is read from AdminTokenFile when one is
	// named, else from the environment variable AdminTokenEnv. It is never
	// read from this file (see AdminToken). With a token, every admin
	// endpoint but /healthz and /readyz needs "Authorization: Bearer
	// <token>". Without one, the API is open to whoever reaches admin_addr.
	// That is loopback by default.
	AdminTokenEnv  string `toml:"admin_token_env"`
	AdminTokenFile string `toml:"admin_token_file"`
	// DestinationFallbacks is how many instances a routing reply names
	// after its own in x-gateway-destination-endpoint, for a gateway's
	// retries. 0 names none: an ORIGINAL_DST cluster reads one address.
	DestinationFallbacks int `toml:"destination_fallbacks"`
}

// Defaults of [server].
const (
	DefaultExtProcAddr   = "127.0.0.1:50051"
	DefaultAdminAddr     = "127.0.0.1:8090"
	DefaultLogLevel      = "info"
	DefaultDrainTimeout  = 10 * time.Second
	DefaultDrainDelay    = 3 * time.Second
	MaxDrainDelay        = 5 * time.Minute
	DefaultAdminTokenEnv = "TETHER_ADMIN_TOKEN"
	MinAdminToken        = 16 // bytes
	// MaxDestinationFallbacks bounds server.destination_fallbacks.
	MaxDestinationFallbacks = 8
)

func defaultServer() Server {
	return Server{
		ExtProcAddr:   DefaultExtProcAddr,
		AdminAddr:     DefaultAdminAddr,
		LogLevel:      DefaultLogLevel,
		DrainDelay:    Dur(DefaultDrainDelay),
		DrainTimeout:  Dur(DefaultDrainTimeout),
		AdminTokenEnv: DefaultAdminTokenEnv,
	}
}

func (c *Config) validateServer(bad reporter) {
	s := c.Server
	for _, a := range []struct{ key, v string }{
		{"server.extproc_addr", s.ExtProcAddr}, {"server.admin_addr", s.AdminAddr},
	} {
		if _, _, err := net.SplitHostPort(a.v); err != nil {
			bad(a.key, a.v, "want host:port")
		}
	}
	switch s.LogLevel {
	case "debug", "info", "warn", "error":
	default:
		bad("server.log_level", s.LogLevel, "want debug, info, warn or error")
	}
	if s.DrainTimeout.D < 0 {
		bad("server.drain_timeout", s.DrainTimeout, "must not be negative")
	}
	if d := s.DrainDelay.D; d < 0 || d > MaxDrainDelay {
		bad("server.drain_delay", s.DrainDelay, fmt.Sprintf("want 0 (off) to %v", MaxDrainDelay))
	}
	if n := s.DestinationFallbacks; n < 0 || n > MaxDestinationFallbacks {
		bad("server.destination_fallbacks", n, fmt.Sprintf("want 0 (none) to %d", MaxDestinationFallbacks))
	}
	if !envName.MatchString(s.AdminTokenEnv) {
		// Not shown: a token put where its variable's name goes.
		bad("server.admin_token_env", "(hidden)", "want the name of an environment variable, not its value")
	}
}
