package affinity

// Placement: where a session goes when it has no instance, or must leave
// its own. Every rule of it is here, in the order it applies:
//
//  1. the candidates: the healthy instances of the session's model
//     version, on-demand ones before spot ones (stickyCandidates);
//  2. the fail-open preference: the instance Envoy's fail-open pool would
//     send the request to, so a session keeps its instance while no tether
//     replica answers (placeNew);
//  3. the bounded load: no instance takes a session past
//     ⌈(1+ε)·(A+1)·w/W⌉ active sessions (choose);
//  4. the KV room: an instance below kv_sessions, whose engine does not
//     report its KV cache full, before one without room (choose);
//  5. weighted rendezvous hashing: among the instances the rules accept,
//     the session's own ranking decides, so every replica, and tether
//     without its store, makes the same choice (Rendezvous).
//
// The load view (load.go) counts a choice as pending under its lock
// (Load.reserve), so that concurrent placements see each other.

import (
	"math"

	"github.com/tetherproxy/tether/fleet"
)

// place is bounded-load placement over cands: the session goes
// to the highest-ranked instance whose active sessions are below its bound,
// ⌈(1+ε)·(A+1)·w/W⌉ (A the active sessions and W the weight of all
// candidates), preferring one that also has room in its KV cache (active
// below kv_sessions, the soft cap, and a KV-cache usage its engine reports
// below the saturation threshold). When every instance is at its bound
// the hash's first choice takes the session. The choice is reserved in the
// load view until unreserve, so concurrent placements count each other.
func (d *Decider) place(key string, cands []fleet.Instance, p *Policy) fleet.Instance {
	in, _ := d.load.reserve(key, cands, p.Epsilon, p.Saturation, -1)
	return in
}

// placeNew is place for a request that may bind a new session: with a
// fail-open pool (WithFailOpen) the session goes to the instance Envoy's
// pool would send req to, unless that instance is not a candidate, is
// over its bound or its engine reports its KV cache full; overridden says
// the pool's choice was passed over.
func (d *Decider) placeNew(req Request, key string, cands []fleet.Instance, p *Policy) (in fleet.Instance, overridden bool) {
	if d.failOpen == nil {
		return d.place(key, cands, p), false
	}
	name, ok := d.failOpen(req.Headers, d.fleet.All())
	if !ok {
		return d.place(key, cands, p), false
	}
	pref := -1
	for i, c := range cands {
		if c.Name == name {
			pref = i
			break
		}
	}
	in, overridden = d.load.reserve(key, cands, p.Epsilon, p.Saturation, pref)
	return in, overridden || pref < 0
}

// choose is place's rule: the index in cands of the instance for key,
// given the candidates' active sessions and whether their engine reports
// a full KV cache (full nil: none does). pref, when not -1, is the index
// of the instance Envoy's fail-open pool would pick: it takes the session
// while it is under its bound and its engine does not report it full;
// overridden says it did not.
func choose(key string, cands []fleet.Instance, active []int, full []bool, eps float64, pref int) (i int, overridden bool) {
	if len(cands) == 1 {
		return 0, false
	}
	// Each candidate's rendezvous score, once; the highest-ranked candidate
	// a rule accepts is found by one pass over them, in ranking's order
	// (score, then name), without sorting.
	var scoreBuf [64]float64
	scores := scoreBuf[:0]
	kh := fnv64(key)
	for _, in := range cands {
		scores = append(scores, score(kh, in))
	}
	best := func(ok func(int) bool) int {
		b := -1
		for i := range cands {
			if ok(i) && (b < 0 || scores[i] > scores[b] || scores[i] == scores[b] && cands[i].Name < cands[b].Name) {
				b = i
			}
		}
		return b
	}
	first := best(func(int) bool { return true })
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
	if pref >= 0 {
		if under(pref) && free(pref) {
			return pref, false
		}
		overridden = true
	}
	// The common case: the hash's own choice is under all three.
	if under(first) && room(first) && free(first) {
		return first, overridden
	}
	// What the engine reports outranks the kv_sessions estimate.
	for _, ok := range []func(int) bool{
		func(i int) bool { return under(i) && room(i) && free(i) },
		func(i int) bool { return under(i) && free(i) },
		func(i int) bool { return under(i) && room(i) },
		under,
	} {
		if i := best(ok); i >= 0 {
			return i, overridden
		}
	}
	return first, overridden
}

func ceil(x float64) int {
	n := int(x)
	if float64(n) < x {
		n++
	}
	return n
}

// stickyCandidates is where a session of version v may be placed: the
// healthy instances of v (all of them when v is "" or has none), on-demand
// before spot.
func stickyCandidates(v string, healthy []fleet.Instance) []fleet.Instance {
	cands := healthy
	if v != "" {
		if of := ofVersion(healthy, v); len(of) > 0 {
			cands = of
		}
	}
	return avoidSpot(cands)
}

// unsaturated drops saturated instances unless all are.
func (d *Decider) unsaturated(in []fleet.Instance, s Saturation) []fleet.Instance {
	return d.load.unsaturated(in, s)
}

// avoidSpot drops spot instances unless nothing else is left.
func avoidSpot(in []fleet.Instance) []fleet.Instance { return onlySpot(in, false) }

// preferSpot keeps only spot instances when there are any.
func preferSpot(in []fleet.Instance) []fleet.Instance { return onlySpot(in, true) }

// onlySpot keeps the spot instances of in (spot) or the others (!spot),
// unless that leaves none or all.
func onlySpot(in []fleet.Instance, spot bool) []fleet.Instance {
	n := 0
	for _, i := range in {
		if i.Spot() == spot {
			n++
		}
	}
	if n == 0 || n == len(in) {
		return in
	}
	out := make([]fleet.Instance, 0, n)
	for _, i := range in {
		if i.Spot() == spot {
			out = append(out, i)
		}
	}
	return out
}

// Rendezvous returns the instance with the highest weighted rendezvous score
// for key (Schindelhauer and Schomaker's weighted HRW: score = -w / ln(u),
// u uniform in (0,1) from a hash of key and instance name). Each key lands on
// an instance with probability proportional to its weight, every replica
// computes the same answer without talking to the others, and removing an
// instance moves only the keys that were on it. healthy must not be empty.
func Rendezvous(key string, healthy []fleet.Instance) fleet.Instance {
	return healthy[top(key, healthy)]
}

// top is the index of Rendezvous's choice.
func top(key string, healthy []fleet.Instance) int {
	kh := fnv64(key)
	best, bestScore := 0, math.Inf(-1)
	for i, in := range healthy {
		score := score(kh, in)
		if score > bestScore || (score == bestScore && in.Name < healthy[best].Name) {
			best, bestScore = i, score
		}
	}
	return best
}

// score is in's weighted rendezvous score for a key hashing to kh.
func score(kh uint64, in fleet.Instance) float64 {
	h := mix64(kh ^ fnv64(in.Name))
	// u in (0,1): 53 bits, never 0 or 1.
	u := (float64(h>>11) + 0.5) / (1 << 53)
	return -in.Weight / math.Log(u)
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
