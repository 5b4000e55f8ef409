package emulator

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"
)

// text returns n tokens "<prefix>0 <prefix>1 …".
func text(prefix string, n int) string {
	w := make([]string, n)
	for i := range w {
		w[i] = fmt.Sprintf("%s%d", prefix, i)
	}
	return strings.Join(w, " ")
}

// join joins texts as a chat prompt does.
func join(parts ...string) string { return strings.Join(parts, "\n") }

func hashes(s string) []BlockHash {
	var h BlockHasher
	return h.Append(nil, s)
}

func TestBlockHasher(t *testing.T) {
	base := text("w", 64)
	changed := func(i int) string {
		w := strings.Fields(base)
		w[i] = "CHANGED"
		return strings.Join(w, " ")
	}
	tests := []struct {
		name     string
		a, b     string
		wantSame int // leading block hashes a and b share
	}{
		{"same text", base, base, 4},
		{"whitespace does not matter", base, strings.ReplaceAll(base, " ", "\n\t "), 4},
		{"changed first token invalidates every block", base, changed(0), 0},
		{"changed token 20 keeps only the first block", base, changed(20), 1},
		{"changed last token", base, changed(63), 3},
		{"token boundaries count", "ab c " + text("x", 15), "a bc " + text("x", 15), 0},
		{"a longer text extends the chain", base, base + " " + text("y", 40), 4},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ha, hb := hashes(tc.a), hashes(tc.b)
			same := 0
			for same < min(len(ha), len(hb)) && ha[same] == hb[same] {
				same++
			}
			if same != tc.wantSame {
				t.Errorf("%d leading blocks shared, want %d", same, tc.wantSame)
			}
		})
	}

	t.Run("full blocks only, token count as CountTokens", func(t *testing.T) {
		for _, n := range []int{0, 1, 15, 16, 17, 47, 48, 1000} {
			var h BlockHasher
			got := h.Append(nil, text("t", n))
			if len(got) != n/BlockSize || h.Tokens() != n || h.Tokens() != CountTokens(text("t", n)) {
				t.Errorf("%d tokens: %d blocks, Tokens() %d; want %d blocks", n, len(got), h.Tokens(), n/BlockSize)
			}
		}
	})
	t.Run("appending in pieces equals appending at once", func(t *testing.T) {
		whole := hashes(join(text("a", 23), text("b", 30), text("c", 11)))
		var h BlockHasher
		got := h.Append(nil, text("a", 23))
		fork := h // a copy continues independently
		got = h.Append(got, text("b", 30))
		got = h.Append(got, text("c", 11))
		if fmt.Sprint(got) != fmt.Sprint(whole) {
			t.Errorf("pieces %v, whole %v", got, whole)
		}
		other := fork.Append(nil, text("z", 30))
		if len(other) == 0 || other[0] == got[1] {
			t.Errorf("a forked hasher does not continue its own sequence: %v vs %v", other, got)
		}
	})
}

// cacheOp is one step of a cache scenario: look up text (want: the cached
// tokens) or store it.
type cacheOp struct {
	store   bool
	session string
	text    string
	at      time.Duration // offset from t0: the lookup time, or when stored blocks are ready
	want    int           // lookups: cached tokens
}

func store(session, text string) cacheOp { return cacheOp{store: true, session: session, text: text} }
func lookup(text string, want int) cacheOp {
	return cacheOp{text: text, want: want}
}

func TestKVCache(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	sys := text("sys", 64) // 4 blocks shared by every user of an application
	turn1 := join(sys, text("q1-", 40), "served by gpu-a")
	turn2 := join(turn1, text("q2-", 30))
	a, b, c := text("a", 64), text("b", 64), text("c", 64)

	tests := []struct {
		name string
		cfg  CacheConfig
		ops  []cacheOp
		want CacheStats // checked fields: Blocks, Conversations, Evictions, ConversationEvictions, ReleasedBlocks
	}{
		{
			name: "shared system prompt hits across sessions",
			cfg:  CacheConfig{CapacityTokens: 10000},
			ops: []cacheOp{
				lookup(join(sys, text("u1-", 40)), 0),
				store("s1", join(sys, text("u1-", 40))),
				lookup(join(sys, text("u2-", 40)), 64),
				lookup(join(sys, text("u1-", 40)), 96), // 104 tokens: 6 full blocks
			},
			want: CacheStats{Blocks: 6, Conversations: 1},
		},
		{
			name: "multi-turn conversation hits its previous turn, answer included",
			cfg:  CacheConfig{CapacityTokens: 10000},
			ops: []cacheOp{
				store("s1", turn1), // 107 tokens: 6 blocks
				lookup(turn2, 96),
				store("s1", turn2), // 137 tokens: 8 blocks
				lookup(join(turn2, "served by gpu-a", text("q3-", 20)), 128),
			},
			want: CacheStats{Blocks: 8, Conversations: 1},
		},
		{
			name: "a changed early token invalidates the later blocks",
			cfg:  CacheConfig{CapacityTokens: 10000},
			ops: []cacheOp{
				store("", a),
				lookup(strings.Replace(a, "a20", "X", 1), 16),
				lookup(strings.Replace(a, "a0 ", "X ", 1), 0),
				lookup(strings.Replace(a, "a63", "X", 1), 48),
			},
			want: CacheStats{Blocks: 4, Conversations: 1},
		},
		{
			name: "a partial block is not cached",
			cfg:  CacheConfig{CapacityTokens: 10000},
			ops:  []cacheOp{store("", text("p", 20)), lookup(text("p", 20), 16), lookup(text("p", 15), 0)},
			want: CacheStats{Blocks: 1, Conversations: 1},
		},
		{
			name: "capacity evicts the least recently used",
			cfg:  CacheConfig{CapacityTokens: 128, MaxConversations: -1},
			ops: []cacheOp{
				store("", a), store("", b),
				lookup(a, 64), lookup(b, 64),
				store("", c),
				lookup(a, 0), lookup(b, 64), lookup(c, 64),
			},
			want: CacheStats{Blocks: 8, Evictions: 4},
		},
		{
			name: "storing again refreshes a chain",
			cfg:  CacheConfig{CapacityTokens: 128, MaxConversations: -1},
			ops: []cacheOp{
				store("", a), store("", b), store("", a), store("", c),
				lookup(a, 64), lookup(b, 0), lookup(c, 64),
			},
			want: CacheStats{Blocks: 8, Evictions: 4},
		},
		{
			name: "eviction takes the end of a chain first",
			cfg:  CacheConfig{CapacityTokens: 130, MaxConversations: -1}, // 8 blocks
			ops: []cacheOp{
				store("", a),                        // 4 blocks
				store("", join(sys, text("x", 32))), // 6 blocks: 2 of a go, from its end
				lookup(a, 32), lookup(join(sys, text("x", 32)), 96),
			},
			want: CacheStats{Blocks: 8, Evictions: 2},
		},
		{
			name: "a chain longer than the capacity keeps its beginning",
			cfg:  CacheConfig{CapacityTokens: 64, MaxConversations: -1},
			ops:  []cacheOp{store("", text("long", 160)), lookup(text("long", 160), 64)},
			want: CacheStats{Blocks: 4, Evictions: 6},
		},
		{
			name: "conversation cap drops the least recent session and keeps the shared prefix",
			cfg:  CacheConfig{CapacityTokens: 10000, MaxConversations: 2},
			ops: []cacheOp{
				store("s1", join(sys, a)), store("s2", join(sys, b)), store("s3", join(sys, c)),
				lookup(join(sys, a), 64), lookup(join(sys, b), 128), lookup(join(sys, c), 128),
			},
			want: CacheStats{Blocks: 12, Conversations: 2, ConversationEvictions: 1, ReleasedBlocks: 4},
		},
		{
			name: "a session's use keeps it",
			cfg:  CacheConfig{CapacityTokens: 10000, MaxConversations: 2},
			ops: []cacheOp{
				store("s1", a), store("s2", b), store("s1", a), store("s3", c),
				lookup(a, 64), lookup(b, 0), lookup(c, 64),
			},
			want: CacheStats{Blocks: 8, Conversations: 2, ConversationEvictions: 1, ReleasedBlocks: 4},
		},
		{
			name: "an anonymous follow-up continues its conversation",
			cfg:  CacheConfig{CapacityTokens: 10000, MaxConversations: 1},
			ops:  []cacheOp{store("", turn1), store("", turn2), lookup(turn2, 128), lookup(turn1, 96)},
			want: CacheStats{Blocks: 8, Conversations: 1},
		},
		{
			name: "anonymous users sharing only a system prompt are two conversations",
			cfg:  CacheConfig{CapacityTokens: 10000, MaxConversations: 1},
			ops: []cacheOp{
				store("", join(sys, a)), store("", join(sys, b)),
				lookup(join(sys, a), 64), lookup(join(sys, b), 128),
			},
			want: CacheStats{Blocks: 8, Conversations: 1, ConversationEvictions: 1, ReleasedBlocks: 4},
		},
		{
			name: "a session that moves on lets go of its old blocks",
			cfg:  CacheConfig{CapacityTokens: 10000},
			ops:  []cacheOp{store("s", join(sys, a)), store("s", join(sys, b)), lookup(join(sys, a), 64)},
			want: CacheStats{Blocks: 8, Conversations: 1, ReleasedBlocks: 4},
		},
		{
			name: "a prompt shorter than a block holds nothing",
			cfg:  CacheConfig{CapacityTokens: 10000},
			ops:  []cacheOp{store("s", a), store("s", "hi"), store("", "hello"), lookup(a, 0)},
			want: CacheStats{Blocks: 0, Conversations: 0, ReleasedBlocks: 4},
		},
		{
			name: "no conversation cap: only the capacity evicts",
			cfg:  CacheConfig{CapacityTokens: 10000, MaxConversations: -1},
			ops: []cacheOp{
				store("s1", join(sys, a)), store("s2", join(sys, b)), store("s3", join(sys, c)), store("s1", text("z", 32)),
				lookup(join(sys, a), 128), lookup(join(sys, b), 128), lookup(join(sys, c), 128),
			},
			want: CacheStats{Blocks: 18},
		},
		{
			name: "blocks serve only once ready",
			cfg:  CacheConfig{CapacityTokens: 10000},
			ops: []cacheOp{
				{store: true, text: a, at: time.Second},
				{text: a, at: 999 * time.Millisecond, want: 0},
				{text: a, at: time.Second, want: 64},
				{store: true, session: "x", text: a, at: 2 * time.Second}, // the earlier ready time stays
				{text: a, at: time.Second, want: 64},
			},
			want: CacheStats{Blocks: 4, Conversations: 2},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c, err := NewKVCache(tc.cfg)
			if err != nil {
				t.Fatal(err)
			}
			for i, op := range tc.ops {
				hs := hashes(op.text)
				if op.store {
					chain := make([]Block, len(hs))
					for j, h := range hs {
						chain[j] = Block{Hash: h, Ready: t0.Add(op.at)}
					}
					c.Store(op.session, chain)
				} else if got := c.Match(hs, t0.Add(op.at)) * BlockSize; got != op.want {
					t.Errorf("op %d: lookup of %.30q… = %d cached tokens, want %d", i, op.text, got, op.want)
				}
				if err := c.check(); err != nil {
					t.Fatalf("op %d: %v", i, err)
				}
			}
			got := c.Stats()
			want := tc.want
			want.BlockSize, want.Tokens, want.CapacityTokens = BlockSize, want.Blocks*BlockSize, tc.cfg.CapacityTokens/BlockSize*BlockSize
			want.MaxConversations = tc.cfg.maxConversations()
			if got != want {
				t.Errorf("stats\n got %+v\nwant %+v", got, want)
			}
		})
	}
}

func TestKVCacheConfig(t *testing.T) {
	if _, err := NewKVCache(CacheConfig{CapacityTokens: 15}); err == nil || !strings.Contains(err.Error(), "capacity_tokens 15") {
		t.Errorf("capacity below one block: %v", err)
	}
	c, err := NewKVCache(CacheConfig{CapacityTokens: 1000})
	if err != nil {
		t.Fatal(err)
	}
	if s := c.Stats(); s.MaxConversations != DefaultMaxConversations || s.CapacityTokens != 992 {
		t.Errorf("defaults: %+v", s)
	}
	c.Store("s", []Block{{Hash: 1}, {Hash: 2}})
	c.Reset()
	if s := c.Stats(); s.Blocks != 0 || s.Conversations != 0 {
		t.Errorf("after Reset: %+v", s)
	}
}

func TestKVCacheConcurrent(t *testing.T) {
	for _, maxConv := range []int{-1, 5} {
		t.Run(fmt.Sprint("max conversations ", maxConv), func(t *testing.T) {
			c, err := NewKVCache(CacheConfig{CapacityTokens: 40 * BlockSize, MaxConversations: maxConv})
			if err != nil {
				t.Fatal(err)
			}
			sys := text("sys", 48)
			var wg sync.WaitGroup
			for g := range 8 {
				wg.Go(func() {
					rng := rand.New(rand.NewPCG(uint64(g), 7))
					for range 300 {
						session := ""
						if rng.IntN(2) == 0 {
							session = fmt.Sprint("s", rng.IntN(10))
						}
						hs := hashes(join(sys, text(fmt.Sprint("u", rng.IntN(12)), 16*rng.IntN(6))))
						if rng.IntN(3) == 0 {
							c.Match(hs, time.Time{})
							continue
						}
						chain := make([]Block, len(hs))
						for i, h := range hs {
							chain[i] = Block{Hash: h}
						}
						c.Store(session, chain)
					}
				})
			}
			wg.Wait()
			if err := c.check(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func BenchmarkBlockHasher16k(b *testing.B) {
	prompt := text("token", 16384)
	b.SetBytes(int64(len(prompt)))
	var dst []BlockHash
	for b.Loop() {
		var h BlockHasher
		dst = h.Append(dst[:0], prompt)
	}
}

func BenchmarkKVCacheMatch16k(b *testing.B) {
	c, err := NewKVCache(CacheConfig{CapacityTokens: ProfileA100().KVCapacityTokens})
	if err != nil {
		b.Fatal(err)
	}
	hs := hashes(text("token", 16384))
	chain := make([]Block, len(hs))
	for i, h := range hs {
		chain[i] = Block{Hash: h}
	}
	c.Store("s", chain)
	for b.Loop() {
		if c.Match(hs, time.Time{}) != len(hs) {
			b.Fatal("miss")
		}
	}
}

func BenchmarkKVCacheStore16k(b *testing.B) {
	c, err := NewKVCache(CacheConfig{CapacityTokens: 100_000, MaxConversations: 20})
	if err != nil {
		b.Fatal(err)
	}
	// 64 distinct 16k-token chains sharing a 1k-token prefix, stored in
	// turn: every store evicts (capacity about 6 chains, cap 20).
	sys := text("sys", 1024)
	chains := make([][]Block, 64)
	for i := range chains {
		hs := hashes(join(sys, text(fmt.Sprint("u", i), 15360)))
		chains[i] = make([]Block, len(hs))
		for j, h := range hs {
			chains[i][j] = Block{Hash: h}
		}
	}
	i := 0
	for b.Loop() {
		c.Store("", chains[i%len(chains)])
		i++
	}
}

// check verifies the cache's invariants (for tests).
func (c *KVCache) check() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.blocks) > c.maxBlocks {
		return fmt.Errorf("%d blocks, capacity %d", len(c.blocks), c.maxBlocks)
	}
	listed := 0
	for b := c.lru.front; b != nil; b = b.next {
		if b.next != nil && b.next.prev != b || b.next == nil && c.lru.back != b {
			return fmt.Errorf("lru: broken link after block %x", b.hash)
		}
		listed++
	}
	if listed != len(c.blocks) {
		return fmt.Errorf("lru holds %d blocks, map %d", listed, len(c.blocks))
	}
	convs := 0
	refs := make(map[*cacheBlock]int)
	for cv := c.convLRU.front; cv != nil; cv = cv.next {
		if cv.next != nil && cv.next.prev != cv || cv.next == nil && c.convLRU.back != cv {
			return fmt.Errorf("conversations: broken link")
		}
		convs++
		for _, r := range cv.chain {
			if r.live() {
				refs[r.b]++
			}
		}
	}
	if convs != c.convs {
		return fmt.Errorf("%d conversations listed, %d counted", convs, c.convs)
	}
	if c.maxConvs > 0 && convs > c.maxConvs {
		return fmt.Errorf("%d conversations, cap %d", convs, c.maxConvs)
	}
	if convs != len(c.sessions)+len(c.leaves) {
		return fmt.Errorf("%d conversations, %d sessions + %d anonymous", convs, len(c.sessions), len(c.leaves))
	}
	for h, b := range c.blocks {
		if b.hash != h || !b.listed {
			return fmt.Errorf("block %x: inconsistent record", h)
		}
		if c.maxConvs > 0 && (b.refs < 1 || b.refs != refs[b]) {
			return fmt.Errorf("block %x: refs %d, held by %d conversations", h, b.refs, refs[b])
		}
	}
	return nil
}
