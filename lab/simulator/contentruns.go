package simulator

import (
	"fmt"
	"time"
)

// contentRuns is prefix.Index for the simulator's chains, kept in runs of
// blocks: the same answers to Match, Record and Horizon (the calls
// cache-aware placement makes of its index, affinity.PrefixIndex), at a cost
// per call of the runs it touches rather than of the blocks (a Record in
// the field's mix touches about 250 blocks, 170 of them new, each a map
// insertion and later an eviction in prefix.Index).
//
// What makes runs enough is what makes them enough for GIE's indexer
// (gieIndex): a block of a chain is known by its owner (the application,
// its application and shared document, or its conversation) and its
// index. prefix.Index records a chain last block first, so after a Record
// the front of the instance's LRU holds each owner's range as one run,
// lowest index first, all sent at the same time; an eviction takes the
// highest index of the last run. The blocks evicted from one run all have
// the same age, and the moving mean behind Horizon takes them one by one,
// in prefix.Index's order, so it adds up to the same float64.
//
// The decider hands the index chains, not conversations: the router sets
// conv to the conversation whose chain it passes to Refine, and Match and
// Record want that chain (or a prefix of it, the same slice).
// TestContentRunsMatchesIndex drives it and prefix.Index with the same
// calls of a simulation and compares every answer.
type contentRuns struct {
	blockRuns
	capacity int // blocks per instance
	conv     *conversation
	ids      map[string]int32
	insts    []contentInst
	spans    []gieSpan // scratch
	reach    []int     // scratch of Match, per instance
	// trace, when set (tests), sees every call and its answer.
	trace func(contentCall)
}

// contentCall is one call on a contentRuns and its answer.
type contentCall struct {
	op      string // "match", "record" or "horizon"
	name    string
	chain   []uint64
	names   []string
	depth   []int
	best    int
	now     time.Time
	horizon time.Duration
	ok      bool
}

// contentInst is what an instance holds beside its list
// (blockRuns.lists): n the blocks, idle prefix.Index's moving mean of the
// evicted blocks' ages (ns).
type contentInst struct {
	n    int
	idle float64
}

// contentEvictWeight is prefix.Index's evictWeight.
const contentEvictWeight = 0.02

func newContentRuns(capacity int) *contentRuns {
	return &contentRuns{blockRuns: newBlockRuns(0), capacity: max(capacity, 1), ids: map[string]int32{}}
}

// chainSpans returns the owners' ranges of chain, which must be the first
// blocks of the chain of x.conv.
func (x *contentRuns) chainSpans(chain []uint64) []gieSpan {
	c := x.conv
	if c == nil || len(chain) > len(c.hashes) || &chain[0] != &c.hashes[0] {
		panic(fmt.Sprintf("simulate: the decider passed the index a chain of %d blocks that is not the chain of the request it places", len(chain)))
	}
	x.spans = gieSpans(x.spans, c, len(chain))
	return x.spans
}

func (x *contentRuns) id(name string) int32 {
	if i, ok := x.ids[name]; ok {
		return i
	}
	i := x.addList()
	x.insts = append(x.insts, contentInst{})
	x.ids[name] = i
	return i
}

// Match writes into depth[i] how many leading blocks of chain the index
// holds for names[i], and returns the most (prefix.Index.Match).
func (x *contentRuns) Match(chain []uint64, names []string, depth []int) int {
	clear(depth)
	if len(chain) == 0 || len(names) == 0 {
		return 0
	}
	spans := x.chainSpans(chain)
	// reach[i]: the leading blocks instance i holds, as far as the spans
	// so far go; an instance that stops short of a span's end takes no
	// part in the next span.
	reach := x.reach[:0]
	for range x.insts {
		reach = append(reach, 0)
	}
	x.reach = reach
	for _, sp := range spans {
		runs := x.owners[sp.owner]
		// A run holding an instance's next block extends its reach; an
		// instance's runs of one owner are disjoint, so passes until
		// nothing moves settle it.
		for changed := true; changed; {
			changed = false
			for _, id := range runs {
				r := &x.runs[id]
				if at := reach[r.list]; at >= sp.lo && int(r.lo) <= at && at < int(r.hi) {
					reach[r.list] = min(int(r.hi), sp.hi)
					if reach[r.list] < sp.hi {
						changed = true
					}
				}
			}
		}
	}
	best := 0
	for i, name := range names {
		id, ok := x.ids[name]
		if !ok {
			continue
		}
		depth[i] = reach[id]
		best = max(best, reach[id])
	}
	if x.trace != nil {
		x.trace(contentCall{op: "match", chain: chain, names: names, depth: depth, best: best})
	}
	return best
}

// Record notes that chain was sent to instance at now (prefix.Index.Record):
// every block becomes the most recent there, the first most of all; then
// the least recent beyond the capacity are evicted.
func (x *contentRuns) Record(name string, chain []uint64, now time.Time) {
	if len(chain) == 0 {
		return
	}
	spans := x.chainSpans(chain)
	t := now.UnixNano()
	i := x.id(name)
	in := &x.insts[i]
	for k := len(spans) - 1; k >= 0; k-- {
		sp := spans[k]
		held := 0
		runs := x.owners[sp.owner]
		for j := 0; j < len(runs); {
			id := runs[j]
			r := &x.runs[id]
			lo, hi := max(int(r.lo), sp.lo), min(int(r.hi), sp.hi)
			if r.list != i || lo >= hi {
				j++
				continue
			}
			held += hi - lo
			gone := x.cut(id, lo, hi)
			runs = x.owners[sp.owner]
			if !gone { // else runs[j] is another run now
				j++
			}
		}
		in.n += sp.hi - sp.lo - held
		x.front(sp.owner, i, sp.lo, sp.hi, t)
	}
	for in.n > x.capacity {
		id := x.lists[i].tail
		r := &x.runs[id]
		k := min(in.n-x.capacity, int(r.hi-r.lo))
		age := float64(t - r.at)
		for range k {
			if in.idle == 0 {
				in.idle = max(age, 1)
			} else {
				in.idle += contentEvictWeight * (age - in.idle)
				in.idle = max(in.idle, 1)
			}
		}
		r.hi -= int32(k)
		in.n -= k
		if r.lo == r.hi {
			x.remove(id)
		}
	}
	if x.trace != nil {
		x.trace(contentCall{op: "record", name: name, chain: chain, now: now})
	}
}

// Horizon is how long a block nobody sends survives on instance, from the
// evictions (prefix.Index.Horizon).
func (x *contentRuns) Horizon(name string) (h time.Duration, ok bool) {
	if i, known := x.ids[name]; known && x.insts[i].idle != 0 {
		h, ok = time.Duration(x.insts[i].idle), true
	}
	if x.trace != nil {
		x.trace(contentCall{op: "horizon", name: name, horizon: h, ok: ok})
	}
	return h, ok
}

// cut takes blocks [lo, hi) out of run id, leaving the blocks before and
// after them where the run was; true when the run is gone.
func (x *contentRuns) cut(id int32, lo, hi int) bool {
	r := &x.runs[id]
	switch {
	case int(r.lo) == lo && int(r.hi) == hi:
		x.remove(id)
		return true
	case int(r.lo) == lo:
		r.lo = int32(hi)
	case int(r.hi) == hi:
		r.hi = int32(lo)
	default:
		// The blocks before lo are more recent than those after hi: they
		// keep the run's place, the others follow it.
		owner, inst, at, end := r.owner, int(r.list), r.at, int(r.hi)
		r.hi = int32(lo)
		after := x.alloc(owner, inst, hi, end, at)
		x.link(after, id, x.runs[id].next)
	}
	return false
}

// front makes blocks [lo, hi) of owner, sent at t, the most recent of
// instance i.
func (x *contentRuns) front(owner uint64, i int32, lo, hi int, t int64) {
	if h := x.lists[i].head; h >= 0 && x.runs[h].owner == owner && int(x.runs[h].lo) == hi && x.runs[h].at == t {
		x.runs[h].lo = int32(lo)
		return
	}
	id := x.alloc(owner, int(i), lo, hi, t)
	x.link(id, -1, x.lists[i].head)
}
