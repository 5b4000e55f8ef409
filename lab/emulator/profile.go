package emulator

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"time"
)

// Profile holds the cost figures of one GPU serving a model with the shape of
// an 8B Llama (hidden 4096, 32 layers, 8 KV heads, bf16). The figures come
// from ../shared/calibration/ (see the package README for the derivation).
type Profile struct {
	// Name is the profile's name, as --profile takes it.
	Name string
	// Estimate is true when the figures are derived rather than measured.
	Estimate bool
	// Source says where the figures come from, in one line.
	Source string

	// Prefill of n uncached prompt tokens after c cached ones takes
	//
	//	PrefillFloor + n·PrefillPerToken + (n·c + n²/2)·AttentionPerPair + c·CachedPerToken
	//
	// and never less than one decode step at batch 1 with the same context
	// (a forward pass of even one token costs that much). n·c + n²/2 counts
	// the attention pairs: each new token attends to the cached tokens and
	// to the new tokens before it. The last three figures are nanoseconds.
	PrefillFloor     time.Duration
	PrefillPerToken  float64 // ns per uncached token: the dense layers, compute-bound
	AttentionPerPair float64 // ns per (new token, earlier token) pair, compute-bound
	CachedPerToken   float64 // ns per cached token read by a prefill

	// Decode is the time of one decode step (one output token for every
	// sequence in the batch) by batch size and context.
	Decode DecodeTable

	// KVCapacityTokens is the KV cache a serving engine keeps on this GPU:
	// (memory × 0.9 − 16 GB of weights) / 128 KiB per token.
	KVCapacityTokens int
}

// DecodeTable holds measured decode step times. Step interpolates linearly
// between the measured batch sizes and contexts, and extrapolates linearly
// beyond them from the nearest two.
type DecodeTable struct {
	Batches  []int       // ascending batch sizes, the first one 1
	Contexts []int       // ascending contexts (tokens per sequence)
	StepMs   [][]float64 // StepMs[i][j]: one step at Contexts[i] and Batches[j], milliseconds
}

// Step is the time of one decode step for batch sequences of context tokens
// each. batch is at least 1 and context at least 0.
func (t DecodeTable) Step(batch, context int) time.Duration {
	b := float64(max(batch, 1))
	c := float64(max(context, 0))
	byContext := make([]float64, len(t.Contexts))
	for i, row := range t.StepMs {
		byContext[i] = interpolate(t.Batches, row, b)
	}
	ms := interpolate(t.Contexts, byContext, c)
	return time.Duration(max(ms, 0) * float64(time.Millisecond))
}

// interpolate returns y at x on the polyline through (xs[i], ys[i]),
// extended beyond its ends by its first and last segments.
func interpolate(xs []int, ys []float64, x float64) float64 {
	if len(xs) == 1 {
		return ys[0]
	}
	i := 1
	for i < len(xs)-1 && x > float64(xs[i]) {
		i++
	}
	x0, x1 := float64(xs[i-1]), float64(xs[i])
	return ys[i-1] + (x-x0)*(ys[i]-ys[i-1])/(x1-x0)
}

// Prefill is the time to prefill uncached tokens after cached ones (see
// Profile).
func (p Profile) Prefill(uncached, cached int) time.Duration {
	n, c := float64(max(uncached, 0)), float64(max(cached, 0))
	ns := float64(p.PrefillFloor) + n*p.PrefillPerToken + (n*c+n*n/2)*p.AttentionPerPair + c*p.CachedPerToken
	return max(time.Duration(ns), p.Decode.Step(1, uncached+cached))
}

// Validate reports the first problem with the profile.
func (p Profile) Validate() error {
	if p.Name == "" {
		return fmt.Errorf("emulator: profile has no name")
	}
	for _, f := range []struct {
		name string
		v    float64
	}{
		{"prefill_floor", float64(p.PrefillFloor)},
		{"prefill_per_token", p.PrefillPerToken},
		{"attention_per_pair", p.AttentionPerPair},
		{"cached_per_token", p.CachedPerToken},
	} {
		if math.IsNaN(f.v) || math.IsInf(f.v, 0) || f.v < 0 {
			return fmt.Errorf("emulator: profile %q: %s %v: want a finite number ≥ 0", p.Name, f.name, f.v)
		}
	}
	t := p.Decode
	if len(t.Batches) == 0 || len(t.Contexts) == 0 || len(t.StepMs) != len(t.Contexts) {
		return fmt.Errorf("emulator: profile %q: decode table needs batches, contexts and one row of steps per context", p.Name)
	}
	if t.Batches[0] != 1 || !strictlyAscending(t.Batches) || !strictlyAscending(t.Contexts) {
		return fmt.Errorf("emulator: profile %q: decode batches %v and contexts %v must ascend strictly, batches from 1", p.Name, t.Batches, t.Contexts)
	}
	for i, row := range t.StepMs {
		if len(row) != len(t.Batches) {
			return fmt.Errorf("emulator: profile %q: decode row %d has %d steps for %d batch sizes", p.Name, i, len(row), len(t.Batches))
		}
		for _, v := range row {
			if math.IsNaN(v) || math.IsInf(v, 0) || v <= 0 {
				return fmt.Errorf("emulator: profile %q: decode step %v ms: want a finite number > 0", p.Name, v)
			}
		}
	}
	if p.KVCapacityTokens < BlockSize {
		return fmt.Errorf("emulator: profile %q: kv_capacity_tokens %d: want at least %d", p.Name, p.KVCapacityTokens, BlockSize)
	}
	return nil
}

func strictlyAscending(xs []int) bool {
	for i := 1; i < len(xs); i++ {
		if xs[i] <= xs[i-1] {
			return false
		}
	}
	return true
}

// The H200 figures. Prefill: a least-squares fit to the compute-bound rows of
// h200-llama8b-shape.json (misses at 8k and 16k prefix, and the four
// CUDA-graphed hits of 256 new tokens); it reproduces those six figures
// within 1% (16k miss 602.3 ms, hit 25.2 ms: ratio 23.9). Decode: the
// CUDA-graphed step times of h200-llama8b-shape-batching.json as measured.
const (
	h200PrefillFloor     = 6014 * time.Microsecond
	h200PrefillPerToken  = 25943.0 // ns
	h200AttentionPerPair = 1.18919 // ns
	h200CachedPerToken   = 455.78  // ns
)

var (
	decodeBatches  = []int{1, 8, 32, 64}
	decodeContexts = []int{2048, 8192}
	h200DecodeMs   = [][]float64{
		{8.442, 9.376, 11.175, 13.402},  // context 2,048
		{8.671, 10.793, 16.802, 24.680}, // context 8,192
	}
)

// Datasheet ratios of an H200 to an A100 80GB: dense bf16 989 vs 312
// TFLOP/s (compute-bound work: prefill) and HBM 4.8 vs 2.0 TB/s
// (memory-bound work: decode, the per-forward floor, reading cached KV).
const (
	a100ComputeRatio = 989.0 / 312.0
	a100MemoryRatio  = 4.8 / 2.0
)

// kvCapacity is the KV cache of a card with mem bytes: 90% of the memory
// (vLLM's default gpu_memory_utilization) less 16 GB of bf16 weights, at
// 128 KiB per token (2 × 32 layers × 8 KV heads × 128 × 2 bytes).
func kvCapacity(mem float64) int {
	return int((mem*0.9 - 16e9) / (128 << 10))
}

// ProfileH200 is the measured profile: one NVIDIA H200 (141 GB), bf16,
// 8B-Llama shape. KV cache about 846k tokens.
func ProfileH200() Profile {
	rows := make([][]float64, len(h200DecodeMs))
	for i, r := range h200DecodeMs {
		rows[i] = slices.Clone(r)
	}
	return Profile{
		Name:             "h200",
		Source:           "measured on one NVIDIA H200, bf16, 8B-Llama shape (../shared/calibration)",
		PrefillFloor:     h200PrefillFloor,
		PrefillPerToken:  h200PrefillPerToken,
		AttentionPerPair: h200AttentionPerPair,
		CachedPerToken:   h200CachedPerToken,
		Decode:           DecodeTable{Batches: slices.Clone(decodeBatches), Contexts: slices.Clone(decodeContexts), StepMs: rows},
		KVCapacityTokens: kvCapacity(141e9),
	}
}

// ProfileA100 is the default profile, an A100 80GB. Its figures are
// ESTIMATES, NOT MEASUREMENTS: the measured H200 figures scaled by the
// datasheet ratios, compute-bound work (prefill per token and per attention
// pair) 989/312 ≈ 3.17× slower, memory-bound work (decode steps, the prefill
// floor, reading cached KV) 4.8/2.0 = 2.4× slower. KV cache about 427k tokens.
func ProfileA100() Profile {
	p := ProfileH200()
	p.Name = "a100"
	p.Estimate = true
	p.Source = "ESTIMATE for an A100 80GB: the measured H200 figures scaled by datasheet ratios (compute 989/312, memory bandwidth 4.8/2.0), not measured"
	p.PrefillFloor = time.Duration(float64(p.PrefillFloor) * a100MemoryRatio)
	p.PrefillPerToken *= a100ComputeRatio
	p.AttentionPerPair *= a100ComputeRatio
	p.CachedPerToken *= a100MemoryRatio
	for _, row := range p.Decode.StepMs {
		for j := range row {
			row[j] *= a100MemoryRatio
		}
	}
	p.KVCapacityTokens = kvCapacity(80e9)
	return p
}

// ProfileNames lists the profiles ProfileByName knows.
func ProfileNames() []string { return []string{"a100", "h200"} }

// ProfileByName returns the profile called name ("a100" or "h200", any case).
func ProfileByName(name string) (Profile, error) {
	switch strings.ToLower(name) {
	case "a100":
		return ProfileA100(), nil
	case "h200":
		return ProfileH200(), nil
	}
	return Profile{}, fmt.Errorf("emulator: unknown profile %q: want one of %s", name, strings.Join(ProfileNames(), ", "))
}
