// Package ringhash computes the choice of Envoy's RING_HASH balancer.
// With it, tether places a new session where Envoy's fail-open pool would
// send it when no tether replica answers, so the pool and tether agree.
//
// It has two halves, each computed as Envoy computes it.
//
// The ring, from source/extensions/load_balancing_policies/ring_hash/ring_hash_lb.cc:
//   - Every host gets points in proportion to its load_balancing_weight
//     (see NewWeighted).
//   - A point is the xxHash64 of "<hash key>_<i>". The hash key is the
//     endpoint's envoy.lb metadata hash_key, which xds sets to the instance
//     name. An endpoint without one uses its address.
//   - A request goes to the first point at or after its hash, wrapping
//     around.
//   - xds gives each pool endpoint the weight LBWeights maps its instance's
//     weight to. tether builds its ring from the same integers.
//
// The request's hash, from source/common/http/hash_policy.cc:
//   - Each header hash policy hashes the header's value with xxHash64,
//     seed 0.
//   - A policy's hash combines with the hash so far as rotl(hash, 1) xor new.
//   - A terminal policy that produced a hash stops the list.
//
// The raw header values are hashed and dropped. Nothing here keeps them.
package ringhash

import (
	"math"
	"slices"
	"strconv"

	"github.com/cespare/xxhash/v2"
)

// DefaultMinSize is Envoy's default minimum_ring_size.
const DefaultMinSize = 1024

// MaxSize is Envoy's default maximum_ring_size.
const MaxSize = 8 << 20

// Ring is the ring of a RING_HASH cluster.
type Ring struct {
	points []point
	hosts  int
}

type point struct {
	hash uint64
	host int32
}

// New builds the ring of equally weighted hosts with the given hash keys.
// The keys come in the order of the cluster's endpoints; ties on equal
// point hashes follow that order. minSize <= 0 means DefaultMinSize.
func New(keys []string, minSize int) *Ring {
	return NewWeighted(keys, nil, minSize)
}

// NewWeighted builds the ring of hosts with the given hash keys and
// load_balancing_weights. weights[i] is the weight of keys[i]. nil weights
// are all 1, and a weight of 0 counts as 1, as in Envoy.
//
// It follows Envoy's Ring constructor:
//   - Each host's normalized weight is its weight over the sum of weights.
//   - scale = ceil(min_normalized_weight × min_ring_size) /
//     min_normalized_weight, capped at max_ring_size. So the lightest host
//     gets a whole number of points.
//   - Walking the hosts in order, a running target grows by scale × the
//     host's normalized weight. The host gets points "<key>_0", "<key>_1",
//     ... until the running count of points reaches the target.
//
// The arithmetic is Envoy's, in float64 and in the same order. So the
// counts agree where a fractional target rounds up or down. Equal weights
// give every host ceil(minSize / hosts) points, except where the float sums
// round up: 75 hosts get 15, 14, 14, .... Envoy 1.40 does the same.
func NewWeighted(keys []string, weights []uint32, minSize int) *Ring {
	n := len(keys)
	r := &Ring{hosts: n}
	if n == 0 {
		return r
	}
	if minSize <= 0 {
		minSize = DefaultMinSize
	}
	weight := func(i int) float64 {
		if weights == nil || weights[i] == 0 {
			return 1
		}
		return float64(weights[i])
	}
	sum := 0.0
	for i := range n {
		sum += weight(i)
	}
	// normalizeHostWeights: min_normalized_weight starts at 1.
	minNorm := 1.0
	for i := range n {
		minNorm = min(minNorm, weight(i)/sum)
	}
	// The explicit float64 conversions round each product as C++ does:
	// Go may otherwise fuse a multiply and an add.
	scale := min(math.Ceil(float64(minNorm*float64(minSize)))/minNorm, float64(MaxSize))
	r.points = make([]point, 0, int(math.Ceil(scale))+n)
	var buf []byte
	current, target := 0.0, 0.0
	for h, k := range keys {
		buf = append(append(buf[:0], k...), '_')
		base := len(buf)
		target += float64(scale * (weight(h) / sum))
		for i := 0; current < target; i++ {
			buf = strconv.AppendInt(buf[:base], int64(i), 10)
			r.points = append(r.points, point{hash: xxhash.Sum64(buf), host: int32(h)})
			current++
		}
	}
	slices.SortStableFunc(r.points, func(a, b point) int { return cmp(a.hash, b.hash) })
	return r
}

func cmp(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// Pick is the index in New's keys of the host a request hashing to h goes
// to. It is -1 for an empty ring.
func (r *Ring) Pick(h uint64) int {
	if len(r.points) == 0 {
		return -1
	}
	i, _ := slices.BinarySearchFunc(r.points, h, func(p point, h uint64) int { return cmp(p.hash, h) })
	if i == len(r.points) {
		i = 0
	}
	return int(r.points[i].host)
}

// Policy is one header hash policy of a route, in the route's order.
type Policy struct {
	Header   string
	Terminal bool
}

// Hash is the hash Envoy's route computes with policies from a request.
// get returns the request's header values, "" for an absent header. ok is
// false when no policy produced a hash; Envoy then picks a random host.
func Hash(policies []Policy, get func(name string) string) (h uint64, ok bool) {
	for _, p := range policies {
		if v := get(p.Header); v != "" {
			next := xxhash.Sum64String(v)
			if ok {
				h = (h<<1 | h>>63) ^ next
			} else {
				h = next
			}
			ok = true
		}
		if p.Terminal && ok {
			break
		}
	}
	return h, ok
}

// LBWeights maps instance weights to the load_balancing_weights of a
// pool's endpoints, keeping the ratios between them. Instance weights are
// floats; config holds them above 0 and at most 1e6. Envoy wants integers
// of at least 1 whose sum fits a uint32.
//   - Weights with at most six decimals are scaled by the smallest power
//     of ten that makes them all whole. They are then divided by the
//     integers' greatest common divisor. 1, 1, 2, 4 stay 1, 1, 2, 4; 0.5,
//     1.5 become 1, 3; equal weights become 1 each.
//   - Other weights, or a sum that overflows, are scaled so the largest
//     becomes floor(MaxUint32 / hosts). Each is rounded to at least 1 and
//     reduced the same way. Each weight's share of the largest is then off
//     by at most 0.5 / floor(MaxUint32 / hosts): 1.2e-7 with 1,000 hosts.
//
// A weight of 0 or less counts as the smallest; valid config never has
// one. The result is appended to dst. xds gives Envoy these weights and
// plan builds tether's fail-open ring from them, so the two rings are the
// same.
func LBWeights(dst []uint32, weights []float64) []uint32 {
	base := len(dst)
	n := len(weights)
	if n == 0 {
		return dst
	}
	lo, hi := math.Inf(1), 0.0
	for _, w := range weights {
		if w > 0 && !math.IsInf(w, 1) {
			lo, hi = min(lo, w), max(hi, w)
		}
	}
	if hi == 0 { // nothing usable: equal weights
		for range weights {
			dst = append(dst, 1)
		}
		return dst
	}
	w := func(x float64) float64 {
		if !(x > 0) || math.IsInf(x, 1) {
			return lo
		}
		return x
	}
	exact := false
	for p, f := 0, 1.0; p <= 6 && !exact; p, f = p+1, f*10 {
		exact = true
		sum := 0.0
		for _, x := range weights {
			v := w(x) * f
			r := math.Round(v)
			if r < 1 || math.Abs(v-r) > 1e-9*v {
				exact = false
				break
			}
			sum += r
		}
		if exact && sum > math.MaxUint32 {
			exact = false
			break
		}
		if exact {
			for _, x := range weights {
				dst = append(dst, uint32(math.Round(w(x)*f)))
			}
		}
	}
	if !exact {
		dst = dst[:base]
		unit := float64(math.MaxUint32 / uint64(n))
		for _, x := range weights {
			dst = append(dst, uint32(max(math.Round(w(x)/hi*unit), 1)))
		}
	}
	g := dst[base]
	for _, v := range dst[base:] {
		g = gcd(g, v)
	}
	for i := range dst[base:] {
		dst[base+i] /= g
	}
	return dst
}

func gcd(a, b uint32) uint32 {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}
