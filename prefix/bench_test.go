package prefix

import (
	"encoding/json"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/cespare/xxhash/v2"
)

// body returns a chat request of about size bytes: a system prompt of
// three quarters of it, then a user message, as a retrieval application
// sends.
func body(size int) []byte {
	sys := words(1, size*3/4/9)
	user := words(2, size/4/9)
	return chat("meta-llama/Llama-3.1-8B-Instruct", "system", sys, "user", user)
}

var sizes = []struct {
	name string
	size int
}{{"1KB", 1 << 10}, {"32KB", 32 << 10}, {"400KB", 400 << 10}}

// BenchmarkChain is the extraction and hashing of one body, by block size:
// what a content decision costs before the index.
func BenchmarkChain(b *testing.B) {
	for _, s := range sizes {
		for _, block := range []int{64, 128, 256, 512} {
			b.Run(fmt.Sprintf("%s/block=%d", s.name, block), func(b *testing.B) {
				h := hasher(b, block)
				h.maxBlocks = 1 << 20
				buf := body(s.size)
				b.SetBytes(int64(len(buf)))
				var out []uint64
				for b.Loop() {
					out, _ = h.Chain(out[:0], buf)
				}
			})
		}
	}
}

// BenchmarkExtract compares parsers on the extraction alone (the
// messages' roles and contents, unescaped): encoding/json into a struct
// against fastjson, which Chain uses.
func BenchmarkExtract(b *testing.B) {
	for _, s := range sizes {
		buf := body(s.size)
		b.Run(s.name+"/encoding-json", func(b *testing.B) {
			b.SetBytes(int64(len(buf)))
			for b.Loop() {
				var req struct {
					Model    string `json:"model"`
					Messages []struct {
						Role    string          `json:"role"`
						Content json.RawMessage `json:"content"`
					} `json:"messages"`
				}
				if err := json.Unmarshal(buf, &req); err != nil {
					b.Fatal(err)
				}
				for _, m := range req.Messages {
					var text string
					if err := json.Unmarshal(m.Content, &text); err != nil {
						b.Fatal(err)
					}
				}
			}
		})
		b.Run(s.name+"/fastjson", func(b *testing.B) {
			h := hasher(b, 256)
			b.SetBytes(int64(len(buf)))
			for b.Loop() {
				p := h.parsers.Get()
				v, err := p.ParseBytes(buf)
				if err != nil {
					b.Fatal(err)
				}
				for _, m := range v.GetArray("messages") {
					_ = m.GetStringBytes("role")
					_ = m.GetStringBytes("content")
				}
				h.parsers.Put(p)
			}
		})
	}
}

// BenchmarkHash compares block hash functions on 256-byte blocks.
func BenchmarkHash(b *testing.B) {
	block := []byte(words(1, 100))[:256]
	b.Run("xxhash", func(b *testing.B) {
		b.SetBytes(256)
		for b.Loop() {
			_ = xxhash.Sum64(block)
		}
	})
	b.Run("fnv1a", func(b *testing.B) {
		b.SetBytes(256)
		for b.Loop() {
			h := uint64(14695981039346656037)
			for _, c := range block {
				h ^= uint64(c)
				h *= 1099511628211
			}
			_ = h
		}
	})
}

// BenchmarkDecide is a whole content decision's prefix work: the chain
// of a body, then the match over 64 candidates, each holding an
// application's system prompt and one holding the whole prompt.
func BenchmarkDecide(b *testing.B) {
	for _, s := range sizes {
		b.Run(s.name, func(b *testing.B) {
			h := hasher(b, DefaultBlockBytes)
			buf := body(s.size)
			chain, _ := h.Chain(nil, buf)
			x := NewIndex(1 << 20)
			names := make([]string, 64)
			now := time.Unix(0, 0)
			for i := range names {
				names[i] = fmt.Sprintf("a100-%d", i)
				x.Record(names[i], chain[:len(chain)*3/4], now)
			}
			x.Record(names[17], chain, now)
			depth := make([]int, len(names))
			b.SetBytes(int64(len(buf)))
			var out []uint64
			b.ResetTimer()
			for b.Loop() {
				out, _ = h.Chain(out[:0], buf)
				if x.Match(out, names, depth) != len(chain) {
					b.Fatal("no full match")
				}
			}
		})
	}
}

// BenchmarkIndexMemory reports the heap the index takes per block held,
// for a million blocks over 64 instances.
func BenchmarkIndexMemory(b *testing.B) {
	for b.Loop() {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		x := NewIndex(1 << 15)
		now := time.Unix(0, 0)
		chain := make([]uint64, 1024)
		for i := range 1000 {
			for k := range chain {
				chain[k] = uint64(i)<<20 | uint64(k)
			}
			x.Record(fmt.Sprintf("i-%d", i%64), chain, now)
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		blocks := 0
		for _, s := range x.Stats() {
			blocks += s.Blocks
		}
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(blocks), "B/block")
		runtime.KeepAlive(x)
	}
}
