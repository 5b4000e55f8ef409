// Package storetest is the conformance suite every affinity.Store must pass.
// store/memory and store/redis run the same cases, so "two tether replicas
// agree" and the lifetime rules mean the same thing whichever store is wired.
package storetest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/tetherproxy/tether/affinity"
)

// Harness tells Run how to make a store and how to move its clock.
type Harness struct {
	// New returns an empty store for one case. Cases run in parallel, so
	// stores returned for different t must not share expiry clocks (a shared
	// server is fine when Advance only waits).
	New func(t *testing.T) affinity.Store
	// Advance lets d pass on the store's own expiry clock: FastForward for
	// miniredis, nothing for a store that reads "now" from Binding.Since, a
	// real wait for a real server.
	Advance func(t *testing.T, d time.Duration)
	// Idle is the idle timeout the expiry cases use (0: one minute). A
	// harness whose Advance really waits sets it small, a few hundred
	// milliseconds; the cases keep a margin of a third of it either side.
	Idle time.Duration
}

// start is the suite's first "now": a whole millisecond, because the Redis
// store keeps Since with millisecond precision.
var start = time.UnixMilli(1_750_000_000_000)

const races = 32

// env is one case's view: its store, its clock and its key namespace.
type env struct {
	t     *testing.T
	h     Harness
	s     affinity.Store
	now   time.Time
	idle  time.Duration
	ctx   context.Context
	space string
}

// key namespaces keys by case, so cases sharing one server never collide.
func (e *env) key(name string) string { return e.space + "/" + name }

// advance moves the caller's clock and the store's clock together.
func (e *env) advance(d time.Duration) {
	e.t.Helper()
	e.now = e.now.Add(d)
	e.h.Advance(e.t, d)
}

// skew moves only the caller's clock: by less than the idle timeout, or in
// Max cases that run with an hour of Idle, so the store's own expiry clock
// cannot change the outcome.
func (e *env) skew(d time.Duration) { e.now = e.now.Add(d) }

func (e *env) lt() affinity.Lifetime { return affinity.Lifetime{Idle: e.idle} }

func (e *env) bind(name string) affinity.Binding {
	return affinity.Binding{Instance: name, Since: e.now}
}

// getOrBind calls GetOrBind and checks the binding and outcome.
func (e *env) getOrBind(key string, candidate affinity.Binding, lt affinity.Lifetime, want affinity.Binding, wantOut affinity.Outcome) {
	e.t.Helper()
	got, out, err := e.s.GetOrBind(e.ctx, key, candidate, lt)
	if err != nil {
		e.t.Fatalf("GetOrBind(%q, %s): %v", key, candidate.Instance, err)
	}
	if out != wantOut {
		e.t.Errorf("GetOrBind(%q, %s) outcome = %v, want %v", key, candidate.Instance, out, wantOut)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		e.t.Errorf("GetOrBind(%q, %s) binding (-want +got):\n%s", key, candidate.Instance, diff)
	}
}

// replace calls Replace and checks the binding it returns.
func (e *env) replace(key, old string, next affinity.Binding, want affinity.Binding) {
	e.t.Helper()
	got, err := e.s.Replace(e.ctx, key, old, next, e.lt())
	if err != nil {
		e.t.Fatalf("Replace(%q, %s -> %s): %v", key, old, next.Instance, err)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		e.t.Errorf("Replace(%q, %s -> %s) binding (-want +got):\n%s", key, old, next.Instance, diff)
	}
}

type testCase struct {
	name string
	run  func(e *env)
}

var cases = []testCase{
	{"new key is created", func(e *env) {
		a := e.bind("a")
		e.getOrBind(e.key("k"), a, e.lt(), a, affinity.Created)
	}},
	{"second caller finds the first binding", func(e *env) {
		a := e.bind("a")
		e.getOrBind(e.key("k"), a, e.lt(), a, affinity.Created)
		e.skew(e.idle / 10) // the found binding must keep its own Since
		e.getOrBind(e.key("k"), e.bind("b"), e.lt(), a, affinity.Found)
	}},
	{"idle expiry creates again", func(e *env) {
		e.getOrBind(e.key("k"), e.bind("a"), e.lt(), e.bind("a"), affinity.Created)
		e.advance(e.idle + e.idle/3)
		b := e.bind("b")
		e.getOrBind(e.key("k"), b, e.lt(), b, affinity.Created)
	}},
	{"use refreshes the idle timeout", func(e *env) {
		a := e.bind("a")
		e.getOrBind(e.key("k"), a, e.lt(), a, affinity.Created)
		e.advance(e.idle * 2 / 3)
		e.getOrBind(e.key("k"), e.bind("b"), e.lt(), a, affinity.Found)
		e.advance(e.idle * 2 / 3) // past Idle since creation, not since last use
		e.getOrBind(e.key("k"), e.bind("c"), e.lt(), a, affinity.Found)
		e.advance(e.idle + e.idle/3)
		d := e.bind("d")
		e.getOrBind(e.key("k"), d, e.lt(), d, affinity.Created)
	}},
	{"max exceeded renews", func(e *env) {
		lt := affinity.Lifetime{Idle: time.Hour, Max: 10 * time.Minute}
		a := e.bind("a")
		e.getOrBind(e.key("k"), a, lt, a, affinity.Created)
		e.skew(lt.Max - time.Second)
		e.getOrBind(e.key("k"), e.bind("b"), lt, a, affinity.Found)
		e.skew(time.Second) // exactly Max old: placed again
		c := e.bind("c")
		e.getOrBind(e.key("k"), c, lt, c, affinity.Renewed)
		// Max now counts from the renewal.
		e.skew(lt.Max - time.Second)
		e.getOrBind(e.key("k"), e.bind("d"), lt, c, affinity.Found)
	}},
	{"max zero is no limit", func(e *env) {
		lt := affinity.Lifetime{Idle: time.Hour}
		a := e.bind("a")
		e.getOrBind(e.key("k"), a, lt, a, affinity.Created)
		for range 5 {
			e.skew(50 * time.Minute) // each use is within Idle of the last
			e.getOrBind(e.key("k"), e.bind("b"), lt, a, affinity.Found)
		}
	}},
	{"replace moves a binding still bound to old", func(e *env) {
		e.getOrBind(e.key("k"), e.bind("a"), e.lt(), e.bind("a"), affinity.Created)
		e.skew(e.idle / 10)
		b := e.bind("b")
		e.replace(e.key("k"), "a", b, b)
		e.skew(e.idle / 10)
		e.getOrBind(e.key("k"), e.bind("c"), e.lt(), b, affinity.Found)
	}},
	{"replace keeps a binding another caller moved", func(e *env) {
		a := e.bind("a")
		e.getOrBind(e.key("k"), a, e.lt(), a, affinity.Created)
		e.skew(e.idle / 10)
		e.replace(e.key("k"), "x", e.bind("b"), a)
		e.skew(e.idle / 10)
		e.getOrBind(e.key("k"), e.bind("c"), e.lt(), a, affinity.Found)
	}},
	{"replace stores an absent key", func(e *env) {
		b := e.bind("b")
		e.replace(e.key("k"), "a", b, b)
		e.getOrBind(e.key("k"), e.bind("c"), e.lt(), b, affinity.Found)
	}},
	{"replace stores over an expired binding", func(e *env) {
		e.getOrBind(e.key("k"), e.bind("a"), e.lt(), e.bind("a"), affinity.Created)
		e.advance(e.idle + e.idle/3)
		b := e.bind("b")
		e.replace(e.key("k"), "x", b, b)
	}},
	{"replace refreshes the idle timeout of the kept binding", func(e *env) {
		a := e.bind("a")
		e.getOrBind(e.key("k"), a, e.lt(), a, affinity.Created)
		e.advance(e.idle * 2 / 3)
		e.replace(e.key("k"), "x", e.bind("b"), a)
		e.advance(e.idle * 2 / 3)
		e.getOrBind(e.key("k"), e.bind("c"), e.lt(), a, affinity.Found)
	}},
	{"keys are isolated", func(e *env) {
		a, b := e.bind("a"), e.bind("b")
		e.getOrBind(e.key("k1"), a, e.lt(), a, affinity.Created)
		e.getOrBind(e.key("k2"), b, e.lt(), b, affinity.Created)
		c := e.bind("c")
		e.replace(e.key("k1"), "a", c, c)
		e.getOrBind(e.key("k2"), e.bind("d"), e.lt(), b, affinity.Found)
		e.getOrBind(e.key("k1"), e.bind("d"), e.lt(), c, affinity.Found)
		// A key that is a prefix of another is still its own key.
		p := e.bind("p")
		e.getOrBind(e.key("k"), p, e.lt(), p, affinity.Created)
	}},
	{"racing get-or-bind agree on one winner", func(e *env) {
		key := e.key("k")
		type result struct {
			b   affinity.Binding
			out affinity.Outcome
			err error
		}
		res := make([]result, races)
		race(races, func(i int) {
			b, out, err := e.s.GetOrBind(e.ctx, key, e.bind(fmt.Sprintf("i%02d", i)), e.lt())
			res[i] = result{b, out, err}
		})
		created := 0
		for i, r := range res {
			if r.err != nil {
				e.t.Fatalf("racer %d: %v", i, r.err)
			}
			if r.out == affinity.Created {
				created++
			}
			if diff := cmp.Diff(res[0].b, r.b); diff != "" {
				e.t.Errorf("racer %d disagrees with racer 0 (-0 +%d):\n%s", i, i, diff)
			}
		}
		if created != 1 {
			e.t.Errorf("%d racers saw Created, want exactly 1", created)
		}
		e.getOrBind(key, e.bind("late"), e.lt(), res[0].b, affinity.Found)
	}},
	{"racing replace agree on one winner", func(e *env) {
		key := e.key("k")
		e.getOrBind(key, e.bind("old"), e.lt(), e.bind("old"), affinity.Created)
		e.skew(e.idle / 10)
		type result struct {
			next, got affinity.Binding
			err       error
		}
		res := make([]result, races)
		race(races, func(i int) {
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
		e.getOrBind(key, e.bind("late"), e.lt(), res[0].got, affinity.Found)
	}},
	{"racing renewals past max agree on one winner", func(e *env) {
		key := e.key("k")
		lt := affinity.Lifetime{Idle: e.idle, Max: e.idle / 2}
		e.getOrBind(key, e.bind("old"), lt, e.bind("old"), affinity.Created)
		e.skew(e.idle / 2) // past Max on the caller's clock; the idle timeout still holds
		res := make([]affinity.Binding, races)
		outs := make([]affinity.Outcome, races)
		race(races, func(i int) {
			b, out, err := e.s.GetOrBind(e.ctx, key, e.bind(fmt.Sprintf("i%02d", i)), lt)
			if err != nil {
				e.t.Errorf("racer %d: %v", i, err)
			}
			res[i], outs[i] = b, out
		})
		renewed := 0
		for i := range res {
			if outs[i] == affinity.Renewed {
				renewed++
			}
			if diff := cmp.Diff(res[0], res[i]); diff != "" {
				e.t.Errorf("racer %d disagrees with racer 0:\n%s", i, diff)
			}
		}
		if renewed != 1 || res[0].Instance == "old" {
			e.t.Errorf("%d racers renewed (want 1), binding now %q", renewed, res[0].Instance)
		}
	}},
	{"get-or-bind racing replace never splits", func(e *env) {
		key := e.key("k")
		e.getOrBind(key, e.bind("old"), e.lt(), e.bind("old"), affinity.Created)
		got := make([]affinity.Binding, races)
		race(races, func(i int) {
			var err error
			if i%2 == 0 {
				got[i], err = e.s.Replace(e.ctx, key, "old", e.bind(fmt.Sprintf("r%02d", i)), e.lt())
			} else {
				got[i], _, err = e.s.GetOrBind(e.ctx, key, e.bind(fmt.Sprintf("g%02d", i)), e.lt())
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
	{"bad input is an error, not a binding", func(e *env) {
		ok := e.bind("a")
		bad := []struct {
			name string
			b    affinity.Binding
			lt   affinity.Lifetime
		}{
			{"empty instance", affinity.Binding{Since: e.now}, e.lt()},
			{"zero since", affinity.Binding{Instance: "a"}, e.lt()},
			{"zero idle", ok, affinity.Lifetime{}},
			{"negative idle", ok, affinity.Lifetime{Idle: -time.Second}},
			{"negative max", ok, affinity.Lifetime{Idle: e.idle, Max: -time.Second}},
		}
		for _, c := range bad {
			if b, out, err := e.s.GetOrBind(e.ctx, e.key("k"), c.b, c.lt); err == nil {
				e.t.Errorf("GetOrBind with %s = %+v, %v, want an error", c.name, b, out)
			}
			if b, err := e.s.Replace(e.ctx, e.key("k"), "a", c.b, c.lt); err == nil {
				e.t.Errorf("Replace with %s = %+v, want an error", c.name, b)
			}
		}
		// Nothing was stored by the rejected calls.
		b := e.bind("b")
		e.getOrBind(e.key("k"), b, e.lt(), b, affinity.Created)
	}},
	{"cancelled context is an error", func(e *env) {
		ctx, cancel := context.WithCancel(e.ctx)
		cancel()
		if _, _, err := e.s.GetOrBind(ctx, e.key("k"), e.bind("a"), e.lt()); !errors.Is(err, context.Canceled) {
			e.t.Errorf("GetOrBind with a cancelled context: err = %v, want context.Canceled", err)
		}
		if _, err := e.s.Replace(ctx, e.key("k"), "a", e.bind("a"), e.lt()); !errors.Is(err, context.Canceled) {
			e.t.Errorf("Replace with a cancelled context: err = %v, want context.Canceled", err)
		}
	}},
}

// race runs f(0..n-1) on n goroutines released together, to maximise overlap.
func race(n int, f func(i int)) {
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
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := &env{t: t, h: h, s: h.New(t), now: start, idle: idle, ctx: t.Context(), space: t.Name()}
			c.run(e)
		})
	}
}

// Benchmark measures GetOrBind on s: the Found path (one hot key) and the
// Created path (a new key per call), serial and with b.RunParallel. It
// reports no verdict; compare stores as ratios within one run.
func Benchmark(b *testing.B, s affinity.Store) {
	lt := affinity.Lifetime{Idle: time.Hour, Max: time.Hour}
	cand := affinity.Binding{Instance: "inst-a", Since: start}
	ctx := context.Background()
	var seq atomic.Int64 // keys never repeat across sub-benchmark reruns
	call := func(b *testing.B, key string, want affinity.Outcome) {
		if _, out, err := s.GetOrBind(ctx, key, cand, lt); err != nil || out != want {
			b.Fatalf("GetOrBind(%q) = %v, %v; want %v", key, out, err, want)
		}
	}
	hot := fmt.Sprintf("bench/hot/%d", seq.Add(1))
	if _, _, err := s.GetOrBind(ctx, hot, cand, lt); err != nil {
		b.Fatal(err)
	}
	b.Run("found", func(b *testing.B) {
		for b.Loop() {
			call(b, hot, affinity.Found)
		}
	})
	b.Run("created", func(b *testing.B) {
		for b.Loop() {
			call(b, fmt.Sprintf("bench/new/%d", seq.Add(1)), affinity.Created)
		}
	})
	b.Run("found-parallel", func(b *testing.B) {
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				call(b, hot, affinity.Found)
			}
		})
	})
	b.Run("created-parallel", func(b *testing.B) {
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				call(b, fmt.Sprintf("bench/new/%d", seq.Add(1)), affinity.Created)
			}
		})
	})
}
