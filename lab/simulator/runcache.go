package simulator

import (
	"hash/fnv"

	"github.com/tetherproxy/tether/lab/emulator"
)

// runCache is emulator.KVCache for the chains a simulation stores, kept by runs
// of blocks instead of block by block.
//
// Every chain the simulation stores is chain(a, c, n): the full blocks
// 0..S_a-1 of application a's system prompt (shared by its conversations),
// then blocks S_a..n-1 that belong to conversation c alone; a conversation's
// chains only grow from turn to turn (each prompt carries the previous
// prompt and answer). Under emulator.KVCache's rules (read them there) the state
// of such chains has a simple shape, which this type keeps instead of one
// record per block:
//
//   - The cached blocks of a conversation are a run S_a..end-1, contiguous
//     in the LRU and in index order: each store puts the whole chain at the
//     front, first block first; the LRU then evicts a run from its end.
//     Their ready times rise with the index, kept as segments.
//   - The cached system blocks of an application are a prefix 0..s-1, also
//     one run of the LRU; each keeps its own ready time, reference count
//     and generation (the emulator's block objects: a block evicted and stored again
//     is a new object, and the conversations that held the old one no
//     longer count for it), in an array.
//   - The LRU is a list of runs, at most one per application and one per
//     conversation; capacity eviction trims the last run.
//   - With the conversation cap, a conversation's blocks are held by
//     exactly one kept conversation record (its own), so they need no
//     reference counts: dropping the record frees the run.
//
// A store or a lookup then costs O(S_a) array steps and O(1) runs instead
// of a map operation and a list move per block. TestRunCacheMatchesSim
// drives this type and emulator.KVCache with the same random stores and lookups
// of this shape, edge cases included (chains of system blocks only,
// capacities smaller than a chain, caps of one), and compares every answer
// and every counter.
type runCache struct {
	maxBlocks int
	maxConvs  int // 0: no conversation tracking
	count     int // blocks cached

	apps []appBlocks
	runs map[uint64]int32 // conversation → slot in convRuns
	all  []convRun
	free []int32

	// The LRU of runs: node i < len(apps) is application i's system run,
	// node len(apps)+j is convRuns slot j.
	lruPrev, lruNext []int32
	lruFront         int32
	lruBack          int32

	recs      []convRecord
	freeRecs  []int32
	sessions  map[uint64]int32
	leaves    map[leafKey]int32
	leafConv  map[uint64]int32 // records whose leaf is a conversation block, by conversation
	sysLeaves []int            // per application: records whose leaf is one of its system blocks
	recFront  int32
	recBack   int32
	recLen    int

	stats emulator.CacheStats
	segs  []readySeg // scratch
}

// appBlocks are the system blocks of one application.
type appBlocks struct {
	blocks []sysBlock // S_a of them
	cached int        // blocks 0..cached-1 are cached
	// readyBy is when every cached block is ready, or later (a bound:
	// blocks that leave the cache leave it as it was).
	readyBy int64
	// gens counts the changes of its blocks' generations: a record that
	// saw the same count holds every block it held.
	gens uint64
}

type sysBlock struct {
	ready int64
	refs  int32
	gen   uint32 // changes when the block leaves the cache
}

// convRun is the cached blocks of one conversation: start..end-1.
type convRun struct {
	conv       uint64
	start, end int32
	segs       []readySeg
}

// readySeg says blocks up to end-1 (from the previous segment's end) are
// ready at ready.
type readySeg struct {
	end   int32
	ready int64
}

// leafKey names a block: a conversation's (sys false, owner the
// conversation) or an application's system block (sys true, owner the
// application).
type leafKey struct {
	owner uint64
	index int32
	sys   bool
}

// convRecord is one of the emulator's conversations (the unit of the cap).
type convRecord struct {
	named     bool
	session   uint64
	leaf      leafKey
	leafIndex bool
	// The chain of its last store (hasChain): application app's system
	// blocks, with the generations they had, and conversation conv's
	// blocks up to n.
	hasChain bool
	app      int
	conv     uint64
	n        int32
	sysGens  []uint32
	appGens  uint64 // its application's gens when sysGens were taken

	listed     bool
	prev, next int32
}

// newRunCache mirrors emulator.NewKVCache for a simulation whose applications'
// system prompts have systemBlocks[a] full blocks; cfg must be valid.
func newRunCache(cfg emulator.CacheConfig, systemBlocks []int) *runCache {
	c := &runCache{
		maxBlocks: cfg.CapacityTokens / emulator.BlockSize,
		runs:      make(map[uint64]int32),
		sessions:  make(map[uint64]int32),
		leaves:    make(map[leafKey]int32),
		leafConv:  make(map[uint64]int32),
		sysLeaves: make([]int, len(systemBlocks)),
		lruFront:  -1, lruBack: -1, recFront: -1, recBack: -1,
	}
	switch {
	case cfg.MaxConversations == 0:
		c.maxConvs = emulator.DefaultMaxConversations
	case cfg.MaxConversations > 0:
		c.maxConvs = cfg.MaxConversations
	}
	for _, n := range systemBlocks {
		c.apps = append(c.apps, appBlocks{blocks: make([]sysBlock, n)})
		c.lruPrev = append(c.lruPrev, -1)
		c.lruNext = append(c.lruNext, -1)
	}
	return c
}

// sessionKey is the emulator's hash of a session id (FNV-1a, 64 bits).
func sessionKey(s string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(s))
	return h.Sum64()
}

// match mirrors KVCache.Match on the first lookup blocks of chain(a, conv, ·):
// how many leading blocks are cached and ready at t.
func (c *runCache) match(a int, conv uint64, lookup int, t int64) int {
	app := &c.apps[a]
	sys := len(app.blocks)
	if look := min(lookup, sys); look > app.cached || app.readyBy > t {
		for i := range look {
			if i >= app.cached || app.blocks[i].ready > t {
				return i
			}
		}
	}
	if lookup <= sys {
		return lookup
	}
	slot, ok := c.runs[conv]
	if !ok {
		return sys
	}
	r := &c.all[slot]
	upto := min(int32(lookup), r.end)
	pos := r.start
	for _, s := range r.segs {
		if pos >= upto {
			break
		}
		if s.ready > t {
			return int(pos)
		}
		pos = s.end
	}
	return int(min(pos, upto))
}

// store mirrors KVCache.Store of chain(a, conv, n): blocks below
// promptBlocks ready at prompt, the others at answer. named and session
// are the emulator's session argument (named: session = sessionKey(x-session-id)).
func (c *runCache) store(a int, conv uint64, n, promptBlocks int, prompt, answer int64, named bool, session uint64) {
	app := &c.apps[a]
	sys := len(app.blocks)
	readyAt := func(i int) int64 {
		if i < promptBlocks {
			return prompt
		}
		return answer
	}
	// The blocks: present ones keep the earlier ready time, missing ones
	// are inserted.
	if app.cached < sys || app.readyBy > min(prompt, answer) {
		app.readyBy = 0
		for i := range sys {
			b := &app.blocks[i]
			if i >= app.cached {
				b.ready, b.refs = readyAt(i), 0
				c.count++
			} else {
				b.ready = min(b.ready, readyAt(i))
			}
			app.readyBy = max(app.readyBy, b.ready)
		}
		app.cached = sys
	}
	node := int32(-1)
	if n > sys {
		slot, ok := c.runs[conv]
		if !ok {
			slot = c.newRun(conv, int32(sys))
		}
		r := &c.all[slot]
		c.count += n - int(r.end)
		c.extend(r, int32(n), int32(promptBlocks), prompt, answer)
		node = int32(len(c.apps)) + slot
	}
	// The LRU: the conversation's run, then the system run, to the front.
	if node >= 0 {
		c.toFront(node)
	}
	c.toFront(int32(a))

	if c.maxConvs > 0 {
		c.assign(a, conv, n, named, session)
		for c.recLen > c.maxConvs {
			c.dropRecord(c.recBack)
			c.stats.ConversationEvictions++
		}
	}
	for c.count > c.maxBlocks {
		c.evictBack(c.count - c.maxBlocks)
	}
}

// extend makes r cover start..n-1 with the ready times min(old, new).
func (c *runCache) extend(r *convRun, n, promptBlocks int32, prompt, answer int64) {
	out := c.segs[:0]
	pos := r.start
	emit := func(end int32, ready int64) {
		if end <= pos {
			return
		}
		if k := len(out) - 1; k >= 0 && out[k].ready == ready {
			out[k].end = end
		} else {
			out = append(out, readySeg{end: end, ready: ready})
		}
		pos = end
	}
	next := func(limit int32) (int32, int64) {
		if pos < promptBlocks {
			return min(limit, promptBlocks), prompt
		}
		return limit, answer
	}
	for _, s := range r.segs {
		for pos < s.end {
			end, v := next(s.end)
			emit(end, min(s.ready, v))
		}
	}
	for pos < n {
		emit(next(n))
	}
	r.segs = append(r.segs[:0], out...)
	r.end = n
	c.segs = out
}

// assign mirrors KVCache.assign for chain(a, conv, n), never empty.
func (c *runCache) assign(a int, conv uint64, n int, named bool, session uint64) {
	var cv int32
	if named {
		var ok bool
		if cv, ok = c.sessions[session]; !ok {
			cv = c.newRecord(true, session)
			c.sessions[session] = cv
		}
	} else if cv = c.deepestLeaf(a, conv, n); cv < 0 {
		cv = c.newRecord(false, 0)
	}

	// sim adds a reference to every block of the new chain, then drops
	// one from every live block of the old chain. For the system blocks of
	// the same application that is: a block the record already held (same
	// generation) keeps its count, any other gains one. The old chain's
	// blocks of another application or conversation (only when a record
	// of system blocks alone is continued by another conversation) lose
	// theirs.
	rec := &c.recs[cv]
	app := &c.apps[a]
	sys := len(app.blocks)
	if rec.hasChain && rec.app == a {
		if rec.appGens != app.gens {
			for i := range sys {
				if b := &app.blocks[i]; rec.sysGens[i] != b.gen {
					b.refs++
					rec.sysGens[i] = b.gen
				}
			}
		}
	} else {
		for i := range sys {
			app.blocks[i].refs++
		}
		if rec.hasChain {
			c.releaseSystem(rec.app, rec.sysGens)
		}
		gens := rec.sysGens[:0]
		for i := range sys {
			gens = append(gens, app.blocks[i].gen)
		}
		rec.sysGens = gens
	}
	rec.appGens = app.gens
	if rec.hasChain && rec.conv != conv && int(rec.n) > len(c.apps[rec.app].blocks) {
		c.releaseRun(rec.conv)
	}
	rec.app, rec.conv, rec.n, rec.hasChain = a, conv, int32(n), true
	if !rec.named {
		c.unindexLeaf(cv)
		if n > sys {
			rec.leaf = leafKey{owner: conv, index: int32(n - 1)}
			c.leafConv[conv] = cv
		} else {
			rec.leaf = leafKey{owner: uint64(a), index: int32(n - 1), sys: true}
			c.sysLeaves[a]++
		}
		c.leaves[rec.leaf] = cv
		rec.leafIndex = true
	}
	c.recToFront(cv)
}

// deepestLeaf finds the anonymous record whose leaf is the deepest block of
// chain(a, conv, n), as the emulator's scan from the end of the chain does.
func (c *runCache) deepestLeaf(a int, conv uint64, n int) int32 {
	sys := len(c.apps[a].blocks)
	if cv, ok := c.leafConv[conv]; ok && int(c.recs[cv].leaf.index) < n {
		return cv
	}
	if c.sysLeaves[a] > 0 {
		for i := min(sys, n) - 1; i >= 0; i-- {
			if cv, ok := c.leaves[leafKey{owner: uint64(a), index: int32(i), sys: true}]; ok {
				return cv
			}
		}
	}
	return -1
}

func (c *runCache) unindexLeaf(cv int32) {
	rec := &c.recs[cv]
	if !rec.leafIndex {
		return
	}
	delete(c.leaves, rec.leaf)
	if rec.leaf.sys {
		c.sysLeaves[rec.leaf.owner]--
	} else if c.leafConv[rec.leaf.owner] == cv {
		delete(c.leafConv, rec.leaf.owner)
	}
	rec.leafIndex = false
}

// dropRecord mirrors KVCache.dropConversation.
func (c *runCache) dropRecord(cv int32) {
	rec := &c.recs[cv]
	if rec.hasChain {
		c.releaseSystem(rec.app, rec.sysGens)
		if int(rec.n) > len(c.apps[rec.app].blocks) {
			c.releaseRun(rec.conv)
		}
	}
	c.forget(cv)
}

// releaseSystem drops a reference from each live system block of
// application a that a record held with generations gens, and frees those
// no record holds any more. The cached blocks stay a prefix: the records
// holding a block include those holding any block after it.
func (c *runCache) releaseSystem(a int, gens []uint32) {
	app := &c.apps[a]
	lowest := app.cached
	for i, g := range gens {
		b := &app.blocks[i]
		if i >= app.cached || b.gen != g {
			continue // evicted since
		}
		b.refs--
		if b.refs <= 0 {
			b.gen++
			app.gens++
			b.refs = 0
			c.count--
			c.stats.ReleasedBlocks++
			lowest = min(lowest, i)
		}
	}
	if lowest < app.cached {
		app.cached = lowest
		if lowest == 0 {
			c.unlink(int32(a))
		}
	}
}

// releaseRun frees the cached blocks of conversation conv (held by one
// record only).
func (c *runCache) releaseRun(conv uint64) {
	slot, ok := c.runs[conv]
	if !ok {
		return
	}
	r := &c.all[slot]
	n := int(r.end - r.start)
	c.count -= n
	c.stats.ReleasedBlocks += int64(n)
	c.deleteRun(slot)
}

// forget mirrors KVCache.forget; the record's slot is then free.
func (c *runCache) forget(cv int32) {
	rec := &c.recs[cv]
	if rec.named {
		delete(c.sessions, rec.session)
	} else {
		c.unindexLeaf(cv)
	}
	if rec.listed {
		c.recUnlink(cv)
	}
	c.freeRecs = append(c.freeRecs, cv)
}

// evictBack removes up to excess blocks from the end of the LRU's last run.
func (c *runCache) evictBack(excess int) {
	node := c.lruBack
	if int(node) < len(c.apps) {
		app := &c.apps[node]
		k := min(excess, app.cached)
		for i := app.cached - k; i < app.cached; i++ {
			app.blocks[i].gen++
			app.blocks[i].refs = 0
		}
		app.gens++
		app.cached -= k
		c.count -= k
		c.stats.Evictions += int64(k)
		if app.cached == 0 {
			c.unlink(node)
		}
		return
	}
	slot := node - int32(len(c.apps))
	r := &c.all[slot]
	k := min(excess, int(r.end-r.start))
	r.end -= int32(k)
	c.count -= k
	c.stats.Evictions += int64(k)
	if r.end == r.start {
		c.deleteRun(slot)
		return
	}
	for len(r.segs) > 0 && r.segs[len(r.segs)-1].end > r.end {
		last := &r.segs[len(r.segs)-1]
		if len(r.segs) == 1 || r.segs[len(r.segs)-2].end < r.end {
			last.end = r.end
			break
		}
		r.segs = r.segs[:len(r.segs)-1]
	}
}

// cacheStats mirrors KVCache.Stats.
func (c *runCache) cacheStats() emulator.CacheStats {
	s := c.stats
	s.BlockSize = emulator.BlockSize
	s.Blocks = c.count
	s.Tokens = c.count * emulator.BlockSize
	s.CapacityTokens = c.maxBlocks * emulator.BlockSize
	s.Conversations = c.recLen
	s.MaxConversations = c.maxConvs
	return s
}

func (c *runCache) newRun(conv uint64, start int32) int32 {
	var slot int32
	if n := len(c.free); n > 0 {
		slot = c.free[n-1]
		c.free = c.free[:n-1]
	} else {
		c.all = append(c.all, convRun{})
		c.lruPrev = append(c.lruPrev, -1)
		c.lruNext = append(c.lruNext, -1)
		slot = int32(len(c.all) - 1)
	}
	r := &c.all[slot]
	r.conv, r.start, r.end, r.segs = conv, start, start, r.segs[:0]
	c.runs[conv] = slot
	return slot
}

func (c *runCache) deleteRun(slot int32) {
	node := int32(len(c.apps)) + slot
	if c.linked(node) {
		c.unlink(node)
	}
	delete(c.runs, c.all[slot].conv)
	c.all[slot].segs = c.all[slot].segs[:0]
	c.free = append(c.free, slot)
}

// toFront moves LRU node i (linked or not) to the front.
func (c *runCache) toFront(i int32) {
	if c.lruFront == i {
		return
	}
	if c.linked(i) {
		c.unlink(i)
	}
	c.lruPrev[i], c.lruNext[i] = -1, c.lruFront
	if c.lruFront >= 0 {
		c.lruPrev[c.lruFront] = i
	} else {
		c.lruBack = i
	}
	c.lruFront = i
}

func (c *runCache) linked(i int32) bool { return c.lruPrev[i] >= 0 || c.lruFront == i }

func (c *runCache) unlink(i int32) {
	p, n := c.lruPrev[i], c.lruNext[i]
	if p >= 0 {
		c.lruNext[p] = n
	} else if c.lruFront == i {
		c.lruFront = n
	}
	if n >= 0 {
		c.lruPrev[n] = p
	} else if c.lruBack == i {
		c.lruBack = p
	}
	c.lruPrev[i], c.lruNext[i] = -1, -1
}

func (c *runCache) newRecord(named bool, session uint64) int32 {
	var i int32
	if n := len(c.freeRecs); n > 0 {
		i = c.freeRecs[n-1]
		c.freeRecs = c.freeRecs[:n-1]
	} else {
		c.recs = append(c.recs, convRecord{})
		i = int32(len(c.recs) - 1)
	}
	c.recs[i] = convRecord{named: named, session: session, prev: -1, next: -1, sysGens: c.recs[i].sysGens[:0]}
	return i
}

func (c *runCache) recToFront(i int32) {
	rec := &c.recs[i]
	if rec.listed {
		if c.recFront == i {
			return
		}
		c.recUnlink(i)
	}
	rec = &c.recs[i]
	rec.listed = true
	rec.prev, rec.next = -1, c.recFront
	if c.recFront >= 0 {
		c.recs[c.recFront].prev = i
	} else {
		c.recBack = i
	}
	c.recFront = i
	c.recLen++
}

func (c *runCache) recUnlink(i int32) {
	rec := &c.recs[i]
	if rec.prev >= 0 {
		c.recs[rec.prev].next = rec.next
	} else {
		c.recFront = rec.next
	}
	if rec.next >= 0 {
		c.recs[rec.next].prev = rec.prev
	} else {
		c.recBack = rec.prev
	}
	rec.prev, rec.next, rec.listed = -1, -1, false
	c.recLen--
}
