// Package store opens tether's binding store by its URL, redis.url.
// "embedded" opens the in-process memory store. Anything else opens a Redis
// store.
//
// Each package that uses the store declares the interface it needs, where
// it uses it:
//
//   - the decision: affinity.Store;
//   - the replicas' sync: replicas.LoadSyncer, Circuits, Leases, ContentBus;
//   - the admin API: admin.SessionIndex, admin.Checker;
//   - the session-length metrics: metrics.Counts.
//
// Store here is all of them together, which is what the server wires. The
// types they speak are in package bindings.
package store

import (
	"context"
	"io"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/replicas"
	"github.com/tetherproxy/tether/store/memory"
	"github.com/tetherproxy/tether/store/redis"
)

// Embedded is the URL of the in-process memory store, store/memory. With it
// the local stack and demos run without a Redis server. Bindings live only
// as long as the process and are not shared with other replicas. It takes
// no settings: the value is exactly "embedded".
const Embedded = "embedded"

// Store is everything a tether replica uses of its binding store.
type Store interface {
	affinity.Store      // the decision: GetOrBind, Replace
	replicas.LoadSyncer // SyncLoad, SetDrained
	replicas.Circuits   // the instance breaker's shared circuits
	replicas.Leases     // who scrapes which engines
	replicas.ContentBus // the prefix index's records, between replicas

	// The session index, admin.SessionIndex. replicas.CircuitShare reads
	// Bound.
	Show(ctx context.Context, key string, now time.Time) (s bindings.Session, ok bool, err error)
	Mark(ctx context.Context, f bindings.MarkFilter, m bindings.Move, now time.Time) (marked, remaining int, err error)
	Bound(ctx context.Context, instance string, limit int, now time.Time) ([]bindings.Session, error)
	// Requests reads sessions' request counts, for metrics.Counts.
	Requests(ctx context.Context, keys []string, now time.Time) ([]int, error)
	// Ping and Health tell readiness whether the store reaches its backend.
	// They are admin.Checker.
	Ping(ctx context.Context) error
	Health() bindings.Health

	io.Closer // releases what Open built; idempotent
}

var (
	_ Store = (*memory.Store)(nil)
	_ Store = (*redis.Store)(nil)
)

// Options tune what Open builds. The memory store has no round trip to
// bound. It has no write that can fail apart from the decision, and no guard
// that opens. It uses only OnGuard, which it calls once with false.
type Options struct {
	// Timeout bounds each round trip of the request path. 0 disables it.
	// See redis.Options.Timeout.
	Timeout time.Duration
	// OnIndexError hears of failed writes that do not fail the decision.
	// See redis.Options.OnIndexError.
	OnIndexError func(error)
	// OnGuard hears the state of the store's guard on its backend. It hears
	// it once when the store is built: true when the backend is
	// unreachable. Then it hears each time the guard opens or closes. See
	// redis.Options.OnGuard.
	OnGuard func(open bool)
	// Cache tunes the Redis store's hit cache, redis.Options.Cache. The
	// memory store has no round trip to save and ignores it.
	Cache redis.CacheOptions
}

// Open returns the store rawURL names. Embedded gives a new memory store.
// Any other value gives a Redis store from redis.Open, which takes
// standalone, Cluster or Sentinel URLs. A Redis that does not answer gives
// a store whose guard is open, not an error. A URL Open cannot use fails it
// with a *redis.URLError. Its text never shows a password.
func Open(ctx context.Context, rawURL string, opts Options) (Store, error) {
	if rawURL == Embedded {
		s := memory.New()
		if opts.OnGuard != nil {
			opts.OnGuard(false)
		}
		return s, nil
	}
	s, err := redis.Open(ctx, rawURL, redis.Options{Timeout: opts.Timeout, OnIndexError: opts.OnIndexError, OnGuard: opts.OnGuard, Cache: opts.Cache})
	if err != nil {
		return nil, err
	}
	return s, nil
}

// CheckURL reports, without connecting, whether Open accepts rawURL. When
// not, the error is a *redis.URLError. `tether config validate` calls it,
// so a config file and Open agree on what a store URL is.
func CheckURL(rawURL string) error {
	if rawURL == Embedded {
		return nil
	}
	return redis.CheckURL(rawURL)
}
