package simulator

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/tetherproxy/tether/lab/emulator"
)

// TestRunCacheMatchesSim drives runCache and emulator.KVCache with the same
// random stores and lookups of the simulation's shape (system blocks of an
// application, then blocks of one conversation, each conversation's chain
// growing from store to store) and compares every answer and every counter.
func TestRunCacheMatchesSim(t *testing.T) {
	tests := []struct {
		name  string
		cfg   emulator.CacheConfig
		convs int
	}{
		{"small capacity, cap 3", emulator.CacheConfig{CapacityTokens: 40 * emulator.BlockSize, MaxConversations: 3}, 30},
		{"large capacity, cap 3", emulator.CacheConfig{CapacityTokens: 5000 * emulator.BlockSize, MaxConversations: 3}, 30},
		{"default cap", emulator.CacheConfig{CapacityTokens: 300 * emulator.BlockSize}, 60},
		{"cap 1", emulator.CacheConfig{CapacityTokens: 60 * emulator.BlockSize, MaxConversations: 1}, 20},
		{"no cap", emulator.CacheConfig{CapacityTokens: 100 * emulator.BlockSize, MaxConversations: -1}, 30},
		{"no cap, tiny", emulator.CacheConfig{CapacityTokens: 3 * emulator.BlockSize, MaxConversations: -1}, 10},
		{"tiny", emulator.CacheConfig{CapacityTokens: emulator.BlockSize, MaxConversations: 1}, 10},
		{"smaller than a system prompt", emulator.CacheConfig{CapacityTokens: 4 * emulator.BlockSize, MaxConversations: 2}, 10},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for seed := range uint64(3) {
				compareRunCache(t, tt.cfg, tt.convs, seed, 2000)
			}
		})
	}
}

func compareRunCache(t *testing.T, cfg emulator.CacheConfig, convs int, seed uint64, ops int) {
	t.Helper()
	ref, err := emulator.NewKVCache(cfg)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(seed, 7))
	// Applications of 1 to 6 system blocks.
	sysLen := []int{1 + rng.IntN(6), 1 + rng.IntN(6), 1 + rng.IntN(6)}
	sysHash := make([][]emulator.BlockHash, len(sysLen))
	for a, n := range sysLen {
		for range n {
			sysHash[a] = append(sysHash[a], emulator.BlockHash(rng.Uint64()))
		}
	}
	got := newRunCache(cfg, sysLen)
	type conv struct {
		app     int
		n       int // blocks of its last chain
		session string
	}
	cs := make([]conv, convs)
	for i := range cs {
		cs[i] = conv{app: rng.IntN(len(sysLen))}
		cs[i].n = sysLen[cs[i].app]
		if rng.IntN(2) == 0 {
			cs[i].session = "sess-" + string(rune('a'+i%26)) + string(rune('a'+i/26))
		}
	}
	hashes := func(c int, n int) []emulator.BlockHash {
		a := cs[c].app
		out := make([]emulator.BlockHash, 0, n)
		for i := range n {
			if i < sysLen[a] {
				out = append(out, sysHash[a][i])
			} else {
				out = append(out, emulator.BlockHash(wlSplitmix(uint64(c)<<32+uint64(i))))
			}
		}
		return out
	}
	epoch := time.Unix(1000, 0)
	now := int64(0)
	for op := range ops {
		now += rng.Int64N(int64(50 * time.Millisecond))
		c := rng.IntN(convs)
		a := cs[c].app
		if rng.IntN(3) == 0 {
			lookup := sysLen[a] + rng.IntN(cs[c].n+4-sysLen[a]) // at least the system blocks, as every prompt
			at := now + rng.Int64N(int64(2*time.Second)) - int64(time.Second)
			want := ref.Match(hashes(c, lookup), epoch.Add(time.Duration(at)))
			if g := got.match(a, uint64(c), lookup, at); g != want {
				t.Fatalf("seed %d op %d: match conv %d, %d blocks at %d = %d, want %d", seed, op, c, lookup, at, g, want)
			}
			continue
		}
		// The chain grows (or stays: a chain of system blocks alone can
		// be stored again).
		n := cs[c].n + rng.IntN(12)
		if rng.IntN(10) == 0 {
			n = cs[c].n
		}
		cs[c].n = n
		prompt := sysLen[a] + rng.IntN(n-sysLen[a]+1)
		pre := now + rng.Int64N(int64(time.Second))
		ans := pre + rng.Int64N(int64(time.Second))
		chain := make([]emulator.Block, n)
		for i, h := range hashes(c, n) {
			chain[i] = emulator.Block{Hash: h, Ready: epoch.Add(time.Duration(pre))}
			if i >= prompt {
				chain[i].Ready = epoch.Add(time.Duration(ans))
			}
		}
		ref.Store(cs[c].session, chain)
		got.store(a, uint64(c), n, prompt, pre, ans, cs[c].session != "", sessionKey(cs[c].session))
		if diff := cmp.Diff(ref.Stats(), got.cacheStats()); diff != "" {
			t.Fatalf("seed %d op %d: store conv %d (app %d, %d blocks, session %q): stats (-sim +runs):\n%s", seed, op, c, a, n, cs[c].session, diff)
		}
	}
	for c := range cs {
		for n := sysLen[cs[c].app]; n <= cs[c].n; n++ {
			at := now + int64(time.Hour)
			if w, g := ref.Match(hashes(c, n), epoch.Add(time.Duration(at))), got.match(cs[c].app, uint64(c), n, at); w != g {
				t.Fatalf("seed %d: final match conv %d, %d blocks = %d, want %d", seed, c, n, g, w)
			}
		}
	}
}
