package replicas_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/prometheus/client_golang/prometheus"
	goredis "github.com/redis/go-redis/v9"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/metrics"
	"github.com/tetherproxy/tether/replicas"
	redisstore "github.com/tetherproxy/tether/store/redis"
)

// replicaUnderTest is one tether replica's breaker, decider and sharing
// loop over a shared store.
type replicaUnderTest struct {
	breaker *fleet.Breaker
	decider *affinity.Decider
}

func startReplica(t *testing.T, ctx context.Context, store *redisstore.Store, fl *fleet.Fleet, name string) *replicaUnderTest {
	t.Helper()
	cfg := fleet.BreakerConfig{Threshold: 3, Window: 30 * time.Second, Cooldown: 2 * time.Second}
	reg := prometheus.NewRegistry()
	var br *fleet.Breaker
	rec := metrics.NewBreaker(reg, func() uint64 { return br.Dropped() })
	br = fleet.NewBreaker(cfg, nil, rec.Changed)
	d := affinity.New(store, fl, affinity.Policy{Mode: affinity.Sticky, Lifetime: bindings.Lifetime{Idle: time.Minute}},
		affinity.WithBreaker(br), affinity.WithLoad(affinity.NewLoad()))
	share := &replicas.CircuitShare{Replica: name, Breaker: br, Store: store, Index: store, Mover: d,
		Known: func(in string) bool { _, ok := fl.Lookup(in); return ok }, Recorder: rec, Log: zerolog.Nop()}
	done := make(chan struct{})
	go func() { defer close(done); share.Run(ctx) }()
	t.Cleanup(func() { <-done })
	return &replicaUnderTest{breaker: br, decider: d}
}

// TestReplicasAgreeOnCircuits: failures seen by two replicas add up in the
// store, the replica whose report opened the circuit moves the sessions,
// the other replica follows the shared circuit, and a good probe on one
// closes it on both.
func TestReplicasAgreeOnCircuits(t *testing.T) {
	m := miniredis.RunT(t)
	client := goredis.NewClient(&goredis.Options{Addr: m.Addr(), ContextTimeoutEnabled: true})
	defer client.Close()
	store, err := redisstore.New(client, redisstore.Options{Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	var instances []fleet.Instance
	for _, z := range []string{"z1", "z2"} {
		for i := range 2 {
			instances = append(instances, fleet.Instance{Name: fmt.Sprintf("%s-%d", z, i), Address: fmt.Sprintf("127.0.0.1:%d", 9000+len(instances)), Zone: z, Weight: 1, KVSessions: 1000})
		}
	}
	fl := fleet.New(instances)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	a := startReplica(t, ctx, store, fl, "replica-a")
	b := startReplica(t, ctx, store, fl, "replica-b")

	// Sessions, placed through replica a.
	bound := map[string]string{}
	for i := range 100 {
		id := identity.Identity{Key: fmt.Sprint("s:", i), Source: identity.SourceSession}
		dec, err := a.decider.Decide(ctx, affinity.Request{ID: id})
		if err != nil {
			t.Fatal(err)
		}
		a.decider.Finish(dec, fleet.Outcome{Answered: true})
		bound[id.Key] = dec.Instance.Name
	}
	// Two failures of z1-0 on each replica: neither opens it alone …
	for range 2 {
		for _, r := range []*replicaUnderTest{a, b} {
			r.breaker.Done("z1-0", r.breaker.Begin("z1-0"), fleet.Outcome{Answered: true, Failed: true})
		}
	}
	// … but the fleet's count (4 > 3) does, and both replicas keep it out.
	waitUntil(t, "both replicas see z1-0 open", func() bool {
		return a.breaker.State("z1-0") == fleet.Open && b.breaker.State("z1-0") == fleet.Open
	})
	// The replica that tipped it moved z1-0's sessions to z1-1 before
	// their next request.
	waitUntil(t, "z1-0's sessions moved", func() bool {
		sessions, err := store.Bound(ctx, "z1-0", 0, time.Now())
		return err == nil && len(sessions) == 0
	})
	moved := 0
	for key, was := range bound {
		s, ok, err := store.Show(ctx, key, time.Now())
		if err != nil || !ok {
			t.Fatalf("session %s lost: %v", key, err)
		}
		switch {
		case was == "z1-0":
			moved++
			if s.Binding.Instance != "z1-1" {
				t.Errorf("%s moved from z1-0 to %s, want z1-1 (same zone)", key, s.Binding.Instance)
			}
		case s.Binding.Instance != was:
			t.Errorf("%s moved from %s to %s though its instance is fine", key, was, s.Binding.Instance)
		}
	}
	if moved == 0 {
		t.Fatal("no session was on z1-0; the test proves nothing")
	}

	// After the cooldown, a good probe on b closes the circuit for a too.
	waitUntil(t, "half-open on b", func() bool { return b.breaker.State("z1-0") == fleet.HalfOpen })
	b.breaker.Done("z1-0", b.breaker.Begin("z1-0"), fleet.Outcome{Answered: true})
	waitUntil(t, "closed on a", func() bool { return a.breaker.State("z1-0") == fleet.Closed })
	cancel()
}

// waitUntil waits, at most 5 s, until cond holds.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
