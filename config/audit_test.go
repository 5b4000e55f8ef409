package config

import (
	"strings"
	"testing"
	"time"
)

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
