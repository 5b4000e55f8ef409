package config

import (
	"strings"
	"time"
)

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

// Defaults of [redis].
const (
	DefaultRedisURL     = "embedded"
	DefaultRedisTimeout = 10 * time.Millisecond
)

func defaultRedis() Redis {
	return Redis{URL: DefaultRedisURL, Timeout: Dur(DefaultRedisTimeout)}
}

func (c *Config) validateRedis(bad reporter) {
	// The scheme only: the store's parser (store/redis CheckURL) reads the
	// rest, in `tether config validate` and when tether starts, and this
	// package imports nothing of tether's. Only the scheme is shown: the
	// rest may hold a password. "embedded" takes no settings (checkEmbedded).
	if why := checkEmbedded(c.Redis.URL); why != "" {
		bad("redis.url", shownRedisURL(c.Redis.URL), why)
	} else if c.Redis.URL != embeddedURL && !redisScheme(c.Redis.URL) {
		bad("redis.url", shownURL(c.Redis.URL), `want "embedded", `+redisSchemes)
	}
	// A store call must end well inside Envoy's ext_proc message timeout:
	// past that Envoy routes on without tether, and the answer is wasted.
	if c.Redis.Timeout.D < time.Millisecond || c.Redis.Timeout.D >= c.Envoy.MessageTimeout.D {
		bad("redis.timeout", c.Redis.Timeout, "want at least 1ms and below envoy.message_timeout "+c.Envoy.MessageTimeout.String())
	}
}

// redisSchemes lists the URL forms store/redis opens, for errors.
const redisSchemes = "redis://, rediss://, unix://, redis+cluster://, rediss+cluster://, redis+sentinel:// or rediss+sentinel://"

// redisScheme reports whether u has a scheme store/redis opens.
func redisScheme(u string) bool {
	switch urlScheme(u) {
	case "redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel":
		return true
	}
	return false
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
