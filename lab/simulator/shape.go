package simulator

import (
	"math/bits"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/tetherproxy/tether/lab/workload"
)

// shape is a workload conversation without its texts: what the fast path
// needs to price and route it. shapes.at(n) describes the same conversation
// as workload.Generator.At(n), turn for turn, without writing a word.
//
// Why: At writes every word of every message (a long document is 4,000 to
// 16,000 pseudo-random words), about 120 µs per conversation on average, 30
// minutes of CPU for the 15.6 million conversations of an hour at 10,000
// requests per second. The fast path only needs the token counts, the
// identity headers and the think times; the words matter only through which
// KV blocks two prompts share, which the fast path knows without them (see
// model.go).
//
// How: at replays At's draws from the same random stream in the same order
// and, where At draws one random number per pseudo-word, advances the stream
// by that many steps at once (PCG is a linear congruential generator, which
// can jump ahead in O(log n)). It therefore mirrors the internals of
// lab/workload (the stream's seeding, the order of the draws, the words of
// the long-text instruction); TestShapesMatchWorkload compares it with At
// on thousands of conversations of several configurations, so a change to
// the generator that this file does not follow fails that test.
type shape struct {
	index    uint64
	kind     workload.Kind
	app      int // index in the configuration's Apps
	identity workload.Identity
	turns    []turnShape
	// doc is the shared document a KindDocs conversation opens with (its
	// first user message: the document, then the tag and the question),
	// -1 for the other kinds.
	doc int
}

// turnShape is one request of a shape.
type turnShape struct {
	userTokens int
	maxTokens  int
	think      time.Duration // before this turn; 0 for the first
}

// shapes draws the shapes of one workload configuration.
type shapes struct {
	cfg      workload.Config // with defaults
	mix      []float64
	ids      []float64
	weights  []float64
	total    float64
	longInst int // words of the long-text instruction
	// The shared documents (when the mix draws them): popularity weights
	// and their sum, and each one's length in tokens.
	docWeights []float64
	docTotal   float64
	docTokens  []int
}

// Mirrors of lab/workload's unexported constants (see shape).
const (
	wlStreamConversations = 0x636f6e7665727361 // "conversa"
	wlStreamDocs          = 0x646f63756d656e74 // "document"
	wlLongInstruction     = "Summarise the following document in a few paragraphs, then list its key figures:"
)

func newShapes(cfg workload.Config) *shapes {
	cfg = cfg.WithDefaults()
	s := &shapes{
		cfg:      cfg,
		mix:      []float64{cfg.Mix.Long, cfg.Mix.MultiTurn, cfg.Mix.Single},
		ids:      []float64{cfg.Identities.Session, cfg.Identities.Token, cfg.Identities.Device, cfg.Identities.Anonymous},
		longInst: len(strings.Fields(wlLongInstruction)),
	}
	for _, a := range cfg.Apps {
		s.weights = append(s.weights, a.Weight)
		s.total += a.Weight
	}
	if cfg.Mix.Docs > 0 {
		s.mix = append(s.mix, cfg.Mix.Docs)
		s.docWeights, s.docTotal = workload.DocWeights(cfg.Docs)
		for k := range cfg.Docs.Count {
			// A document's length is the first draw of its own stream.
			rng := rand.New(rand.NewPCG(wlSplitmix(cfg.Seed^wlStreamDocs), wlSplitmix(uint64(k))))
			s.docTokens = append(s.docTokens, wlDraw(rng, cfg.Docs.Tokens))
		}
	}
	return s
}

// at returns the shape of conversation n (workload.Generator.At(n)).
func (s *shapes) at(n uint64) shape {
	cfg := &s.cfg
	src := rand.NewPCG(wlSplitmix(cfg.Seed), wlSplitmix(n^wlStreamConversations))
	rng := rand.New(src)
	sh := shape{index: n, doc: -1}
	sh.kind = workload.Kinds()[wlPick(rng.Float64(), s.mix)]
	sh.app = wlPick(rng.Float64()*s.total, s.weights)
	sh.identity = wlIdentity(rng, workload.IdentityKinds()[wlPick(rng.Float64(), s.ids)])

	// user skips the random words of a message of n tokens: the tag (one
	// word) and the instruction's words come first and draw nothing.
	user := func(tagged bool, instruction, n int) {
		fixed := 0
		if tagged && n > 0 {
			fixed = 1
		}
		fixed += min(instruction, n-fixed)
		skipPCG(src, uint64(n-fixed))
	}
	switch sh.kind {
	case workload.KindLong:
		n := wlDraw(rng, cfg.LongTokens)
		user(true, s.longInst, n)
		sh.turns = []turnShape{{userTokens: n, maxTokens: wlDraw(rng, cfg.LongOutput)}}
	case workload.KindSingle:
		n := wlDraw(rng, cfg.SingleTokens)
		user(true, 0, n)
		sh.turns = []turnShape{{userTokens: n, maxTokens: wlDraw(rng, cfg.SingleOutput)}}
	case workload.KindMultiTurn:
		sh.turns = make([]turnShape, wlDraw(rng, cfg.Turns))
		for i := range sh.turns {
			t := &sh.turns[i]
			t.userTokens = wlDraw(rng, cfg.TurnTokens)
			user(i == 0, 0, t.userTokens)
			if i > 0 {
				t.think = wlThink(rng, cfg.ThinkTime)
			}
			t.maxTokens = wlDraw(rng, cfg.MultiTurnOutput)
		}
	case workload.KindDocs:
		sh.doc = wlPick(rng.Float64()*s.docTotal, s.docWeights)
		sh.turns = make([]turnShape, wlDraw(rng, cfg.Docs.Turns))
		for i := range sh.turns {
			t := &sh.turns[i]
			q := wlDraw(rng, cfg.Docs.QuestionTokens)
			user(i == 0, 0, q)
			t.userTokens = q
			if i == 0 {
				t.userTokens += s.docTokens[sh.doc]
			} else {
				t.think = wlThink(rng, cfg.ThinkTime)
			}
			t.maxTokens = wlDraw(rng, cfg.Docs.Output)
		}
	}
	return sh
}

// wlIdentity mirrors workload's identity headers.
func wlIdentity(rng *rand.Rand, kind workload.IdentityKind) workload.Identity {
	id := workload.Identity{Kind: kind}
	switch kind {
	case workload.IdentitySession:
		id.Headers = []workload.Header{{Name: workload.SessionHeader, Value: "sess-" + wlHex(rng, 2)}}
	case workload.IdentityToken:
		id.Headers = []workload.Header{{Name: workload.AuthHeader, Value: "Bearer tk-" + wlHex(rng, 2)}}
	case workload.IdentityDevice:
		id.Headers = []workload.Header{
			{Name: workload.DeviceHeader, Value: "dev-" + wlHex(rng, 1)},
			{Name: workload.UserHeader, Value: "user-" + wlHex(rng, 1)},
		}
	}
	return id
}

// wlHex is workload's hex: words random numbers as %016x.
func wlHex(rng *rand.Rand, words int) string {
	const digits = "0123456789abcdef"
	b := make([]byte, 0, 16*words)
	for range words {
		x := rng.Uint64()
		for shift := 60; shift >= 0; shift -= 4 {
			b = append(b, digits[x>>shift&0xf])
		}
	}
	return string(b)
}

func wlDraw(rng *rand.Rand, r workload.Range) int { return r.Min + rng.IntN(r.Max-r.Min+1) }

func wlThink(rng *rand.Rand, mean time.Duration) time.Duration {
	d := time.Duration(min(rng.ExpFloat64(), 10) * float64(mean))
	return d.Round(time.Millisecond)
}

func wlPick(u float64, weights []float64) int {
	last := 0
	for i, w := range weights {
		if w <= 0 {
			continue
		}
		if u < w {
			return i
		}
		u -= w
		last = i
	}
	return last
}

func wlSplitmix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// skipPCG advances p by n steps, as n calls of p.Uint64 would, in O(log n):
// the state of math/rand/v2's PCG is a 128-bit linear congruential
// generator, s ← s·mul + inc (mod 2¹²⁸), and n steps of it are one step of
// s ← s·A + C with A = mulⁿ and C = inc·(mulⁿ⁻¹ + … + 1) (Brown, "Random
// number generation with arbitrary strides", 1994). The state is read and
// written through PCG's own MarshalBinary and Seed, so the output function
// stays math/rand/v2's; TestSkipPCG checks the jump against n calls.
func skipPCG(p *rand.PCG, n uint64) {
	if n == 0 {
		return
	}
	var buf [20]byte
	b, _ := p.AppendBinary(buf[:0]) // "pcg:" hi lo, big-endian; never fails
	s := u128{hi: be64(b[4:]), lo: be64(b[12:])}
	accMul, accAdd := u128{lo: 1}, u128{}
	curMul, curAdd := pcgMul, pcgInc
	for ; n > 0; n >>= 1 {
		if n&1 == 1 {
			accMul = accMul.mul(curMul)
			accAdd = accAdd.mul(curMul).add(curAdd)
		}
		curAdd = curMul.add(u128{lo: 1}).mul(curAdd)
		curMul = curMul.mul(curMul)
	}
	s = s.mul(accMul).add(accAdd)
	p.Seed(s.hi, s.lo)
}

// The multiplier and increment of math/rand/v2's PCG.
var (
	pcgMul = u128{hi: 2549297995355413924, lo: 4865540595714422341}
	pcgInc = u128{hi: 6364136223846793005, lo: 1442695040888963407}
)

// u128 is an unsigned 128-bit integer; arithmetic wraps modulo 2¹²⁸.
type u128 struct{ hi, lo uint64 }

func (a u128) mul(b u128) u128 {
	hi, lo := bits.Mul64(a.lo, b.lo)
	hi += a.hi*b.lo + a.lo*b.hi
	return u128{hi: hi, lo: lo}
}

func (a u128) add(b u128) u128 {
	lo, c := bits.Add64(a.lo, b.lo, 0)
	hi, _ := bits.Add64(a.hi, b.hi, c)
	return u128{hi: hi, lo: lo}
}

func be64(b []byte) uint64 {
	_ = b[7]
	return uint64(b[0])<<56 | uint64(b[1])<<48 | uint64(b[2])<<40 | uint64(b[3])<<32 |
		uint64(b[4])<<24 | uint64(b[5])<<16 | uint64(b[6])<<8 | uint64(b[7])
}
