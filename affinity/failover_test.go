package affinity_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/store/memory"
)

// zoned is two zones of two instances each, all of version v1.
func zoned() []fleet.Instance {
	var out []fleet.Instance
	for _, z := range []string{"z1", "z2"} {
		for i := range 2 {
			out = append(out, fleet.Instance{Name: fmt.Sprintf("%s-%d", z, i), Zone: z, Version: "v1", Weight: 1, KVSessions: 100})
		}
	}
	return out
}

type failoverEnv struct {
	t       *testing.T
	clk     *clock
	store   *memory.Store
	breaker *fleet.Breaker
	d       *affinity.Decider
}

func newFailoverEnv(t *testing.T, p affinity.Policy, instances []fleet.Instance) *failoverEnv {
	clk := &clock{t: time.Unix(1_700_000_000, 0)}
	st := memory.New()
	br := fleet.NewBreaker(fleet.DefaultBreaker, clk.now, nil)
	d := affinity.New(st, fleet.New(instances), p, affinity.WithClock(clk.now), affinity.WithBreaker(br))
	return &failoverEnv{t: t, clk: clk, store: st, breaker: br, d: d}
}

// evacuate moves instance's sessions as replicas.CircuitShare does: read
// from the store's index, then handed to the decider.
func evacuate(t *testing.T, e *failoverEnv, instance string) (int, error) {
	t.Helper()
	sessions, err := e.store.Bound(context.Background(), instance, 0, e.clk.now())
	if err != nil {
		return 0, err
	}
	return e.d.Evacuate(context.Background(), instance, sessions)
}

// kill fails requests to instance until its circuit opens.
func (e *failoverEnv) kill(instance string) {
	e.t.Helper()
	for range fleet.DefaultBreaker.Threshold + 1 {
		probe := e.breaker.Begin(instance)
		e.breaker.Done(instance, probe, fleet.Outcome{Answered: true, Failed: true})
	}
	if e.breaker.Available(instance) {
		e.t.Fatalf("%s still available", instance)
	}
}

func (e *failoverEnv) decide(req affinity.Request) (affinity.Decision, error) {
	dec, err := e.d.Decide(context.Background(), req)
	if err == nil {
		e.d.Finish(dec, fleet.Outcome{Answered: true})
	}
	return dec, err
}

func (e *failoverEnv) must(req affinity.Request) affinity.Decision {
	e.t.Helper()
	dec, err := e.decide(req)
	if err != nil {
		e.t.Fatalf("Decide(%s): %v", req.ID.Key, err)
	}
	return dec
}

func (e *failoverEnv) binding(key string) bindings.Binding {
	e.t.Helper()
	s, ok, err := e.store.Show(context.Background(), key, e.clk.now())
	if err != nil || !ok {
		e.t.Fatalf("Show(%s): %v, %v", key, ok, err)
	}
	return s.Binding
}

// sessionOn places new sessions until one lands on instance.
func (e *failoverEnv) sessionOn(instance string) affinity.Request {
	e.t.Helper()
	for i := range 1000 {
		req := session(fmt.Sprint("probe-", instance, "-", i))
		if e.must(req).Instance.Name == instance {
			return req
		}
	}
	e.t.Fatalf("no session placed on %s", instance)
	return affinity.Request{}
}

func TestGradualLadder(t *testing.T) {
	e := newFailoverEnv(t, affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime}, zoned())
	req := e.sessionOn("z1-0")
	other := e.sessionOn("z2-1")

	e.kill("z1-0")
	got := e.must(req)
	if got.Kind != affinity.KindFailover || got.Stage != affinity.StageSameZone || got.Instance.Name != "z1-1" {
		t.Fatalf("first failover: %s %s on %s, want failover same_zone on z1-1", got.Kind, got.Stage, got.Instance.Name)
	}
	if b := e.binding(req.ID.Key); b.Instance != "z1-1" || b.Failovers != 1 {
		t.Fatalf("binding after the first failover: %+v", b)
	}
	if got := e.must(req); got.Kind != affinity.KindHit || got.Instance.Name != "z1-1" {
		t.Fatalf("next turn: %s on %s, want a hit on z1-1", got.Kind, got.Instance.Name)
	}
	if got := e.must(other); got.Kind != affinity.KindHit || got.Instance.Name != "z2-1" {
		t.Fatalf("a session on another instance: %s on %s, want a hit on z2-1", got.Kind, got.Instance.Name)
	}

	// Its new instance fails too: another zone, even though z1 has no
	// other instance left anyway.
	e.kill("z1-1")
	got = e.must(req)
	if got.Kind != affinity.KindFailover || got.Stage != affinity.StageOtherZone || got.Instance.Zone != "z2" {
		t.Fatalf("second failover: %s %s on %s", got.Kind, got.Stage, got.Instance.Name)
	}
	third := got.Instance.Name

	// And that one: random routing for the session, binding kept.
	e.kill(third)
	for range 20 {
		got = e.must(req)
		if got.Kind != affinity.KindFallback || got.Stage != affinity.StageRandom || got.Mode != affinity.Random || got.Instance.Name == third {
			t.Fatalf("third failover: %s %s %s on %s", got.Mode, got.Kind, got.Stage, got.Instance.Name)
		}
	}
	if b := e.binding(req.ID.Key); b.Instance != third || b.Failovers != 2 {
		t.Fatalf("binding during random fallback: %+v", b)
	}
	// Its instance comes back (a good probe closes the circuit): the
	// session is sticky there again.
	e.clk.add(fleet.DefaultBreaker.Cooldown)
	probe := e.breaker.Begin(third)
	e.breaker.Done(third, probe, fleet.Outcome{Answered: true})
	if got := e.must(req); got.Kind != affinity.KindHit || got.Instance.Name != third {
		t.Fatalf("after recovery: %s on %s, want a hit on %s", got.Kind, got.Instance.Name, third)
	}
}

func TestLadderSkipsAnEmptyZone(t *testing.T) {
	instances := zoned()[1:] // z1-1 alone in z1
	e := newFailoverEnv(t, affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime}, instances)
	var req affinity.Request
	for i := range 1000 {
		req = session(fmt.Sprint("s", i))
		if e.must(req).Instance.Name == "z1-1" {
			break
		}
	}
	e.kill("z1-1")
	got := e.must(req)
	if got.Kind != affinity.KindFailover || got.Stage != affinity.StageOtherZone || got.Instance.Zone != "z2" {
		t.Fatalf("%s %s on %s, want failover other_zone in z2", got.Kind, got.Stage, got.Instance.Name)
	}
	if b := e.binding(req.ID.Key); b.Failovers != 1 {
		t.Errorf("failovers = %d, want 1", b.Failovers)
	}
}

// TestLadderInOneZone: with a single zone the second failover stays in
// it (there is no other zone to try) rather than giving up stickiness;
// the third routes at random. Ten minutes after its last failover a
// session starts the ladder again.
func TestLadderInOneZone(t *testing.T) {
	var instances []fleet.Instance
	for i := range 4 {
		instances = append(instances, fleet.Instance{Name: fmt.Sprint("z-", i), Zone: "z", Version: "v1", Weight: 1, KVSessions: 100})
	}
	e := newFailoverEnv(t, affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime}, instances)
	req := session("one-zone")
	first := e.must(req).Instance.Name
	e.kill(first)
	second := e.must(req)
	e.kill(second.Instance.Name)
	third := e.must(req)
	if third.Kind != affinity.KindFailover || third.Stage != affinity.StageSameZone {
		t.Fatalf("second failover in a one-zone fleet: %s %s on %s, want a same-zone rebind", third.Kind, third.Stage, third.Instance.Name)
	}
	if b := e.binding(req.ID.Key); b.Failovers != 2 || b.Instance != third.Instance.Name {
		t.Fatalf("binding after two failovers: %+v", b)
	}
	e.kill(third.Instance.Name)
	if got := e.must(req); got.Kind != affinity.KindFallback {
		t.Fatalf("third failover: %s, want fallback (random)", got.Kind)
	}
	// Much later, its instance still out: the ladder starts over, and the
	// session is bound again instead of random for good.
	e.clk.add(11 * time.Minute)
	for _, in := range []string{first, second.Instance.Name, third.Instance.Name} {
		e.kill(in) // keep them out past their cooldowns
	}
	got := e.must(req)
	if got.Kind != affinity.KindFailover || got.Stage != affinity.StageSameZone {
		t.Fatalf("after the ladder's memory: %s %s on %s, want a failover again", got.Kind, got.Stage, got.Instance.Name)
	}
	if b := e.binding(req.ID.Key); b.Failovers != 1 {
		t.Errorf("failovers after the reset = %d, want 1", b.Failovers)
	}
}

// TestEvacuateAvoidsHalfOpenInstances: an instance whose circuit is
// half-open has not proven itself; evacuated sessions go elsewhere.
func TestEvacuateAvoidsHalfOpenInstances(t *testing.T) {
	e := newFailoverEnv(t, affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime}, zoned())
	var keys []string
	for i := range 100 {
		req := session(fmt.Sprint("s", i))
		if e.must(req).Instance.Name == "z1-0" {
			keys = append(keys, req.ID.Key)
		}
	}
	e.kill("z1-1")
	e.clk.add(fleet.DefaultBreaker.Cooldown) // z1-1 half-open now
	if st := e.breaker.State("z1-1"); st != fleet.HalfOpen {
		t.Fatalf("z1-1 is %v", st)
	}
	e.kill("z1-0")
	if _, err := evacuate(t, e, "z1-0"); err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if b := e.binding(k); b.Instance == "z1-1" || b.Instance == "z1-0" {
			t.Fatalf("%s evacuated to %s", k, b.Instance)
		}
	}
	if len(keys) == 0 {
		t.Fatal("no session on z1-0")
	}
}

func TestFallbackPolicies(t *testing.T) {
	t.Run("random", func(t *testing.T) {
		e := newFailoverEnv(t, affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime, Fallback: affinity.FallbackRandom}, zoned())
		req := e.sessionOn("z1-0")
		e.kill("z1-0")
		seen := map[string]bool{}
		for range 200 {
			got := e.must(req)
			if got.Kind != affinity.KindFallback || got.Instance.Name == "z1-0" {
				t.Fatalf("%s on %s", got.Kind, got.Instance.Name)
			}
			seen[got.Instance.Name] = true
		}
		if len(seen) != 3 {
			t.Errorf("random fallback used %v, want all 3 other instances", seen)
		}
		if b := e.binding(req.ID.Key); b.Instance != "z1-0" || b.Failovers != 0 {
			t.Errorf("binding changed under random fallback: %+v", b)
		}
	})
	t.Run("none", func(t *testing.T) {
		e := newFailoverEnv(t, affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime, Fallback: affinity.FallbackNone}, zoned())
		req := e.sessionOn("z1-0")
		e.kill("z1-0")
		_, err := e.decide(req)
		if !errors.Is(err, affinity.ErrInstanceUnavailable) || !contains(err.Error(), "z1-0", `fallback_policy = "none"`) {
			t.Fatalf("err = %v, want ErrUnavailable naming the instance and the policy", err)
		}
		// New sessions are placed on what is available.
		for i := range 50 {
			if got := e.must(session(fmt.Sprint("new", i))); got.Instance.Name == "z1-0" {
				t.Fatal("a new session was placed on the unavailable instance")
			}
		}
	})
	t.Run("strict version", func(t *testing.T) {
		instances := zoned()
		instances[1].Version = "v2" // z1-0 is the only v1 in z1 …
		instances[2].Version = "v2"
		instances[3].Version = "v2" // … and in the fleet
		e := newFailoverEnv(t, affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime, VersionAffinity: affinity.Strict}, instances)
		req := session("v1-session")
		for i := 0; e.must(req).Instance.Name != "z1-0"; i++ {
			req = session(fmt.Sprint("v1-session", i))
		}
		e.kill("z1-0")
		if _, err := e.decide(req); !errors.Is(err, affinity.ErrNoVersion) {
			t.Fatalf("err = %v, want ErrNoVersion", err)
		}
	})
}

func TestEvacuateMovesOnlyTheFailedInstancesSessions(t *testing.T) {
	e := newFailoverEnv(t, affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime}, zoned())
	before := map[string]string{}
	for i := range 200 {
		req := session(fmt.Sprint("s", i))
		before[req.ID.Key] = e.must(req).Instance.Name
	}
	e.kill("z1-0")
	moved, err := evacuate(t, e, "z1-0")
	if err != nil {
		t.Fatal(err)
	}
	want := 0
	for key, in := range before {
		b := e.binding(key)
		switch {
		case in == "z1-0":
			want++
			if b.Instance != "z1-1" || b.Failovers != 1 {
				t.Errorf("%s: evacuated to %+v, want z1-1 at stage 1", key, b)
			}
		case b.Instance != in:
			t.Errorf("%s moved from %s to %s", key, in, b.Instance)
		}
	}
	if moved != want || want == 0 {
		t.Fatalf("moved %d, want %d", moved, want)
	}
	// Their next turn is a plain hit.
	for key, in := range before {
		if in != "z1-0" {
			continue
		}
		got := e.must(session(key[len("s:"):]))
		if got.Kind != affinity.KindHit || got.Instance.Name != "z1-1" {
			t.Fatalf("%s after evacuation: %s on %s", key, got.Kind, got.Instance.Name)
		}
	}
	// Only the gradual policy evacuates.
	e.d.SetPolicy(affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime, Fallback: affinity.FallbackRandom})
	e.kill("z2-0")
	if n, err := evacuate(t, e, "z2-0"); n != 0 || err != nil {
		t.Errorf("random policy evacuated %d (%v)", n, err)
	}
}

func contains(s string, subs ...string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}

// gatedStore holds the first GetOrBind of key until release is closed,
// after closing entered.
type gatedStore struct {
	*memory.Store
	key              string
	once             sync.Once
	entered, release chan struct{}
}

func (g *gatedStore) GetOrBind(ctx context.Context, l bindings.Lookup) (bindings.Result, error) {
	if l.Key == g.key {
		g.once.Do(func() { close(g.entered); <-g.release })
	}
	return g.Store.GetOrBind(ctx, l)
}

// TestHalfOpenTakesOneProbe: two requests read a half-open instance as
// available at once; the one that begins first is its probe, and the
// other decides again without it instead of probing too.
func TestHalfOpenTakesOneProbe(t *testing.T) {
	clk := &clock{t: time.Unix(1_700_000_000, 0)}
	st := &gatedStore{Store: memory.New(), entered: make(chan struct{}), release: make(chan struct{})}
	br := fleet.NewBreaker(fleet.DefaultBreaker, clk.now, nil)
	d := affinity.New(st, fleet.New(zoned()), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime},
		affinity.WithClock(clk.now), affinity.WithBreaker(br))
	e := &failoverEnv{t: t, clk: clk, store: st.Store, breaker: br, d: d}
	var on []affinity.Request // two sessions bound to z1-0
	for i := 0; len(on) < 2; i++ {
		if i == 1000 {
			t.Fatal("fewer than two of 1000 sessions placed on z1-0")
		}
		if req := session(fmt.Sprint("half-open-", i)); e.must(req).Instance.Name == "z1-0" {
			on = append(on, req)
		}
	}
	first, second := on[0], on[1]
	e.kill("z1-0")
	clk.add(fleet.DefaultBreaker.Cooldown)
	if br.State("z1-0") != fleet.HalfOpen {
		t.Fatalf("z1-0 %v after the cooldown, want half-open", br.State("z1-0"))
	}

	st.key = first.ID.Key
	type result struct {
		dec affinity.Decision
		err error
	}
	done := make(chan result, 1)
	go func() {
		dec, err := d.Decide(context.Background(), first)
		done <- result{dec, err}
	}()
	<-st.entered // first has read z1-0 available, and waits for the store
	dec2, err := d.Decide(context.Background(), second)
	if err != nil || dec2.Instance.Name != "z1-0" {
		t.Fatalf("second request: %+v, %v; want the probe on z1-0", dec2, err)
	}
	close(st.release)
	r := <-done
	if r.err != nil || r.dec.Instance.Name == "z1-0" {
		t.Fatalf("first request, whose read of z1-0 preceded the probe: %+v, %v; want it placed elsewhere", r.dec, r.err)
	}
	d.Finish(r.dec, fleet.Outcome{Answered: true})
	d.Finish(dec2, fleet.Outcome{Answered: true})
	if br.State("z1-0") != fleet.Closed {
		t.Errorf("after the probe answered: %v, want closed", br.State("z1-0"))
	}
}
