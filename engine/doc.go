// Package engine reads what an instance's serving engine (vLLM, SGLang)
// says about its load on /metrics: it scrapes with a timeout and a body
// limit (Scraper), parses the Prometheus text format with prometheus/common's
// expfmt (Parse), and turns successive samples into readings with rates
// (Tracker). Every failure is an *Error whose Reason is the label of
// tether_engine_scrape_errors_total.
//
// Only the lines of the families tether reads are handed to expfmt: a vLLM
// exposition is ~900 lines, nearly all histogram buckets, and skipping them
// makes a parse ~20 times cheaper (lines.go; the fuzz target checks that it
// changes no result of an exposition that parses whole).
//
// # What tether reads
//
// The names below were checked against the engines' own metrics code:
// vLLM's vllm/v1/metrics/loggers.py (the 0.8 V1 engine, 0.10 and 0.12) and
// vllm/engine/metrics.py (the V0 engine, as of 0.4/0.5); SGLang's
// python/sglang/srt/metrics/collector.py (releases before and after
// realtime_tokens_total and the retraction counter appeared) and
// python/sglang/srt/observability/metrics_collector.py (where it moved
// since), with the labels its scheduler and tokenizer manager give. Both engines publish
// through prometheus_client; the testdata expositions were rendered by it
// from those definitions (testdata/make_fixtures.py).
//
// vLLM, labels model_name and engine (V1; one series per data-parallel
// engine, all in the one exposition of an API server), model_name alone (V0):
//
//	waiting    vllm:num_requests_waiting (gauge)
//	running    vllm:num_requests_running (gauge)
//	KV usage   vllm:kv_cache_usage_perc (gauge, 0..1; since 0.9), else
//	           vllm:gpu_cache_usage_perc (V0 to 0.10, deprecated in 0.9;
//	           gone from 0.12's default exposition)
//	prefix     vllm:prefix_cache_hits_total, vllm:prefix_cache_queries_total
//	           (counters, tokens; since 0.9), else
//	           vllm:gpu_prefix_cache_hits_total and _queries_total (V1 0.8 to
//	           0.10, deprecated in 0.9; the first 0.8 releases counted
//	           blocks, not tokens).
//	           V0 publishes none (only the gauge gpu_prefix_cache_hit_rate,
//	           not read): PrefixKnown is false.
//	preemption vllm:num_preemptions_total (counter)
//	capacity   vllm:cache_config_info (an info gauge, value 1, labels the
//	           CacheConfig as Python's str() writes it, no model_name):
//	           num_gpu_blocks × block_size. With data-parallel engines each
//	           engine's series carries the API server's num_gpu_blocks, the
//	           sum over its engines: the series are copies, not added.
//
// SGLang, labels model_name and engine_type, and in later releases tp_rank,
// pp_rank, moe_ep_rank, dp_rank (when data-parallel), priority (with
// priority scheduling); always rendered by prometheus_client's
// multiprocess collector (no _created series; older prometheus_client
// releases write every HELP as "Multiprocess metric"):
//
//	waiting    sglang:num_queue_reqs (gauge)
//	running    sglang:num_running_reqs (gauge)
//	KV usage   sglang:token_usage (gauge: used / total tokens of the KV
//	           pool; with hybrid pools the fullest)
//	prefix     sglang:realtime_tokens_total{mode="prefill_cache"} as hits and
//	           {mode="prefill_compute"} + {mode="prefill_cache"} as queries
//	           (the scheduler's counter, updated as prefill is scheduled;
//	           the cache_hit_rate gauge is the same ratio over one log
//	           interval); releases without it: the tokenizer manager's
//	           sglang:cached_tokens_total as hits and
//	           sglang:prompt_tokens_total as queries (counted when a request
//	           finishes). The gauge sglang:cache_hit_rate is never used as a
//	           counter.
//	preemption sglang:num_retracted_requests_total (counter; releases before
//	           it have only the gauge num_retracted_reqs: Preemptions 0)
//	capacity   sglang:max_total_num_tokens (gauge, tokens of one scheduler's
//	           KV pool, set once at start): summed over dp ranks. Releases
//	           without it publish the figure only in /get_server_info's
//	           max_total_num_tokens, which tether does not ask: CacheTokens 0.
//
// The capacity (Sample.CacheTokens) is parsed apart from the load and never
// refuses a sample: a missing family or label, a label that is no integer
// ("None" before vLLM sets it), zero, a negative value, a fraction or one
// past 2^40 tokens, or a malformed line of its family leave it 0, unknown.
//
// # Counter names
//
// client_python exposes a counter vllm:prefix_cache_hits in the text format
// as a family vllm:prefix_cache_hits_total (that is what its # TYPE line
// says) plus a gauge family vllm:prefix_cache_hits_created; in OpenMetrics
// the # TYPE line names vllm:prefix_cache_hits over samples
// vllm:prefix_cache_hits_total and _created, which expfmt's text parser reads
// as untyped families named after the samples. Counters are therefore looked
// up by their sample name, ending _total, as counter, gauge or untyped;
// _created series are ignored. The Scraper asks for the text format.
//
// # Data-parallel engines
//
// An exposition can hold several engines. vLLM's are told apart by the label
// engine, SGLang's by dp_rank. Counts (waiting, running, the counters) are
// summed over the engines; KV usage, a share of each engine's own cache, is
// their mean. Within one SGLang dp rank, series that differ in tp_rank,
// pp_rank or moe_ep_rank are the same scheduler state reported by several
// ranks (--enable-metrics-for-all-schedulers), so the largest stands for the
// rank, and priority="<n>" series, a breakdown of the priority="" total, are
// dropped. Sample.Engines counts the engines of the running gauge.
//
// # Bad input
//
// Nothing here panics on what an instance serves, and no garbage reaches a
// reading: a value tether reads (not the families it ignores, which may
// legitimately be NaN) that is NaN, infinite or negative, a KV usage above 1,
// or a queue of more than a billion requests refuses the whole sample
// (ReasonBadValue); an exposition without the kind's waiting or running gauge
// is ReasonMissing (without a usage gauge, KVKnown is false). Anything that is
// not the text format (an HTML error page, JSON, a body cut inside a line) is
// ReasonParse; a malformed line of a family not read is not looked at. An
// answer other than 200 is ReasonStatus; a body over the limit ReasonTooLarge
// (read through io.LimitReader(MaxBody+1), and refused before it is parsed);
// no whole answer within the timeout ReasonTimeout; a refused, reset or cut
// connection ReasonConnect.
//
// # Rates and staleness
//
// The Tracker keeps each instance's last sample and rates the next one
// against it: (counter now − counter then) / the time between them, whatever
// that time (after failed scrapes it spans them). The first sample of an
// instance has no rates, nor has one whose engine count or prefix-counter
// availability changed, nor one taken no later than the one before (which
// stays the reference). A counter lower than before is an engine restart: the
// reading comes with ReasonCounterReset and no rates, and becomes the new
// reference; rates are never negative. A reading carries the time it was
// taken (EngineReading.At, the scraping replica's clock); the Tracker never
// expires one. Its users do: a reading older than engines.staleness is not
// used, and its instance's engine metrics are not exported.
package engine
