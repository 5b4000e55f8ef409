package prefix

import (
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"
)

// Index keeps, for each instance, the blocks of the prompts tether sent
// there. What it keeps is bounded by what the instance's KV cache can
// hold, least recently sent out first. It answers which candidate holds
// the longest prefix of a new prompt.
//
// It is what tether knows of each cache from its own routing. It cannot
// see an engine evict, so it evicts as an LRU of the engine's capacity
// would.
//
// Memory: each (instance, block) is one 24-byte node in a slab, plus one
// map entry. The entry is a uint64 key and an int32 value, with Go's map
// overhead. BenchmarkIndexMemory measures the whole per block held.
//
// A held block is keyed by its hash XOR its instance's salt. Two pairs
// collide with probability 2⁻⁶⁴, as two blocks' hashes do.
//
// It is safe for concurrent use. One mutex guards it.
type Index struct {
	mu     sync.Mutex
	blocks map[uint64]int32 // block hash ^ instance salt → its node
	nodes  []node
	free   int32 // first free node, linked by next; -1 none
	insts  []instance
	ids    map[string]int32
	// capacity is an instance's capacity in blocks until SetCapacity.
	capacity int
}

// node is one block one instance holds.
type node struct {
	key        uint64 // the block's hash ^ the instance's salt
	at         int64  // when it was last sent there, unix ns
	prev, next int32  // in the instance's LRU, most recent first; -1 none
}

// instance is one instance's LRU.
type instance struct {
	name       string
	salt       uint64
	head, tail int32
	n, cap     int
	evictions  uint64
	// idle is the moving mean of how long evicted blocks had gone unsent,
	// in ns. It is how long a prefix nobody sends survives there. 0 means
	// none was evicted.
	idle float64
}

// Stat is one instance's share of the index.
type Stat struct {
	Instance  string
	Blocks    int // indexed now
	Capacity  int // at most
	Evictions uint64
	// Horizon is how long a block nobody sends survives there. It is a
	// moving mean over the blocks the index evicted, and 0 while none was.
	Horizon time.Duration
}

// NewIndex returns an index giving each instance capacity blocks, at least
// 1, until SetCapacity says otherwise.
func NewIndex(capacity int) *Index {
	return &Index{blocks: map[uint64]int32{}, free: -1, ids: map[string]int32{}, capacity: max(capacity, 1)}
}

// id returns the instance's id, adding it.
func (x *Index) id(name string) int32 {
	if i, ok := x.ids[name]; ok {
		return i
	}
	i := int32(len(x.insts))
	x.insts = append(x.insts, instance{name: name, salt: salt(name), head: -1, tail: -1, cap: x.capacity})
	x.ids[name] = i
	return i
}

// SetCapacity bounds what the index keeps for instance, in blocks. The
// bound is what its engine says its KV cache holds, in the index's block
// size. SetCapacity evicts down to it.
func (x *Index) SetCapacity(name string, blocks int, now time.Time) {
	x.mu.Lock()
	defer x.mu.Unlock()
	in := &x.insts[x.id(name)]
	in.cap = max(blocks, 1)
	for in.n > in.cap {
		x.evict(in, now.UnixNano())
	}
}

// Forget drops everything indexed for instance. The instance left the
// fleet, or its engine restarted with an empty cache.
func (x *Index) Forget(name string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	i, ok := x.ids[name]
	if !ok {
		return
	}
	in := &x.insts[i]
	for in.tail >= 0 {
		x.drop(in, in.tail)
	}
}

// Record notes that the blocks of chain were sent to instance at now. Its
// engine computes or reuses every one of them. So each is now the most
// recently used there, the first block most of all. An engine evicts a
// prompt's last blocks first.
func (x *Index) Record(name string, chain []uint64, now time.Time) {
	if len(chain) == 0 {
		return
	}
	t := now.UnixNano()
	x.mu.Lock()
	defer x.mu.Unlock()
	in := &x.insts[x.id(name)]
	for k := len(chain) - 1; k >= 0; k-- {
		x.touch(in, chain[k]^in.salt, t)
	}
	for in.n > in.cap {
		x.evict(in, t)
	}
}

// Match writes into depth[i], for each candidate names[i], how many
// leading blocks of chain the index holds for it, and returns the largest.
// depth must be as long as names.
//
// What the index holds for an instance is always a prefix of each chain. A
// block is sent with all those before it, and they become more recent than
// it. So a block outlives none of its predecessors. Each candidate's depth
// is therefore found by binary search. That is about 64 × 12 lookups for a
// 400 KB prompt over 64 candidates.
func (x *Index) Match(chain []uint64, names []string, depth []int) int {
	clear(depth)
	if len(chain) == 0 || len(names) == 0 {
		return 0
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	best := 0
	for i, name := range names {
		id, ok := x.ids[name]
		if !ok {
			continue
		}
		salt := x.insts[id].salt
		if _, ok := x.blocks[chain[0]^salt]; !ok {
			continue
		}
		// Invariant: it holds chain[lo-1], not chain[hi]. hi = len means
		// unknown.
		lo, hi := 1, len(chain)
		for lo < hi {
			mid := int(uint(lo+hi+1) >> 1)
			if _, ok := x.blocks[chain[mid-1]^salt]; ok {
				lo = mid
			} else {
				hi = mid - 1
			}
		}
		depth[i] = lo
		best = max(best, lo)
	}
	return best
}

// Stats returns each instance's share of the index, in the order the
// instances were first seen.
func (x *Index) Stats() []Stat {
	x.mu.Lock()
	defer x.mu.Unlock()
	out := make([]Stat, 0, len(x.insts))
	for _, in := range x.insts {
		out = append(out, Stat{Instance: in.name, Blocks: in.n, Capacity: in.cap,
			Evictions: in.evictions, Horizon: time.Duration(in.idle)})
	}
	return out
}

// Horizon is how long a block nobody sends survives on instance, from the
// index's evictions. ok is false while it has evicted none there.
func (x *Index) Horizon(name string) (time.Duration, bool) {
	x.mu.Lock()
	defer x.mu.Unlock()
	i, ok := x.ids[name]
	if !ok || x.insts[i].idle == 0 {
		return 0, false
	}
	return time.Duration(x.insts[i].idle), true
}

// touch makes the block keyed key the most recent of in, adding it.
func (x *Index) touch(in *instance, key uint64, t int64) {
	if n, ok := x.blocks[key]; ok {
		x.nodes[n].at = t
		x.unlink(in, n)
		x.push(in, n)
		return
	}
	n := x.alloc()
	x.nodes[n] = node{key: key, at: t, prev: -1, next: -1}
	x.blocks[key] = n
	x.push(in, n)
	in.n++
}

// evictWeight is the weight of the newest eviction in Horizon's moving
// mean. About the last fifty evictions count.
const evictWeight = 0.02

// evict drops in's least recent block.
func (x *Index) evict(in *instance, t int64) {
	n := in.tail
	age := float64(t - x.nodes[n].at)
	if in.idle == 0 {
		in.idle = max(age, 1)
	} else {
		in.idle += evictWeight * (age - in.idle)
		in.idle = max(in.idle, 1)
	}
	in.evictions++
	x.drop(in, n)
}

// drop removes node n from in.
func (x *Index) drop(in *instance, n int32) {
	x.unlink(in, n)
	in.n--
	delete(x.blocks, x.nodes[n].key)
	x.nodes[n] = node{next: x.free, prev: -1}
	x.free = n
}

func (x *Index) alloc() int32 {
	if n := x.free; n >= 0 {
		x.free = x.nodes[n].next
		return n
	}
	x.nodes = append(x.nodes, node{})
	return int32(len(x.nodes) - 1)
}

func (x *Index) push(in *instance, n int32) {
	x.nodes[n].prev, x.nodes[n].next = -1, in.head
	if in.head >= 0 {
		x.nodes[in.head].prev = n
	}
	in.head = n
	if in.tail < 0 {
		in.tail = n
	}
}

func (x *Index) unlink(in *instance, n int32) {
	p, nx := x.nodes[n].prev, x.nodes[n].next
	if p >= 0 {
		x.nodes[p].next = nx
	} else if in.head == n {
		in.head = nx
	}
	if nx >= 0 {
		x.nodes[nx].prev = p
	} else if in.tail == n {
		in.tail = p
	}
	x.nodes[n].prev, x.nodes[n].next = -1, -1
}

// salt is an instance's key salt. It is a hash of its name, so every
// replica keys alike.
func salt(name string) uint64 { return xxhash.Sum64String(name) | 1 }
