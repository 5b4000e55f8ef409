// Package storetest is the conformance suite every store must pass.
// store/memory and store/redis run the same cases. So these mean the same
// thing whichever store is wired: "two tether replicas agree", the lifetime
// rules, aliases, the session index, the load exchange, the request counts
// and the instance circuits.
package storetest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/replicas"
)

// Store is what the suite tests: the hot path, the session index, the
// load exchange, the reading of request counts and the instance circuits.
type Store interface {
	affinity.Store
	replicas.LoadSyncer
	replicas.Circuits
	replicas.Leases
	// The session index (admin.SessionIndex).
	Show(ctx context.Context, key string, now time.Time) (s bindings.Session, ok bool, err error)
	Mark(ctx context.Context, f bindings.MarkFilter, m bindings.Move, now time.Time) (marked, remaining int, err error)
	Bound(ctx context.Context, instance string, limit int, now time.Time) ([]bindings.Session, error)
	// The request counts (metrics.Counts).
	Requests(ctx context.Context, keys []string, now time.Time) ([]int, error)
}

// Harness tells Run how to make a store and how to move its clock.
type Harness struct {
	// New returns an empty store for one case. Cases run in parallel. So
	// stores returned for different t must not share state. On a shared
	// server, give each its own key prefix. They must not share expiry
	// clocks either. A shared server is fine when Advance only waits.
	New func(t *testing.T) Store
	// Advance lets d pass on the store's own expiry clock. It is
	// FastForward for miniredis. It is nothing for a store that reads "now"
	// from its arguments. It is a real wait for a real server.
	Advance func(t *testing.T, d time.Duration)
	// Idle is the idle timeout the expiry cases use. 0 means one minute. A
	// harness whose Advance really waits sets it small, a few seconds. The
	// cases keep margins of Idle/4 to Idle/2 on the store's expiry clock,
	// which must hold on a loaded machine. Cases run in parallel, so a
	// larger Idle adds little to the suite's time.
	Idle time.Duration
	// Peeks says the store's Peek (affinity.Peeker) must find a session
	// GetOrBind finds: the memory store, and the Redis store with its hit
	// cache. Without it a store may always say it cannot tell.
	Peeks bool
}

// start is the suite's first "now": a whole millisecond, because the Redis
// store keeps Since with millisecond precision.
var start = time.UnixMilli(1_750_000_000_000)

const (
	races = 32
	// reportTTL is long against any real wait, so reports expire only when
	// a case moves its own clock past it.
	reportTTL = time.Minute
)

// env is one case's view: its store, its clock and its key namespace.
type env struct {
	t     *testing.T
	h     Harness
	s     Store
	now   time.Time
	idle  time.Duration
	ctx   context.Context
	space string
	seq   int // makes failure report members unique
	// breaker is the instance breaker the circuit cases report with.
	breaker fleet.BreakerConfig
}

// key namespaces keys by case, so cases sharing one server never collide.
func (e *env) key(name string) string { return e.space + "/" + name }

// advance moves the caller's clock and the store's clock together.
func (e *env) advance(d time.Duration) {
	e.t.Helper()
	e.now = e.now.Add(d)
	e.h.Advance(e.t, d)
}

// skew moves only the caller's clock. It moves it by less than the idle
// timeout, or in Max cases that run with an hour of Idle. So the store's
// own expiry clock cannot change the outcome.
func (e *env) skew(d time.Duration) { e.now = e.now.Add(d) }

func (e *env) lt() bindings.Lifetime { return bindings.Lifetime{Idle: e.idle} }

func (e *env) bind(instance string) bindings.Binding {
	return bindings.Binding{Instance: instance, Since: e.now}
}

func (e *env) bindv(instance, version string) bindings.Binding {
	return bindings.Binding{Instance: instance, Version: version, Since: e.now}
}

// look is a Lookup of key with candidate and aliases, with the case's
// lifetime.
func (e *env) look(key string, candidate bindings.Binding, aliases ...string) bindings.Lookup {
	return bindings.Lookup{Key: key, Aliases: aliases, Candidate: candidate, Lifetime: e.lt()}
}

// lookup calls GetOrBind and checks the whole result but its request
// count (the count cases check that).
func (e *env) lookup(l bindings.Lookup, want bindings.Result) {
	e.t.Helper()
	got, err := e.s.GetOrBind(e.ctx, l)
	if err != nil {
		e.t.Fatalf("GetOrBind(%q, %s): %v", l.Key, l.Candidate.Instance, err)
	}
	if diff := cmp.Diff(want, got, cmpopts.IgnoreFields(bindings.Result{}, "Requests", "Idle")); diff != "" {
		e.t.Errorf("GetOrBind(%q, aliases %q, %s) (-want +got):\n%s", l.Key, l.Aliases, l.Candidate.Instance, diff)
	}
}

// count calls GetOrBind and checks the outcome, the session key and the
// request count.
func (e *env) count(l bindings.Lookup, wantKey string, wantOut bindings.Origin, wantRequests int) {
	e.t.Helper()
	got, err := e.s.GetOrBind(e.ctx, l)
	if err != nil {
		e.t.Fatalf("GetOrBind(%q, %s): %v", l.Key, l.Candidate.Instance, err)
	}
	if got.Key != wantKey || got.Origin != wantOut || got.Requests != wantRequests {
		e.t.Errorf("GetOrBind(%q) = key %q, %v, %d requests; want key %q, %v, %d requests",
			l.Key, got.Key, got.Origin, got.Requests, wantKey, wantOut, wantRequests)
	}
}

// requests calls Requests and checks the counts.
func (e *env) requests(keys []string, want []int) {
	e.t.Helper()
	got, err := e.s.Requests(e.ctx, keys, e.now)
	if err != nil {
		e.t.Fatalf("Requests(%q): %v", keys, err)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		e.t.Errorf("Requests(%q) (-want +got):\n%s", keys, diff)
	}
}

// getOrBind calls GetOrBind on a key without aliases and checks the
// binding and outcome (and that the result is key's own, without a move).
func (e *env) getOrBind(key string, candidate bindings.Binding, lt bindings.Lifetime, want bindings.Binding, wantOut bindings.Origin) {
	e.t.Helper()
	l := bindings.Lookup{Key: key, Candidate: candidate, Lifetime: lt}
	e.lookup(l, bindings.Result{Key: key, Binding: want, Origin: wantOut})
}

// renew calls GetOrBind on a key without aliases that must be renewed:
// candidate stored, prev the binding it replaced.
func (e *env) renew(key string, candidate bindings.Binding, lt bindings.Lifetime, prev bindings.Binding) {
	e.t.Helper()
	l := bindings.Lookup{Key: key, Candidate: candidate, Lifetime: lt}
	e.lookup(l, bindings.Result{Key: key, Binding: candidate, Origin: bindings.Renewed, Previous: prev})
}

// replace calls Replace and checks the binding it returns.
func (e *env) replace(key, old string, next bindings.Binding, want bindings.Binding) {
	e.t.Helper()
	got, err := e.s.Replace(e.ctx, key, old, next, e.lt())
	if err != nil {
		e.t.Fatalf("Replace(%q, %s -> %s): %v", key, old, next.Instance, err)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		e.t.Errorf("Replace(%q, %s -> %s) binding (-want +got):\n%s", key, old, next.Instance, diff)
	}
}

// show calls Show and checks the session, all but its TTL, which must be
// in (0, idle].
func (e *env) show(key string, want bindings.Session, wantOK bool) {
	e.t.Helper()
	got, ok, err := e.s.Show(e.ctx, key, e.now)
	if err != nil {
		e.t.Fatalf("Show(%q): %v", key, err)
	}
	if ok != wantOK {
		e.t.Fatalf("Show(%q) ok = %v, want %v (session %+v)", key, ok, wantOK, got)
	}
	if !ok {
		return
	}
	if got.TTL <= 0 || got.TTL > e.idle {
		e.t.Errorf("Show(%q) TTL = %v, want in (0, %v]", key, got.TTL, e.idle)
	}
	got.TTL, want.TTL = 0, 0
	if diff := cmp.Diff(want, got); diff != "" {
		e.t.Errorf("Show(%q) (-want +got):\n%s", key, diff)
	}
}

// mark calls Mark and checks its counts.
func (e *env) mark(f bindings.MarkFilter, m bindings.Move, wantMarked, wantRemaining int) {
	e.t.Helper()
	marked, remaining, err := e.s.Mark(e.ctx, f, m, e.now)
	if err != nil {
		e.t.Fatalf("Mark(%+v, %+v): %v", f, m, err)
	}
	if marked != wantMarked || remaining != wantRemaining {
		e.t.Errorf("Mark(%+v, %+v) = %d marked, %d remaining; want %d, %d", f, m, marked, remaining, wantMarked, wantRemaining)
	}
}

// sync publishes a report for replica and returns the load of instances.
func (e *env) sync(replica string, inFlight, queue map[string]int, instances ...string) fleet.LoadState {
	e.t.Helper()
	st, err := e.s.SyncLoad(e.ctx, fleet.LoadReport{Replica: replica, InFlight: inFlight, Queue: queue}, instances, reportTTL, e.now)
	if err != nil {
		e.t.Fatalf("SyncLoad(%s): %v", replica, err)
	}
	if st.Active == nil || st.InFlight == nil || st.Queue == nil || st.Drained == nil {
		e.t.Fatalf("SyncLoad(%s) = %+v: a nil map", replica, st)
	}
	return st
}

// active returns the active sessions of instances, as an observer replica
// with an empty report sees them.
func (e *env) active(instances ...string) map[string]int {
	e.t.Helper()
	return e.sync("observer", nil, nil, instances...).Active
}

// checkActive checks the active sessions of want's instances.
func (e *env) checkActive(want map[string]int) {
	e.t.Helper()
	var instances []string
	for in := range want {
		instances = append(instances, in)
	}
	if diff := cmp.Diff(want, e.active(instances...)); diff != "" {
		e.t.Errorf("active sessions (-want +got):\n%s", diff)
	}
}

type testCase struct {
	name string
	run  func(e *env)
}

var cases = []testCase{
	{"a peek finds what get-or-bind finds, and counts nothing", func(e *env) {
		p, ok := e.s.(affinity.Peeker)
		if !ok {
			e.t.Skip("the store does not peek")
		}
		k := e.key("k")
		if got, ok := p.Peek(k, e.now, e.lt()); ok {
			e.t.Errorf("Peek of an unbound key = %+v, want nothing", got)
		}
		a := e.bind("a")
		e.getOrBind(k, a, e.lt(), a, bindings.Created)
		e.skew(e.idle / 10)
		// A store may need a request or two before its memory holds the
		// session (a cache fills as Redis answers); one that must peek is
		// given a few seconds to.
		var res bindings.Result
		found := false
		for deadline := time.Now().Add(5 * time.Second); !found; time.Sleep(time.Millisecond) {
			var err error
			if res, err = e.s.GetOrBind(e.ctx, e.look(k, e.bind("b"))); err != nil || res.Origin != bindings.Found {
				e.t.Fatalf("GetOrBind of the bound key = %+v, %v; want it found", res, err)
			}
			var got bindings.Binding
			if got, found = p.Peek(k, e.now, e.lt()); found {
				if diff := cmp.Diff(a, got); diff != "" {
					e.t.Errorf("Peek of the bound key (-want +got):\n%s", diff)
				}
			}
			if !e.h.Peeks || time.Now().After(deadline) {
				break
			}
		}
		if e.h.Peeks && !found {
			e.t.Errorf("Peek never found the session GetOrBind found, in 5s")
		}
		for range 3 {
			p.Peek(k, e.now, e.lt())
		}
		e.count(e.look(k, e.bind("b")), k, bindings.Found, res.Requests+1) // the peeks counted nothing
		if got, ok := p.Peek(k, e.now, bindings.Lifetime{Idle: e.idle, Max: e.idle / 20}); ok {
			e.t.Errorf("Peek past the maximum lifetime = %+v, want nothing", got)
		}
		e.advance(e.idle + e.idle/3)
		if got, ok := p.Peek(k, e.now, e.lt()); ok {
			e.t.Errorf("Peek of an expired session = %+v, want nothing", got)
		}
	}},
	{"new key is created", func(e *env) {
		a := e.bind("a")
		e.getOrBind(e.key("k"), a, e.lt(), a, bindings.Created)
	}},
	{"second caller finds the first binding", func(e *env) {
		a := e.bind("a")
		e.getOrBind(e.key("k"), a, e.lt(), a, bindings.Created)
		e.skew(e.idle / 10) // the found binding must keep its own Since
		e.getOrBind(e.key("k"), e.bind("b"), e.lt(), a, bindings.Found)
	}},
	{"idle expiry creates again", func(e *env) {
		e.getOrBind(e.key("k"), e.bind("a"), e.lt(), e.bind("a"), bindings.Created)
		e.advance(e.idle + e.idle/3)
		b := e.bind("b")
		e.getOrBind(e.key("k"), b, e.lt(), b, bindings.Created)
	}},
	{"use refreshes the idle timeout", func(e *env) {
		a := e.bind("a")
		e.getOrBind(e.key("k"), a, e.lt(), a, bindings.Created)
		e.advance(e.idle * 2 / 3)
		e.getOrBind(e.key("k"), e.bind("b"), e.lt(), a, bindings.Found)
		e.advance(e.idle * 2 / 3) // past Idle since creation, not since last use
		e.getOrBind(e.key("k"), e.bind("c"), e.lt(), a, bindings.Found)
		e.advance(e.idle + e.idle/3)
		d := e.bind("d")
		e.getOrBind(e.key("k"), d, e.lt(), d, bindings.Created)
	}},
	{"a hit says how long the session was idle", func(e *env) {
		a := e.bind("a")
		e.getOrBind(e.key("k"), a, e.lt(), a, bindings.Created)
		for _, d := range []time.Duration{e.idle / 3, e.idle / 4, 0, e.idle / 2} {
			e.advance(d)
			got, err := e.s.GetOrBind(e.ctx, e.look(e.key("k"), e.bind("b")))
			if err != nil {
				e.t.Fatal(err)
			}
			if got.Origin != bindings.Found || got.Idle < d-time.Millisecond || got.Idle > d+time.Millisecond {
				e.t.Errorf("after %v unused: %v, idle %v", d, got.Origin, got.Idle)
			}
		}
	}},
	{"max exceeded renews", func(e *env) {
		lt := bindings.Lifetime{Idle: time.Hour, Max: 10 * time.Minute}
		a := e.bindv("a", "v1")
		e.getOrBind(e.key("k"), a, lt, a, bindings.Created)
		e.skew(lt.Max - time.Second)
		e.getOrBind(e.key("k"), e.bind("b"), lt, a, bindings.Found)
		e.skew(time.Second) // exactly Max old: placed again
		c := e.bindv("c", "v2")
		e.renew(e.key("k"), c, lt, a) // Previous is what it replaced
		// Max now counts from the renewal.
		e.skew(lt.Max - time.Second)
		e.getOrBind(e.key("k"), e.bind("d"), lt, c, bindings.Found)
		e.skew(time.Second)
		d := e.bind("d")
		e.renew(e.key("k"), d, lt, c) // with its version
	}},
	{"max zero is no limit", func(e *env) {
		lt := bindings.Lifetime{Idle: time.Hour}
		a := e.bind("a")
		e.getOrBind(e.key("k"), a, lt, a, bindings.Created)
		for range 5 {
			e.skew(50 * time.Minute) // each use is within Idle of the last
			e.getOrBind(e.key("k"), e.bind("b"), lt, a, bindings.Found)
		}
	}},
	{"replace moves a binding still bound to old", func(e *env) {
		e.getOrBind(e.key("k"), e.bind("a"), e.lt(), e.bind("a"), bindings.Created)
		e.skew(e.idle / 10)
		b := e.bind("b")
		e.replace(e.key("k"), "a", b, b)
		e.skew(e.idle / 10)
		e.getOrBind(e.key("k"), e.bind("c"), e.lt(), b, bindings.Found)
	}},
	{"replace keeps a binding another caller moved", func(e *env) {
		a := e.bind("a")
		e.getOrBind(e.key("k"), a, e.lt(), a, bindings.Created)
		e.skew(e.idle / 10)
		e.replace(e.key("k"), "x", e.bind("b"), a)
		e.skew(e.idle / 10)
		e.getOrBind(e.key("k"), e.bind("c"), e.lt(), a, bindings.Found)
	}},
	{"replace stores an absent key", func(e *env) {
		b := e.bind("b")
		e.replace(e.key("k"), "a", b, b)
		e.getOrBind(e.key("k"), e.bind("c"), e.lt(), b, bindings.Found)
	}},
	{"replace stores over an expired binding", func(e *env) {
		e.getOrBind(e.key("k"), e.bind("a"), e.lt(), e.bind("a"), bindings.Created)
		e.advance(e.idle + e.idle/3)
		b := e.bind("b")
		e.replace(e.key("k"), "x", b, b)
	}},
	{"replace refreshes the idle timeout of the kept binding", func(e *env) {
		a := e.bind("a")
		e.getOrBind(e.key("k"), a, e.lt(), a, bindings.Created)
		e.advance(e.idle * 2 / 3)
		e.replace(e.key("k"), "x", e.bind("b"), a)
		e.advance(e.idle * 2 / 3)
		e.getOrBind(e.key("k"), e.bind("c"), e.lt(), a, bindings.Found)
	}},
	{"keys are isolated", func(e *env) {
		a, b := e.bind("a"), e.bind("b")
		e.getOrBind(e.key("k1"), a, e.lt(), a, bindings.Created)
		e.getOrBind(e.key("k2"), b, e.lt(), b, bindings.Created)
		c := e.bind("c")
		e.replace(e.key("k1"), "a", c, c)
		e.getOrBind(e.key("k2"), e.bind("d"), e.lt(), b, bindings.Found)
		e.getOrBind(e.key("k1"), e.bind("d"), e.lt(), c, bindings.Found)
		// A key that is a prefix of another is still its own key.
		p := e.bind("p")
		e.getOrBind(e.key("k"), p, e.lt(), p, bindings.Created)
	}},
	{"keys with braces keep their own binding", func(e *env) {
		// Redis Cluster hashes the text between the first '{' and '}'. A
		// key must not change which slot its binding and link go to.
		// Escaping must keep distinct keys distinct.
		keys := []string{"{", "}", "}x", "{}", "a{b}c", "%7B", "%", "{fleet}"}
		for i, k := range keys {
			b := e.bind(fmt.Sprint("i", i))
			e.lookup(e.look(k, b, "}"+k+"{"), bindings.Result{Key: k, Binding: b, Origin: bindings.Created})
		}
		active := map[string]int{}
		for i, k := range keys {
			b := e.bind(fmt.Sprint("i", i))
			e.lookup(e.look(k, e.bind("other")), bindings.Result{Key: k, Binding: b, Origin: bindings.Found})
			e.lookup(e.look("}"+k+"{", e.bind("other")), bindings.Result{Key: k, Binding: b, Origin: bindings.Found})
			e.show("}"+k+"{", bindings.Session{Key: k, Binding: b}, true)
			active[b.Instance] = 1
		}
		e.checkActive(active)
		e.mark(bindings.MarkFilter{Instance: "i0"}, bindings.Move{Off: "i0"}, 1, 0)
		moved := e.bind("moved")
		e.replace(keys[0], "i0", moved, moved)
		e.checkActive(map[string]int{"i0": 0, "moved": 1})
	}},
	{"alias links and follows", func(e *env) {
		s, t := e.key("s"), e.key("t")
		a := e.bind("a")
		e.lookup(e.look(s, a, t), bindings.Result{Key: s, Binding: a, Origin: bindings.Created})
		e.skew(e.idle / 10)
		// A request with only the alias finds the session and names its key.
		e.lookup(e.look(t, e.bind("b")), bindings.Result{Key: s, Binding: a, Origin: bindings.Found})
		// The alias made no session of its own.
		e.checkActive(map[string]int{"a": 1, "b": 0})
		// A move of the session key is what the alias finds next.
		c := e.bind("c")
		e.replace(s, "a", c, c)
		e.lookup(e.look(t, e.bind("d")), bindings.Result{Key: s, Binding: c, Origin: bindings.Found})
	}},
	{"alias link expires with the idle lifetime", func(e *env) {
		s, t := e.key("s"), e.key("t")
		a := e.bind("a")
		e.lookup(e.look(s, a, t), bindings.Result{Key: s, Binding: a, Origin: bindings.Created})
		e.advance(e.idle * 2 / 3)
		// Carrying the alias again refreshes the link.
		e.lookup(e.look(s, e.bind("b"), t), bindings.Result{Key: s, Binding: a, Origin: bindings.Found})
		e.advance(e.idle * 2 / 3) // past Idle since the first link
		e.lookup(e.look(t, e.bind("c")), bindings.Result{Key: s, Binding: a, Origin: bindings.Found})
		e.advance(e.idle * 2 / 3) // following the link is a use of it too
		e.lookup(e.look(t, e.bind("c")), bindings.Result{Key: s, Binding: a, Origin: bindings.Found})
		e.advance(e.idle * 3 / 2) // a link may outlive its session by Idle/4
		d := e.bind("d")
		e.lookup(e.look(t, d), bindings.Result{Key: t, Binding: d, Origin: bindings.Created})
	}},
	{"newer link overwrites an older one", func(e *env) {
		s1, s2, t := e.key("s1"), e.key("s2"), e.key("t")
		a, b := e.bind("a"), e.bind("b")
		e.lookup(e.look(s1, a, t), bindings.Result{Key: s1, Binding: a, Origin: bindings.Created})
		e.lookup(e.look(s2, b, t), bindings.Result{Key: s2, Binding: b, Origin: bindings.Created})
		e.lookup(e.look(t, e.bind("c")), bindings.Result{Key: s2, Binding: b, Origin: bindings.Found})
		// A session's links are written when its refresh is due: at most
		// every Idle/4 (the Redis store), not by every request.
		e.skew(e.idle / 4)
		e.lookup(e.look(s1, e.bind("c"), t), bindings.Result{Key: s1, Binding: a, Origin: bindings.Found})
		e.lookup(e.look(t, e.bind("c")), bindings.Result{Key: s1, Binding: a, Origin: bindings.Found})
	}},
	{"alias first seen mid-session is linked within Idle/4", func(e *env) {
		s, u, t := e.key("s"), e.key("u"), e.key("t")
		a := e.bind("a")
		e.lookup(e.look(s, a, u), bindings.Result{Key: s, Binding: a, Origin: bindings.Created})
		e.skew(e.idle / 10)
		// The Redis store links t at the session's next due refresh.
		e.lookup(e.look(s, e.bind("b"), u, t), bindings.Result{Key: s, Binding: a, Origin: bindings.Found})
		e.skew(e.idle / 4)
		e.lookup(e.look(s, e.bind("b"), u, t), bindings.Result{Key: s, Binding: a, Origin: bindings.Found})
		e.lookup(e.look(t, e.bind("c")), bindings.Result{Key: s, Binding: a, Origin: bindings.Found})
		e.lookup(e.look(u, e.bind("c")), bindings.Result{Key: s, Binding: a, Origin: bindings.Found})
		e.checkActive(map[string]int{"a": 1, "b": 0, "c": 0})
	}},
	{"alias equal to the key is ignored", func(e *env) {
		s, t := e.key("s"), e.key("t")
		a := e.bind("a")
		e.lookup(e.look(s, a, s, "", t, t), bindings.Result{Key: s, Binding: a, Origin: bindings.Created})
		e.lookup(e.look(s, e.bind("b"), s), bindings.Result{Key: s, Binding: a, Origin: bindings.Found})
		e.lookup(e.look(t, e.bind("b")), bindings.Result{Key: s, Binding: a, Origin: bindings.Found})
		e.show(s, bindings.Session{Key: s, Binding: a}, true)
	}},
	{"alias equal to the resolved key is ignored", func(e *env) {
		s, t := e.key("s"), e.key("t")
		a := e.bind("a")
		e.lookup(e.look(s, a, t), bindings.Result{Key: s, Binding: a, Origin: bindings.Created})
		// t leads to s; s among t's aliases must not be linked back to t.
		e.lookup(e.look(t, e.bind("b"), s), bindings.Result{Key: s, Binding: a, Origin: bindings.Found})
		e.lookup(e.look(s, e.bind("c")), bindings.Result{Key: s, Binding: a, Origin: bindings.Found})
		e.lookup(e.look(t, e.bind("c")), bindings.Result{Key: s, Binding: a, Origin: bindings.Found})
		e.checkActive(map[string]int{"a": 1, "b": 0, "c": 0})
	}},
	{"version is stored and returned", func(e *env) {
		k := e.key("k")
		a1 := e.bindv("a", "v1")
		e.getOrBind(k, a1, e.lt(), a1, bindings.Created)
		e.getOrBind(k, e.bindv("b", "v2"), e.lt(), a1, bindings.Found)
		e.show(k, bindings.Session{Key: k, Binding: a1}, true)
		e.skew(e.idle / 10)
		b2 := e.bindv("b", "v2")
		e.replace(k, "a", b2, b2)
		e.getOrBind(k, e.bindv("c", "v3"), e.lt(), b2, bindings.Found)
		// The kept binding of a lost Replace keeps its version.
		e.replace(k, "a", e.bindv("c", "v3"), b2)
	}},
	{"replace clears a pending move", func(e *env) {
		k := e.key("k")
		a := e.bindv("a", "v1")
		e.getOrBind(k, a, e.lt(), a, bindings.Created)
		e.mark(bindings.MarkFilter{Instance: "a"}, bindings.Move{Version: "v2"}, 1, 0)
		want := bindings.Result{Key: k, Binding: a, Origin: bindings.Found, Move: bindings.Move{Version: "v2"}}
		e.lookup(e.look(k, e.bind("x")), want)
		e.show(k, bindings.Session{Key: k, Binding: a, Move: bindings.Move{Version: "v2"}}, true)
		e.skew(e.idle / 10)
		b := e.bindv("b", "v2")
		e.replace(k, "a", b, b)
		e.getOrBind(k, e.bind("x"), e.lt(), b, bindings.Found) // no move
		e.show(k, bindings.Session{Key: k, Binding: b}, true)
		e.checkActive(map[string]int{"a": 0, "b": 1})
	}},
	{"renewal clears a pending move and moves the index", func(e *env) {
		k := e.key("k")
		lt := bindings.Lifetime{Idle: time.Hour, Max: 10 * time.Minute}
		a := e.bind("a")
		e.getOrBind(k, a, lt, a, bindings.Created)
		e.mark(bindings.MarkFilter{Instance: "a"}, bindings.Move{Off: "a"}, 1, 0)
		e.skew(lt.Max)
		c := e.bind("c")
		e.renew(k, c, lt, a) // no move on a renewal
		e.getOrBind(k, e.bind("d"), lt, c, bindings.Found)
		e.checkActive(map[string]int{"a": 0, "c": 1})
	}},
	{"index counts binds, expiry and moves", func(e *env) {
		for _, k := range []string{"k1", "k2"} {
			e.getOrBind(e.key(k), e.bind("a"), e.lt(), e.bind("a"), bindings.Created)
		}
		e.getOrBind(e.key("k3"), e.bind("b"), e.lt(), e.bind("b"), bindings.Created)
		e.checkActive(map[string]int{"a": 2, "b": 1, "c": 0})
		b := e.bind("b")
		e.replace(e.key("k1"), "a", b, b)
		e.checkActive(map[string]int{"a": 1, "b": 2, "c": 0})
		e.advance(e.idle * 3 / 2) // an index entry may outlive its binding by Idle/4
		e.checkActive(map[string]int{"a": 0, "b": 0, "c": 0})
	}},
	{"index keeps a session whatever idle each request carries", func(e *env) {
		// Requests of one session may carry different idle timeouts (a
		// matching rule may set its own). The binding lives by the last
		// one; its index entry and alias links must live at least as long.
		k, t := e.key("k"), e.key("t")
		long, short := e.lt(), bindings.Lifetime{Idle: e.idle / 3}
		use := func(lt bindings.Lifetime, candidate, want bindings.Binding, out bindings.Origin) {
			e.t.Helper()
			l := bindings.Lookup{Key: k, Aliases: []string{t}, Candidate: candidate, Lifetime: lt}
			e.lookup(l, bindings.Result{Key: k, Binding: want, Origin: out})
		}
		a := e.bind("a")
		use(long, a, a, bindings.Created)
		e.advance(e.idle / 4)
		use(short, e.bind("b"), a, bindings.Found)
		use(long, e.bind("b"), a, bindings.Found) // the binding lives Idle from here again
		// Past the short timeout and what an index entry written for it
		// would last, well within the long one.
		e.advance(e.idle / 2)
		e.checkActive(map[string]int{"a": 1})
		e.mark(bindings.MarkFilter{Instance: "a"}, bindings.Move{Off: "a"}, 1, 0)
		e.lookup(e.look(t, e.bind("c")), bindings.Result{Key: k, Binding: a, Origin: bindings.Found, Move: bindings.Move{Off: "a"}})
		e.advance(e.idle * 3 / 2)
		e.checkActive(map[string]int{"a": 0})
	}},
	{"index keeps a session in use", func(e *env) {
		a := e.bind("a")
		e.getOrBind(e.key("k"), a, e.lt(), a, bindings.Created)
		e.advance(e.idle * 2 / 3)
		e.getOrBind(e.key("k"), e.bind("b"), e.lt(), a, bindings.Found)
		e.advance(e.idle * 2 / 3) // past Idle*5/4 since the bind
		e.checkActive(map[string]int{"a": 1})
		e.advance(e.idle * 3 / 2)
		e.checkActive(map[string]int{"a": 0})
	}},
	{"mark selects by version, limits and counts what remains", func(e *env) {
		var v1, v2 []string
		for i := range 3 {
			v1 = append(v1, e.key(fmt.Sprint("v1-", i)))
			e.getOrBind(v1[i], e.bindv("a", "v1"), e.lt(), e.bindv("a", "v1"), bindings.Created)
		}
		for i := range 2 {
			v2 = append(v2, e.key(fmt.Sprint("v2-", i)))
			e.getOrBind(v2[i], e.bindv("a", "v2"), e.lt(), e.bindv("a", "v2"), bindings.Created)
		}
		other := e.key("other")
		e.getOrBind(other, e.bindv("b", "v1"), e.lt(), e.bindv("b", "v1"), bindings.Created)

		f, toV2 := bindings.MarkFilter{Instance: "a", Version: "v1", Limit: 2}, bindings.Move{Version: "v2"}
		e.mark(f, toV2, 2, 1)
		e.mark(f, toV2, 1, 0)
		e.mark(f, toV2, 0, 0)
		for _, k := range v1 {
			e.show(k, bindings.Session{Key: k, Binding: e.bindv("a", "v1"), Move: toV2}, true)
		}
		for _, k := range append(v2, other) {
			got, _, err := e.s.Show(e.ctx, k, e.now)
			if err != nil || got.Move.Pending() {
				e.t.Errorf("Show(%q) = %+v, %v; want no pending move", k, got, err)
			}
		}
		// Limit 0 marks every selected session without a move yet.
		e.mark(bindings.MarkFilter{Instance: "a"}, bindings.Move{Off: "a"}, 2, 0)
		e.mark(bindings.MarkFilter{Instance: "a"}, bindings.Move{Off: "a"}, 0, 0)
	}},
	{"mark skips sessions that moved or ended", func(e *env) {
		for _, k := range []string{"moved", "used", "ended"} {
			e.getOrBind(e.key(k), e.bind("a"), e.lt(), e.bind("a"), bindings.Created)
		}
		e.advance(e.idle * 2 / 3)
		b := e.bind("b")
		e.replace(e.key("moved"), "a", b, b)
		e.getOrBind(e.key("used"), e.bind("x"), e.lt(), bindings.Binding{Instance: "a", Since: start}, bindings.Found)
		e.advance(e.idle * 2 / 3) // "ended" is past its idle timeout
		e.mark(bindings.MarkFilter{Instance: "a", Limit: 5}, bindings.Move{Off: "a"}, 1, 0)
		e.show(e.key("moved"), bindings.Session{Key: e.key("moved"), Binding: b}, true)
		e.show(e.key("ended"), bindings.Session{}, false)
		e.checkActive(map[string]int{"a": 1, "b": 1})
	}},
	{"show follows an alias", func(e *env) {
		s, t := e.key("s"), e.key("t")
		a := e.bindv("a", "v1")
		e.lookup(e.look(s, a, t), bindings.Result{Key: s, Binding: a, Origin: bindings.Created})
		e.show(t, bindings.Session{Key: s, Binding: a}, true)
		e.show(s, bindings.Session{Key: s, Binding: a}, true)
		e.show(e.key("none"), bindings.Session{}, false)
		e.advance(e.idle + e.idle/3)
		e.show(t, bindings.Session{}, false)
		e.show(s, bindings.Session{}, false)
	}},
	{"sync load sums the other replicas", func(e *env) {
		in := []string{"a", "b", "c"}
		none := map[string]int{}
		// others is how many other replicas' reports stand.
		check := func(what string, st fleet.LoadState, others int, inFlight, queue map[string]int) {
			e.t.Helper()
			want := fleet.LoadState{Active: map[string]int{"a": 0, "b": 0, "c": 0}, InFlight: inFlight, Queue: queue, Drained: map[string]bool{},
				Engine: map[string]fleet.EngineReading{}, Replicas: others}
			if diff := cmp.Diff(want, st); diff != "" {
				e.t.Errorf("%s (-want +got):\n%s", what, diff)
			}
		}
		// "z" is not listed: it is left out.
		check("r1 alone", e.sync("r1", map[string]int{"a": 2, "b": 1, "z": 9}, map[string]int{"a": 5}, in...),
			0, none, map[string]int{"a": 5})
		check("r2 sees r1", e.sync("r2", map[string]int{"a": 3}, map[string]int{"a": 7, "b": 1}, in...),
			1, map[string]int{"a": 2, "b": 1}, map[string]int{"a": 7, "b": 1})
		check("r1 sees r2", e.sync("r1", map[string]int{"a": 2, "b": 1, "z": 9}, map[string]int{"a": 5}, in...),
			1, map[string]int{"a": 3}, map[string]int{"a": 7, "b": 1})
		// A new report replaces the last one.
		e.skew(reportTTL / 2)
		check("r2 again", e.sync("r2", map[string]int{"a": 4}, nil, in...),
			1, map[string]int{"a": 2, "b": 1}, map[string]int{"a": 5})
		// r1's report (from the start) has expired; r2's (from ttl/2) has not.
		e.skew(reportTTL/2 + time.Second)
		check("r1 expired", e.sync("r2", map[string]int{"a": 4}, nil, in...), 0, none, none)
		// A replica that reports nothing still counts as one.
		check("r1 back", e.sync("r1", nil, nil, in...), 1, map[string]int{"a": 4}, none)
		check("r2 sees r1 back", e.sync("r2", nil, nil, in...), 1, none, none)
	}},
	{"sync load shares the newest engine reading", func(e *env) {
		in := []string{"a", "b"}
		at := func(d time.Duration) time.Time { return e.now.Add(d).Truncate(time.Millisecond) }
		old := fleet.EngineReading{Waiting: 1, Running: 2, At: at(-time.Second)}
		newer := fleet.EngineReading{Waiting: 7, Running: 3, KVUsage: 0.5, KVKnown: true, PrefixHits: 10, PrefixQueries: 40,
			PrefixKnown: true, Preemptions: 2, HitRate: 1.5, QueryRate: 4, PreemptionRate: 0.25, RatesKnown: true, CacheTokens: 465_000, At: at(0)}
		sync := func(replica string, engine map[string]fleet.EngineReading) fleet.LoadState {
			e.t.Helper()
			st, err := e.s.SyncLoad(e.ctx, fleet.LoadReport{Replica: replica, Engine: engine}, in, reportTTL, e.now)
			if err != nil {
				e.t.Fatalf("SyncLoad(%s): %v", replica, err)
			}
			return st
		}
		if st := sync("r1", map[string]fleet.EngineReading{"a": old, "z": old}); len(st.Engine) != 0 {
			e.t.Errorf("r1 alone sees engine readings %v, want none (its own are left out)", st.Engine)
		}
		sync("r2", map[string]fleet.EngineReading{"a": newer})
		// r3 sees both reports: the newest reading of a wins; z is not listed.
		st := sync("r3", nil)
		if diff := cmp.Diff(map[string]fleet.EngineReading{"a": newer}, st.Engine, cmpopts.EquateApproxTime(0)); diff != "" {
			e.t.Errorf("engine readings (-want +got):\n%s", diff)
		}
	}},
	{"leases", func(e *env) {
		name, ttl := e.key("engines/0"), e.idle/2
		take := func(holder string, want bool) {
			e.t.Helper()
			ok, err := e.s.Lease(e.ctx, name, holder, ttl, e.now)
			if err != nil {
				e.t.Fatalf("Lease(%s): %v", holder, err)
			}
			if ok != want {
				e.t.Errorf("Lease(%s) = %v, want %v", holder, ok, want)
			}
		}
		take("r1", true)
		take("r2", false)
		take("r1", true) // renewed
		if err := e.s.Release(e.ctx, name, "r2"); err != nil {
			e.t.Fatal(err)
		}
		take("r2", false) // r2 could not release r1's lease
		if err := e.s.Release(e.ctx, name, "r1"); err != nil {
			e.t.Fatal(err)
		}
		take("r2", true)
		e.advance(ttl + ttl/2)
		take("r1", true) // r2's lease ran out
		for _, bad := range []struct {
			name, holder string
			ttl          time.Duration
		}{{"", "r1", ttl}, {name, "", ttl}, {name, "r1", 0}} {
			if _, err := e.s.Lease(e.ctx, bad.name, bad.holder, bad.ttl, e.now); err == nil {
				e.t.Errorf("Lease(%q, %q, %v) = nil error, want one", bad.name, bad.holder, bad.ttl)
			}
		}
	}},
	{"drained set", func(e *env) {
		for _, d := range []struct {
			in string
			on bool
		}{{"a", true}, {"b", true}, {"b", false}, {"c", false}, {"a", true}} {
			if err := e.s.SetDrained(e.ctx, d.in, d.on); err != nil {
				e.t.Fatalf("SetDrained(%s, %v): %v", d.in, d.on, err)
			}
		}
		st := e.sync("r1", nil, nil)
		if diff := cmp.Diff(map[string]bool{"a": true}, st.Drained); diff != "" {
			e.t.Errorf("drained (-want +got):\n%s", diff)
		}
		if err := e.s.SetDrained(e.ctx, "a", false); err != nil {
			e.t.Fatal(err)
		}
		if st := e.sync("r1", nil, nil); len(st.Drained) != 0 {
			e.t.Errorf("drained = %v after undraining all, want none", st.Drained)
		}
	}},
	{"racing get-or-bind agree on one winner", func(e *env) {
		key := e.key("k")
		type result struct {
			res bindings.Result
			err error
		}
		res := make([]result, races)
		instances := make([]string, races)
		race(func(i int) {
			instances[i] = fmt.Sprintf("i%02d", i)
			r, err := e.s.GetOrBind(e.ctx, e.look(key, e.bind(instances[i])))
			res[i] = result{r, err}
		})
		created := 0
		for i, r := range res {
			if r.err != nil {
				e.t.Fatalf("racer %d: %v", i, r.err)
			}
			if r.res.Origin == bindings.Created {
				created++
			}
			if diff := cmp.Diff(res[0].res.Binding, r.res.Binding); diff != "" {
				e.t.Errorf("racer %d disagrees with racer 0 (-0 +%d):\n%s", i, i, diff)
			}
		}
		if created != 1 {
			e.t.Errorf("%d racers saw Created, want exactly 1", created)
		}
		won := res[0].res.Binding
		e.getOrBind(key, e.bind("late"), e.lt(), won, bindings.Found)
		want := map[string]int{}
		for _, in := range instances {
			want[in] = 0
		}
		want[won.Instance] = 1
		e.checkActive(want)
	}},
	{"racing replace agree on one winner", func(e *env) {
		key := e.key("k")
		e.getOrBind(key, e.bind("old"), e.lt(), e.bind("old"), bindings.Created)
		e.skew(e.idle / 10)
		type result struct {
			next, got bindings.Binding
			err       error
		}
		res := make([]result, races)
		race(func(i int) {
			next := e.bind(fmt.Sprintf("i%02d", i))
			got, err := e.s.Replace(e.ctx, key, "old", next, e.lt())
			res[i] = result{next, got, err}
		})
		won := 0
		for i, r := range res {
			if r.err != nil {
				e.t.Fatalf("racer %d: %v", i, r.err)
			}
			if r.got.Instance == r.next.Instance {
				won++
			}
			if diff := cmp.Diff(res[0].got, r.got); diff != "" {
				e.t.Errorf("racer %d disagrees with racer 0 (-0 +%d):\n%s", i, i, diff)
			}
		}
		if won != 1 {
			e.t.Errorf("%d racers moved the binding, want exactly 1", won)
		}
		e.getOrBind(key, e.bind("late"), e.lt(), res[0].got, bindings.Found)
		e.checkActive(map[string]int{"old": 0, res[0].got.Instance: 1})
	}},
	{"racing renewals past max agree on one winner", func(e *env) {
		key := e.key("k")
		lt := bindings.Lifetime{Idle: e.idle, Max: e.idle / 2}
		old := e.bindv("old", "v1")
		e.getOrBind(key, old, lt, old, bindings.Created)
		e.skew(e.idle / 2) // past Max on the caller's clock; the idle timeout still holds
		res := make([]bindings.Result, races)
		race(func(i int) {
			r, err := e.s.GetOrBind(e.ctx, bindings.Lookup{Key: key, Candidate: e.bind(fmt.Sprintf("i%02d", i)), Lifetime: lt})
			if err != nil {
				e.t.Errorf("racer %d: %v", i, err)
			}
			res[i] = r
		})
		renewed := 0
		for i := range res {
			var prev bindings.Binding
			if res[i].Origin == bindings.Renewed {
				renewed++
				prev = old
			}
			if res[i].Previous != prev {
				e.t.Errorf("racer %d (%v): Previous = %+v, want %+v", i, res[i].Origin, res[i].Previous, prev)
			}
			if diff := cmp.Diff(res[0].Binding, res[i].Binding); diff != "" {
				e.t.Errorf("racer %d disagrees with racer 0:\n%s", i, diff)
			}
		}
		if renewed != 1 || res[0].Binding.Instance == "old" {
			e.t.Errorf("%d racers renewed (want 1), binding now %q", renewed, res[0].Binding.Instance)
		}
	}},
	{"get-or-bind racing replace never splits", func(e *env) {
		key := e.key("k")
		e.getOrBind(key, e.bind("old"), e.lt(), e.bind("old"), bindings.Created)
		got := make([]bindings.Binding, races)
		race(func(i int) {
			var err error
			if i%2 == 0 {
				got[i], err = e.s.Replace(e.ctx, key, "old", e.bind(fmt.Sprintf("r%02d", i)), e.lt())
			} else {
				var r bindings.Result
				r, err = e.s.GetOrBind(e.ctx, e.look(key, e.bind(fmt.Sprintf("g%02d", i))))
				got[i] = r.Binding
			}
			if err != nil {
				e.t.Errorf("racer %d: %v", i, err)
			}
		})
		// Readers may see "old" (before the move) or the one mover; never
		// two different movers, and never a get-or-bind candidate.
		movers := map[string]bool{}
		for i, b := range got {
			switch {
			case b.Instance == "old":
			case strings.HasPrefix(b.Instance, "r"):
				movers[b.Instance] = true
			default:
				e.t.Errorf("racer %d got %q: a get-or-bind replaced a live binding", i, b.Instance)
			}
		}
		if len(movers) != 1 {
			e.t.Errorf("movers seen: %v, want exactly one", movers)
		}
	}},
	{"failovers are stored by replace and reset by a new placement", func(e *env) {
		key := e.key("s")
		e.getOrBind(key, e.bind("a"), e.lt(), e.bind("a"), bindings.Created)
		moved := e.bind("b")
		moved.Failovers = 1
		e.replace(key, "a", moved, moved)
		e.getOrBind(key, e.bind("x"), e.lt(), moved, bindings.Found)
		e.show(key, bindings.Session{Key: key, Binding: moved}, true)
		again := e.bind("c")
		again.Failovers = bindings.MaxFailovers
		e.replace(key, "b", again, again)
		e.getOrBind(key, e.bind("x"), e.lt(), again, bindings.Found)
		// A lost race returns the winner's count.
		e.replace(key, "b", e.bind("d"), again)
		// Renewed after Max: a new placement starts the ladder over.
		e.skew(e.idle / 2)
		fresh := e.bind("e")
		e.renew(key, fresh, bindings.Lifetime{Idle: e.idle, Max: e.idle / 2}, again)
		e.getOrBind(key, e.bind("x"), e.lt(), fresh, bindings.Found)
		bad := e.bind("f")
		bad.Failovers = 3
		if _, err := e.s.Replace(e.ctx, key, "e", bad, e.lt()); err == nil {
			e.t.Error("Replace with failovers 3 succeeded")
		}
	}},
	{"requests are counted per session", func(e *env) {
		s, t, other := e.key("s"), e.key("t"), e.key("other")
		e.requests([]string{s}, []int{0})
		e.count(e.look(s, e.bind("a"), t), s, bindings.Created, 1)
		e.skew(e.idle / 10)
		e.count(e.look(s, e.bind("b")), s, bindings.Found, 2)
		e.count(e.look(s, e.bind("b")), s, bindings.Found, 3)
		// A request by an alias counts for the session it leads to.
		e.count(e.look(t, e.bind("b")), s, bindings.Found, 4)
		e.count(e.look(other, e.bind("b")), other, bindings.Created, 1)
		// Counts are read by session key; an alias has none of its own.
		e.requests([]string{s, t, other, e.key("none"), s}, []int{4, 0, 1, 0, 4})
		e.requests(nil, []int{})
	}},
	{"a renewal keeps counting", func(e *env) {
		k := e.key("k")
		lt := bindings.Lifetime{Idle: time.Hour, Max: 10 * time.Minute}
		e.count(bindings.Lookup{Key: k, Candidate: e.bind("a"), Lifetime: lt}, k, bindings.Created, 1)
		e.skew(time.Minute)
		e.count(bindings.Lookup{Key: k, Candidate: e.bind("b"), Lifetime: lt}, k, bindings.Found, 2)
		e.skew(lt.Max)
		e.count(bindings.Lookup{Key: k, Candidate: e.bind("c"), Lifetime: lt}, k, bindings.Renewed, 3)
		e.count(bindings.Lookup{Key: k, Candidate: e.bind("d"), Lifetime: lt}, k, bindings.Found, 4)
		e.requests([]string{k}, []int{4})
	}},
	{"replace keeps the count", func(e *env) {
		k := e.key("k")
		e.count(e.look(k, e.bind("a")), k, bindings.Created, 1)
		e.skew(e.idle / 10)
		e.count(e.look(k, e.bind("x")), k, bindings.Found, 2)
		b := e.bind("b")
		e.replace(k, "a", b, b)
		e.requests([]string{k}, []int{2})
		e.count(e.look(k, e.bind("x")), k, bindings.Found, 3)
		// A lost Replace keeps the winner's binding and count.
		e.replace(k, "a", e.bind("c"), b)
		e.count(e.look(k, e.bind("x")), k, bindings.Found, 4)
		// Over no binding there is no count to keep: the next request is 1.
		n := e.key("new")
		e.replace(n, "a", b, b)
		e.requests([]string{k, n}, []int{4, 0})
		e.count(e.look(n, e.bind("x")), n, bindings.Found, 1)
	}},
	{"an ended session's count is gone", func(e *env) {
		k := e.key("k")
		e.count(e.look(k, e.bind("a")), k, bindings.Created, 1)
		e.count(e.look(k, e.bind("a")), k, bindings.Found, 2)
		e.advance(e.idle + e.idle/3)
		e.requests([]string{k}, []int{0})
		e.count(e.look(k, e.bind("b")), k, bindings.Created, 1)
	}},
	{"racing requests each get their own count", func(e *env) {
		k := e.key("k")
		e.count(e.look(k, e.bind("a")), k, bindings.Created, 1)
		got := make([]int, races)
		race(func(i int) {
			r, err := e.s.GetOrBind(e.ctx, e.look(k, e.bind("b")))
			if err != nil {
				e.t.Errorf("racer %d: %v", i, err)
			}
			got[i] = r.Requests
		})
		slices.Sort(got)
		want := make([]int, races)
		for i := range want {
			want[i] = i + 2
		}
		if diff := cmp.Diff(want, got); diff != "" {
			e.t.Errorf("counts of racing requests (-want +got):\n%s", diff)
		}
		e.requests([]string{k}, []int{races + 1})
	}},
	{"bound lists the live sessions of an instance", func(e *env) {
		for i := range 5 {
			e.getOrBind(e.key(fmt.Sprint("s", i)), e.bind("a"), e.lt(), e.bind("a"), bindings.Created)
		}
		e.getOrBind(e.key("other"), e.bind("b"), e.lt(), e.bind("b"), bindings.Created)
		// One moves away, one expires.
		e.replace(e.key("s0"), "a", e.bind("b"), e.bind("b"))
		e.advance(e.idle / 2)
		e.getOrBind(e.key("s1"), e.bind("x"), e.lt(), bindings.Binding{Instance: "a", Since: start}, bindings.Found)
		e.getOrBind(e.key("s2"), e.bind("x"), e.lt(), bindings.Binding{Instance: "a", Since: start}, bindings.Found)
		e.getOrBind(e.key("s3"), e.bind("x"), e.lt(), bindings.Binding{Instance: "a", Since: start}, bindings.Found)
		e.advance(e.idle*3/4 + e.idle/8) // s4 is past its idle timeout
		got, err := e.s.Bound(e.ctx, "a", 0, e.now)
		if err != nil {
			e.t.Fatalf("Bound(a): %v", err)
		}
		keys := map[string]bool{}
		for _, s := range got {
			keys[s.Key] = true
			if s.Binding.Instance != "a" || s.TTL <= 0 || s.TTL > e.idle {
				e.t.Errorf("Bound(a) returned %+v", s)
			}
		}
		want := map[string]bool{e.key("s1"): true, e.key("s2"): true, e.key("s3"): true}
		if diff := cmp.Diff(want, keys); diff != "" {
			e.t.Errorf("Bound(a) keys (-want +got):\n%s", diff)
		}
		if got, err := e.s.Bound(e.ctx, "a", 2, e.now); err != nil || len(got) != 2 {
			e.t.Errorf("Bound(a, limit 2) = %d sessions, %v", len(got), err)
		}
		if got, err := e.s.Bound(e.ctx, "nobody", 0, e.now); err != nil || len(got) != 0 {
			e.t.Errorf("Bound(nobody) = %v, %v", got, err)
		}
		for _, c := range []struct {
			in    string
			limit int
		}{{"", 0}, {"a", -1}} {
			if _, err := e.s.Bound(e.ctx, c.in, c.limit, e.now); err == nil {
				e.t.Errorf("Bound(%q, %d) succeeded", c.in, c.limit)
			}
		}
	}},
	{"bad input is an error, not a binding", func(e *env) {
		ok := e.bind("a")
		bad := []struct {
			name string
			b    bindings.Binding
			lt   bindings.Lifetime
		}{
			{"empty instance", bindings.Binding{Since: e.now}, e.lt()},
			{"zero since", bindings.Binding{Instance: "a"}, e.lt()},
			{"zero idle", ok, bindings.Lifetime{}},
			{"negative idle", ok, bindings.Lifetime{Idle: -time.Second}},
			{"negative max", ok, bindings.Lifetime{Idle: e.idle, Max: -time.Second}},
		}
		for _, c := range bad {
			l := bindings.Lookup{Key: e.key("k"), Aliases: []string{e.key("t")}, Candidate: c.b, Lifetime: c.lt}
			if r, err := e.s.GetOrBind(e.ctx, l); err == nil {
				e.t.Errorf("GetOrBind with %s = %+v, want an error", c.name, r)
			}
			if b, err := e.s.Replace(e.ctx, e.key("k"), "a", c.b, c.lt); err == nil {
				e.t.Errorf("Replace with %s = %+v, want an error", c.name, b)
			}
		}
		badMarks := []struct {
			name string
			f    bindings.MarkFilter
			m    bindings.Move
		}{
			{"empty instance", bindings.MarkFilter{}, bindings.Move{Off: "a"}},
			{"negative limit", bindings.MarkFilter{Instance: "a", Limit: -1}, bindings.Move{Off: "a"}},
			{"empty move", bindings.MarkFilter{Instance: "a"}, bindings.Move{}},
		}
		for _, c := range badMarks {
			if n, left, err := e.s.Mark(e.ctx, c.f, c.m, e.now); err == nil {
				e.t.Errorf("Mark with %s = %d, %d, want an error", c.name, n, left)
			}
		}
		if _, err := e.s.SyncLoad(e.ctx, fleet.LoadReport{}, nil, reportTTL, e.now); err == nil {
			e.t.Error("SyncLoad with an empty replica name succeeded")
		}
		if _, err := e.s.SyncLoad(e.ctx, fleet.LoadReport{Replica: "r"}, nil, 0, e.now); err == nil {
			e.t.Error("SyncLoad with a zero ttl succeeded")
		}
		if err := e.s.SetDrained(e.ctx, "", true); err == nil {
			e.t.Error("SetDrained with an empty instance succeeded")
		}
		// Nothing was stored by the rejected calls.
		b := e.bind("b")
		e.getOrBind(e.key("k"), b, e.lt(), b, bindings.Created)
		e.getOrBind(e.key("t"), b, e.lt(), b, bindings.Created)
	}},
	{"cancelled context is an error", func(e *env) {
		ctx, cancel := context.WithCancel(e.ctx)
		cancel()
		check := func(op string, err error) {
			e.t.Helper()
			if !errors.Is(err, context.Canceled) {
				e.t.Errorf("%s with a cancelled context: err = %v, want context.Canceled", op, err)
			}
		}
		_, err := e.s.GetOrBind(ctx, e.look(e.key("k"), e.bind("a")))
		check("GetOrBind", err)
		_, err = e.s.Replace(ctx, e.key("k"), "a", e.bind("a"), e.lt())
		check("Replace", err)
		_, _, err = e.s.Show(ctx, e.key("k"), e.now)
		check("Show", err)
		_, _, err = e.s.Mark(ctx, bindings.MarkFilter{Instance: "a"}, bindings.Move{Off: "a"}, e.now)
		check("Mark", err)
		_, err = e.s.SyncLoad(ctx, fleet.LoadReport{Replica: "r"}, []string{"a"}, reportTTL, e.now)
		check("SyncLoad", err)
		check("SetDrained", e.s.SetDrained(ctx, "a", true))
		_, err = e.s.Requests(ctx, []string{e.key("k")}, e.now)
		check("Requests", err)
		_, _, err = e.s.ReportFailure(ctx, "a", e.now, "m", breaker)
		check("ReportFailure", err)
		_, err = e.s.ReportRecovered(ctx, "a", e.now)
		check("ReportRecovered", err)
		_, err = e.s.Circuits(ctx, e.now)
		check("Circuits", err)
	}},
}

// race runs f(0..races-1) on races goroutines released together, to
// maximise overlap.
func race(f func(i int)) {
	n := races
	var ready, done sync.WaitGroup
	gate := make(chan struct{})
	ready.Add(n)
	done.Add(n)
	for i := range n {
		go func() {
			defer done.Done()
			ready.Done()
			<-gate
			f(i)
		}()
	}
	ready.Wait()
	close(gate)
	done.Wait()
}

// Run runs every conformance case against the stores h makes.
func Run(t *testing.T, h Harness) {
	t.Helper()
	if h.New == nil || h.Advance == nil {
		t.Fatal("storetest: Harness needs New and Advance")
	}
	idle := h.Idle
	if idle <= 0 {
		idle = time.Minute
	}
	for _, c := range slices.Concat(cases, circuitCases) {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := &env{t: t, h: h, s: h.New(t), now: start, idle: idle, ctx: t.Context(), space: t.Name(), breaker: breaker}
			c.run(e)
		})
	}
}

// Benchmark measures GetOrBind on s, serial and with b.RunParallel. It
// measures the Found path: one hot key, with and without an alias. It
// measures the Created path: a new key per call. It reports no verdict.
// Compare stores as ratios within one run.
func Benchmark(b *testing.B, s affinity.Store) {
	lt := bindings.Lifetime{Idle: time.Hour, Max: time.Hour}
	cand := bindings.Binding{Instance: "inst-a", Version: "v1", Since: start}
	ctx := context.Background()
	var seq atomic.Int64 // keys never repeat across sub-benchmark reruns
	call := func(b *testing.B, l bindings.Lookup, want bindings.Origin) {
		if r, err := s.GetOrBind(ctx, l); err != nil || r.Origin != want {
			b.Fatalf("GetOrBind(%q) = %v, %v; want %v", l.Key, r.Origin, err, want)
		}
	}
	hot := bindings.Lookup{Key: fmt.Sprintf("bench/hot/%d", seq.Add(1)), Candidate: cand, Lifetime: lt}
	if _, err := s.GetOrBind(ctx, hot); err != nil {
		b.Fatal(err)
	}
	hotAlias := hot
	hotAlias.Aliases = []string{hot.Key + "/alias"}
	fresh := func() bindings.Lookup {
		return bindings.Lookup{Key: fmt.Sprintf("bench/new/%d", seq.Add(1)), Candidate: cand, Lifetime: lt}
	}
	b.Run("found", func(b *testing.B) {
		for b.Loop() {
			call(b, hot, bindings.Found)
		}
	})
	b.Run("found-with-alias", func(b *testing.B) {
		for b.Loop() {
			call(b, hotAlias, bindings.Found)
		}
	})
	b.Run("created", func(b *testing.B) {
		for b.Loop() {
			call(b, fresh(), bindings.Created)
		}
	})
	b.Run("found-parallel", func(b *testing.B) {
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				call(b, hot, bindings.Found)
			}
		})
	})
	b.Run("created-parallel", func(b *testing.B) {
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				call(b, fresh(), bindings.Created)
			}
		})
	})
}
