package engine

import (
	"math"
	"strconv"
)

// maxCacheTokens bounds a KV cache's capacity. No instance holds a trillion
// tokens of KV cache, so a larger figure is garbage, not capacity.
const maxCacheTokens int64 = 1 << 40

// The capacity is read apart from the load. Its lines, capacityNames, are
// parsed on their own, after the sample. Anything wrong with them makes the
// capacity 0, unknown: a malformed line, a label that is no number, zero, a
// negative or huge value. It never refuses the sample. The capacity is a
// static figure a router can do without, not a reason to drop a reading.

// vllmCapacity reads vllm:cache_config_info. The capacity is
// num_gpu_blocks × block_size.
//
// It is an info gauge, always 1. Its labels are vLLM's CacheConfig, each
// value as Python's str() writes it (metrics_info in vllm/config/cache.py).
// A value is "None" before the engine sets it.
//
// Several data-parallel engines give one series each, told apart by the
// label engine. Each carries the API server's num_gpu_blocks, which is
// already the sum over its engines. See wait_for_engine_startup in
// vllm/v1/engine/utils.py: "Sum values from all engines in DP case". So the
// series are copies, and the largest stands for the instance.
//
// Newer releases also carry kv_cache_size_tokens. It is per engine and aware
// of hybrid models' KV groups. It is not read.
func vllmCapacity(fams families) int {
	var best int64
	for _, m := range fams["vllm:cache_config_info"].GetMetric() {
		blocks, ok := positiveInt(labelValue(m, "num_gpu_blocks"))
		if !ok {
			continue
		}
		size, ok := positiveInt(labelValue(m, "block_size"))
		if !ok || blocks > maxCacheTokens/size {
			continue
		}
		best = max(best, blocks*size)
	}
	return tokens(best)
}

// sglangCapacity reads sglang:max_total_num_tokens. It is the gauge of the KV
// pool's size in tokens, which each scheduler sets once at start. It is among
// the constants of SGLang's metrics collector. Older releases publish it only
// in /get_server_info, and then the capacity is unknown.
//
// Each data-parallel rank has a pool of its own, so the ranks add up. Within
// a rank, the series of its TP, PP and EP ranks are copies, as for the load
// gauges. One unusable series makes the whole capacity unknown, because a
// sum without a rank would understate it.
func sglangCapacity(fams families) int {
	var buf [8]engineValue
	ranks, err := sglangSchedulers.of(fams, "sglang:max_total_num_tokens", false, buf[:0])
	if err != nil {
		return 0
	}
	var total int64
	for _, r := range ranks {
		if r.v < 1 || r.v != math.Trunc(r.v) || r.v > float64(maxCacheTokens-total) {
			return 0
		}
		total += int64(r.v)
	}
	return tokens(total)
}

// positiveInt parses a label value written by Python's str() of an int.
func positiveInt(s string) (int64, bool) {
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil || v < 1 || v > maxCacheTokens {
		return 0, false
	}
	return v, true
}

// tokens is v as an int, 0 when it is out of range.
func tokens(v int64) int {
	if v < 1 || v > maxCacheTokens || v > math.MaxInt {
		return 0
	}
	return int(v)
}
