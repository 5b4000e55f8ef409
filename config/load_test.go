package config

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/BurntSushi/toml"
	"github.com/google/go-cmp/cmp"
)

// TestParseEmptyIsDefault: a file that sets nothing is Default().
func TestParseEmptyIsDefault(t *testing.T) {
	for _, doc := range []string{"", "[server]\n[routing]\n[envoy]\n[audit]\n[tls]\n"} {
		c := must(t, doc)
		if d := cmp.Diff(Default(), c); d != "" {
			t.Errorf("%q (-Default +Parse):\n%s", doc, d)
		}
	}
}

// TestSetKeyWins: a key left out keeps its default, a key set wins, also
// when set to 0, "" or false; pointers stay nil until set.
func TestSetKeyWins(t *testing.T) {
	no := false
	for _, tc := range []struct {
		name, toml string
		got        func(Config) any
		want       any
	}{
		{"xds.addr left out", "", func(c Config) any { return c.XDS.Addr }, DefaultXDSAddr},
		{"xds.addr empty turns ADS off", "[xds]\naddr = \"\"", func(c Config) any { return c.XDS.Addr }, ""},
		{"epsilon left out", "", func(c Config) any { return c.Routing.BoundedLoadEpsilon }, DefaultEpsilon},
		{"queue depth left out", "", func(c Config) any { return c.Routing.SaturationQueueDepth }, DefaultQueueDepth},
		{"queue depth 0 is off", "[routing]\nsaturation_queue_depth = 0", func(c Config) any { return c.Routing.SaturationQueueDepth }, 0},
		{"sample rate left out", "", func(c Config) any { return c.Audit.SampleRate }, 1.0},
		{"sticky left out", "", func(c Config) any { return c.Routing.StickyEnabled }, 1},
		{"sticky_enabled 0", "[routing]\nsticky_enabled = 0", func(c Config) any { return c.Routing.StickyEnabled }, 0},
		{"failure threshold left out", "", func(c Config) any { return c.Routing.FailureThreshold }, DefaultFailureThreshold},
		{"failure threshold 0", "[routing]\nfailure_threshold = 0", func(c Config) any { return c.Routing.FailureThreshold }, 0},
		{"retries left out", "", func(c Config) any { return c.Envoy.Retries }, uint32(DefaultRetries)},
		{"retries 0", "[envoy]\nretries = 0", func(c Config) any { return c.Envoy.Retries }, uint32(0)},
		{"ext_proc left out", "", func(c Config) any { return c.Envoy.ExtProc }, true},
		{"ext_proc false", "[envoy]\next_proc = false", func(c Config) any { return c.Envoy.ExtProc }, false},
		{"max sticky left out", "", func(c Config) any { return c.Routing.MaxStickyDuration.D }, DefaultMaxStickyDuration},
		{"max sticky 0 is never", "[routing]\nmax_sticky_duration = 0", func(c Config) any { return c.Routing.MaxStickyDuration.D }, time.Duration(0)},
		{"drain delay 0 is off", "[server]\ndrain_delay = 0", func(c Config) any { return c.Server.DrainDelay.D }, time.Duration(0)},
		{"route timeout 0 is none", "[envoy]\nroute_timeout = \"0s\"", func(c Config) any { return c.Envoy.RouteTimeout.D }, time.Duration(0)},
		{"seconds", "[routing]\nidle_timeout = 90", func(c Config) any { return c.Routing.IdleTimeout.D }, 90 * time.Second},
		{"fractional seconds", "[routing]\nidle_timeout = 1.5", func(c Config) any { return c.Routing.IdleTimeout.D }, 1500 * time.Millisecond},
		{"Go duration", "[routing]\nidle_timeout = \"1m30s\"", func(c Config) any { return c.Routing.IdleTimeout.D }, 90 * time.Second},
		{"debug headers true", "[server]\ndebug_headers = true", func(c Config) any { return c.Server.DebugHeaders }, true},
		{"require_client_cert left out", "", func(c Config) any { return c.TLS.RequireClientCert }, (*bool)(nil)},
		{"require_client_cert false", "[xds]\naddr = \"\"\n[tls]\ncert_file = \"c\"\nkey_file = \"k\"\nclient_ca_file = \"ca\"\nrequire_client_cert = false",
			func(c Config) any { return c.TLS.RequireClientCert }, &no},
		{"outlier left out", "", func(c Config) any { return *c.OutlierDetection.EnforcingConsecutive5xx }, uint32(100)},
		{"outlier 0 overrides", "[outlier_detection]\nenforcing_consecutive_5xx = 0",
			func(c Config) any { return *c.OutlierDetection.EnforcingConsecutive5xx }, uint32(0)},
		{"breaker 0 overrides", "[circuit_breakers]\nmax_retries = 0",
			func(c Config) any { return *c.CircuitBreakers.MaxRetries }, uint32(0)},
		{"instance defaults", "[[instances]]\nname = \"a\"\naddress = \"10.0.0.1:1\"",
			func(c Config) any { return c.Instances[0] }, Instance{Name: "a", Address: "10.0.0.1:1", Version: DefaultVersion, Weight: 1, KVSessions: DefaultKVSessions, Capacity: CapacityOnDemand, Engine: EngineGeneric}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if d := cmp.Diff(tc.want, tc.got(must(t, tc.toml))); d != "" {
				t.Errorf("(-want +got):\n%s", d)
			}
		})
	}
	// Set to a value that is refused, a key with a default is refused by
	// name, not replaced by its default.
	for doc, key := range map[string]string{
		"[routing]\nbounded_load_epsilon = 0": "routing.bounded_load_epsilon = 0",
		"[audit]\nsample_rate = 0":            "audit.sample_rate = 0",
		"[server]\nlog_level = \"\"":          `server.log_level = ""`,
		"[routing]\nidle_timeout = 0":         "routing.idle_timeout = 0s",
		"[identity]\nmax_value_bytes = 0":     "identity.max_value_bytes = 0",
	} {
		if _, err := Parse([]byte(doc)); err == nil || !strings.Contains(err.Error(), key) {
			t.Errorf("%q: error %v, want one naming %s", doc, err, key)
		}
	}
}

// TestEncodeRoundTrip: e2e and the lab build a Config in code and hand it
// to tether through BurntSushi/toml's encoder; Parse must read back the
// same Config, zero values that differ from the defaults included.
func TestEncodeRoundTrip(t *testing.T) {
	no := false
	c := Default()
	c.Server.ExtProcAddr = "0.0.0.0:50051"
	c.Server.DebugHeaders = true
	c.Server.LogLevel = "debug"
	c.Server.DrainDelay = Dur(0)
	c.Server.DrainTimeout = Dur(2500 * time.Millisecond)
	c.Server.AdminTokenFile = "/run/secrets/admin-token"
	c.Redis.URL = "redis://10.0.0.1:6379/2"
	c.Redis.Timeout = Dur(25 * time.Millisecond)
	r := &c.Routing
	r.Mode = ModeHybrid
	r.StickyEnabled = 0
	r.MaxStickyDuration = Dur(0)
	r.IdleTimeout = Dur(90 * time.Second)
	r.FallbackPolicy = "none"
	r.FailureThreshold = 0
	r.FailureWindow = Dur(1500 * time.Millisecond)
	r.ClusterHeader = "x-cluster"
	r.RandomSeed = 42
	r.AdaptiveSticky = 1
	r.VersionAffinity = VersionStrict
	r.CanaryByHeader = "x-canary"
	r.BoundedLoadEpsilon = 0.1
	r.SaturationInFlight = 4
	r.SaturationQueueDepth = 0
	r.Rules = []Rule{
		{Name: "peak", PathPrefix: "/v1", Header: "x-plan", Value: "pro", Tiers: []string{"gold"}, Hours: "22:00-06:00",
			Days: []string{"mon", "fri"}, Timezone: "Europe/Paris", Mode: ModeAdaptive, IdleTimeout: Dur(2 * time.Hour),
			Priority: PriorityHigh, Version: "v2"},
		{Name: "batch", Header: "x-client", Regex: "^batch-", Mode: ModeRandom},
		{Name: "weekend", Days: []string{"sat"}, Timezone: DefaultTimezone, Mode: ModeSticky},
	}
	c.Identity.SessionHeader = "x-conversation"
	c.Identity.MaxValueBytes = 16
	c.Identity.SecretEnv = "MY_SECRET"
	c.Instances = []Instance{
		{Name: "a", Address: "10.0.0.1:8000", Zone: "z1", Version: "v1", Weight: 2, KVSessions: 64, Capacity: CapacityOnDemand},
		{Name: "b", Address: "10.0.0.2:8000", Zone: "z2", Version: "v2", Weight: 0.5, KVSessions: 1, Capacity: CapacitySpot},
	}
	c.Versions = []Version{{Name: "v1", Weight: 0}, {Name: "v2", Weight: 1, Canary: true}}
	c.XDS.Addr = ""
	c.Envoy.ListenerAddr = "0.0.0.0:10000"
	c.Envoy.ExtProcEndpoints = []string{"10.0.0.9:50051", "10.0.0.10:50051"}
	c.Envoy.MessageTimeout = Dur(500 * time.Millisecond)
	c.Envoy.RouteTimeout = Dur(0)
	c.Envoy.Retries = 0
	c.Envoy.DefaultVersion = "v1"
	c.Envoy.ExtProc = false
	c.Envoy.PoolLB = "least_request"
	c.OutlierDetection.Consecutive5xx = u32(7)
	c.OutlierDetection.EnforcingSuccessRate = u32(0)
	c.OutlierDetection.Interval = dur(5 * time.Second)
	c.OutlierDetection.Instances = map[string]OutlierSettings{
		"a": {EnforcingConsecutive5xx: u32(0), BaseEjectionTime: dur(time.Minute), MaxEjectionTime: dur(10 * time.Minute)},
	}
	c.CircuitBreakers.MaxRetries = u32(0)
	c.CircuitBreakers.Instances = map[string]CircuitBreakerSettings{"b": {MaxRequests: u32(8)}}
	c.Audit = Audit{Enabled: true, Sink: AuditSinkFile, Retention: Dur(48 * time.Hour), SampleRate: 0.05, Buffer: 1, Batch: 1,
		PostgresDSNEnv: "DSN", FileDir: "/var/lib/tether/audit", KeyringEnv: "KEYS", KeyringFile: "/etc/tether/keys",
		PseudonymKeyEnv: "PSEUDO", PseudonymKeyFile: "/etc/tether/pseudonym"}
	c.TLS = TLS{CertFile: "/etc/tether/tls.crt", KeyFile: "/etc/tether/tls.key", ClientCAFile: "/etc/tether/ca.crt",
		RequireClientCert: &no, MinVersion: "1.3"}
	if err := c.Validate(); err != nil {
		t.Fatalf("the test's config is invalid: %v", err)
	}

	for name, want := range map[string]Config{"Default": Default(), "edited": c} {
		t.Run(name, func(t *testing.T) {
			var b bytes.Buffer
			if err := toml.NewEncoder(&b).Encode(want); err != nil {
				t.Fatal(err)
			}
			got, err := Parse(b.Bytes())
			if err != nil {
				t.Fatalf("%v\n%s", err, b.String())
			}
			if d := cmp.Diff(want, got, derived); d != "" {
				t.Errorf("round trip (-encoded +parsed):\n%s\n%s", d, b.String())
			}
		})
	}
}
