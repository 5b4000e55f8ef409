// Package memory is an in-process affinity.Store for unit tests and for a
// single tether process that runs without Redis.
//
// The store has no clock of its own: "now" is candidate.Since (GetOrBind) or
// next.Since (Replace), so tests drive time by choosing those values and the
// store behaves exactly like the caller's clock says. Expired entries are
// removed lazily and by an amortised sweep on the call path; there is no
// background goroutine to stop.
package memory

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/tetherproxy/tether/affinity"
)

const (
	// sampleEvery and sampleSize bound the incremental sweep: every
	// sampleEvery calls, look at up to sampleSize entries (Go map iteration
	// starts at a random point, so successive samples cover the map).
	sampleEvery = 64
	sampleSize  = 128
	// minFullSweep is the smallest map size that triggers a full sweep; after
	// one, the next runs when the map has doubled, so a sweep costs O(1)
	// amortised per insert and the map stays within about twice the live set.
	minFullSweep = 1024
)

var _ affinity.Store = (*Store)(nil)

type entry struct {
	b       affinity.Binding
	expires time.Time // lastUse + Idle of the last call that touched it
}

// Store is a mutex-protected map of bindings. The zero value is not usable;
// call New.
type Store struct {
	mu        sync.Mutex
	m         map[string]entry
	calls     int
	nextSweep int // map size that triggers the next full sweep
}

// New returns an empty store.
func New() *Store {
	return &Store{m: make(map[string]entry), nextSweep: minFullSweep}
}

// Len is the number of entries held, expired or not; for tests.
func (s *Store) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.m)
}

// GetOrBind implements affinity.Store.
func (s *Store) GetOrBind(ctx context.Context, key string, candidate affinity.Binding, lt affinity.Lifetime) (affinity.Binding, affinity.Outcome, error) {
	if err := affinity.CheckBinding(candidate, lt); err != nil {
		return affinity.Binding{}, 0, fmt.Errorf("memory get-or-bind: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return affinity.Binding{}, 0, fmt.Errorf("memory get-or-bind: %w", err)
	}
	now := candidate.Since
	s.mu.Lock()
	defer s.mu.Unlock()
	s.housekeep(now)

	e, ok := s.m[key]
	out := affinity.Created
	switch {
	case ok && now.Before(e.expires) && (lt.Max == 0 || now.Sub(e.b.Since) < lt.Max):
		e.expires = now.Add(lt.Idle)
		s.m[key] = e
		return e.b, affinity.Found, nil
	case ok && now.Before(e.expires):
		out = affinity.Renewed
	}
	s.m[key] = entry{b: candidate, expires: now.Add(lt.Idle)}
	return candidate, out, nil
}

// Replace implements affinity.Store.
func (s *Store) Replace(ctx context.Context, key, old string, next affinity.Binding, lt affinity.Lifetime) (affinity.Binding, error) {
	if err := affinity.CheckBinding(next, lt); err != nil {
		return affinity.Binding{}, fmt.Errorf("memory replace: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return affinity.Binding{}, fmt.Errorf("memory replace: %w", err)
	}
	now := next.Since
	s.mu.Lock()
	defer s.mu.Unlock()
	s.housekeep(now)

	e, ok := s.m[key]
	if ok && now.Before(e.expires) && e.b.Instance != old {
		// Someone else moved it first: keep theirs, count this as a use.
		e.expires = now.Add(lt.Idle)
		s.m[key] = e
		return e.b, nil
	}
	s.m[key] = entry{b: next, expires: now.Add(lt.Idle)}
	return next, nil
}

// housekeep runs the amortised sweep. Called with s.mu held.
func (s *Store) housekeep(now time.Time) {
	s.calls++
	if len(s.m) >= s.nextSweep {
		for k, e := range s.m {
			if !now.Before(e.expires) {
				delete(s.m, k)
			}
		}
		s.nextSweep = max(2*len(s.m), minFullSweep)
		return
	}
	if s.calls%sampleEvery != 0 {
		return
	}
	n := 0
	for k, e := range s.m {
		if !now.Before(e.expires) {
			delete(s.m, k)
		}
		if n++; n >= sampleSize {
			break
		}
	}
}
