package affinity

// Weighted rendezvous hashing: the pipeline's pick (pipeline.go) and what
// it hashes with.

import (
	"math"

	"github.com/tetherproxy/tether/fleet"
)

// Rendezvous returns the instance with the highest weighted rendezvous
// score for key. The score is Schindelhauer and Schomaker's weighted HRW:
// -w / ln(u), with u uniform in (0,1) from a hash of key and instance
// name. A key lands on an instance with a chance proportional to its
// weight. Every replica computes the same answer without talking to the
// others. Removing an instance moves only the keys that were on it.
// healthy must not be empty. It is the pipeline's pick alone.
func Rendezvous(key string, healthy []fleet.Instance) fleet.Instance {
	kh := fnv64(key)
	best, bestScore := 0, math.Inf(-1)
	for i, in := range healthy {
		if s := score(kh, in); s > bestScore || s == bestScore && in.Name < healthy[best].Name {
			best, bestScore = i, s
		}
	}
	return healthy[best]
}

// score is in's weighted rendezvous score for a key hashing to kh.
func score(kh uint64, in fleet.Instance) float64 {
	return -in.Weight / math.Log(draw(kh, in))
}

// draw is the uniform in (0,1) that key kh draws for in. Among instances
// of equal weight it orders them as score does (score grows with it), for
// a logarithm less.
func draw(kh uint64, in fleet.Instance) float64 {
	h := mix64(kh ^ fnv64(in.Name))
	// 53 bits, never 0 or 1.
	return (float64(h>>11) + 0.5) / (1 << 53)
}

// fnv64 is FNV-1a; stable across processes and versions, unlike maphash.
func fnv64(s string) uint64 {
	h := uint64(14695981039346656037)
	for i := 0; i < len(s); i++ {
		h ^= uint64(s[i])
		h *= 1099511628211
	}
	return h
}

// mix64 is the splitmix64 finaliser: FNV's low bits are weak, this spreads them.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}
