package config

import (
	"fmt"
	"net"
	"net/netip"
	"reflect"
	"strings"
	"time"
)

// XDS is tether's bundled ADS server.
type XDS struct {
	// Addr is where Envoy's ADS stream connects; "" turns the server off
	// (Envoy then runs from a static bootstrap such as envoy/envoy-static.yaml).
	Addr string `toml:"addr"`
}

// Envoy holds what the generated Envoy resources need beyond the fleet.
type Envoy struct {
	// ListenerAddr is where Envoy takes client traffic.
	ListenerAddr string `toml:"listener_addr"`
	// ExtProcEndpoints are the tether replicas Envoy calls; empty means this
	// process's server.extproc_addr.
	ExtProcEndpoints []string `toml:"extproc_endpoints"`
	// MessageTimeout bounds each ext_proc exchange; past it Envoy goes on
	// without tether (failure_mode_allow) on the default route.
	MessageTimeout Duration `toml:"message_timeout"`
	// RouteTimeout bounds a whole LLM request, streaming included.
	RouteTimeout Duration `toml:"route_timeout"`
	// Retries is how many times Envoy retries a request that failed at the
	// instance (connect failure, reset, 502/503/504) on a fallback host; 0
	// never retries.
	Retries uint32 `toml:"retries"`
	// DefaultVersion picks the pool the default route (tether unreachable)
	// sends to; empty means the version with the most instances.
	DefaultVersion string `toml:"default_version"`
	// ExtProc puts tether's ext_proc filter in Envoy's listener. Turning it
	// off leaves tether as a control plane only: every request takes the
	// default route to the pool, balanced by PoolLB. The benchmarks use it
	// to measure Envoy's own balancing with the same clusters.
	ExtProc bool `toml:"ext_proc"`
	// PoolLB balances the model-version pools: "ring_hash" (default: on the
	// session headers, so sessions stay together without tether),
	// "round_robin" or "least_request".
	PoolLB string `toml:"pool_lb"`
	// Outcomes is how tether hears how each request ended: its status, the
	// host that answered, what the instance reported. That feeds the
	// instance breaker, the in-flight counts and the metrics.
	//   - "access_log", the default: Envoy's gRPC access log, one stream
	//     per Envoy worker, at the end of each request, off the path.
	//   - "observe": a second ext_proc filter in observability mode streams
	//     the response headers as they pass, off the path. It costs one
	//     more stream per request.
	//   - "inline": the routing exchange also waits for the response
	//     headers, a second blocking round trip per request.
	// docs/envoy.md measures the three.
	Outcomes string `toml:"outcomes"`
	// OutcomeFlush is how long Envoy's access log may hold entries to send
	// them in batches, with outcomes = "access_log". It delays the breaker
	// by as much. 0, the default, sends each entry as it is written.
	OutcomeFlush Duration `toml:"outcome_flush"`
}

// OutlierSettings are Envoy's outlier detection knobs. In
// [outlier_detection] every key is set: a key the file leaves out keeps
// its default. Per instance, in [outlier_detection.instances.NAME], a nil
// field is a key left out, which follows [outlier_detection].
type OutlierSettings struct {
	Consecutive5xx                     *uint32   `toml:"consecutive_5xx"`
	EnforcingConsecutive5xx            *uint32   `toml:"enforcing_consecutive_5xx"`
	ConsecutiveGatewayFailure          *uint32   `toml:"consecutive_gateway_failure"`
	EnforcingConsecutiveGatewayFailure *uint32   `toml:"enforcing_consecutive_gateway_failure"`
	Interval                           *Duration `toml:"interval"`
	BaseEjectionTime                   *Duration `toml:"base_ejection_time"`
	MaxEjectionTime                    *Duration `toml:"max_ejection_time"`
	MaxEjectionPercent                 *uint32   `toml:"max_ejection_percent"`
	SuccessRateMinimumHosts            *uint32   `toml:"success_rate_minimum_hosts"`
	SuccessRateRequestVolume           *uint32   `toml:"success_rate_request_volume"`
	SuccessRateStdevFactor             *uint32   `toml:"success_rate_stdev_factor"`
	EnforcingSuccessRate               *uint32   `toml:"enforcing_success_rate"`
	FailurePercentageThreshold         *uint32   `toml:"failure_percentage_threshold"`
	FailurePercentageMinimumHosts      *uint32   `toml:"failure_percentage_minimum_hosts"`
	FailurePercentageRequestVolume     *uint32   `toml:"failure_percentage_request_volume"`
	EnforcingFailurePercentage         *uint32   `toml:"enforcing_failure_percentage"`
}

// OutlierDetection is the [outlier_detection] section.
type OutlierDetection struct {
	OutlierSettings
	Instances map[string]OutlierSettings `toml:"instances"`
}

// CircuitBreakerSettings are Envoy's per-cluster thresholds. An
// instance's nil fields follow [circuit_breakers], as OutlierSettings' do.
type CircuitBreakerSettings struct {
	MaxConnections     *uint32 `toml:"max_connections"`
	MaxPendingRequests *uint32 `toml:"max_pending_requests"`
	MaxRequests        *uint32 `toml:"max_requests"`
	MaxRetries         *uint32 `toml:"max_retries"`
}

// CircuitBreakers is the [circuit_breakers] section.
type CircuitBreakers struct {
	CircuitBreakerSettings
	Instances map[string]CircuitBreakerSettings `toml:"instances"`
}

// Defaults for the generated Envoy resources.
const (
	DefaultXDSAddr        = "127.0.0.1:18000"
	DefaultListenerAddr   = "127.0.0.1:10000"
	DefaultMessageTimeout = 200 * time.Millisecond
	DefaultRouteTimeout   = 300 * time.Second
	DefaultRetries        = 1
	DefaultPoolLB         = "ring_hash"
	DefaultOutcomes       = "access_log"
	DefaultOutcomeFlush   = 0
)

// defaultXDS has the ADS server on, on loopback.
func defaultXDS() XDS { return XDS{Addr: DefaultXDSAddr} }

// defaultEnvoy puts tether's ext_proc filter in the listener.
// [outlier_detection] and [circuit_breakers] have no default section:
// their fields inherit (Outlier, Breakers).
func defaultEnvoy() Envoy {
	return Envoy{
		ListenerAddr:   DefaultListenerAddr,
		MessageTimeout: Dur(DefaultMessageTimeout),
		RouteTimeout:   Dur(DefaultRouteTimeout),
		Retries:        DefaultRetries,
		ExtProc:        true,
		PoolLB:         DefaultPoolLB,
		Outcomes:       DefaultOutcomes,
		OutcomeFlush:   Dur(DefaultOutcomeFlush),
	}
}

func u32(v uint32) *uint32 { return &v }
func dur(d time.Duration) *Duration {
	x := Dur(d)
	return &x
}

// defaultOutlier is tuned for LLM traffic: few, slow requests per host.
//
//   - Gateway failures eject after 3 in a row. They are 502, 503, 504,
//     connect failures and resets. An overloaded or dead model server
//     answers that way, and each failed request costs a user seconds.
//   - Any 5xx ejects after 5 in a row. A model server's 500 is more often
//     one bad prompt than a bad host.
//   - Success-rate and failure-percentage detection are off. They need a
//     request volume per interval, 100 by default. A GPU instance serving a
//     few requests a second reaches that only on long intervals.
//   - Ejection starts at 30 s and is capped at 5 min. A model server
//     restart takes longer than the 5 s a web server might need.
//   - At most half a cluster is ejected. So a fleet-wide problem, such as a
//     bad model rollout, does not empty every cluster at once.
func defaultOutlier() OutlierSettings {
	return OutlierSettings{
		Consecutive5xx:                     u32(5),
		EnforcingConsecutive5xx:            u32(100),
		ConsecutiveGatewayFailure:          u32(3),
		EnforcingConsecutiveGatewayFailure: u32(100),
		Interval:                           dur(10 * time.Second),
		BaseEjectionTime:                   dur(30 * time.Second),
		MaxEjectionTime:                    dur(300 * time.Second),
		MaxEjectionPercent:                 u32(50),
		SuccessRateMinimumHosts:            u32(5),
		SuccessRateRequestVolume:           u32(100),
		SuccessRateStdevFactor:             u32(1900),
		EnforcingSuccessRate:               u32(0),
		FailurePercentageThreshold:         u32(85),
		FailurePercentageMinimumHosts:      u32(5),
		FailurePercentageRequestVolume:     u32(50),
		EnforcingFailurePercentage:         u32(0),
	}
}

// defaultCircuitBreakers bound what Envoy sends one instance. Upstreams
// speak HTTP/1.1, so connections are concurrent requests. A model server
// batches 64–256 sequences. So 256 in flight and 512 queued in Envoy keep a
// burst from piling unbounded onto one GPU. They do not refuse normal load.
func defaultCircuitBreakers() CircuitBreakerSettings {
	return CircuitBreakerSettings{
		MaxConnections:     u32(256),
		MaxPendingRequests: u32(512),
		MaxRequests:        u32(256),
		MaxRetries:         u32(3),
	}
}

// validateEnvoy checks [xds], [envoy], [outlier_detection] and
// [circuit_breakers].
func (c *Config) validateEnvoy(bad reporter) {
	if c.XDS.Addr != "" {
		if _, _, err := net.SplitHostPort(c.XDS.Addr); err != nil {
			bad("xds.addr", c.XDS.Addr, `want host:port, or "" to turn the ADS server off`)
		}
	}
	if _, err := netip.ParseAddrPort(c.Envoy.ListenerAddr); err != nil {
		bad("envoy.listener_addr", c.Envoy.ListenerAddr, "want IP:port")
	}
	for i, e := range c.Envoy.ExtProcEndpoints {
		if err := ipPort(e); err != nil {
			bad(fmt.Sprintf("envoy.extproc_endpoints[%d]", i), e, err.Error())
		}
	}
	if c.Envoy.MessageTimeout.D <= 0 {
		bad("envoy.message_timeout", c.Envoy.MessageTimeout, "must be positive")
	}
	if c.Envoy.RouteTimeout.D < 0 {
		bad("envoy.route_timeout", c.Envoy.RouteTimeout, "must not be negative (0 means no timeout)")
	}
	switch c.Envoy.PoolLB {
	case "ring_hash", "round_robin", "least_request":
	default:
		bad("envoy.pool_lb", c.Envoy.PoolLB, `want "ring_hash", "round_robin" or "least_request"`)
	}
	switch c.Envoy.Outcomes {
	case "access_log", "observe", "inline":
	default:
		bad("envoy.outcomes", c.Envoy.Outcomes, `want "access_log", "observe" or "inline"`)
	}
	if f := c.Envoy.OutcomeFlush.D; f != 0 && (f < time.Millisecond || f > time.Second) {
		bad("envoy.outcome_flush", c.Envoy.OutcomeFlush, "want 0 (each entry at once) or 1ms to 1s: the breaker hears of failures this late")
	}
	if r := c.Envoy.Retries; r > 5 {
		bad("envoy.retries", r, "want 0 to 5")
	}
	if v := c.Envoy.DefaultVersion; v != "" {
		found := false
		for _, in := range c.Instances {
			found = found || in.Version == v
		}
		for _, g := range c.Discovery.DNS {
			found = found || g.Version == v
		}
		if !found {
			bad("envoy.default_version", v, "no instance has this version")
		}
	}
	c.validateSectionsSet(bad)
	names := map[string]bool{}
	for _, in := range c.Instances {
		names[in.Name] = true
	}
	c.validateOutlier(bad, names)
	for _, name := range sortedKeys(c.CircuitBreakers.Instances) {
		if !names[name] {
			bad(fmt.Sprintf("circuit_breakers.instances.%s", name), name, "no such instance")
		}
	}
}

// validateSectionsSet refuses a key of [outlier_detection] or
// [circuit_breakers] left unset. Default sets them all, and a file cannot
// unset one: a Config built in code that clears one is refused here, not
// dereferenced later.
func (c *Config) validateSectionsSet(bad reporter) {
	for _, sec := range []struct {
		name string
		v    any
	}{{"outlier_detection", c.OutlierDetection.OutlierSettings}, {"circuit_breakers", c.CircuitBreakers.CircuitBreakerSettings}} {
		v := reflect.ValueOf(sec.v)
		for i := range v.NumField() {
			if v.Field(i).IsNil() {
				name, _, _ := strings.Cut(v.Type().Field(i).Tag.Get("toml"), ",")
				bad(sec.name+"."+name, "unset", "every key of the section needs a value (config.Default has them all)")
			}
		}
	}
}

// validateOutlier checks [outlier_detection] and its sections per
// instance, which must name one of names. An instance's ejection times
// follow the section's where it leaves them out.
func (c *Config) validateOutlier(bad reporter, names map[string]bool) {
	checkOutlier(bad, "outlier_detection", c.OutlierDetection.OutlierSettings)
	for _, name := range sortedKeys(c.OutlierDetection.Instances) {
		key := fmt.Sprintf("outlier_detection.instances.%s", name)
		if !names[name] {
			bad(key, name, "no such instance")
			continue
		}
		o := c.OutlierDetection.Instances[name]
		checkOutlier(bad, key, o)
		base, most := c.OutlierDetection.BaseEjectionTime, c.OutlierDetection.MaxEjectionTime
		if o.BaseEjectionTime != nil {
			base = o.BaseEjectionTime
		}
		if o.MaxEjectionTime != nil {
			most = o.MaxEjectionTime
		}
		if base != nil && most != nil && most.D < base.D {
			bad(key+".max_ejection_time", *most, "must not be below base_ejection_time "+base.String())
		}
	}
	if o := c.OutlierDetection; o.BaseEjectionTime != nil && o.MaxEjectionTime != nil && o.MaxEjectionTime.D < o.BaseEjectionTime.D {
		bad("outlier_detection.max_ejection_time", *o.MaxEjectionTime, "must not be below base_ejection_time "+o.BaseEjectionTime.String())
	}
}

// checkOutlier checks the keys o sets, named under key.
func checkOutlier(bad reporter, key string, o OutlierSettings) {
	for _, p := range []struct {
		name string
		v    *uint32
	}{
		{"max_ejection_percent", o.MaxEjectionPercent}, {"enforcing_consecutive_5xx", o.EnforcingConsecutive5xx},
		{"enforcing_consecutive_gateway_failure", o.EnforcingConsecutiveGatewayFailure},
		{"enforcing_success_rate", o.EnforcingSuccessRate}, {"enforcing_failure_percentage", o.EnforcingFailurePercentage},
		{"failure_percentage_threshold", o.FailurePercentageThreshold},
	} {
		if p.v != nil && *p.v > 100 {
			bad(key+"."+p.name, *p.v, "a percentage: want 0 to 100")
		}
	}
	for _, p := range []struct {
		name string
		v    *Duration
	}{{"interval", o.Interval}, {"base_ejection_time", o.BaseEjectionTime}, {"max_ejection_time", o.MaxEjectionTime}} {
		if p.v != nil && p.v.D <= 0 {
			bad(key+"."+p.name, *p.v, "must be positive")
		}
	}
	for _, p := range []struct {
		name string
		v    *uint32
	}{{"consecutive_5xx", o.Consecutive5xx}, {"consecutive_gateway_failure", o.ConsecutiveGatewayFailure}} {
		if p.v != nil && *p.v == 0 {
			bad(key+"."+p.name, 0, "must be at least 1 (use the enforcing_ percentage 0 to turn it off)")
		}
	}
}
