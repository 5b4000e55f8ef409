package simulator

// blockRuns keeps runs of chain blocks: each run is blocks [lo, hi) of one
// owner (an application's system prompt, a shared document, a
// conversation; gieSpans) on one list, a server's or an instance's LRU,
// in that list's order of use. Each owner's runs are found wherever they
// are. What GIE's indexer (gieindex.go) and tether's prefix index
// (contentruns.go) keep of the simulator's chains.
type blockRuns struct {
	runs   []blockRun
	free   int32 // first free run, linked by next; -1 none
	lists  []listEnds
	owners map[uint64][]int32 // owner → its runs, on every list
}

// blockRun is blocks [lo, hi) of owner on list, between prev (more
// recent) and next. pos is its place in owners[owner]; at is when it was
// last sent, for the indexes that age their blocks.
type blockRun struct {
	owner      uint64
	at         int64
	lo, hi     int32
	list       int32
	prev, next int32
	pos        int32
}

// listEnds are a list's most recent run (head) and least recent (tail);
// -1 for none.
type listEnds struct{ head, tail int32 }

func newBlockRuns(lists int) blockRuns {
	x := blockRuns{free: -1, owners: map[uint64][]int32{}}
	for range lists {
		x.addList()
	}
	return x
}

// addList adds an empty list and returns its index.
func (x *blockRuns) addList() int32 {
	x.lists = append(x.lists, listEnds{head: -1, tail: -1})
	return int32(len(x.lists) - 1)
}

// alloc returns a new run of blocks [lo, hi) of owner on list, sent at
// at, not yet linked into the list.
func (x *blockRuns) alloc(owner uint64, list, lo, hi int, at int64) int32 {
	id := x.free
	if id >= 0 {
		x.free = x.runs[id].next
	} else {
		x.runs = append(x.runs, blockRun{})
		id = int32(len(x.runs) - 1)
	}
	runs := x.owners[owner]
	x.runs[id] = blockRun{owner: owner, at: at, lo: int32(lo), hi: int32(hi), list: int32(list), prev: -1, next: -1, pos: int32(len(runs))}
	x.owners[owner] = append(runs, id)
	return id
}

// link puts run id between prev and next (-1: the list's ends) in its
// list.
func (x *blockRuns) link(id, prev, next int32) {
	r := &x.runs[id]
	l := &x.lists[r.list]
	r.prev, r.next = prev, next
	if prev >= 0 {
		x.runs[prev].next = id
	} else {
		l.head = id
	}
	if next >= 0 {
		x.runs[next].prev = id
	} else {
		l.tail = id
	}
}

// remove takes run id out of its list and its owner's runs, and frees it.
func (x *blockRuns) remove(id int32) {
	r := x.runs[id]
	l := &x.lists[r.list]
	if r.prev >= 0 {
		x.runs[r.prev].next = r.next
	} else {
		l.head = r.next
	}
	if r.next >= 0 {
		x.runs[r.next].prev = r.prev
	} else {
		l.tail = r.prev
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
	x.runs[id] = blockRun{next: x.free, prev: -1}
	x.free = id
}
