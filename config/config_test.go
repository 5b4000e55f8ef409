package config

import (
	"crypto/tls"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tetherproxy/tether/internal/testenv"
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

func TestParseGood(t *testing.T) {
	c, err := Parse([]byte(good))
	if err != nil {
		t.Fatal(err)
	}
	if c.Routing.MaxStickyDuration.D != 1800*time.Second || c.Routing.IdleTimeout.D != 5*time.Minute {
		t.Errorf("durations: %v %v", c.Routing.MaxStickyDuration, c.Routing.IdleTimeout)
	}
	if !c.Routing.Sticky() || c.Routing.FallbackPolicy != "gradual" {
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
	if c.Routing.Sticky() {
		t.Fatal("sticky_enabled = 0 must turn sticky routing off")
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
		{"redis timeout above envoy's", "[redis]\ntimeout = \"300ms\"", []string{"redis.timeout", "envoy.message_timeout"}},
		{"tiny max sticky", "[routing]\nmax_sticky_duration = 0.0001", []string{"routing.max_sticky_duration"}},
		{"cluster header is the auth header", "[routing]\ncluster_header = \"authorization\"", []string{"routing.cluster_header", "identity.auth_header"}},
		{"session header is host", "[identity]\nsession_header = \"host\"", []string{"identity.session_header", "HTTP"}},
		{"xds addr", "[xds]\naddr = \"18000\"", []string{"xds.addr"}},
		{"listener host name", "[envoy]\nlistener_addr = \"localhost:10000\"", []string{"envoy.listener_addr"}},
		{"extproc endpoint", "[envoy]\nextproc_endpoints = [\"tether:50051\"]", []string{"envoy.extproc_endpoints[0]"}},
		{"message timeout", "[envoy]\nmessage_timeout = \"-1s\"", []string{"envoy.message_timeout"}},
		{"retries", "[envoy]\nretries = 9", []string{"envoy.retries"}},
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
	c, err := Parse([]byte(`
[outlier_detection]
consecutive_gateway_failure = 2
[outlier_detection.instances.a]
consecutive_5xx = 9
[circuit_breakers]
max_requests = 100
[circuit_breakers.instances.a]
max_connections = 7
[[instances]]
name = "a"
address = "10.0.0.1:1"
[[instances]]
name = "b"
address = "10.0.0.2:1"
`))
	if err != nil {
		t.Fatal(err)
	}
	a, b := c.Outlier("a"), c.Outlier("b")
	if *a.Consecutive5xx != 9 || *b.Consecutive5xx != 5 || *a.ConsecutiveGatewayFailure != 2 || *b.ConsecutiveGatewayFailure != 2 {
		t.Errorf("outlier: a 5xx=%d gw=%d, b 5xx=%d gw=%d", *a.Consecutive5xx, *a.ConsecutiveGatewayFailure, *b.Consecutive5xx, *b.ConsecutiveGatewayFailure)
	}
	if *a.BaseEjectionTime != Dur(30*time.Second) {
		t.Errorf("unset field did not take the default: %v", *a.BaseEjectionTime)
	}
	ca, cb := c.Breakers("a"), c.Breakers("b")
	if *ca.MaxConnections != 7 || *cb.MaxConnections != 256 || *ca.MaxRequests != 100 || *cb.MaxRequests != 100 {
		t.Errorf("breakers: a conn=%d req=%d, b conn=%d req=%d", *ca.MaxConnections, *ca.MaxRequests, *cb.MaxConnections, *cb.MaxRequests)
	}
	// Defaults are copies: changing one result must not change the next.
	*a.Consecutive5xx = 1
	if *c.Outlier("a").Consecutive5xx != 9 {
		t.Error("Outlier returned shared state")
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

func TestSecretFromEnv(t *testing.T) {
	t.Setenv("TETHER_TEST_SECRET", "from-the-environment-0123")
	c, err := Parse([]byte("[identity]\nsecret = \"from-the-file-0123456789\"\nsecret_env = \"TETHER_TEST_SECRET\""))
	if err != nil {
		t.Fatal(err)
	}
	if got := string(c.Identity.SecretBytes()); got != "from-the-environment-0123" {
		t.Fatalf("secret %q: the environment must win", got)
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

func TestAuditDefaults(t *testing.T) {
	c, err := Parse([]byte("[audit]\nenabled = false\n"))
	if err != nil {
		t.Fatal(err)
	}
	a := c.Audit
	if a.Enabled || a.Sink != AuditSinkRedis || a.Retention.D != 720*time.Hour || a.SampleRate != 1 ||
		a.Buffer != DefaultAuditBuffer || a.Batch != DefaultAuditBatch || a.PostgresDSNEnv != "TETHER_AUDIT_POSTGRES_DSN" ||
		a.KeyringEnv != "TETHER_AUDIT_KEYS" || a.PseudonymKeyEnv != "TETHER_AUDIT_PSEUDONYM_KEY" {
		t.Errorf("audit defaults: %+v", a)
	}
	if d := Default().Audit; d.SampleRate != 1 || d.Enabled || d.Retention.D != 720*time.Hour {
		t.Errorf("Default().Audit = %+v", d)
	}
}

func TestAuditGood(t *testing.T) {
	for name, toml := range map[string]string{
		"redis of the store": "[redis]\nurl = \"redis://10.0.0.1:6379\"\n[audit]\nenabled = true\n",
		"another redis": "[audit]\nenabled = true\nredis_url = \"redis+cluster://10.0.0.1:7000?addr=10.0.0.2:7000\"\n" +
			"retention = \"168h\"\nsample_rate = 0.05\nbuffer = 100000\nbatch = 1000\n",
		// The DSN's variable is read when tether starts, not when the file is parsed.
		"postgres": "[audit]\nenabled = true\nsink = \"postgres\"\npostgres_dsn_env = \"AUDIT_DSN_NOT_SET_HERE\"\n",
		"file":     "[audit]\nenabled = true\nsink = \"file\"\nfile_dir = \"/var/lib/tether/audit\"\nretention = 2592000\n",
		"key files": "[audit]\nenabled = true\nsink = \"file\"\nfile_dir = \"d\"\nkeyring_file = \"/etc/tether/audit.keys\"\n" +
			"pseudonym_key_file = \"/etc/tether/audit.pseudonym\"\n",
		"disabled on the embedded store": "[audit]\nenabled = false\n",
	} {
		t.Run(name, func(t *testing.T) {
			if _, err := Parse([]byte(toml)); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestAuditBad(t *testing.T) {
	tests := []struct {
		name, toml string
		want       []string // every string must appear in the error
	}{
		{"retention 31 days", "[audit]\nretention = \"744h\"", []string{"audit.retention", "744h", "30 days (720h)"}},
		{"retention 31 days in seconds", "[audit]\nretention = 2678400", []string{"audit.retention", "744h"}},
		{"retention 0", "[audit]\nretention = 0", []string{"audit.retention", "positive"}},
		{"retention negative", "[audit]\nretention = \"-1h\"", []string{"audit.retention", "positive"}},
		{"retention under a day for files", "[audit]\nsink = \"file\"\nfile_dir = \"d\"\nretention = \"12h\"", []string{"audit.retention", "24h"}},
		{"sample rate 0", "[audit]\nsample_rate = 0", []string{"audit.sample_rate", "0 < rate <= 1"}},
		{"sample rate 1.5", "[audit]\nsample_rate = 1.5", []string{"audit.sample_rate", "1.5"}},
		{"sample rate negative", "[audit]\nsample_rate = -0.5", []string{"audit.sample_rate"}},
		{"sample rate NaN", "[audit]\nsample_rate = nan", []string{"audit.sample_rate"}},
		{"unknown sink", "[audit]\nsink = \"kafka\"", []string{"audit.sink", `"kafka"`, `"redis", "postgres" or "file"`}},
		{"file without dir", "[audit]\nsink = \"file\"", []string{"audit.file_dir", "required"}},
		{"buffer negative", "[audit]\nbuffer = -1", []string{"audit.buffer"}},
		{"batch huge", "[audit]\nbatch = 1000000", []string{"audit.batch"}},
		{"dsn env not a name", "[audit]\npostgres_dsn_env = \"postgres://u:hunter2@db/x\"", []string{"audit.postgres_dsn_env", "environment variable"}},
		{"same env for both keys", "[audit]\nkeyring_env = \"K\"\npseudonym_key_env = \"K\"", []string{"audit.pseudonym_key_env", "differ"}},
		{"same file for both keys", "[audit]\nkeyring_file = \"k\"\npseudonym_key_file = \"k\"", []string{"audit.pseudonym_key_file", "differ"}},
		{"redis url with files", "[audit]\nsink = \"file\"\nfile_dir = \"d\"\nredis_url = \"redis://:hunter2@h:1\"", []string{"audit.redis_url", "sink = \"redis\""}},
		{"redis url embedded", "[audit]\nredis_url = \"embedded\"", []string{"audit.redis_url", "embedded"}},
		{"redis url scheme", "[audit]\nredis_url = \"http://:hunter2@h:1\"", []string{"audit.redis_url", `"http://…"`}},
		{"enabled on the embedded store", "[audit]\nenabled = true", []string{"audit.sink", "embedded", "audit.redis_url"}},
		{"unknown key", "[audit]\nsample = 0.5", []string{"audit.sample"}},
		{"enabled not a bool", "[audit]\nenabled = 1", []string{"enabled"}},
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
			if strings.Contains(err.Error(), "hunter2") {
				t.Errorf("error %q shows a password", err)
			}
		})
	}
}

func TestTLSKeys(t *testing.T) {
	const on = "[tls]\ncert_file = \"/c.pem\"\nkey_file = \"/k.pem\"\n"
	const envoy = "[tls.envoy]\nca_file = \"/e/ca.pem\"\n"
	for _, tc := range []struct {
		name, toml string
		want       []string // empty: valid
	}{
		{"plaintext", "", nil},
		{"TLS, ADS off, no Envoy side", "[xds]\naddr = \"\"\n" + on, nil},
		{"mTLS, ADS off, no Envoy side", "[xds]\naddr = \"\"\n" + on + "client_ca_file = \"/ca.pem\"\n", nil},
		// Named at all, Envoy's side must be whole: xds.Build generates it.
		{"mTLS, ADS off, Envoy side without its certificate", "[xds]\naddr = \"\"\n" + on + "client_ca_file = \"/ca.pem\"\n" + envoy,
			[]string{"tls.envoy.cert_file", "client certificate", "none of it"}},
		{"TLS, ADS off, Envoy side without tether's CA", "[xds]\naddr = \"\"\n" + on + "[tls.envoy]\nsni = \"tether.svc\"\n",
			[]string{"tls.envoy.ca_file", "verify tether", "none of it"}},
		{"TLS with Envoy's CA", on + envoy, nil},
		{"mTLS with Envoy's client certificate", on + "client_ca_file = \"/ca.pem\"\n" + envoy + "cert_file = \"/e/c.pem\"\nkey_file = \"/e/k.pem\"\nsni = \"tether.svc\"\n", nil},
		{"verify-if-given without Envoy's certificate", on + "client_ca_file = \"/ca.pem\"\nrequire_client_cert = false\n" + envoy, nil},
		{"TLS 1.3", on + "min_version = \"1.3\"\n" + envoy, nil},
		{"key without cert", "[tls]\nkey_file = \"/k.pem\"", []string{"tls.key_file", `"/k.pem"`, "without tls.cert_file"}},
		{"cert without key", "[tls]\ncert_file = \"/c.pem\"", []string{"tls.cert_file", "without tls.key_file"}},
		{"client CA without cert", "[tls]\nclient_ca_file = \"/ca.pem\"", []string{"tls.client_ca_file", `"/ca.pem"`}},
		{"require without CA", on + "require_client_cert = true\n" + envoy, []string{"tls.require_client_cert", "tls.client_ca_file"}},
		{"TLS 1.1", on + "min_version = \"1.1\"\n" + envoy, []string{"tls.min_version", `"1.1"`, "RFC 8996"}},
		{"TLS 1.0 on plaintext too", "[tls]\nmin_version = \"1.0\"", []string{"tls.min_version"}},
		{"Envoy side while plaintext", envoy, []string{"tls.envoy.ca_file", "plaintext"}},
		{"Envoy cert without key", on + envoy + "cert_file = \"/e/c.pem\"\n", []string{"tls.envoy.cert_file", "tls.envoy.key_file"}},
		{"SNI an IP and port", on + envoy + "sni = \"10.0.0.1:50051\"\n", []string{"tls.envoy.sni"}},
		// The DNS name pattern matches a dotted quad: refused by name.
		{"SNI an IPv4 address", on + envoy + "sni = \"127.0.0.1\"\n", []string{"tls.envoy.sni", `"127.0.0.1"`, "an IP address"}},
		{"SNI an IPv6 address", on + envoy + "sni = \"::1\"\n", []string{"tls.envoy.sni", `"::1"`, "an IP address"}},
		{"SNI a name with digits", on + envoy + "sni = \"tether-0.1.example\"\n", nil},
		{"ADS on without Envoy's CA", on, []string{"tls.envoy.ca_file", "verify tether"}},
		{"mTLS, ADS on, no Envoy certificate", on + "client_ca_file = \"/ca.pem\"\n" + envoy, []string{"tls.envoy.cert_file", "client certificate"}},
		{"unknown key", on + "ca_file = \"/ca.pem\"\n", []string{"tls.ca_file"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.toml))
			if len(tc.want) == 0 {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
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

func TestTLSClientAuth(t *testing.T) {
	no := false
	for _, tc := range []struct {
		tls    TLS
		want   tls.ClientAuthType
		mutual bool
	}{
		{TLS{CertFile: "c"}, tls.NoClientCert, false},
		{TLS{CertFile: "c", ClientCAFile: "ca"}, tls.RequireAndVerifyClientCert, true},
		{TLS{CertFile: "c", ClientCAFile: "ca", RequireClientCert: &no}, tls.VerifyClientCertIfGiven, false},
	} {
		if got := tc.tls.ClientAuth(); got != tc.want || tc.tls.Mutual() != tc.mutual {
			t.Errorf("%+v: ClientAuth %v mutual %v, want %v %v", tc.tls, got, tc.tls.Mutual(), tc.want, tc.mutual)
		}
	}
	if d := Default().TLS; d.Enabled() || d.MinVersion != "1.2" || d.MinTLSVersion() != tls.VersionTLS12 {
		t.Errorf("default [tls] = %+v", d)
	}
	if v := (TLS{MinVersion: "1.3"}).MinTLSVersion(); v != tls.VersionTLS13 {
		t.Errorf("1.3 → %x", v)
	}
}

// TestLoadChecksTLSFiles: Load (and so `tether config validate`) reads the
// files [tls] names; Parse does not.
func TestLoadChecksTLSFiles(t *testing.T) {
	dir := t.TempDir()
	now := time.Now()
	authority := testenv.NewCA(t, "ca.test")
	ca := testenv.WriteFile(t, filepath.Join(dir, "ca.test.crt"), authority.PEM)
	writeCert := func(name string, from, to time.Time) (cert, key string) {
		c, k := authority.Issue(t, name, true, from, to)
		return testenv.WritePair(t, dir, name, c, k)
	}
	good, goodKey := writeCert("tether.test", now.Add(-time.Hour), now.Add(24*time.Hour))
	_, otherKey := writeCert("other.test", now.Add(-time.Hour), now.Add(24*time.Hour))
	old, oldKey := writeCert("old.test", time.Date(2020, 1, 1, 0, 0, 0, 0, time.UTC), time.Date(2021, 1, 1, 0, 0, 0, 0, time.UTC))
	early, earlyKey := writeCert("early.test", now.Add(24*time.Hour), now.Add(48*time.Hour))
	empty := filepath.Join(dir, "empty.pem")
	if err := os.WriteFile(empty, []byte("# nothing here\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	file := func(cert, key, clientCA, sni string) string {
		s := fmt.Sprintf("[xds]\naddr = \"\"\n[tls]\ncert_file = %q\nkey_file = %q\n", cert, key)
		if clientCA != "" {
			s += fmt.Sprintf("client_ca_file = %q\n", clientCA)
		}
		if sni != "" {
			s += fmt.Sprintf("[tls.envoy]\nca_file = \"/envoy/ca.pem\"\nsni = %q\n", sni)
			if clientCA != "" {
				s += "cert_file = \"/envoy/client.crt\"\nkey_file = \"/envoy/client.key\"\n"
			}
		}
		return s
	}
	for _, tc := range []struct {
		name, toml string
		want       []string
	}{
		{"good", file(good, goodKey, ca, "tether.test"), nil},
		{"missing cert", file(filepath.Join(dir, "nope.crt"), goodKey, "", ""), []string{"tls.cert_file", "nope.crt", "no such file"}},
		{"a directory", file(dir, goodKey, "", ""), []string{"tls.cert_file", "not a regular file"}},
		{"no PEM", file(empty, goodKey, "", ""), []string{"tls.cert_file", "empty.pem", "no PEM certificate"}},
		{"key of another certificate", file(good, otherKey, "", ""), []string{"tls.key_file", "other.test.key", "not the key of tls.cert_file", "tether.test.crt"}},
		{"key file holds a certificate", file(good, good, "", ""), []string{"tls.key_file", "no PEM private key"}},
		{"expired", file(old, oldKey, "", ""), []string{"tls.cert_file", "old.test.crt", "expired on 2021-01-01T00:00:00Z", "valid from 2020-01-01T00:00:00Z"}},
		{"not yet valid", file(early, earlyKey, "", ""), []string{"tls.cert_file", "not valid until"}},
		{"client CA without certificates", file(good, goodKey, empty, ""), []string{"tls.client_ca_file", "empty.pem", "no PEM certificate"}},
		{"client CA is a leaf", file(good, goodKey, good, ""), []string{"tls.client_ca_file", "not a CA"}},
		{"SNI the certificate lacks", file(good, goodKey, "", "tether.prod"), []string{"tls.envoy.sni", `"tether.prod"`, "does not name it"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := Parse([]byte(tc.toml)); err != nil {
				t.Fatalf("Parse reads no file, yet: %v", err)
			}
			p := filepath.Join(t.TempDir(), "tether.toml")
			if err := os.WriteFile(p, []byte(tc.toml), 0o600); err != nil {
				t.Fatal(err)
			}
			_, err := Load(p)
			if len(tc.want) == 0 {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil {
				t.Fatal("want an error")
			}
			for _, w := range append(tc.want, p) {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
}

func TestAdminToken(t *testing.T) {
	const tok = "s3cret-admin-token-0123456789"
	dir := t.TempDir()
	write := func(name, s string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	c := Default()
	if c.Server.AdminTokenEnv != "TETHER_ADMIN_TOKEN" || c.Server.AdminAddr != "127.0.0.1:8090" {
		t.Fatalf("defaults: %+v", c.Server)
	}
	t.Setenv("TETHER_TEST_ADMIN", "")
	c.Server.AdminTokenEnv = "TETHER_TEST_ADMIN"
	if got, err := c.Server.AdminToken(); got != "" || err != nil {
		t.Fatalf("unset: %q, %v; want no token", got, err)
	}
	t.Setenv("TETHER_TEST_ADMIN", tok)
	if got, err := c.Server.AdminToken(); got != tok || err != nil {
		t.Fatalf("from env: %q, %v", got, err)
	}
	c.Server.AdminTokenFile = write("token", "file-token-0123456789abcdef\n")
	if got, err := c.Server.AdminToken(); got != "file-token-0123456789abcdef" || err != nil {
		t.Fatalf("from file: %q, %v; the file wins and its newline goes", got, err)
	}
	for _, tc := range []struct {
		name, file, env string
		want            []string
	}{
		{"short env", "", "tiny-tok", []string{"$TETHER_TEST_ADMIN", "shorter than 16"}},
		{"short file", write("short", "tiny-tok\n"), "", []string{"server.admin_token_file", "shorter than 16"}},
		{"empty file", write("empty", "\n"), "", []string{"server.admin_token_file", "empty"}},
		{"space inside", write("space", "tiny-tok 0123456789"), "", []string{"white space"}},
		{"missing file", filepath.Join(dir, "nope"), "", []string{"server.admin_token_file", "no such file"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := c.Server
			s.AdminTokenFile = tc.file
			t.Setenv("TETHER_TEST_ADMIN", tc.env)
			_, err := s.AdminToken()
			if err == nil {
				t.Fatal("want an error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
			if strings.Contains(err.Error(), "tiny-tok") {
				t.Errorf("error %q shows the token", err)
			}
		})
	}
	// The variable's name, not a token, goes in the file.
	_, err := Parse([]byte("[server]\nadmin_token_env = \"" + tok + "-x\""))
	if err == nil || !strings.Contains(err.Error(), "server.admin_token_env") || strings.Contains(err.Error(), tok) {
		t.Fatalf("token as admin_token_env: %v", err)
	}
	// Load checks the token file; the token itself is never in the TOML.
	p := write("tether.toml", "[server]\nadmin_token_file = \""+filepath.Join(dir, "nope")+"\"\n")
	if _, err := Load(p); err == nil || !strings.Contains(err.Error(), "server.admin_token_file") {
		t.Fatalf("Load with a missing token file: %v", err)
	}
	if _, err := Parse([]byte("[server]\nadmin_token = \"" + tok + "\"")); err == nil || !strings.Contains(err.Error(), "server.admin_token") {
		t.Fatalf("admin_token in the file: %v", err)
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
