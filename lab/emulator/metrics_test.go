package emulator

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	dto "github.com/prometheus/client_model/go"

	"github.com/tetherproxy/tether/internal/promtext"
)

// scrape answers GET /metrics in-process and parses it with the lab's
// Prometheus text parser (expfmt).
func scrape(t *testing.T, h http.Handler) promtext.Metrics {
	t.Helper()
	w := call(t, h, "GET", "/metrics", "")
	if w.Code != http.StatusOK {
		t.Fatalf("GET /metrics: %d %s", w.Code, w.Body)
	}
	if ct := w.Header().Get("Content-Type"); !strings.HasPrefix(ct, "text/plain; version=0.0.4") {
		t.Errorf("GET /metrics: Content-Type %q, want the text format 0.0.4", ct)
	}
	m, err := promtext.Parse(w.Body)
	if err != nil {
		t.Fatalf("GET /metrics: %v\n%s", err, w.Body)
	}
	return m
}

func labelsOf(s *dto.Metric) map[string]string {
	out := map[string]string{}
	for _, l := range s.GetLabel() {
		out[l.GetName()] = l.GetValue()
	}
	return out
}

// checkFamily checks that name is exported with type typ, a help text, and
// samples labelled exactly labels (plus the variable label extra, when
// given), and returns its samples.
func checkFamily(t *testing.T, m promtext.Metrics, name string, typ dto.MetricType, labels map[string]string, extra string) []*dto.Metric {
	t.Helper()
	f, ok := m[name]
	if !ok {
		t.Errorf("%s: not exported", name)
		return nil
	}
	if f.GetType() != typ {
		t.Errorf("%s: type %v, want %v", name, f.GetType(), typ)
	}
	if f.GetHelp() == "" {
		t.Errorf("%s: no help text", name)
	}
	if len(f.GetMetric()) == 0 {
		t.Errorf("%s: no sample", name)
	}
	for _, s := range f.GetMetric() {
		got := labelsOf(s)
		if extra != "" {
			if got[extra] == "" {
				t.Errorf("%s: sample %v has no %s label", name, got, extra)
			}
			delete(got, extra)
		}
		if diff := cmp.Diff(labels, got); diff != "" {
			t.Errorf("%s: labels (-want +got):\n%s", name, diff)
		}
	}
	return f.GetMetric()
}

// gauge is the value of the counter or gauge name (its one sample).
func gauge(t *testing.T, m promtext.Metrics, name string) float64 {
	t.Helper()
	if n := len(m[name].GetMetric()); n != 1 {
		t.Errorf("%s: %d samples, want 1", name, n)
	}
	return m.Sum(name, nil)
}

func statsOf(t *testing.T, h http.Handler) Stats {
	t.Helper()
	var s Stats
	if err := json.Unmarshal(call(t, h, "GET", "/admin/stats", "").Body.Bytes(), &s); err != nil {
		t.Fatal(err)
	}
	return s
}

// chatBody is a chat request with a system prompt and a user message.
func chatBody(system, user string) string {
	b, _ := json.Marshal(map[string]any{"messages": []map[string]string{{"role": "system", "content": system}, {"role": "user", "content": user}}})
	return string(b)
}

// TestVLLMMetrics: an instance on the GPU model serves vLLM V1's metrics,
// labelled with its served model and engine "0": the prefix cache
// counters equal the emulator's own (a shared system prompt hits), the
// token and request counters what it served, the histograms one
// observation per request on vLLM's buckets.
func TestVLLMMetrics(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	now := t0
	var mu sync.Mutex
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	g := newGPU(t, GPUConfig{Profile: ProfileA100()})
	h, _ := recordedHandler(t, Instance{Name: "gpu-m", Model: "llama-3.1-8b", LatencyModel: g, Now: clock})

	sys := text("sys", 64)
	for _, user := range []string{"first question here", "another one"} {
		if w := call(t, h, "POST", "/v1/chat/completions", chatBody(sys, user)); w.Code != 200 {
			t.Fatalf("%d %s", w.Code, w.Body)
		}
	}
	st := statsOf(t, h)
	if st.CachedTokens != 64 || st.PrefixCacheHits != 64 || st.PrefixCacheQueries != st.PromptTokens || st.PromptTokens != 64*2+3+2 {
		t.Fatalf("stats: cached %d, prefix cache %d of %d, prompt %d", st.CachedTokens, st.PrefixCacheHits, st.PrefixCacheQueries, st.PromptTokens)
	}

	// Both requests were priced at t0: the first is in the batch, the
	// second queued behind its prefill.
	m := scrape(t, h)
	labels := map[string]string{"model_name": "llama-3.1-8b", "engine": "0"}
	gauges := []string{"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
	counters := []string{"vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
		"vllm:prompt_tokens_total", "vllm:generation_tokens_total"}
	for _, name := range gauges {
		checkFamily(t, m, name, dto.MetricType_GAUGE, labels, "")
	}
	for _, name := range counters {
		checkFamily(t, m, name, dto.MetricType_COUNTER, labels, "")
	}
	success := checkFamily(t, m, "vllm:request_success_total", dto.MetricType_COUNTER, labels, "finished_reason")
	for _, name := range []string{"vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"} {
		checkFamily(t, m, name, dto.MetricType_HISTOGRAM, labels, "")
	}
	for name := range m {
		if !strings.HasPrefix(name, "vllm:") {
			t.Errorf("%s: not one of vLLM's", name)
		}
	}

	state := g.EngineState(t0)
	want := map[string]float64{
		"vllm:num_requests_running":       1,
		"vllm:num_requests_waiting":       1,
		"vllm:kv_cache_usage_perc":        float64(state.UsedBlocks) / float64(state.CapacityBlocks),
		"vllm:prefix_cache_queries_total": float64(st.PrefixCacheQueries),
		"vllm:prefix_cache_hits_total":    float64(st.PrefixCacheHits),
		"vllm:num_preemptions_total":      0,
		"vllm:prompt_tokens_total":        float64(st.PromptTokens),
		"vllm:generation_tokens_total":    float64(st.CompletionTokens),
	}
	for name, v := range want {
		if got := gauge(t, m, name); got != v {
			t.Errorf("%s = %v, want %v", name, got, v)
		}
	}
	// The first request holds its 67 prompt tokens: 4 full blocks and a
	// partial one.
	if state.UsedBlocks != 5 || state.UsedTokens != 67 {
		t.Errorf("engine state %+v: want 5 blocks, 67 tokens held", state)
	}
	reasons := map[string]float64{}
	for _, s := range success {
		reasons[labelsOf(s)["finished_reason"]] = s.GetCounter().GetValue()
	}
	if diff := cmp.Diff(map[string]float64{"stop": 2, "length": 0, "abort": 0}, reasons); diff != "" {
		t.Errorf("vllm:request_success_total by finished_reason (-want +got):\n%s", diff)
	}
	for name, buckets := range map[string][]float64{
		"vllm:time_to_first_token_seconds": vllmTTFTBuckets(),
		"vllm:e2e_request_latency_seconds": vllmE2EBuckets(),
	} {
		hs := m[name].GetMetric()[0].GetHistogram()
		var got []float64
		for _, b := range hs.GetBucket() {
			got = append(got, b.GetUpperBound())
		}
		if !slices.Equal(got, append(buckets, math.Inf(1))) {
			t.Errorf("%s: buckets %v, want vLLM's %v", name, got, buckets)
		}
		if hs.GetSampleCount() != 2 || hs.GetSampleSum() <= 0 {
			t.Errorf("%s: %d samples summing to %v, want 2 requests", name, hs.GetSampleCount(), hs.GetSampleSum())
		}
	}

	// Once both have decoded, nothing runs or waits and the cached blocks
	// count as free; the counters stay.
	mu.Lock()
	now = t0.Add(time.Hour)
	mu.Unlock()
	m = scrape(t, h)
	for _, name := range gauges {
		if v := gauge(t, m, name); v != 0 {
			t.Errorf("after the requests: %s = %v, want 0", name, v)
		}
	}
	if v := gauge(t, m, "vllm:prefix_cache_hits_total"); v != 64 {
		t.Errorf("after the requests: hits %v", v)
	}
	if st := statsOf(t, h); st.MetricsScrapes != 2 || st.Engine != EngineVLLM || st.ServedModel != "llama-3.1-8b" {
		t.Errorf("stats: %d scrapes of %s serving %q, want 2 of vllm serving llama-3.1-8b", st.MetricsScrapes, st.Engine, st.ServedModel)
	}

	// POST /admin/reset zeroes them, as a restart would.
	call(t, h, "POST", "/admin/reset", "")
	m = scrape(t, h)
	for _, name := range counters {
		if v := gauge(t, m, name); v != 0 {
			t.Errorf("after reset: %s = %v", name, v)
		}
	}
	if n := m["vllm:time_to_first_token_seconds"].GetMetric()[0].GetHistogram().GetSampleCount(); n != 0 {
		t.Errorf("after reset: %d TTFT samples", n)
	}
	if st := statsOf(t, h); st.MetricsScrapes != 1 {
		t.Errorf("after reset: %d scrapes, want 1", st.MetricsScrapes)
	}
}

// TestMetricsOverHTTP scrapes a served instance as Prometheus would, with
// the shared parser's client: one scrape counted, and the hit and query
// counters agree with /admin/stats exactly after real requests.
func TestMetricsOverHTTP(t *testing.T) {
	srv := newServer(t, Instance{Name: "gpu-h", LatencyModel: newGPU(t, GPUConfig{Profile: ProfileA100(), TimeScale: 0.001})})
	sys := text("sys", 100)
	for _, user := range []string{"one", "two", "three"} {
		if resp, b := do(t, srv, "POST", "/v1/chat/completions", strings.NewReader(chatBody(sys, user))); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
	}
	m, err := promtext.Get(t.Context(), srv.Client(), srv.URL+"/metrics")
	if err != nil {
		t.Fatal(err)
	}
	_, b := do(t, srv, "GET", "/admin/stats", nil)
	var st Stats
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatal(err)
	}
	hits, queries := m.Sum("vllm:prefix_cache_hits_total", nil), m.Sum("vllm:prefix_cache_queries_total", nil)
	if hits != float64(st.PrefixCacheHits) || queries != float64(st.PrefixCacheQueries) || hits != 2*96 || st.MetricsScrapes != 1 {
		t.Errorf("metrics: %v hits of %v; stats: %d of %d, %d scrapes", hits, queries, st.PrefixCacheHits, st.PrefixCacheQueries, st.MetricsScrapes)
	}
	if resp, _ := do(t, srv, "POST", "/metrics", nil); resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("POST /metrics: %d", resp.StatusCode)
	}
}

// TestSGLangMetrics: with Engine sglang, SGLang's names and labels instead
// of vLLM's, from the same state.
func TestSGLangMetrics(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	g := newGPU(t, GPUConfig{Profile: ProfileA100()})
	h, _ := recordedHandler(t, Instance{Name: "gpu-s", Model: "llama", Engine: EngineSGLang, LatencyModel: g, Now: func() time.Time { return t0 }})
	sys := text("sys", 64)
	for _, user := range []string{"first question here", "another one"} {
		if w := call(t, h, "POST", "/v1/chat/completions", chatBody(sys, user)); w.Code != 200 {
			t.Fatalf("%d %s", w.Code, w.Body)
		}
	}
	st := statsOf(t, h)
	m := scrape(t, h)
	sched := map[string]string{"model_name": "llama", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
	tok := map[string]string{"model_name": "llama"}
	for _, name := range []string{"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_used_tokens", "sglang:token_usage",
		"sglang:max_total_num_tokens", "sglang:cache_hit_rate"} {
		checkFamily(t, m, name, dto.MetricType_GAUGE, sched, "")
	}
	checkFamily(t, m, "sglang:num_retracted_requests_total", dto.MetricType_COUNTER, sched, "")
	for _, name := range []string{"sglang:prompt_tokens_total", "sglang:generation_tokens_total", "sglang:cached_tokens_total",
		"sglang:num_requests_total", "sglang:num_aborted_requests_total"} {
		checkFamily(t, m, name, dto.MetricType_COUNTER, tok, "")
	}
	for _, name := range []string{"sglang:time_to_first_token_seconds", "sglang:e2e_request_latency_seconds"} {
		checkFamily(t, m, name, dto.MetricType_HISTOGRAM, tok, "")
	}
	for name := range m {
		if !strings.HasPrefix(name, "sglang:") {
			t.Errorf("%s: not one of SGLang's", name)
		}
	}
	state := g.EngineState(t0)
	want := map[string]float64{
		"sglang:num_running_reqs":             1,
		"sglang:num_queue_reqs":               1,
		"sglang:num_used_tokens":              67,
		"sglang:token_usage":                  67 / float64(state.CapacityTokens),
		"sglang:max_total_num_tokens":         float64(state.CapacityTokens),
		"sglang:cache_hit_rate":               64.0 / 66, // the last prompt: 64 of its 66 tokens
		"sglang:num_retracted_requests_total": 0,
		"sglang:prompt_tokens_total":          float64(st.PromptTokens),
		"sglang:generation_tokens_total":      float64(st.CompletionTokens),
		"sglang:cached_tokens_total":          float64(st.PrefixCacheHits),
		"sglang:num_requests_total":           2,
		"sglang:num_aborted_requests_total":   0,
	}
	for name, v := range want {
		if got := gauge(t, m, name); got != v {
			t.Errorf("%s = %v, want %v", name, got, v)
		}
	}
	if st.PrefixCacheHits != 64 {
		t.Errorf("stats: %d hits", st.PrefixCacheHits)
	}
	hs := m["sglang:time_to_first_token_seconds"].GetMetric()[0].GetHistogram()
	var got []float64
	for _, b := range hs.GetBucket() {
		got = append(got, b.GetUpperBound())
	}
	if !slices.Equal(got, append(sglangTTFTBuckets(), math.Inf(1))) || hs.GetSampleCount() != 2 {
		t.Errorf("TTFT buckets %v with %d samples, want SGLang's with 2", got, hs.GetSampleCount())
	}
}

// TestMetricsWithFixedLatency: without a cache model, /metrics serves what
// the handler knows: the requests in flight run (past MaxRunning they
// wait), no KV cache, no prefix cache queries, the tokens served.
func TestMetricsWithFixedLatency(t *testing.T) {
	for _, maxRunning := range []int{0, 1} {
		t.Run(fmt.Sprintf("max running %d", maxRunning), func(t *testing.T) { testFixedMetrics(t, maxRunning) })
	}
}

// testFixedMetrics runs three requests at once; with maxRunning 1, two of
// them count as waiting.
func testFixedMetrics(t *testing.T, maxRunning int) {
	hh, err := NewHandler(Instance{Name: "gpu-f", Latency: time.Millisecond, MaxRunning: maxRunning})
	if err != nil {
		t.Fatal(err)
	}
	h := hh.(*handler)
	gate := make(chan struct{})
	h.sleep = func(ctx context.Context, _ time.Duration) error {
		select {
		case <-gate:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	const n = 3
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() { call(t, h, "POST", "/v1/chat/completions", chatHi) })
	}
	for i := 0; h.inFlight.Load() < n; i++ {
		if i > 1000 {
			t.Fatal("the requests did not start")
		}
		time.Sleep(5 * time.Millisecond)
	}
	m := scrape(t, h)
	close(gate)
	wg.Wait()
	running := n
	if maxRunning > 0 {
		running = maxRunning
	}
	for name, v := range map[string]float64{
		"vllm:num_requests_running":       float64(running),
		"vllm:num_requests_waiting":       float64(n - running),
		"vllm:kv_cache_usage_perc":        0,
		"vllm:prefix_cache_queries_total": 0,
		"vllm:prefix_cache_hits_total":    0,
		"vllm:num_preemptions_total":      0,
		"vllm:prompt_tokens_total":        n, // "hi" is one token
	} {
		if got := gauge(t, m, name); got != v {
			t.Errorf("%s = %v, want %v", name, got, v)
		}
	}
	m = scrape(t, h)
	if got := m.Sum("vllm:request_success_total", map[string]string{"finished_reason": "stop"}); got != n {
		t.Errorf("finished: %v, want %d", got, n)
	}
	if got := gauge(t, m, "vllm:num_requests_running"); got != 0 {
		t.Errorf("afterwards: %v running", got)
	}
	ttft := m["vllm:time_to_first_token_seconds"].GetMetric()[0].GetHistogram()
	if ttft.GetSampleCount() != n || math.Abs(ttft.GetSampleSum()-n*time.Millisecond.Seconds()) > 1e-12 {
		t.Errorf("TTFT: %d samples, sum %v; want %d of the fixed 1ms", ttft.GetSampleCount(), ttft.GetSampleSum(), n)
	}
}

// TestAbortedRequests: a client that leaves before its answer counts as
// an aborted request, without latency observations.
func TestAbortedRequests(t *testing.T) {
	for _, engine := range []string{EngineVLLM, EngineSGLang} {
		h, _ := recordedHandler(t, Instance{Name: "gpu-a", Engine: engine})
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		req, _ := http.NewRequestWithContext(ctx, "POST", "/v1/chat/completions", strings.NewReader(chatHi))
		h.ServeHTTP(httptest.NewRecorder(), req)
		m := scrape(t, h)
		if engine == EngineVLLM {
			if got := m.Sum("vllm:request_success_total", map[string]string{"finished_reason": "abort"}); got != 1 {
				t.Errorf("vllm: %v aborted", got)
			}
			if n := m["vllm:e2e_request_latency_seconds"].GetMetric()[0].GetHistogram().GetSampleCount(); n != 0 {
				t.Errorf("vllm: %d e2e samples for an aborted request", n)
			}
		} else if got := m.Sum("sglang:num_aborted_requests_total", nil); got != 1 || m.Sum("sglang:num_requests_total", nil) != 1 {
			t.Errorf("sglang: %v aborted of %v", got, m.Sum("sglang:num_requests_total", nil))
		}
	}
}

// TestEngineStateTimeline: the GPU model places the requests it priced on
// its timeline: running from the start of the prefill to the end of the
// decode, waiting before; the blocks of running requests (shared ones
// once, a partial last block whole) are the KV cache in use.
func TestEngineStateTimeline(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	g := newGPU(t, GPUConfig{Profile: ProfileA100(), Cache: CacheConfig{CapacityTokens: 100 * BlockSize, MaxConversations: -1}})
	a := g.Cost(Request{Prompt: text("a", 40), Completion: text("x", 20), PromptTokens: 40, CompletionTokens: 20, Arrived: t0})
	b := g.Cost(Request{Prompt: text("a", 40) + " " + text("b", 8), Completion: "y", PromptTokens: 48, CompletionTokens: 1, Arrived: t0, InFlight: 1})
	if b.CachedTokens != 32 || b.Queued != a.Wait {
		t.Fatalf("second request: %+v, want 32 cached after queueing %v", b, a.Wait)
	}
	aPrefilled := t0.Add(a.Wait)
	tests := []struct {
		name string
		at   time.Time
		want EngineState
	}{
		// a prefills its 40 tokens (2 blocks and a partial one); b waits.
		{"a prefills", t0, EngineState{Running: 1, Waiting: 1, UsedBlocks: 3, UsedTokens: 40}},
		// a has its first token (41); b prefills 48, sharing a's 2 blocks.
		{"b prefills", aPrefilled, EngineState{Running: 2, UsedBlocks: 4, UsedTokens: 3*BlockSize + 9}},
		// b is done (one token: no decode); a is half way through its
		// decode: 1 + 19/2 tokens generated, 50 in all.
		{"a decodes", aPrefilled.Add(a.Decode / 2), EngineState{Running: 1, UsedBlocks: 4, UsedTokens: 50}},
		{"all done", aPrefilled.Add(a.Decode), EngineState{}},
	}
	for _, tc := range tests {
		tc.want.CapacityBlocks, tc.want.CapacityTokens = 100, 100*BlockSize
		if got := g.EngineState(tc.at); got != tc.want {
			t.Errorf("%s: %+v, want %+v", tc.name, got, tc.want)
		}
	}
	g.Reset()
	if got := g.EngineState(t0); got.Running+got.Waiting != 0 || g.held == nil || len(g.held) != 0 {
		t.Errorf("after reset: %+v, %d held", got, len(g.held))
	}
}

// TestPreemptions: a store that makes the cache free a block of a running
// request counts one preemption; freeing a finished request's does not.
func TestPreemptions(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	g := newGPU(t, GPUConfig{Profile: ProfileA100(), Cache: CacheConfig{CapacityTokens: 4 * BlockSize, MaxConversations: -1}})
	a := g.Cost(Request{Prompt: text("a", 48), Completion: text("x", 30), PromptTokens: 48, CompletionTokens: 30, Arrived: t0})
	t1 := t0.Add(a.Wait + time.Millisecond) // a decodes
	b := g.Cost(Request{Prompt: text("b", 64), Completion: "y", PromptTokens: 64, CompletionTokens: 1, Arrived: t1, InFlight: 1})
	if got := g.EngineState(t1).Preemptions; got != 1 {
		t.Errorf("b evicted the blocks of a, running: %d preemptions, want 1", got)
	}
	end := t1.Add(b.Wait + b.Decode + a.Decode + time.Second)
	g.Cost(Request{Prompt: text("c", 64), Completion: "z", PromptTokens: 64, CompletionTokens: 1, Arrived: end})
	if got := g.EngineState(end).Preemptions; got != 1 {
		t.Errorf("c evicted finished requests only: %d preemptions, want still 1", got)
	}
	if s := g.Cache().Stats(); s.Evictions == 0 {
		t.Errorf("no eviction: %+v", s)
	}

	h, _ := recordedHandler(t, Instance{Name: "gpu-p", LatencyModel: g})
	if got := gauge(t, scrape(t, h), "vllm:num_preemptions_total"); got != 1 {
		t.Errorf("vllm:num_preemptions_total = %v", got)
	}
	if st := statsOf(t, h); st.Preemptions != 1 {
		t.Errorf("stats: %d preemptions", st.Preemptions)
	}
}

// TestReportHeaders: the emulator-only load headers are off by default and
// sent with ReportHeaders; x-instance and x-kv-cached-tokens always are.
func TestReportHeaders(t *testing.T) {
	for _, report := range []bool{false, true} {
		g := newGPU(t, GPUConfig{Profile: ProfileA100(), TimeScale: 0.001})
		srv := newServer(t, Instance{Name: "gpu-r", LatencyModel: g, ReportHeaders: report})
		resp, b := do(t, srv, "POST", "/v1/chat/completions", strings.NewReader(chatHi))
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		if resp.Header.Get(InstanceHeader) != "gpu-r" || resp.Header.Get(CachedTokensHeader) != "0" {
			t.Errorf("report %v: %s %q, %s %q", report, InstanceHeader, resp.Header.Get(InstanceHeader), CachedTokensHeader, resp.Header.Get(CachedTokensHeader))
		}
		for _, name := range []string{QueueDepthHeader, GPUUtilizationHeader} {
			_, sent := resp.Header[http.CanonicalHeaderKey(name)]
			if sent != report {
				t.Errorf("report %v: %s sent %v (%q)", report, name, sent, resp.Header.Get(name))
			}
		}
		if report {
			if d, err := strconv.Atoi(resp.Header.Get(QueueDepthHeader)); err != nil || d != 0 {
				t.Errorf("%s = %q", QueueDepthHeader, resp.Header.Get(QueueDepthHeader))
			}
		}
	}
}

// TestServedModel: /v1/models lists the served model, owned by the
// engine; a request naming no model is answered as it, one naming another
// is served and answered with its name, as before.
func TestServedModel(t *testing.T) {
	srv := newServer(t, Instance{Name: "gpu-v", Model: "llama-3.1-8b", Engine: EngineSGLang})
	_, b := do(t, srv, "GET", "/v1/models", nil)
	var list modelList
	if err := json.Unmarshal(b, &list); err != nil {
		t.Fatal(err)
	}
	want := modelList{Object: "list", Data: []model{{ID: "llama-3.1-8b", Object: "model", OwnedBy: "sglang", Root: "llama-3.1-8b", MaxModelLen: MaxModelLen}}}
	if len(list.Data) == 1 {
		list.Data[0].Created = 0 // the time of the answer
	}
	if diff := cmp.Diff(want, list); diff != "" {
		t.Errorf("/v1/models (-want +got):\n%s", diff)
	}
	for body, want := range map[string]string{
		chatHi: "llama-3.1-8b",
		`{"model":"other","messages":[{"role":"user","content":"hi"}]}`: "other",
		`{"prompt":"hi"}`: "llama-3.1-8b",
	} {
		path := "/v1/chat/completions"
		if strings.Contains(body, "prompt") {
			path = "/v1/completions"
		}
		resp, b := do(t, srv, "POST", path, strings.NewReader(body))
		var out struct{ Model string }
		if err := json.Unmarshal(b, &out); err != nil || resp.StatusCode != 200 || out.Model != want {
			t.Errorf("%s %s: %d, model %q (%v), want %q", path, body, resp.StatusCode, out.Model, err, want)
		}
	}
}

func TestInstanceEngineAndModelValidation(t *testing.T) {
	for _, in := range []Instance{
		{Name: "a", Engine: "tgi"},
		{Name: "a", Engine: "VLLM"},
		{Name: "a", Model: "bad\nname"},
		{Name: "a", Model: strings.Repeat("m", maxModelLen+1)},
		{Name: "a", Model: "\xff"},
	} {
		if _, err := NewHandler(in); err == nil {
			t.Errorf("NewHandler(engine %q, model %q): no error", in.Engine, in.Model)
		}
	}
	for _, in := range []Instance{{Name: "a", Engine: EngineVLLM, Model: "/models/Llama 3.1 8B"}, {Name: "a", Engine: EngineSGLang}} {
		if _, err := NewHandler(in); err != nil {
			t.Errorf("NewHandler(engine %q, model %q): %v", in.Engine, in.Model, err)
		}
	}
}
