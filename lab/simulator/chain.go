package simulator

import (
	"unsafe"

	"github.com/tetherproxy/tether/lab/emulator"
)

// A prompt's block chain: what a router that reads the prompt's content
// (GIE's prefix scorer, SGLang's cache_aware, later tether's own
// cache-aware decider) sees of it, without text.
//
// One chain block is one emulator KV block: emulator.BlockSize (16) tokens,
// about 64 characters at the 4 characters per token GIE assumes. Block i
// of a prompt has the identity the fast path gives it (model.go): its
// application's system block i while i is below the system prompt's full
// blocks, then (KindDocs) the shared document's block i while the block
// lies wholly before the end of the document, then the conversation's own
// block i. Its hash chains on the block before it,
//
//	h_0 = mix(0, key_0), h_i = mix(h_{i-1}, key_i),
//
// so two prompts have the same hash at i exactly when their first i+1
// blocks are the same, as the emulator's text hashes (emulator.BlockHasher)
// have; TestChainMatchesText checks the two agree on which blocks are equal.

// Domain tags of the block keys.
const (
	keySystem   = 0x73797374656d // "system"
	keyDocument = 0x646f63       // "doc"
	keyOwn      = 0x6f776e       // "own"
)

// ownerKey is what an owner's block keys share: block i's key is
// wlSplitmix(ownerKey + i).
func ownerKey(tag, owner uint64) uint64 { return wlSplitmix(tag ^ wlSplitmix(owner)) }

func chainMix(prev, key uint64) uint64 { return wlSplitmix(prev*0x9e3779b97f4a7c15 ^ key) }

// chain returns the full blocks of the prompt of c's current turn (the
// request being routed) as chained hashes. It is cached on the
// conversation and extended as its turns grow the prompt: each call costs
// only the blocks no earlier call hashed. The slice is the conversation's;
// callers must not keep or change it past the call that routes the request.
func (c *conversation) chain() []uint64 {
	return c.blocks((c.history + c.shape.turns[c.turn].userTokens) / emulator.BlockSize)
}

// blocks returns the first n chained block hashes of c's sequence (its
// prompts and answers so far, and beyond: every block's key is known from
// its index).
func (c *conversation) blocks(n int) []uint64 {
	for i := len(c.hashes); i < n; {
		// The blocks of one owner at a time: their keys share ownerKey.
		var base uint64
		end := n
		switch {
		case i < c.sysBlocks:
			base, end = ownerKey(keySystem, uint64(c.shape.app)), min(n, c.sysBlocks)
		case i < c.docEnd:
			base, end = ownerKey(keyDocument, uint64(c.shape.doc)), min(n, c.docEnd)
		default:
			base = ownerKey(keyOwn, c.shape.index)
		}
		prev := uint64(0)
		if i > 0 {
			prev = c.hashes[i-1]
		}
		for ; i < end; i++ {
			prev = chainMix(prev, wlSplitmix(base+uint64(i)))
			c.hashes = append(c.hashes, prev)
		}
	}
	return c.hashes[:n]
}

// blockHashes views hashes as the emulator's block hashes (the same
// uint64s: emulator.BlockHash is a uint64).
func blockHashes(hashes []uint64) []emulator.BlockHash {
	if len(hashes) == 0 {
		return nil
	}
	return unsafe.Slice((*emulator.BlockHash)(unsafe.Pointer(&hashes[0])), len(hashes))
}

// chainCache is the fast path's cache for workloads with shared documents:
// emulator.KVCache itself, keyed by the chain's hashes instead of the
// text's. runCache's shape (a conversation's blocks one run after its
// application's system blocks) does not hold once conversations share a
// document's blocks too; KVCache on hashes that are equal exactly when
// the text's are makes the same decisions as on the text, one map
// operation per block (TestFastMatchesText runs a mix with documents).
type chainCache struct {
	kv *emulator.KVCache
	// carry are the counters of the caches reset before (an instance
	// restarted), added to the current one's.
	carry emulator.CacheStats
	chain []emulator.Block // scratch
}

func (k *chainCache) match(c *conversation, lookup int, t int64) int {
	return k.kv.Match(blockHashes(c.blocks(lookup)), virtualTime(t))
}

func (k *chainCache) store(c *conversation, n, promptBlocks int, prompt, answer int64) {
	hashes := c.blocks(n)
	chain := k.chain[:0]
	for i, h := range hashes {
		ready := prompt
		if i >= promptBlocks {
			ready = answer
		}
		chain = append(chain, emulator.Block{Hash: emulator.BlockHash(h), Ready: virtualTime(ready)})
	}
	k.kv.Store(c.session, chain)
	clear(chain)
	k.chain = chain[:0]
}

func (k *chainCache) reset(cfg emulator.CacheConfig) {
	st := k.kv.Stats()
	k.carry.Evictions += st.Evictions
	k.carry.ConversationEvictions += st.ConversationEvictions
	k.carry.ReleasedBlocks += st.ReleasedBlocks
	kv, err := emulator.NewKVCache(cfg)
	if err != nil {
		panic(err) // cfg made the first one
	}
	k.kv = kv
}

func (k *chainCache) cacheStats() emulator.CacheStats {
	s := k.kv.Stats()
	s.Evictions += k.carry.Evictions
	s.ConversationEvictions += k.carry.ConversationEvictions
	s.ReleasedBlocks += k.carry.ReleasedBlocks
	return s
}
