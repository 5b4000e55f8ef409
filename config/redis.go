package config

import (
	"fmt"
	"strings"
	"time"
)

// Redis says where bindings live.
type Redis struct {
	// URL is one of:
	//   - redis://host:port/db, rediss://… or unix:///path;
	//   - redis+cluster://host:port?addr=…;
	//   - redis+sentinel://host:port?master_name=…;
	//   - "embedded", the in-process memory store, which takes no settings
	//     (see store Open).
	URL string `toml:"url"`
	// Timeout bounds each call on the request path, 10ms by default. Past
	// it the request is placed without Redis. After 5 such failures in a
	// row the store stops calling Redis for a cooldown (see store/redis).
	Timeout Duration `toml:"timeout"`
	// Cache serves a sticky hit from what the replica already knows,
	// without a round trip. An invalidation channel keeps it true across
	// replicas (see store/redis cache.go). It works on a standalone Redis,
	// a Sentinel's master or a Cluster.
	Cache bool `toml:"cache"`
	// CacheSize is the most sessions a replica caches.
	CacheSize int `toml:"cache_size"`
	// CacheTTL is the longest a cached binding is served after Redis last
	// answered for it, by a lookup or a write back. It is a backstop:
	// changes arrive by message.
	CacheTTL Duration `toml:"cache_ttl"`
	// CacheFlushInterval is how often the write backs due are sent, in
	// one pipeline.
	CacheFlushInterval Duration `toml:"cache_flush_interval"`
	// CacheWriteBack is how long a session's cached hits wait, from the
	// first of them, to be written back together. A write back carries the
	// session's idle refresh, its request count and its last use. So Redis
	// refreshes a busy session at most once per CacheWriteBack per replica.
	CacheWriteBack Duration `toml:"cache_write_back"`
}

// Defaults of [redis].
const (
	DefaultRedisURL     = "embedded"
	DefaultRedisTimeout = 10 * time.Millisecond
	// The hit cache's defaults (store/redis DefaultCache*).
	DefaultRedisCacheSize          = 100_000
	DefaultRedisCacheTTL           = 30 * time.Second
	DefaultRedisCacheFlushInterval = 200 * time.Millisecond
	DefaultRedisCacheWriteBack     = 15 * time.Second
	// Bounds of the hit cache's settings.
	maxRedisCacheSize          = 10_000_000
	minRedisCacheTTL           = 100 * time.Millisecond
	maxRedisCacheTTL           = 5 * time.Minute
	minRedisCacheFlushInterval = 10 * time.Millisecond
	maxRedisCacheFlushInterval = time.Second
)

func defaultRedis() Redis {
	return Redis{URL: DefaultRedisURL, Timeout: Dur(DefaultRedisTimeout), Cache: true,
		CacheSize: DefaultRedisCacheSize, CacheTTL: Dur(DefaultRedisCacheTTL), CacheFlushInterval: Dur(DefaultRedisCacheFlushInterval),
		CacheWriteBack: Dur(DefaultRedisCacheWriteBack)}
}

func (c *Config) validateRedis(bad reporter) {
	// The scheme only. The store's parser, store/redis CheckURL, reads the
	// rest, in `tether config validate` and when tether starts. This
	// package imports nothing of tether's. Only the scheme is shown, since
	// the rest may hold a password. "embedded" takes no settings
	// (checkEmbedded).
	if why := checkEmbedded(c.Redis.URL); why != "" {
		bad("redis.url", shownRedisURL(c.Redis.URL), why)
	} else if c.Redis.URL != embeddedURL && !redisScheme(c.Redis.URL) {
		bad("redis.url", shownURL(c.Redis.URL), `want "embedded", `+redisSchemes)
	}
	// A store call must end well inside Envoy's ext_proc message timeout.
	// Past that Envoy routes on without tether, and the answer is wasted.
	if c.Redis.Timeout.D < time.Millisecond || c.Redis.Timeout.D >= c.Envoy.MessageTimeout.D {
		bad("redis.timeout", c.Redis.Timeout, "want at least 1ms and below envoy.message_timeout "+c.Envoy.MessageTimeout.String())
	}
	// Checked whether or not the cache is on, so turning it on later
	// cannot surprise.
	r := c.Redis
	if r.CacheSize < 1 || r.CacheSize > maxRedisCacheSize {
		bad("redis.cache_size", r.CacheSize, fmt.Sprintf("want 1 to %d sessions", maxRedisCacheSize))
	}
	if r.CacheTTL.D < minRedisCacheTTL || r.CacheTTL.D > maxRedisCacheTTL {
		bad("redis.cache_ttl", r.CacheTTL, fmt.Sprintf("want %v to %v", minRedisCacheTTL, maxRedisCacheTTL))
	}
	if r.CacheFlushInterval.D < minRedisCacheFlushInterval || r.CacheFlushInterval.D > maxRedisCacheFlushInterval {
		bad("redis.cache_flush_interval", r.CacheFlushInterval, fmt.Sprintf("want %v to %v", minRedisCacheFlushInterval, maxRedisCacheFlushInterval))
	} else if r.CacheFlushInterval.D >= r.CacheTTL.D {
		bad("redis.cache_flush_interval", r.CacheFlushInterval, "want below redis.cache_ttl "+r.CacheTTL.String())
	} else if r.CacheWriteBack.D < r.CacheFlushInterval.D || r.CacheWriteBack.D > r.CacheTTL.D/2 {
		// A busy session's write back is what keeps its entry fresh. Even
		// a flush late, it must come well before the entry's TTL runs out.
		bad("redis.cache_write_back", r.CacheWriteBack, fmt.Sprintf("want redis.cache_flush_interval %v to half redis.cache_ttl, %v",
			r.CacheFlushInterval, r.CacheTTL.D/2))
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
// when it looks like one. The rest may hold a password. So may a string
// without "://", such as host:port with credentials or a pasted secret.
func shownURL(u string) string {
	scheme := urlScheme(u)
	if scheme == "" || len(scheme) > 20 || strings.Trim(scheme, "abcdefghijklmnopqrstuvwxyz+") != "" {
		return "(not shown: not a URL)"
	}
	return scheme + "://…"
}
