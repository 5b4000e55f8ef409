package config

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp/cmpopts"
)

const good = `
[routing]
sticky_enabled = 1
max_sticky_duration = 1800
fallback_policy = "gradual"
idle_timeout = "5m"

[[instances]]
name = "a100-1"
address = "127.0.0.1:8001"
zone = "z1"
version = "v1"
weight = 2

[[instances]]
name = "a100-2"
address = "127.0.0.1:8002"
`

// derived leaves out of a comparison what Validate derives from the keys
// (a rule's compiled regex and window), which cmp cannot compare.
var derived = cmpopts.IgnoreFields(Rule{}, "Pattern", "Window")

func TestParseGood(t *testing.T) {
	c, err := Parse([]byte(good))
	if err != nil {
		t.Fatal(err)
	}
	if c.Routing.MaxStickyDuration.D != 1800*time.Second || c.Routing.IdleTimeout.D != 5*time.Minute {
		t.Errorf("durations: %v %v", c.Routing.MaxStickyDuration, c.Routing.IdleTimeout)
	}
	if c.Routing.Mode != ModeSticky || c.Routing.StickyEnabled != 1 || c.Routing.FallbackPolicy != "gradual" {
		t.Errorf("routing: %+v", c.Routing)
	}
	if c.Instances[1].Weight != 1 || c.Instances[1].Version != DefaultVersion {
		t.Errorf("instance defaults not applied: %+v", c.Instances[1])
	}
	if c.Server.ExtProcAddr != DefaultExtProcAddr || c.Redis.URL != "embedded" || c.Redis.Timeout.D != DefaultRedisTimeout {
		t.Errorf("server defaults: %+v %+v", c.Server, c.Redis)
	}
}

func TestStickyDisabled(t *testing.T) {
	c, err := Parse([]byte("[routing]\nsticky_enabled = 0\n"))
	if err != nil {
		t.Fatal(err)
	}
	if c.Routing.StickyEnabled != 0 || c.Routing.Mode != ModeSticky {
		t.Fatalf("sticky_enabled = 0 read as %d (mode %s); plan.Mode makes it random", c.Routing.StickyEnabled, c.Routing.Mode)
	}
}

func TestParseBad(t *testing.T) {
	tests := []struct {
		name, toml string
		want       []string // every string must appear in the error
	}{
		{"syntax", "[routing\nmode = 1", []string{"line 2"}},
		{"unknown key", "[routing]\nstiky_enabled = 1", []string{"routing.stiky_enabled"}},
		{"unknown section", "[rooting]\nmode = \"sticky\"", []string{"rooting"}},
		{"bad mode", `[routing]` + "\n" + `mode = "roundrobin"`, []string{"routing.mode", `"roundrobin"`}},
		{"sticky_enabled 2", "[routing]\nsticky_enabled = 2", []string{"routing.sticky_enabled", "2"}},
		{"fallback policy", "[routing]\nfallback_policy = \"panic\"", []string{"routing.fallback_policy", `"panic"`}},
		{"negative failure threshold", "[routing]\nfailure_threshold = -1", []string{"routing.failure_threshold", "-1"}},
		{"huge failure threshold", "[routing]\nfailure_threshold = 99999999", []string{"routing.failure_threshold"}},
		{"tiny failure window", "[routing]\nfailure_window = \"1ms\"", []string{"routing.failure_window", "100ms"}},
		{"zero cooldown", "[routing]\nfailure_cooldown = 0", []string{"routing.failure_cooldown"}},
		{"cooldown not a duration", "[routing]\nfailure_cooldown = \"soon\"", []string{"failure_cooldown", "soon"}},
		{"negative max", "[routing]\nmax_sticky_duration = -5", []string{"routing.max_sticky_duration", "-5s"}},
		{"bad duration string", "[routing]\nidle_timeout = \"soon\"", []string{"idle_timeout", `"soon"`}},
		{"tiny idle", "[routing]\nidle_timeout = \"10ms\"", []string{"routing.idle_timeout", "10ms"}},
		{"duration of wrong type", "[routing]\nidle_timeout = true", []string{"idle_timeout"}},
		{"envoy header", "[routing]\ncluster_header = \"x-envoy-upstream\"", []string{"routing.cluster_header"}},
		{"upper-case header", "[identity]\nsession_header = \"X-Session\"", []string{"identity.session_header"}},
		{"short secret", "[identity]\nsecret = \"abc\"", []string{"identity.secret", "16 bytes"}},
		{"redis scheme", "[redis]\nurl = \"http://:hunter2@h:1\"", []string{"redis.url"}},
		{"bad listen", "[server]\nextproc_addr = \"50051\"", []string{"server.extproc_addr", `"50051"`}},
		{"bad log level", "[server]\nlog_level = \"loud\"", []string{"server.log_level"}},
		{"negative drain delay", "[server]\ndrain_delay = \"-1s\"", []string{"server.drain_delay", "-1s", "0 (off) to 5m0s"}},
		{"drain delay of an hour", "[server]\ndrain_delay = \"1h\"", []string{"server.drain_delay", "1h0m0s"}},
		{"drain delay not a duration", "[server]\ndrain_delay = \"2 seconds\"", []string{"drain_delay", `"2 seconds"`}},
		{"negative destination fallbacks", "[server]\ndestination_fallbacks = -1", []string{"server.destination_fallbacks", "-1", "0 (none) to 8"}},
		{"too many destination fallbacks", "[server]\ndestination_fallbacks = 9", []string{"server.destination_fallbacks", "9"}},
		{"destination fallbacks not a number", "[server]\ndestination_fallbacks = \"two\"", []string{"destination_fallbacks"}},
		{"duplicate instance", "[[instances]]\nname = \"a\"\naddress = \"10.0.0.1:1\"\n[[instances]]\nname = \"a\"\naddress = \"10.0.0.1:2\"", []string{"instances[1].name", "duplicate of instances[0]"}},
		{"instance name", "[[instances]]\nname = \"A B\"\naddress = \"10.0.0.1:1\"", []string{"instances[0].name", `"A B"`}},
		{"instance address", "[[instances]]\nname = \"a\"\naddress = \"nowhere\"", []string{"instances[0].address", `"nowhere"`}},
		{"instance weight", "[[instances]]\nname = \"a\"\naddress = \"10.0.0.1:1\"\nweight = -1", []string{"instances[0].weight", "-1"}},
		{"instance weight NaN", "[[instances]]\nname = \"a\"\naddress = \"10.0.0.1:1\"\nweight = nan", []string{"instances[0].weight"}},
		{"instance unknown key", "[[instances]]\nname = \"a\"\naddress = \"10.0.0.1:1\"\ngpu = \"a100\"", []string{"instances.gpu"}},
		{"host name address", "[[instances]]\nname = \"a\"\naddress = \"gpu-1.internal:8000\"", []string{"instances[0].address", "IP:port"}},
		{"address without port", "[[instances]]\nname = \"a\"\naddress = \"10.0.0.1\"", []string{"instances[0].address", `"10.0.0.1"`}},
		{"port 0", "[[instances]]\nname = \"a\"\naddress = \"10.0.0.1:0\"", []string{"instances[0].address", "port"}},
		{"port too big", "[[instances]]\nname = \"a\"\naddress = \"10.0.0.1:99999\"", []string{"instances[0].address"}},
		{"bad version", "[[instances]]\nname = \"a\"\naddress = \"10.0.0.1:1\"\nversion = \"v 1\"", []string{"instances[0].version"}},
		{"redis timeout zero", "[redis]\ntimeout = 0", []string{"redis.timeout"}},
		{"redis cache size zero", "[redis]\ncache_size = 0", []string{"redis.cache_size", "0", "want 1 to 10000000"}},
		{"redis cache size huge", "[redis]\ncache_size = 20000000", []string{"redis.cache_size", "20000000"}},
		{"redis cache ttl short", "[redis]\ncache_ttl = \"10ms\"", []string{"redis.cache_ttl", "10ms", "100ms to 5m0s"}},
		{"redis cache ttl long", "[redis]\ncache_ttl = \"1h\"", []string{"redis.cache_ttl", "1h0m0s"}},
		{"redis cache flush zero", "[redis]\ncache_flush_interval = 0", []string{"redis.cache_flush_interval", "10ms to 1s"}},
		{"redis cache flush above ttl", "[redis]\ncache_ttl = \"500ms\"\ncache_flush_interval = \"600ms\"", []string{"redis.cache_flush_interval", "below redis.cache_ttl 500ms"}},
		{"redis cache write back below flush", "[redis]\ncache_write_back = \"100ms\"", []string{"redis.cache_write_back", "100ms", "redis.cache_flush_interval 200ms to half redis.cache_ttl, 15s"}},
		{"redis cache write back above half ttl", "[redis]\ncache_ttl = \"10s\"", []string{"redis.cache_write_back", "15s", "to half redis.cache_ttl, 5s"}},
		{"redis cache not a bool", "[redis]\ncache = \"yes\"", []string{"cache"}},
		{"redis timeout above envoy's", "[redis]\ntimeout = \"300ms\"", []string{"redis.timeout", "envoy.message_timeout"}},
		{"tiny max sticky", "[routing]\nmax_sticky_duration = 0.0001", []string{"routing.max_sticky_duration"}},
		{"cluster header is the auth header", "[routing]\ncluster_header = \"authorization\"", []string{"routing.cluster_header", "identity.auth_header"}},
		{"session header is host", "[identity]\nsession_header = \"host\"", []string{"identity.session_header", "HTTP"}},
		{"xds addr", "[xds]\naddr = \"18000\"", []string{"xds.addr"}},
		{"listener host name", "[envoy]\nlistener_addr = \"localhost:10000\"", []string{"envoy.listener_addr"}},
		{"extproc endpoint", "[envoy]\nextproc_endpoints = [\"tether:50051\"]", []string{"envoy.extproc_endpoints[0]"}},
		{"message timeout", "[envoy]\nmessage_timeout = \"-1s\"", []string{"envoy.message_timeout"}},
		{"retries", "[envoy]\nretries = 9", []string{"envoy.retries"}},
		{"outcomes", "[envoy]\noutcomes = \"later\"", []string{"envoy.outcomes", "later"}},
		{"outcome flush below 1ms", "[envoy]\noutcome_flush = \"500us\"", []string{"envoy.outcome_flush", "1ms"}},
		{"outcome flush above 1s", "[envoy]\noutcome_flush = \"2s\"", []string{"envoy.outcome_flush"}},
		{"unknown default version", "[envoy]\ndefault_version = \"v9\"", []string{"envoy.default_version"}},
		{"negative ejection time", "[outlier_detection]\nbase_ejection_time = \"-30s\"", []string{"outlier_detection.base_ejection_time", "-30s"}},
		{"percent above 100", "[outlier_detection]\nmax_ejection_percent = 150", []string{"outlier_detection.max_ejection_percent", "150"}},
		{"consecutive 0", "[outlier_detection]\nconsecutive_5xx = 0", []string{"outlier_detection.consecutive_5xx"}},
		{"negative count", "[outlier_detection]\nconsecutive_5xx = -1", []string{"consecutive_5xx"}},
		{"max below base", "[outlier_detection]\nbase_ejection_time = \"60s\"\nmax_ejection_time = \"30s\"", []string{"outlier_detection.max_ejection_time"}},
		{"override for unknown instance", "[outlier_detection.instances.gpu-9]\nconsecutive_5xx = 2", []string{"outlier_detection.instances.gpu-9", "no such instance"}},
		{"breaker for unknown instance", "[circuit_breakers.instances.gpu-9]\nmax_requests = 2", []string{"circuit_breakers.instances.gpu-9", "no such instance"}},
		{"override with bad value", "[[instances]]\nname = \"a\"\naddress = \"10.0.0.1:1\"\n[outlier_detection.instances.a]\ninterval = \"0s\"", []string{"outlier_detection.instances.a.interval"}},
		{"unknown outlier key", "[outlier_detection]\nconsecutive_500 = 3", []string{"outlier_detection.consecutive_500"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.toml))
			if err == nil {
				t.Fatal("want an error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
}

func TestErrorsNeverShowSecrets(t *testing.T) {
	for _, url := range []string{
		"http://:hunter2@h:1/x",
		"redis+ring://u:hunter2@h:1?addr=h:2",
	} {
		_, err := Parse([]byte("[identity]\nsecret = \"abc\"\n[redis]\nurl = \"" + url + "\""))
		if err == nil {
			t.Fatalf("%s: want an error", url)
		}
		if !strings.Contains(err.Error(), "redis.url") {
			t.Errorf("%s: error %q does not name redis.url", url, err)
		}
		for _, s := range []string{"hunter2", `"abc"`} {
			if strings.Contains(err.Error(), s) {
				t.Errorf("error %q shows a secret %q", err, s)
			}
		}
	}
}

// TestRedisURLForms: every form the store opens passes validation.
func TestRedisURLForms(t *testing.T) {
	for _, url := range []string{
		"embedded",
		"redis://:hunter2@10.0.0.1:6379/0",
		"rediss://10.0.0.1:6380",
		"unix:///run/redis.sock?db=2",
		"redis+cluster://10.0.0.1:7000?addr=10.0.0.2:7000&addr=10.0.0.3:7000",
		"rediss+cluster://u:hunter2@redis-0.internal:6379",
		"redis+sentinel://10.0.0.1:26379?addr=10.0.0.2:26379&master_name=mymaster&db=1",
		"rediss+sentinel://u:hunter2@10.0.0.1:26379/2?master_name=mymaster&password=hunter2",
	} {
		if _, err := Parse([]byte("[redis]\nurl = \"" + url + "\"")); err != nil {
			t.Errorf("%s: %v", url, err)
		}
	}
}

func TestOverridesInherit(t *testing.T) {
	c, err := Parse([]byte("[outlier_detection]\nconsecutive_gateway_failure = 2\n" +
		"[outlier_detection.instances.a]\nconsecutive_5xx = 9\n" +
		"[circuit_breakers]\nmax_requests = 100\n[circuit_breakers.instances.a]\nmax_connections = 7\n" +
		"[[instances]]\nname = \"a\"\naddress = \"10.0.0.1:1\"\n"))
	if err != nil {
		t.Fatal(err)
	}
	// The section's keys the file leaves out keep their defaults; an
	// instance's table sets only its own keys (plan layers them).
	o, oa := c.OutlierDetection, c.OutlierDetection.Instances["a"]
	if *o.ConsecutiveGatewayFailure != 2 || *o.Consecutive5xx != 5 || *o.BaseEjectionTime != Dur(30*time.Second) {
		t.Errorf("outlier_detection: gw=%d 5xx=%d base=%v", *o.ConsecutiveGatewayFailure, *o.Consecutive5xx, *o.BaseEjectionTime)
	}
	if *oa.Consecutive5xx != 9 || oa.ConsecutiveGatewayFailure != nil {
		t.Errorf("outlier_detection.instances.a: %+v", oa)
	}
	b, ba := c.CircuitBreakers, c.CircuitBreakers.Instances["a"]
	if *b.MaxRequests != 100 || *b.MaxConnections != 256 || *ba.MaxConnections != 7 || ba.MaxRequests != nil {
		t.Errorf("circuit_breakers: %d %d, instance a %+v", *b.MaxRequests, *b.MaxConnections, ba)
	}
}

func TestXDSCanBeTurnedOff(t *testing.T) {
	c, err := Parse([]byte("[xds]\naddr = \"\""))
	if err != nil || c.XDS.Addr != "" {
		t.Fatalf("addr %q, err %v: an explicit empty xds.addr turns ADS off", c.XDS.Addr, err)
	}
	if d := Default(); d.XDS.Addr != DefaultXDSAddr {
		t.Fatalf("default xds.addr %q", d.XDS.Addr)
	}
}

func TestLoad(t *testing.T) {
	if _, err := Load(filepath.Join(t.TempDir(), "missing.toml")); err == nil {
		t.Fatal("want an error for a missing file")
	}
	p := filepath.Join(t.TempDir(), "bad.toml")
	if err := os.WriteFile(p, []byte("[routing]\nmode = \"x\""), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := Load(p)
	if err == nil || !strings.Contains(err.Error(), p) || !strings.Contains(err.Error(), "routing.mode") {
		t.Fatalf("error %v should name the file and the key", err)
	}
}

func TestLocalStackConfigIsValid(t *testing.T) {
	c, err := Load(filepath.Join("..", "deploy", "local", "tether.toml"))
	if err != nil {
		t.Fatal(err)
	}
	zones := map[string]int{}
	for _, in := range c.Instances {
		zones[in.Zone]++
	}
	if len(c.Instances) != 8 || len(zones) != 2 {
		t.Fatalf("local stack: %d instances in %d zones, want 8 in 2", len(c.Instances), len(zones))
	}
}

func FuzzParse(f *testing.F) {
	f.Add([]byte(good))
	f.Add([]byte("[routing]\nmax_sticky_duration = 1e300"))
	f.Add([]byte(routingExample))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := Parse(data)
		if err == nil {
			if err := c.Validate(); err != nil {
				t.Fatalf("Parse accepted what Validate refuses: %v", err)
			}
		}
	})
}

// TestReadmeExample keeps the README's configuration example valid.
func TestReadmeExample(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(b), "```toml\n")
	if !ok {
		t.Fatal("README has no toml example")
	}
	example, _, _ := strings.Cut(rest, "```")
	if _, err := Parse([]byte(example)); err != nil {
		t.Fatalf("README example: %v", err)
	}
}

// TestRedisURLErrorsHideSecrets: a Redis URL that is refused is never
// printed beyond its scheme, also when it has no "://" at all.
func TestRedisURLErrorsHideSecrets(t *testing.T) {
	const secret = "hunter2secret"
	for _, doc := range []string{
		"[redis]\nurl = \"" + secret + "@redis.internal:6379\"",
		"[redis]\nurl = \"http://u:" + secret + "@redis\"",
		"[audit]\nsink = \"file\"\nfile_dir = \"/tmp/a\"\nredis_url = \"" + secret + "@redis:6379\"",
		"[audit]\nredis_url = \"" + secret + "@redis:6379\"",
		"[audit]\nredis_url = \"ftp://" + secret + "@redis:6379\"",
	} {
		_, err := Parse([]byte(doc))
		if err == nil {
			t.Errorf("%q accepted", doc)
			continue
		}
		if strings.Contains(err.Error(), secret) {
			t.Errorf("error shows the secret: %v", err)
		}
	}
}

// TestDrainDelay: 2 s unless set; "0s" turns it off rather than taking
// the default.
func TestDrainDelay(t *testing.T) {
	for toml, want := range map[string]time.Duration{
		"":                                   DefaultDrainDelay,
		"[server]\ndrain_delay = \"0s\"":     0,
		"[server]\ndrain_delay = \"7500ms\"": 7500 * time.Millisecond,
	} {
		c, err := Parse([]byte(toml))
		if err != nil {
			t.Fatalf("%q: %v", toml, err)
		}
		if got := c.Server.DrainDelay.D; got != want {
			t.Errorf("%q: drain_delay %v, want %v", toml, got, want)
		}
	}
	if d := Default().Server.DrainDelay.D; d != DefaultDrainDelay {
		t.Errorf("Default() drain_delay %v, want %v", d, DefaultDrainDelay)
	}
}
