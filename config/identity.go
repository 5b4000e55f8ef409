package config

// Identity names the headers that identify a caller.
type Identity struct {
	SessionHeader string `toml:"session_header"`
	AuthHeader    string `toml:"auth_header"`
	DeviceHeader  string `toml:"device_header"`
	UserHeader    string `toml:"user_header"`
	MaxValueBytes int    `toml:"max_value_bytes"`
	// Secret keys the HMAC of identifiers. Prefer SecretEnv. A secret in a
	// file is easy to leak (see SecretBytes).
	Secret    string `toml:"secret"`
	SecretEnv string `toml:"secret_env"`
}

// Defaults of [identity].
const (
	DefaultSessionHeader = "x-session-id"
	DefaultAuthHeader    = "authorization"
	DefaultDeviceHeader  = "x-device-id"
	DefaultUserHeader    = "x-user-id"
	DefaultMaxValueBytes = 4096 // identity.DefaultMaxValueBytes
	DefaultSecretEnv     = "TETHER_IDENTITY_SECRET"
)

func defaultIdentity() Identity {
	return Identity{
		SessionHeader: DefaultSessionHeader,
		AuthHeader:    DefaultAuthHeader,
		DeviceHeader:  DefaultDeviceHeader,
		UserHeader:    DefaultUserHeader,
		MaxValueBytes: DefaultMaxValueBytes,
		SecretEnv:     DefaultSecretEnv,
	}
}

// validateIdentity checks [identity] but its header names. validateHeaders
// checks those, with the routing headers they must not clash with.
func (c *Config) validateIdentity(bad reporter) {
	id := c.Identity
	if id.MaxValueBytes < 16 || id.MaxValueBytes > 8192 {
		bad("identity.max_value_bytes", id.MaxValueBytes, "want 16 to 8192")
	}
	if id.Secret != "" && len(id.Secret) < 16 {
		bad("identity.secret", "(hidden)", "must be at least 16 bytes")
	}
	if !envName.MatchString(id.SecretEnv) {
		bad("identity.secret_env", id.SecretEnv, "want an environment variable name")
	}
}
