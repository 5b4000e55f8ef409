package affinity_test

import (
	"context"
	"testing"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/store/memory"
)

// TestHitIsNotRanked: a session the store can peek at is not placed again
// on each request. The fail-open choice, which only a placement reads,
// is asked once, for the bind; the hits that follow do not ask, and stay.
func TestHitIsNotRanked(t *testing.T) {
	ctx := context.Background()
	asked := 0
	pool := func(h identity.Headers, all []fleet.Instance) (string, bool) {
		asked++
		return poolOf(h, all)
	}
	d := affinity.New(memory.New(), fleet.New(instances(4)), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime}, affinity.WithFailOpen(pool))
	for i := range 5 {
		dec, err := d.Decide(ctx, pooled("s", "gpu-2"))
		if err != nil {
			t.Fatal(err)
		}
		d.Finish(dec, fleet.Outcome{Answered: true})
		if want := map[bool]affinity.Kind{true: affinity.KindBind, false: affinity.KindHit}[i == 0]; dec.Kind != want || dec.Instance.Name != "gpu-2" {
			t.Fatalf("request %d: %s on %s, want %s on gpu-2", i, dec.Kind, dec.Instance.Name, want)
		}
	}
	if asked != 1 {
		t.Errorf("the fail-open choice was asked %d times over a bind and 4 hits, want once", asked)
	}
}

// peekedStore peeks at a binding its store does not hold: the session's
// binding went between the peek and the store's answer.
type peekedStore struct {
	*memory.Store
	b bindings.Binding
}

func (s peekedStore) Peek(string, time.Time, bindings.Lifetime) (bindings.Binding, bool) {
	return s.b, true
}

// TestPeekedBindingGoneIsBoundAgain: a session peeked on gpu-1 whose
// binding is gone by the time the store answers is bound to gpu-1 again,
// and the load view counts it there. A peek at an instance that is not
// available is ignored: the session is ranked.
func TestPeekedBindingGoneIsBoundAgain(t *testing.T) {
	ctx := context.Background()
	fl := fleet.New(instances(4))
	load := affinity.NewLoad()
	d := affinity.New(peekedStore{memory.New(), bindings.Binding{Instance: "gpu-1"}}, fl,
		affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime}, affinity.WithLoad(load))
	dec, err := d.Decide(ctx, session("gone"))
	if err != nil {
		t.Fatal(err)
	}
	if dec.Kind != affinity.KindBind || dec.Instance.Name != "gpu-1" {
		t.Errorf("%s on %s, want a bind on gpu-1", dec.Kind, dec.Instance.Name)
	}
	if n := load.Active("gpu-1"); n != 1 {
		t.Errorf("gpu-1 has %d sessions in the load view, want 1", n)
	}
	d = affinity.New(peekedStore{memory.New(), bindings.Binding{Instance: "gpu-9"}}, fl,
		affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime})
	dec, err = d.Decide(ctx, session("elsewhere"))
	if err != nil {
		t.Fatal(err)
	}
	if want := affinity.Rendezvous("s:elsewhere", fl.All()); dec.Kind != affinity.KindBind || dec.Instance != want {
		t.Errorf("peeked at an unknown instance: %s on %s, want a bind on %s, the ranking's", dec.Kind, dec.Instance.Name, want.Name)
	}
}
