package config

import (
	"fmt"
	"time"
)

// Audit configures the routing audit. It writes one record per decision.
// The record holds the user id sealed with AES-256-GCM, and a keyed
// pseudonym to find a user's records by. Secrets never sit in the file.
// The keys and the PostgreSQL DSN come from environment variables or key
// files that the file names.
type Audit struct {
	Enabled bool `toml:"enabled"`
	// Sink is "redis", "postgres" or "file".
	//   - "redis" is a Stream, <prefix>audit, in the binding store's Redis
	//     or in RedisURL's.
	//   - "file" is JSON lines, one file per UTC day in FileDir.
	Sink string `toml:"sink"`
	// Retention is at most 720h (30 days), and at least 24h for files.
	Retention Duration `toml:"retention"`
	// SampleRate is the fraction of hits and random decisions recorded,
	// in (0, 1]. Decisions that make or change a binding are always
	// recorded, so forget finds every binding made.
	SampleRate float64 `toml:"sample_rate"`
	// Buffer is how many records may wait for the sink. Past it they are
	// dropped and counted. Batch is the most written at once.
	Buffer int `toml:"buffer"`
	Batch  int `toml:"batch"`
	// PostgresDSNEnv names the environment variable holding the
	// PostgreSQL DSN. The DSN may hold a password.
	PostgresDSNEnv string `toml:"postgres_dsn_env"`
	FileDir        string `toml:"file_dir"`
	// RedisURL, when set, puts the stream in another Redis than the
	// binding store's. It takes the forms of redis.url, except "embedded".
	RedisURL string `toml:"redis_url"`
	// The keyring and the pseudonym key come from the file when one is
	// named, else from the environment variable. The keyring holds
	// "id=key" entries, the current key first.
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

// Defaults and bounds of [audit].
const (
	DefaultAuditRetention      = 30 * 24 * time.Hour
	MaxAuditRetention          = 30 * 24 * time.Hour // the audit package's MaxRetention
	DefaultAuditSampleRate     = 1.0
	DefaultAuditBuffer         = 4096
	MaxAuditBuffer             = 1 << 20
	DefaultAuditBatch          = 256
	MaxAuditBatch              = 10000
	DefaultAuditPostgresDSNEnv = "TETHER_AUDIT_POSTGRES_DSN"
	DefaultAuditKeyringEnv     = "TETHER_AUDIT_KEYS"
	DefaultAuditPseudonymEnv   = "TETHER_AUDIT_PSEUDONYM_KEY"
)

func defaultAudit() Audit {
	return Audit{
		Sink:            AuditSinkRedis,
		Retention:       Dur(DefaultAuditRetention),
		SampleRate:      DefaultAuditSampleRate,
		Buffer:          DefaultAuditBuffer,
		Batch:           DefaultAuditBatch,
		PostgresDSNEnv:  DefaultAuditPostgresDSNEnv,
		KeyringEnv:      DefaultAuditKeyringEnv,
		PseudonymKeyEnv: DefaultAuditPseudonymEnv,
	}
}

// validateAudit checks [audit] whether or not it is enabled. So a section
// switched on later is already right. What only exists at start, the keys
// and the DSN, is checked then.
func (c *Config) validateAudit(bad reporter) {
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
		case a.RedisURL == embeddedURL:
			bad("audit.redis_url", a.RedisURL, "want a Redis URL: records in the embedded (in-process) store die with the process")
		case !redisScheme(a.RedisURL):
			bad("audit.redis_url", shownURL(a.RedisURL), "want "+redisSchemes)
		}
	}
	if a.Enabled && a.Sink == AuditSinkRedis && a.RedisURL == "" && c.Redis.URL == embeddedURL {
		bad("audit.sink", a.Sink, `with redis.url = "embedded" the records would live inside this process, where they die with it `+
			"and `tether audit forget` cannot reach them: set audit.redis_url, or use sink = \"file\" or \"postgres\"")
	}
}
