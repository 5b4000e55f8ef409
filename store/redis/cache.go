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
// deployment: behind a Sentinel the subscription follows the master (a
// failover breaks it, the cache is flushed and the store subscribes to the
// new master; a subscription still on the old master, now a replica, hears
// what the new one publishes, as Redis replicates PUBLISH), and on a
// Cluster a PUBLISH on the node that holds the session reaches the
// subscribers of every node over the cluster bus. Sharded pub/sub (Redis 7
// SPUBLISH) would spare the other nodes that message, at the cost of one
// subscription per shard, kept in step with the slot map; a message costs
// each node about what a PING does, and only changes publish (binds,
// moves, marks, forgets: not hits), so the broadcast stays.
//
// When the subscription drops, or a PING on it is not answered within a
// ping interval, the whole cache is flushed and nothing is served or
// stored from it until the store has subscribed again. A lookup that
// started before an invalidation (or a resubscription) of its shard does
// not store its answer, so a reply older than a change never outlives the
// change's message.
//
// A cached hit queues its idle-timeout refresh and request count; a
// background flush writes the queue back every FlushInterval in one
// pipeline (the touch script, which writes only if the binding is still
// the one cached, never shortens its TTL, and finds the index entry and
// alias links due as a hit would). The queue holds at most QueueSize
// sessions: past that a hit's write back is dropped and counted, and the
// request never waits. A cached entry is served only while the session
// would still be alive in Redis (its idle timeout, measured from its last
// hit, less a margin that covers the flush) and younger than its max
// lifetime, and at most TTL after Redis last answered for it.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/maphash"
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
	DefaultCacheTTL           = 10 * time.Second
	DefaultCacheFlushInterval = 200 * time.Millisecond
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
	// FlushInterval is how often cached hits' refreshes and counts are
	// written back (default DefaultCacheFlushInterval).
	FlushInterval time.Duration
	// QueueSize is the most sessions waiting for a write back (default
	// DefaultCacheQueueSize); past it, write backs are dropped and counted.
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
	Dropped          uint64 // write backs dropped, the queue full
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
	instance string
	since    int64 // the binding's Since, ms: the write back applies to this binding only
	count    int
	now      int64 // the last hit, caller's clock ms
	at       time.Time
	idle     time.Duration
	aliases  []string
}

type hitCache struct {
	s      *Store
	opts   CacheOptions
	seed   maphash.Seed
	shards [cacheShards]cacheShard
	perCap int
	ready  atomic.Bool
	qmu    sync.Mutex
	queue  map[string]*touch
	// inflight is the batch a flush is writing back, done closed when it
	// has: a miss on one of its sessions waits for it, so that the count
	// Redis returns includes the cached hits.
	inflight map[string]*touch
	done     chan struct{}
	stop     context.CancelFunc
	wg       sync.WaitGroup
	flushMu  sync.Mutex // one write back at a time

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

// start runs the subscriber and the flusher until close.
func (c *hitCache) start() {
	ctx, cancel := context.WithCancel(context.Background())
	c.stop = cancel
	c.wg.Add(2)
	go func() { defer c.wg.Done(); c.subscribe(ctx) }()
	go func() { defer c.wg.Done(); c.flushLoop(ctx) }()
}

// close stops both goroutines and writes back what is queued.
func (c *hitCache) close() {
	c.stop()
	c.wg.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), OpTimeout)
	defer cancel()
	c.flush(ctx)
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
	epoch = sh.epoch
	e := sh.entries[l.Key]
	if !c.ready.Load() || e == nil {
		sh.mu.Unlock()
		c.misses.Add(1)
		return res, false, epoch
	}
	idle := l.Lifetime.Idle
	if time.Since(e.fetched) >= c.opts.TTL || now.Sub(e.lastHit) >= idle-c.margin(idle) ||
		(l.Lifetime.Max > 0 && now.Sub(e.b.Since) >= l.Lifetime.Max) || now.Before(e.b.Since) ||
		refreshDue(e, now.UnixMilli(), idle, len(aliases) > 0) {
		delete(sh.entries, l.Key)
		sh.mu.Unlock()
		c.misses.Add(1)
		return res, false, epoch
	}
	e.requests++
	res = bindings.Result{Key: l.Key, Binding: e.b, Origin: bindings.Found, Requests: e.requests, Idle: max(now.Sub(e.lastHit), 0)}
	if now.After(e.lastHit) {
		e.lastHit = now
	}
	sh.mu.Unlock()
	c.hits.Add(1)
	c.enqueue(l.Key, res.Binding, now, idle, aliases)
	return res, true, epoch
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

// enqueue queues the write back of a cached hit; a full queue drops it.
func (c *hitCache) enqueue(key string, b bindings.Binding, now time.Time, idle time.Duration, aliases []string) {
	c.qmu.Lock()
	defer c.qmu.Unlock()
	t := c.queue[key]
	if t == nil {
		if len(c.queue) >= c.opts.QueueSize {
			c.dropped.Add(1)
			return
		}
		t = &touch{}
		c.queue[key] = t
	}
	t.instance, t.since, t.count = b.Instance, b.Since.UnixMilli(), t.count+1
	t.now, t.at, t.idle = now.UnixMilli(), time.Now(), idle
	if len(aliases) > 0 {
		t.aliases = aliases
	}
}

// take removes key's queued write back, for a caller that sends it
// itself, after waiting for a flush that is writing key back.
func (c *hitCache) take(ctx context.Context, key string) (*touch, bool) {
	c.qmu.Lock()
	t, ok := c.queue[key]
	if ok {
		delete(c.queue, key)
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

func (c *hitCache) flushLoop(ctx context.Context) {
	tick := time.NewTicker(c.opts.FlushInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			fctx, cancel := context.WithTimeout(ctx, max(c.opts.FlushInterval, OpTimeout))
			c.flush(fctx)
			cancel()
		}
	}
}

// flush writes back everything queued, in one pipeline, then the index
// entries and alias links found due.
func (c *hitCache) flush(ctx context.Context) {
	c.flushMu.Lock()
	defer c.flushMu.Unlock()
	c.qmu.Lock()
	q := c.queue
	if len(q) == 0 {
		c.qmu.Unlock()
		return
	}
	c.queue = make(map[string]*touch, len(q))
	c.inflight, c.done = q, make(chan struct{})
	done := c.done
	c.qmu.Unlock()
	defer func() {
		c.qmu.Lock()
		c.inflight = nil
		c.qmu.Unlock()
		close(done)
	}()
	keys := make([]string, 0, len(q))
	calls := make([]*scriptCall, 0, len(q))
	for k, t := range q {
		keys = append(keys, k)
		calls = append(calls, c.s.touchCall(k, t))
	}
	c.s.exec(ctx, calls, nil)
	failed := false
	for i, call := range calls {
		t := q[keys[i]]
		r, err := parseTouchReply(call.cmd)
		if err != nil {
			failed = true
			continue
		}
		c.writeBacks.Add(1)
		if !r.same {
			c.drop(keys[i]) // moved meanwhile: its message is on its way
			continue
		}
		aliases := t.aliases
		if r.links == 0 {
			aliases = nil
		}
		if r.index != 0 || len(aliases) > 0 {
			c.s.refresh(ctx, keys[i], t.instance, "", t.now, r.index, aliases, r.links)
		}
	}
	if failed {
		c.writeBackErrors.Add(1)
		c.s.indexError(errors.New("redis cache write back: some sessions' refreshes failed"))
	}
}

// subscribe keeps the invalidation subscription, flushing the cache
// whenever it may have missed a message.
func (c *hitCache) subscribe(ctx context.Context) {
	backoff := 50 * time.Millisecond
	for ctx.Err() == nil {
		ps := c.s.client.Subscribe(ctx, c.s.channel)
		// A read in progress does not see ctx end: closing the
		// subscription ends it, so Close does not wait for the ping.
		unwatch := context.AfterFunc(ctx, func() { _ = ps.Close() })
		err := c.receive(ctx, ps)
		unwatch()
		c.setReady(false)
		_ = ps.Close()
		if ctx.Err() != nil {
			return
		}
		if err == nil {
			backoff = 50 * time.Millisecond
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, time.Second)
	}
}

// receive reads one subscription until it fails or a PING goes unanswered.
// It returns nil when the subscription had worked.
func (c *hitCache) receive(ctx context.Context, ps *goredis.PubSub) error {
	pinged, worked := false, false
	for {
		msg, err := ps.ReceiveTimeout(ctx, c.opts.PingInterval)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			var ne interface{ Timeout() bool }
			if !pinged && errors.As(err, &ne) && ne.Timeout() && worked {
				pinged = true
				if err := ps.Ping(ctx); err != nil {
					return nilIf(worked, err)
				}
				continue
			}
			return nilIf(worked, err)
		}
		pinged = false
		switch m := msg.(type) {
		case *goredis.Subscription:
			if m.Kind == "subscribe" && m.Channel == c.s.channel {
				worked = true
				c.setReady(true)
			}
		case *goredis.Pong:
		case *goredis.Message:
			c.invalidate(m.Payload)
		}
	}
}

func nilIf(ok bool, err error) error {
	if ok {
		return nil
	}
	return err
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

// touchSrc: KEYS[1] binding. ARGV[1] instance, [2] since (the cached
// binding's), [3] hits to count, [4] TTL ms left of the last hit's idle
// timeout, [5] the last hit's now, [6] now + idle*5/4, [7] refresh period
// ms, [8] margin ms, [9] idle ms, [10] '1' when the hits had alias links.
//
// Writes back cached hits: only to the binding they were served from
// (another one, or none, is left alone), never shortening its TTL. Replies
// {1, index expiry, link expiry} like a hit of getOrBindSrc (each empty
// unless due), or {0} when the binding is another.
const touchSrc = `
local function int(v)
  if v and string.match(v, '^%d+$') then return tonumber(v) end
  return nil
end
local cur = redis.call('HMGET', KEYS[1], 'i', 's', 'x', 'e', 'l', 'n', 'u')
if cur[1] ~= ARGV[1] or cur[2] ~= ARGV[2] then
  return {0}
end
local u = int(cur[7])
if not u or tonumber(ARGV[5]) > u then
  redis.call('HSET', KEYS[1], 'u', ARGV[5])
end
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[4]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
if cur[6] and string.match(cur[6], '^%d+$') and #cur[6] <= 15 then
  redis.call('HINCRBY', KEYS[1], 'n', ARGV[3])
else
  redis.call('HSET', KEYS[1], 'n', ARGV[3])
end
local now = tonumber(ARGV[5])
local reach = now + tonumber(ARGV[9]) + tonumber(ARGV[8])
local x, e, l = int(cur[3]), int(cur[4]), int(cur[5])
local ie, le = '', ''
if not x or not e or now - x >= tonumber(ARGV[7]) or reach > e then
  ie = ARGV[6]
  if e and e > tonumber(ARGV[6]) then ie = cur[4] end
  redis.call('HSET', KEYS[1], 'x', ARGV[5], 'e', ie)
end
if ARGV[10] == '1' and (ie ~= '' or not l or reach > l) then
  le = ARGV[6]
  if l and l > tonumber(ARGV[6]) then le = cur[5] end
  redis.call('HSET', KEYS[1], 'l', le)
end
return {1, ie, le}
`

var touchScript = goredis.NewScript(touchSrc)

// touchCall is the write back of t for key.
func (s *Store) touchCall(key string, t *touch) *scriptCall {
	ttl := max(t.idle-time.Since(t.at), time.Millisecond)
	return &scriptCall{sc: touchScript, keys: []string{s.bindingKey(key)},
		args: []any{t.instance, t.since, t.count, millis(ttl), t.now, t.now + entryLifetime(t.idle),
			refreshPeriod(t.idle), refreshMargin(t.idle), millis(t.idle), boolArg(len(t.aliases) > 0)}}
}

type touchReply struct {
	same         bool
	index, links int64
}

func parseTouchReply(cmd *goredis.Cmd) (touchReply, error) {
	res, err := cmd.Slice()
	if err != nil {
		return touchReply{}, err
	}
	if len(res) == 1 {
		return touchReply{}, nil
	}
	if len(res) != 3 {
		return touchReply{}, fmt.Errorf("unexpected touch reply %v", res)
	}
	ie, _ := res[1].(string)
	le, _ := res[2].(string)
	r := touchReply{same: true}
	if ie != "" {
		if _, err := fmt.Sscan(ie, &r.index); err != nil {
			return touchReply{}, fmt.Errorf("unexpected touch reply %v", res)
		}
	}
	if le != "" {
		if _, err := fmt.Sscan(le, &r.links); err != nil {
			return touchReply{}, fmt.Errorf("unexpected touch reply %v", res)
		}
	}
	return r, nil
}
