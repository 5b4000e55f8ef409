package simulator

import (
	"strings"
	"time"

	"github.com/tetherproxy/tether/lab/emulator"
)

// model prices the requests of one instance: emulator.GPU's latency model.
type model interface {
	// cost prices c's current turn arriving at virtual time arrived
	// (nanoseconds from the start) with inFlight requests already on the
	// instance, and stores its blocks, as emulator.GPU.Cost does.
	cost(c *conversation, arrived int64, inFlight int) emulator.Cost
	stats() emulator.ModelStats
	// reset empties the cache and the queue (the instance restarted); the
	// GPU figures go on adding up.
	reset()
}

// epochUnix is virtual time zero, in Unix seconds, for the parts of the
// code that take a time.Time (emulator.GPU, affinity's clock): 2025-01-01. Any
// fixed instant would do.
const epochUnix = 1735689600

// virtualTime is the time.Time of virtual time ns.
func virtualTime(ns int64) time.Time { return time.Unix(epochUnix, ns).UTC() }

// textModel is the exact path: emulator.GPU itself, given the request's text as
// the emulator's HTTP handler builds it (the chat messages' contents joined
// by "\n", the answer "served by <instance> …" of max_tokens words). It
// re-tokenises and re-hashes every prompt, so it is slow; it is the
// reference the fast path is tested against.
type textModel struct {
	name string
	cfg  emulator.GPUConfig
	gpu  *emulator.GPU
	// prefillFree is when the GPU's prefills so far end (its own
	// prefillFree), for cachedPrefix.
	prefillFree int64
}

func (m *textModel) cost(c *conversation, arrived int64, inFlight int) emulator.Cost {
	k := c.turn
	msgs, err := c.text.Messages(k, c.answers)
	if err != nil {
		panic(err) // the runner keeps one answer per turn served: a bug
	}
	parts := make([]string, len(msgs))
	for i, m := range msgs {
		parts[i] = m.Content
	}
	prompt := strings.Join(parts, "\n")
	c.answer = answerText(m.name, c.shape.turns[k].maxTokens)
	cost := m.gpu.Cost(emulator.Request{
		Instance:         m.name,
		Endpoint:         "/v1/chat/completions",
		Prompt:           prompt,
		PromptTokens:     emulator.CountTokens(prompt),
		CompletionTokens: c.shape.turns[k].maxTokens,
		Completion:       c.answer,
		Session:          c.session,
		Arrived:          virtualTime(arrived),
		InFlight:         inFlight,
	})
	m.prefillFree = arrived + int64(cost.Wait)
	return cost
}

func (m *textModel) stats() emulator.ModelStats { return m.gpu.Stats() }

// reset starts a new GPU (the exact path runs no scenario, so none of its
// figures are lost in a run that counts them).
func (m *textModel) reset() {
	gpu, err := emulator.NewGPU(m.cfg)
	if err != nil {
		panic(err) // m.cfg made the first one
	}
	m.gpu, m.prefillFree = gpu, 0
}

// answerText is what an emulated instance answers with ignore_eos: the
// words "served by <name>" repeated until the answer is maxTokens words
// long (the emulator's answerWords; TestAnswerTextMatchesEmulator checks it against
// the emulator's handler).
func answerText(name string, maxTokens int) string {
	words := strings.Fields("served by " + name)
	for len(words) < maxTokens {
		words = append(words, words[len(words)%3])
	}
	return strings.Join(words[:min(maxTokens, len(words))], " ")
}

// blockModel is the fast path: emulator.GPU.Cost step for step, without text.
//
// A prompt is the application's system prompt, then the conversation's own
// messages, each turn extending the previous prompt and answer. The system
// prompt's full blocks are shared by every conversation of the
// application; every later block belongs to one conversation only (its
// first user message starts with the conversation's id) and is the same
// block in every turn that carries it (the history does not change). So a
// block is known by (application, index) or (conversation, index), the
// token counts give the number of blocks, and runCache keeps emulator.KVCache's
// state in those terms. TestFastMatchesText runs both paths on the same
// traffic and compares the results.
type blockModel struct {
	profile     emulator.Profile
	timeScale   float64
	cacheConfig emulator.CacheConfig
	cache       *runCache
	// docs replaces cache when the workload has shared documents
	// (chain.go); nil otherwise.
	docs        *chainCache
	system      []int // per application: its system prompt's full blocks
	prefillFree int64
	prefillGPU  time.Duration
	decodeGPU   float64 // ns
}

func (m *blockModel) cost(c *conversation, arrived int64, inFlight int) emulator.Cost {
	t := c.shape.turns[c.turn]
	promptTokens, out := c.history+t.userTokens, t.maxTokens
	promptBlocks := promptTokens / emulator.BlockSize
	blocks := (promptTokens + out) / emulator.BlockSize
	a, conv := c.shape.app, c.shape.index

	// From here on, emulator.GPU.Cost.
	lookup := 0
	if promptTokens > 0 {
		lookup = min(promptBlocks, (promptTokens-1)/emulator.BlockSize)
	}
	batch := max(inFlight, 0) + 1
	p := m.profile

	// Prefills run one at a time; this one looks the cache up when it
	// starts.
	start := max(arrived, m.prefillFree)
	var cached int
	if m.docs != nil {
		cached = m.docs.match(c, lookup, start) * emulator.BlockSize
	} else {
		cached = m.cache.match(a, conv, lookup, start) * emulator.BlockSize
	}
	prefill := p.Prefill(promptTokens-cached, cached)
	prefillEnd := start + int64(m.scale(prefill))
	m.prefillFree = prefillEnd

	step := p.Decode.Step(batch, promptTokens+out/2)
	decode := time.Duration(max(out-1, 0)) * step
	decodeEnd := prefillEnd + int64(m.scale(decode))

	if m.docs != nil {
		m.docs.store(c, blocks, promptBlocks, prefillEnd, decodeEnd)
	} else {
		m.cache.store(a, conv, blocks, promptBlocks, prefillEnd, decodeEnd, c.session != "", c.sessionKey)
	}

	m.prefillGPU += prefill
	m.decodeGPU += float64(decode) / float64(batch)
	return emulator.Cost{
		Wait:         time.Duration(prefillEnd - arrived),
		Decode:       time.Duration(decodeEnd - prefillEnd),
		CachedTokens: cached,
		Queued:       time.Duration(start - arrived),
	}
}

func (m *blockModel) reset() {
	m.prefillFree = 0
	if m.docs != nil {
		m.docs.reset(m.cacheConfig)
		return
	}
	st := m.cache.stats
	m.cache = newRunCache(m.cacheConfig, m.system)
	m.cache.stats.Evictions, m.cache.stats.ConversationEvictions, m.cache.stats.ReleasedBlocks = st.Evictions, st.ConversationEvictions, st.ReleasedBlocks
	m.prefillFree = 0
}

func (m *blockModel) scale(d time.Duration) time.Duration {
	return time.Duration(float64(d) * m.timeScale)
}

func (m *blockModel) stats() emulator.ModelStats {
	return emulator.ModelStats{
		Profile:           m.profile.Name,
		Estimate:          m.profile.Estimate,
		TimeScale:         m.timeScale,
		Cache:             m.cacheStats(),
		PrefillGPUSeconds: m.prefillGPU.Seconds(),
		DecodeGPUSeconds:  m.decodeGPU / 1e9,
	}
}

func (m *blockModel) cacheStats() emulator.CacheStats {
	if m.docs != nil {
		return m.docs.cacheStats()
	}
	return m.cache.cacheStats()
}
