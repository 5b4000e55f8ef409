package simulator

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/tetherproxy/tether/lab/workload"
)

// sharedDocumentsSmall is the shared-documents regime, shortened and on a
// smaller fleet, for tests.
func sharedDocumentsSmall(p Policy) Options {
	r, err := LookupRegime("shared-documents")
	if err != nil {
		panic(err)
	}
	o, err := r.Apply(Options{Policy: p, Instances: 16, Rate: 8, Seed: 1, Workload: workload.Config{Seed: 1}})
	if err != nil {
		panic(err)
	}
	o.Duration, o.Scenario.Warmup = 8*time.Minute, 3*time.Minute
	return o
}

// TestSharedDocumentsRegime runs the regime: every policy serves its
// requests, the oracle bounds every policy (within the 0.2 points a
// greedy oracle can be passed by, as TestOracleBounds), and the
// content-reading routers find the shared documents where the identity
// routers cannot.
func TestSharedDocumentsRegime(t *testing.T) {
	hit := map[Policy]float64{}
	for _, p := range Policies() {
		res := run(t, sharedDocumentsSmall(p))
		s := res.Summary
		if s.ByKind[workload.KindDocs].OK < 500 || s.OK != s.Requests {
			t.Fatalf("%s: %d OK of %d requests, %d of documents: want all OK, hundreds", p, s.OK, s.Requests, s.ByKind[workload.KindDocs].OK)
		}
		if res.InfiniteCacheBound < s.KVHitRate {
			t.Errorf("%s: hit rate %.4f above the infinite-cache bound %.4f", p, s.KVHitRate, res.InfiniteCacheBound)
		}
		hit[p] = s.KVHitRate
	}
	for p, h := range hit {
		if h > hit[Oracle]+0.002 {
			t.Errorf("%s: hit rate %.4f above the oracle's %.4f by more than 0.2 points", p, h, hit[Oracle])
		}
	}
	for _, p := range []Policy{GIEPrefix, SGLangCacheAware, Oracle} {
		if hit[p] < hit[Sticky]+0.1 {
			t.Errorf("%s: hit rate %.4f, sticky %.4f: want a content-reading router 10 points above", p, hit[p], hit[Sticky])
		}
	}
}

// TestPeersDeterministic: a peer's run depends only on its options (its
// random draws come from the seed), and another seed changes its draws.
func TestPeersDeterministic(t *testing.T) {
	for _, p := range []Policy{GIEPrefix, SGLangCacheAware} {
		t.Run(string(p), func(t *testing.T) {
			o := docsOptions(p)
			a, b := run(t, o), run(t, o)
			if diff := cmp.Diff(a, b, ignoreRunFields); diff != "" {
				t.Errorf("two runs differ (-first +second):\n%s", diff)
			}
			o.Seed = 9
			if c := run(t, o); cmp.Equal(a.Summary.RequestsPerInstance, c.Summary.RequestsPerInstance) {
				t.Errorf("router seed 9 placed every request as seed 2 did")
			}
		})
	}
}

// TestSGLangBalanceGate: with the load imbalanced (max − min > 64 and max
// > 1.5 × min) the request goes to the least-loaded worker whatever its
// tree holds; balanced, to the worker whose tree matches it.
func TestSGLangBalanceGate(t *testing.T) {
	instances := make([]*instance, 4)
	for i := range instances {
		instances[i] = &instance{up: true}
	}
	var now int64
	r := newSGLangRouter(instances, func() int64 { return now }, newTestRand(1))
	r.update(&fleetState{instances: instances, live: []int{0, 1, 2, 3}, died: -1})
	c := &conversation{shape: shape{index: 7, doc: -1, turns: []turnShape{{userTokens: 640}}}, sysBlocks: 4, docEnd: 4}
	k := &call{conv: c}

	// Balanced, empty trees: the smallest tree; then the tree holds the
	// prompt there and the same prompt follows it.
	first, _, _ := r.route(t.Context(), k)
	for range 3 {
		if got, _, _ := r.route(t.Context(), k); got != first {
			t.Fatalf("balanced: prompt sent to %d after %d holds it", got, first)
		}
	}
	// Imbalanced: worker 2 idle, the others loaded beyond both thresholds.
	least := (first + 2) % 4
	for i, in := range instances {
		in.inFlight = 100
		if i == least {
			in.inFlight = 10
		}
	}
	if got, _, _ := r.route(t.Context(), k); got != least {
		t.Errorf("imbalanced (100 vs 10): sent to %d, want the least loaded %d", got, least)
	}
	if r.imbalanced != 1 {
		t.Errorf("%d imbalanced decisions, want 1", r.imbalanced)
	}
	// Beyond the absolute threshold but within the relative one: balanced.
	for i, in := range instances {
		in.inFlight = 200
		if i == least {
			in.inFlight = 135
		}
	}
	before := r.balanced
	if _, _, err := r.route(t.Context(), k); err != nil {
		t.Fatal(err)
	}
	if r.balanced != before+1 {
		t.Errorf("200 vs 135 (ratio 1.48): want a balanced decision")
	}
}
