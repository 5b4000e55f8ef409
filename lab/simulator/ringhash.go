package simulator

import (
	"math"
	"slices"
	"strconv"

	"github.com/cespare/xxhash/v2"

	"github.com/tetherproxy/tether/lab/workload"
)

// DefaultRingSize is Envoy's default minimum_ring_size for RING_HASH.
const DefaultRingSize = 1024

// MaxRingSize is Envoy's default maximum_ring_size.
const MaxRingSize = 8 << 20

// ring emulates the ring of an Envoy RING_HASH cluster with the defaults
// tether's xDS server leaves in place (xxHash, minimum_ring_size 1024, equal
// weights): every host gets ceil(minSize / hosts) points, the xxHash64 of
// "<hash key>_<i>" (the endpoint's hash_key metadata, which tether's xDS
// server sets to the instance name; Envoy uses the address without one), and a request goes to the first point at or after its
// hash, wrapping around (ring_hash_lb.cc). Envoy's own binary search (from
// ketama) picks the same point except in corner cases of equal hashes.
type ring struct {
	points []ringPoint
}

type ringPoint struct {
	hash uint64
	host int32
}

func newRing(keys []string, minSize int) ring {
	n := len(keys)
	// Envoy: scale = ceil(min_normalized_weight × min_ring_size) /
	// min_normalized_weight, capped at max_ring_size; each host then gets
	// scale × its normalized weight points (1/n each here).
	perHost := int(math.Ceil(float64(minSize) / float64(n)))
	perHost = max(min(perHost, MaxRingSize/n), 1)
	r := ring{points: make([]ringPoint, 0, perHost*n)}
	for h, k := range keys {
		key := []byte(k + "_")
		base := len(key)
		for i := range perHost {
			key = strconv.AppendInt(key[:base], int64(i), 10)
			r.points = append(r.points, ringPoint{hash: xxhash.Sum64(key), host: int32(h)})
		}
	}
	slices.SortStableFunc(r.points, func(a, b ringPoint) int {
		switch {
		case a.hash < b.hash:
			return -1
		case a.hash > b.hash:
			return 1
		}
		return 0
	})
	return r
}

// pick returns the host of hash h.
func (r ring) pick(h uint64) int {
	i, _ := slices.BinarySearchFunc(r.points, h, func(p ringPoint, h uint64) int {
		switch {
		case p.hash < h:
			return -1
		case p.hash > h:
			return 1
		}
		return 0
	})
	if i == len(r.points) {
		i = 0
	}
	return int(r.points[i].host)
}

// envoyHash is the hash Envoy computes from a request's headers with the
// hash policies of tether's routes (xds/resources.go): x-session-id
// (terminal), else authorization (terminal), else x-device-id then
// x-user-id, combined as Envoy combines policies (the hash so far rotated
// left by one, xor the new one). Each header hashes as xxHash64 of its value
// with seed 0. ok is false when no header is present: Envoy then picks the
// host from a random hash.
func envoyHash(headers []workload.Header) (h uint64, ok bool) {
	get := func(name string) (string, bool) {
		for _, hd := range headers {
			if hd.Name == name {
				return hd.Value, true
			}
		}
		return "", false
	}
	policies := []struct {
		header   string
		terminal bool
	}{
		{workload.SessionHeader, true},
		{workload.AuthHeader, true},
		{workload.DeviceHeader, false},
		{workload.UserHeader, true},
	}
	for _, p := range policies {
		if v, present := get(p.header); present {
			next := xxhash.Sum64String(v)
			if ok {
				h = (h<<1 | h>>63) ^ next
			} else {
				h = next
			}
			ok = true
		}
		if p.terminal && ok {
			break
		}
	}
	return h, ok
}
