package engine

// vLLM labels every engine metric model_name and engine. One API server
// serves one series per data-parallel engine. V0, before 0.8, had no engine
// label: one series, one engine.
var vllmSpec = spec{
	running: "vllm:num_requests_running",
	waiting: "vllm:num_requests_waiting",
	// kv_cache_usage_perc is there since 0.9. gpu_cache_usage_perc is there
	// from V0 to 0.10. It is deprecated in 0.9 and gone from 0.12's default
	// exposition.
	usage:       []string{"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"},
	engine:      vllmEngines,
	prefix:      vllmPrefix,
	preemptions: "vllm:num_preemptions_total",
}

var vllmEngines = fold{label: "engine"}

// vllmPrefix reads prefix_cache_queries and _hits, in tokens, since 0.9.
// Else it reads the gpu_prefix_cache_ pair of 0.8 to 0.10. That pair counts
// blocks in the first 0.8 releases, and tokens after. V0 has neither. Its
// only prefix figure is the gauge gpu_prefix_cache_hit_rate, which is not a
// counter and is not read.
func vllmPrefix(fams families) (hits, queries float64, known bool, err error) {
	for _, pair := range [...][2]string{
		{"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"},
		{"vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total"},
	} {
		var buf [8]engineValue
		q, err := vllmEngines.of(fams, pair[1], false, buf[:0])
		if err != nil {
			return 0, 0, false, err
		}
		if len(q) == 0 {
			continue
		}
		queries = sum(q)
		h, err := vllmEngines.of(fams, pair[0], false, buf[:0])
		if err != nil {
			return 0, 0, false, err
		}
		return sum(h), queries, true, nil
	}
	return 0, 0, false, nil
}
