// Package config reads tether's TOML configuration, fills in defaults and
// validates it. Errors name the key and the bad value.
package config

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/BurntSushi/toml"
)

// Config is the whole file.
type Config struct {
	Server    Server     `toml:"server"`
	Redis     Redis      `toml:"redis"`
	Routing   Routing    `toml:"routing"`
	Identity  Identity   `toml:"identity"`
	Instances []Instance `toml:"instances"`
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

	// xdsSet records that the file set xds.addr, possibly to "" (off);
	// epsilonSet and queueDepthSet that it set those keys, possibly to 0
	// (refused, and off).
	// auditRateSet that it set audit.sample_rate (0 is refused).
	xdsSet, epsilonSet, queueDepthSet, auditRateSet bool
}

// Server holds listen addresses and logging.
type Server struct {
	ExtProcAddr string `toml:"extproc_addr"`
	AdminAddr   string `toml:"admin_addr"`
	// DebugHeaders adds x-tether-instance and x-tether-decision to responses.
	DebugHeaders bool   `toml:"debug_headers"`
	LogLevel     string `toml:"log_level"`
	// DrainDelay is how long tether keeps taking new ext_proc streams after
	// SIGTERM while it reports itself not ready and not serving, so Envoy's
	// health checks take the replica out before its listener closes.
	DrainDelay Duration `toml:"drain_delay"`
	// DrainTimeout bounds how long SIGTERM waits for open ext_proc streams.
	DrainTimeout Duration `toml:"drain_timeout"`
	// The admin API's bearer token: read from AdminTokenFile when one is
	// named, else from the environment variable AdminTokenEnv; never from
	// this file. With a token, every admin endpoint but /healthz and
	// /readyz needs "Authorization: Bearer <token>"; without one the API is
	// open to whoever reaches admin_addr (loopback by default).
	AdminTokenEnv  string `toml:"admin_token_env"`
	AdminTokenFile string `toml:"admin_token_file"`
}

// Redis says where bindings live.
type Redis struct {
	// URL: redis://host:port/db, rediss://…, unix:///path,
	// redis+cluster://host:port?addr=…, redis+sentinel://host:port?master_name=…,
	// or "embedded", the in-process memory store, which takes no settings
	// (see store Open).
	URL string `toml:"url"`
	// Timeout bounds each call on the request path (default 10ms): past
	// it the request is placed without Redis, and after 5 such failures in
	// a row the store stops calling Redis for a cooldown (see store/redis).
	Timeout Duration `toml:"timeout"`
}

// Routing is the decision policy. Key names follow the field's configs.
type Routing struct {
	// Mode is sticky, random or hybrid (the rules decide; random when none
	// matches).
	Mode              string   `toml:"mode"`
	StickyEnabled     *int     `toml:"sticky_enabled"`
	MaxStickyDuration Duration `toml:"max_sticky_duration"`
	IdleTimeout       Duration `toml:"idle_timeout"`
	// FallbackPolicy is what a session whose instance is out (its breaker
	// open) does: gradual (same zone, other zone, then random), random,
	// or none (503).
	FallbackPolicy string `toml:"fallback_policy"`
	// The instance breaker (tether's own; [circuit_breakers] is Envoy's):
	// more than FailureThreshold failures (5xx answers, Envoy's replies for
	// an instance it cannot reach) within FailureWindow, counted across
	// replicas through the store, keep the instance out for
	// FailureCooldown; then one probe request at a time decides.
	FailureThreshold *int     `toml:"failure_threshold"`
	FailureWindow    Duration `toml:"failure_window"`
	FailureCooldown  Duration `toml:"failure_cooldown"`
	// ClusterHeader is the request header Envoy routes on.
	ClusterHeader string `toml:"cluster_header"`
	// RandomSeed makes random routing reproducible (tests, benchmarks); 0
	// seeds from the operating system.
	RandomSeed uint64 `toml:"random_seed"`

	// AdaptiveSticky (0 or 1) lets a sticky session move off an instance
	// that is saturated (see the saturation keys) unless its rule gives it
	// high priority.
	AdaptiveSticky int `toml:"adaptive_sticky"`
	// VersionAffinity says whether a session may change model version:
	// strict, prefer (only when none of its version is healthy) or none.
	VersionAffinity string `toml:"version_affinity"`
	// CanaryByHeader names the request header whose value "always" or
	// "never" opts a session into or out of the canary versions; "" (the
	// default) lets no client choose.
	CanaryByHeader string `toml:"canary_by_header"`
	// BoundedLoadEpsilon is the slack of bounded-load placement: a new
	// session skips an instance whose sessions reach (1+ε) × its share.
	BoundedLoadEpsilon float64 `toml:"bounded_load_epsilon"`
	// TierHeader names the request header that rules' tiers match.
	TierHeader string `toml:"tier_header"`
	// An instance is saturated when it has SaturationInFlight requests in
	// flight or reports a queue of SaturationQueueDepth (in the
	// QueueDepthHeader response header); 0 turns a threshold off.
	SaturationInFlight   int    `toml:"saturation_inflight"`
	SaturationQueueDepth int    `toml:"saturation_queue_depth"`
	QueueDepthHeader     string `toml:"queue_depth_header"`
	// Instances may report running out of memory ("true" or "1"; status
	// 507 counts too) and their GPU utilisation (percent, 0–100) in
	// response headers; tether exports both per instance.
	OOMHeader            string `toml:"oom_header"`
	GPUUtilizationHeader string `toml:"gpu_utilization_header"`
	// Rules override the policy for the requests they match; the first
	// matching rule wins.
	Rules []Rule `toml:"rules"`
}

// Identity names the headers that identify a caller.
type Identity struct {
	SessionHeader string `toml:"session_header"`
	AuthHeader    string `toml:"auth_header"`
	DeviceHeader  string `toml:"device_header"`
	UserHeader    string `toml:"user_header"`
	MaxValueBytes int    `toml:"max_value_bytes"`
	// Secret keys the HMAC of identifiers. Prefer SecretEnv: a secret in a
	// file is easy to leak.
	Secret    string `toml:"secret"`
	SecretEnv string `toml:"secret_env"`
}

// Audit configures the routing audit: one record per decision, with the
// user id sealed (AES-256-GCM) and a keyed pseudonym to find a user's
// records by. Secrets never sit in the file: the keys and the PostgreSQL
// DSN come from environment variables (or key files) the file names.
type Audit struct {
	Enabled bool `toml:"enabled"`
	// Sink is "redis" (a Stream, <prefix>audit, in the binding store's
	// Redis or in RedisURL's), "postgres" or "file" (JSON lines, a file
	// per UTC day in FileDir).
	Sink string `toml:"sink"`
	// Retention: at most 720h (30 days), and at least 24h for files.
	Retention Duration `toml:"retention"`
	// SampleRate is the fraction of hits and random decisions recorded,
	// in (0, 1]; decisions that make or change a binding are always
	// recorded, so forget finds every binding made.
	SampleRate float64 `toml:"sample_rate"`
	// Buffer is how many records may wait for the sink (past it they are
	// dropped and counted); Batch is the most written at once.
	Buffer int `toml:"buffer"`
	Batch  int `toml:"batch"`
	// PostgresDSNEnv names the environment variable holding the
	// PostgreSQL DSN (it may hold a password).
	PostgresDSNEnv string `toml:"postgres_dsn_env"`
	FileDir        string `toml:"file_dir"`
	// RedisURL, when set, puts the stream in another Redis than the
	// binding store's (same forms as redis.url, except "embedded").
	RedisURL string `toml:"redis_url"`
	// The keyring ("id=key" entries, the current key first) and the
	// pseudonym key: from the file when one is named, else from the
	// environment variable.
	KeyringEnv       string `toml:"keyring_env"`
	KeyringFile      string `toml:"keyring_file"`
	PseudonymKeyEnv  string `toml:"pseudonym_key_env"`
	PseudonymKeyFile string `toml:"pseudonym_key_file"`
}

// Audit sinks.
const (
	AuditSinkRedis    = "redis"
	AuditSinkPostgres = "postgres"
	AuditSinkFile     = "file"
)

// Instance is one model server.
type Instance struct {
	Name    string  `toml:"name" json:"name"`
	Address string  `toml:"address" json:"address"`
	Zone    string  `toml:"zone" json:"zone"`
	Version string  `toml:"version" json:"version"`
	Weight  float64 `toml:"weight" json:"weight"`
	// KVSessions is how many conversations' KV cache the instance holds;
	// placement never counts it overloaded below that. 0 means the default.
	KVSessions int `toml:"kv_sessions" json:"kv_sessions"`
	// Pool is "" (on-demand) or "spot" (may be reclaimed at short notice).
	Pool string `toml:"pool" json:"pool"`
}

// SetDefaults fills in the instance's unset version, weight and
// kv_sessions. Parse calls it; so must code that builds an instance
// (the admin API) before validating it.
func (in *Instance) SetDefaults() {
	if in.Version == "" {
		in.Version = DefaultVersion
	}
	if in.Weight == 0 {
		in.Weight = 1
	}
	if in.KVSessions == 0 {
		in.KVSessions = DefaultKVSessions
	}
}

// Modes. Hybrid is for routing.mode only, adaptive for a rule's mode only
// (globally it is routing.adaptive_sticky).
const (
	ModeSticky   = "sticky"
	ModeRandom   = "random"
	ModeHybrid   = "hybrid"   // the rules decide; a request no rule matches is routed at random
	ModeAdaptive = "adaptive" // sticky, but a session moves off a saturated instance
)

// Defaults.
const (
	DefaultExtProcAddr       = "127.0.0.1:50051"
	DefaultAdminAddr         = "127.0.0.1:8090"
	DefaultRedisURL          = "embedded"
	DefaultRedisTimeout      = 10 * time.Millisecond
	DefaultIdleTimeout       = 30 * time.Minute
	DefaultMaxStickyDuration = 1800 * time.Second
	DefaultClusterHeader     = "x-tether-cluster"
	DefaultSecretEnv         = "TETHER_IDENTITY_SECRET"
	DefaultDrainTimeout      = 10 * time.Second
	DefaultDrainDelay        = 3 * time.Second
	DefaultMaxValueBytes     = 4096 // identity.DefaultMaxValueBytes
	MaxDrainDelay            = 5 * time.Minute
	DefaultAdminTokenEnv     = "TETHER_ADMIN_TOKEN"
	MinAdminToken            = 16 // bytes
	DefaultTLSMinVersion     = "1.2"
	DefaultVersion           = "default"
	DefaultKVSessions        = 20
	MaxKVSessions            = 100000
	DefaultVersionAffinity   = VersionPrefer
	DefaultEpsilon           = 0.25
	DefaultTierHeader        = "x-user-tier"
	// DefaultQueueDepth: the depth an instance reports counts the requests
	// it is decoding too, so saturation sits well above its normal batch.
	// Under the benchmark's load the emulated A100s report a median of 3
	// and a p99 of 8; at 4, adaptive routing moved 29% of turns and lost
	// a sixth of the KV-cache hits (BENCHMARKS.md). Tune it to the engine.
	DefaultQueueDepth       = 12
	DefaultQueueDepthHeader = "x-queue-depth"
	DefaultOOMHeader        = "x-oom"
	DefaultGPUHeader        = "x-gpu-utilization"
	DefaultTimezone         = "UTC"
	DefaultFailureThreshold = 3
	DefaultFailureWindow    = 30 * time.Second
	DefaultFailureCooldown  = 30 * time.Second
	MaxFailureThreshold     = 10000

	DefaultAuditRetention      = 30 * 24 * time.Hour
	MaxAuditRetention          = 30 * 24 * time.Hour // the audit package's MaxRetention
	DefaultAuditBuffer         = 4096
	MaxAuditBuffer             = 1 << 20
	DefaultAuditBatch          = 256
	MaxAuditBatch              = 10000
	DefaultAuditPostgresDSNEnv = "TETHER_AUDIT_POSTGRES_DSN"
	DefaultAuditKeyringEnv     = "TETHER_AUDIT_KEYS"
	DefaultAuditPseudonymEnv   = "TETHER_AUDIT_PSEUDONYM_KEY"
)

// Default returns a configuration with every default filled in and no instances.
func Default() Config {
	var c Config
	c.setDefaults()
	return c
}

// Load reads, defaults and validates a file, then checks the files it
// names (CheckFiles). Parse alone touches no file.
func Load(path string) (Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return Config{}, fmt.Errorf("read config: %w", err)
	}
	c, err := Parse(data)
	if err != nil {
		return Config{}, fmt.Errorf("%s: %w", path, err)
	}
	if err := c.CheckFiles(time.Now()); err != nil {
		return Config{}, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

// Parse decodes TOML, fills in defaults and validates. Unknown keys are an
// error: a misspelt key silently ignored is a production incident later.
func Parse(data []byte) (Config, error) {
	var c Config
	md, err := toml.Decode(string(data), &c)
	if err != nil {
		var perr toml.ParseError
		if errors.As(err, &perr) {
			if perr.LastKey != "" {
				return Config{}, fmt.Errorf("line %d: %s: %s", perr.Position.Line, perr.LastKey, perr.Message)
			}
			return Config{}, fmt.Errorf("line %d: %s", perr.Position.Line, perr.Message)
		}
		return Config{}, fmt.Errorf("parse: %w", err)
	}
	if und := md.Undecoded(); len(und) > 0 {
		keys := make([]string, len(und))
		for i, k := range und {
			keys[i] = k.String()
		}
		return Config{}, fmt.Errorf("unknown key %s", strings.Join(keys, ", "))
	}
	c.xdsSet = md.IsDefined("xds", "addr")
	c.epsilonSet = md.IsDefined("routing", "bounded_load_epsilon")
	c.queueDepthSet = md.IsDefined("routing", "saturation_queue_depth")
	c.auditRateSet = md.IsDefined("audit", "sample_rate")
	c.setDefaults()
	if err := c.Validate(); err != nil {
		return Config{}, err
	}
	return c, nil
}

func (c *Config) setDefaults() {
	str := func(s *string, v string) {
		if *s == "" {
			*s = v
		}
	}
	dur := func(d *Duration, v time.Duration) {
		if !d.set {
			*d = Duration{D: v, set: true}
		}
	}
	str(&c.Server.ExtProcAddr, DefaultExtProcAddr)
	str(&c.Server.AdminAddr, DefaultAdminAddr)
	str(&c.Server.LogLevel, "info")
	dur(&c.Server.DrainTimeout, DefaultDrainTimeout)
	dur(&c.Server.DrainDelay, DefaultDrainDelay)
	str(&c.Server.AdminTokenEnv, DefaultAdminTokenEnv)
	str(&c.TLS.MinVersion, DefaultTLSMinVersion)
	str(&c.Redis.URL, DefaultRedisURL)
	dur(&c.Redis.Timeout, DefaultRedisTimeout)
	str(&c.Routing.Mode, ModeSticky)
	if c.Routing.StickyEnabled == nil {
		one := 1
		c.Routing.StickyEnabled = &one
	}
	dur(&c.Routing.MaxStickyDuration, DefaultMaxStickyDuration)
	dur(&c.Routing.IdleTimeout, DefaultIdleTimeout)
	str(&c.Routing.FallbackPolicy, "gradual")
	if c.Routing.FailureThreshold == nil {
		n := DefaultFailureThreshold
		c.Routing.FailureThreshold = &n
	}
	dur(&c.Routing.FailureWindow, DefaultFailureWindow)
	dur(&c.Routing.FailureCooldown, DefaultFailureCooldown)
	str(&c.Routing.ClusterHeader, DefaultClusterHeader)
	str(&c.Routing.VersionAffinity, DefaultVersionAffinity)
	if c.Routing.BoundedLoadEpsilon == 0 && !c.epsilonSet {
		c.Routing.BoundedLoadEpsilon = DefaultEpsilon
	}
	str(&c.Routing.TierHeader, DefaultTierHeader)
	if c.Routing.SaturationQueueDepth == 0 && !c.queueDepthSet {
		c.Routing.SaturationQueueDepth = DefaultQueueDepth
	}
	str(&c.Routing.QueueDepthHeader, DefaultQueueDepthHeader)
	str(&c.Routing.OOMHeader, DefaultOOMHeader)
	str(&c.Routing.GPUUtilizationHeader, DefaultGPUHeader)
	for i := range c.Routing.Rules {
		if r := &c.Routing.Rules[i]; r.Hours != "" || len(r.Days) > 0 {
			str(&r.Timezone, DefaultTimezone)
		}
	}
	str(&c.Identity.SessionHeader, "x-session-id")
	str(&c.Identity.AuthHeader, "authorization")
	str(&c.Identity.DeviceHeader, "x-device-id")
	str(&c.Identity.UserHeader, "x-user-id")
	str(&c.Identity.SecretEnv, DefaultSecretEnv)
	if c.Identity.MaxValueBytes == 0 {
		c.Identity.MaxValueBytes = DefaultMaxValueBytes
	}
	if c.XDS.Addr == "" && !c.xdsSet {
		c.XDS.Addr = DefaultXDSAddr
	}
	str(&c.Envoy.ListenerAddr, DefaultListenerAddr)
	dur(&c.Envoy.MessageTimeout, DefaultMessageTimeout)
	dur(&c.Envoy.RouteTimeout, DefaultRouteTimeout)
	if c.Envoy.Retries == nil {
		c.Envoy.Retries = u32(DefaultRetries)
	}
	if c.Envoy.ExtProc == nil {
		on := true
		c.Envoy.ExtProc = &on
	}
	str(&c.Envoy.PoolLB, "ring_hash")
	for i := range c.Instances {
		c.Instances[i].SetDefaults()
	}
	a := &c.Audit
	str(&a.Sink, AuditSinkRedis)
	dur(&a.Retention, DefaultAuditRetention)
	if a.SampleRate == 0 && !c.auditRateSet {
		a.SampleRate = 1
	}
	if a.Buffer == 0 {
		a.Buffer = DefaultAuditBuffer
	}
	if a.Batch == 0 {
		a.Batch = DefaultAuditBatch
	}
	str(&a.PostgresDSNEnv, DefaultAuditPostgresDSNEnv)
	str(&a.KeyringEnv, DefaultAuditKeyringEnv)
	str(&a.PseudonymKeyEnv, DefaultAuditPseudonymEnv)
}

// Sticky reports whether sessions are bound at all.
func (r Routing) Sticky() bool {
	return r.Mode == ModeSticky && (r.StickyEnabled == nil || *r.StickyEnabled != 0)
}

var (
	headerName   = regexp.MustCompile(`^[a-z0-9][a-z0-9-]*$`)
	versionName  = regexp.MustCompile(`^[A-Za-z0-9._-]{1,63}$`)
	envName      = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
	instanceName = regexp.MustCompile(`^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$`)
)

// Validate checks every value. It expects defaults to be filled in.
func (c *Config) Validate() error {
	var errs []error
	bad := func(key string, val any, why string) {
		errs = append(errs, fmt.Errorf("%s = %v: %s", key, quote(val), why))
	}
	for _, a := range []struct{ key, v string }{
		{"server.extproc_addr", c.Server.ExtProcAddr}, {"server.admin_addr", c.Server.AdminAddr},
	} {
		if _, _, err := net.SplitHostPort(a.v); err != nil {
			bad(a.key, a.v, "want host:port")
		}
	}
	switch c.Server.LogLevel {
	case "debug", "info", "warn", "error":
	default:
		bad("server.log_level", c.Server.LogLevel, "want debug, info, warn or error")
	}
	if c.Server.DrainTimeout.D < 0 {
		bad("server.drain_timeout", c.Server.DrainTimeout, "must not be negative")
	}
	if d := c.Server.DrainDelay.D; d < 0 || d > MaxDrainDelay {
		bad("server.drain_delay", c.Server.DrainDelay, fmt.Sprintf("want 0 (off) to %v", MaxDrainDelay))
	}
	if !envName.MatchString(c.Server.AdminTokenEnv) {
		// Not shown: a token put where its variable's name goes.
		bad("server.admin_token_env", "(hidden)", "want the name of an environment variable, not its value")
	}
	// The scheme only: the store's parser (store/redis CheckURL) reads the
	// rest, in `tether config validate` and when tether starts, and this
	// package imports nothing of tether's. Only the scheme is shown: the
	// rest may hold a password. "embedded" takes no settings (checkEmbedded).
	if why := checkEmbedded(c.Redis.URL); why != "" {
		bad("redis.url", shownRedisURL(c.Redis.URL), why)
	} else if c.Redis.URL != embeddedURL {
		switch urlScheme(c.Redis.URL) {
		case "redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel":
		default:
			bad("redis.url", shownURL(c.Redis.URL), `want "embedded", redis://, rediss://, unix://, redis+cluster://, rediss+cluster://, redis+sentinel:// or rediss+sentinel://`)
		}
	}
	// A store call must end well inside Envoy's ext_proc message timeout:
	// past that Envoy routes on without tether, and the answer is wasted.
	if c.Redis.Timeout.D < time.Millisecond || c.Redis.Timeout.D >= c.Envoy.MessageTimeout.D {
		bad("redis.timeout", c.Redis.Timeout, "want at least 1ms and below envoy.message_timeout "+c.Envoy.MessageTimeout.String())
	}
	switch c.Routing.Mode {
	case ModeSticky, ModeRandom, ModeHybrid:
	default:
		bad("routing.mode", c.Routing.Mode, `want "sticky", "random" or "hybrid"`)
	}
	if se := *c.Routing.StickyEnabled; se != 0 && se != 1 {
		bad("routing.sticky_enabled", se, "want 0 or 1")
	}
	if d := c.Routing.MaxStickyDuration.D; d != 0 && d < time.Second {
		bad("routing.max_sticky_duration", c.Routing.MaxStickyDuration, "want 0 (no limit) or at least 1s")
	}
	if c.Routing.IdleTimeout.D < time.Second {
		bad("routing.idle_timeout", c.Routing.IdleTimeout, "must be at least 1s")
	}
	switch c.Routing.FallbackPolicy {
	case "gradual", "random", "none":
	default:
		bad("routing.fallback_policy", c.Routing.FallbackPolicy, `want "gradual", "random" or "none"`)
	}
	if n := *c.Routing.FailureThreshold; n < 0 || n > MaxFailureThreshold {
		bad("routing.failure_threshold", n, fmt.Sprintf("want 0 (the first failure opens) to %d", MaxFailureThreshold))
	}
	if c.Routing.FailureWindow.D < 100*time.Millisecond {
		bad("routing.failure_window", c.Routing.FailureWindow, "want at least 100ms")
	}
	if c.Routing.FailureCooldown.D < 100*time.Millisecond {
		bad("routing.failure_cooldown", c.Routing.FailureCooldown, "want at least 100ms")
	}
	if strings.HasPrefix(c.Routing.ClusterHeader, "x-envoy-") {
		bad("routing.cluster_header", c.Routing.ClusterHeader, "Envoy reserves x-envoy- headers")
	}
	// Envoy strips the routing header from client requests, so it must not
	// be one that carries identity or that Envoy itself needs.
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
	c.validateRouting(bad)
	if c.Identity.MaxValueBytes < 16 || c.Identity.MaxValueBytes > 8192 {
		bad("identity.max_value_bytes", c.Identity.MaxValueBytes, "want 16 to 8192")
	}
	if c.Identity.Secret != "" && len(c.Identity.Secret) < 16 {
		bad("identity.secret", "(hidden)", "must be at least 16 bytes")
	}
	if !envName.MatchString(c.Identity.SecretEnv) {
		bad("identity.secret_env", c.Identity.SecretEnv, "want an environment variable name")
	}
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
		if err := ipPort(in.Address); err != nil {
			bad(key+".address", in.Address, err.Error())
		}
		if !versionName.MatchString(in.Version) {
			bad(key+".version", in.Version, "want 1-63 letters, digits, '.', '_' or '-'")
		}
		if !(in.Weight > 0) || in.Weight > 1e6 {
			bad(key+".weight", in.Weight, "want a number above 0 and at most 1e6")
		}
		// 0 is the default (kv_sessions left out); Parse and SetDefaults fill it in.
		if in.KVSessions < 0 || in.KVSessions > MaxKVSessions {
			bad(key+".kv_sessions", in.KVSessions, fmt.Sprintf("want 1 to %d", MaxKVSessions))
		}
		switch in.Pool {
		case "", PoolSpot:
		default:
			bad(key+".pool", in.Pool, `want "" (on-demand) or "spot"`)
		}
	}
	c.validateEnvoy(bad)
	c.validateAudit(bad)
	c.validateTLS(bad)
	return errors.Join(errs...)
}

// validateAudit checks [audit] whether or not it is enabled, so a section
// switched on later is already right; what only exists at start (the
// keys, the DSN) is checked then.
func (c *Config) validateAudit(bad func(key string, val any, why string)) {
	a := &c.Audit
	switch a.Sink {
	case AuditSinkRedis, AuditSinkPostgres, AuditSinkFile:
	default:
		bad("audit.sink", a.Sink, `want "redis", "postgres" or "file"`)
	}
	switch r := a.Retention.D; {
	case r <= 0:
		bad("audit.retention", a.Retention, "must be positive")
	case r > MaxAuditRetention:
		bad("audit.retention", a.Retention, "longer than the maximum of 30 days (720h): audit records are kept 30 days at most")
	case r < 24*time.Hour && a.Sink == AuditSinkFile:
		bad("audit.retention", a.Retention, `want at least 24h with sink = "file" (a file per day)`)
	}
	if r := a.SampleRate; !(r > 0 && r <= 1) {
		bad("audit.sample_rate", r, "want 0 < rate <= 1 (1 records every decision)")
	}
	if a.Buffer < 1 || a.Buffer > MaxAuditBuffer {
		bad("audit.buffer", a.Buffer, fmt.Sprintf("want 1 to %d", MaxAuditBuffer))
	}
	if a.Batch < 1 || a.Batch > MaxAuditBatch {
		bad("audit.batch", a.Batch, fmt.Sprintf("want 1 to %d", MaxAuditBatch))
	}
	for _, e := range []struct{ key, v string }{
		{"audit.postgres_dsn_env", a.PostgresDSNEnv}, {"audit.keyring_env", a.KeyringEnv},
		{"audit.pseudonym_key_env", a.PseudonymKeyEnv},
	} {
		if !envName.MatchString(e.v) {
			// Not shown: a DSN or a key put where its variable's name goes.
			bad(e.key, "(hidden)", "want the name of an environment variable, not its value")
		}
	}
	if a.KeyringEnv == a.PseudonymKeyEnv {
		bad("audit.pseudonym_key_env", a.PseudonymKeyEnv, "is also audit.keyring_env: the two keys must differ")
	}
	if a.KeyringFile != "" && a.KeyringFile == a.PseudonymKeyFile {
		bad("audit.pseudonym_key_file", a.PseudonymKeyFile, "is also audit.keyring_file: the two keys must differ")
	}
	if a.Sink == AuditSinkFile && a.FileDir == "" {
		bad("audit.file_dir", a.FileDir, `required with sink = "file"`)
	}
	if a.RedisURL != "" {
		switch {
		case a.Sink != AuditSinkRedis:
			bad("audit.redis_url", shownURL(a.RedisURL), `only used with sink = "redis"`)
		case a.RedisURL == "embedded":
			bad("audit.redis_url", a.RedisURL, "want a Redis URL: records in the embedded (in-process) store die with the process")
		default:
			switch urlScheme(a.RedisURL) {
			case "redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel":
			default:
				bad("audit.redis_url", shownURL(a.RedisURL), "want redis://, rediss://, unix://, redis+cluster://, rediss+cluster://, redis+sentinel:// or rediss+sentinel://")
			}
		}
	}
	if a.Enabled && a.Sink == AuditSinkRedis && a.RedisURL == "" && c.Redis.URL == "embedded" {
		bad("audit.sink", a.Sink, `with redis.url = "embedded" the records would live inside this process, where they die with it `+
			"and `tether audit forget` cannot reach them: set audit.redis_url, or use sink = \"file\" or \"postgres\"")
	}
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// SecretBytes returns the identity secret: from the environment variable
// named by secret_env when it is set, else from the file.
func (i Identity) SecretBytes() []byte {
	if i.SecretEnv != "" {
		if v := os.Getenv(i.SecretEnv); v != "" {
			return []byte(v)
		}
	}
	return []byte(i.Secret)
}

// ipPort checks an upstream address: Envoy's static and EDS endpoints take
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

func quote(v any) string {
	if s, ok := v.(string); ok {
		return fmt.Sprintf("%q", s)
	}
	return fmt.Sprint(v)
}

// TLS is the [tls] section: tether's certificate for its gRPC servers
// (ext_proc and xDS; Envoy is the client of both, so one certificate
// serves both), the CA client certificates must chain to, and, in
// [tls.envoy], the files Envoy presents and trusts in the configuration
// tether generates for it. Without cert_file both servers speak
// plaintext. The admin HTTP server is not covered: it listens on loopback
// by default and takes a bearer token (server.admin_token_env).
type TLS struct {
	CertFile string `toml:"cert_file"`
	KeyFile  string `toml:"key_file"`
	// ClientCAFile turns on mutual TLS: a client must present a
	// certificate that chains to one of its CAs.
	ClientCAFile string `toml:"client_ca_file"`
	// RequireClientCert defaults to true when client_ca_file is set; false
	// verifies a certificate a client offers but lets one without any in
	// (for a migration only).
	RequireClientCert *bool `toml:"require_client_cert"`
	// MinVersion is "1.2" (the default) or "1.3", for tether and for the
	// Envoy side.
	MinVersion string `toml:"min_version"`
	// Envoy is how Envoy connects: the tether-extproc cluster tether
	// serves over xDS and the ADS cluster of the bootstrap get a TLS
	// transport socket with these files (paths on Envoy's host).
	Envoy EnvoyTLS `toml:"envoy"`
}

// EnvoyTLS is the [tls.envoy] section.
type EnvoyTLS struct {
	// CertFile and KeyFile are Envoy's client certificate (mutual TLS).
	CertFile string `toml:"cert_file"`
	KeyFile  string `toml:"key_file"`
	// CAFile verifies tether's certificate.
	CAFile string `toml:"ca_file"`
	// SNI is the server name Envoy sends and requires in tether's
	// certificate (a DNS subject alternative name); "" checks the chain only.
	SNI string `toml:"sni"`
}

// Enabled reports whether the gRPC servers speak TLS.
func (t TLS) Enabled() bool { return t.CertFile != "" }

// ClientAuth is how the gRPC servers treat client certificates.
func (t TLS) ClientAuth() tls.ClientAuthType {
	switch {
	case t.ClientCAFile == "":
		return tls.NoClientCert
	case t.RequireClientCert != nil && !*t.RequireClientCert:
		return tls.VerifyClientCertIfGiven
	default:
		return tls.RequireAndVerifyClientCert
	}
}

// Mutual reports whether every client must present a valid certificate.
func (t TLS) Mutual() bool { return t.ClientAuth() == tls.RequireAndVerifyClientCert }

// MinTLSVersion is min_version as a crypto/tls constant.
func (t TLS) MinTLSVersion() uint16 {
	if t.MinVersion == "1.3" {
		return tls.VersionTLS13
	}
	return tls.VersionTLS12
}

var dnsName = regexp.MustCompile(`^([a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?)(\.[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?)*$`)

// validateTLS checks how the keys fit together; CheckFiles reads the files.
func (c *Config) validateTLS(bad func(key string, val any, why string)) {
	t := c.TLS
	switch {
	case t.KeyFile != "" && t.CertFile == "":
		bad("tls.key_file", t.KeyFile, "set without tls.cert_file")
	case t.CertFile != "" && t.KeyFile == "":
		bad("tls.cert_file", t.CertFile, "set without tls.key_file")
	}
	if t.ClientCAFile != "" && t.CertFile == "" {
		bad("tls.client_ca_file", t.ClientCAFile, "mutual TLS needs tls.cert_file and tls.key_file too")
	}
	if t.RequireClientCert != nil && *t.RequireClientCert && t.ClientCAFile == "" {
		bad("tls.require_client_cert", true, "needs tls.client_ca_file, the CA client certificates must chain to")
	}
	switch t.MinVersion {
	case "1.2", "1.3":
	default:
		bad("tls.min_version", t.MinVersion, `want "1.2" or "1.3" (TLS 1.0 and 1.1 are deprecated, RFC 8996)`)
	}
	e := t.Envoy
	for _, f := range []struct{ key, v string }{
		{"tls.envoy.cert_file", e.CertFile}, {"tls.envoy.key_file", e.KeyFile}, {"tls.envoy.ca_file", e.CAFile}, {"tls.envoy.sni", e.SNI},
	} {
		if f.v != "" && !t.Enabled() {
			bad(f.key, f.v, "tether serves plaintext: set tls.cert_file and tls.key_file, or remove it")
		}
	}
	switch {
	case e.CertFile != "" && e.KeyFile == "":
		bad("tls.envoy.cert_file", e.CertFile, "set without tls.envoy.key_file")
	case e.KeyFile != "" && e.CertFile == "":
		bad("tls.envoy.key_file", e.KeyFile, "set without tls.envoy.cert_file")
	}
	// An IP address passes the DNS name pattern (127.0.0.1 is four
	// labels) but is not one: it cannot be sent as SNI, and the check
	// tether generates matches DNS subject alternative names only.
	if _, err := netip.ParseAddr(e.SNI); err == nil {
		bad("tls.envoy.sni", e.SNI, "an IP address, not a DNS name: an IP cannot be sent as SNI and Envoy would look for it among the certificate's DNS names; name a DNS name of tether's certificate, or leave sni empty to check the chain only")
	} else if e.SNI != "" && (len(e.SNI) > 253 || !dnsName.MatchString(e.SNI)) {
		bad("tls.envoy.sni", e.SNI, "want a DNS name (an IP address cannot be sent as SNI)")
	}
	// With the ADS server on, tether generates Envoy's side: it must work.
	// With it off (Envoy configured elsewhere, as in Istio) [tls.envoy] may
	// be left out, and the generated resources then carry no TLS for
	// Envoy's side; named at all, it must be whole. xds.Build follows the
	// same rule (EnvoyMissing), so a valid configuration always builds.
	for _, m := range t.EnvoyMissing() {
		switch {
		case c.XDS.Addr != "":
			bad(m.Key, "", m.Why+" (required while the ADS server is on)")
		case e != EnvoyTLS{}:
			bad(m.Key, "", m.Why+" (with the ADS server off, name all of [tls.envoy] or none of it)")
		}
	}
}

// Missing is a key [tls.envoy] lacks, and why Envoy needs it.
type Missing struct{ Key, Why string }

// EnvoyMissing lists what [tls.envoy] lacks for Envoy to reach tether's
// [tls] servers: tether's CA, and under mutual TLS Envoy's client
// certificate. Nothing while tether serves plaintext.
func (t TLS) EnvoyMissing() []Missing {
	if !t.Enabled() {
		return nil
	}
	var out []Missing
	if t.Envoy.CAFile == "" {
		out = append(out, Missing{"tls.envoy.ca_file", "required with tls.cert_file: Envoy must verify tether's certificate"})
	}
	if t.Mutual() && t.Envoy.CertFile == "" {
		out = append(out, Missing{"tls.envoy.cert_file", "required with tls.client_ca_file: tether refuses an Envoy without a client certificate"})
	}
	return out
}

// maxPEM bounds a certificate, key or token file: a path such as
// /dev/zero must not hang the start.
const maxPEM = 1 << 20

// readSmall reads a regular file of at most maxPEM bytes; errors name key.
func readSmall(key, path string) ([]byte, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("%s = %q: %w", key, path, pathErr(err))
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s = %q: not a regular file", key, path)
	}
	if fi.Size() > maxPEM {
		return nil, fmt.Errorf("%s = %q: larger than %d bytes", key, path, maxPEM)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("%s = %q: %w", key, path, pathErr(err))
	}
	return b, nil
}

// pathErr drops the path from an os error: the message names it already.
func pathErr(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}

// TLSFiles is what [tls] names, read and checked.
type TLSFiles struct {
	// Certificate is tether's, with Leaf set.
	Certificate tls.Certificate
	// ClientCAs is nil without tls.client_ca_file.
	ClientCAs *x509.CertPool
}

// ReadFiles reads and checks tls.cert_file, tls.key_file and
// tls.client_ca_file: every certificate must be valid at now, the key
// must be the certificate's, and the client CA file must hold CA
// certificates. Errors name the key and the file.
func (t TLS) ReadFiles(now time.Time) (*TLSFiles, error) {
	if !t.Enabled() {
		return nil, errors.New("tls: no tls.cert_file")
	}
	certPEM, err := readSmall("tls.cert_file", t.CertFile)
	if err != nil {
		return nil, err
	}
	chain, err := pemCertificates(certPEM)
	if err != nil {
		return nil, fmt.Errorf("tls.cert_file = %q: %w", t.CertFile, err)
	}
	for i, c := range chain {
		if err := validAt(c, now); err != nil {
			what := "the certificate"
			if i > 0 {
				what = fmt.Sprintf("chain certificate %d (%s)", i, c.Subject)
			}
			return nil, fmt.Errorf("tls.cert_file = %q: %s %w", t.CertFile, what, err)
		}
	}
	keyPEM, err := readSmall("tls.key_file", t.KeyFile)
	if err != nil {
		return nil, err
	}
	if !strings.Contains(string(keyPEM), "PRIVATE KEY-----") {
		return nil, fmt.Errorf("tls.key_file = %q: no PEM private key in the file", t.KeyFile)
	}
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("tls.key_file = %q: not the key of tls.cert_file %q: %w", t.KeyFile, t.CertFile, err)
	}
	pair.Leaf = chain[0]
	out := &TLSFiles{Certificate: pair}
	if t.ClientCAFile == "" {
		return out, nil
	}
	caPEM, err := readSmall("tls.client_ca_file", t.ClientCAFile)
	if err != nil {
		return nil, err
	}
	cas, err := pemCertificates(caPEM)
	if err != nil {
		return nil, fmt.Errorf("tls.client_ca_file = %q: %w", t.ClientCAFile, err)
	}
	out.ClientCAs = x509.NewCertPool()
	for _, ca := range cas {
		if !ca.BasicConstraintsValid || !ca.IsCA {
			return nil, fmt.Errorf("tls.client_ca_file = %q: %q is not a CA certificate (want the CA that signs client certificates, not a client's or tether's own)", t.ClientCAFile, ca.Subject.String())
		}
		if err := validAt(ca, now); err != nil {
			return nil, fmt.Errorf("tls.client_ca_file = %q: CA %q %w", t.ClientCAFile, ca.Subject.String(), err)
		}
		out.ClientCAs.AddCert(ca)
	}
	return out, nil
}

// pemCertificates parses every CERTIFICATE block; none is an error.
func pemCertificates(data []byte) ([]*x509.Certificate, error) {
	var out []*x509.Certificate
	for {
		var b *pem.Block
		b, data = pem.Decode(data)
		if b == nil {
			break
		}
		if b.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			return nil, fmt.Errorf("certificate %d: %w", len(out)+1, err)
		}
		out = append(out, c)
	}
	if len(out) == 0 {
		return nil, errors.New("no PEM certificate in the file")
	}
	return out, nil
}

// validAt says why c is not valid at now, with its dates.
func validAt(c *x509.Certificate, now time.Time) error {
	span := fmt.Sprintf("(valid from %s to %s)", c.NotBefore.UTC().Format(time.RFC3339), c.NotAfter.UTC().Format(time.RFC3339))
	switch {
	case now.After(c.NotAfter):
		return fmt.Errorf("expired on %s %s", c.NotAfter.UTC().Format(time.RFC3339), span)
	case now.Before(c.NotBefore):
		return fmt.Errorf("is not valid until %s %s", c.NotBefore.UTC().Format(time.RFC3339), span)
	}
	return nil
}

// AdminToken returns the admin API's bearer token: the content of
// server.admin_token_file when one is named (trailing white space
// removed), else $server.admin_token_env; "" means the API is open.
// Errors never show the token.
func (s Server) AdminToken() (string, error) {
	var tok, from string
	if s.AdminTokenFile != "" {
		b, err := readSmall("server.admin_token_file", s.AdminTokenFile)
		if err != nil {
			return "", err
		}
		tok, from = strings.TrimRight(string(b), " \t\r\n"), fmt.Sprintf("server.admin_token_file %q", s.AdminTokenFile)
		if tok == "" {
			return "", fmt.Errorf("server.admin_token_file = %q: empty", s.AdminTokenFile)
		}
	} else {
		tok, from = os.Getenv(s.AdminTokenEnv), "$"+s.AdminTokenEnv
		if tok == "" {
			return "", nil
		}
	}
	if len(tok) < MinAdminToken {
		return "", fmt.Errorf("admin token (from %s) is shorter than %d bytes", from, MinAdminToken)
	}
	if strings.ContainsAny(tok, " \t\r\n") {
		return "", fmt.Errorf("admin token (from %s) holds white space: it cannot be sent in an Authorization header", from)
	}
	return tok, nil
}

// CheckFiles reads what the configuration names on this host: the [tls]
// certificates and key, the client CA file, and the admin token file (the
// [tls.envoy] paths are on Envoy's host and are not read). Load calls it,
// so `tether config validate` catches an expired certificate; tether
// reads them again when it starts.
func (c *Config) CheckFiles(now time.Time) error {
	var errs []error
	if c.TLS.Enabled() {
		f, err := c.TLS.ReadFiles(now)
		if err != nil {
			errs = append(errs, err)
		} else if sni := c.TLS.Envoy.SNI; sni != "" {
			if err := f.Certificate.Leaf.VerifyHostname(sni); err != nil {
				errs = append(errs, fmt.Errorf("tls.envoy.sni = %q: tls.cert_file %q does not name it, so Envoy would refuse tether: %w", sni, c.TLS.CertFile, err))
			}
		}
	}
	if c.Server.AdminTokenFile != "" {
		if _, err := c.Server.AdminToken(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// urlScheme is the part of a URL before "://", "" when it has none.
func urlScheme(u string) string {
	scheme, _, ok := strings.Cut(u, "://")
	if !ok {
		return ""
	}
	return scheme
}

// shownURL is what an error may print of a Redis URL: its scheme only,
// when it looks like one. The rest may hold a password, and so may a
// string without "://" (host:port with credentials, a pasted secret).
func shownURL(u string) string {
	scheme := urlScheme(u)
	if scheme == "" || len(scheme) > 20 || strings.Trim(scheme, "abcdefghijklmnopqrstuvwxyz+") != "" {
		return "(not shown: not a URL)"
	}
	return scheme + "://…"
}
