package emulator

import (
	"bytes"
	"math"
	"net/http"
	"slices"
	"strconv"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"
)

// pathMetrics is where an instance serves its engine's metrics.
const pathMetrics = "/metrics"

// The metrics of GET /metrics, as the engine named by Instance.Engine
// exports them: vLLM V1's (vllm/v1/metrics/loggers.py) or SGLang's
// (python/sglang/srt/metrics/collector.py), with their names, types, labels
// and bucket lists; the help texts are the emulator's own words. Every
// instance has its own registry. The values come from the handler's
// counters and the latency model's EngineState at the time of the scrape;
// see the package README for how each is computed.

// Bucket upper bounds, in seconds, of the latency histograms: those vLLM V1
// and SGLang (its defaults) declare.
func vllmTTFTBuckets() []float64 {
	return []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80,
		160, 640, 2560}
}

func vllmE2EBuckets() []float64 {
	return []float64{0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920, 7680}
}

func sglangTTFTBuckets() []float64 {
	return []float64{0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400}
}

func sglangE2EBuckets() []float64 {
	return []float64{0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400}
}

// engineMetrics is one instance's /metrics: its registry and the
// histograms the handler observes.
type engineMetrics struct {
	registry  *prometheus.Registry
	ttft, e2e *histogram
}

// snapshot is what one scrape reports.
type snapshot struct {
	state                          EngineState
	prefixQueries, prefixHits      int64
	promptTokens, generationTokens int64
	finished                       [numFinishReasons]int64
	lastHitRate                    float64
	ttft, e2e                      histogramSnapshot
}

func (s *snapshot) kvUsage(tokens bool) float64 {
	used, capacity := s.state.UsedBlocks, s.state.CapacityBlocks
	if tokens {
		used, capacity = s.state.UsedTokens, s.state.CapacityTokens
	}
	if capacity <= 0 {
		return 0
	}
	return min(float64(used)/float64(capacity), 1)
}

func (s *snapshot) finishedAll() int64 {
	var n int64
	for _, v := range s.finished {
		n += v
	}
	return n
}

// family is one metric family of the exposition.
type family struct {
	desc *prometheus.Desc
	kind familyKind
	typ  prometheus.ValueType               // kindValue
	val  func(*snapshot) float64            // kindValue
	hist func(*snapshot) *histogramSnapshot // kindHistogram
	info func(*snapshot) []string           // kindInfo: the values of desc's labels, in order
}

type familyKind int

const (
	kindValue     familyKind = iota // one counter or gauge sample
	kindByReason                    // one counter sample per finished_reason
	kindHistogram                   // one histogram
	kindInfo                        // one gauge sample of 1 whose labels carry the values
)

func newEngineMetrics(h *handler) *engineMetrics {
	var fams []family
	m := &engineMetrics{registry: prometheus.NewRegistry()}
	if h.engine == EngineSGLang {
		fams = sglangFamilies(h.model)
		m.ttft, m.e2e = newHistogram(sglangTTFTBuckets()), newHistogram(sglangE2EBuckets())
	} else {
		fams = vllmFamilies(h.model)
		m.ttft, m.e2e = newHistogram(vllmTTFTBuckets()), newHistogram(vllmE2EBuckets())
	}
	// The families are fixed and distinct: registering cannot fail.
	m.registry.MustRegister(&collector{h: h, fams: fams})
	return m
}

func value(d *prometheus.Desc, typ prometheus.ValueType, val func(*snapshot) float64) family {
	return family{desc: d, kind: kindValue, typ: typ, val: val}
}

func counterOf(v int64) float64 { return float64(v) }

// vllmFamilies are vLLM V1's metrics, labelled model_name and engine="0"
// (one engine core), as vLLM's Prometheus logger labels them.
func vllmFamilies(model string) []family {
	labels := prometheus.Labels{"model_name": model, "engine": "0"}
	d := func(name, help string, variable ...string) *prometheus.Desc {
		return prometheus.NewDesc(name, help, variable, labels)
	}
	g, c := prometheus.GaugeValue, prometheus.CounterValue
	return []family{
		value(d("vllm:num_requests_running", "Requests in the running batch: being prefilled or decoded."), g,
			func(s *snapshot) float64 { return float64(s.state.Running) }),
		value(d("vllm:num_requests_waiting", "Requests admitted and queued, waiting for the scheduler."), g,
			func(s *snapshot) float64 { return float64(s.state.Waiting) }),
		value(d("vllm:kv_cache_usage_perc", "Share of the KV cache blocks held by running requests, 0 to 1 (cached blocks nobody holds are free)."), g,
			func(s *snapshot) float64 { return s.kvUsage(false) }),
		value(d("vllm:prefix_cache_queries_total", "Prefix cache lookups, counted in prompt tokens looked up."), c,
			func(s *snapshot) float64 { return counterOf(s.prefixQueries) }),
		value(d("vllm:prefix_cache_hits_total", "Prefix cache hits, counted in prompt tokens served from the cache."), c,
			func(s *snapshot) float64 { return counterOf(s.prefixHits) }),
		value(d("vllm:num_preemptions_total", "Running requests the engine preempted, since it started."), c,
			func(s *snapshot) float64 { return counterOf(s.state.Preemptions) }),
		value(d("vllm:prompt_tokens_total", "Prompt (prefill) tokens processed."), c,
			func(s *snapshot) float64 { return counterOf(s.promptTokens) }),
		value(d("vllm:generation_tokens_total", "Tokens generated."), c,
			func(s *snapshot) float64 { return counterOf(s.generationTokens) }),
		{desc: d("vllm:request_success_total", "Requests the engine finished, by why they finished.", "finished_reason"), kind: kindByReason},
		{desc: d("vllm:time_to_first_token_seconds", "Seconds from a request's arrival to its first token."), kind: kindHistogram,
			hist: func(s *snapshot) *histogramSnapshot { return &s.ttft }},
		{desc: d("vllm:e2e_request_latency_seconds", "Seconds from a request's arrival to its last token."), kind: kindHistogram,
			hist: func(s *snapshot) *histogramSnapshot { return &s.e2e }},
		{desc: prometheus.NewDesc("vllm:cache_config_info", "The engine's KV cache configuration, in the labels.", cacheConfigLabels, nil),
			kind: kindInfo, info: cacheConfigValues},
	}
}

// cacheConfigLabels are the labels of vllm:cache_config_info: fields of
// vLLM's CacheConfig (metrics_info in vllm/config/cache.py writes them all)
// and engine, without model_name, as vLLM labels it.
var cacheConfigLabels = []string{
	"block_size", "cache_dtype", "calculate_kv_scales", "cpu_offload_gb", "enable_prefix_caching", "engine",
	"gpu_memory_utilization", "is_attention_free", "num_cpu_blocks", "num_gpu_blocks", "num_gpu_blocks_override",
	"prefix_caching_hash_algo", "sliding_window", "swap_space",
}

// cacheConfigValues are the values of cacheConfigLabels, as Python's str()
// writes vLLM's: num_gpu_blocks is the KV cache's capacity in 16-token
// blocks, "None" for a model without cache (Fixed), as vLLM's is before it
// has measured its memory.
func cacheConfigValues(s *snapshot) []string {
	blocks, caching := "None", "False"
	if s.state.CapacityBlocks > 0 {
		blocks, caching = strconv.Itoa(s.state.CapacityBlocks), "True"
	}
	return []string{
		strconv.Itoa(BlockSize), "auto", "False", "0", caching, "0",
		"0.9", "False", "None", blocks, "None",
		"sha256", "None", "4",
	}
}

// sglangFamilies are SGLang's metrics: the scheduler's, labelled
// model_name, engine_type="unified", tp_rank="0" and pp_rank="0", and the
// tokenizer manager's, labelled model_name, as SGLang labels them.
func sglangFamilies(model string) []family {
	sched := prometheus.Labels{"model_name": model, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
	tok := prometheus.Labels{"model_name": model}
	ds := func(name, help string) *prometheus.Desc { return prometheus.NewDesc(name, help, nil, sched) }
	dt := func(name, help string) *prometheus.Desc { return prometheus.NewDesc(name, help, nil, tok) }
	g, c := prometheus.GaugeValue, prometheus.CounterValue
	return []family{
		value(ds("sglang:num_running_reqs", "Requests in the running batch."), g,
			func(s *snapshot) float64 { return float64(s.state.Running) }),
		value(ds("sglang:num_queue_reqs", "Requests in the waiting queue."), g,
			func(s *snapshot) float64 { return float64(s.state.Waiting) }),
		value(ds("sglang:num_used_tokens", "KV cache tokens held by running requests."), g,
			func(s *snapshot) float64 { return float64(min(s.state.UsedTokens, s.state.CapacityTokens)) }),
		value(ds("sglang:token_usage", "Share of the KV cache token pool held by running requests, 0 to 1 (evictable cached tokens are free)."), g,
			func(s *snapshot) float64 { return s.kvUsage(true) }),
		value(ds("sglang:max_total_num_tokens", "Tokens the KV cache pool holds at most."), g,
			func(s *snapshot) float64 { return float64(s.state.CapacityTokens) }),
		value(ds("sglang:cache_hit_rate", "Prefix cache hit rate of the latest prefill: cached tokens over its prompt tokens."), g,
			func(s *snapshot) float64 { return s.lastHitRate }),
		value(ds("sglang:num_retracted_requests_total", "Running requests retracted (preempted), since the start."), c,
			func(s *snapshot) float64 { return counterOf(s.state.Preemptions) }),
		value(dt("sglang:prompt_tokens_total", "Prompt (prefill) tokens processed."), c,
			func(s *snapshot) float64 { return counterOf(s.promptTokens) }),
		value(dt("sglang:generation_tokens_total", "Tokens generated."), c,
			func(s *snapshot) float64 { return counterOf(s.generationTokens) }),
		value(dt("sglang:cached_tokens_total", "Prompt tokens served from the prefix cache."), c,
			func(s *snapshot) float64 { return counterOf(s.prefixHits) }),
		value(dt("sglang:num_requests_total", "Requests finished, aborted ones included."), c,
			func(s *snapshot) float64 { return counterOf(s.finishedAll()) }),
		value(dt("sglang:num_aborted_requests_total", "Requests aborted (the client left)."), c,
			func(s *snapshot) float64 { return counterOf(s.finished[finishAbortIndex]) }),
		{desc: dt("sglang:time_to_first_token_seconds", "Seconds from a request's arrival to its first token."), kind: kindHistogram,
			hist: func(s *snapshot) *histogramSnapshot { return &s.ttft }},
		{desc: dt("sglang:e2e_request_latency_seconds", "Seconds from a request's arrival to its last token."), kind: kindHistogram,
			hist: func(s *snapshot) *histogramSnapshot { return &s.e2e }},
	}
}

// collector reads one snapshot of the handler per scrape.
type collector struct {
	h    *handler
	fams []family
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, f := range c.fams {
		ch <- f.desc
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	s := c.h.snapshot()
	for _, f := range c.fams {
		switch f.kind {
		case kindValue:
			ch <- prometheus.MustNewConstMetric(f.desc, f.typ, f.val(&s))
		case kindByReason:
			for i, n := range s.finished {
				ch <- prometheus.MustNewConstMetric(f.desc, prometheus.CounterValue, float64(n), finishReason(i))
			}
		case kindHistogram:
			hs := f.hist(&s)
			ch <- prometheus.MustNewConstHistogram(f.desc, hs.count, hs.sum, hs.buckets)
		case kindInfo:
			ch <- prometheus.MustNewConstMetric(f.desc, prometheus.GaugeValue, 1, f.info(&s)...)
		}
	}
}

// snapshot reads the counters and the model's state for one scrape.
func (h *handler) snapshot() snapshot {
	c := &h.counters
	s := snapshot{
		prefixQueries:    c.prefixQueries.Load(),
		prefixHits:       c.prefixHits.Load(),
		promptTokens:     c.promptTokens.Load(),
		generationTokens: c.completionTokens.Load(),
		lastHitRate:      math.Float64frombits(c.lastHitRate.Load()),
		ttft:             h.metrics.ttft.snapshot(),
		e2e:              h.metrics.e2e.snapshot(),
	}
	for i := range s.finished {
		s.finished[i] = c.finished[i].Load()
	}
	if h.engineModel != nil {
		s.state = h.engineModel.EngineState(h.now())
	} else {
		// No scheduler to ask: the requests in flight run, up to the cap,
		// the rest wait, and there is no KV cache.
		n := int(max(h.inFlight.Load(), 0))
		run := n
		if h.maxRunning > 0 {
			run = min(n, h.maxRunning)
		}
		s.state = EngineState{Running: run, Waiting: n - run}
	}
	return s
}

// serveMetrics answers GET /metrics: the engine's metrics in the
// Prometheus text format (version 0.0.4, what vLLM and SGLang serve by
// default), whatever the scraper accepts.
func (h *handler) serveMetrics(w http.ResponseWriter, _ *http.Request) {
	fams, err := h.metrics.registry.Gather()
	if err != nil {
		writeError(w, http.StatusInternalServerError, "Gathering the metrics failed: "+err.Error(), "", "")
		return
	}
	format := expfmt.NewFormat(expfmt.TypeTextPlain)
	var buf bytes.Buffer
	enc := expfmt.NewEncoder(&buf, format)
	for _, f := range fams {
		if err := enc.Encode(f); err != nil {
			writeError(w, http.StatusInternalServerError, "Encoding the metrics failed: "+err.Error(), "", "")
			return
		}
	}
	h.counters.scrapes.Add(1)
	w.Header().Set("Content-Type", string(format))
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(buf.Bytes())
}

// histogram is a fixed-bucket histogram the handler observes and a scrape
// reads whole; POST /admin/reset empties it.
type histogram struct {
	mu     sync.Mutex
	upper  []float64 // bucket upper bounds, ascending
	counts []uint64  // per bucket, not cumulative
	count  uint64
	sum    float64
}

type histogramSnapshot struct {
	count   uint64
	sum     float64
	buckets map[float64]uint64 // cumulative, by upper bound
}

func newHistogram(upper []float64) *histogram {
	return &histogram{upper: upper, counts: make([]uint64, len(upper))}
}

func (h *histogram) observe(v float64) {
	if math.IsNaN(v) {
		return
	}
	i, _ := slices.BinarySearch(h.upper, v) // the first bound >= v
	h.mu.Lock()
	defer h.mu.Unlock()
	if i < len(h.counts) {
		h.counts[i]++
	}
	h.count++
	h.sum += v
}

func (h *histogram) snapshot() histogramSnapshot {
	h.mu.Lock()
	defer h.mu.Unlock()
	s := histogramSnapshot{count: h.count, sum: h.sum, buckets: make(map[float64]uint64, len(h.upper))}
	var cum uint64
	for i, ub := range h.upper {
		cum += h.counts[i]
		s.buckets[ub] = cum
	}
	return s
}

func (h *histogram) reset() {
	h.mu.Lock()
	defer h.mu.Unlock()
	clear(h.counts)
	h.count, h.sum = 0, 0
}
