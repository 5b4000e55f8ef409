package engine

import dto "github.com/prometheus/client_model/go"

// SGLang's schedulers label their metrics model_name and engine_type. Later
// releases add tp_rank, pp_rank and moe_ep_rank. They add dp_rank when there
// is more than one data-parallel rank.
//
// Only a scheduler of attention-TP rank 0 reports, one per dp rank.
// --enable-metrics-for-all-schedulers makes every rank report the same state.
// So the series of one dp_rank are copies, and the largest stands for the
// rank.
//
// With priority scheduling, the series priority="" is the total. The
// priority="<n>" series are a breakdown of it, and are dropped.
var sglangSpec = spec{
	running:     "sglang:num_running_reqs",
	waiting:     "sglang:num_queue_reqs",
	usage:       []string{"sglang:token_usage"},
	engine:      sglangSchedulers,
	prefix:      sglangPrefix,
	preemptions: "sglang:num_retracted_requests_total",
}

var sglangSchedulers = fold{label: "dp_rank", copies: true, keep: noPriorityBreakdown}

func noPriorityBreakdown(m *dto.Metric) bool { return labelValue(m, "priority") == "" }

// sglangPrefix reads the scheduler's realtime_tokens_total. It counts as
// prefill is scheduled.
//
//   - mode prefill_cache counts the prompt tokens found in the radix cache.
//   - mode prefill_compute counts those computed.
//
// SGLang's cache_hit_rate gauge is cache / (cache + compute) over its log
// interval.
//
// Older releases lack realtime_tokens_total. There it reads the tokenizer
// manager's prompt_tokens_total and cached_tokens_total. Those count when a
// request finishes. They are summed over all their series, whatever the
// custom labels, is_streaming or cache_source. cached_tokens_total has no
// series until the first cache hit. So prompt tokens alone make the counters
// known.
func sglangPrefix(fams families) (hits, queries float64, known bool, err error) {
	var buf [8]engineValue
	cache, err := sglangCacheTokens.of(fams, "sglang:realtime_tokens_total", false, buf[:0])
	if err != nil {
		return 0, 0, false, err
	}
	hits = sum(cache)
	compute, err := sglangComputeTokens.of(fams, "sglang:realtime_tokens_total", false, buf[:0])
	if err != nil {
		return 0, 0, false, err
	}
	if len(cache) > 0 || len(compute) > 0 {
		return hits, hits + sum(compute), true, nil
	}

	tokenizer := fold{}
	prompt, err := tokenizer.of(fams, "sglang:prompt_tokens_total", false, buf[:0])
	if err != nil || len(prompt) == 0 {
		return 0, 0, false, err
	}
	queries = sum(prompt)
	cached, err := tokenizer.of(fams, "sglang:cached_tokens_total", false, buf[:0])
	if err != nil {
		return 0, 0, false, err
	}
	return sum(cached), queries, true, nil
}

var (
	sglangCacheTokens   = sglangSchedulers.withKeep(mode("prefill_cache"))
	sglangComputeTokens = sglangSchedulers.withKeep(mode("prefill_compute"))
)

func mode(want string) func(*dto.Metric) bool {
	return func(m *dto.Metric) bool { return labelValue(m, "mode") == want }
}

// withKeep is f keeping only the series both f.keep and keep accept.
func (f fold) withKeep(keep func(*dto.Metric) bool) fold {
	if outer := f.keep; outer != nil {
		f.keep = func(m *dto.Metric) bool { return outer(m) && keep(m) }
	} else {
		f.keep = keep
	}
	return f
}
