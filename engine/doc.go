// Package engine reads the load an instance's serving engine (vLLM, SGLang)
// reports on /metrics.
//
//   - Scraper fetches /metrics with a timeout and a body limit.
//   - Parse reads the Prometheus text format with prometheus/common's expfmt.
//   - Tracker turns successive samples into readings with rates.
//
// Every failure is an *Error. Its Reason is the label of
// tether_engine_scrape_errors_total.
//
// Only the lines of the families tether reads are handed to expfmt. A vLLM
// exposition is ~900 lines, nearly all histogram buckets. Skipping them makes
// a parse ~20 times cheaper (lines.go). The fuzz target checks that skipping
// changes no result of an exposition that parses whole.
//
// # What tether reads
//
// The names below were checked against the engines' own metrics code:
//
//   - vLLM: vllm/v1/metrics/loggers.py for the V1 engine (0.8, 0.10, 0.12)
//     and vllm/engine/metrics.py for the V0 engine (0.4, 0.5).
//   - SGLang: python/sglang/srt/metrics/collector.py, in releases before and
//     after realtime_tokens_total and the retraction counter appeared.
//     Later releases moved it to
//     python/sglang/srt/observability/metrics_collector.py. The labels are
//     those its scheduler and tokenizer manager give.
//
// Both engines publish through prometheus_client. The testdata expositions
// were rendered by it from those definitions (testdata/make_fixtures.py).
//
// vLLM labels its series with model_name and engine on V1, and model_name
// alone on V0. V1 has one series per data-parallel engine, all in the one
// exposition of an API server.
//
//	waiting    vllm:num_requests_waiting (gauge)
//	running    vllm:num_requests_running (gauge)
//	KV usage   vllm:kv_cache_usage_perc: gauge, 0..1, since 0.9.
//	           Else vllm:gpu_cache_usage_perc: V0 to 0.10, deprecated in
//	           0.9, gone from 0.12's default exposition.
//	prefix     vllm:prefix_cache_hits_total, vllm:prefix_cache_queries_total:
//	           counters, in tokens, since 0.9.
//	           Else vllm:gpu_prefix_cache_hits_total and _queries_total:
//	           V1 0.8 to 0.10, deprecated in 0.9.
//	           The first 0.8 releases counted blocks, not tokens.
//	           V0 publishes none, so PrefixKnown is false.
//	           Its gauge gpu_prefix_cache_hit_rate is not read.
//	preemption vllm:num_preemptions_total (counter)
//	capacity   vllm:cache_config_info: num_gpu_blocks × block_size.
//	           It is an info gauge of value 1, without model_name.
//	           Its labels are the CacheConfig as Python's str() writes it.
//	           With data-parallel engines, each engine's series carries
//	           the API server's num_gpu_blocks, the sum over its engines.
//	           The series are copies, so they are not added.
//
// SGLang labels its series with model_name and engine_type. Later releases
// add tp_rank, pp_rank and moe_ep_rank. They add dp_rank when data-parallel,
// and priority with priority scheduling. SGLang always renders through
// prometheus_client's multiprocess collector, so there are no _created
// series. Older prometheus_client releases write every HELP as
// "Multiprocess metric".
//
//	waiting    sglang:num_queue_reqs (gauge)
//	running    sglang:num_running_reqs (gauge)
//	KV usage   sglang:token_usage: gauge, used / total tokens of the KV pool.
//	           With hybrid pools it is the fullest pool.
//	prefix     sglang:realtime_tokens_total: {mode="prefill_cache"} as hits,
//	           {mode="prefill_compute"} + {mode="prefill_cache"} as queries.
//	           It is the scheduler's counter, updated as prefill is scheduled.
//	           Releases without it: the tokenizer manager's
//	           sglang:cached_tokens_total as hits and
//	           sglang:prompt_tokens_total as queries.
//	           Those count when a request finishes.
//	           The gauge sglang:cache_hit_rate is the same ratio over one
//	           log interval. It is never used as a counter.
//	preemption sglang:num_retracted_requests_total (counter).
//	           Releases before it have only the gauge num_retracted_reqs:
//	           Preemptions is 0.
//	capacity   sglang:max_total_num_tokens: summed over dp ranks.
//	           It is a gauge of the tokens in one scheduler's KV pool,
//	           set once at start.
//	           Releases without it publish the figure only in
//	           /get_server_info's max_total_num_tokens.
//	           tether does not ask it, so CacheTokens is 0.
//
// The capacity, Sample.CacheTokens, is parsed apart from the load. It never
// refuses a sample. It stays 0, unknown, on any of these:
//
//   - a missing family or label;
//   - a label that is no integer, such as "None" before vLLM sets it;
//   - zero, a negative value, a fraction, or more than 2^40 tokens;
//   - a malformed line of its family.
//
// # Counter names
//
// client_python exposes a counter vllm:prefix_cache_hits in two ways.
//
//   - In the text format, as a family vllm:prefix_cache_hits_total, which its
//     # TYPE line names, plus a gauge family vllm:prefix_cache_hits_created.
//   - In OpenMetrics, the # TYPE line names vllm:prefix_cache_hits over the
//     samples vllm:prefix_cache_hits_total and _created. expfmt's text parser
//     reads those as untyped families named after the samples.
//
// So counters are looked up by their sample name, ending _total, as counter,
// gauge or untyped. _created series are ignored. The Scraper asks for the
// text format.
//
// # Data-parallel engines
//
// An exposition can hold several engines. vLLM's are told apart by the label
// engine, SGLang's by dp_rank.
//
//   - Counts are summed over the engines: waiting, running, the counters.
//   - KV usage is the mean, as it is a share of each engine's own cache.
//   - Within one SGLang dp rank, series that differ in tp_rank, pp_rank or
//     moe_ep_rank are the same scheduler state reported by several ranks
//     (--enable-metrics-for-all-schedulers). The largest stands for the rank.
//   - priority="<n>" series break down the priority="" total. They are
//     dropped.
//
// Sample.Engines counts the engines of the running gauge.
//
// # Bad input
//
// Nothing here panics on what an instance serves, and no garbage reaches a
// reading. Each failure has its Reason:
//
//   - ReasonBadValue refuses the whole sample. It is a value tether reads that
//     is NaN, infinite or negative, a KV usage above 1, or a queue of more
//     than a billion requests. Families tether ignores may legitimately be
//     NaN and are not checked.
//   - ReasonMissing: the exposition lacks the kind's waiting or running gauge.
//     Without a usage gauge, KVKnown is false instead.
//   - ReasonParse: the body is not the text format. Examples are an HTML error
//     page, JSON, or a body cut inside a line. A malformed line of a family
//     not read is not looked at.
//   - ReasonStatus: an answer other than 200.
//   - ReasonTooLarge: a body over the limit. It is read through
//     io.LimitReader(MaxBody+1) and refused before it is parsed.
//   - ReasonTimeout: no whole answer within the timeout.
//   - ReasonConnect: a refused, reset or cut connection.
//
// # Rates and staleness
//
// The Tracker keeps each instance's last sample and rates the next one
// against it. A rate is (counter now − counter then) / the time between
// them. That time may span failed scrapes.
//
// A sample has no rates when:
//
//   - it is the first of its instance;
//   - its engine count or prefix-counter availability changed;
//   - it was taken no later than the one before, which stays the reference.
//
// A counter lower than before is an engine restart. The reading comes with
// ReasonCounterReset and no rates, and becomes the new reference. Rates are
// never negative.
//
// A reading carries the time it was taken, EngineReading.At, on the scraping
// replica's clock. The Tracker never expires a reading; its users do. A
// reading older than engines.staleness is not used, and its instance's engine
// metrics are not exported.
package engine
