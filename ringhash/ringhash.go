// Package ringhash computes the choice of Envoy's RING_HASH balancer, so
// tether can place a new session where Envoy's fail-open pool would send it
// when no tether replica answers: the pool and tether then agree.
//
// Two halves, each as Envoy computes it:
//   - the ring (source/extensions/load_balancing_policies/ring_hash/
//     ring_hash_lb.cc): every host gets ceil(minimum_ring_size / hosts)
//     points (equal weights), the xxHash64 of "<hash key>_<i>", where the
//     hash key is the endpoint's envoy.lb metadata hash_key (tether sets the
//     instance name, xds) and the address without one; a request goes to
//     the first point at or after its hash, wrapping around;
//   - the request's hash (source/common/http/hash_policy.cc): each header
//     hash policy hashes the header's value with xxHash64 (seed 0); a
//     policy's hash combines with the hash so far as rotl(hash, 1) xor new;
//     a terminal policy that produced a hash stops the list.
//
// The raw header values are hashed and dropped: nothing here keeps them.
package ringhash

import (
	"math"
	"slices"
	"strconv"
	"sync"

	"github.com/cespare/xxhash/v2"
)

// DefaultMinSize is Envoy's default minimum_ring_size.
const DefaultMinSize = 1024

// MaxSize is Envoy's default maximum_ring_size.
const MaxSize = 8 << 20

// Ring is the ring of a RING_HASH cluster over equally weighted hosts.
type Ring struct {
	points []point
	hosts  int
}

type point struct {
	hash uint64
	host int32
}

// New builds the ring of hosts with the given hash keys, in the order of
// the cluster's endpoints (the order ties on equal point hashes follow).
// minSize <= 0 means DefaultMinSize.
func New(keys []string, minSize int) *Ring {
	n := len(keys)
	r := &Ring{hosts: n}
	if n == 0 {
		return r
	}
	if minSize <= 0 {
		minSize = DefaultMinSize
	}
	// Envoy: scale = ceil(min_normalized_weight × min_ring_size) /
	// min_normalized_weight, capped at max_ring_size; each host then gets
	// scale × its normalized weight (1/n) points.
	perHost := int(math.Ceil(float64(minSize) / float64(n)))
	perHost = max(min(perHost, MaxSize/n), 1)
	r.points = make([]point, 0, perHost*n)
	var buf []byte
	for h, k := range keys {
		buf = append(append(buf[:0], k...), '_')
		base := len(buf)
		for i := range perHost {
			buf = strconv.AppendInt(buf[:base], int64(i), 10)
			r.points = append(r.points, point{hash: xxhash.Sum64(buf), host: int32(h)})
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

// Pick is the index (in New's keys) of the host a request hashing to h
// goes to; -1 for an empty ring.
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

// Hash is the hash Envoy's route computes with policies from a request
// whose header values get returns ("" for an absent header). ok is false
// when no policy produced a hash: Envoy then picks a random host.
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

// Cache keeps the ring of the last host set it was asked for: the pool's
// membership changes rarely, its requests often. Safe for concurrent use.
type Cache struct {
	MinSize int // 0: DefaultMinSize

	mu   sync.Mutex
	keys []string
	ring *Ring
}

// Pick is New(keys, c.MinSize).Pick(h), the ring built once per host set.
func (c *Cache) Pick(keys []string, h uint64) int {
	c.mu.Lock()
	if c.ring == nil || !slices.Equal(c.keys, keys) {
		c.keys = slices.Clone(keys)
		c.ring = New(c.keys, c.MinSize)
	}
	r := c.ring
	c.mu.Unlock()
	return r.Pick(h)
}
