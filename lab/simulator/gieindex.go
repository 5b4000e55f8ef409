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
	capacity int // blocks per server
	runs     []gieRun
	free     int32 // first free run, linked by next; -1 none
	servers  []gieServer
	owners   map[uint64][]int32 // owner → its runs, on every server
	cover    []gieSpan          // scratch of match
}

// gieRun is blocks [lo, hi) of owner held by server, in the server's LRU
// between prev (more recent) and next; within the run a lower index is
// less recent. pos is its place in owners[owner].
type gieRun struct {
	owner      uint64
	lo, hi     int32
	server     int32
	prev, next int32
	pos        int32
}

// gieServer is one server's LRU: head the most recent run.
type gieServer struct {
	head, tail int32
	size       int // blocks held
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
	x := &gieIndex{capacity: capacity, free: -1, servers: make([]gieServer, servers), owners: map[uint64][]int32{}}
	for i := range x.servers {
		x.servers[i] = gieServer{head: -1, tail: -1}
	}
	return x
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
				depth[r.server] += hi - lo
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
		if int(run.server) != s {
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
		after := x.alloc(r.owner, int(r.server), hi, int(r.hi))
		x.runs[id].hi = int32(lo)
		x.link(after, x.runs[id].prev, id)
	}
}

// front makes blocks [lo, hi) of owner the most recent of server s.
func (x *gieIndex) front(owner uint64, s, lo, hi int) {
	sv := &x.servers[s]
	if h := sv.head; h >= 0 && x.runs[h].owner == owner && int(x.runs[h].hi) == lo {
		x.runs[h].hi = int32(hi)
		return
	}
	id := x.alloc(owner, s, lo, hi)
	x.link(id, -1, sv.head)
}

// evict drops the n least recent blocks of server s.
func (x *gieIndex) evict(s, n int) {
	sv := &x.servers[s]
	for n > 0 && sv.tail >= 0 {
		id := sv.tail
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
	for x.servers[s].head >= 0 {
		x.remove(x.servers[s].head)
	}
	x.servers[s].size = 0
}

// alloc returns a new run of blocks [lo, hi) of owner on server s, not yet
// in the server's list.
func (x *gieIndex) alloc(owner uint64, s, lo, hi int) int32 {
	id := x.free
	if id >= 0 {
		x.free = x.runs[id].next
	} else {
		x.runs = append(x.runs, gieRun{})
		id = int32(len(x.runs) - 1)
	}
	runs := x.owners[owner]
	x.runs[id] = gieRun{owner: owner, lo: int32(lo), hi: int32(hi), server: int32(s), prev: -1, next: -1, pos: int32(len(runs))}
	x.owners[owner] = append(runs, id)
	return id
}

// link puts run id between prev and next (-1: the list's ends) in its
// server's list.
func (x *gieIndex) link(id, prev, next int32) {
	r := &x.runs[id]
	sv := &x.servers[r.server]
	r.prev, r.next = prev, next
	if prev >= 0 {
		x.runs[prev].next = id
	} else {
		sv.head = id
	}
	if next >= 0 {
		x.runs[next].prev = id
	} else {
		sv.tail = id
	}
}

// remove takes run id out of its server's list and its owner's runs, and
// frees it; the blocks it held leave its server's count only through
// evict and drop.
func (x *gieIndex) remove(id int32) {
	r := x.runs[id]
	sv := &x.servers[r.server]
	if r.prev >= 0 {
		x.runs[r.prev].next = r.next
	} else {
		sv.head = r.next
	}
	if r.next >= 0 {
		x.runs[r.next].prev = r.prev
	} else {
		sv.tail = r.prev
	}
	runs := x.owners[r.owner]
	last := runs[len(runs)-1]
	runs[r.pos] = last
	x.runs[last].pos = r.pos
	if runs = runs[:len(runs)-1]; len(runs) == 0 {
		delete(x.owners, r.owner)
	} else {
		x.owners[r.owner] = runs
	}
	x.runs[id] = gieRun{next: x.free, prev: -1}
	x.free = id
}
