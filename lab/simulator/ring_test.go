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

// TestRingSpread: the simulated ring hash's shares over hosts keyed as
// tether's xDS keys them, 1024 points.
func TestRingSpread(t *testing.T) {
	for _, n := range []int{1, 8, 64} {
		keys := make([]string, n)
		for i := range keys {
			keys[i] = fmt.Sprintf("gpu-%d", i)
		}
		r := ringhash.New(keys, DefaultRingSize)
		counts := make([]int, n)
		rng := newTestRand(1)
		const draws = 200_000
		for range draws {
			counts[r.Pick(rng.Uint64())]++
		}
		// With 1024 points the shares of Envoy's ring are uneven: within
		// a factor of about 3 for 64 hosts of 16 points each.
		for i, c := range counts {
			share := float64(c) * float64(n) / draws
			if share < 0.3 || share > 2 {
				t.Errorf("%d hosts: host %d gets %.2f of its fair share", n, i, share)
			}
		}
	}
}
