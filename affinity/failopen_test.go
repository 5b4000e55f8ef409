package affinity_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/store/memory"
)

// poolOf is a fail-open pool that sends a request to the instance its
// x-pool header names (the ring's choice, in the real one).
func poolOf(h identity.Headers, all []fleet.Instance) (string, bool) {
	if h == nil || h.Get("x-pool") == "" {
		return "", false
	}
	return h.Get("x-pool"), true
}

func pooled(s, instance string) affinity.Request {
	r := session(s)
	r.Headers = identity.Map{"x-pool": instance}
	return r
}

func TestFailOpenPlacesWherePoolSends(t *testing.T) {
	ctx := context.Background()
	fl := fleet.New(instances(4))
	d := affinity.New(memory.New(), fl, affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime}, affinity.WithFailOpen(poolOf))
	// Sessions spread over the pool's choices evenly: every one binds
	// where the pool sends it, none is overridden.
	for i := range 40 {
		want := fmt.Sprintf("gpu-%d", i%4)
		dec, err := d.Decide(ctx, pooled(fmt.Sprint("s", i), want))
		if err != nil {
			t.Fatal(err)
		}
		d.Finish(dec, fleet.Outcome{Answered: true})
		if dec.Kind != affinity.KindBind || dec.Instance.Name != want {
			t.Fatalf("session %d: %s on %s, want a bind on %s", i, dec.Kind, dec.Instance.Name, want)
		}
	}
	if n := d.FailOpenOverrides(); n != 0 {
		t.Errorf("%d overrides, want 0", n)
	}
	// A hit stays where it is bound whatever the pool says.
	if dec, _ := d.Decide(ctx, pooled("s0", "gpu-3")); dec.Kind != affinity.KindHit || dec.Instance.Name != "gpu-0" {
		t.Errorf("follow-up: %s on %s, want a hit on gpu-0", dec.Kind, dec.Instance.Name)
	}
	// No pool choice (no identity header it hashes): rendezvous, as without a pool.
	dec, _ := d.Decide(ctx, session("plain"))
	if dec.Instance != affinity.Rendezvous("s:plain", fl.All()) {
		t.Errorf("no pool choice: %s, want the rendezvous choice", dec.Instance.Name)
	}
}

func TestFailOpenOverriddenOverBound(t *testing.T) {
	ctx := context.Background()
	fl := fleet.New(instances(4))
	d := affinity.New(memory.New(), fl, affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime, Epsilon: 0.25}, affinity.WithFailOpen(poolOf))
	// Every session's pool choice is gpu-1: it takes sessions up to its
	// bound ⌈1.25·(A+1)/4⌉, the rest go elsewhere and are counted.
	on := map[string]int{}
	const n = 40
	for i := range n {
		dec, err := d.Decide(ctx, pooled(fmt.Sprint("s", i), "gpu-1"))
		if err != nil {
			t.Fatal(err)
		}
		on[dec.Instance.Name]++
	}
	over := n - on["gpu-1"]
	if on["gpu-1"] > 13 || on["gpu-1"] < 10 || over == 0 {
		t.Fatalf("placements %v: gpu-1 should stop at its bound", on)
	}
	if got := d.FailOpenOverrides(); got != uint64(over) {
		t.Errorf("%d overrides counted, %d sessions placed off gpu-1", got, over)
	}
	// A pool choice that is not a candidate (not in the fleet) is passed over too.
	before := d.FailOpenOverrides()
	if _, err := d.Decide(ctx, pooled("gone", "gpu-9")); err != nil {
		t.Fatal(err)
	}
	if d.FailOpenOverrides() != before+1 {
		t.Errorf("a pool choice outside the candidates is not counted")
	}
}

func TestFailOpenOverriddenWhenKVFull(t *testing.T) {
	ctx := context.Background()
	p := affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime, Epsilon: 0.25,
		Saturation: affinity.Saturation{KVUsage: 0.8, Stale: time.Minute}}
	d := affinity.New(memory.New(), fleet.New(instances(4)), p, affinity.WithFailOpen(poolOf))
	d.Load().SetEngine("gpu-2", fleet.EngineReading{KVUsage: 0.9, KVKnown: true, At: time.Now()})
	for i := range 8 {
		dec, err := d.Decide(ctx, pooled(fmt.Sprint("s", i), "gpu-2"))
		if err != nil {
			t.Fatal(err)
		}
		if dec.Instance.Name == "gpu-2" {
			t.Fatalf("session %d bound on gpu-2, whose engine reports its KV cache full", i)
		}
	}
	if got := d.FailOpenOverrides(); got != 8 {
		t.Errorf("%d overrides, want 8", got)
	}
	// Room again: the pool's choice takes new sessions.
	d.Load().SetEngine("gpu-2", fleet.EngineReading{KVUsage: 0.2, KVKnown: true, At: time.Now()})
	if dec, _ := d.Decide(ctx, pooled("later", "gpu-2")); dec.Instance.Name != "gpu-2" {
		t.Errorf("with room: %s, want gpu-2", dec.Instance.Name)
	}
}

// TestFailOpenWhenStoreFails: with the store down, a request goes where
// the pool sends it, where new sessions were bound, not to the rendezvous
// choice.
func TestFailOpenWhenStoreFails(t *testing.T) {
	fl := fleet.New(instances(4))
	d := affinity.New(failingStore{}, fl, affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime}, affinity.WithFailOpen(poolOf))
	for i := range 20 {
		r := pooled(fmt.Sprint("down", i), fmt.Sprintf("gpu-%d", i%4))
		dec, err := d.Decide(context.Background(), r)
		if err != nil {
			t.Fatal(err)
		}
		if dec.Kind != affinity.KindDegraded || dec.Instance.Name != r.Headers.Get("x-pool") {
			t.Fatalf("session %d with the store down: %s on %s, want degraded on the pool's %s", i, dec.Kind, dec.Instance.Name, r.Headers.Get("x-pool"))
		}
	}
	if dec, _ := d.Decide(context.Background(), session("plain")); dec.Instance != affinity.Rendezvous("s:plain", fl.All()) {
		t.Errorf("no pool choice, store down: %s, want the rendezvous choice", dec.Instance.Name)
	}
}
