// Package prefix reads the prompt an LLM request's body carries, as the
// engine will see it. It cuts the prompt into chained blocks. Index keeps,
// for each instance, which blocks tether sent there. Cache-aware placement
// scores candidates with it.
//
// The package knows nothing of Envoy, Redis or the decision. extproc hands
// it a body, and affinity asks the index.
//
// Each block is hashed with the hash of the one before. So a block's hash
// covers everything before it. Two prompts share their first k hashes
// exactly when they share their first k blocks. An instance may hold a run
// of a prompt's blocks from the start. The longest such run is the prefix
// the instance's KV cache can serve, as far as tether saw.
package prefix

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/cespare/xxhash/v2"
	"github.com/valyala/fastjson"
)

// Reason says why a body gave no chain. The request is then placed by its
// identity, as without content, and counted by reason.
type Reason string

// The reasons a body gives no chain.
const (
	// ReasonNotJSON: the body does not parse as JSON, or nests deeper than
	// the parser allows.
	ReasonNotJSON Reason = "not_json"
	// ReasonNotPrompt: the body is JSON, but not an object with "messages"
	// (chat) or a string "prompt" (completions).
	ReasonNotPrompt Reason = "not_prompt"
	// ReasonBadMessages: "messages" is empty or not an array. Or it holds
	// a message that is not an object with a string role and a content.
	// The content must be a string, an array of parts or null.
	ReasonBadMessages Reason = "bad_messages"
	// ReasonShort: the prompt is shorter than one block. A cache could
	// hold nothing for it that identity placement would miss.
	ReasonShort Reason = "short"
)

// Defaults of Hasher.
const (
	// DefaultBlockBytes is the block size: 256 bytes. That is about 64
	// tokens of English, or four vLLM blocks of 16 tokens. BENCHMARKS.md
	// has the measurement it was chosen by. Per 32 KB body, 64-byte blocks
	// cost about four times the hashing and index lookups of 256-byte
	// ones. Their finer match buys nothing: a prefix is worth moving for at
	// thousands of tokens, not at tens.
	DefaultBlockBytes = 256
	// DefaultMaxBlocks bounds the blocks hashed per prompt. 4096 blocks of
	// 256 bytes is 1 MiB, Envoy's default body buffer. A longer prompt is
	// hashed up to there. The match is exact as far as it goes.
	DefaultMaxBlocks = 4096
)

// Hasher turns request bodies into chains. Its zero value is not usable.
// New fills in the defaults. It is safe for concurrent use.
type Hasher struct {
	blockBytes, maxBlocks int
	parsers               fastjson.ParserPool
}

// NewHasher returns a Hasher cutting blocks of blockBytes bytes, at most
// maxBlocks per prompt. 0 takes the defaults.
func NewHasher(blockBytes, maxBlocks int) (*Hasher, error) {
	if blockBytes == 0 {
		blockBytes = DefaultBlockBytes
	}
	if maxBlocks == 0 {
		maxBlocks = DefaultMaxBlocks
	}
	if blockBytes < 16 || blockBytes > 1<<16 {
		return nil, fmt.Errorf("prefix: block size %d bytes: want 16 to 65536", blockBytes)
	}
	if maxBlocks < 1 {
		return nil, fmt.Errorf("prefix: max blocks %d: want at least 1", maxBlocks)
	}
	return &Hasher{blockBytes: blockBytes, maxBlocks: maxBlocks}, nil
}

// Chain returns the chained hashes of the full blocks of the prompt body
// carries, appended to dst. body is an OpenAI-style chat or completions
// request. When there is no chain, Chain returns the reason.
//
// The prompt is what the engine's prefix cache keys on, in order:
//   - the model;
//   - the request's cache_salt, since vLLM keeps salted prompts apart;
//   - each message's role and content, or the completions prompt.
//
// A content given as parts gives each text part's text. Any other part,
// such as an image, gives its JSON, which names the same image the same
// way. What a chat template adds around them is the same for every request
// of a model, so it changes no match. A body is read, never kept. The
// chain holds hashes only.
func (h *Hasher) Chain(dst []uint64, body []byte) ([]uint64, Reason) {
	p := h.parsers.Get()
	defer h.parsers.Put(p)
	v, err := p.ParseBytes(body)
	if err != nil {
		return dst, ReasonNotJSON
	}
	if v.Type() != fastjson.TypeObject {
		return dst, ReasonNotPrompt
	}
	c := chainer{out: dst, size: h.blockBytes, max: h.maxBlocks}
	c.reset(0)
	c.field(v.GetStringBytes("model"))
	c.field(v.GetStringBytes("cache_salt"))
	if msgs := v.Get("messages"); msgs != nil {
		if err := c.messages(msgs); err != nil {
			return dst, ReasonBadMessages
		}
	} else if prompt := v.Get("prompt"); prompt != nil && prompt.Type() == fastjson.TypeString {
		c.write(prompt.GetStringBytes())
	} else {
		return dst, ReasonNotPrompt
	}
	if len(c.out) == len(dst) {
		return dst, ReasonShort
	}
	return c.out, ""
}

var errBadMessages = errors.New("bad messages")

// messages writes a chat request's messages.
func (c *chainer) messages(v *fastjson.Value) error {
	msgs, err := v.Array()
	if err != nil || len(msgs) == 0 {
		return errBadMessages
	}
	var raw []byte
	for _, m := range msgs {
		if m.Type() != fastjson.TypeObject {
			return errBadMessages
		}
		role := m.Get("role")
		if role == nil || role.Type() != fastjson.TypeString {
			return errBadMessages
		}
		c.field(role.GetStringBytes())
		content := m.Get("content")
		switch {
		case content == nil || content.Type() == fastjson.TypeNull:
			// An assistant turn of tool calls only: its calls are the turn.
			// With no calls, the turn is empty.
			raw = raw[:0]
			if calls := m.Get("tool_calls"); calls != nil {
				raw = calls.MarshalTo(raw)
			}
			c.field(raw)
		case content.Type() == fastjson.TypeString:
			c.field(content.GetStringBytes())
		case content.Type() == fastjson.TypeArray:
			parts, _ := content.Array()
			for _, part := range parts {
				if part.Type() != fastjson.TypeObject {
					return errBadMessages
				}
				if string(part.GetStringBytes("type")) == "text" {
					c.write(part.GetStringBytes("text"))
					continue
				}
				raw = part.MarshalTo(raw[:0])
				c.write(raw)
			}
			c.write(sep)
		default:
			return errBadMessages
		}
	}
	return nil
}

// sep ends a field, so that ("ab", "c") and ("a", "bc") differ.
var sep = []byte{0}

// chainer cuts a byte stream into blocks of size bytes and hashes each
// with the hash of the one before.
type chainer struct {
	d         xxhash.Digest
	n         int // bytes in the current block
	size, max int
	out       []uint64
	blocks    int // blocks cut so far
	prev      [8]byte
	full      bool // max blocks reached
}

func (c *chainer) reset(prev uint64) {
	c.d.Reset()
	binary.LittleEndian.PutUint64(c.prev[:], prev)
	_, _ = c.d.Write(c.prev[:])
	c.n = 0
}

func (c *chainer) field(b []byte) {
	c.write(b)
	c.write(sep)
}

func (c *chainer) write(b []byte) {
	for len(b) > 0 && !c.full {
		k := min(c.size-c.n, len(b))
		_, _ = c.d.Write(b[:k])
		c.n += k
		b = b[k:]
		if c.n == c.size {
			h := c.d.Sum64()
			c.out = append(c.out, h)
			c.blocks++
			c.full = c.blocks >= c.max
			c.reset(h)
		}
	}
}
