package emulator

import (
	"unicode"
	"unicode/utf8"
)

// CountTokens is the emulator's tokenizer: one token per run of
// non-whitespace characters, with whitespace as unicode.IsSpace defines it
// (the rule of strings.Fields). "Hello, world!" is 2 tokens, "" is 0. Real
// tokenizers give about 1.3 tokens per English word; this rule only has to be
// simple, deterministic and the same on every instance.
func CountTokens(s string) int {
	n := 0
	for i := 0; ; n++ {
		var start int
		if start, i = nextToken(s, i); start == i {
			return n
		}
	}
}

// nextToken finds the first token of s at or after byte i by the CountTokens
// rule and returns its bounds; start == end when there is none.
func nextToken(s string, i int) (start, end int) {
	for i < len(s) {
		if c := s[i]; c < utf8.RuneSelf {
			if !asciiSpace[c] {
				break
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if !unicode.IsSpace(r) {
			break
		}
		i += size
	}
	start = i
	for i < len(s) {
		if c := s[i]; c < utf8.RuneSelf {
			if asciiSpace[c] {
				break
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if unicode.IsSpace(r) {
			break
		}
		i += size
	}
	return start, i
}

// asciiSpace marks the ASCII bytes unicode.IsSpace accepts.
var asciiSpace = [utf8.RuneSelf]bool{'\t': true, '\n': true, '\v': true, '\f': true, '\r': true, ' ': true}

// BlockSize is the number of tokens in one KV-cache block, the default page
// size of vLLM and SGLang.
const BlockSize = 16

// BlockHash identifies a full block of BlockSize tokens together with every
// token before it: the hash of a block chains the hash of the block before
// it, as automatic prefix caching in vLLM and SGLang does. Two sequences share
// a block hash only when they agree on every token up to the end of that
// block, so a cached block can serve a request only when the whole prefix
// before it matches too.
type BlockHash uint64

// BlockHasher cuts a token stream into BlockSize-token blocks and hashes each
// full block, chained to the one before. Tokens follow the CountTokens rule;
// the boundary between two Append calls is a token boundary (as the "\n"
// between chat messages is). A partial last block has no hash: engines cache
// full blocks only.
//
// The zero value starts a sequence. A BlockHasher is a small value: copy it
// to fork a sequence (for example to extend a conversation's history by one
// turn without hashing the history again).
type BlockHasher struct {
	parent BlockHash // hash of the last full block; 0 at the start
	cur    uint64    // running hash of the partial block
	n      int       // tokens in the partial block
	total  int       // tokens appended so far
}

// The FNV-1a constants; tokens are folded 8 bytes at a time, then byte by
// byte.
const (
	fnvOffset = 14695981039346656037
	fnvPrime  = 1099511628211
)

// Append adds the tokens of text and appends the hash of every block they
// complete to dst, which it returns.
func (h *BlockHasher) Append(dst []BlockHash, text string) []BlockHash {
	for i := 0; ; {
		var start int
		if start, i = nextToken(text, i); start == i {
			return dst
		}
		end := i
		tok := text[start:end]
		if h.n == 0 {
			h.cur = mix(fnvOffset, uint64(h.parent))
		}
		c := h.cur
		for len(tok) >= 8 {
			c = (c ^ le64(tok)) * fnvPrime
			c ^= c >> 29
			tok = tok[8:]
		}
		for i := 0; i < len(tok); i++ {
			c = (c ^ uint64(tok[i])) * fnvPrime
		}
		// A value no byte can take ends the token (with its length), so
		// "ab c" and "a bc" hash differently.
		h.cur = (c ^ (0x100 | uint64(end-start)<<9)) * fnvPrime
		h.n++
		h.total++
		if h.n == BlockSize {
			h.parent = BlockHash(finalize(h.cur))
			h.n = 0
			dst = append(dst, h.parent)
		}
	}
}

// Tokens is the number of tokens appended so far.
func (h *BlockHasher) Tokens() int { return h.total }

// le64 reads the first 8 bytes of s as a little-endian number.
func le64(s string) uint64 {
	_ = s[7]
	return uint64(s[0]) | uint64(s[1])<<8 | uint64(s[2])<<16 | uint64(s[3])<<24 |
		uint64(s[4])<<32 | uint64(s[5])<<40 | uint64(s[6])<<48 | uint64(s[7])<<56
}

// mix folds a 64-bit value into an FNV-1a state, byte by byte.
func mix(state, v uint64) uint64 {
	for range 8 {
		state = (state ^ (v & 0xff)) * fnvPrime
		v >>= 8
	}
	return state
}

// finalize spreads the bits of an FNV state (the splitmix64 finalizer).
func finalize(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}
