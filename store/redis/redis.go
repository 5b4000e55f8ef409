// Package redis is the affinity.Store shared by every tether replica.
//
// A binding is one hash, "tether:b:<key>" → {i: instance, s: since in unix
// milliseconds}, whose key TTL is the idle timeout. Each operation is one Lua
// script, so the read, the decision and the write happen atomically on the
// server: replicas racing on a new session agree on one instance. Scripts
// are loaded when the store is built and run with EVALSHA, so the hot path is
// exactly one round trip; after a server restart or SCRIPT FLUSH the first
// call falls back to EVAL once, which caches the script again.
package redis

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/affinity"
)

const (
	// DefaultTimeout bounds one store call in DefaultOptions: a request must
	// never wait long on Redis, the caller falls back to placement instead.
	DefaultTimeout = 50 * time.Millisecond
	// DefaultPrefix is prepended to every binding key.
	DefaultPrefix = "tether:b:"
	// loadTimeout bounds script loading in New, which has no context.
	loadTimeout = 5 * time.Second
)

// getOrBindSrc: KEYS[1] binding; ARGV instance, now ms, idle ms, max ms.
// Returns {instance, since ms, outcome} with outcome 1 found, 2 created,
// 3 renewed (the affinity.Outcome values). A hash without a numeric "s" is
// treated as absent, so a damaged record heals instead of failing forever.
const getOrBindSrc = `
local cur = redis.call('HMGET', KEYS[1], 'i', 's')
local s = tonumber(cur[2])
local outcome = 2
if cur[1] and s then
  local max = tonumber(ARGV[4])
  if max == 0 or tonumber(ARGV[2]) - s < max then
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    return {cur[1], cur[2], 1}
  end
  outcome = 3
end
redis.call('HSET', KEYS[1], 'i', ARGV[1], 's', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {ARGV[1], ARGV[2], outcome}
`

// replaceSrc: KEYS[1] binding; ARGV old instance, next instance, next
// since ms, idle ms. Returns {instance, since ms} now stored. The kept
// binding's idle timeout is refreshed too: the caller is using the session.
const replaceSrc = `
local cur = redis.call('HMGET', KEYS[1], 'i', 's')
if cur[1] and tonumber(cur[2]) and cur[1] ~= ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  return {cur[1], cur[2]}
end
redis.call('HSET', KEYS[1], 'i', ARGV[2], 's', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {ARGV[2], ARGV[3]}
`

var _ affinity.Store = (*Store)(nil)

// Options tunes a Store. Start from DefaultOptions: the zero value has no
// per-call timeout.
type Options struct {
	// Timeout bounds each call with context.WithTimeout; 0 disables it (the
	// client's own read and write timeouts still apply).
	Timeout time.Duration
	// Prefix replaces DefaultPrefix when not empty, for example to share one
	// Redis between two tether deployments.
	Prefix string
}

// DefaultOptions returns the options tether runs with.
func DefaultOptions() Options {
	return Options{Timeout: DefaultTimeout, Prefix: DefaultPrefix}
}

// Validate reports the first invalid option.
func (o Options) Validate() error {
	if o.Timeout < 0 {
		return fmt.Errorf("redis options: timeout must not be negative, got %v", o.Timeout)
	}
	return nil
}

// Store is an affinity.Store over a go-redis client: standalone, Sentinel or
// Cluster (one key per script, so any slot works).
type Store struct {
	client    goredis.UniversalClient
	timeout   time.Duration
	prefix    string
	getOrBind *goredis.Script
	replace   *goredis.Script

	// Owned by the store only when Open built them.
	ownClient bool
	embedded  *embeddedServer
	closeOnce sync.Once
	closeErr  error
}

// New returns a store over a client the caller owns (Close leaves it open).
// It loads the scripts (on every shard of a cluster) and fails if it cannot,
// so a wrong address or password shows at start-up, not on the first
// request. With a per-call timeout the client must have
// ContextTimeoutEnabled; otherwise go-redis ignores context deadlines and a
// slow Redis would hold requests for its read timeout.
func New(client goredis.UniversalClient, opts Options) (*Store, error) {
	ctx, cancel := context.WithTimeout(context.Background(), loadTimeout)
	defer cancel()
	return newStore(ctx, client, opts)
}

func newStore(ctx context.Context, client goredis.UniversalClient, opts Options) (*Store, error) {
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
		client:    client,
		timeout:   opts.Timeout,
		prefix:    opts.Prefix,
		getOrBind: goredis.NewScript(getOrBindSrc),
		replace:   goredis.NewScript(replaceSrc),
	}
	if s.prefix == "" {
		s.prefix = DefaultPrefix
	}
	// SCRIPT LOAD now (a cluster client loads on every shard), so calls can
	// go straight to EVALSHA.
	for _, sc := range []*goredis.Script{s.getOrBind, s.replace} {
		if err := sc.Load(ctx, client).Err(); err != nil {
			return nil, fmt.Errorf("redis store: load scripts: %w", err)
		}
	}
	return s, nil
}

// contextTimeoutEnabled reports whether c honours context deadlines. Unknown
// client types (wrappers) are trusted.
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

// Close releases what Open created: the client and the embedded server. A
// store from New leaves the caller's client open. Close is idempotent.
func (s *Store) Close() error {
	s.closeOnce.Do(func() {
		if s.ownClient {
			s.closeErr = s.client.Close()
		}
		if s.embedded != nil {
			s.embedded.Close()
		}
		if s.closeErr != nil {
			s.closeErr = fmt.Errorf("redis close: %w", s.closeErr)
		}
	})
	return s.closeErr
}

// Ping checks that Redis answers, for readiness probes.
func (s *Store) Ping(ctx context.Context) error {
	ctx, cancel := s.callContext(ctx)
	defer cancel()
	if err := s.client.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("redis ping: %w", err)
	}
	return nil
}

// GetOrBind implements affinity.Store in one EVALSHA.
func (s *Store) GetOrBind(ctx context.Context, key string, candidate affinity.Binding, lt affinity.Lifetime) (affinity.Binding, affinity.Outcome, error) {
	if err := affinity.CheckBinding(candidate, lt); err != nil {
		return affinity.Binding{}, 0, fmt.Errorf("redis get-or-bind: %w", err)
	}
	ctx, cancel := s.callContext(ctx)
	defer cancel()
	if err := ctx.Err(); err != nil {
		// go-redis ignores a done context when ContextTimeoutEnabled is off.
		return affinity.Binding{}, 0, fmt.Errorf("redis get-or-bind: %w", err)
	}
	res, err := s.getOrBind.Run(ctx, s.client, []string{s.prefix + key},
		candidate.Instance, candidate.Since.UnixMilli(), millis(lt.Idle), millis(lt.Max)).Slice()
	if err != nil {
		return affinity.Binding{}, 0, fmt.Errorf("redis get-or-bind: %w", err)
	}
	b, out, err := parseReply(res, true)
	if err != nil {
		return affinity.Binding{}, 0, fmt.Errorf("redis get-or-bind: %w", err)
	}
	return b, out, nil
}

// Replace implements affinity.Store in one EVALSHA.
func (s *Store) Replace(ctx context.Context, key, old string, next affinity.Binding, lt affinity.Lifetime) (affinity.Binding, error) {
	if err := affinity.CheckBinding(next, lt); err != nil {
		return affinity.Binding{}, fmt.Errorf("redis replace: %w", err)
	}
	ctx, cancel := s.callContext(ctx)
	defer cancel()
	if err := ctx.Err(); err != nil {
		return affinity.Binding{}, fmt.Errorf("redis replace: %w", err)
	}
	res, err := s.replace.Run(ctx, s.client, []string{s.prefix + key},
		old, next.Instance, next.Since.UnixMilli(), millis(lt.Idle)).Slice()
	if err != nil {
		return affinity.Binding{}, fmt.Errorf("redis replace: %w", err)
	}
	b, _, err := parseReply(res, false)
	if err != nil {
		return affinity.Binding{}, fmt.Errorf("redis replace: %w", err)
	}
	return b, nil
}

func (s *Store) callContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if s.timeout <= 0 {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, s.timeout)
}

// parseReply decodes {instance, since ms[, outcome]} without trusting its
// shape: a reply we did not expect is an error, never a panic.
func parseReply(res []any, withOutcome bool) (affinity.Binding, affinity.Outcome, error) {
	n := 2
	if withOutcome {
		n = 3
	}
	if len(res) != n {
		return affinity.Binding{}, 0, fmt.Errorf("unexpected script reply %v", res)
	}
	inst, ok1 := res[0].(string)
	since, ok2 := res[1].(string)
	ms, err := strconv.ParseInt(since, 10, 64)
	if !ok1 || !ok2 || err != nil {
		return affinity.Binding{}, 0, fmt.Errorf("unexpected script reply %v", res)
	}
	b := affinity.Binding{Instance: inst, Since: time.UnixMilli(ms)}
	if !withOutcome {
		return b, 0, nil
	}
	out, ok := res[2].(int64)
	if !ok || out < int64(affinity.Found) || out > int64(affinity.Renewed) {
		return affinity.Binding{}, 0, fmt.Errorf("unexpected script reply %v", res)
	}
	return b, affinity.Outcome(out), nil
}

// millis rounds d up to whole milliseconds, so a positive duration never
// becomes PEXPIRE 0 (which deletes the key).
func millis(d time.Duration) int64 {
	return int64((d + time.Millisecond - 1) / time.Millisecond)
}
