// Package workload generates the traffic of an LLM fleet as a stream of
// conversations: the field's mix of long documents, multi-turn chats and
// short single queries, each opening with its application's system prompt,
// each carrying the identity headers of its caller.
//
// It is pure: no I/O, no clock, no global state. A Generator draws every
// conversation from its Config's Seed, so the same Config gives the same
// conversations word for word, and conversation n is the same whichever
// order conversations are asked for in (At). The replay against real
// servers (timing, HTTP, answers) is the business of the caller, for example
// package loadgen; a discrete-event simulation can use the same stream.
//
// # What is generated
//
// A Conversation has a Kind (KindLong: one request with a document of
// Config.LongTokens; KindMultiTurn: Config.Turns turns of Config.TurnTokens
// each, separated by think time; KindSingle: one query of
// Config.SingleTokens), an App whose system prompt opens every request, an
// Identity (the request headers, the same on every turn), and Turns: the
// user message, the answer length (max_tokens) and the think time before
// each turn.
//
// The chat messages of turn k are built by Conversation.Messages from the
// answers the server gave to turns 0..k-1: the system prompt, then each
// earlier user message followed by its answer, then the new user message.
// The messages of turn k are therefore the messages of turn k-1 plus its
// answer plus one user message: each prompt extends the previous one, which
// is what lets a KV cache serve a follow-up turn from the blocks of the
// previous one.
//
// # Text and tokens
//
// Texts are pseudo-random words (syllables drawn from the seed), separated
// by single spaces, so the token counts follow emulator.CountTokens exactly (one
// token per whitespace-separated word): a user message of UserTokens tokens
// has UserTokens words, a system prompt SystemTokens words. The first user
// message of every conversation starts with the conversation's ID in
// brackets, so two conversations never share a KV block after the system
// prompt by accident; the system prompt of an application is the same for
// every conversation of a seed, so they do share that on purpose.
package workload

import (
	"fmt"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"strings"
	"time"
)

// Conversation is one caller's conversation: one request (KindLong,
// KindSingle) or several (KindMultiTurn).
type Conversation struct {
	// ID names the conversation: "s<seed>-c<index>". It is the first token
	// of the first user message.
	ID string
	// Index is the conversation's position in the stream, from 0.
	Index uint64
	Kind  Kind
	// App is the name of the application; System its system prompt, the
	// first message of every request (shared with every conversation of
	// the app), SystemTokens its length in tokens.
	App          string
	System       string
	SystemTokens int
	// Identity is the caller: the same headers go with every turn.
	Identity Identity
	// Turns are the requests, in order: one for KindLong and KindSingle.
	Turns []Turn
	// Document is the index of the shared document a KindDocs
	// conversation's first user message carries (before its tag and
	// question), -1 for the other kinds.
	Document int
}

// Identity is who a conversation's requests say they come from.
type Identity struct {
	Kind IdentityKind
	// Headers are the request headers that carry the identity (none for
	// IdentityAnonymous), in a fixed order.
	Headers []Header
}

// Header is one request header.
type Header struct {
	Name  string
	Value string
}

// Turn is one request of a conversation.
type Turn struct {
	// User is the new user message of the turn; UserTokens its length by
	// emulator.CountTokens.
	User       string
	UserTokens int
	// MaxTokens is the answer length to ask for (max_tokens, with
	// ignore_eos: true the server answers exactly this many tokens).
	MaxTokens int
	// Think is how long the user waits after the previous turn's answer
	// before sending this turn; zero for the first turn.
	Think time.Duration
}

// Message is one chat message, as the OpenAI chat API takes it.
type Message struct {
	Role    string `json:"role"` // "system", "user" or "assistant"
	Content string `json:"content"`
}

// Messages returns the chat messages of turn k (from 0): the system
// prompt, then for each earlier turn its user message and answers[i] (the
// answer the server returned to it, fed back verbatim), then the user
// message of turn k. answers must hold at least k answers; later ones are
// ignored.
func (c Conversation) Messages(k int, answers []string) ([]Message, error) {
	if k < 0 || k >= len(c.Turns) {
		return nil, fmt.Errorf("workload: conversation %s: turn %d: want 0 to %d", c.ID, k, len(c.Turns)-1)
	}
	if len(answers) < k {
		return nil, fmt.Errorf("workload: conversation %s: turn %d needs the answers of the %d turns before it, got %d", c.ID, k, k, len(answers))
	}
	msgs := make([]Message, 0, 2+2*k)
	msgs = append(msgs, Message{Role: "system", Content: c.System})
	for i := range k {
		msgs = append(msgs,
			Message{Role: "user", Content: c.Turns[i].User},
			Message{Role: "assistant", Content: answers[i]})
	}
	return append(msgs, Message{Role: "user", Content: c.Turns[k].User}), nil
}

// Generator produces the conversations of a Config. Next is not safe for
// concurrent use; At is.
type Generator struct {
	cfg     Config
	systems []string // system prompt of each app
	weights []float64
	// The shared documents (only when Mix.Docs > 0): their texts, token
	// counts and popularity weights.
	docs       []string
	docTokens  []int
	docWeights []float64
	docTotal   float64
	next       uint64
}

// New validates cfg, fills in its defaults and returns its generator.
func New(cfg Config) (*Generator, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.WithDefaults()
	g := &Generator{cfg: cfg, systems: make([]string, len(cfg.Apps)), weights: make([]float64, len(cfg.Apps))}
	for i, a := range cfg.Apps {
		g.systems[i] = systemPrompt(cfg.Seed, a)
		g.weights[i] = a.Weight
	}
	if cfg.Mix.Docs > 0 {
		d := cfg.Docs
		g.docWeights, g.docTotal = DocWeights(d)
		for k := range d.Count {
			text, n := document(cfg.Seed, k, d.Tokens)
			g.docs = append(g.docs, text)
			g.docTokens = append(g.docTokens, n)
		}
	}
	return g, nil
}

// DocWeights returns the popularity weights of the documents, 1/(k+1)^s,
// and their sum (added in index order).
func DocWeights(d Docs) ([]float64, float64) {
	w := make([]float64, d.Count)
	total := 0.0
	for k := range w {
		w[k] = 1 / math.Pow(float64(k+1), d.Skew)
		total += w[k]
	}
	return w, total
}

// Document returns shared document k's text and length in tokens; false
// when the configuration draws no documents (Mix.Docs is zero) or k is
// out of range.
func (g *Generator) Document(k int) (string, int, bool) {
	if k < 0 || k >= len(g.docs) {
		return "", 0, false
	}
	return g.docs[k], g.docTokens[k], true
}

// document draws shared document k of a seed: its length, then its
// words, from a stream of its own.
func document(seed uint64, k int, tokens Range) (string, int) {
	rng := rand.New(rand.NewPCG(splitmix(seed^streamDocs), splitmix(uint64(k))))
	n := draw(rng, tokens)
	return userText(rng, "", "", n), n
}

// Config returns the configuration with its defaults filled in.
func (g *Generator) Config() Config {
	c := g.cfg
	c.Apps = append([]App(nil), c.Apps...)
	return c
}

// SystemPrompt returns the system prompt of the named application, and
// false when there is no such application.
func (g *Generator) SystemPrompt(app string) (string, bool) {
	for i, a := range g.cfg.Apps {
		if a.Name == app {
			return g.systems[i], true
		}
	}
	return "", false
}

// MeanRequestsPerConversation is the expected number of requests of a
// conversation: 1 for long and single ones, the mean of Turns for
// multi-turn ones. A replay divides a request rate by it to get the rate
// of new conversations.
func (g *Generator) MeanRequestsPerConversation() float64 {
	m, t, d := g.cfg.Mix, g.cfg.Turns, g.cfg.Docs.Turns
	return m.Long + m.Single + m.MultiTurn*float64(t.Min+t.Max)/2 + m.Docs*float64(d.Min+d.Max)/2
}

// Next returns the next conversation of the stream: At(0), At(1), ...
func (g *Generator) Next() Conversation {
	c := g.At(g.next)
	g.next++
	return c
}

// At returns conversation n of the stream. It depends only on the Config
// and n.
func (g *Generator) At(n uint64) Conversation {
	cfg := &g.cfg
	rng := rand.New(rand.NewPCG(splitmix(cfg.Seed), splitmix(n^streamConversations)))
	c := Conversation{
		ID:       fmt.Sprintf("s%d-c%d", cfg.Seed, n),
		Index:    n,
		Kind:     Kinds()[pick(rng.Float64(), cfg.Mix.shares())],
		Document: -1,
	}
	app := pick(rng.Float64()*sum(g.weights), g.weights)
	c.App, c.System, c.SystemTokens = cfg.Apps[app].Name, g.systems[app], cfg.Apps[app].SystemTokens
	c.Identity = identity(rng, IdentityKinds()[pick(rng.Float64(), cfg.Identities.shares())])

	tag := "[" + c.ID + "]"
	switch c.Kind {
	case KindLong:
		n := draw(rng, cfg.LongTokens)
		c.Turns = []Turn{{User: userText(rng, tag, longInstruction, n), UserTokens: n, MaxTokens: draw(rng, cfg.LongOutput)}}
	case KindSingle:
		n := draw(rng, cfg.SingleTokens)
		c.Turns = []Turn{{User: userText(rng, tag, "", n), UserTokens: n, MaxTokens: draw(rng, cfg.SingleOutput)}}
	case KindMultiTurn:
		c.Turns = make([]Turn, draw(rng, cfg.Turns))
		for i := range c.Turns {
			t := &c.Turns[i]
			t.UserTokens = draw(rng, cfg.TurnTokens)
			if i == 0 {
				t.User = userText(rng, tag, "", t.UserTokens)
			} else {
				t.User = userText(rng, "", "", t.UserTokens)
				t.Think = think(rng, cfg.ThinkTime)
			}
			t.MaxTokens = draw(rng, cfg.MultiTurnOutput)
		}
	case KindDocs:
		// The document first (shared text, so shared KV blocks), then the
		// tag and the question: the conversation's own blocks start
		// after the document.
		d := pick(rng.Float64()*g.docTotal, g.docWeights)
		c.Document = d
		c.Turns = make([]Turn, draw(rng, cfg.Docs.Turns))
		for i := range c.Turns {
			t := &c.Turns[i]
			q := draw(rng, cfg.Docs.QuestionTokens)
			if i == 0 {
				t.User = g.docs[d] + "\n" + userText(rng, tag, "", q)
				t.UserTokens = g.docTokens[d] + q
			} else {
				t.User = userText(rng, "", "", q)
				t.UserTokens = q
				t.Think = think(rng, cfg.ThinkTime)
			}
			t.MaxTokens = draw(rng, cfg.Docs.Output)
		}
	}
	return c
}

// Domain separators of the random streams drawn from one seed.
const (
	streamConversations = 0x636f6e7665727361 // "conversa"
	streamApps          = 0x6170706c69636174 // "applicat"
	streamDocs          = 0x646f63756d656e74 // "document"
)

// longInstruction opens the user message of a long-text request.
const longInstruction = "Summarise the following document in a few paragraphs, then list its key figures:"

// userText returns a message of exactly n tokens: the tag (when not empty),
// the instruction's words (as many as fit), then pseudo-random words.
func userText(rng *rand.Rand, tag, instruction string, n int) string {
	var b strings.Builder
	b.Grow(n * 8)
	words := 0
	add := func(w string) {
		if words > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(w)
		words++
	}
	if tag != "" && words < n {
		add(tag)
	}
	for _, w := range strings.Fields(instruction) {
		if words == n {
			break
		}
		add(w)
	}
	for words < n {
		if words > 0 {
			b.WriteByte(' ')
		}
		writeWord(&b, rng, words)
		words++
	}
	return b.String()
}

// systemPrompt returns the system prompt of app for a seed: a preamble that
// names the application, then pseudo-random words, a.SystemTokens tokens
// in all. It depends only on the seed and the application's name and
// length.
func systemPrompt(seed uint64, a App) string {
	h := fnv.New64a()
	_, _ = h.Write([]byte(a.Name))
	rng := rand.New(rand.NewPCG(splitmix(seed^streamApps), splitmix(h.Sum64())))
	preamble := "You are the " + a.Name + " assistant. Follow these instructions in every answer:"
	return userText(rng, "", preamble, a.SystemTokens)
}

// Syllables of the pseudo-words: 17 consonants × 5 vowels.
const (
	consonants = "bcdfghjklmnprstvz"
	vowels     = "aeiou"
)

// writeWord appends one pseudo-word of one to three syllables (about 620k
// different words), drawn from one random number; every 12th word ends a
// sentence. The word never holds whitespace: it is one token.
func writeWord(b *strings.Builder, rng *rand.Rand, i int) {
	x := rng.Uint64()
	syllables := 1 + x%3
	x /= 3
	for range syllables {
		b.WriteByte(consonants[x%uint64(len(consonants))])
		x /= uint64(len(consonants))
		b.WriteByte(vowels[x%uint64(len(vowels))])
		x /= uint64(len(vowels))
	}
	if i%12 == 11 {
		b.WriteByte('.')
	}
}

// identity draws the headers of an identity kind: random hex identifiers,
// 128 bits for secrets and sessions, 64 for devices and users.
func identity(rng *rand.Rand, kind IdentityKind) Identity {
	id := Identity{Kind: kind}
	switch kind {
	case IdentitySession:
		id.Headers = []Header{{SessionHeader, "sess-" + hex(rng, 2)}}
	case IdentityToken:
		id.Headers = []Header{{AuthHeader, "Bearer tk-" + hex(rng, 2)}}
	case IdentityDevice:
		id.Headers = []Header{{DeviceHeader, "dev-" + hex(rng, 1)}, {UserHeader, "user-" + hex(rng, 1)}}
	}
	return id
}

func hex(rng *rand.Rand, words int) string {
	var b strings.Builder
	for range words {
		fmt.Fprintf(&b, "%016x", rng.Uint64())
	}
	return b.String()
}

// draw returns a uniform integer in r.
func draw(rng *rand.Rand, r Range) int { return r.Min + rng.IntN(r.Max-r.Min+1) }

// think draws an exponential think time of the given mean, cut at 10 times
// the mean (so a replay's wait is bounded), rounded to the millisecond.
func think(rng *rand.Rand, mean time.Duration) time.Duration {
	d := time.Duration(min(rng.ExpFloat64(), 10) * float64(mean))
	return d.Round(time.Millisecond)
}

// pick returns the index i of the weight interval u falls in (u in
// [0, sum(weights))), skipping zero weights; the last non-zero index when
// rounding puts u at the end.
func pick(u float64, weights []float64) int {
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

func sum(xs []float64) float64 {
	s := 0.0
	for _, x := range xs {
		s += x
	}
	return s
}

// splitmix spreads the bits of x (the splitmix64 finalizer), so that
// neighbouring seeds and indexes give unrelated streams.
func splitmix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}
