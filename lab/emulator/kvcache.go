package emulator

import (
	"container/list"
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

	mu       sync.Mutex
	blocks   map[BlockHash]*cacheBlock
	lru      list.List // of *cacheBlock; front is the most recently used
	sessions map[uint64]*conversation
	leaves   map[BlockHash]*conversation // anonymous conversations by their last block
	convLRU  list.List                   // of *conversation; front is the most recently used
	stats    CacheStats
	// onRemove, when set (for the duration of one storeReporting call),
	// learns the hash of every block the cache frees.
	onRemove func(BlockHash)
}

type cacheBlock struct {
	hash  BlockHash
	ready time.Time
	refs  int  // conversations whose chain holds this block (with a cap)
	dead  bool // evicted; a conversation may still point at it
	elem  *list.Element
}

type conversation struct {
	session   uint64 // hash of the session id; anonymous when !named
	named     bool
	leaf      BlockHash // last block of the chain (anonymous conversations)
	chain     []*cacheBlock
	elem      *list.Element
	leafIndex bool // registered in leaves
}

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
	c.lru.Init()
	c.sessions = make(map[uint64]*conversation)
	c.leaves = make(map[BlockHash]*conversation)
	c.convLRU.Init()
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

	held := make([]*cacheBlock, len(chain))
	for i, bl := range chain {
		b := c.blocks[bl.Hash]
		switch {
		case b == nil:
			b = &cacheBlock{hash: bl.Hash, ready: bl.Ready}
			c.blocks[bl.Hash] = b
		case bl.Ready.Before(b.ready):
			b.ready = bl.Ready
		}
		held[i] = b
	}
	// Last to first: a block is then used more recently than any block
	// after it, and the LRU evicts chains from their end.
	for i := len(held) - 1; i >= 0; i-- {
		if b := held[i]; b.elem == nil {
			b.elem = c.lru.PushFront(b)
		} else {
			c.lru.MoveToFront(b.elem)
		}
	}

	if c.maxConvs > 0 {
		c.assign(session, chain, held)
		for c.convLRU.Len() > c.maxConvs {
			cv := c.convLRU.Back().Value.(*conversation)
			c.dropConversation(cv)
			c.stats.ConversationEvictions++
		}
	}
	for len(c.blocks) > c.maxBlocks {
		b := c.lru.Back().Value.(*cacheBlock)
		c.remove(b)
		c.stats.Evictions++
	}
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
	cv.chain = held
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
	if cv.elem == nil {
		cv.elem = c.convLRU.PushFront(cv)
	} else {
		c.convLRU.MoveToFront(cv.elem)
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
	if cv.elem != nil {
		c.convLRU.Remove(cv.elem)
		cv.elem = nil
	}
}

// release drops one conversation reference from each live block of chain and
// frees the blocks no conversation holds any more.
func (c *KVCache) release(chain []*cacheBlock) {
	for _, b := range chain {
		if b.dead {
			continue // evicted since; a block with its hash may be a new one
		}
		b.refs--
		if b.refs <= 0 {
			c.remove(b)
			c.stats.ReleasedBlocks++
		}
	}
}

func (c *KVCache) remove(b *cacheBlock) {
	delete(c.blocks, b.hash)
	c.lru.Remove(b.elem)
	b.elem = nil
	b.dead = true
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
	s.Conversations = c.convLRU.Len()
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
