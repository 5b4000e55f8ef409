package affinity_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/replicas"
	"github.com/tetherproxy/tether/store/memory"
)

func instances(n int) []fleet.Instance {
	out := make([]fleet.Instance, n)
	for i := range out {
		out[i] = fleet.Instance{Name: fmt.Sprintf("gpu-%d", i), Zone: fmt.Sprintf("z%d", i%2), Weight: 1}
	}
	return out
}

// clock is a settable time source.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

var lifetime = bindings.Lifetime{Idle: 30 * time.Minute, Max: 1800 * time.Second}

// syncLoad runs one load sync of l, as replica through st, over the
// instances named.
func syncLoad(ctx context.Context, l *affinity.Load, st replicas.LoadSyncer, replica string, names []string, now time.Time) error {
	all := make([]fleet.Instance, len(names))
	for i, n := range names {
		all[i].Name = n
	}
	sync := replicas.LoadSync{Replica: replica, View: l, Store: st, Instances: func() []fleet.Instance { return all }}
	return sync.Sync(ctx, now)
}

func session(s string) affinity.Request {
	return affinity.Request{ID: identity.Identity{Key: "s:" + s, Source: identity.SourceSession}}
}

func TestStickyLifecycle(t *testing.T) {
	ctx := context.Background()
	clk := &clock{t: time.Unix(1_700_000_000, 0)}
	fl := fleet.New(instances(8))
	d := affinity.New(memory.New(), fl, affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime}, affinity.WithClock(clk.now))

	first, err := d.Decide(ctx, session("a"))
	if err != nil {
		t.Fatal(err)
	}
	if first.Kind != affinity.KindBind || first.Instance != affinity.Rendezvous("s:a", fl.All()) {
		t.Fatalf("first request: %+v, want bind on the rendezvous choice", first)
	}
	clk.add(10 * time.Minute)
	if got, _ := d.Decide(ctx, session("a")); got.Kind != affinity.KindHit || got.Instance != first.Instance {
		t.Fatalf("follow-up: %+v, want hit on %s", got, first.Instance.Name)
	}
	// Idle expiry: 31 minutes without use.
	clk.add(31 * time.Minute)
	if got, _ := d.Decide(ctx, session("a")); got.Kind != affinity.KindBind {
		t.Fatalf("after idle timeout: %+v, want a new bind", got)
	}
	// Kept busy past max_sticky_duration: placed again.
	for i := 0; i < 5; i++ {
		clk.add(5 * time.Minute)
		if got, _ := d.Decide(ctx, session("a")); got.Kind != affinity.KindHit {
			t.Fatalf("turn %d: %+v, want hit", i, got)
		}
	}
	clk.add(5 * time.Minute)
	if got, _ := d.Decide(ctx, session("a")); got.Kind != affinity.KindRebind {
		t.Fatalf("past max_sticky_duration: %+v, want rebind", got)
	}
}

func TestBindingOutlivesFleetChange(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	fl := fleet.New(instances(8))
	d := affinity.New(st, fl, affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime})

	before := map[string]string{}
	for i := 0; i < 200; i++ {
		got, err := d.Decide(ctx, session(fmt.Sprint(i)))
		if err != nil {
			t.Fatal(err)
		}
		if got.Previous != "" {
			t.Fatalf("new session %d: previous instance %q, want none", i, got.Previous)
		}
		before[fmt.Sprint(i)] = got.Instance.Name
	}
	// Reweight: rendezvous now prefers other instances for many keys, but
	// bound sessions stay put.
	re := instances(8)
	for i := range re {
		re[i].Weight = float64(i + 1)
	}
	fl.Replace(re)
	for k, inst := range before {
		got, _ := d.Decide(ctx, session(k))
		if got.Kind != affinity.KindHit || got.Instance.Name != inst {
			t.Fatalf("session %s moved from %s to %+v after a reweight", k, inst, got)
		}
	}
	// Remove gpu-3: exactly its sessions move, to a rendezvous choice.
	fl.Replace(append(append([]fleet.Instance{}, re[:3]...), re[4:]...))
	moved := 0
	for k, inst := range before {
		got, _ := d.Decide(ctx, session(k))
		if got.Previous != inst {
			// Continuity is measured on it: the instance of the last turn.
			t.Fatalf("session %s was on %s; decision %+v names %q as its previous instance", k, inst, got, got.Previous)
		}
		switch {
		case inst == "gpu-3" && (got.Kind != affinity.KindMoved || got.Instance.Name == "gpu-3"):
			t.Fatalf("session %s on removed gpu-3: %+v, want moved", k, got)
		case inst == "gpu-3":
			moved++
		case got.Instance.Name != inst:
			t.Fatalf("session %s moved from %s to %s though its instance stayed", k, inst, got.Instance.Name)
		}
	}
	if moved == 0 {
		t.Fatal("no session was on gpu-3; the test proves nothing")
	}
}

// failingStore fails every call.
type failingStore struct{}

var errDown = errors.New("connection refused")

func (failingStore) GetOrBind(context.Context, bindings.Lookup) (bindings.Result, error) {
	return bindings.Result{}, errDown
}

func (failingStore) Replace(context.Context, string, string, bindings.Binding, bindings.Lifetime) (bindings.Binding, error) {
	return bindings.Binding{}, errDown
}

func TestStoreDownFallsBackToRendezvous(t *testing.T) {
	fl := fleet.New(instances(8))
	d := affinity.New(failingStore{}, fl, affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime})
	got, err := d.Decide(context.Background(), session("x"))
	if err != nil {
		t.Fatal(err)
	}
	if got.Kind != affinity.KindDegraded || !errors.Is(got.Err, errDown) || got.Instance != affinity.Rendezvous("s:x", fl.All()) {
		t.Fatalf("got %+v, want degraded on the rendezvous choice", got)
	}
}

func TestRandomRouting(t *testing.T) {
	fl := fleet.New(instances(8))
	tests := []struct {
		name   string
		policy affinity.Policy
		id     affinity.Request
		kind   affinity.Kind
	}{
		{"random mode", affinity.Policy{Mode: affinity.Random}, session("a"), affinity.KindRandom},
		{"anonymous under sticky", affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime}, affinity.Request{ID: identity.Identity{Source: identity.SourceAnonymous}}, affinity.KindAnonymous},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			st := memory.New()
			d := affinity.New(st, fl, tc.policy, affinity.WithRand(rand.New(rand.NewPCG(1, 2)).Uint64))
			seen := map[string]bool{}
			for i := 0; i < 200; i++ {
				got, err := d.Decide(context.Background(), tc.id)
				if err != nil || got.Kind != tc.kind {
					t.Fatalf("got %+v, %v; want kind %s", got, err, tc.kind)
				}
				seen[got.Instance.Name] = true
			}
			if len(seen) != 8 {
				t.Fatalf("200 random decisions reached %d of 8 instances", len(seen))
			}
			if st.Len() != 0 {
				t.Fatalf("random routing wrote %d bindings", st.Len())
			}
		})
	}
}

// chiSquare returns the statistic for counts against expected shares.
func chiSquare(counts []int, shares []float64, n int) float64 {
	x := 0.0
	for i, c := range counts {
		e := shares[i] * float64(n)
		x += (float64(c) - e) * (float64(c) - e) / e
	}
	return x
}

// Critical values of the chi-square distribution at the 1% level.
var chi2Crit01 = map[int]float64{3: 11.345, 7: 18.475}

func TestRandomIsUnbiased(t *testing.T) {
	tests := []struct {
		name    string
		weights []float64
	}{
		{"8 equal", []float64{1, 1, 1, 1, 1, 1, 1, 1}},
		{"weighted 1:2:3:4", []float64{1, 2, 3, 4}},
	}
	for _, tc := range tests {
		for seed := uint64(1); seed <= 3; seed++ {
			t.Run(fmt.Sprintf("%s/seed%d", tc.name, seed), func(t *testing.T) {
				ins := instances(len(tc.weights))
				total := 0.0
				for i, w := range tc.weights {
					ins[i].Weight, total = w, total+w
				}
				shares := make([]float64, len(ins))
				for i, w := range tc.weights {
					shares[i] = w / total
				}
				d := affinity.New(memory.New(), fleet.New(ins), affinity.Policy{Mode: affinity.Random},
					affinity.WithRand(rand.New(rand.NewPCG(seed, 99)).Uint64))
				const n = 4000
				counts := make([]int, len(ins))
				for i := 0; i < n; i++ {
					got, _ := d.Decide(context.Background(), affinity.Request{})
					var idx int
					if _, err := fmt.Sscanf(got.Instance.Name, "gpu-%d", &idx); err != nil {
						t.Fatalf("instance %q: %v", got.Instance.Name, err)
					}
					counts[idx]++
				}
				if x := chiSquare(counts, shares, n); x > chi2Crit01[len(ins)-1] {
					t.Fatalf("chi-square %.2f > %.3f (1%%, %d df): counts %v", x, chi2Crit01[len(ins)-1], len(ins)-1, counts)
				}
			})
		}
	}
}

func TestRendezvousSpreadsByWeight(t *testing.T) {
	ins := instances(4)
	for i := range ins {
		ins[i].Weight = float64(i + 1)
	}
	const n = 20000
	counts := make([]int, 4)
	for i := 0; i < n; i++ {
		in := affinity.Rendezvous(fmt.Sprintf("s:%d", i), ins)
		var idx int
		if _, err := fmt.Sscanf(in.Name, "gpu-%d", &idx); err != nil {
			t.Fatalf("instance %q: %v", in.Name, err)
		}
		counts[idx]++
	}
	// Keys are fixed, so this is deterministic; the bound is the 1% level.
	if x := chiSquare(counts, []float64{.1, .2, .3, .4}, n); x > chi2Crit01[3] {
		t.Fatalf("rendezvous shares %v do not follow weights 1:2:3:4 (chi-square %.2f)", counts, x)
	}
}

func TestRendezvousMovesOnlyWhatItMust(t *testing.T) {
	ins := instances(8)
	const n = 8000
	grown := append(append([]fleet.Instance{}, ins...), fleet.Instance{Name: "gpu-new", Weight: 1})
	shrunk := append(append([]fleet.Instance{}, ins[:5]...), ins[6:]...) // without gpu-5
	toNew := 0
	for i := 0; i < n; i++ {
		k := fmt.Sprintf("s:%d", i)
		was := affinity.Rendezvous(k, ins)
		if now := affinity.Rendezvous(k, grown); now != was {
			if now.Name != "gpu-new" {
				t.Fatalf("adding an instance moved %s from %s to %s", k, was.Name, now.Name)
			}
			toNew++
		}
		if now := affinity.Rendezvous(k, shrunk); now != was && was.Name != "gpu-5" {
			t.Fatalf("removing gpu-5 moved %s from %s", k, was.Name)
		}
	}
	if share := float64(toNew) / n; math.Abs(share-1.0/9) > 0.02 {
		t.Fatalf("new instance took %.3f of keys, want about 1/9", share)
	}
}

func TestNoInstance(t *testing.T) {
	d := affinity.New(memory.New(), fleet.New(nil), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime})
	if _, err := d.Decide(context.Background(), session("a")); !errors.Is(err, affinity.ErrNoInstance) {
		t.Fatalf("err = %v, want ErrNoInstance", err)
	}
}

func TestConcurrentDecisionsAgree(t *testing.T) {
	st := memory.New()
	fl := fleet.New(instances(8))
	// Two deciders with different weights (as during a config rollout)
	// would place differently; the shared store makes them agree.
	skew := instances(8)
	for i := range skew {
		skew[i].Weight = float64(8 - i)
	}
	a := affinity.New(st, fl, affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime})
	b := affinity.New(st, fleet.New(skew), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime})
	var wg sync.WaitGroup
	results := make([][2]string, 300)
	for i := range results {
		wg.Add(2)
		for j, d := range []*affinity.Decider{a, b} {
			go func() {
				defer wg.Done()
				got, err := d.Decide(context.Background(), session(fmt.Sprint(i)))
				if err != nil {
					t.Error(err)
				}
				results[i][j] = got.Instance.Name
			}()
		}
	}
	wg.Wait()
	for i, r := range results {
		if r[0] != r[1] {
			t.Fatalf("session %d: replicas chose %s and %s", i, r[0], r[1])
		}
	}
}

// blockingStore waits until the caller gives up.
type blockingStore struct{}

func (blockingStore) GetOrBind(ctx context.Context, _ bindings.Lookup) (bindings.Result, error) {
	<-ctx.Done()
	return bindings.Result{}, ctx.Err()
}

func (blockingStore) Replace(ctx context.Context, _ string, _ string, _ bindings.Binding, _ bindings.Lifetime) (bindings.Binding, error) {
	<-ctx.Done()
	return bindings.Binding{}, ctx.Err()
}

func TestCanceledRequestIsNotAStoreFailure(t *testing.T) {
	d := affinity.New(blockingStore{}, fleet.New(instances(8)), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	got, err := d.Decide(ctx, session("x"))
	if !errors.Is(err, context.DeadlineExceeded) || got.Kind != "" {
		t.Fatalf("got %+v, %v; want no decision and the context's error", got, err)
	}
}

func TestUnknownInstanceFromAnotherReplicaIsDegraded(t *testing.T) {
	st := memory.New()
	ctx := context.Background()
	now := time.Unix(1_700_000_000, 0)
	// Another replica bound the session to gpu-9, which this one lacks.
	if _, err := st.GetOrBind(ctx, bindings.Lookup{Key: "s:x", Candidate: bindings.Binding{Instance: "gpu-9", Since: now}, Lifetime: lifetime}); err != nil {
		t.Fatal(err)
	}
	race := &replaceLoser{Store: st, winner: "gpu-10"}
	d := affinity.New(race, fleet.New(instances(8)), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime}, affinity.WithClock(func() time.Time { return now }))
	got, err := d.Decide(ctx, session("x"))
	if err != nil || got.Kind != affinity.KindDegraded || !errors.Is(got.Err, affinity.ErrFleetMismatch) {
		t.Fatalf("got %+v, %v; want degraded with ErrFleetMismatch", got, err)
	}
}

// replaceLoser makes every Replace lose to winner, as if another replica
// (with a different fleet) moved the session first.
type replaceLoser struct {
	*memory.Store
	winner string
}

func (r *replaceLoser) Replace(ctx context.Context, key, _ string, next bindings.Binding, lt bindings.Lifetime) (bindings.Binding, error) {
	return r.Store.Replace(ctx, key, "gpu-9", bindings.Binding{Instance: r.winner, Since: next.Since}, lt)
}
