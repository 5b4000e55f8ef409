// Package store opens tether's binding store by its URL (redis.url): the
// in-process memory store for "embedded", a Redis store for anything else.
// The interfaces a store implements are declared, next to each other, by
// the decision core (affinity/store.go); Store here is all of them
// together, which is what the server wires. Consumers depend on the small
// interfaces they use, not on Store.
package store

import (
	"context"
	"io"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/store/memory"
	"github.com/tetherproxy/tether/store/redis"
)

// Embedded is the URL of the in-process memory store (store/memory): the
// local stack and demos run without a Redis server. Bindings live only as
// long as the process and are not shared with other replicas. It takes no
// settings: the value is exactly "embedded".
const Embedded = "embedded"

// Store is everything a tether replica uses of its binding store.
type Store interface {
	affinity.Store        // the hot path: GetOrBind, Replace
	affinity.SessionIndex // Show, Mark, Bound
	affinity.LoadSyncer   // SyncLoad, SetDrained
	affinity.Circuits     // the instance breaker's shared circuits
	affinity.Leases       // who scrapes which engines
	affinity.Counts       // Requests, for the session-length metrics
	affinity.Checker      // Ping, Health, for readiness
	io.Closer             // releases what Open built; idempotent
}

var (
	_ Store = (*memory.Store)(nil)
	_ Store = (*redis.Store)(nil)
)

// Options tune what Open builds. The memory store has no round trip to
// bound, no write that can fail apart from the decision, and no guard that
// opens: it uses only OnGuard, which it calls once with false.
type Options struct {
	// Timeout bounds each round trip of the request path
	// (redis.Options.Timeout); 0 disables it.
	Timeout time.Duration
	// OnIndexError hears of failed writes that do not fail the decision
	// (redis.Options.OnIndexError).
	OnIndexError func(error)
	// OnGuard hears the state of the store's guard on its backend: once
	// when the store is built (true: open, the backend unreachable), then
	// each time it opens or closes (redis.Options.OnGuard).
	OnGuard func(open bool)
	// Cache tunes the Redis store's hit cache (redis.Options.Cache); the
	// memory store has no round trip to save and ignores it.
	Cache redis.CacheOptions
}

// Open returns the store rawURL names: Embedded gives a new memory store,
// any other value a Redis store (redis.Open: standalone, Cluster or
// Sentinel URLs; a Redis that does not answer gives a store whose guard is
// open rather than an error). A URL Open cannot use fails it with a
// *redis.URLError, whose text never shows a password.
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

// CheckURL reports, without connecting, whether Open accepts rawURL; when
// not, the error is a *redis.URLError. `tether config validate` calls it,
// so a config file and Open agree on what a store URL is.
func CheckURL(rawURL string) error {
	if rawURL == Embedded {
		return nil
	}
	return redis.CheckURL(rawURL)
}
