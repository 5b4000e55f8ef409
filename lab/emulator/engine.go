package emulator

import (
	"container/heap"
	"time"
)

// EngineState is what a serving engine's scheduler knows at one instant,
// the figures GET /metrics serves as vLLM's or SGLang's gauges.
type EngineState struct {
	// Running counts the requests being prefilled or decoded (in the batch);
	// Waiting those admitted but queued behind the prefills ahead of them.
	Running, Waiting int
	// UsedBlocks and UsedTokens are the KV cache held by the running
	// requests: the blocks of their sequences so far (prompt, then the
	// answer's tokens as they are generated), a block shared by several
	// counting once, plus each request's partial last block (a whole block
	// in UsedBlocks, its tokens in UsedTokens). Cached blocks that no
	// running request holds are evictable, so free, as in vLLM and SGLang.
	// Both may exceed the capacity: the model admits every request.
	UsedBlocks, UsedTokens int
	// CapacityBlocks and CapacityTokens are the KV cache's size.
	CapacityBlocks, CapacityTokens int
	// Preemptions counts the running requests the cache freed a block of
	// (the capacity LRU or the conversation cap evicting it) since the
	// start or the last Reset: a real engine would have preempted them.
	Preemptions int64
}

// EngineReporter is a LatencyModel with a scheduler and a prefix cache
// (GPU): GET /metrics serves its EngineState, and its prefix cache
// counters (vllm:prefix_cache_queries_total and …_hits_total, in tokens)
// count every request it prices. A model that is not one (Fixed) has no
// prefix cache: /metrics then reports the requests in flight as running,
// none waiting, no KV cache usage and no cache queries.
type EngineReporter interface {
	LatencyModel
	EngineState(now time.Time) EngineState
}

// flight is one request the GPU priced, on the model's timeline: waiting
// until start, prefilling until prefillEnd, decoding until decodeEnd.
type flight struct {
	start, prefillEnd, decodeEnd time.Time
	promptTokens                 int         // tokens of the prompt
	seqTokens                    int         // tokens of the prompt and the answer (one choice)
	hashes                       []BlockHash // the full blocks of that sequence
	preempted                    bool        // counted in GPU.preemptions
	index                        int         // in the flightHeap
}

// tokens is the length of the request's sequence at t while it runs: the
// prompt from the prefill's start, then one more answer token per decode
// step (the first with the prefill), evenly over the decode.
func (f *flight) tokens(t time.Time) int {
	if t.Before(f.prefillEnd) {
		return f.promptTokens
	}
	out := f.seqTokens - f.promptTokens
	if out <= 0 {
		return f.promptTokens
	}
	total := f.decodeEnd.Sub(f.prefillEnd)
	gen := out
	if el := t.Sub(f.prefillEnd); total > 0 && el < total {
		gen = 1 + int(float64(out-1)*float64(el)/float64(total))
	}
	return f.promptTokens + min(gen, out)
}

// running reports whether the request is in the batch at t.
func (f *flight) running(t time.Time) bool {
	return !t.Before(f.start) && t.Before(f.decodeEnd)
}

// flightHeap orders flights by the end of their decode.
type flightHeap []*flight

func (h flightHeap) Len() int           { return len(h) }
func (h flightHeap) Less(i, j int) bool { return h[i].decodeEnd.Before(h[j].decodeEnd) }
func (h flightHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index, h[j].index = i, j
}
func (h *flightHeap) Push(x any) {
	f := x.(*flight)
	f.index = len(*h)
	*h = append(*h, f)
}
func (h *flightHeap) Pop() any {
	old := *h
	f := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return f
}

// admit records a priced request. g.mu is held.
func (g *GPU) admit(f *flight) {
	heap.Push(&g.flights, f)
	for _, h := range f.hashes {
		g.held[h]++
	}
}

// retire forgets the requests whose decode ended by t. g.mu is held.
func (g *GPU) retire(t time.Time) {
	for len(g.flights) > 0 && !g.flights[0].decodeEnd.After(t) {
		f := heap.Pop(&g.flights).(*flight)
		for _, h := range f.hashes {
			if g.held[h]--; g.held[h] <= 0 {
				delete(g.held, h)
			}
		}
	}
}

// preempt counts the requests running at t that held one of the freed
// blocks (of the part of their sequence computed by t). g.mu is held.
func (g *GPU) preempt(freed []BlockHash, t time.Time) {
	if len(freed) == 0 {
		return
	}
	set := make(map[BlockHash]bool, len(freed))
	for _, h := range freed {
		set[h] = true
	}
	for _, f := range g.flights {
		if f.preempted || !f.running(t) {
			continue
		}
		for _, h := range f.hashes[:min(f.tokens(t)/BlockSize, len(f.hashes))] {
			if set[h] {
				f.preempted = true
				g.preemptions++
				break
			}
		}
	}
}

// EngineState implements EngineReporter: the requests the model priced,
// placed on its timeline at now.
func (g *GPU) EngineState(now time.Time) EngineState {
	g.mu.Lock()
	defer g.mu.Unlock()
	capBlocks := g.cache.maxBlocks
	st := EngineState{CapacityBlocks: capBlocks, CapacityTokens: capBlocks * BlockSize, Preemptions: g.preemptions}
	shared := make(map[BlockHash]struct{})
	partialBlocks, partialTokens := 0, 0
	for _, f := range g.flights {
		switch {
		case now.Before(f.start):
			st.Waiting++
		case now.Before(f.decodeEnd):
			st.Running++
			n := f.tokens(now)
			full := min(n/BlockSize, len(f.hashes))
			for _, h := range f.hashes[:full] {
				shared[h] = struct{}{}
			}
			rest := n - full*BlockSize
			partialTokens += rest
			partialBlocks += (rest + BlockSize - 1) / BlockSize
		}
	}
	st.UsedBlocks = len(shared) + partialBlocks
	st.UsedTokens = len(shared)*BlockSize + partialTokens
	return st
}
