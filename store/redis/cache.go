package redis

// The hit cache: a replica serves a sticky hit from what it already knows,
// without a round trip, and still agrees with every other replica. This
// file holds its options and the cache itself: lookups, stores and drops.
// cache_queue.go holds the write-back queue, cache_flush.go the flush that
// sends it, cache_subscribe.go the invalidation subscription and the
// Sentinel watch, cache_stats.go the counters.
//
// go-redis's client-side caching does not fit. It caches allow-listed
// plain reads only, and its tracking would invalidate a binding on every
// write back of a hit's refresh. So the store keeps its own bounded cache
// of bindings.
//
// Every script that changes a binding publishes the binding's key on the
// channel <prefix>invalidate. It publishes inside the script, atomically
// with the change. The changes are a bind or renewal, a Replace for a
// failover or rebind, a Mark for a migration, drain or evacuation, and a
// Forget. Every replica subscribes and drops the entry. A link written for an
// alias is published too. The alias's own binding, if cached, must no longer
// be served.
//
// The channel is classic pub/sub, which reaches every subscriber on every
// deployment. Behind a Sentinel the subscription follows the master: on a
// failover the cache is flushed and the store subscribes to the new
// master (watchSentinel). On a Cluster, a PUBLISH on the node that holds
// the session reaches the subscribers of every node over the cluster bus.
// Sharded pub/sub (Redis 7 SPUBLISH) would spare the other nodes that
// message, 17–19 µs of a 3-master Cluster's CPU, about a tenth of a bind
// (BenchmarkClusterInvalidationBroadcast). But a script may only publish
// to a shard channel its node serves. Each slot would need its channel,
// and every replica a subscription to all of them, kept in step with
// resharding. Only changes publish, not hits, so the broadcast stays.
//
// When the subscription drops, or a PING on it is not answered within a
// ping interval, the whole cache is flushed. Nothing is served or stored
// from it until the store has subscribed again. A lookup that started
// before an invalidation or a resubscription of its shard does not store
// its answer, so a reply older than a change never outlives the change's
// message.
//
// A cached hit queues its session's write back: its idle-timeout refresh,
// its request count and its last use. The hits that follow add to it. The
// flush, every FlushInterval, sends a write back once WriteBack has passed
// since the first hit it carries. A session with a short idle timeout waits
// less (writeBack). So Redis refreshes a busy session at most once per
// WriteBack per replica, and the hits between cost it nothing. One touch
// script call writes back up to touchBatch sessions. It writes a session
// only if its binding is still the one cached, never shortens its TTL,
// and finds the index entry and alias links due as a hit would. Its reply
// revalidates the entry as a lookup would: the entry's age (TTL), its
// request count and its last use are Redis's again.
//
// What a session cannot lose: it must not expire in Redis while its hits
// are served from a cache. A hit is served only within a refresh period
// (Idle/4) of the session's last index write (refreshDue). Redis made that
// write at a use that refreshed the session's TTL too. The write back is
// sent at most writeBack (at most Idle/4) and a flush later: within Idle/2
// and a flush of the use Redis last refreshed the session for. A hit whose
// write back cannot be queued (QueueSize sessions wait) goes to Redis.
//
// What it may lose: a replica that dies takes its queue with it. Up to
// WriteBack of a session's last hits were never written, so the session
// expires up to WriteBack early and its count lacks those hits. The last
// use other replicas read may be WriteBack old.
//
// A cached entry is served only while the session would still be alive in
// Redis and younger than its max lifetime. It is served at most TTL after
// Redis last answered for it, to a lookup or a write back.

import (
	"context"
	"fmt"
	"hash/maphash"
	"sync"
	"sync/atomic"
	"time"

	goredis "github.com/redis/go-redis/v9"
	"github.com/tetherproxy/tether/bindings"
)

// Defaults of CacheOptions.
const (
	DefaultCacheSize          = 100_000
	DefaultCacheTTL           = 30 * time.Second
	DefaultCacheFlushInterval = 200 * time.Millisecond
	DefaultCacheWriteBack     = 15 * time.Second
	DefaultCacheQueueSize     = 65_536
	DefaultCachePingInterval  = time.Second
	// cacheShards spreads the cache's lock.
	cacheShards = 32
)

// Hit modes, for Health and /readyz.
const (
	HitsCached       = "cached"
	HitsOneRoundTrip = "one round trip"
)

// CacheOptions tune the hit cache. The zero value is off.
type CacheOptions struct {
	// Enabled caches sticky hits, on a standalone Redis, a Sentinel's
	// master or a Cluster.
	Enabled bool
	// Size is the most sessions cached (default DefaultCacheSize).
	Size int
	// TTL is the longest an entry is served after Redis last answered for
	// it (default DefaultCacheTTL).
	TTL time.Duration
	// FlushInterval is how often the write backs due are sent (default
	// DefaultCacheFlushInterval).
	FlushInterval time.Duration
	// WriteBack is how long a session's cached hits wait to be written
	// back together, counted from the first of them. The default is
	// DefaultCacheWriteBack. It is never less than FlushInterval, and at
	// most a quarter of the session's idle timeout. Keep it well below TTL.
	// The write back is what keeps a busy session's entry fresh.
	WriteBack time.Duration
	// QueueSize is the most sessions waiting for a write back. The default
	// is DefaultCacheQueueSize. Past it, a hit that would queue another goes
	// to Redis instead, and is counted in CacheStats.Dropped.
	QueueSize int
	// PingInterval is how often the subscription is checked with a PING;
	// an unanswered one flushes the cache (default DefaultCachePingInterval).
	PingInterval time.Duration
}

// withDefaults fills the zero fields.
func (o CacheOptions) withDefaults() CacheOptions {
	if o.Size == 0 {
		o.Size = DefaultCacheSize
	}
	if o.TTL == 0 {
		o.TTL = DefaultCacheTTL
	}
	if o.FlushInterval == 0 {
		o.FlushInterval = DefaultCacheFlushInterval
	}
	if o.WriteBack == 0 {
		o.WriteBack = DefaultCacheWriteBack
	}
	o.WriteBack = max(o.WriteBack, o.FlushInterval)
	if o.QueueSize == 0 {
		o.QueueSize = DefaultCacheQueueSize
	}
	if o.PingInterval == 0 {
		o.PingInterval = DefaultCachePingInterval
	}
	return o
}

// Validate reports the first invalid option (zero values take defaults).
func (o CacheOptions) Validate() error {
	switch {
	case o.Size < 0:
		return fmt.Errorf("redis options: cache size must not be negative, got %d", o.Size)
	case o.TTL < 0:
		return fmt.Errorf("redis options: cache ttl must not be negative, got %v", o.TTL)
	case o.FlushInterval < 0:
		return fmt.Errorf("redis options: cache flush interval must not be negative, got %v", o.FlushInterval)
	case o.WriteBack < 0:
		return fmt.Errorf("redis options: cache write back must not be negative, got %v", o.WriteBack)
	case o.QueueSize < 0:
		return fmt.Errorf("redis options: cache queue size must not be negative, got %d", o.QueueSize)
	case o.PingInterval < 0:
		return fmt.Errorf("redis options: cache ping interval must not be negative, got %v", o.PingInterval)
	}
	return nil
}

// cacheEntry is one cached session, keyed by its session key (never an
// alias).
type cacheEntry struct {
	b        bindings.Binding
	requests int
	lastHit  time.Time // caller's clock: the idle timeout runs from here
	fetched  time.Time // local monotonic clock: TTL runs from here
	// x, e, l: the binding's refresh bookkeeping (bindReply); a hit that
	// would find a refresh due goes to Redis, which does it.
	x, e, l int64
}

type cacheShard struct {
	mu      sync.Mutex
	epoch   uint64 // bumped by every drop; a lookup that saw another epoch does not store
	entries map[string]*cacheEntry
}

type hitCache struct {
	s      *Store
	opts   CacheOptions
	seed   maphash.Seed
	shards [cacheShards]cacheShard
	perCap int
	ready  atomic.Bool
	qmu    sync.Mutex // taken inside a shard's lock, never around one
	queue  map[string]*touch
	due    dueHeap // queue's write backs, soonest due first
	// inflight is the batch a flush is writing back. done is closed when it
	// has. A miss on one of its sessions waits for it, so that the count
	// Redis returns includes the cached hits.
	inflight map[string]*touch
	done     chan struct{}
	stop     context.CancelFunc
	wg       sync.WaitGroup
	flushMu  sync.Mutex // one write back at a time
	// sentinels, behind a Sentinel (from Open), are watched for failovers.
	sentinels *sentinelWatch
	// sub is the invalidation subscription (nil between two), which a
	// master switch closes; switches counts those heard.
	subMu    sync.Mutex
	sub      *goredis.PubSub
	switches uint64

	hits, misses, invalidations, flushes, malformed atomic.Uint64
	writeBacks, dropped, writeBackErrors            atomic.Uint64
}

func newHitCache(s *Store, opts CacheOptions) *hitCache {
	c := &hitCache{s: s, opts: opts, seed: maphash.MakeSeed(), queue: map[string]*touch{}}
	c.perCap = max(1, opts.Size/cacheShards)
	for i := range c.shards {
		c.shards[i].entries = map[string]*cacheEntry{}
	}
	return c
}

// start runs the subscriber and the flusher until close, and behind a
// Sentinel a watcher of each sentinel.
func (c *hitCache) start() {
	ctx, cancel := context.WithCancel(context.Background())
	c.stop = cancel
	c.wg.Add(2)
	go func() { defer c.wg.Done(); c.subscribe(ctx) }()
	go func() { defer c.wg.Done(); c.flushLoop(ctx) }()
	if w := c.sentinels; w != nil {
		for _, o := range w.sentinels {
			c.wg.Add(1)
			go func() { defer c.wg.Done(); c.watchSentinel(ctx, o, w.master) }()
		}
	}
}

// close stops the goroutines and writes back what is queued.
func (c *hitCache) close() {
	c.stop()
	c.wg.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), OpTimeout)
	defer cancel()
	c.flush(ctx, c.takeAll)
}

func (c *hitCache) shard(key string) *cacheShard {
	return &c.shards[maphash.String(c.seed, key)%cacheShards]
}

// lookup serves l from the cache when it can. epoch is what the caller
// passes to store after asking Redis instead.
func (c *hitCache) lookup(l bindings.Lookup, aliases []string) (res bindings.Result, ok bool, epoch uint64) {
	sh := c.shard(l.Key)
	now := l.Candidate.Since
	sh.mu.Lock()
	defer sh.mu.Unlock()
	epoch = sh.epoch
	e := sh.entries[l.Key]
	if !c.ready.Load() || e == nil {
		c.misses.Add(1)
		return res, false, epoch
	}
	idle := l.Lifetime.Idle
	if time.Since(e.fetched) >= c.opts.TTL || now.Sub(e.lastHit) >= idle-c.margin(idle) ||
		(l.Lifetime.Max > 0 && now.Sub(e.b.Since) >= l.Lifetime.Max) || now.Before(e.b.Since) ||
		refreshDue(e, now.UnixMilli(), idle, len(aliases) > 0) || !c.enqueue(l.Key, e.b, now, idle, aliases) {
		delete(sh.entries, l.Key)
		c.misses.Add(1)
		return res, false, epoch
	}
	e.requests++
	res = bindings.Result{Key: l.Key, Binding: e.b, Origin: bindings.Found, Requests: e.requests, Idle: max(now.Sub(e.lastHit), 0)}
	if now.After(e.lastHit) {
		e.lastHit = now
	}
	c.hits.Add(1)
	return res, true, epoch
}

// peek is the binding lookup would serve for key from the cache, without
// counting a hit or queueing its write back. ok false where the entry is
// missing, stale, past the session's idle margin or maximum lifetime. An
// entry whose refresh is due is peeked: lookup leaves that hit to Redis,
// which finds the same binding.
func (c *hitCache) peek(key string, now time.Time, lt bindings.Lifetime) (bindings.Binding, bool) {
	sh := c.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e := sh.entries[key]
	if !c.ready.Load() || e == nil || time.Since(e.fetched) >= c.opts.TTL || now.Sub(e.lastHit) >= lt.Idle-c.margin(lt.Idle) ||
		(lt.Max > 0 && now.Sub(e.b.Since) >= lt.Max) || now.Before(e.b.Since) {
		return bindings.Binding{}, false
	}
	return e.b, true
}

// refreshDue applies getOrBindSrc's refresh rule to a cached entry: a
// hit that would write the index entry or the alias links is left to
// the script.
func refreshDue(e *cacheEntry, now int64, idle time.Duration, hasLinks bool) bool {
	reach := now + millis(idle) + refreshMargin(idle)
	if e.x == 0 || e.e == 0 || now-e.x >= refreshPeriod(idle) || reach > e.e {
		return true
	}
	return hasLinks && (e.l == 0 || reach > e.l)
}

// margin is how long before a session's idle timeout its entry stops
// being served: the write back of the last hit must reach Redis first.
func (c *hitCache) margin(idle time.Duration) time.Duration {
	return max(time.Duration(refreshMargin(idle))*time.Millisecond, 2*c.opts.FlushInterval)
}

// store caches a binding Redis just returned, unless its shard was
// invalidated since epoch.
func (c *hitCache) store(key string, epoch uint64, r bindings.Result, now time.Time, br bindReply) {
	if r.Move.Pending() {
		return // the caller moves it at once
	}
	sh := c.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if sh.epoch != epoch || !c.ready.Load() {
		return
	}
	if _, ok := sh.entries[key]; !ok && len(sh.entries) >= c.perCap {
		for k := range sh.entries { // evict one at random
			delete(sh.entries, k)
			break
		}
	}
	sh.entries[key] = &cacheEntry{b: r.Binding, requests: r.Requests, lastHit: now, fetched: time.Now(), x: br.x, e: br.e, l: br.l}
}

// drop forgets key.
func (c *hitCache) drop(key string) {
	sh := c.shard(key)
	sh.mu.Lock()
	sh.epoch++
	if _, ok := sh.entries[key]; ok {
		delete(sh.entries, key)
		c.invalidations.Add(1)
	}
	sh.mu.Unlock()
}

// dropAll flushes every shard.
func (c *hitCache) dropAll() {
	for i := range c.shards {
		sh := &c.shards[i]
		sh.mu.Lock()
		sh.epoch++
		clear(sh.entries)
		sh.mu.Unlock()
	}
}

// setReady turns serving on when subscribed, or off. Both flush
// everything. Entries stored before a subscription may have missed a
// message. Lookups that started before it must not store theirs.
func (c *hitCache) setReady(ready bool) {
	if !ready && c.ready.Load() {
		c.flushes.Add(1)
	}
	if !ready {
		c.ready.Store(false)
	}
	c.dropAll()
	if ready {
		c.ready.Store(true)
	}
}
