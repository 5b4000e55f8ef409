package affinity

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/store/memory"
)

// TestRankFirstIsFirstOfOrder: the pipeline's pick, one pass without
// sorting, is the first of the whole ranking, on random fleets (1 to 100
// instances, weights, kv_sessions, versions, spot capacity, full caches,
// a fail-open choice) and loads.
func TestRankFirstIsFirstOfOrder(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for n := range 3_000 {
		size := 1 + rng.IntN(100)
		insts := make([]fleet.Instance, size)
		for i := range insts {
			insts[i] = fleet.Instance{Name: fmt.Sprint("gpu-", i), Weight: float64(1 + rng.IntN(3)),
				KVSessions: rng.IntN(30), Version: []string{"v1", "v2"}[rng.IntN(2)], Zone: []string{"a", "b"}[rng.IntN(2)]}
			if rng.IntN(5) == 0 {
				insts[i].Capacity = fleet.Spot
			}
		}
		d := New(memory.New(), fleet.New(insts), Policy{Mode: Sticky, Epsilon: []float64{0, 0.1, 0.25, 1}[rng.IntN(4)],
			Saturation: Saturation{KVUsage: 0.9}})
		for i := range insts {
			d.load.state.Active[insts[i].Name] = rng.IntN(40)
			if rng.IntN(3) == 0 {
				d.load.SetEngine(insts[i].Name, fleet.EngineReading{KVKnown: true, KVUsage: 0.95})
			}
		}
		pl := placement{key: fnv64(fmt.Sprint("session-", n)), from: insts, version: []string{"", "v1", "v2"}[rng.IntN(3)],
			sessions: rng.IntN(4) > 0, spotFirst: rng.IntN(4) == 0}
		if rng.IntN(2) == 0 {
			pl.failOpen = insts[rng.IntN(size)].Name
		}
		if rng.IntN(3) == 0 {
			pl.leave = insts[rng.IntN(size)].Name
		}
		var r Ranking
		d.rank(&pl, &r)
		first, ok := r.First()
		order := r.Order()
		if !ok {
			if len(order) != 0 {
				t.Fatalf("case %d: no first, but an order of %d", n, len(order))
			}
			continue
		}
		if order[0].Name != first.Name {
			t.Fatalf("case %d (%d instances): first %s, order starts with %s", n, size, first.Name, order[0].Name)
		}
	}
}

// TestKVSessionsRaisesTheBound holds the bound to what the README,
// affinity/README.md and docs/config.md say: max(⌈(1+ε) × its weighted
// share⌉, kv_sessions). Four equal instances, 3 sessions in all, the
// hash's choice holding all 3: its share's bound is ⌈1.25 × 4/4⌉ = 2,
// but with kv_sessions 20 it takes the fourth session.
func TestKVSessionsRaisesTheBound(t *testing.T) {
	insts := make([]fleet.Instance, 4)
	for i := range insts {
		insts[i] = fleet.Instance{Name: fmt.Sprint("gpu-", i), Weight: 1, KVSessions: 20}
	}
	d := New(memory.New(), fleet.New(insts), Policy{Mode: Sticky, Epsilon: 0.25})
	key := fnv64("s")
	top := Rendezvous("s", insts)
	d.load.state.Active[top.Name] = 3
	pl := placement{key: key, from: insts, sessions: true}
	var r Ranking
	d.rank(&pl, &r)
	if got, _ := r.First(); got.Name != top.Name {
		t.Errorf("placed on %s; the hash's choice %s holds 3 sessions, under kv_sessions 20", got.Name, top.Name)
	}
	if b := bound(3, insts[0], 4, 0.25); b != 20 {
		t.Errorf("bound = %d, want kv_sessions 20", b)
	}
	insts[0].KVSessions = 0
	if b := bound(3, insts[0], 4, 0.25); b != 2 {
		t.Errorf("bound without kv_sessions = %d, want ⌈1.25 × 4 × 1/4⌉ = 2", b)
	}
}

// TestPickOnEqualWeightsIsRendezvous: on instances of one weight the pick
// orders by the draw alone, without the logarithm, and still chooses as
// weighted rendezvous does.
func TestPickOnEqualWeightsIsRendezvous(t *testing.T) {
	for _, w := range []float64{1, 3.5} {
		insts := make([]fleet.Instance, 40)
		for i := range insts {
			insts[i] = fleet.Instance{Name: fmt.Sprint("gpu-", i), Weight: w}
		}
		d := New(memory.New(), fleet.New(insts), Policy{Mode: Sticky})
		for n := range 2_000 {
			key := fmt.Sprint("k-", n)
			pl := placement{key: fnv64(key), from: insts}
			var r Ranking
			d.rank(&pl, &r)
			if got, want := r.Order()[0].Name, Rendezvous(key, insts).Name; got != want {
				t.Fatalf("weight %g, key %s: picked %s, rendezvous %s", w, key, got, want)
			}
		}
	}
}

func TestShiftFallbacks(t *testing.T) {
	a, b, c, d := fleet.Instance{Name: "a", Version: "v1"}, fleet.Instance{Name: "b", Version: "v1"},
		fleet.Instance{Name: "c", Version: "v1"}, fleet.Instance{Name: "d", Version: "v2"}
	for _, tc := range []struct {
		name     string
		in       []fleet.Instance
		from, to fleet.Instance
		want     []string
	}{
		{"none asked", nil, a, b, nil},
		{"moved to a fallback", []fleet.Instance{b, c}, a, b, []string{"a", "c"}},
		{"moved elsewhere", []fleet.Instance{b, c}, a, d, []string{"b", "c"}},
		{"moved to the last", []fleet.Instance{b, c}, a, c, []string{"a", "b"}},
		{"one long", []fleet.Instance{b}, a, c, []string{"a"}},
	} {
		var got []string
		for _, in := range shiftFallbacks(tc.in, tc.from, tc.to) {
			got = append(got, in.Name)
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestTopIsOrderCut: Top(n) is the first n of Order, for every n.
func TestTopIsOrderCut(t *testing.T) {
	d := New(nil, fleet.New(nil), Policy{})
	from := make([]fleet.Instance, 12)
	for i := range from {
		from[i] = fleet.Instance{Name: string(rune('a' + i)), Weight: float64(1 + i%3)}
	}
	for key := range uint64(50) {
		pl := placement{key: key * 0x9e3779b97f4a7c15, from: from}
		var r Ranking
		d.rank(&pl, &r)
		order := r.Order()
		for n := range len(from) + 2 {
			top := r.Top(n)
			if want := order[:min(n, len(order))]; !slices.EqualFunc(top, want, func(a, b fleet.Instance) bool { return a.Name == b.Name }) {
				t.Fatalf("key %d, n %d: Top %v, Order %v", key, n, top, want)
			}
		}
	}
}

// Order is the whole ranking, best first: what Top cuts short.
func (r *Ranking) Order() []fleet.Instance {
	order := make([]int, r.n)
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int { return r.compare(a, b) })
	out := make([]fleet.Instance, len(order))
	for i, j := range order {
		out[i] = r.from[r.idx()[j]]
	}
	return out
}
