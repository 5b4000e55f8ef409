package affinity

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/tetherproxy/tether/fleet"
)

// chooseByRanking is choose's rule as it was written first: the full
// rendezvous ranking, sorted, then the first instance of it each rule
// accepts. choose finds the same instance without sorting.
func chooseByRanking(key string, cands []fleet.Instance, active []int, full []bool, eps float64) int {
	first := top(key, cands)
	if len(cands) == 1 {
		return first
	}
	total, weight := 0, 0.0
	for i, in := range cands {
		total += active[i]
		weight += in.Weight
	}
	under := func(i int) bool {
		return active[i] < ceil((1+eps)*float64(total+1)*cands[i].Weight/weight)
	}
	room := func(i int) bool { return active[i] < cands[i].KVSessions }
	free := func(i int) bool { return full == nil || !full[i] }
	if under(first) && room(first) && free(first) {
		return first
	}
	order := ranking(key, cands, nil, nil)
	for _, ok := range []func(int) bool{
		func(i int) bool { return under(i) && room(i) && free(i) },
		func(i int) bool { return under(i) && free(i) },
		func(i int) bool { return under(i) && room(i) },
		under,
	} {
		for _, i := range order {
			if ok(i) {
				return i
			}
		}
	}
	return first
}

// TestChooseMatchesRanking compares choose with chooseByRanking on random
// fleets (1 to 100 instances, weights, kv_sessions, full caches), loads
// and epsilons.
func TestChooseMatchesRanking(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for n := range 20_000 {
		size := 1 + rng.IntN(100)
		cands := make([]fleet.Instance, size)
		active := make([]int, size)
		var full []bool
		if rng.IntN(2) == 0 {
			full = make([]bool, size)
		}
		for i := range cands {
			cands[i] = fleet.Instance{Name: fmt.Sprint("gpu-", i), Weight: float64(1 + rng.IntN(3)), KVSessions: rng.IntN(30)}
			active[i] = rng.IntN(40)
			if full != nil {
				full[i] = rng.IntN(3) == 0
			}
		}
		eps := []float64{0, 0.1, 0.25, 1}[rng.IntN(4)]
		key := fmt.Sprint("session-", n)
		got, _ := choose(key, cands, active, full, eps, -1)
		if want := chooseByRanking(key, cands, active, full, eps); got != want {
			t.Fatalf("case %d (%d instances): choose = %d, want %d", n, size, got, want)
		}
	}
}

// ranking returns the indexes of instances in descending rendezvous order
// for key (ranking(…)[0] is Rendezvous's choice), appending to order and
// using scores as scratch space, so a caller with small arrays allocates
// nothing.
func ranking(key string, instances []fleet.Instance, order []int, scores []float64) []int {
	kh := fnv64(key)
	for i, in := range instances {
		scores = append(scores, score(kh, in))
		order = append(order, i)
	}
	slices.SortFunc(order, func(a, b int) int {
		switch {
		case scores[a] > scores[b]:
			return -1
		case scores[a] < scores[b]:
			return 1
		}
		return strings.Compare(instances[a].Name, instances[b].Name)
	})
	return order
}
