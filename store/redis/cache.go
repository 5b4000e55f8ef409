package redis

// The hit cache: a replica serves a sticky hit from what it already knows,
// without a round trip, and still agrees with every other replica.
//
// go-redis's client-side caching does not fit: it caches allow-listed plain
// reads only, and its tracking would invalidate a binding on every write
// back of a hit's refresh. So the store keeps its own bounded cache of
// bindings, and every script that changes a binding (a bind or renewal, a
// Replace: failover, rebind, a Mark: migration, drain, evacuation, a
// Forget) publishes the binding's key on the channel <prefix>invalidate
// inside the script, atomically with the change. Every replica subscribes
// and drops the entry. A link written for an alias is published too: the
// alias's own binding, if cached, must no longer be served.
//
// The channel is classic pub/sub, which reaches every subscriber on every
// deployment: behind a Sentinel the subscription follows the master (on a
// failover the cache is flushed and the store subscribes to the new
// master: watchSentinel), and on a Cluster a PUBLISH on the node that
// holds the session reaches the subscribers of every node over the
// cluster bus. Sharded pub/sub (Redis 7 SPUBLISH) would spare the other
// nodes that message (17–19 µs of a 3-master Cluster's CPU a message,
// BenchmarkClusterInvalidationBroadcast, about a tenth of a bind), but a
// script may only publish to a shard channel its node serves, so each
// slot would need its channel and every replica a subscription to all of
// them, kept in step with resharding; only changes publish (binds, moves,
// marks, forgets: not hits), so the broadcast stays.
//
// When the subscription drops, or a PING on it is not answered within a
// ping interval, the whole cache is flushed and nothing is served or
// stored from it until the store has subscribed again. A lookup that
// started before an invalidation (or a resubscription) of its shard does
// not store its answer, so a reply older than a change never outlives the
// change's message.
//
// A cached hit queues its session's write back (its idle-timeout refresh,
// its request count and its last use), and the hits that follow add to
// it: a session's write back is sent once WriteBack has passed since the
// first hit it carries (less for a session whose idle timeout is short:
// writeBack), by the flush that runs every FlushInterval. So Redis
// refreshes a busy session at most once per WriteBack per replica, and
// the hits between cost it nothing. One script call writes back up to
// touchBatch sessions (the touch script, which writes a session only if
// its binding is still the one cached, never shortens its TTL, and finds
// the index entry and alias links due as a hit would). Its reply
// revalidates the entry as a lookup would: the entry's age (TTL), its
// request count and its last use are Redis's again.
//
// What a session cannot lose: it must not expire in Redis while its hits
// are served from a cache. A hit is served only within a refresh period
// (Idle/4) of the session's last index write (refreshDue), which Redis
// made at a use that refreshed its TTL too; its write back is sent at
// most writeBack (at most Idle/4) and a flush later, so within Idle/2 and
// a flush of the use Redis last refreshed the session for. A hit whose
// write back cannot be queued (QueueSize sessions wait) goes to Redis.
// What it may lose: a replica that dies takes its queue with it, so up to
// WriteBack of a session's last hits were never written: it expires up to
// WriteBack early, and its count lacks those hits. The last use other
// replicas read may be WriteBack old. A cached entry is served only while
// the session would still be alive in Redis and younger than its max
// lifetime, and at most TTL after Redis last answered for it (a lookup,
// or a write back).

import (
	"container/heap"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/maphash"
	"net"
	"slices"
	"strings"
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
	// touchBatch is the most sessions one touch script call writes back:
	// a call holds Redis for about 6 µs a session, so a batch holds it for
	// under a millisecond (BenchmarkWriteBackBatch).
	touchBatch = 128
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
	// back together, counted from the first of them (default
	// DefaultCacheWriteBack; never less than FlushInterval, and at most a
	// quarter of the session's idle timeout). Keep it well below TTL: its
	// write back is what keeps a busy session's entry fresh.
	WriteBack time.Duration
	// QueueSize is the most sessions waiting for a write back (default
	// DefaultCacheQueueSize); past it, a hit that would queue another goes
	// to Redis instead, and is counted (CacheStats.Dropped).
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

// CacheStats counts what the hit cache did.
type CacheStats struct {
	Hits, Misses     uint64 // lookups served from the cache, and not
	Invalidations    uint64 // entries dropped by a message
	Flushes          uint64 // whole-cache flushes (subscription lost)
	Malformed        uint64 // invalidation messages that named no binding
	WriteBacks       uint64 // sessions written back
	Dropped          uint64 // hits sent to Redis because the write-back queue was full
	WriteBackErrors  uint64 // write-back pipelines that failed
	Entries, Pending int    // cached sessions, write backs queued now
	Subscribed       bool   // serving from the cache
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

// touch is a queued write back of a session's cached hits.
type touch struct {
	key      string
	instance string
	since    int64 // the binding's Since, ms: the write back applies to this binding only
	count    int
	now      int64 // the last hit, caller's clock ms
	at       time.Time
	idle     time.Duration
	aliases  []string
	due      time.Time // local clock: sent by the first flush from then
	pos      int       // in the cache's due heap
}

// dueHeap orders the queued write backs by due time.
type dueHeap []*touch

func (h dueHeap) Len() int           { return len(h) }
func (h dueHeap) Less(i, j int) bool { return h[i].due.Before(h[j].due) }
func (h dueHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i]; h[i].pos = i; h[j].pos = j }
func (h *dueHeap) Push(x any)        { t := x.(*touch); t.pos = len(*h); *h = append(*h, t) }
func (h *dueHeap) Pop() any {
	old := *h
	t := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return t
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
	// inflight is the batch a flush is writing back, done closed when it
	// has: a miss on one of its sessions waits for it, so that the count
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

// writeBack is how long after a session's first queued hit its write back
// is sent: Options.WriteBack, but at most a quarter of the idle timeout,
// so that a session with a short one is refreshed in time and still
// served from the cache.
func (c *hitCache) writeBack(idle time.Duration) time.Duration {
	return min(c.opts.WriteBack, idle/4)
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

// setReady turns serving on (subscribed) or off (flushing everything).
// Both flush: entries stored before a subscription may have missed a
// message, and lookups that started before it must not store theirs.
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

// enqueue queues the write back of a cached hit, called with key's
// shard locked. It returns false when the queue is full: the hit must go
// to Redis, which refreshes the session at once.
func (c *hitCache) enqueue(key string, b bindings.Binding, now time.Time, idle time.Duration, aliases []string) bool {
	c.qmu.Lock()
	defer c.qmu.Unlock()
	t := c.queue[key]
	at := time.Now()
	if t == nil {
		if len(c.queue) >= c.opts.QueueSize {
			c.dropped.Add(1)
			return false
		}
		t = &touch{key: key, due: at.Add(c.writeBack(idle))}
		c.queue[key] = t
		heap.Push(&c.due, t)
	}
	t.instance, t.since, t.count = b.Instance, b.Since.UnixMilli(), t.count+1
	t.now, t.at, t.idle = now.UnixMilli(), at, idle
	if len(aliases) > 0 {
		t.aliases = aliases
	}
	return true
}

// take removes key's queued write back, for a caller that sends it
// itself, after waiting for a flush that is writing key back.
func (c *hitCache) take(ctx context.Context, key string) (*touch, bool) {
	c.qmu.Lock()
	t, ok := c.queue[key]
	if ok {
		delete(c.queue, key)
		heap.Remove(&c.due, t.pos)
	}
	var wait chan struct{}
	if _, busy := c.inflight[key]; busy {
		wait = c.done
	}
	c.qmu.Unlock()
	if wait != nil {
		select {
		case <-wait:
		case <-ctx.Done():
		}
	}
	return t, ok
}

// takeDue, takeAll and takeKeys remove and return queued write backs,
// with qmu held: those due at now, all of them, those of keys.
func (c *hitCache) takeDue(now time.Time) map[string]*touch {
	var q map[string]*touch
	for len(c.due) > 0 && !c.due[0].due.After(now) {
		t := heap.Pop(&c.due).(*touch)
		delete(c.queue, t.key)
		if q == nil {
			q = map[string]*touch{}
		}
		q[t.key] = t
	}
	return q
}

func (c *hitCache) takeAll(time.Time) map[string]*touch {
	q := c.queue
	c.queue, c.due = make(map[string]*touch, len(q)), nil
	return q
}

func (c *hitCache) takeKeys(keys []string) func(time.Time) map[string]*touch {
	return func(time.Time) map[string]*touch {
		var q map[string]*touch
		for _, k := range keys {
			if t, ok := c.queue[k]; ok {
				delete(c.queue, k)
				heap.Remove(&c.due, t.pos)
				if q == nil {
					q = map[string]*touch{}
				}
				q[k] = t
			}
		}
		return q
	}
}

func (c *hitCache) flushLoop(ctx context.Context) {
	tick := time.NewTicker(c.opts.FlushInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			fctx, cancel := context.WithTimeout(ctx, max(c.opts.FlushInterval, OpTimeout))
			c.flush(fctx, c.takeDue)
			cancel()
		}
	}
}

// flush writes back the sessions take picks (those due, or those a caller
// is about to read, or all on close) in one pipeline; then the index
// entries and alias links found due.
func (c *hitCache) flush(ctx context.Context, take func(now time.Time) map[string]*touch) {
	c.flushMu.Lock()
	defer c.flushMu.Unlock()
	sent := time.Now()
	c.qmu.Lock()
	q := take(sent)
	if len(q) == 0 {
		c.qmu.Unlock()
		return
	}
	c.inflight, c.done = q, make(chan struct{})
	done := c.done
	c.qmu.Unlock()
	defer func() {
		c.qmu.Lock()
		c.inflight = nil
		c.qmu.Unlock()
		close(done)
	}()
	ts := make([]*touch, 0, len(q))
	for _, t := range q {
		ts = append(ts, t)
	}
	per := c.s.touchPer()
	calls := c.s.touchCalls(ts, per)
	c.s.exec(ctx, calls, nil)
	failed := false
	for i, call := range calls {
		batch := ts[i*per : min((i+1)*per, len(ts))]
		res, err := call.cmd.Slice()
		var rs []touchReply
		if err == nil {
			rs, err = parseTouchReply(res, len(batch))
		}
		if err != nil {
			failed = true
			continue
		}
		for j, t := range batch {
			c.writeBacks.Add(1)
			c.written(t, rs[j], sent)
			aliases := t.aliases
			if rs[j].links == 0 {
				aliases = nil
			}
			if rs[j].same && (rs[j].index != 0 || len(aliases) > 0) {
				c.s.refresh(ctx, t.key, t.instance, "", t.now, rs[j].index, aliases, rs[j].links)
			}
		}
	}
	if failed {
		c.writeBackErrors.Add(1)
		c.s.indexError(errors.New("redis cache write back: some sessions' refreshes failed"))
	}
}

// written applies what Redis answered to a write back sent at sent. The
// binding is no longer the one cached, or has a move pending: the entry
// goes (the change's message is on its way). Otherwise Redis has just
// answered for the binding, as a lookup would: the entry is as fresh as
// a lookup's, with the session's count and last use as Redis keeps them
// (other replicas' hits included) plus this replica's hits since.
func (c *hitCache) written(t *touch, r touchReply, sent time.Time) {
	if !r.same || r.moving {
		c.drop(t.key)
		return
	}
	sh := c.shard(t.key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e := sh.entries[t.key]
	if e == nil || e.b.Instance != t.instance || e.b.Since.UnixMilli() != t.since || !sent.After(e.fetched) {
		return // gone, another binding, or fetched since: newer than this reply
	}
	e.fetched = sent
	c.qmu.Lock()
	since := 0 // hits queued since this write back was taken
	if p := c.queue[t.key]; p != nil {
		since = p.count
	}
	c.qmu.Unlock()
	e.requests = r.requests + since
	if u := time.UnixMilli(r.lastUse); r.lastUse > 0 && u.After(e.lastHit) {
		e.lastHit = u
	}
	if r.index != 0 {
		e.x, e.e = t.now, r.index
	}
	if r.links != 0 {
		e.l = r.links
	}
}

// subscribe keeps the invalidation subscription, flushing the cache
// whenever it may have missed a message.
func (c *hitCache) subscribe(ctx context.Context) {
	keepSubscribed(ctx, func() *goredis.PubSub {
		c.subMu.Lock()
		switches := c.switches
		c.subMu.Unlock()
		ps := c.s.client.Subscribe(ctx, c.s.channel)
		c.subMu.Lock()
		c.sub = ps
		if c.switches != switches {
			_ = ps.Close() // the master switched while it dialed: perhaps the old one
		}
		c.subMu.Unlock()
		return ps
	}, func(ps *goredis.PubSub) bool {
		worked := listen(ctx, ps, c.opts.PingInterval, func(msg any) bool {
			switch m := msg.(type) {
			case *goredis.Subscription:
				if m.Kind == "subscribe" {
					c.setReady(true)
				}
			case *goredis.Message:
				c.invalidate(m.Payload)
			}
			return true
		})
		c.setReady(false)
		c.subMu.Lock()
		c.sub = nil
		c.subMu.Unlock()
		return worked
	})
}

// switched closes the invalidation subscription, after a sentinel
// announced a new master: subscribe flushes the cache and subscribes
// again, on the new master.
func (c *hitCache) switched() {
	c.subMu.Lock()
	defer c.subMu.Unlock()
	c.switches++
	if c.sub != nil {
		_ = c.sub.Close()
	}
}

// watchSentinel follows one sentinel's +switch-master announcements for
// master, and has the cache resubscribe on each (switched). The
// subscription may be on the old master, which go-redis's failover client
// leaves open (it closes the pooled connections only), and which still
// answers PINGs: it does not hear the new master until the sentinel has
// made it a replica, seconds later (when the old master can be reached at
// all), and the messages published meanwhile would be lost without a
// flush. The new subscription goes through the failover client, which asks
// the sentinels for the master. Each sentinel the URL names is watched,
// so the last switch heard comes after every one of them names the new
// master. A watch that broke asks the sentinel for the master when it is
// back: a switch it missed resubscribes too.
func (c *hitCache) watchSentinel(ctx context.Context, opts *goredis.Options, master string) {
	sc := goredis.NewSentinelClient(opts)
	defer func() { _ = sc.Close() }()
	last := "" // the master's address this sentinel last named
	keepSubscribed(ctx, func() *goredis.PubSub { return sc.Subscribe(ctx, "+switch-master") }, func(ps *goredis.PubSub) bool {
		return listen(ctx, ps, c.opts.PingInterval, func(msg any) bool {
			switch m := msg.(type) {
			case *goredis.Subscription:
				if m.Kind != "subscribe" {
					return true
				}
				// (Re)subscribed: a switch missed meanwhile shows as
				// another address.
				addr, err := sc.GetMasterAddrByName(ctx, master).Result()
				if err != nil || len(addr) != 2 {
					return false
				}
				if now := net.JoinHostPort(addr[0], addr[1]); now != last {
					if last != "" {
						c.switched()
					}
					last = now
				}
			case *goredis.Message:
				// "<master name> <old ip> <old port> <new ip> <new port>"
				f := strings.Fields(m.Payload)
				if len(f) == 5 && f[0] == master {
					last = net.JoinHostPort(f[3], f[4])
					c.switched()
				}
			}
			return true
		})
	})
}

// invalidate drops the session a message names: a binding key of this
// store's layout. Anything else is counted and ignored.
func (c *hitCache) invalidate(payload string) {
	origin, name, ok := strings.Cut(payload, " ")
	if !ok || origin == "" {
		c.malformed.Add(1)
		return
	}
	key, ok := c.s.sessionOf(name)
	if !ok {
		c.malformed.Add(1)
		return
	}
	if origin == c.s.origin {
		// This store's own change: it dropped (or stored, after a bind)
		// the entry when the script returned.
		return
	}
	c.drop(key)
}

// newOrigin names a store in its invalidation messages.
func newOrigin() string {
	var b [8]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand)
	return hex.EncodeToString(b[:])
}

var tagUnreplacer = strings.NewReplacer("%7B", "{", "%7D", "}", "%25", "%")

// sessionOf is the session key of a binding key name, the inverse of
// bindingKey.
func (s *Store) sessionOf(name string) (string, bool) {
	rest, ok := strings.CutPrefix(name, s.prefix+"{")
	if !ok {
		return "", false
	}
	esc, ok := strings.CutSuffix(rest, "}:b")
	if !ok || esc == "" || strings.ContainsAny(esc, "{}") {
		return "", false
	}
	key := tagUnreplacer.Replace(esc)
	if s.bindingKey(key) != name {
		return "", false // not escaped as bindingKey escapes
	}
	return key, true
}

func (c *hitCache) stats() CacheStats {
	st := CacheStats{
		Hits: c.hits.Load(), Misses: c.misses.Load(), Invalidations: c.invalidations.Load(),
		Flushes: c.flushes.Load(), Malformed: c.malformed.Load(), WriteBacks: c.writeBacks.Load(),
		Dropped: c.dropped.Load(), WriteBackErrors: c.writeBackErrors.Load(), Subscribed: c.ready.Load(),
	}
	for i := range c.shards {
		sh := &c.shards[i]
		sh.mu.Lock()
		st.Entries += len(sh.entries)
		sh.mu.Unlock()
	}
	c.qmu.Lock()
	st.Pending = len(c.queue)
	c.qmu.Unlock()
	return st
}

// touchSrc: KEYS[k] the binding of the k-th session written back, and
// ten arguments for each from ARGV[10(k-1)+1]: [1] instance, [2] since
// (the cached binding's), [3] hits to count, [4] TTL ms left of the last
// hit's idle timeout, [5] the last hit's now, [6] now + idle*5/4, [7]
// refresh period ms, [8] margin ms, [9] idle ms, [10] '1' when the hits
// had alias links.
//
// Writes back each session's cached hits: only to the binding they were
// served from (another one, or none, is left alone), never shortening its
// TTL, never moving its last use back. Four commands a session: this is
// what a busy session costs Redis per write back. Replies five values a
// session: 0 and four empty strings when the binding is another; else 1
// (2 when a move is pending), the index expiry and the link expiry to
// write (each empty unless due, as getOrBindSrc says), the count n now and
// the last use u it had before (-1 when absent).
const touchSrc = `
local function int(v)
  if v and string.match(v, '^%d+$') then return tonumber(v) end
  return nil
end
local out = {}
for k = 1, #KEYS do
  local a = 10 * (k - 1)
  local cur = redis.call('HMGET', KEYS[k], 'i', 's', 'x', 'e', 'l', 'n', 'u', 'mv', 'mo')
  if cur[1] ~= ARGV[a + 1] or cur[2] ~= ARGV[a + 2] then
    for _, v in ipairs({0, '', '', 0, -1}) do out[#out + 1] = v end
  else
    local now = tonumber(ARGV[a + 5])
    local n = tonumber(ARGV[a + 3])
    -- Up to 15 digits, as getOrBindSrc: Lua numbers are exact to 2^53.
    if cur[6] and string.match(cur[6], '^%d+$') and #cur[6] <= 15 then n = n + tonumber(cur[6]) end
    local set = {'n', n}
    local u = int(cur[7])
    if not u or now > u then
      set[#set + 1] = 'u'
      set[#set + 1] = ARGV[a + 5]
    end
    local reach = now + tonumber(ARGV[a + 9]) + tonumber(ARGV[a + 8])
    local x, e, l = int(cur[3]), int(cur[4]), int(cur[5])
    local ie, le = '', ''
    if not x or not e or now - x >= tonumber(ARGV[a + 7]) or reach > e then
      ie = ARGV[a + 6]
      if e and e > tonumber(ARGV[a + 6]) then ie = cur[4] end
      for _, v in ipairs({'x', ARGV[a + 5], 'e', ie}) do set[#set + 1] = v end
    end
    if ARGV[a + 10] == '1' and (ie ~= '' or not l or reach > l) then
      le = ARGV[a + 6]
      if l and l > tonumber(ARGV[a + 6]) then le = cur[5] end
      set[#set + 1] = 'l'
      set[#set + 1] = le
    end
    redis.call('HSET', KEYS[k], unpack(set))
    if redis.call('PTTL', KEYS[k]) < tonumber(ARGV[a + 4]) then
      redis.call('PEXPIRE', KEYS[k], ARGV[a + 4])
    end
    local st = 1
    if (cur[8] and cur[8] ~= '') or (cur[9] and cur[9] ~= '') then st = 2 end
    for _, v in ipairs({st, ie, le, n, u or -1}) do out[#out + 1] = v end
  end
end
return out
`

var touchScript = goredis.NewScript(touchSrc)

// touchPer is how many sessions one touch call writes back: touchBatch,
// but one on a Cluster, where a script's keys must share a hash slot and
// each session's binding has a slot of its own (its key's hash tag).
func (s *Store) touchPer() int {
	if _, ok := s.client.(*goredis.ClusterClient); ok {
		return 1
	}
	return touchBatch
}

// touchCalls are the write backs of ts, per sessions a call (touchPer).
func (s *Store) touchCalls(ts []*touch, per int) []*scriptCall {
	calls := make([]*scriptCall, 0, (len(ts)+per-1)/per)
	for batch := range slices.Chunk(ts, per) {
		c := &scriptCall{sc: touchScript, keys: make([]string, 0, len(batch)), args: make([]any, 0, 10*len(batch))}
		for _, t := range batch {
			ttl := max(t.idle-time.Since(t.at), time.Millisecond)
			c.keys = append(c.keys, s.bindingKey(t.key))
			c.args = append(c.args, t.instance, t.since, t.count, millis(ttl), t.now, t.now+entryLifetime(t.idle),
				refreshPeriod(t.idle), refreshMargin(t.idle), millis(t.idle), boolArg(len(t.aliases) > 0))
		}
		calls = append(calls, c)
	}
	return calls
}

// touchReply is one session's part of a touchSrc reply.
type touchReply struct {
	same, moving bool  // the binding written back is still there; it has a move pending
	index, links int64 // as in bindReply
	requests     int   // the session's count, these hits included
	lastUse      int64 // the last use Redis knew of before (ms; -1 none)
}

// parseTouchReply decodes the reply of a touch call for n sessions.
func parseTouchReply(res []any, n int) ([]touchReply, error) {
	bad := func() ([]touchReply, error) { return nil, fmt.Errorf("unexpected touch reply %v", res) }
	if len(res) != 5*n {
		return bad()
	}
	out := make([]touchReply, n)
	for i := range out {
		v := res[5*i : 5*i+5]
		st, ok1 := v[0].(int64)
		ie, ok2 := v[1].(string)
		le, ok3 := v[2].(string)
		reqs, ok4 := v[3].(int64)
		u, ok5 := v[4].(int64)
		if !ok1 || !ok2 || !ok3 || !ok4 || !ok5 || st < 0 || st > 2 {
			return bad()
		}
		if st == 0 {
			continue
		}
		r := touchReply{same: true, moving: st == 2, requests: int(reqs), lastUse: u}
		if r.index, ok1 = expiry(ie); !ok1 {
			return bad()
		}
		if r.links, ok1 = expiry(le); !ok1 {
			return bad()
		}
		out[i] = r
	}
	return out, nil
}
