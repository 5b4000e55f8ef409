package simulator

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/cespare/xxhash/v2"

	"github.com/tetherproxy/tether/lab/workload"
	"github.com/tetherproxy/tether/ringhash"
)

func newTestRand(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, seed)) }

func TestEnvoyHash(t *testing.T) {
	x := xxhash.Sum64String
	rot := func(h uint64) uint64 { return h<<1 | h>>63 }
	h := func(kv ...string) []workload.Header {
		var out []workload.Header
		for i := 0; i < len(kv); i += 2 {
			out = append(out, workload.Header{Name: kv[i], Value: kv[i+1]})
		}
		return out
	}
	tests := []struct {
		name    string
		headers []workload.Header
		want    uint64
		ok      bool
	}{
		{"session is terminal", h("x-session-id", "s1", "authorization", "Bearer t", "x-user-id", "u"), x("s1"), true},
		{"then the token", h("authorization", "Bearer t", "x-user-id", "u"), x("Bearer t"), true},
		{"device then user", h("x-device-id", "d", "x-user-id", "u"), rot(x("d")) ^ x("u"), true},
		{"user alone", h("x-user-id", "u"), x("u"), true},
		{"device alone", h("x-device-id", "d"), x("d"), true},
		{"nothing", nil, 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := envoyHash(tt.headers)
			if got != tt.want || ok != tt.ok {
				t.Errorf("envoyHash = %x, %v; want %x, %v", got, ok, tt.want, tt.ok)
			}
		})
	}
}

func TestRing(t *testing.T) {
	for _, n := range []int{1, 8, 64} {
		addrs := make([]string, n)
		for i := range addrs {
			addrs[i] = fmt.Sprintf("127.0.0.1:%d", 20000+i)
		}
		r := newRing(addrs, DefaultRingSize)
		perHost := (DefaultRingSize + n - 1) / n
		if len(r.points) != perHost*n {
			t.Errorf("%d hosts: %d points, want %d (Envoy: ceil(1024/n) each)", n, len(r.points), perHost*n)
		}
		counts := make([]int, n)
		rng := newTestRand(1)
		const draws = 200_000
		for range draws {
			counts[r.pick(rng.Uint64())]++
		}
		// With 1024 points the shares of Envoy's ring are uneven: within
		// a factor of about 3 for 64 hosts of 16 points each.
		for i, c := range counts {
			share := float64(c) * float64(n) / draws
			if share < 0.3 || share > 2 {
				t.Errorf("%d hosts: host %d gets %.2f of its fair share", n, i, share)
			}
		}
		// The same hash, the same host; past the last point, the first.
		if first, again := r.pick(42), r.pick(42); first != again || r.pick(^uint64(0)) != int(r.points[0].host) {
			t.Errorf("%d hosts: pick is not a ring", n)
		}
	}
}

// TestRingMatchesProduct: the simulator's emulation of Envoy's ring and
// request hash picks what package ringhash (tether's own, which places new
// sessions where the fail-open pool sends them) picks.
func TestRingMatchesProduct(t *testing.T) {
	rng := newTestRand(3)
	for _, n := range []int{1, 4, 7, 64} {
		keys := make([]string, n)
		for i := range keys {
			keys[i] = fmt.Sprintf("gpu-%d", i)
		}
		sim, prod := newRing(keys, DefaultRingSize), ringhash.New(keys, ringhash.DefaultMinSize)
		for range 20_000 {
			h := rng.Uint64()
			if s, p := sim.pick(h), prod.Pick(h); s != p {
				t.Fatalf("%d hosts, hash %x: simulator %d, ringhash %d", n, h, s, p)
			}
		}
	}
	policies := []ringhash.Policy{
		{Header: workload.SessionHeader, Terminal: true},
		{Header: workload.AuthHeader, Terminal: true},
		{Header: workload.DeviceHeader},
		{Header: workload.UserHeader, Terminal: true},
	}
	for i := range 1000 {
		var hs []workload.Header
		if i%2 == 0 {
			hs = append(hs, workload.Header{Name: workload.SessionHeader, Value: fmt.Sprint("s", i)})
		}
		if i%3 == 0 {
			hs = append(hs, workload.Header{Name: workload.AuthHeader, Value: fmt.Sprint("Bearer t", i)})
		}
		if i%5 < 3 {
			hs = append(hs, workload.Header{Name: workload.DeviceHeader, Value: fmt.Sprint("d", i)})
		}
		if i%7 < 4 {
			hs = append(hs, workload.Header{Name: workload.UserHeader, Value: fmt.Sprint("u", i)})
		}
		get := func(name string) string {
			for _, h := range hs {
				if h.Name == name {
					return h.Value
				}
			}
			return ""
		}
		s, sok := envoyHash(hs)
		p, pok := ringhash.Hash(policies, get)
		if s != p || sok != pok {
			t.Fatalf("headers %v: simulator %x %v, ringhash %x %v", hs, s, sok, p, pok)
		}
	}
}
