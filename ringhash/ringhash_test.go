package ringhash

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/cespare/xxhash/v2"
)

func TestRingPoints(t *testing.T) {
	for _, n := range []int{1, 3, 4, 64, 2000} {
		keys := make([]string, n)
		for i := range keys {
			keys[i] = fmt.Sprintf("gpu-%d", i)
		}
		r := New(keys, 0)
		per := max((DefaultMinSize+n-1)/n, 1)
		if len(r.points) != per*n {
			t.Errorf("%d hosts: %d points, want %d (Envoy: ceil(1024/n) each)", n, len(r.points), per*n)
		}
		// Every point is xxHash64("<key>_<i>") of its host.
		seen := map[uint64]bool{}
		for h, k := range keys {
			for i := range per {
				seen[xxhash.Sum64String(fmt.Sprintf("%s_%d", k, i))<<16|uint64(h)] = true
			}
		}
		for _, p := range r.points {
			if !seen[p.hash<<16|uint64(p.host)] {
				t.Fatalf("%d hosts: point %x of host %d is not one of its keys' hashes", n, p.hash, p.host)
			}
		}
	}
}

func TestPickIsTheNextPoint(t *testing.T) {
	r := New([]string{"a", "b", "c", "d"}, 0)
	rng := rand.New(rand.NewPCG(1, 2))
	for range 10_000 {
		h := rng.Uint64()
		// The first point at or after h, else the first point: a linear scan.
		want := int(r.points[0].host)
		for _, p := range r.points {
			if p.hash >= h {
				want = int(p.host)
				break
			}
		}
		if got := r.Pick(h); got != want {
			t.Fatalf("Pick(%x) = %d, want %d", h, got, want)
		}
	}
	if got := r.Pick(^uint64(0)); got != int(r.points[0].host) {
		t.Errorf("past the last point: %d, want the first point's host", got)
	}
	if got := New(nil, 0).Pick(1); got != -1 {
		t.Errorf("empty ring: %d, want -1", got)
	}
}

func TestHash(t *testing.T) {
	policies := []Policy{
		{Header: "x-session-id", Terminal: true},
		{Header: "authorization", Terminal: true},
		{Header: "x-device-id"},
		{Header: "x-user-id", Terminal: true},
	}
	rotl := func(h uint64) uint64 { return h<<1 | h>>63 }
	x := xxhash.Sum64String
	for _, tt := range []struct {
		name    string
		headers map[string]string
		want    uint64
		ok      bool
	}{
		{"session", map[string]string{"x-session-id": "s1", "authorization": "Bearer t"}, x("s1"), true},
		{"token", map[string]string{"authorization": "Bearer t", "x-user-id": "u"}, x("Bearer t"), true},
		{"device and user", map[string]string{"x-device-id": "d", "x-user-id": "u"}, rotl(x("d")) ^ x("u"), true},
		{"device alone", map[string]string{"x-device-id": "d"}, x("d"), true},
		{"user alone", map[string]string{"x-user-id": "u"}, x("u"), true},
		{"nothing", map[string]string{"user-agent": "curl"}, 0, false},
	} {
		got, ok := Hash(policies, func(n string) string { return tt.headers[n] })
		if got != tt.want || ok != tt.ok {
			t.Errorf("%s: Hash = %x, %v; want %x, %v", tt.name, got, ok, tt.want, tt.ok)
		}
	}
}

// envoyCounts is each host's number of points as ring_hash_lb.cc counts
// them, written out for the test: normalized weights, the scale that gives
// the lightest host a whole number of points, and running sums.
func envoyCounts(weights []uint32, minSize int) []int {
	sum := 0.0
	for _, w := range weights {
		sum += float64(w)
	}
	minNorm := 1.0
	for _, w := range weights {
		minNorm = min(minNorm, float64(w)/sum)
	}
	scale := min(math.Ceil(float64(minNorm*float64(minSize)))/minNorm, float64(MaxSize))
	counts := make([]int, len(weights))
	current, target := 0.0, 0.0
	for i, w := range weights {
		target += float64(scale * (float64(w) / sum))
		for current < target {
			counts[i]++
			current++
		}
	}
	return counts
}

func TestWeightedRing(t *testing.T) {
	for _, tt := range []struct {
		weights []uint32
		minSize int
		want    []int // points per host; nil: envoyCounts
	}{
		{weights: []uint32{1, 1, 2, 4}, want: []int{128, 128, 256, 512}},
		{weights: []uint32{1, 1, 1, 1}, want: []int{256, 256, 256, 256}},
		{weights: []uint32{3, 1}, minSize: 6, want: []int{6, 2}},
		// Fractional targets per host: the running sums decide.
		{weights: []uint32{1, 2, 3}, minSize: 1000},
		{weights: []uint32{7, 11, 13, 1000}, minSize: 1024},
	} {
		keys := make([]string, len(tt.weights))
		for i := range keys {
			keys[i] = fmt.Sprintf("gpu-%d", i)
		}
		want := tt.want
		if want == nil {
			want = envoyCounts(tt.weights, tt.minSize)
		}
		r := NewWeighted(keys, tt.weights, tt.minSize)
		got := make([]int, len(keys))
		for _, p := range r.points {
			got[p.host]++
		}
		if !slices.Equal(got, want) {
			t.Errorf("weights %v, min %d: points per host %v, want %v", tt.weights, tt.minSize, got, want)
		}
		// Host h's points are "<key>_0" .. "<key>_<count-1>".
		seen := map[uint64]bool{}
		for h, k := range keys {
			for i := range want[h] {
				seen[xxhash.Sum64String(fmt.Sprintf("%s_%d", k, i))<<20|uint64(h)] = true
			}
		}
		for _, p := range r.points {
			if !seen[p.hash<<20|uint64(p.host)] {
				t.Fatalf("weights %v: point %x of host %d is not one of its keys' hashes", tt.weights, p.hash, p.host)
			}
		}
	}
	// Equal weights, however given, are New's ring.
	keys := []string{"a", "b", "c"}
	if a, b := New(keys, 0), NewWeighted(keys, []uint32{5, 5, 5}, 0); !slices.Equal(a.points, b.points) {
		t.Error("weights 5, 5, 5: not New's ring")
	}
}

// TestEnvoysRings: points per host as Envoy 1.40 built them (its trace
// log, "ring hash: hash_key=h<i>_<j>", for a STATIC RING_HASH cluster of
// these endpoints, hash keys h0, h1, ...). With 75 equal hosts the float
// running sums give the first host one point more than ceil(1024/75).
func TestEnvoysRings(t *testing.T) {
	eq75 := make([]int, 75)
	for i := range eq75 {
		eq75[i] = 14
	}
	eq75[0] = 15
	for _, tt := range []struct {
		weights []uint32
		want    []int
	}{
		{make([]uint32, 75), eq75}, // no load_balancing_weight: 1 each
		{[]uint32{1, 1, 2, 4}, []int{128, 128, 256, 512}},
		{[]uint32{3, 7, 1, 13, 2}, []int{120, 280, 40, 520, 80}},
	} {
		keys := make([]string, len(tt.weights))
		for i := range keys {
			keys[i] = fmt.Sprintf("h%d", i)
		}
		got := make([]int, len(keys))
		for _, p := range NewWeighted(keys, tt.weights, 0).points {
			got[p.host]++
		}
		if !slices.Equal(got, tt.want) {
			t.Errorf("weights %v: points per host %v, Envoy's %v", tt.weights, got, tt.want)
		}
	}
	// Envoy logged hash_key=h0_0 hash=15328715382737556215.
	if h := xxhash.Sum64String("h0_0"); h != 15328715382737556215 {
		t.Errorf("xxHash64(h0_0) = %d, Envoy's 15328715382737556215", h)
	}
}

func TestLBWeights(t *testing.T) {
	for _, tt := range []struct {
		in   []float64
		want []uint32
	}{
		{[]float64{1, 1, 2, 4}, []uint32{1, 1, 2, 4}},
		{[]float64{1, 1, 1}, []uint32{1, 1, 1}},
		{[]float64{2.5, 2.5}, []uint32{1, 1}},
		{[]float64{0.5, 1.5}, []uint32{1, 3}},
		{[]float64{0.25, 1}, []uint32{1, 4}},
		{[]float64{0.000001, 1}, []uint32{1, 1000000}},
		{[]float64{6, 4, 10}, []uint32{3, 2, 5}},
		{[]float64{1e6, 1e6 - 1}, []uint32{1e6, 1e6 - 1}},
		{[]float64{0, 2}, []uint32{1, 1}}, // 0 counts as the smallest
		{[]float64{0, 0}, []uint32{1, 1}}, // nothing usable: equal
		{[]float64{1, 3}, []uint32{1, 3}}, // whole numbers as they are
		{nil, nil},
	} {
		got := LBWeights(nil, tt.in)
		if !slices.Equal(got, tt.want) {
			t.Errorf("LBWeights(%v) = %v, want %v", tt.in, got, tt.want)
		}
	}
	// Not decimal: scaled to the largest, ratios kept closely, sum fits.
	in := []float64{1.0 / 3, 1, math.Pi}
	got := LBWeights(nil, in)
	sum := uint64(0)
	for i, v := range got {
		sum += uint64(v)
		if ratio := float64(v) / float64(got[2]); math.Abs(ratio-in[i]/in[2]) > 1e-8 {
			t.Errorf("LBWeights(%v)[%d]: ratio %v, want %v", in, i, ratio, in[i]/in[2])
		}
	}
	if sum > math.MaxUint32 {
		t.Errorf("LBWeights(%v) sums to %d, past a uint32", in, sum)
	}
	// Many large decimal weights whose scaled sum overflows fall back.
	big := make([]float64, 5000)
	for i := range big {
		big[i] = 1e6 - float64(i%2)*0.5
	}
	sum = 0
	for _, v := range LBWeights(nil, big) {
		if v == 0 {
			t.Fatal("a weight of 0")
		}
		sum += uint64(v)
	}
	if sum > math.MaxUint32 {
		t.Errorf("5000 weights near 1e6 sum to %d, past a uint32", sum)
	}
	// Appends to dst.
	if got := LBWeights([]uint32{9}, []float64{2, 4}); !slices.Equal(got, []uint32{9, 1, 2}) {
		t.Errorf("append: %v", got)
	}
}
