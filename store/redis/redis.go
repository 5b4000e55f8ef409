// Package redis is the binding store shared by every tether replica. It
// reaches standalone Redis, Sentinel or Redis Cluster through a go-redis
// UniversalClient. It implements every store interface of affinity
// (store.go). They cover the hot path, the session index, the load
// exchange, the instance circuits, the request counts and the readiness
// check.
//
// # Key layout
//
// Every Lua script touches the keys of one hash slot only, so the layout
// works on Redis Cluster. Per-session keys carry the session key as their
// hash tag. So a session's binding and its alias link share a slot:
//
//	tether:{<key>}:b          HASH    i instance, v version, s since ms,
//	                                  f failovers, n requests made,
//	                                  mv move-to-version, mo move-off-instance,
//	                                  x last index write ms, e index entry
//	                                  expiry ms, l alias links' expiry ms;
//	                                  PTTL = idle
//	tether:{<key>}:a          STRING  the session key <key> leads to;
//	                                  PTTL = Idle*5/4 from its last write
//
// Fleet-wide state shares the hash tag {fleet}, so one script reads it all.
// The trade-off is that one slot, on one Cluster shard, holds the whole fleet
// state. It takes writes only on binds, index refreshes and load syncs, never
// on an ordinary hit. An index refresh comes about every Idle/4 per session
// in use. A load sync comes once a second per replica.
//
//	tether:{fleet}:i:<instance>  ZSET  member session key, score expiry ms
//	tether:{fleet}:r:<replica>   HASH  f:<instance> in flight, q:<instance> queue
//	tether:{fleet}:replicas      ZSET  member replica, score report expiry ms
//	tether:{fleet}:drained       SET   drained instances
//
// "tether:" is Options.Prefix. A '{', '}' or '%' in a session key is escaped
// in the key name as %7B, %7D or %25. So any key keeps its own slot. Member
// and link values keep the key as it is.
//
// # Round trips
//
// Scripts are loaded when the store is built, if Redis answers then. They run
// with EVALSHA. Redis may not have them: it did not answer at build, or it
// restarted, or it ran SCRIPT FLUSH. Then a call refused with NOSCRIPT is
// sent again once with EVAL, which caches the script again.
//
//   - With the hit cache on (Options.Cache, cache.go), a cached hit whose
//     refresh is not due is NO round trip. Its refresh, count and last use
//     are written back later, in a batch. The batch goes with the session's
//     other hits of the next CacheOptions.WriteBack.
//   - Otherwise a hit whose refresh is not due is ONE round trip. The
//     get-or-bind script is sent alone.
//   - A bind, or a hit whose refresh is due, is two round trips. The script
//     goes first. Then one pipeline carries the index script on the {fleet}
//     slot and a SET per alias link.
//   - A key that is itself an alias adds one round trip before those. The
//     first finds the link, the second gets or binds the linked key.
//
// # Refreshes
//
// The binding records when its index entry (e) and its alias links (l)
// expire. A use may keep the binding alive to within a margin of either:
// Idle/8, at most a second. Then the use rewrites it to expire Idle*5/4 from
// now, never earlier than before. The index entry is also rewritten once it
// is Idle/4 old, which heals a lost entry.
//
// With one idle timeout throughout, that is a refresh every Idle/4 or a
// little sooner. The entry and the links always outlive the binding,
// whatever idle timeout each request carries. So a session may be counted in
// its instance's index after it ends. That lasts up to Idle/4 with one idle
// timeout. Otherwise it lasts up to the longest Idle*5/4 its requests
// carried. A link may outlive its session as long. A request carrying only
// that alias then binds under the ended session's key.
//
// Alias links are written only once the request's key is resolved. They are
// written only when due: on a bind, and with the refreshes above. An alias
// that a session's requests start to carry mid-session is linked at the next
// refresh, up to Idle/4 later. A request carrying only that alias before then
// starts a session of its own. A refresh writes the links of the request
// that makes it due: its aliases, and its key when that key is an alias.
//
// A failed index or alias write does not fail the decision.
// Options.OnIndexError hears of it. It also hears of report values SyncLoad
// skipped.
//
// # Outages
//
// A request must never wait on a dead Redis. Its caller decides without the
// store when a call fails. So every call is bounded by Options.Timeout
// (DefaultTimeout, 10 ms). Each store also has a guard on Redis, a go-redis
// hook on its client. The guard is a circuit breaker. It is called the guard
// to tell it from the instance breaker.
//
//   - It opens after 5 calls in a row fail. A pipeline is one call. A call
//     fails on a network error, a timeout or a pool timeout. It also fails
//     on a reply saying the server cannot serve now: LOADING, CLUSTERDOWN,
//     TRYAGAIN, MASTERDOWN, READONLY, BUSY, max clients.
//   - Other replies are answers, and say Redis is up. Examples are NOSCRIPT,
//     WRONGTYPE, a script error, or no such key.
//   - A caller's cancellation counts neither way.
//   - While open, every call fails at once with an error wrapping
//     ErrGuardOpen. It does not touch the network.
//   - After a cooldown of 500 ms, the guard is half open. It lets one call
//     through as a probe. The others still fail at once.
//   - The probe's success closes the guard. Its failure opens it again for
//     twice the cooldown, up to 2 s. So tether uses Redis again at most
//     about 2 s after it returns.
//   - Recovery needs no operator, only calls. tether makes at least one call
//     a second, its load sync.
//   - On a Redis Cluster, every failed call also asks the client to reload
//     its slot map. The reload is lazy, one at a time. A master that died
//     sends no MOVED to say its replica took over.
//
// Store.Health reports the guard's state, for readiness and metrics. Their
// names keep "breaker": tether_redis_breaker_opens_total and the /readyz
// "breaker" field. Options.OnGuard hears when the guard opens and closes.
//
// A store starts without Redis. New and Open wait at most a second for Redis
// to answer a PING. When it does not, they return a store whose guard is
// open, which recovers as above. A Redis that answers with an error fails
// them, as a malformed URL fails Open. Such errors are a wrong password or a
// missing permission.
package redis

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/replicas"
)

const (
	// DefaultTimeout bounds one store call in defaultOptions: a request must
	// never wait long on Redis, the caller falls back to placement instead.
	// A round trip to a Redis nearby takes well under a millisecond.
	DefaultTimeout = 10 * time.Millisecond
	// OpTimeout is the least time a round trip off the request path gets
	// (see opContext).
	OpTimeout = time.Second
	// DefaultPrefix is prepended to every key.
	DefaultPrefix = "tether:"
	// markBatch is how many sessions Mark checks per pipeline.
	markBatch = 256
)

var (
	_ replicas.LoadSyncer = (*Store)(nil)
	_ replicas.Circuits   = (*Store)(nil)
	_ replicas.Leases     = (*Store)(nil)
)

// Options tunes a Store. Start from defaultOptions: the zero value has no
// per-call timeout.
type Options struct {
	// Timeout bounds each round trip of the request path with
	// context.WithTimeout. That path is GetOrBind, Replace and Ping. Round
	// trips off it get at least OpTimeout: Show, Mark, Bound, SyncLoad,
	// SetDrained and the instance circuits. 0 disables both. The client's
	// own read and write timeouts still apply.
	Timeout time.Duration
	// Prefix replaces DefaultPrefix when not empty, for example to share one
	// Redis between two tether deployments. It must not contain '{' or '}',
	// which would change the keys' hash tags.
	Prefix string
	// OnIndexError, when not nil, is called with the error of a write that
	// is not part of the decision. Such a write does not fail the decision:
	// a session index update, an alias link. The decision stands. Both heal
	// at the session's next refresh. OnIndexError also hears, once per
	// SyncLoad, of other replicas' report values that were not integers and
	// were skipped. It is called from the calling goroutine, so
	// concurrently. Make it safe for that.
	OnIndexError func(error)
	// OnGuard, when not nil, hears the guard's state. It is called once
	// when the store is built, with true when Redis is unreachable. Then it
	// is called each time the guard opens (true) or closes again (false).
	// Reopenings after a failed probe are not reported. It is called with
	// the guard's lock held, from the goroutine whose call changed the
	// state. Keep it short, such as setting a gauge. Do not call the Store
	// from it.
	OnGuard func(open bool)
	// Cache serves sticky hits without a round trip (cache.go). It works on
	// a standalone Redis, behind a Sentinel and on a Cluster alike.
	// Store.Hits says whether it is on.
	//
	// A store with the cache on must be closed. It runs two goroutines.
	// Behind a Sentinel, a store Open made runs one more for each sentinel
	// the URL names, to watch it for failovers. A store from New does not
	// know the sentinels. It only flushes when its subscription drops.
	Cache CacheOptions
}

// Validate reports the first invalid option.
func (o Options) Validate() error {
	if o.Timeout < 0 {
		return fmt.Errorf("redis options: timeout must not be negative, got %v", o.Timeout)
	}
	if strings.ContainsAny(o.Prefix, "{}") {
		return fmt.Errorf("redis options: prefix %q must not contain '{' or '}'", o.Prefix)
	}
	if err := o.Cache.Validate(); err != nil {
		return err
	}
	return nil
}

// Store implements the interfaces of the binding store over a go-redis
// client. They are affinity.Store and those admin, metrics and replicas
// declare.
type Store struct {
	client       goredis.UniversalClient
	timeout      time.Duration
	prefix       string
	fleet        string // prefix + "{fleet}:"
	onIndexError func(error)
	guard        *guard // the guard on Redis, a hook on client

	getOrBind, replace, index, show, mark, prune, syncLoad *goredis.Script

	// channel is where the scripts publish a changed binding's key. cache
	// is nil when this store does not cache hits. hits and hitsWhy say so,
	// for Hits.
	channel       string
	origin        string // this store's name in its messages, random
	cache         *hitCache
	hits, hitsWhy string

	// ownClient: Open built the client, so Close closes it.
	ownClient bool
	closeOnce sync.Once
	closeErr  error
}

// New returns a store over a client the caller owns. Close leaves the
// client open.
//
// New adds the store's guard to the client as a hook. If Redis answers a
// PING within a second, New loads the scripts, on every shard of a cluster.
// A Redis that answers with an error, such as a wrong password, fails New.
// A Redis that does not answer gives a store whose guard is open. See the
// package comment.
//
// With a per-call timeout the client must have ContextTimeoutEnabled.
// Otherwise go-redis ignores context deadlines, and a slow Redis would hold
// requests for its read timeout.
func New(client goredis.UniversalClient, opts Options) (*Store, error) {
	return newStore(context.Background(), client, opts, nil, nil)
}

// newStore builds the store and checks Redis, as New says. redact removes
// secrets from the error texts Health reports. Nil redacts nothing.
// sentinels are the sentinels the hit cache watches for failovers. They are
// set only when the client is Open's failover client.
func newStore(ctx context.Context, client goredis.UniversalClient, opts Options, redact func(string) string, sentinels *sentinelWatch) (*Store, error) {
	if client == nil {
		return nil, errors.New("redis store: nil client")
	}
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	if opts.Timeout > 0 && !contextTimeoutEnabled(client) {
		return nil, errors.New("redis store: a per-call timeout needs a client with ContextTimeoutEnabled")
	}
	s := &Store{
		client:       client,
		timeout:      opts.Timeout,
		prefix:       opts.Prefix,
		onIndexError: opts.OnIndexError,
		getOrBind:    goredis.NewScript(getOrBindSrc),
		replace:      goredis.NewScript(replaceSrc),
		index:        goredis.NewScript(indexSrc),
		show:         goredis.NewScript(showSrc),
		mark:         goredis.NewScript(markSrc),
		prune:        goredis.NewScript(pruneSrc),
		syncLoad:     goredis.NewScript(syncLoadSrc),
	}
	if s.prefix == "" {
		s.prefix = DefaultPrefix
	}
	s.fleet = s.prefix + "{fleet}:"
	s.origin = newOrigin()
	s.hits, s.hitsWhy = HitsOneRoundTrip, "cache off ([redis] cache = false)"
	// Published whether or not this replica caches: another replica on the
	// same Redis may.
	s.channel = s.prefix + "invalidate"
	if opts.Cache.Enabled {
		s.cache = newHitCache(s, opts.Cache.withDefaults())
		s.cache.sentinels = sentinels
		s.hits, s.hitsWhy = HitsCached, ""
	}
	bc := guardConfig{redact: redact}
	if cc, ok := client.(*goredis.ClusterClient); ok {
		// Lazy and coalesced by go-redis: one reload at a time.
		bc.onFailure = func() { cc.ReloadState(context.Background()) }
	}
	s.guard = newGuard(bc)
	client.AddHook(s.guard)
	// SCRIPT LOAD now, so calls can go straight to EVALSHA. A cluster
	// client loads on every shard.
	scripts := []*goredis.Script{s.getOrBind, s.replace, s.index, s.show, s.mark, s.prune, s.syncLoad}
	if s.cache != nil {
		scripts = append(scripts, touchScript)
	}
	if err := s.start(ctx, scripts); err != nil {
		return nil, err
	}
	s.guard.watch(opts.OnGuard)
	if s.cache != nil {
		s.cache.start()
	}
	return s, nil
}

// contextTimeoutEnabled reports whether c honours context deadlines. Unknown
// client types, such as wrappers, are trusted.
func contextTimeoutEnabled(c goredis.UniversalClient) bool {
	switch c := c.(type) {
	case *goredis.Client:
		return c.Options().ContextTimeoutEnabled
	case *goredis.ClusterClient:
		return c.Options().ContextTimeoutEnabled
	case *goredis.Ring:
		return c.Options().ContextTimeoutEnabled
	}
	return true
}

// Close releases the client Open created. A store from New leaves the
// caller's client open. Close is idempotent.
func (s *Store) Close() error {
	s.closeOnce.Do(func() {
		if s.cache != nil {
			s.cache.close()
		}
		s.guard.off.Store(true)
		if s.ownClient {
			s.closeErr = s.client.Close()
		}
		if s.closeErr != nil {
			s.closeErr = fmt.Errorf("redis close: %w", s.closeErr)
		}
	})
	return s.closeErr
}

// Ping checks that Redis answers, for readiness probes. Like every call it
// goes through the guard. While the guard is open it fails at once with
// ErrGuardOpen. Once the cooldown has passed it may be the probe.
func (s *Store) Ping(ctx context.Context) error {
	ctx, cancel := s.callContext(ctx)
	defer cancel()
	if err := s.client.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("redis ping: %w", err)
	}
	return nil
}

// Key names. tagReplacer escapes what would change a key's hash tag, and
// '%' so that the escaping stays one to one.
var tagReplacer = strings.NewReplacer("%", "%25", "{", "%7B", "}", "%7D")

func (s *Store) bindingKey(key string) string {
	return s.prefix + "{" + tagReplacer.Replace(key) + "}:b"
}

func (s *Store) linkKey(key string) string {
	return s.prefix + "{" + tagReplacer.Replace(key) + "}:a"
}

func (s *Store) indexKey(instance string) string { return s.fleet + "i:" + instance }
func (s *Store) reportPrefix() string            { return s.fleet + "r:" }
func (s *Store) replicasKey() string             { return s.fleet + "replicas" }
func (s *Store) drainedKey() string              { return s.fleet + "drained" }

// GetOrBind implements affinity.Store. A hit whose refresh is not due is
// one EVALSHA. The package comment has the other cases.
func (s *Store) GetOrBind(ctx context.Context, l bindings.Lookup) (bindings.Result, error) {
	if err := bindings.CheckBinding(l.Candidate, l.Lifetime); err != nil {
		return bindings.Result{}, fmt.Errorf("redis get-or-bind: %w", err)
	}

	// Nothing is linked until the key is resolved. l.Key may itself be an
	// alias, and the links must lead to the key the binding lives under.
	key, aliases := l.Key, aliasesOf(l.Aliases, l.Key)
	var epoch uint64
	if s.cache != nil {
		// A cached hit: no round trip, no context, nothing sent.
		res, ok, e := s.cache.lookup(l, aliases)
		if ok {
			return res, nil
		}
		epoch = e
	}
	ctx, cancel := s.callContext(ctx)
	defer cancel()
	if err := ctx.Err(); err != nil {
		// go-redis ignores a done context when ContextTimeoutEnabled is off.
		return bindings.Result{}, fmt.Errorf("redis get-or-bind: %w", err)
	}
	now := l.Candidate.Since.UnixMilli()
	var pending *touch
	if s.cache != nil {
		// Hits cached earlier and not yet written back go first, in the
		// same round trip, so the count this call returns includes them.
		pending, _ = s.cache.take(ctx, key)
	}
	r, err := s.getOrBindOnce(ctx, l, key, true, len(aliases) > 0, pending)
	if err != nil {
		return bindings.Result{}, fmt.Errorf("redis get-or-bind: %w", err)
	}
	if r.link != "" {
		// l.Key is an alias. It is linked again, with the other aliases,
		// whenever the session's links are due. So following it keeps it.
		key, aliases = r.link, aliasesOf(append([]string{l.Key}, l.Aliases...), r.link)
		var pending *touch
		if s.cache != nil {
			pending, _ = s.cache.take(ctx, key)
		}
		r, err = s.getOrBindOnce(ctx, l, key, false, len(aliases) > 0, pending)
		if err != nil {
			return bindings.Result{}, fmt.Errorf("redis get-or-bind: %w", err)
		}
		if r.link != "" {
			return bindings.Result{}, fmt.Errorf("redis get-or-bind: unexpected alias reply for %q", key)
		}
	}
	if r.links == 0 {
		aliases = nil
	}
	if r.index != 0 || len(aliases) > 0 {
		s.refresh(ctx, key, r.b.Instance, r.prevInstance, now, r.index, aliases, r.links)
	}
	res := bindings.Result{Key: key, Binding: r.b, Origin: r.out, Requests: r.requests}
	switch r.out {
	case bindings.Found:
		res.Move = r.move
		if r.idle > 0 {
			res.Idle = time.Duration(r.idle) * time.Millisecond
		}
	case bindings.Renewed:
		res.Previous = r.prev
	}
	if s.cache != nil {
		if key == l.Key {
			s.cache.store(key, epoch, res, l.Candidate.Since, r)
		} else {
			s.cache.drop(key) // its cached count is behind now
		}
	}
	return res, nil
}

// Peek implements affinity.Peeker from the hit cache: no round trip, so
// a store without the cache, or a session it does not hold, is not
// peeked.
func (s *Store) Peek(key string, now time.Time, lt bindings.Lifetime) (bindings.Binding, bool) {
	if s.cache == nil {
		return bindings.Binding{}, false
	}
	return s.cache.peek(key, now, lt)
}

// aliasesOf returns the aliases to link to key. It leaves out empty ones,
// key itself and repeats.
func aliasesOf(aliases []string, key string) []string {
	var out []string
	for _, a := range aliases {
		if a != "" && a != key && !slices.Contains(out, a) {
			out = append(out, a)
		}
	}
	return out
}

// getOrBindOnce runs the get-or-bind script on key, alone. A hit whose
// refresh is not due is this one EVALSHA. hasLinks tells the script that
// the request has alias links to write when they are due. A pending write
// back of key's cached hits is sent before it, in one pipeline.
func (s *Store) getOrBindOnce(ctx context.Context, l bindings.Lookup, key string, follow, hasLinks bool, pending *touch) (bindReply, error) {
	now, idle := l.Candidate.Since.UnixMilli(), l.Lifetime.Idle
	c := &scriptCall{
		sc:   s.getOrBind,
		keys: []string{s.bindingKey(key), s.linkKey(key)},
		args: []any{l.Candidate.Instance, l.Candidate.Version, now, millis(idle), millis(l.Lifetime.Max),
			boolArg(follow), now + entryLifetime(idle), refreshPeriod(idle), refreshMargin(idle), boolArg(hasLinks), s.channel, s.origin},
	}
	calls := []*scriptCall{c}
	if pending != nil {
		calls = []*scriptCall{s.touchCalls([]*touch{pending}, 1)[0], c}
	}
	s.exec(ctx, calls, nil)
	res, err := c.cmd.Slice()
	if err != nil {
		return bindReply{}, err
	}
	return parseBindReply(res)
}

// Replace implements affinity.Store in one EVALSHA. The index script
// follows when the session moved, or when its index entry is due for a
// refresh.
func (s *Store) Replace(ctx context.Context, key, old string, next bindings.Binding, lt bindings.Lifetime) (bindings.Binding, error) {
	if err := bindings.CheckBinding(next, lt); err != nil {
		return bindings.Binding{}, fmt.Errorf("redis replace: %w", err)
	}
	ctx, cancel := s.callContext(ctx)
	defer cancel()
	if err := ctx.Err(); err != nil {
		return bindings.Binding{}, fmt.Errorf("redis replace: %w", err)
	}
	now := next.Since.UnixMilli()
	c := &scriptCall{sc: s.replace, keys: []string{s.bindingKey(key)},
		args: []any{old, next.Instance, next.Version, now, millis(lt.Idle), now + entryLifetime(lt.Idle),
			refreshPeriod(lt.Idle), refreshMargin(lt.Idle), next.Failovers, s.channel, s.origin}}
	calls := []*scriptCall{c}
	if s.cache != nil {
		// The binding changes, or another replica's is kept. Forget it here
		// at once: the message comes back later. Cached hits not yet
		// written back go first, so the count moves with the binding.
		s.cache.drop(key)
		if t, ok := s.cache.take(ctx, key); ok {
			calls = []*scriptCall{s.touchCalls([]*touch{t}, 1)[0], c}
		}
	}
	s.exec(ctx, calls, nil)
	if s.cache != nil {
		s.cache.drop(key) // a lookup that read the old binding meanwhile
	}
	res, err := c.cmd.Slice()
	if err != nil {
		return bindings.Binding{}, fmt.Errorf("redis replace: %w", err)
	}
	r, err := parseReplaceReply(res)
	if err != nil {
		return bindings.Binding{}, fmt.Errorf("redis replace: %w", err)
	}
	if r.index != 0 {
		s.refresh(ctx, key, r.b.Instance, r.prev, now, r.index, nil, 0)
	}
	return r.b, nil
}

// refresh writes, in one pipeline, what a script found due:
//
//   - when index is not 0, key's entry in instance's index, with score
//     index, removing it from prev's index;
//   - the aliases' links to key, until linkExpiry.
//
// Errors go to OnIndexError. The decision stands.
func (s *Store) refresh(ctx context.Context, key, instance, prev string, now, index int64, aliases []string, linkExpiry int64) {
	var calls []*scriptCall
	if index != 0 {
		from := s.indexKey(instance)
		if prev != "" {
			from = s.indexKey(prev)
		}
		// The index key's own TTL is garbage collection only. Twice the
		// entry's lifetime leaves room for clock skew between replicas and
		// Redis.
		keyTTL := 2 * max(index-now, 1)
		calls = append(calls, &scriptCall{sc: s.index, keys: []string{s.indexKey(instance), from}, args: []any{key, index, keyTTL}})
	}
	ttl := time.Duration(linkExpiry-now) * time.Millisecond
	if ttl <= 0 {
		aliases = nil // cannot happen: the script never lowers an expiry below now + Idle*5/4
	}
	sets := make([]*goredis.StatusCmd, 0, len(aliases))
	s.exec(ctx, calls, func(p goredis.Pipeliner) {
		for _, a := range aliases {
			sets = append(sets, p.Set(ctx, s.linkKey(a), key, ttl))
			if s.channel != "" {
				// A request for a now leads to key. A replica that cached a's
				// own binding must ask Redis again.
				p.Publish(ctx, s.channel, s.origin+" "+s.bindingKey(a))
			}
		}
	})
	if len(calls) > 0 {
		if err := calls[0].cmd.Err(); err != nil {
			s.indexError(fmt.Errorf("redis index %q on %q: %w", key, instance, err))
		}
	}
	if s.cache != nil {
		for _, a := range aliases {
			s.cache.drop(a) // its own message is skipped here
		}
	}
	for i, c := range sets {
		if err := c.Err(); err != nil {
			s.indexError(fmt.Errorf("redis link alias %q to %q: %w", aliases[i], key, err))
		}
	}
}

func (s *Store) indexError(err error) {
	if s.onIndexError != nil {
		s.onIndexError(err)
	}
}

// Show implements admin.SessionIndex in one round trip, two when key is an
// alias. It refreshes nothing.
func (s *Store) Show(ctx context.Context, key string, _ time.Time) (bindings.Session, bool, error) {
	ctx, cancel := s.opContext(ctx)
	defer cancel()
	if err := ctx.Err(); err != nil {
		return bindings.Session{}, false, fmt.Errorf("redis show: %w", err)
	}
	s.flushCache(ctx)
	sess, link, ok, err := s.showOnce(ctx, key, true)
	if err == nil && link != "" {
		key = link // one hop: the linked key's own link is not followed
		sess, link, ok, err = s.showOnce(ctx, key, false)
		if err == nil && link != "" {
			err = fmt.Errorf("unexpected alias reply for %q", key)
		}
	}
	if err != nil {
		return bindings.Session{}, false, fmt.Errorf("redis show: %w", err)
	}
	if !ok {
		return bindings.Session{}, false, nil
	}
	sess.Key = key
	return sess, true, nil
}

// showOnce runs the show script on key.
func (s *Store) showOnce(ctx context.Context, key string, follow bool) (sess bindings.Session, link string, ok bool, err error) {
	c := &scriptCall{sc: s.show, keys: []string{s.bindingKey(key), s.linkKey(key)}, args: []any{boolArg(follow)}}
	s.exec(ctx, []*scriptCall{c}, nil)
	res, err := c.cmd.Slice()
	if err != nil {
		return bindings.Session{}, "", false, err
	}
	return parseShowReply(res)
}

// Mark implements admin.SessionIndex. It reads the live members of the
// instance's index. It checks and marks their bindings in pipelines of
// markBatch. Then it prunes the members whose binding is gone or on
// another instance. Each round trip gets its own Options.Timeout.
func (s *Store) Mark(ctx context.Context, f bindings.MarkFilter, m bindings.Move, now time.Time) (marked, remaining int, err error) {
	if err := bindings.CheckMark(f, m); err != nil {
		return 0, 0, fmt.Errorf("redis mark: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return 0, 0, fmt.Errorf("redis mark: %w", err)
	}
	s.flushCache(ctx)
	idx := s.indexKey(f.Instance)
	members, err := s.liveMembers(ctx, idx, now.UnixMilli())
	if err != nil {
		return 0, 0, fmt.Errorf("redis mark: %w", err)
	}
	var t markTally
	for len(members) > 0 {
		n, mark := markSize(len(members), f.Limit, t.marked)
		if err := s.markMembers(ctx, f, m, members[:n], mark, &t); err != nil {
			return t.marked, t.remaining, fmt.Errorf("redis mark: %w", err)
		}
		members = members[n:]
	}
	if len(t.gone) > 0 {
		s.pruneIndex(ctx, idx, t.gone)
	}
	return t.marked, t.remaining, nil
}

// markTally is what Mark's batches found.
type markTally struct {
	marked, remaining int
	gone              []goredis.Z // members whose binding is gone or elsewhere
}

// markSize is how many of the left members Mark's next batch checks, and
// whether it marks them. It marks while the limit allows, then only
// counts. A limit of 0 is no limit.
func markSize(left, limit, marked int) (n int, mark bool) {
	n = min(left, markBatch)
	if limit <= 0 {
		return n, true
	}
	if need := limit - marked; need > 0 {
		return min(n, need), true
	}
	return n, false
}

// markMembers checks the bindings of batch in one pipeline, marks them
// when mark is true, and adds what it found to t.
func (s *Store) markMembers(ctx context.Context, f bindings.MarkFilter, m bindings.Move, batch []goredis.Z, mark bool, t *markTally) error {
	calls := make([]*scriptCall, len(batch))
	for i, z := range batch {
		calls[i] = &scriptCall{sc: s.mark, keys: []string{s.bindingKey(z.Member.(string))},
			args: []any{f.Instance, f.Version, boolArg(mark), m.Version, m.Off, s.channel, s.origin}}
	}
	bctx, cancel := s.opContext(ctx)
	s.exec(bctx, calls, nil)
	cancel()
	for i, c := range calls {
		v, err := c.cmd.Int64()
		if err != nil {
			return err
		}
		switch v {
		case markGone:
			t.gone = append(t.gone, batch[i])
		case markDone:
			t.marked++
			if s.cache != nil {
				s.cache.drop(batch[i].Member.(string))
			}
		case markUnmarked:
			t.remaining++
		case markOther, markPending:
		default:
			return fmt.Errorf("unexpected script reply %d", v)
		}
	}
	return nil
}

// liveMembers drops the expired members of an index and returns the others
// with their scores.
func (s *Store) liveMembers(ctx context.Context, idx string, now int64) ([]goredis.Z, error) {
	ctx, cancel := s.opContext(ctx)
	defer cancel()
	pipe := s.client.Pipeline()
	pipe.ZRemRangeByScore(ctx, idx, "-inf", strconv.FormatInt(now, 10))
	live := pipe.ZRangeByScoreWithScores(ctx, idx, &goredis.ZRangeBy{Min: "(" + strconv.FormatInt(now, 10), Max: "+inf"})
	if _, err := pipe.Exec(ctx); err != nil {
		return nil, fmt.Errorf("read index %q: %w", idx, err)
	}
	zs := live.Val()
	for _, z := range zs {
		if _, ok := z.Member.(string); !ok {
			return nil, fmt.Errorf("read index %q: unexpected member %v", idx, z.Member)
		}
	}
	return zs, nil
}

// Bound implements admin.SessionIndex. It reads the live members of the
// instance's index, then their bindings in pipelines of markBatch. Each
// round trip gets its own Options.Timeout.
func (s *Store) Bound(ctx context.Context, instance string, limit int, now time.Time) ([]bindings.Session, error) {
	if err := bindings.CheckBound(instance, limit); err != nil {
		return nil, fmt.Errorf("redis bound: %w", err)
	}
	s.flushCache(ctx)
	zs, err := s.liveMembers(ctx, s.indexKey(instance), now.UnixMilli())
	if err != nil {
		return nil, fmt.Errorf("redis bound: %w", err)
	}
	var out []bindings.Session
	for chunk := range slices.Chunk(zs, markBatch) {
		calls := make([]*scriptCall, len(chunk))
		for i, z := range chunk {
			key := z.Member.(string) // liveMembers checked
			calls[i] = &scriptCall{sc: s.show, keys: []string{s.bindingKey(key), s.linkKey(key)}, args: []any{boolArg(false)}}
		}
		cctx, cancel := s.opContext(ctx)
		s.exec(cctx, calls, nil)
		cancel()
		for i, c := range calls {
			res, err := c.cmd.Slice()
			if err != nil {
				return out, fmt.Errorf("redis bound: %w", err)
			}
			sess, _, ok, err := parseShowReply(res)
			if err != nil {
				return out, fmt.Errorf("redis bound: %w", err)
			}
			if !ok || sess.Binding.Instance != instance {
				continue
			}
			sess.Key = chunk[i].Member.(string)
			if out = append(out, sess); limit > 0 && len(out) == limit {
				return out, nil
			}
		}
	}
	return out, nil
}

// pruneIndex removes members whose score has not changed since they were
// read. Errors go to OnIndexError. The counts Mark returns are right anyway.
func (s *Store) pruneIndex(ctx context.Context, idx string, zs []goredis.Z) {
	for chunk := range slices.Chunk(zs, markBatch) {
		args := make([]any, 0, 2*len(chunk))
		for _, z := range chunk {
			args = append(args, z.Member, strconv.FormatFloat(z.Score, 'f', -1, 64))
		}
		c := &scriptCall{sc: s.prune, keys: []string{idx}, args: args}
		cctx, cancel := s.opContext(ctx)
		s.exec(cctx, []*scriptCall{c}, nil)
		cancel()
		if err := c.cmd.Err(); err != nil {
			s.indexError(fmt.Errorf("redis prune index %q: %w", idx, err))
			return
		}
	}
}

// SyncLoad implements replicas.LoadSyncer in one EVALSHA on the {fleet}
// slot.
func (s *Store) SyncLoad(ctx context.Context, r fleet.LoadReport, instances []string, ttl time.Duration, now time.Time) (fleet.LoadState, error) {
	if err := replicas.CheckReport(r, ttl); err != nil {
		return fleet.LoadState{}, fmt.Errorf("redis sync load: %w", err)
	}
	ctx, cancel := s.opContext(ctx)
	defer cancel()
	if err := ctx.Err(); err != nil {
		return fleet.LoadState{}, fmt.Errorf("redis sync load: %w", err)
	}
	keys := make([]string, 0, 3+len(instances))
	keys = append(keys, s.replicasKey(), s.drainedKey(), s.reportPrefix()+r.Replica)
	for _, in := range instances {
		keys = append(keys, s.indexKey(in))
	}
	ms := now.UnixMilli()
	args := []any{ms, ms + millis(ttl), millis(2 * ttl), r.Replica, s.reportPrefix()}
	for in, n := range r.InFlight {
		args = append(args, "f:"+in, n)
	}
	for in, q := range r.Queue {
		args = append(args, "q:"+in, q)
	}
	for in, e := range r.Engine {
		args = append(args, "e:"+in, encodeReading(e))
	}
	c := &scriptCall{sc: s.syncLoad, keys: keys, args: args}
	s.exec(ctx, []*scriptCall{c}, nil)
	res, err := c.cmd.Slice()
	if err != nil {
		return fleet.LoadState{}, fmt.Errorf("redis sync load: %w", err)
	}
	st, skipped, err := parseLoadReply(res, r, instances)
	if err != nil {
		return fleet.LoadState{}, fmt.Errorf("redis sync load: %w", err)
	}
	if len(skipped) > 0 {
		// Counted once per sync, so a broken replica cannot flood the hook.
		s.indexError(fmt.Errorf("redis sync load: skipped %d report value(s) that are not integers: %s",
			len(skipped), strings.Join(skipped[:min(len(skipped), 3)], ", ")))
	}
	return st, nil
}

// SetDrained implements replicas.LoadSyncer.
func (s *Store) SetDrained(ctx context.Context, instance string, drained bool) error {
	if instance == "" {
		return errors.New("redis set drained: empty instance name")
	}
	ctx, cancel := s.opContext(ctx)
	defer cancel()
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("redis set drained: %w", err)
	}
	var err error
	if drained {
		err = s.client.SAdd(ctx, s.drainedKey(), instance).Err()
	} else {
		err = s.client.SRem(ctx, s.drainedKey(), instance).Err()
	}
	if err != nil {
		return fmt.Errorf("redis set drained %q: %w", instance, err)
	}
	return nil
}

// scriptCall is one script invocation in a pipeline. cmd holds its result
// after exec.
type scriptCall struct {
	sc   *goredis.Script
	keys []string
	args []any
	cmd  *goredis.Cmd
}

// exec sends calls with EVALSHA, and the commands extra adds, in one
// pipeline. A call is refused with NOSCRIPT when the server restarted,
// failed over or flushed its scripts. Such calls are sent again with EVAL,
// which caches the scripts again. That costs one more round trip, once.
// Errors are left in each command.
func (s *Store) exec(ctx context.Context, calls []*scriptCall, extra func(goredis.Pipeliner)) {
	if len(calls) == 1 && extra == nil {
		// The hot path, a follow-up turn, is one call: no pipeline.
		c := calls[0]
		if c.cmd = c.sc.EvalSha(ctx, s.client, c.keys, c.args...); goredis.HasErrorPrefix(c.cmd.Err(), "NOSCRIPT") {
			c.cmd = c.sc.Eval(ctx, s.client, c.keys, c.args...)
		}
		return
	}
	pipe := s.client.Pipeline()
	for _, c := range calls {
		c.cmd = c.sc.EvalSha(ctx, pipe, c.keys, c.args...)
	}
	if extra != nil {
		extra(pipe)
	}
	_, _ = pipe.Exec(ctx)
	var retry []*scriptCall
	for _, c := range calls {
		if goredis.HasErrorPrefix(c.cmd.Err(), "NOSCRIPT") {
			retry = append(retry, c)
		}
	}
	if len(retry) == 0 {
		return
	}
	pipe = s.client.Pipeline()
	for _, c := range retry {
		c.cmd = c.sc.Eval(ctx, pipe, c.keys, c.args...)
	}
	_, _ = pipe.Exec(ctx)
}

// flushCache writes back the queued cached hits of keys, or all of them
// when no key is named. A call that reads what they change calls it
// first. They change counts, TTLs and the index.
func (s *Store) flushCache(ctx context.Context, keys ...string) {
	if s.cache == nil {
		return
	}
	ctx, cancel := s.opContext(ctx)
	defer cancel()
	take := s.cache.takeAll
	if len(keys) > 0 {
		take = s.cache.takeKeys(keys)
	}
	s.cache.flush(ctx, take)
}

// Hits says how this store serves a sticky hit: HitsCached, or
// HitsOneRoundTrip with the reason.
func (s *Store) Hits() (mode, why string) { return s.hits, s.hitsWhy }

// CacheStats returns the hit cache's counters. They are zero when it is
// off.
func (s *Store) CacheStats() CacheStats {
	if s.cache == nil {
		return CacheStats{}
	}
	return s.cache.stats()
}

func (s *Store) callContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if s.timeout <= 0 {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, s.timeout)
}

// opContext bounds a round trip off the request path: operations, the
// load sync, the instance circuits. The bound is Options.Timeout, but at
// least OpTimeout. Such a call may read a whole instance's index or every
// replica's report. Nobody waits on it. Cutting it at the request path's
// 10 ms would turn a large fleet's ordinary work into failures, and into
// the guard's count.
func (s *Store) opContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if s.timeout <= 0 {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, max(s.timeout, OpTimeout))
}

func boolArg(b bool) string {
	if b {
		return "1"
	}
	return "0"
}

// entryLifetime is how long an index entry or alias link written now
// lasts: Idle*5/4. So it outlives the binding until the next refresh.
func entryLifetime(idle time.Duration) int64 { return millis(idle * 5 / 4) }

// refreshPeriod is how old an index entry may get before a hit rewrites it
// anyway. That heals a lost entry.
func refreshPeriod(idle time.Duration) int64 { return millis(idle / 4) }

// maxMargin bounds refreshMargin.
const maxMargin = time.Second

// refreshMargin is how long an index entry or alias link must outlive the
// binding a request refreshes. Else it is written again. The margin is
// slack for the clocks of the replicas and Redis. With one idle timeout
// throughout, a session's entry is rewritten every Idle/4 minus this margin.
func refreshMargin(idle time.Duration) int64 { return millis(min(idle/8, maxMargin)) }

// millis rounds d up to whole milliseconds. So a positive duration never
// becomes PEXPIRE 0, which deletes the key.
func millis(d time.Duration) int64 {
	return int64((d + time.Millisecond - 1) / time.Millisecond)
}
