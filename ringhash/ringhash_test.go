package ringhash

import (
	"fmt"
	"math/rand/v2"
	"sync"
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

func TestCache(t *testing.T) {
	var c Cache
	a, b := []string{"a", "b", "c"}, []string{"a", "b", "c", "d"}
	ra, rb := New(a, 0), New(b, 0)
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for i := range 2000 {
				keys, r := a, ra
				if i%3 == 0 {
					keys, r = b, rb
				}
				h := rng.Uint64()
				if got, want := c.Pick(keys, h), r.Pick(h); got != want {
					t.Errorf("Cache.Pick = %d, want %d", got, want)
					return
				}
			}
		}()
	}
	wg.Wait()
}
