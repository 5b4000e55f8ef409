package config

import (
	"fmt"
	"math"
	"strings"
	"time"
)

// Routing is the decision policy ([routing]). Key names follow the field's
// configs.
type Routing struct {
	// Mode is sticky, random or hybrid. Under hybrid the rules decide, and
	// a request no rule matches is routed at random.
	Mode string `toml:"mode"`
	// StickyEnabled 0 routes sticky and hybrid traffic at random (see
	// Sticky). 1 is the default.
	StickyEnabled int `toml:"sticky_enabled"`
	// MaxStickyDuration bounds a binding's life; 0 means no limit.
	MaxStickyDuration Duration `toml:"max_sticky_duration"`
	IdleTimeout       Duration `toml:"idle_timeout"`
	// FallbackPolicy is what a session does when its instance is out,
	// with its breaker open:
	//   - gradual tries the same zone, then another zone, then random;
	//   - random routes at random;
	//   - none answers 503.
	FallbackPolicy string `toml:"fallback_policy"`
	// The instance breaker is tether's own; [circuit_breakers] is Envoy's.
	// Failures are 5xx answers and Envoy's replies for an instance it
	// cannot reach. They are counted across replicas through the store.
	// More than FailureThreshold failures within FailureWindow keep the
	// instance out for FailureCooldown. Then one probe request at a time
	// decides. 0 opens on the first failure.
	FailureThreshold int      `toml:"failure_threshold" reload:"restart"`
	FailureWindow    Duration `toml:"failure_window" reload:"restart"`
	FailureCooldown  Duration `toml:"failure_cooldown" reload:"restart"`
	// ClusterHeader is the request header Envoy routes on.
	ClusterHeader string `toml:"cluster_header" reload:"restart"`
	// RandomSeed makes random routing reproducible, for tests and
	// benchmarks. 0 seeds from the operating system.
	RandomSeed uint64 `toml:"random_seed" reload:"restart"`

	// AdaptiveSticky, 0 or 1, lets a sticky session move off a saturated
	// instance, unless its rule gives it high priority. The saturation
	// keys say when an instance is saturated.
	AdaptiveSticky int `toml:"adaptive_sticky"`
	// VersionAffinity says whether a session may change model version:
	// strict, prefer or none. Under prefer it changes only when no
	// instance of its version is healthy.
	VersionAffinity string `toml:"version_affinity"`
	// CanaryByHeader names the request header whose value "always" or
	// "never" opts a session into or out of the canary versions. "", the
	// default, lets no client choose.
	CanaryByHeader string `toml:"canary_by_header"`
	// BoundedLoadEpsilon is the slack of bounded-load placement. A new
	// session skips an instance whose sessions reach (1+ε) × its share.
	BoundedLoadEpsilon float64 `toml:"bounded_load_epsilon"`
	// TierHeader names the request header that rules' tiers match.
	TierHeader string `toml:"tier_header"`
	// An instance is saturated when it has SaturationInFlight requests in
	// flight. It is also saturated when it reports a queue of
	// SaturationQueueDepth in the QueueDepthHeader response header. 0
	// turns a threshold off.
	SaturationInFlight   int    `toml:"saturation_inflight"`
	SaturationQueueDepth int    `toml:"saturation_queue_depth"`
	QueueDepthHeader     string `toml:"queue_depth_header" reload:"restart"`
	// These read the engines' own metrics ([engines]). An instance is
	// saturated at SaturationWaiting requests waiting, or at a KV-cache
	// usage of SaturationKVUsage, from 0 to 1. 0 turns a threshold off. A
	// new session skips an instance at SaturationKVUsage when another has
	// room.
	SaturationWaiting int     `toml:"saturation_waiting"`
	SaturationKVUsage float64 `toml:"saturation_kv_usage"`
	// Instances may report in response headers that they ran out of
	// memory, as "true" or "1". Status 507 counts too. They may also report
	// their GPU utilisation, in percent from 0 to 100. tether exports both
	// per instance.
	OOMHeader            string `toml:"oom_header" reload:"restart"`
	GPUUtilizationHeader string `toml:"gpu_utilization_header" reload:"restart"`
	// Rules override the policy for the requests they match. The first
	// matching rule wins.
	Rules []Rule `toml:"rules"`
}

// Version is one [[versions]] entry. Versions say how new sessions split
// between model versions.
type Version struct {
	Name string `toml:"name"`
	// Weight is the version's share of new sessions. Unset, it is 0, so a
	// version listed only as a canary gets no traffic by weight.
	Weight float64 `toml:"weight"`
	// Canary versions take the sessions that routing.canary_by_header opts
	// in, and none of those that opt out.
	Canary bool `toml:"canary"`
}

// Modes. Hybrid is for routing.mode only. Adaptive is for a rule's mode
// only; globally it is routing.adaptive_sticky.
const (
	ModeSticky   = "sticky"
	ModeRandom   = "random"
	ModeHybrid   = "hybrid"   // the rules decide; a request no rule matches is routed at random
	ModeAdaptive = "adaptive" // sticky, but a session moves off a saturated instance
)

// Version affinities.
const (
	VersionStrict = "strict"
	VersionPrefer = "prefer"
	VersionNone   = "none"
)

// Defaults and bounds of [routing].
const (
	DefaultStickyEnabled     = 1
	DefaultMaxStickyDuration = 1800 * time.Second
	DefaultIdleTimeout       = 30 * time.Minute
	DefaultFallbackPolicy    = "gradual"
	DefaultFailureThreshold  = 3
	DefaultFailureWindow     = 30 * time.Second
	DefaultFailureCooldown   = 30 * time.Second
	MaxFailureThreshold      = 10000
	DefaultClusterHeader     = "x-tether-cluster"
	DefaultVersionAffinity   = VersionPrefer
	DefaultEpsilon           = 0.25
	DefaultTierHeader        = "x-user-tier"
	// DefaultQueueDepth sits well above an instance's normal batch. The
	// depth an instance reports counts the requests it is decoding too.
	// Under the benchmark's load the emulated A100s report a median of 3
	// and a p99 of 8. At 4, adaptive routing moved 29% of turns and lost a
	// sixth of the KV-cache hits (BENCHMARKS.md). Tune it to the engine.
	DefaultQueueDepth       = 12
	DefaultQueueDepthHeader = "x-queue-depth"
	// DefaultWaiting and DefaultKVUsage are what the Gateway API Inference
	// Extension and llm-d count as saturated. That is a waiting queue of 5,
	// or a KV cache 80% in use.
	DefaultWaiting   = 5
	DefaultKVUsage   = 0.8
	DefaultOOMHeader = "x-oom"
	DefaultGPUHeader = "x-gpu-utilization"
)

func defaultRouting() Routing {
	return Routing{
		Mode:                 ModeSticky,
		StickyEnabled:        DefaultStickyEnabled,
		MaxStickyDuration:    Dur(DefaultMaxStickyDuration),
		IdleTimeout:          Dur(DefaultIdleTimeout),
		FallbackPolicy:       DefaultFallbackPolicy,
		FailureThreshold:     DefaultFailureThreshold,
		FailureWindow:        Dur(DefaultFailureWindow),
		FailureCooldown:      Dur(DefaultFailureCooldown),
		ClusterHeader:        DefaultClusterHeader,
		VersionAffinity:      DefaultVersionAffinity,
		BoundedLoadEpsilon:   DefaultEpsilon,
		TierHeader:           DefaultTierHeader,
		SaturationQueueDepth: DefaultQueueDepth,
		QueueDepthHeader:     DefaultQueueDepthHeader,
		SaturationWaiting:    DefaultWaiting,
		SaturationKVUsage:    DefaultKVUsage,
		OOMHeader:            DefaultOOMHeader,
		GPUUtilizationHeader: DefaultGPUHeader,
	}
}

// validateRouting checks [routing], its [[routing.rules]] and [[versions]],
// and the request headers of [routing] and [identity] together.
func (c *Config) validateRouting(bad reporter) {
	r := c.Routing
	switch r.Mode {
	case ModeSticky, ModeRandom, ModeHybrid:
	default:
		bad("routing.mode", r.Mode, `want "sticky", "random" or "hybrid"`)
	}
	if se := r.StickyEnabled; se != 0 && se != 1 {
		bad("routing.sticky_enabled", se, "want 0 or 1")
	}
	if d := r.MaxStickyDuration.D; d != 0 && d < time.Second {
		bad("routing.max_sticky_duration", r.MaxStickyDuration, "want 0 (no limit) or at least 1s")
	}
	if r.IdleTimeout.D < time.Second {
		bad("routing.idle_timeout", r.IdleTimeout, "must be at least 1s")
	}
	switch r.FallbackPolicy {
	case "gradual", "random", "none":
	default:
		bad("routing.fallback_policy", r.FallbackPolicy, `want "gradual", "random" or "none"`)
	}
	if n := r.FailureThreshold; n < 0 || n > MaxFailureThreshold {
		bad("routing.failure_threshold", n, fmt.Sprintf("want 0 (the first failure opens) to %d", MaxFailureThreshold))
	}
	if r.FailureWindow.D < 100*time.Millisecond {
		bad("routing.failure_window", r.FailureWindow, "want at least 100ms")
	}
	if r.FailureCooldown.D < 100*time.Millisecond {
		bad("routing.failure_cooldown", r.FailureCooldown, "want at least 100ms")
	}
	if strings.HasPrefix(r.ClusterHeader, "x-envoy-") {
		bad("routing.cluster_header", r.ClusterHeader, "Envoy reserves x-envoy- headers")
	}
	c.validateHeaders(bad)
	switch r.VersionAffinity {
	case VersionStrict, VersionPrefer, VersionNone:
	default:
		bad("routing.version_affinity", r.VersionAffinity, `want "strict", "prefer" or "none"`)
	}
	if e := r.BoundedLoadEpsilon; !(e > 0) || e > 10 {
		bad("routing.bounded_load_epsilon", e, "want a number above 0 and at most 10")
	}
	if r.AdaptiveSticky != 0 && r.AdaptiveSticky != 1 {
		bad("routing.adaptive_sticky", r.AdaptiveSticky, "want 0 or 1")
	}
	if r.SaturationInFlight < 0 {
		bad("routing.saturation_inflight", r.SaturationInFlight, "must not be negative (0 turns it off)")
	}
	if r.SaturationQueueDepth < 0 {
		bad("routing.saturation_queue_depth", r.SaturationQueueDepth, "must not be negative (0 turns it off)")
	}
	if r.SaturationWaiting < 0 {
		bad("routing.saturation_waiting", r.SaturationWaiting, "must not be negative (0 turns it off)")
	}
	if u := r.SaturationKVUsage; math.IsNaN(u) || u < 0 || u > 1 {
		bad("routing.saturation_kv_usage", u, "want a share from 0 (off) to 1")
	}
	if r.AdaptiveSticky == 1 && !r.saturable() {
		bad("routing.adaptive_sticky", r.AdaptiveSticky, noThreshold)
	}
	if r.Mode == ModeHybrid && len(r.Rules) == 0 {
		bad("routing.mode", r.Mode, "hybrid needs at least one [[routing.rules]]")
	}
	versions, unknownVersion := c.instanceVersions()
	c.validateRules(bad, versions, unknownVersion)
	c.validateVersions(bad, versions, unknownVersion)
}

const noThreshold = "adaptive routing needs routing.saturation_inflight, saturation_queue_depth, saturation_waiting or saturation_kv_usage above 0"

// saturable reports whether an instance can be saturated at all. Adaptive
// routing needs a threshold.
func (r Routing) saturable() bool {
	return r.SaturationInFlight > 0 || r.SaturationQueueDepth > 0 || r.SaturationWaiting > 0 || r.SaturationKVUsage > 0
}

// validateHeaders checks the request headers tether reads and the
// response headers instances report. Envoy strips the routing header from
// client requests, so it must not be one that carries identity or that
// Envoy itself needs.
func (c *Config) validateHeaders(bad reporter) {
	used := map[string]string{"host": "HTTP", "content-length": "HTTP", "content-type": "HTTP",
		"user-agent": "the device fingerprint", "accept-language": "the device fingerprint", "x-forwarded-for": "the device fingerprint"}
	for _, h := range []struct{ key, v string }{
		{"identity.session_header", c.Identity.SessionHeader}, {"identity.auth_header", c.Identity.AuthHeader},
		{"identity.device_header", c.Identity.DeviceHeader}, {"identity.user_header", c.Identity.UserHeader},
		{"routing.cluster_header", c.Routing.ClusterHeader}, {"routing.tier_header", c.Routing.TierHeader},
		{"routing.canary_by_header", c.Routing.CanaryByHeader},
	} {
		switch {
		case h.v == "" && h.key == "routing.canary_by_header":
			// off
		case !headerName.MatchString(h.v):
			bad(h.key, h.v, "want a lower-case header name")
		case used[h.v] != "":
			bad(h.key, h.v, "already used by "+used[h.v])
		default:
			used[h.v] = h.key
		}
	}
	reports := map[string]string{}
	for _, h := range []struct{ key, v string }{
		{"routing.queue_depth_header", c.Routing.QueueDepthHeader}, {"routing.oom_header", c.Routing.OOMHeader},
		{"routing.gpu_utilization_header", c.Routing.GPUUtilizationHeader},
	} {
		switch {
		case !headerName.MatchString(h.v):
			bad(h.key, h.v, "want a lower-case header name")
		case reports[h.v] != "":
			bad(h.key, h.v, "already used by "+reports[h.v])
		default:
			reports[h.v] = h.key
		}
	}
}

// instanceVersions is the set of the instances' versions, and the error
// for a version none has. A [[discovery.dns]] group's version counts: its
// instances may not be found yet.
func (c *Config) instanceVersions() (map[string]bool, string) {
	versions := map[string]bool{}
	for _, in := range c.Instances {
		versions[in.Version] = true
	}
	for _, g := range c.Discovery.DNS {
		versions[g.Version] = true
	}
	if len(versions) == 0 {
		return versions, "unknown version: no instance has it (there are no instances)"
	}
	return versions, "unknown version: no instance has it (instances have " + strings.Join(sortedKeys(versions), ", ") + ")"
}

// validateVersions checks [[versions]]. Each names a version some
// instance has, once. The weights must not all be 0.
func (c *Config) validateVersions(bad reporter, versions map[string]bool, unknownVersion string) {
	seen := map[string]int{}
	sum, weighed := 0.0, true
	for i, v := range c.Versions {
		key := fmt.Sprintf("versions[%d]", i)
		switch {
		case !versionName.MatchString(v.Name):
			bad(key+".name", v.Name, "want 1-63 letters, digits, '.', '_' or '-'")
		case !versions[v.Name]:
			bad(key+".name", v.Name, unknownVersion)
		default:
			if j, dup := seen[v.Name]; dup {
				bad(key+".name", v.Name, fmt.Sprintf("duplicate of versions[%d]", j))
			} else {
				seen[v.Name] = i
			}
		}
		if !(v.Weight >= 0) || v.Weight > 1e6 {
			bad(key+".weight", v.Weight, "want a number from 0 to 1e6")
			weighed = false
		} else {
			sum += v.Weight
		}
	}
	if len(c.Versions) > 0 && weighed && sum == 0 {
		weights := make([]float64, len(c.Versions))
		for i, v := range c.Versions {
			weights[i] = v.Weight
		}
		bad("versions", weights, "weights sum to zero: at least one version needs a weight above 0")
	}
}
