// Package memory is the in-process binding store. It implements every store
// interface of affinity (store.go), the instance circuits included, in
// mutex-guarded maps. redis.url = "embedded" opens it (store.Open). It
// serves a single tether process, the local stack, and unit tests of the
// decision core. Nothing is persisted or shared with other replicas.
//
// The store has no clock of its own. "now" is l.Candidate.Since in
// GetOrBind, next.Since in Replace, and the now argument in Show, Mark and
// SyncLoad. So tests drive time by choosing those values, and the store
// behaves exactly as the caller's clock says. Expired bindings and alias
// links are removed lazily, and by an amortised sweep on the call path.
// There is no background goroutine to stop. The circuits follow the Redis
// store's scripts (store/redis circuits.go) step for step.
//
// This store is exact, unlike the Redis store. A session is counted while
// its binding lives, and every request links its aliases. The Redis store's
// session index may count a session for a while after it ends. It links a
// request's aliases only when the session's refresh is due.
package memory

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/replicas"
)

const (
	// sampleEvery and sampleSize bound the incremental sweep. Every
	// sampleEvery calls, it looks at up to sampleSize entries of each map.
	// Go map iteration starts at a random point, so successive samples
	// cover the map.
	sampleEvery = 64
	sampleSize  = 128
	// minFullSweep is the smallest size, bindings plus links, that triggers
	// a full sweep. After one, the next runs when the size has doubled. So
	// a sweep costs O(1) amortised per insert, and the maps stay within
	// about twice the live set.
	minFullSweep = 1024
)

var (
	_ replicas.LoadSyncer = (*Store)(nil)
	_ replicas.Circuits   = (*Store)(nil)
)

// ErrClosed is the error of a call after Close.
var ErrClosed = errors.New("memory store closed")

type entry struct {
	b        bindings.Binding
	move     bindings.Move
	expires  time.Time // lastUse + Idle of the last call that touched it
	lastUse  time.Time
	requests int // the session's request count (Result.Requests)
}

// link is an alias: a weaker key that leads to a session key.
type link struct {
	to      string
	expires time.Time
}

type report struct {
	load    fleet.LoadReport
	expires time.Time
}

type lease struct {
	holder  string
	expires time.Time
}

// Store is a mutex-protected set of maps. The zero value is not usable;
// call New.
type Store struct {
	mu       sync.Mutex
	bindings map[string]entry
	links    map[string]link
	index    map[string]map[string]struct{} // instance → session keys bound to it
	// expiry holds, for every binding, an item at its expiry time. It also
	// holds stale items of older expiry times and dropped bindings. With it
	// SyncLoad counts the live sessions of an instance without visiting
	// them. It drops the expired bindings first, then counts the index.
	expiry  expiryHeap
	reports map[string]report // replica → its last load report
	drained map[string]bool
	leases  map[string]lease
	// The instance circuits: an instance's recent failures (member → when),
	// and the end of the cooldown of each circuit that is not closed.
	failures map[string]map[string]time.Time
	circuits map[string]time.Time
	closed   bool
	since    time.Time // when New ran, for Health

	calls     int
	nextSweep int // size that triggers the next full sweep
}

// New returns an empty store.
func New() *Store {
	return &Store{
		bindings:  map[string]entry{},
		links:     map[string]link{},
		index:     map[string]map[string]struct{}{},
		reports:   map[string]report{},
		drained:   map[string]bool{},
		leases:    map[string]lease{},
		failures:  map[string]map[string]time.Time{},
		circuits:  map[string]time.Time{},
		since:     time.Now(),
		nextSweep: minFullSweep,
	}
}

// lock takes s.mu and fails when ctx is done or the store is closed; on
// success the caller unlocks.
func (s *Store) lock(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return ErrClosed
	}
	return nil
}

// Len is the number of bindings and alias links held, expired or not; for
// tests.
func (s *Store) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.bindings) + len(s.links)
}

// GetOrBind implements affinity.Store.
func (s *Store) GetOrBind(ctx context.Context, l bindings.Lookup) (bindings.Result, error) {
	if err := bindings.CheckBinding(l.Candidate, l.Lifetime); err != nil {
		return bindings.Result{}, fmt.Errorf("memory get-or-bind: %w", err)
	}
	now, idle := l.Candidate.Since, l.Lifetime.Idle
	if err := s.lock(ctx); err != nil {
		return bindings.Result{}, fmt.Errorf("memory get-or-bind: %w", err)
	}
	defer s.mu.Unlock()
	s.housekeep(now)

	// One hop: l.Key may lead to the session key; that key's own link, if
	// any, is not followed.
	key := l.Key
	if ln, ok := s.links[l.Key]; ok && now.Before(ln.expires) {
		ln.expires = now.Add(idle) // the link is in use
		s.links[l.Key] = ln
		key = ln.to
	}
	res := bindings.Result{Key: key, Origin: bindings.Created}
	e, ok := s.live(key, now)
	switch {
	case ok && (l.Lifetime.Max == 0 || now.Sub(e.b.Since) < l.Lifetime.Max):
		res.Idle = max(now.Sub(e.lastUse), 0)
		e.expires, e.lastUse = now.Add(idle), now
		e.requests++
		s.bindings[key] = e
		s.expireAt(key, e.expires)
		res.Binding, res.Origin, res.Move, res.Requests = e.b, bindings.Found, e.move, e.requests
	case ok:
		// The same conversation placed again: it keeps counting.
		res.Origin, res.Previous, res.Requests = bindings.Renewed, e.b, e.requests+1
		s.put(key, entry{b: l.Candidate, expires: now.Add(idle), lastUse: now, requests: res.Requests})
		res.Binding = l.Candidate
	default:
		res.Requests = 1
		s.put(key, entry{b: l.Candidate, expires: now.Add(idle), lastUse: now, requests: 1})
		res.Binding = l.Candidate
	}
	for _, a := range l.Aliases {
		if a != "" && a != key {
			s.links[a] = link{to: key, expires: now.Add(idle)}
		}
	}
	return res, nil
}

// Peek implements affinity.Peeker: the binding GetOrBind would find, by
// the same rules, without counting a request.
func (s *Store) Peek(key string, now time.Time, lt bindings.Lifetime) (bindings.Binding, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ln, ok := s.links[key]; ok && now.Before(ln.expires) {
		key = ln.to
	}
	e, ok := s.live(key, now)
	if !ok || (lt.Max > 0 && now.Sub(e.b.Since) >= lt.Max) {
		return bindings.Binding{}, false
	}
	return e.b, true
}

// Replace implements affinity.Store.
func (s *Store) Replace(ctx context.Context, key, old string, next bindings.Binding, lt bindings.Lifetime) (bindings.Binding, error) {
	if err := bindings.CheckBinding(next, lt); err != nil {
		return bindings.Binding{}, fmt.Errorf("memory replace: %w", err)
	}
	now := next.Since
	if err := s.lock(ctx); err != nil {
		return bindings.Binding{}, fmt.Errorf("memory replace: %w", err)
	}
	defer s.mu.Unlock()
	s.housekeep(now)

	e, ok := s.live(key, now)
	if ok && e.b.Instance != old {
		// Someone else moved it first: keep theirs, count this as a use.
		e.expires, e.lastUse = now.Add(lt.Idle), now
		s.bindings[key] = e
		s.expireAt(key, e.expires)
		return e.b, nil
	}
	// No pending move; the same session, so the same count (0 when there
	// was no binding).
	n := 0
	if ok {
		n = e.requests
	}
	s.put(key, entry{b: next, expires: now.Add(lt.Idle), lastUse: now, requests: n})
	return next, nil
}

// Show implements admin.SessionIndex. It does not refresh anything.
func (s *Store) Show(ctx context.Context, key string, now time.Time) (bindings.Session, bool, error) {
	if err := s.lock(ctx); err != nil {
		return bindings.Session{}, false, fmt.Errorf("memory show: %w", err)
	}
	defer s.mu.Unlock()
	if ln, ok := s.links[key]; ok && now.Before(ln.expires) {
		key = ln.to
	}
	e, ok := s.live(key, now)
	if !ok {
		return bindings.Session{}, false, nil
	}
	return bindings.Session{Key: key, Binding: e.b, Move: e.move, TTL: e.expires.Sub(now)}, true, nil
}

// Mark implements admin.SessionIndex. Sessions are visited in key order.
func (s *Store) Mark(ctx context.Context, f bindings.MarkFilter, m bindings.Move, now time.Time) (marked, remaining int, err error) {
	if err := bindings.CheckMark(f, m); err != nil {
		return 0, 0, fmt.Errorf("memory mark: %w", err)
	}
	if err := s.lock(ctx); err != nil {
		return 0, 0, fmt.Errorf("memory mark: %w", err)
	}
	defer s.mu.Unlock()
	for _, key := range slices.Sorted(maps.Keys(s.index[f.Instance])) {
		e, ok := s.live(key, now)
		switch {
		case !ok || e.b.Instance != f.Instance:
			delete(s.index[f.Instance], key)
		case f.Version != "" && e.b.Version != f.Version, e.move.Pending():
			// Not selected, or already asked to move.
		case f.Limit == 0 || marked < f.Limit:
			e.move = m
			s.bindings[key] = e
			marked++
		default:
			remaining++
		}
	}
	return marked, remaining, nil
}

// Bound implements admin.SessionIndex. Sessions come in key order.
func (s *Store) Bound(ctx context.Context, instance string, limit int, now time.Time) ([]bindings.Session, error) {
	if err := bindings.CheckBound(instance, limit); err != nil {
		return nil, fmt.Errorf("memory bound: %w", err)
	}
	if err := s.lock(ctx); err != nil {
		return nil, fmt.Errorf("memory bound: %w", err)
	}
	defer s.mu.Unlock()
	var out []bindings.Session
	for _, key := range slices.Sorted(maps.Keys(s.index[instance])) {
		e, ok := s.live(key, now)
		if !ok || e.b.Instance != instance {
			continue
		}
		if limit > 0 && len(out) == limit {
			break
		}
		out = append(out, bindings.Session{Key: key, Binding: e.b, Move: e.move, TTL: e.expires.Sub(now)})
	}
	return out, nil
}

// Requests returns the request count of each session key's live binding
// at now. A key without one gives 0. keys are session keys. An alias link
// is not followed.
func (s *Store) Requests(ctx context.Context, keys []string, now time.Time) ([]int, error) {
	if err := s.lock(ctx); err != nil {
		return nil, fmt.Errorf("memory requests: %w", err)
	}
	defer s.mu.Unlock()
	out := make([]int, len(keys))
	for i, k := range keys {
		if e, ok := s.live(k, now); ok {
			out[i] = e.requests
		}
	}
	return out, nil
}

// SyncLoad implements replicas.LoadSyncer. fleet.MergeLoad merges the
// reports, as in the Redis store.
func (s *Store) SyncLoad(ctx context.Context, r fleet.LoadReport, instances []string, ttl time.Duration, now time.Time) (fleet.LoadState, error) {
	if err := replicas.CheckReport(r, ttl); err != nil {
		return fleet.LoadState{}, fmt.Errorf("memory sync load: %w", err)
	}
	if err := s.lock(ctx); err != nil {
		return fleet.LoadState{}, fmt.Errorf("memory sync load: %w", err)
	}
	defer s.mu.Unlock()
	s.reports[r.Replica] = report{load: fleet.LoadReport{Replica: r.Replica, InFlight: maps.Clone(r.InFlight), Queue: maps.Clone(r.Queue), Engine: maps.Clone(r.Engine)}, expires: now.Add(ttl)}
	maps.DeleteFunc(s.reports, func(_ string, rep report) bool { return !now.Before(rep.expires) })

	s.expire(now)
	reports := make([]fleet.LoadReport, 0, len(s.reports))
	for _, rep := range s.reports {
		reports = append(reports, rep.load)
	}
	st := fleet.MergeLoad(r.Replica, instances, reports)
	for _, in := range instances {
		st.Active[in] = s.active(in)
	}
	maps.Copy(st.Drained, s.drained)
	return st, nil
}

// Lease implements replicas.Leases.
func (s *Store) Lease(ctx context.Context, name, holder string, ttl time.Duration, now time.Time) (bool, error) {
	if err := replicas.CheckLease(name, holder, ttl); err != nil {
		return false, fmt.Errorf("memory lease: %w", err)
	}
	if err := s.lock(ctx); err != nil {
		return false, fmt.Errorf("memory lease: %w", err)
	}
	defer s.mu.Unlock()
	if l, ok := s.leases[name]; ok && l.holder != holder && now.Before(l.expires) {
		return false, nil
	}
	s.leases[name] = lease{holder: holder, expires: now.Add(ttl)}
	return true, nil
}

// Release implements replicas.Leases.
func (s *Store) Release(ctx context.Context, name, holder string) error {
	if err := replicas.CheckLease(name, holder, time.Second); err != nil {
		return fmt.Errorf("memory release: %w", err)
	}
	if err := s.lock(ctx); err != nil {
		return fmt.Errorf("memory release: %w", err)
	}
	defer s.mu.Unlock()
	if l, ok := s.leases[name]; ok && l.holder == holder {
		delete(s.leases, name)
	}
	return nil
}

// SetDrained implements replicas.LoadSyncer.
func (s *Store) SetDrained(ctx context.Context, instance string, drained bool) error {
	if instance == "" {
		return errors.New("memory set drained: empty instance name")
	}
	if err := s.lock(ctx); err != nil {
		return fmt.Errorf("memory set drained: %w", err)
	}
	defer s.mu.Unlock()
	if drained {
		s.drained[instance] = true
	} else {
		delete(s.drained, instance)
	}
	return nil
}

// ReportFailure implements replicas.Circuits, as store/redis's script
// does. A failure while the circuit is open is not counted. One while it
// is half-open opens it again. Otherwise it joins the window, the failures
// of the last cfg.Window. The circuit opens when the window holds more than
// cfg.Threshold.
func (s *Store) ReportFailure(ctx context.Context, instance string, at time.Time, member string, cfg fleet.BreakerConfig) (opened bool, until time.Time, err error) {
	if err := replicas.CheckFailure(instance, member, cfg); err != nil {
		return false, time.Time{}, fmt.Errorf("memory report failure: %w", err)
	}
	if err := s.lock(ctx); err != nil {
		return false, time.Time{}, fmt.Errorf("memory report failure: %w", err)
	}
	defer s.mu.Unlock()
	// Redis keeps times in milliseconds; so does this store, so that both
	// answer the same cooldown end.
	at = at.Truncate(time.Millisecond)
	open := func() (bool, time.Time, error) {
		until := at.Add(cfg.Cooldown)
		s.circuits[instance] = until
		delete(s.failures, instance)
		return true, until, nil
	}
	if till, ok := s.circuits[instance]; ok {
		if till.After(at) {
			return false, till, nil
		}
		return open()
	}
	fs := s.failures[instance]
	if fs == nil {
		fs = map[string]time.Time{}
		s.failures[instance] = fs
	}
	fs[member] = at
	oldest := at.Add(-cfg.Window)
	maps.DeleteFunc(fs, func(_ string, t time.Time) bool { return !t.After(oldest) })
	if len(fs) > cfg.Threshold {
		return open()
	}
	return false, time.Time{}, nil
}

// ReportRecovered implements replicas.Circuits.
func (s *Store) ReportRecovered(ctx context.Context, instance string, at time.Time) (bool, error) {
	if instance == "" {
		return false, errors.New("memory report recovered: empty instance")
	}
	if err := s.lock(ctx); err != nil {
		return false, fmt.Errorf("memory report recovered: %w", err)
	}
	defer s.mu.Unlock()
	till, ok := s.circuits[instance]
	if !ok || till.After(at) {
		return false, nil
	}
	delete(s.circuits, instance)
	delete(s.failures, instance)
	return true, nil
}

// Circuits implements replicas.Circuits; it deletes the stale circuits.
func (s *Store) Circuits(ctx context.Context, now time.Time) (map[string]time.Time, error) {
	if err := s.lock(ctx); err != nil {
		return nil, fmt.Errorf("memory circuits: %w", err)
	}
	defer s.mu.Unlock()
	maps.DeleteFunc(s.circuits, func(_ string, until time.Time) bool { return now.Sub(until) > replicas.StaleCircuit })
	return maps.Clone(s.circuits), nil
}

// Ping implements admin.Checker: the store is in the process, so it
// answers unless it is closed.
func (s *Store) Ping(ctx context.Context) error {
	if err := s.lock(ctx); err != nil {
		return fmt.Errorf("memory ping: %w", err)
	}
	s.mu.Unlock()
	return nil
}

// Health implements admin.Checker: there is no backend to lose, so the
// guard is always closed.
func (s *Store) Health() bindings.Health {
	return bindings.Health{State: bindings.GuardClosed, Since: s.since}
}

// Close drops what the store holds; calls after it fail with ErrClosed.
// Close is idempotent.
func (s *Store) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	s.bindings, s.links, s.index, s.reports, s.expiry = nil, nil, nil, nil, nil
	s.drained, s.failures, s.circuits = nil, nil, nil
	return nil
}

// live returns key's binding when it has not expired at now. Called with
// s.mu held.
func (s *Store) live(key string, now time.Time) (entry, bool) {
	e, ok := s.bindings[key]
	return e, ok && now.Before(e.expires)
}

// put stores e under key and moves the key to e's instance index. Called
// with s.mu held.
func (s *Store) put(key string, e entry) {
	if old, ok := s.bindings[key]; ok && old.b.Instance != e.b.Instance {
		delete(s.index[old.b.Instance], key)
	}
	s.bindings[key] = e
	s.expireAt(key, e.expires)
	idx := s.index[e.b.Instance]
	if idx == nil {
		idx = map[string]struct{}{}
		s.index[e.b.Instance] = idx
	}
	idx[key] = struct{}{}
}

// drop removes key's binding and its index entry. Called with s.mu held.
func (s *Store) drop(key string) {
	if e, ok := s.bindings[key]; ok {
		delete(s.index[e.b.Instance], key)
		delete(s.bindings, key)
	}
}

// active counts the live sessions in instance's index. It is called with
// s.mu held, after s.expire(now). So every binding left is live at now. The
// index holds only bindings to its instance (put, drop). So the count is
// the index's size.
func (s *Store) active(instance string) int {
	n := len(s.index[instance])
	if n == 0 {
		delete(s.index, instance)
	}
	return n
}

// expireAt records that key's binding expires at t. It is called with s.mu
// held, whenever a binding's expiry is set. When stale items outnumber the
// bindings, the heap is rebuilt from them. That is amortised O(1) per call.
func (s *Store) expireAt(key string, t time.Time) {
	heap.Push(&s.expiry, expiryItem{at: t, key: key})
	if len(s.expiry) > 2*len(s.bindings)+minFullSweep {
		s.expiry = s.expiry[:0]
		for k, e := range s.bindings {
			s.expiry = append(s.expiry, expiryItem{at: e.expires, key: k})
		}
		heap.Init(&s.expiry)
	}
}

// expire drops every binding expired at now. Called with s.mu held.
func (s *Store) expire(now time.Time) {
	for len(s.expiry) > 0 && !now.Before(s.expiry[0].at) {
		it := heap.Pop(&s.expiry).(expiryItem)
		if e, ok := s.bindings[it.key]; ok && e.expires.Equal(it.at) {
			s.drop(it.key)
		}
	}
}

type expiryItem struct {
	at  time.Time
	key string
}

// expiryHeap is a min-heap of expiry items by time (container/heap).
type expiryHeap []expiryItem

func (h expiryHeap) Len() int           { return len(h) }
func (h expiryHeap) Less(i, j int) bool { return h[i].at.Before(h[j].at) }
func (h expiryHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *expiryHeap) Push(x any)        { *h = append(*h, x.(expiryItem)) }
func (h *expiryHeap) Pop() any {
	old := *h
	it := old[len(old)-1]
	*h = old[:len(old)-1]
	return it
}

// housekeep runs the amortised sweep of bindings and links. Called with
// s.mu held.
func (s *Store) housekeep(now time.Time) {
	s.calls++
	full := len(s.bindings)+len(s.links) >= s.nextSweep
	if !full && s.calls%sampleEvery != 0 {
		return
	}
	limit := sampleSize
	if full {
		limit = -1
	}
	n := 0
	for k, e := range s.bindings {
		if !now.Before(e.expires) {
			s.drop(k)
		}
		if n++; n == limit {
			break
		}
	}
	n = 0
	for k, ln := range s.links {
		if !now.Before(ln.expires) {
			delete(s.links, k)
		}
		if n++; n == limit {
			break
		}
	}
	if full {
		s.nextSweep = max(2*(len(s.bindings)+len(s.links)), minFullSweep)
	}
}

// PublishContent implements replicas.ContentBus: a process has one prefix
// index, and the memory store no other replica to share it with, so it
// sends nothing.
func (s *Store) PublishContent(context.Context, []byte) error { return nil }

// SubscribeContent implements replicas.ContentBus: nothing is ever
// published to it, so it waits for ctx to end.
func (s *Store) SubscribeContent(ctx context.Context, _ func([]byte)) { <-ctx.Done() }
