package affinity

// The placement pipeline. Every choice of an instance goes through rank,
// in four stages (a session the store peeks bound to an available
// instance is no choice: Decider.lookup):
//
//  1. candidates: the instances of the request's model version, or all of
//     them when it has none.
//  2. filters, in order:
//     - healthy or probing, and in the caller's subset (Request.Subset);
//     - not the instance a session leaves;
//     - in the fallback rung's zone;
//     - on-demand before spot (spot first for random routing);
//     - for adaptive routing, not saturated.
//  3. scores. For a session: the bounded load, KV room, and the fail-open
//     pool's own choice. For a prompt: what the prefix an instance holds
//     saves, against what its work costs (content.go).
//  4. pick: the request's rendezvous ranking orders what the scores tie.
//
// The result is a Ranking: the candidates, best first. The scores are exact
// comparisons and ties fall to a hash. So every replica reaches the same
// ranking from the same state, and so does Envoy's fail-open ring for the
// requests it decides.

import (
	"cmp"
	"slices"

	"github.com/tetherproxy/tether/fleet"
)

// placement is what one choice of an instance asks of the pipeline. A
// field left at its zero value turns its stage off.
type placement struct {
	// key is the hash whose rendezvous ranking breaks ties: a session
	// key's (fnv64), a prompt's, or a random draw.
	key uint64
	// from are the instances the decision sees as healthy or probing.
	from []fleet.Instance
	// version narrows the candidates to one model version; all of from
	// when none is of it.
	version string

	// leave is the instance a session leaves.
	leave string
	// zone keeps the instances of one zone, or with otherZones those of
	// every other zone (a fallback rung).
	zone       string
	otherZones bool
	// spotFirst keeps only spot instances when there are any (random
	// routing); otherwise spot ones are kept only when nothing else is.
	spotFirst bool
	// unsaturated drops saturated instances, unless all are (adaptive).
	unsaturated bool

	// sessions scores for a session's binding: bounded load and KV room
	// (score), with the fail-open pool's instance first when it qualifies.
	sessions bool
	failOpen string
	// prompt scores by what each candidate's cache holds (content.go).
	prompt *promptScore
	// reserve counts the first of the ranking as a pending placement
	// until the Ranking is committed or released.
	reserve bool
}

// Ranking is the pipeline's answer: the candidates, best first.
type Ranking struct {
	from []fleet.Instance
	n    int // candidates
	best int // the first, in idx(); -1 for none
	// overridden says the fail-open pool named an instance and the
	// ranking does not put it first.
	overridden bool
	held       hold

	// The candidates' indexes in from, and their keys: in the arrays up
	// to their size, so a ranking allocates nothing; in the slices
	// beyond. engArr holds the engine readings of up to as many.
	idxArr [64]int
	keyArr [64]rankKey
	engArr [64]engineLoad
	idxBig []int
	keyBig []rankKey
}

// ranking lends a Ranking from the decider's pool; done returns it. A
// Ranking is 4 KB of arrays with the engine readings. On the stack of the
// goroutine gRPC starts for each request, two rankings of 2 KB and rank's
// 2.5 KB of readings made that stack grow, and be copied, on every
// decision: 7% of tether's CPU behind a gateway (BENCHMARKS.md, "Behind a
// gateway").
func (d *Decider) ranking() *Ranking {
	if r, ok := d.rankings.Get().(*Ranking); ok {
		return r
	}
	return &Ranking{best: -1}
}

// done ends r's reservation, if it still holds one, and returns r to the
// pool empty, without the fleet or big slices it pointed to.
func (d *Decider) done(r *Ranking) {
	r.release()
	r.from, r.n, r.best, r.idxBig, r.keyBig = nil, 0, -1, nil, nil
	d.rankings.Put(r)
}

// idx is the candidates' indexes in from.
func (r *Ranking) idx() []int {
	if r.idxBig != nil {
		return r.idxBig[:r.n]
	}
	return r.idxArr[:r.n]
}

// keys is the candidates' keys, as idx.
func (r *Ranking) keys() []rankKey {
	if r.keyBig != nil {
		return r.keyBig[:r.n]
	}
	return r.keyArr[:r.n]
}

// rankKey orders the candidates: the lower tier, then the lower cost,
// then the one pinned (the choice identity made), then the higher
// rendezvous score, then the name.
type rankKey struct {
	tier  int8
	pin   bool
	cost  float64
	score float64
}

// First is the chosen instance; ok is false when no candidate is left.
func (r *Ranking) First() (fleet.Instance, bool) {
	if r.best < 0 {
		return fleet.Instance{}, false
	}
	return r.from[r.idx()[r.best]], true
}

// Top is the first n of the ranking, best first, without sorting the
// rest.
func (r *Ranking) Top(n int) []fleet.Instance {
	n = min(n, r.n)
	if n <= 0 {
		return nil
	}
	var topArr [8]int
	top := topArr[:0]
	for c := range r.n {
		i := len(top)
		for i > 0 && r.compare(c, top[i-1]) < 0 {
			i--
		}
		if i < n {
			if len(top) < n {
				top = append(top, 0)
			}
			copy(top[i+1:], top[i:len(top)-1])
			top[i] = c
		}
	}
	out := make([]fleet.Instance, len(top))
	for i, c := range top {
		out[i] = r.from[r.idx()[c]]
	}
	return out
}

// compare orders candidates a and b of the ranking (in idx): negative
// when a ranks first.
func (r *Ranking) compare(a, b int) int {
	keys := r.keys()
	ka, kb := keys[a], keys[b]
	switch {
	case ka.tier != kb.tier:
		return cmp.Compare(ka.tier, kb.tier)
	case ka.cost != kb.cost:
		return cmp.Compare(ka.cost, kb.cost)
	case ka.pin != kb.pin:
		if ka.pin {
			return -1
		}
		return 1
	case ka.score != kb.score:
		return -cmp.Compare(ka.score, kb.score)
	}
	idx := r.idx()
	return cmp.Compare(r.from[idx[a]].Name, r.from[idx[b]].Name)
}

// commit ends the reservation of the first: the store bound the session
// there, leaving from ("" for a new session).
func (r *Ranking) commit(from string) { r.held.end(true, from) }

// release ends the reservation of the first, if it is still held: the
// session was not bound there. It may follow commit.
func (r *Ranking) release() { r.held.end(false, "") }

// hold counts a placement on an instance as pending in the load view, so
// that concurrent placements see each other, until it ends once.
type hold struct {
	l    *Load
	name string
}

// holdOn holds a placement on name; the caller ends it.
func (l *Load) holdOn(name string) hold {
	l.mu.Lock()
	l.count(l.pending, name, 1)
	l.mu.Unlock()
	return hold{l: l, name: name}
}

func (h *hold) end(bound bool, from string) {
	if h.l == nil {
		return
	}
	h.l.unreserve(h.name, bound, from)
	h.l = nil
}

// rank runs the pipeline for pl into r, which the caller keeps (a
// ranking of up to 64 candidates allocates nothing).
func (d *Decider) rank(pl *placement, r *Ranking) {
	// Every field but the arrays, which are written before they are read.
	r.from, r.n, r.best, r.overridden, r.held, r.idxBig, r.keyBig = pl.from, 0, -1, false, hold{}, nil, nil
	big := len(pl.from) > len(r.idxArr)
	idx := r.idxArr[:0]
	if big {
		idx = make([]int, 0, len(pl.from))
	}
	idx = filter(pl, candidates(pl, idx))
	if pl.prompt != nil {
		pl.prompt.match(d.index, pl.from, idx)
	}
	// The load view is read, scored on and reserved under one lock, so
	// concurrent placements see each other.
	l := d.load
	l.mu.Lock()
	defer l.mu.Unlock()
	p := d.policy.Load()
	// Each candidate's engine reading, read once for every stage, by its
	// index in from.
	var engs []engineLoad
	if big {
		engs = make([]engineLoad, len(pl.from))
	} else {
		engs = r.engArr[:len(pl.from)]
		clear(engs) // a lent ranking holds the last one's
	}
	if pl.unsaturated || pl.sessions || pl.prompt != nil {
		cutoff := l.cutoff(p.Saturation.Stale)
		for _, i := range idx {
			engs[i] = l.engineLoadSince(pl.from[i].Name, cutoff)
		}
	}
	if pl.unsaturated {
		idx = l.unsaturated(pl.from, idx, p.Saturation, engs)
	}
	r.n = len(idx)
	if big {
		// Copies, never r's own arrays: r keeps no pointer into itself.
		r.idxBig, r.keyBig = slices.Clone(idx), make([]rankKey, r.n)
	}
	if r.n == 0 {
		return
	}
	clear(r.keys())
	switch {
	case pl.prompt != nil && pl.prompt.worth():
		pl.prompt.score(l, p, pl, r, engs)
	case pl.sessions:
		scoreSessions(l, p, pl, r, engs)
	case pl.failOpen != "":
		scoreFailOpen(pl, r)
	}
	pick(pl.key, r)
	if pl.reserve {
		in := pl.from[r.idx()[r.best]]
		l.count(l.pending, in.Name, 1)
		r.held = hold{l: l, name: in.Name}
	}
}

// scoreFailOpen puts the fail-open pool's instance first, whatever its
// load: where a request goes while the store is down.
func scoreFailOpen(pl *placement, r *Ranking) {
	keys := r.keys()
	for k, i := range r.idx() {
		if pl.from[i].Name != pl.failOpen {
			keys[k].tier = 1
		}
	}
}

// candidates is stage 1: the indexes in pl.from of the instances of
// pl.version, or all of them when none is of it.
func candidates(pl *placement, idx []int) []int {
	for i, in := range pl.from {
		if pl.version == "" || in.Version == pl.version {
			idx = append(idx, i)
		}
	}
	if len(idx) == 0 {
		for i := range pl.from {
			idx = append(idx, i)
		}
	}
	return idx
}

// filter is stage 2 (less the saturation, which reads the load view in
// rank): what is left of idx.
func filter(pl *placement, idx []int) []int {
	if pl.leave != "" || pl.zone != "" {
		idx = slices.DeleteFunc(idx, func(i int) bool {
			in := pl.from[i]
			return in.Name == pl.leave || pl.zone != "" && (in.Zone == pl.zone) == pl.otherZones
		})
	}
	// Spot capacity: random routing takes it first, sessions last, and
	// either way only when it leaves some and not all.
	spot := 0
	for _, i := range idx {
		if pl.from[i].Spot() {
			spot++
		}
	}
	if spot > 0 && spot < len(idx) {
		idx = slices.DeleteFunc(idx, func(i int) bool { return pl.from[i].Spot() != pl.spotFirst })
	}
	return idx
}

// unsaturated drops the saturated instances of idx, unless all are;
// engs are their engines' readings, by index in from.
func (l *Load) unsaturated(from []fleet.Instance, idx []int, s Saturation, engs []engineLoad) []int {
	var satBuf [64]bool
	sat := satBuf[:0]
	n := 0
	for _, i := range idx {
		x := l.saturatedWith(from[i].Name, s, engs[i])
		sat = append(sat, x)
		if !x {
			n++
		}
	}
	if n == 0 || n == len(idx) {
		return idx
	}
	kept := idx[:0]
	for k, i := range idx {
		if !sat[k] {
			kept = append(kept, i)
		}
	}
	return kept
}

// scoreSessions is stage 3 for a session's binding. No instance takes a
// session past its bound (bound), and one whose engine reports its KV
// cache full takes one only when every instance under its bound is full.
// The fail-open pool's instance takes it whenever it qualifies. The tiers:
// the fail-open pool's instance, under its bound with KV room (0); any
// under its bound with KV room (1); under its bound (2); the rest (3).
func scoreSessions(l *Load, p *Policy, pl *placement, r *Ranking, engs []engineLoad) {
	idx, keys := r.idx(), r.keys()
	var activeBuf [64]int
	active := activeBuf[:0]
	total, weight := 0, 0.0
	for _, i := range idx {
		in := pl.from[i]
		a := l.activeLocked(in.Name)
		active = append(active, a)
		total += a
		weight += in.Weight
	}
	pref := false
	for k, i := range idx {
		in := pl.from[i]
		under := active[k] < bound(total, in, weight, p.Epsilon)
		e := engs[i]
		full := p.Saturation.KVUsage > 0 && e.ok && e.kvKnown && e.kvUsage >= p.Saturation.KVUsage
		t := int8(3)
		switch {
		case under && !full && in.Name == pl.failOpen:
			t, pref = 0, true
		case under && !full:
			t = 1
		case under:
			t = 2
		}
		keys[k] = rankKey{tier: t}
	}
	r.overridden = pl.failOpen != "" && !pref
}

// bound is bounded load: the most sessions instance in may hold, of the
// total held by candidates of total weight weight, ε the policy's Epsilon.
// It is in's weighted share of one more session by (1+ε), rounded up, and
// never below in.KVSessions: an instance whose KV cache has room for its
// sessions takes the sessions its hash gives it, so replicas, and tether
// without its store, place a session alike.
func bound(total int, in fleet.Instance, weight, eps float64) int {
	return max(ceil((1+eps)*float64(total+1)*in.Weight/weight), in.KVSessions)
}

// pick is stage 4: the first of the ranking, by its keys and then by
// the rendezvous score of key, found in one pass without sorting.
func pick(key uint64, r *Ranking) {
	idx, keys := r.idx(), r.keys()
	equal := true
	for _, i := range idx {
		equal = equal && r.from[i].Weight == r.from[idx[0]].Weight
	}
	for k, i := range idx {
		if equal {
			keys[k].score = draw(key, r.from[i])
		} else {
			keys[k].score = score(key, r.from[i])
		}
	}
	r.best = 0
	for k := 1; k < r.n; k++ {
		if r.compare(k, r.best) < 0 {
			r.best = k
		}
	}
}

func ceil(x float64) int {
	n := int(x)
	if float64(n) < x {
		n++
	}
	return n
}
