package emulator

import (
	"fmt"
	"math"
	"slices"
	"sync"
	"time"
)

// GPUConfig configures a GPU latency model.
type GPUConfig struct {
	// Profile holds the cost figures (ProfileA100, ProfileH200).
	Profile Profile

	// TimeScale multiplies every duration the model hands out: 0.1 runs ten
	// times faster than real time, with the same ratios. Zero means 1.
	TimeScale float64

	// Cache configures the prefix cache. A zero CapacityTokens means the
	// profile's KVCapacityTokens; MaxConversations works as documented on
	// CacheConfig (zero: DefaultMaxConversations).
	Cache CacheConfig

	// PromptOnly stores only the prompt's blocks. By default the answer's
	// blocks are stored after them, as serving engines do, so the next turn
	// of a conversation, which carries the answer, hits up to its end.
	PromptOnly bool
}

func (c GPUConfig) withDefaults() GPUConfig {
	if c.TimeScale == 0 {
		c.TimeScale = 1
	}
	if c.Cache.CapacityTokens == 0 {
		c.Cache.CapacityTokens = c.Profile.KVCapacityTokens
	}
	return c
}

// Validate reports the first problem with the configuration.
func (c GPUConfig) Validate() error {
	if err := c.Profile.Validate(); err != nil {
		return err
	}
	if s := c.TimeScale; math.IsNaN(s) || math.IsInf(s, 0) || s < 0 {
		return fmt.Errorf("emulator: time_scale %v: want a finite number > 0 (1 is real time, 0.1 ten times faster)", s)
	}
	return c.withDefaults().Cache.Validate()
}

// ModelStats describes the state of a latency model, for GET /admin/stats.
type ModelStats struct {
	Profile   string     `json:"profile"`
	Estimate  bool       `json:"estimate"` // the profile's figures are derived, not measured
	TimeScale float64    `json:"time_scale"`
	Cache     CacheStats `json:"cache"`
	// PrefillGPUSeconds and DecodeGPUSeconds add up the emulated GPU time
	// spent, in unscaled seconds: every prefill in full, and every decode
	// step divided by the batch it ran in (the request's share of the GPU).
	PrefillGPUSeconds float64 `json:"prefill_gpu_seconds"`
	DecodeGPUSeconds  float64 `json:"decode_gpu_seconds"`
}

// Utilizer is a LatencyModel that reports how busy its GPU is: the share
// of the time just before now it was working, 0 to 1. The handler sends it
// as GPUUtilizationHeader.
type Utilizer interface {
	Utilization(now time.Time) float64
}

// StatefulModel is a LatencyModel with state that the admin endpoints report
// (GET /admin/stats) and reset (POST /admin/reset).
type StatefulModel interface {
	LatencyModel
	Stats() ModelStats
	Reset()
}

// GPU is the LatencyModel of one emulated GPU serving an 8B-Llama-shaped
// model: a prefix KV cache (KVCache) and the calibrated costs of a Profile.
// For each request, Cost
//
//  1. hashes the prompt into blocks and looks up the longest cached prefix
//     (the last prompt token is always computed, as in vLLM, so a prompt
//     that is entirely cached still recomputes its last block);
//  2. queues the prefill of the uncached tokens behind the prefills already
//     admitted: the GPU prefills one request at a time, at its full rate;
//  3. times the decode of the answer's tokens after the first at the step
//     time of a batch of InFlight+1 sequences of this request's context;
//  4. stores the prompt's blocks (ready when its prefill ends) and the
//     answer's (ready when its decode ends).
//
// Cost is a pure function of the model's state and the Request (Arrived,
// InFlight, the texts): it never reads a clock and never sleeps; the handler
// waits. Every duration is multiplied by the time scale.
//
// Not modelled: later arrivals slowing down a decode already timed, prefill
// chunks interleaved with decode steps, batch limits, preemption (counted
// when the cache frees a running request's block, see EngineState, but the
// request keeps its cost), and cancelled requests (their cost stays spent,
// their blocks stored, and they count as running until their decode ends).
type GPU struct {
	cfg   GPUConfig
	cache *KVCache

	mu          sync.Mutex
	prefillFree time.Time // when the prefills admitted so far are done
	prefillGPU  time.Duration
	decodeGPU   float64 // ns
	// busy are the spans the GPU is booked for (prefills, decodes), in
	// wall time, for Utilization; those that ended a window ago are
	// dropped.
	busy []span
	// flights are the requests priced whose decode had not ended when the
	// last request arrived, soonest end first (a heap); held counts, per
	// block hash, the flights whose sequence has that block; preemptions
	// counts the running requests the cache freed a block of (see
	// EngineState).
	flights     flightHeap
	held        map[BlockHash]int
	preemptions int64
}

// span is a stretch of wall time, [from, to).
type span struct{ from, to time.Time }

// UtilizationWindow is the trailing window Utilization measures over.
const UtilizationWindow = time.Second

var (
	_ StatefulModel  = (*GPU)(nil)
	_ Utilizer       = (*GPU)(nil)
	_ EngineReporter = (*GPU)(nil)
)

// NewGPU returns a GPU model with an empty cache.
func NewGPU(cfg GPUConfig) (*GPU, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	cache, err := NewKVCache(cfg.Cache)
	if err != nil {
		return nil, err
	}
	return &GPU{cfg: cfg, cache: cache, held: make(map[BlockHash]int)}, nil
}

// Cache returns the model's prefix cache.
func (g *GPU) Cache() *KVCache { return g.cache }

// Profile returns the model's profile.
func (g *GPU) Profile() Profile { return g.cfg.Profile }

// Cost implements LatencyModel.
func (g *GPU) Cost(r Request) Cost {
	var h BlockHasher
	hashes := h.Append(nil, r.Prompt)
	promptTokens, promptBlocks := h.Tokens(), len(hashes)
	// The answer's blocks follow the prompt's: the request holds them while
	// it decodes, and the cache stores them unless PromptOnly.
	hashes = h.Append(hashes, r.Completion)
	seqTokens := h.Tokens()
	stored := hashes
	if g.cfg.PromptOnly {
		stored = hashes[:promptBlocks]
	}
	lookup := 0
	if promptTokens > 0 {
		lookup = min(promptBlocks, (promptTokens-1)/BlockSize)
	}
	out := max(r.CompletionTokens, 0)
	batch := max(r.InFlight, 0) + 1
	p := g.cfg.Profile

	g.mu.Lock()
	defer g.mu.Unlock()
	g.retire(r.Arrived)

	// Prefills run one at a time: this one starts when the GPU is free, and
	// looks the cache up then, so it finds what the prefills queued ahead
	// of it computed (a shared system prompt, say).
	start := r.Arrived
	if g.prefillFree.After(start) {
		start = g.prefillFree
	}
	cached := g.cache.Match(hashes[:lookup], start) * BlockSize
	prefill := p.Prefill(promptTokens-cached, cached)
	prefillEnd := start.Add(g.scale(prefill))
	g.prefillFree = prefillEnd

	step := p.Decode.Step(batch, promptTokens+out/2)
	decode := time.Duration(max(out-1, 0)) * step
	decodeEnd := prefillEnd.Add(g.scale(decode))

	chain := make([]Block, len(stored))
	for i, hash := range stored {
		chain[i] = Block{Hash: hash, Ready: prefillEnd}
		if i >= promptBlocks {
			chain[i].Ready = decodeEnd
		}
	}
	var freed []BlockHash // blocks of requests in flight the store frees
	g.cache.storeReporting(r.Session, chain, func(hash BlockHash) {
		if g.held[hash] > 0 {
			freed = append(freed, hash)
		}
	})
	g.preempt(freed, r.Arrived)
	g.admit(&flight{
		start: start, prefillEnd: prefillEnd, decodeEnd: decodeEnd,
		promptTokens: promptTokens, seqTokens: seqTokens, hashes: hashes,
	})

	g.prefillGPU += prefill
	g.decodeGPU += float64(decode) / float64(batch)
	old := r.Arrived.Add(-UtilizationWindow)
	g.busy = slices.DeleteFunc(g.busy, func(s span) bool { return !s.to.After(old) })
	g.busy = append(g.busy, span{start, decodeEnd})
	return Cost{
		Wait:         prefillEnd.Sub(r.Arrived),
		Decode:       decodeEnd.Sub(prefillEnd),
		CachedTokens: cached,
		Queued:       start.Sub(r.Arrived),
	}
}

func (g *GPU) scale(d time.Duration) time.Duration {
	return time.Duration(float64(d) * g.cfg.TimeScale)
}

// Stats implements StatefulModel.
func (g *GPU) Stats() ModelStats {
	g.mu.Lock()
	defer g.mu.Unlock()
	return ModelStats{
		Profile:           g.cfg.Profile.Name,
		Estimate:          g.cfg.Profile.Estimate,
		TimeScale:         g.cfg.TimeScale,
		Cache:             g.cache.Stats(),
		PrefillGPUSeconds: g.prefillGPU.Seconds(),
		DecodeGPUSeconds:  g.decodeGPU / 1e9,
	}
}

// Utilization implements Utilizer: the share of the UtilizationWindow
// before now in which the GPU was prefilling or decoding some request, as
// the model booked it (from a prefill's start to its decode's end;
// concurrent decodes count once, as one batch). A report, not a figure
// the model's costs depend on.
func (g *GPU) Utilization(now time.Time) float64 {
	from := now.Add(-UtilizationWindow)
	g.mu.Lock()
	spans := make([]span, 0, len(g.busy))
	for _, s := range g.busy {
		a, b := later(s.from, from), earlier(s.to, now)
		if b.After(a) {
			spans = append(spans, span{a, b})
		}
	}
	g.mu.Unlock()
	slices.SortFunc(spans, func(a, b span) int { return a.from.Compare(b.from) })
	var busy time.Duration
	var cur span
	for i, s := range spans {
		switch {
		case i == 0:
			cur = s
		case s.from.After(cur.to):
			busy += cur.to.Sub(cur.from)
			cur = s
		default:
			cur.to = later(cur.to, s.to)
		}
	}
	if len(spans) > 0 {
		busy += cur.to.Sub(cur.from)
	}
	return min(float64(busy)/float64(UtilizationWindow), 1)
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

func earlier(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

// Reset implements StatefulModel: it empties the cache, forgets the prefill
// queue and the requests in flight, and zeroes the counters.
func (g *GPU) Reset() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.cache.Reset()
	g.busy = nil
	g.flights = nil
	g.held = make(map[BlockHash]int)
	g.preemptions = 0
	g.prefillFree = time.Time{}
	g.prefillGPU = 0
	g.decodeGPU = 0
}
