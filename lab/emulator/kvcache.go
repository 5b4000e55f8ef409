package emulator

import (
	"fmt"
	"hash/fnv"
	"sync"
	"time"
)

// DefaultMaxConversations is the conversation cap of a CacheConfig that
// leaves MaxConversations zero.
const DefaultMaxConversations = 20

// CacheConfig configures a KVCache.
type CacheConfig struct {
	// CapacityTokens bounds the tokens the cache holds, in whole blocks
	// (rounded down to a multiple of BlockSize). At least BlockSize.
	CapacityTokens int

	// MaxConversations caps the conversations whose blocks the cache keeps:
	// when one more conversation stores blocks, the least recently used one
	// is dropped and the blocks no kept conversation holds are freed. Zero
	// means DefaultMaxConversations; negative means no cap (blocks then
	// leave only by the capacity LRU). See KVCache for what a conversation is.
	MaxConversations int
}

// Validate reports the first problem with the configuration.
func (c CacheConfig) Validate() error {
	if c.CapacityTokens < BlockSize {
		return fmt.Errorf("emulator: kv cache capacity_tokens %d: want at least one block (%d tokens)", c.CapacityTokens, BlockSize)
	}
	return nil
}

func (c CacheConfig) maxConversations() int {
	switch {
	case c.MaxConversations == 0:
		return DefaultMaxConversations
	case c.MaxConversations < 0:
		return 0 // no cap
	}
	return c.MaxConversations
}

// Block is one block of a sequence to store: its chained hash and the time
// from which it can serve other requests (when its KV has been computed).
type Block struct {
	Hash  BlockHash
	Ready time.Time
}

// CacheStats describes a KVCache.
type CacheStats struct {
	BlockSize        int `json:"block_size"`
	Blocks           int `json:"blocks"`
	Tokens           int `json:"tokens"` // Blocks × BlockSize
	CapacityTokens   int `json:"capacity_tokens"`
	Conversations    int `json:"conversations"`
	MaxConversations int `json:"max_conversations"` // 0: no cap
	// Evictions counts blocks dropped by the capacity LRU.
	Evictions int64 `json:"evictions"`
	// ConversationEvictions counts conversations dropped by the cap.
	ConversationEvictions int64 `json:"conversation_evictions"`
	// ReleasedBlocks counts blocks freed because no kept conversation held
	// them any more (after a conversation was dropped or moved on).
	ReleasedBlocks int64 `json:"released_blocks"`
}

// KVCache is the prefix cache of one emulated GPU: blocks of BlockSize tokens
// identified by chained hashes (see BlockHash), evicted least recently used
// first when the capacity is reached, as vLLM's and SGLang's automatic prefix
// caching do.
//
// A request hits the longest run of leading blocks that are all cached and
// ready (Match). After it, its blocks are stored (Store): present ones are
// marked used, missing ones inserted. Blocks are marked used from the last to
// the first, so a block is always used more recently than the blocks after
// it, and the LRU always evicts the end of a chain before its beginning: the
// cache never holds a block whose prefix it has lost.
//
// Conversations. With a conversation cap, the cache also keeps at most
// MaxConversations conversations, each holding the blocks of its most recent
// Store. A conversation is:
//   - the session named by Store's session argument (the request's
//     x-session-id header) when it is not empty;
//   - otherwise a chain of blocks: a store without session continues the
//     anonymous conversation whose last block (its leaf) is the deepest
//     block of the stored chain, and starts a new one when no anonymous
//     conversation ends on the chain. A follow-up turn, whose prompt carries
//     the previous prompt and answer, so continues its conversation, while
//     two users who share only a system prompt are two conversations.
//
// A conversation that stores a different chain (a new turn, an edited
// history) lets go of the blocks its new chain does not contain. Blocks
// shared by several conversations (a common system prompt) stay while any
// of them is kept. A store whose chain is empty (a prompt shorter than one
// block) holds nothing and drops its session's previous blocks.
//
// A KVCache is safe for concurrent use. Its memory is bounded by the capacity
// (one small record per block) and by the cap (one record per conversation);
// sessions are kept as 64-bit hashes.
type KVCache struct {
	cfg       CacheConfig
	maxBlocks int
	maxConvs  int // 0: no conversation tracking

	mu     sync.Mutex
	blocks map[BlockHash]*cacheBlock
	// lru runs from the most recently used block (front) to the least
	// (back), linked through the blocks.
	lru      blockList
	sessions map[uint64]*conversation
	leaves   map[BlockHash]*conversation // anonymous conversations by their last block
	convLRU  convList                    // front is the most recently used
	convs    int                         // in convLRU
	stats    CacheStats
	// held is the blocks of the chain being stored; free the records of
	// blocks the cache let go of, for the blocks it inserts next.
	held []*cacheBlock
	free []*cacheBlock
	// onRemove, when set (for the duration of one storeReporting call),
	// learns the hash of every block the cache frees.
	onRemove func(BlockHash)
}

// cacheBlock is a cached block. The cache reuses the record of a block
// it let go of: gen tells the two apart.
type cacheBlock struct {
	hash              BlockHash
	ready             time.Time
	refs              int    // conversations whose chain holds this block (with a cap)
	gen               uint32 // changes when the block leaves the cache
	links[cacheBlock]        // in the LRU
}

// blockRef is a conversation's hold on a block: the block the record held
// while its gen is the one held.
type blockRef struct {
	b   *cacheBlock
	gen uint32
}

// live reports whether the block held is still cached.
func (r blockRef) live() bool { return r.b.gen == r.gen }

type conversation struct {
	session             uint64 // hash of the session id; anonymous when !named
	named               bool
	leaf                BlockHash // last block of the chain (anonymous conversations)
	chain               []blockRef
	links[conversation]      // in convLRU
	leafIndex           bool // registered in leaves
}

// links are what an element of a list keeps of it: its neighbours, and
// whether it is in one.
type links[T any] struct {
	prev, next *T
	listed     bool
}

func (k *links[T]) link() *links[T] { return k }

// linked is a pointer to an element that keeps its links.
type linked[T any] interface {
	*T
	link() *links[T]
}

// list is a doubly linked list of elements that keep their own links, so
// that moving one allocates nothing.
type list[T any, P linked[T]] struct{ front, back *T }

func (l *list[T, P]) pushFront(x *T) {
	k := P(x).link()
	k.prev, k.next, k.listed = nil, l.front, true
	if l.front != nil {
		P(l.front).link().prev = x
	} else {
		l.back = x
	}
	l.front = x
}

func (l *list[T, P]) remove(x *T) {
	k := P(x).link()
	if k.prev != nil {
		P(k.prev).link().next = k.next
	} else {
		l.front = k.next
	}
	if k.next != nil {
		P(k.next).link().prev = k.prev
	} else {
		l.back = k.prev
	}
	k.prev, k.next, k.listed = nil, nil, false
}

func (l *list[T, P]) moveToFront(x *T) {
	if l.front != x {
		l.remove(x)
		l.pushFront(x)
	}
}

// blockList is the blocks' LRU; convList the conversations'.
type (
	blockList = list[cacheBlock, *cacheBlock]
	convList  = list[conversation, *conversation]
)

// NewKVCache returns an empty cache.
func NewKVCache(cfg CacheConfig) (*KVCache, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	c := &KVCache{
		cfg:       cfg,
		maxBlocks: cfg.CapacityTokens / BlockSize,
		maxConvs:  cfg.maxConversations(),
	}
	c.reset()
	return c, nil
}

func (c *KVCache) reset() {
	c.blocks = make(map[BlockHash]*cacheBlock)
	c.lru = blockList{}
	c.sessions = make(map[uint64]*conversation)
	c.leaves = make(map[BlockHash]*conversation)
	c.convLRU, c.convs = convList{}, 0
	c.held, c.free = nil, nil
	c.stats = CacheStats{}
}

// Reset empties the cache and zeroes its counters.
func (c *KVCache) Reset() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.reset()
}

// Match returns how many leading blocks of hashes are cached and ready at t.
// It does not mark them used; Store does.
func (c *KVCache) Match(hashes []BlockHash, t time.Time) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, h := range hashes {
		b := c.blocks[h]
		if b == nil || b.ready.After(t) {
			return i
		}
	}
	return len(hashes)
}

// Store records a chain of blocks, from the first block of a sequence on:
// present blocks are marked used (and keep the earlier of their two ready
// times), missing ones are inserted. The chain becomes the blocks of the
// conversation (see KVCache); then the cache evicts what exceeds the
// conversation cap and the capacity.
func (c *KVCache) Store(session string, chain []Block) {
	c.storeReporting(session, chain, nil)
}

// storeReporting is Store, calling removed (when not nil) with the hash of
// every block it frees, by the capacity LRU or the conversation cap. It
// calls removed with the cache locked: removed must not call the cache.
func (c *KVCache) storeReporting(session string, chain []Block, removed func(BlockHash)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.onRemove = removed
	defer func() { c.onRemove = nil }()

	held := c.held[:0]
	for _, bl := range chain {
		b := c.blocks[bl.Hash]
		switch {
		case b == nil:
			b = c.newBlock(bl)
			c.blocks[bl.Hash] = b
		case bl.Ready.Before(b.ready):
			b.ready = bl.Ready
		}
		held = append(held, b)
	}
	c.held = held
	// Last to first: a block is then used more recently than any block
	// after it, and the LRU evicts chains from their end.
	for i := len(held) - 1; i >= 0; i-- {
		if b := held[i]; !b.listed {
			c.lru.pushFront(b)
		} else {
			c.lru.moveToFront(b)
		}
	}

	if c.maxConvs > 0 {
		c.assign(session, chain, held)
		for c.convs > c.maxConvs {
			c.dropConversation(c.convLRU.back)
			c.stats.ConversationEvictions++
		}
	}
	for len(c.blocks) > c.maxBlocks {
		c.remove(c.lru.back)
		c.stats.Evictions++
	}
	clear(held)
}

// newBlock returns a record for bl, not yet in the LRU.
func (c *KVCache) newBlock(bl Block) *cacheBlock {
	n := len(c.free)
	if n == 0 {
		return &cacheBlock{hash: bl.Hash, ready: bl.Ready}
	}
	b := c.free[n-1]
	c.free[n-1] = nil
	c.free = c.free[:n-1]
	b.hash, b.ready, b.refs = bl.Hash, bl.Ready, 0
	return b
}

// assign makes held the chain of the conversation the store belongs to.
func (c *KVCache) assign(session string, chain []Block, held []*cacheBlock) {
	var cv *conversation
	if session != "" {
		key := sessionKey(session)
		cv = c.sessions[key]
		if cv == nil {
			if len(held) == 0 {
				return
			}
			cv = &conversation{session: key, named: true}
			c.sessions[key] = cv
		}
	} else {
		if len(held) == 0 {
			return
		}
		for i := len(chain) - 1; i >= 0 && cv == nil; i-- {
			cv = c.leaves[chain[i].Hash]
		}
		if cv == nil {
			cv = &conversation{}
		}
	}

	for _, b := range held {
		b.refs++
	}
	c.release(cv.chain)
	cv.chain = cv.chain[:0]
	for _, b := range held {
		cv.chain = append(cv.chain, blockRef{b: b, gen: b.gen})
	}
	if len(held) == 0 {
		// A session whose latest prompt holds no block keeps nothing.
		c.forget(cv)
		return
	}
	if !cv.named {
		if cv.leafIndex {
			delete(c.leaves, cv.leaf)
		}
		cv.leaf = held[len(held)-1].hash
		c.leaves[cv.leaf] = cv
		cv.leafIndex = true
	}
	if !cv.listed {
		c.convLRU.pushFront(cv)
		c.convs++
	} else if c.convLRU.front != cv {
		c.convLRU.remove(cv)
		c.convLRU.pushFront(cv)
	}
}

// dropConversation forgets cv and frees the blocks only it held.
func (c *KVCache) dropConversation(cv *conversation) {
	c.release(cv.chain)
	cv.chain = nil
	c.forget(cv)
}

// forget removes cv from the indexes.
func (c *KVCache) forget(cv *conversation) {
	if cv.named {
		delete(c.sessions, cv.session)
	} else if cv.leafIndex {
		delete(c.leaves, cv.leaf)
		cv.leafIndex = false
	}
	if cv.listed {
		c.convLRU.remove(cv)
		c.convs--
	}
}

// release drops one conversation reference from each live block of chain and
// frees the blocks no conversation holds any more.
func (c *KVCache) release(chain []blockRef) {
	for _, r := range chain {
		if !r.live() {
			continue // evicted since; its record may hold another block now
		}
		b := r.b
		b.refs--
		if b.refs <= 0 {
			c.remove(b)
			c.stats.ReleasedBlocks++
		}
	}
}

// remove lets go of b; its record is then free for another block.
func (c *KVCache) remove(b *cacheBlock) {
	delete(c.blocks, b.hash)
	c.lru.remove(b)
	b.gen++
	c.free = append(c.free, b)
	if c.onRemove != nil {
		c.onRemove(b.hash)
	}
}

// Stats returns the cache's size and counters.
func (c *KVCache) Stats() CacheStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.stats
	s.BlockSize = BlockSize
	s.Blocks = len(c.blocks)
	s.Tokens = len(c.blocks) * BlockSize
	s.CapacityTokens = c.maxBlocks * BlockSize
	s.Conversations = c.convs
	s.MaxConversations = c.maxConvs
	return s
}

// sessionKey hashes a session id: the cache keeps 8 bytes per session,
// whatever the length of the header.
func sessionKey(s string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(s))
	return h.Sum64()
}
