package metrics

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/identity"
)

// fakeCounts is the binding store as the trackers see it: one per fleet,
// shared by the replicas' trackers.
type fakeCounts struct {
	mu     sync.Mutex
	counts map[string]int
	err    error
	calls  int
	during func() // runs inside Requests, the tracker's lock released
}

func newFakeCounts() *fakeCounts { return &fakeCounts{counts: map[string]int{}} }

func (f *fakeCounts) Requests(_ context.Context, keys []string, _ time.Time) ([]int, error) {
	f.mu.Lock()
	f.calls++
	during, err := f.during, f.err
	out := make([]int, len(keys))
	for i, k := range keys {
		out[i] = f.counts[k]
	}
	f.mu.Unlock()
	if during != nil {
		during()
	}
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (f *fakeCounts) set(key string, n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if n == 0 {
		delete(f.counts, key)
		return
	}
	f.counts[key] = n
}

func (f *fakeCounts) callCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls
}

var t0 = time.Unix(1_750_000_000, 0)

// replica is one tether replica's tracker with its own registry and clock.
type replica struct {
	t   *testing.T
	reg *prometheus.Registry
	s   *SessionLengths
	now time.Time
}

func newReplica(t *testing.T, store Counts, maxSessions int) *replica {
	r := &replica{t: t, reg: prometheus.NewRegistry(), now: t0}
	r.s = NewSessionLengths(r.reg, store, SessionLengthsOptions{MaxSessions: maxSessions, Now: func() time.Time { return r.now }})
	return r
}

// serve records a request of key with count n at the replica's clock, and
// the store's count with it (the store counted the request).
func (r *replica) serve(store *fakeCounts, key string, n int) {
	store.set(key, n)
	r.s.Seen(key, n, r.now)
}

// at moves the replica's clock to t0+d and sweeps.
func (r *replica) at(d time.Duration) {
	r.t.Helper()
	r.now = t0.Add(d)
	if err := r.s.Sweep(r.t.Context()); err != nil {
		r.t.Fatalf("Sweep at %v: %v", d, err)
	}
}

// observed returns the histogram's count and sum, as scraped.
func (r *replica) observed() (n uint64, sum float64) {
	r.t.Helper()
	mfs, err := r.reg.Gather()
	if err != nil {
		r.t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "tether_session_requests" {
			h := mf.GetMetric()[0].GetHistogram()
			return h.GetSampleCount(), h.GetSampleSum()
		}
	}
	r.t.Fatal("tether_session_requests not registered")
	return 0, 0
}

// gauge returns tether_session_requests_tracked, as scraped.
func (r *replica) gauge() float64 {
	r.t.Helper()
	mfs, err := r.reg.Gather()
	if err != nil {
		r.t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "tether_session_requests_tracked" {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	r.t.Fatal("tether_session_requests_tracked not registered")
	return 0
}

func (r *replica) tracked() int {
	r.t.Helper()
	r.s.mu.Lock()
	defer r.s.mu.Unlock()
	return len(r.s.sessions)
}

func (r *replica) checkObserved(what string, wantN uint64, wantSum float64) {
	r.t.Helper()
	if n, sum := r.observed(); n != wantN || sum != wantSum {
		r.t.Errorf("%s: observed %d sessions, sum %v; want %d, sum %v", what, n, sum, wantN, wantSum)
	}
}

func TestSessionLengthsOneReplica(t *testing.T) {
	store := newFakeCounts()
	r := newReplica(t, store, 0)
	for n := 1; n <= 3; n++ {
		r.now = t0.Add(time.Duration(n) * time.Second)
		r.serve(store, "s:a", n)
	}
	r.at(20 * time.Second) // quiet 17 s: not asked
	if c := store.callCount(); c != 0 {
		t.Errorf("store asked %d times about a session quiet for less than 30 s", c)
	}
	r.at(35 * time.Second) // quiet 32 s: still bound, ours
	r.checkObserved("session live", 0, 0)
	if store.callCount() != 1 || r.tracked() != 1 {
		t.Fatalf("after the first check: %d store calls, %d tracked; want 1, 1", store.callCount(), r.tracked())
	}
	store.set("s:a", 0) // the binding expires
	r.at(50 * time.Second)
	r.checkObserved("rechecked before its time", 0, 0)
	r.at(65 * time.Second) // 30 s after the first check
	r.checkObserved("session ended", 1, 3)
	r.at(5 * time.Minute)
	r.checkObserved("session ended, later sweep", 1, 3)
	if r.tracked() != 0 {
		t.Errorf("%d sessions tracked after the session ended, want 0", r.tracked())
	}
}

func TestSessionLengthsTwoReplicas(t *testing.T) {
	store := newFakeCounts()
	a, b := newReplica(t, store, 0), newReplica(t, store, 0)
	for n := 1; n <= 3; n++ {
		a.now = t0.Add(time.Duration(n) * time.Second)
		a.serve(store, "s:a", n)
	}
	for n := 4; n <= 7; n++ {
		b.now = t0.Add(time.Duration(n+6) * time.Second)
		b.serve(store, "s:a", n)
	}
	var ended bool
	for d := 15 * time.Second; d <= 5*time.Minute; d += 15 * time.Second {
		if d >= 2*time.Minute && !ended {
			store.set("s:a", 0) // the binding expires
			ended = true
		}
		a.at(d)
		b.at(d)
	}
	a.checkObserved("replica a (requests 1-3)", 0, 0)
	b.checkObserved("replica b (requests 4-7)", 1, 7)
	if a.tracked()+b.tracked() != 0 {
		t.Errorf("tracked after the end: a %d, b %d; want 0", a.tracked(), b.tracked())
	}
}

// TestSessionLengthsShortIdleCountsTwice pins the documented limit: a
// binding that expires before the replica that did not serve the last
// request has checked is observed by both.
func TestSessionLengthsShortIdleCountsTwice(t *testing.T) {
	store := newFakeCounts()
	a, b := newReplica(t, store, 0), newReplica(t, store, 0)
	a.serve(store, "s:a", 1)
	b.now = t0.Add(time.Second)
	b.serve(store, "s:a", 2)
	store.set("s:a", 0) // a 5 s idle timeout
	a.at(45 * time.Second)
	b.at(45 * time.Second)
	a.checkObserved("replica a", 1, 1)
	b.checkObserved("replica b", 1, 2)
}

func TestSessionLengthsRechecks(t *testing.T) {
	store := newFakeCounts()
	r := newReplica(t, store, 0)
	r.serve(store, "s:a", 4)
	// A long conversation pause: checked at 30 s, 30 s later, then every
	// minute, never less often.
	var asked []time.Duration
	for d := time.Second; d <= 5*time.Minute; d += time.Second {
		before := store.callCount()
		r.at(d)
		if store.callCount() > before {
			asked = append(asked, d)
		}
	}
	want := []time.Duration{30 * time.Second, time.Minute, 2 * time.Minute, 3 * time.Minute, 4 * time.Minute, 5 * time.Minute}
	if fmt.Sprint(asked) != fmt.Sprint(want) {
		t.Errorf("store asked at %v, want %v", asked, want)
	}
	// A new request resets the wait.
	r.serve(store, "s:a", 5)
	r.at(5*time.Minute + 29*time.Second)
	if n := store.callCount(); n != len(want) {
		t.Errorf("store asked %d times, want %d: a session seen 29 s ago was checked", n, len(want))
	}
	r.checkObserved("live session", 0, 0)
}

func TestSessionLengthsStoreErrorKeepsSessions(t *testing.T) {
	store := newFakeCounts()
	r := newReplica(t, store, 0)
	r.serve(store, "s:a", 2)
	store.set("s:a", 0)
	store.err = errors.New("redis down")
	r.now = t0.Add(time.Minute)
	if err := r.s.Sweep(t.Context()); err == nil {
		t.Fatal("Sweep with a failing store returned no error")
	}
	if got := testutil.ToFloat64(r.s.checkErrors); got != 1 {
		t.Errorf("check errors = %v, want 1", got)
	}
	if r.tracked() != 1 {
		t.Fatalf("%d sessions tracked after a failed check, want 1", r.tracked())
	}
	r.checkObserved("store down", 0, 0)
	store.err = nil
	r.at(time.Minute + 15*time.Second)
	r.checkObserved("store back", 1, 2)

	// A sweep cut short by its context is no store error.
	r.serve(store, "s:b", 1)
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	r.now = r.now.Add(time.Minute)
	if err := r.s.Sweep(ctx); !errors.Is(err, context.Canceled) {
		t.Errorf("Sweep with a cancelled context = %v, want context.Canceled", err)
	}
	if got := testutil.ToFloat64(r.s.checkErrors); got != 1 {
		t.Errorf("check errors = %v after a cancelled sweep, want still 1", got)
	}
}

func TestSessionLengthsCap(t *testing.T) {
	store := newFakeCounts()
	r := newReplica(t, store, 2)
	r.serve(store, "s:a", 1)
	r.serve(store, "s:b", 1)
	r.serve(store, "s:c", 1) // over the cap
	r.serve(store, "s:a", 2) // tracked already
	r.serve(store, "s:d", 1) // over the cap
	if got := testutil.ToFloat64(r.s.untracked); got != 2 {
		t.Errorf("untracked = %v, want 2", got)
	}
	if got := r.gauge(); r.tracked() != 2 || got != 2 {
		t.Errorf("tracked = %d (gauge %v), want 2", r.tracked(), got)
	}
	// Room again once a session ends.
	store.set("s:a", 0)
	r.at(time.Minute)
	r.serve(store, "s:e", 1)
	if got := testutil.ToFloat64(r.s.untracked); got != 2 || r.tracked() != 2 {
		t.Errorf("after an end: untracked %v, tracked %d; want 2, 2", got, r.tracked())
	}
}

func TestSessionLengthsKeyStartsAgain(t *testing.T) {
	store := newFakeCounts()
	r := newReplica(t, store, 0)
	r.serve(store, "s:a", 5)
	r.now = t0.Add(time.Millisecond)
	r.s.Seen("s:a", 4, r.now) // raced the 5th: the same session
	r.checkObserved("a reordered request", 0, 0)
	r.now = t0.Add(20 * time.Second)
	r.serve(store, "s:a", 1) // a 10 s idle timeout: a new session on the key
	r.checkObserved("the key started again", 1, 5)
	r.serve(store, "s:a", 2)
	store.set("s:a", 0)
	r.at(time.Minute)
	r.checkObserved("the second session ended", 2, 7)
	// The store found a newer, shorter session than the one seen here.
	r.serve(store, "s:b", 6)
	store.set("s:b", 1)
	r.at(2 * time.Minute)
	r.checkObserved("a newer binding", 3, 13)
}

// TestSessionLengthsSeenDuringCheck: a request served while the store is
// read makes the session active again; the count read before it must not
// end it.
func TestSessionLengthsSeenDuringCheck(t *testing.T) {
	store := newFakeCounts()
	r := newReplica(t, store, 0)
	r.serve(store, "s:a", 3)
	r.now = t0.Add(time.Minute)
	store.set("s:a", 0) // read as gone...
	store.during = func() { r.s.Seen("s:a", 4, t0.Add(time.Minute)) }
	if err := r.s.Sweep(t.Context()); err != nil {
		t.Fatal(err)
	}
	store.during = nil
	r.checkObserved("a session seen during its check", 0, 0)
	if r.tracked() != 1 {
		t.Errorf("%d tracked, want 1", r.tracked())
	}
}

// TestSessionLengthsManySessions sweeps more sessions than one store call
// and one scan chunk hold while requests keep arriving (run it with -race).
func TestSessionLengthsManySessions(t *testing.T) {
	store := newFakeCounts()
	r := newReplica(t, store, 0)
	const n = 3*scanChunk + 7
	for i := range n {
		r.s.Seen(fmt.Sprint("s:", i), i%5+1, t0) // bindings all gone
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range 20_000 {
			r.s.Seen(fmt.Sprint("live:", i%100), 1, t0.Add(time.Minute))
		}
	}()
	r.now = t0.Add(time.Minute)
	if err := r.s.Sweep(t.Context()); err != nil {
		t.Fatal(err)
	}
	<-done
	got, _ := r.observed()
	if got != n {
		t.Errorf("observed %d sessions, want %d", got, n)
	}
	if calls, want := store.callCount(), (n+checkBatch-1)/checkBatch; calls != want {
		t.Errorf("%d store calls, want %d", calls, want)
	}
	if r.tracked() != 100 {
		t.Errorf("%d tracked, want the 100 live sessions", r.tracked())
	}
}

func TestSessionLengthsSeenDoesNotAllocate(t *testing.T) {
	r := newReplica(t, newFakeCounts(), 0)
	key := "s:0123456789abcdefghijkl"
	r.s.Seen(key, 1, t0)
	n := 1
	if allocs := testing.AllocsPerRun(1000, func() { n++; r.s.Seen(key, n, t0) }); allocs != 0 {
		t.Errorf("Seen of a tracked session allocates %v times, want 0", allocs)
	}
}

func TestMetricsFeedSessionLengths(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg)
	s := NewSessionLengths(reg, newFakeCounts(), SessionLengthsOptions{})
	id := identity.Identity{Key: "s:alias", Source: identity.SourceSession}
	m.Decision(id, affinity.Decision{Kind: affinity.KindHit}, time.Millisecond) // not tracked yet
	m.TrackSessions(s)
	m.Decision(id, affinity.Decision{Kind: affinity.KindHit, Key: "s:session", Requests: 2}, time.Millisecond)
	m.Decision(id, affinity.Decision{Kind: affinity.KindDegraded}, time.Millisecond) // no count
	s.mu.Lock()
	defer s.mu.Unlock()
	if e, ok := s.sessions["s:session"]; len(s.sessions) != 1 || !ok || e.max != 2 {
		t.Errorf("tracked %v, want s:session (the binding's key, not the request's) at 2", s.sessions)
	}
}

func TestSessionLengthsRunStops(t *testing.T) {
	s := NewSessionLengths(prometheus.NewRegistry(), newFakeCounts(), SessionLengthsOptions{})
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); s.Run(ctx) }()
	cancel()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not stop with its context")
	}
}
