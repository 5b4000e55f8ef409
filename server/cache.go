package server

import (
	"github.com/prometheus/client_golang/prometheus"

	redisstore "github.com/tetherproxy/tether/store/redis"
)

// registerHitCache exports the Redis store's hit cache counters. They
// stay zero when the cache is off: on a Cluster, on a Sentinel, or with
// [redis] cache = false.
func registerHitCache(reg prometheus.Registerer, s *redisstore.Store) {
	counter := func(name, help string, v func(redisstore.CacheStats) uint64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help},
			func() float64 { return float64(v(s.CacheStats())) })
	}
	gauge := func(name, help string, v func(redisstore.CacheStats) float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help},
			func() float64 { return v(s.CacheStats()) })
	}
	reg.MustRegister(
		counter("tether_redis_cache_hits_total", "Sticky hits served from the replica's cache, without a Redis round trip.",
			func(c redisstore.CacheStats) uint64 { return c.Hits }),
		counter("tether_redis_cache_misses_total", "Lookups the hit cache could not serve (sent to Redis).",
			func(c redisstore.CacheStats) uint64 { return c.Misses }),
		counter("tether_redis_cache_invalidations_total", "Cached sessions dropped because a binding changed (a message from another replica, or this one's own change).",
			func(c redisstore.CacheStats) uint64 { return c.Invalidations }),
		counter("tether_redis_cache_flushes_total", "Whole-cache flushes: the invalidation subscription dropped or missed a PING.",
			func(c redisstore.CacheStats) uint64 { return c.Flushes }),
		counter("tether_redis_cache_malformed_messages_total", "Invalidation messages that named no binding, ignored.",
			func(c redisstore.CacheStats) uint64 { return c.Malformed }),
		counter("tether_redis_cache_writebacks_dropped_total", "Hits whose write back found the queue full: each went to Redis instead (one round trip).",
			func(c redisstore.CacheStats) uint64 { return c.Dropped }),
		gauge("tether_redis_cache_entries", "Sessions in the replica's hit cache.",
			func(c redisstore.CacheStats) float64 { return float64(c.Entries) }),
		gauge("tether_redis_cache_subscribed", "1 while the hit cache serves (subscribed to the invalidation channel), else 0.",
			func(c redisstore.CacheStats) float64 {
				if c.Subscribed {
					return 1
				}
				return 0
			}),
	)
}
