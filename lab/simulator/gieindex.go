package simulator

import "slices"

// gieIndex is GIE's indexer (gieRouter) kept in runs of blocks instead of
// one entry per block hash: the same answers, at a cost per request of the
// runs it touches rather than of the blocks (about 150 a request at 64
// instances, each a map operation in the indexer's own shape).
//
// What makes runs enough: a prompt's chain is, in order, its application's
// system blocks, its shared document's blocks, then its conversation's own
// blocks (chain.go), so a block is known by its owner (the application,
// the application and document, or the conversation) and its index, and
// two prompts share a hash exactly when they share (owner, index). The
// indexer touches a request's blocks first to last, so after a request the
// front of the server's LRU holds each owner's range as one run, highest
// index first; an eviction takes the lowest index of the last run; a later
// request touching part of a run splits it. A server's LRU is a list of
// runs, and the servers holding a block are the runs of its owner that
// cover it.
//
// TestGIEIndexMatchesHashes drives it and the per-hash indexer (GIE's own
// shape, in the test) with the same requests and compares every answer.
type gieIndex struct {
	blockRuns
	capacity int // blocks per server
	servers  []gieServer
	cover    []gieSpan // scratch of match
}

// gieServer is what a server holds beside its list (blockRuns.lists).
type gieServer struct {
	size int // blocks held
}

// gieSpan is blocks [lo, hi) of owner: part of a prompt's chain.
type gieSpan struct {
	owner  uint64
	lo, hi int
}

// Owner keys: a conversation's own blocks by its index (below 2^41,
// burst conversations included), system and document blocks tagged
// above.
const (
	gieOwnerSystem   = 1 << 62
	gieOwnerDocument = 1 << 63
)

// gieSpans returns the owners' ranges of the first n blocks of c's chain,
// in chain order, into out.
func gieSpans(out []gieSpan, c *conversation, n int) []gieSpan {
	out = out[:0]
	add := func(owner uint64, lo, hi int) {
		if hi = min(hi, n); hi > lo {
			out = append(out, gieSpan{owner: owner, lo: lo, hi: hi})
		}
	}
	add(gieOwnerSystem|uint64(c.shape.app), 0, c.sysBlocks)
	if c.shape.doc >= 0 {
		add(gieOwnerDocument|uint64(c.shape.app)<<32|uint64(c.shape.doc), c.sysBlocks, c.docEnd)
	}
	add(c.shape.index, c.docEnd, n)
	return out
}

func newGIEIndex(servers, capacity int) *gieIndex {
	return &gieIndex{blockRuns: newBlockRuns(servers), capacity: capacity, servers: make([]gieServer, servers)}
}

// match writes into depth[s], for every server s, how many blocks of the
// chain (spans, in order) up to the first block no server holds server s
// holds: GIE's matchLongestPrefix.
func (x *gieIndex) match(spans []gieSpan, depth []int) {
	clear(depth)
	for _, sp := range spans {
		runs := x.owners[sp.owner]
		// The first block of the span no server holds: sweep the runs
		// covering the span's blocks by their first block.
		cover := x.cover[:0]
		for _, id := range runs {
			r := &x.runs[id]
			if lo, hi := max(int(r.lo), sp.lo), min(int(r.hi), sp.hi); lo < hi {
				cover = append(cover, gieSpan{lo: lo, hi: hi})
			}
		}
		slices.SortFunc(cover, func(a, b gieSpan) int { return a.lo - b.lo })
		reach := sp.lo
		for _, c := range cover {
			if c.lo > reach {
				break
			}
			reach = max(reach, c.hi)
		}
		x.cover = cover
		for _, id := range runs {
			r := &x.runs[id]
			if lo, hi := max(int(r.lo), sp.lo), min(int(r.hi), reach); lo < hi {
				depth[r.list] += hi - lo
			}
		}
		if reach < sp.hi {
			return
		}
	}
}

// add is the indexer's Add after a request with the chain spans went to
// server s: each block, first to last, becomes the most recent of s (added
// when s did not hold it, evicting s's least recent block beyond the
// capacity).
func (x *gieIndex) add(spans []gieSpan, s int) {
	for _, sp := range spans {
		for j := sp.lo; j < sp.hi; {
			id, next := x.find(sp.owner, s, j)
			if id >= 0 {
				// Held: blocks j to the run's end move to the front.
				end := min(int(x.runs[id].hi), sp.hi)
				x.cut(id, j, end)
				x.front(sp.owner, s, j, end)
				j = end
				continue
			}
			// Not held up to the next run of the owner on s: added, and
			// as many of s's least recent blocks evicted as the capacity
			// asks. A block added now is never evicted by the blocks added
			// after it while the request's chain fits the capacity; and
			// when it does not, the LRU keeps the most recent blocks
			// whatever the order of the additions and evictions.
			end := min(next, sp.hi)
			x.front(sp.owner, s, j, end)
			x.servers[s].size += end - j
			x.evict(s, x.servers[s].size-x.capacity)
			j = end
		}
	}
}

// find returns the run of owner on server s holding block j (-1: none)
// and where the next run of owner on s after j starts (MaxInt: none).
func (x *gieIndex) find(owner uint64, s, j int) (id int32, next int) {
	next = int(^uint(0) >> 1)
	for _, r := range x.owners[owner] {
		run := &x.runs[r]
		if int(run.list) != s {
			continue
		}
		if int(run.lo) <= j && j < int(run.hi) {
			return r, 0
		}
		if int(run.lo) > j {
			next = min(next, int(run.lo))
		}
	}
	return -1, next
}

// cut takes blocks [lo, hi) out of run id, leaving the blocks before and
// after them where the run was.
func (x *gieIndex) cut(id int32, lo, hi int) {
	r := &x.runs[id]
	switch {
	case int(r.lo) == lo && int(r.hi) == hi:
		x.remove(id)
	case int(r.lo) == lo:
		r.lo = int32(hi)
	case int(r.hi) == hi:
		r.hi = int32(lo)
	default:
		// The blocks after hi are more recent than those before lo: a run
		// of their own, just before it.
		after := x.alloc(r.owner, int(r.list), hi, int(r.hi), 0)
		x.runs[id].hi = int32(lo)
		x.link(after, x.runs[id].prev, id)
	}
}

// front makes blocks [lo, hi) of owner the most recent of server s.
func (x *gieIndex) front(owner uint64, s, lo, hi int) {
	l := &x.lists[s]
	if h := l.head; h >= 0 && x.runs[h].owner == owner && int(x.runs[h].hi) == lo {
		x.runs[h].hi = int32(hi)
		return
	}
	id := x.alloc(owner, s, lo, hi, 0)
	x.link(id, -1, l.head)
}

// evict drops the n least recent blocks of server s.
func (x *gieIndex) evict(s, n int) {
	sv, l := &x.servers[s], &x.lists[s]
	for n > 0 && l.tail >= 0 {
		id := l.tail
		r := &x.runs[id]
		k := min(n, int(r.hi-r.lo))
		r.lo += int32(k)
		sv.size -= k
		n -= k
		if r.lo == r.hi {
			x.remove(id)
		}
	}
}

// drop forgets everything server s holds.
func (x *gieIndex) drop(s int) {
	for x.lists[s].head >= 0 {
		x.remove(x.lists[s].head)
	}
	x.servers[s].size = 0
}
