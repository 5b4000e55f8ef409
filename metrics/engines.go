package metrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tetherproxy/tether/engine"
	"github.com/tetherproxy/tether/fleet"
)

// EngineView is what the engine gauges read at each scrape: the newest
// reading of each instance's engine that is younger than the staleness
// bound, whichever replica took it.
type EngineView interface {
	Engines(stale time.Duration) map[string]fleet.EngineReading
}

// Engines exports the instances' engine readings and counts this
// replica's scrapes (engine.Recorder). Every replica exports every
// instance's reading, so aggregate with max by (upstream), never sum. The
// counters mirror the engine's own: rate() over them is the engine's
// rate, and a restart of the engine is an ordinary counter reset.
type Engines struct {
	view  EngineView
	stale time.Duration
	now   func() time.Time

	waiting, running, kv, hits, queries, preemptions, age *prometheus.Desc

	scrapes  prometheus.Counter
	errors   *prometheus.CounterVec
	duration prometheus.Histogram
	shards   prometheus.Gauge
}

var _ engine.Recorder = (*Engines)(nil)

// NewEngines registers the engine metrics, reading view with staleness
// bound stale.
func NewEngines(reg prometheus.Registerer, view EngineView, stale time.Duration) *Engines {
	label := []string{"upstream"}
	e := &Engines{
		view: view, stale: stale, now: time.Now,
		waiting: prometheus.NewDesc("tether_engine_waiting_requests",
			"Requests waiting in the instance's engine queue (vllm:num_requests_waiting, sglang:num_queue_reqs), summed over its data-parallel engines.", label, nil),
		running: prometheus.NewDesc("tether_engine_running_requests",
			"Requests the instance's engine is serving (vllm:num_requests_running, sglang:num_running_reqs).", label, nil),
		kv: prometheus.NewDesc("tether_engine_kv_cache_usage_ratio",
			"Share of the instance's KV cache in use, 0 to 1 (vllm:kv_cache_usage_perc, sglang:token_usage), the mean over its data-parallel engines.", label, nil),
		hits: prometheus.NewDesc("tether_engine_prefix_cache_hit_tokens_total",
			"The engine's own count of prompt tokens served from its prefix cache (vllm:prefix_cache_hits_total), mirrored; aggregate with max by (upstream).", label, nil),
		queries: prometheus.NewDesc("tether_engine_prefix_cache_query_tokens_total",
			"The engine's own count of prompt tokens looked up in its prefix cache (vllm:prefix_cache_queries_total), mirrored; aggregate with max by (upstream).", label, nil),
		preemptions: prometheus.NewDesc("tether_engine_preemptions_total",
			"The engine's own count of preempted requests (vllm:num_preemptions_total), mirrored; aggregate with max by (upstream).", label, nil),
		age: prometheus.NewDesc("tether_engine_reading_age_seconds",
			"Age of the newest reading of the instance's engine; an instance whose reading is older than engines.staleness has none of these series.", label, nil),
		scrapes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tether_engine_scrapes_total",
			Help: "Scrapes of engine /metrics this replica made (one replica scrapes each instance: sum over replicas to see the fleet's).",
		}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tether_engine_scrape_errors_total",
			Help: "Engine scrapes that failed or gave a reading not to trust, by reason (connect, timeout, status, too_large, parse, missing, bad_value, counter_reset, other).",
		}, []string{"reason"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "tether_engine_scrape_duration_seconds",
			Help:    "Time one engine scrape took, answer read and parsed.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5},
		}),
		shards: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "tether_engine_scrape_shards",
			Help: "Shards of the fleet's engines this replica holds the scrape lease of.",
		}),
	}
	for _, r := range engine.Reasons() {
		e.errors.WithLabelValues(r)
	}
	reg.MustRegister(e, e.scrapes, e.errors, e.duration, e.shards)
	return e
}

// Scraped implements engine.Recorder.
func (e *Engines) Scraped(_ string, took time.Duration, reason string) {
	e.scrapes.Inc()
	e.duration.Observe(took.Seconds())
	if reason != "" {
		e.errors.WithLabelValues(reason).Inc()
	}
}

// Shards implements engine.Recorder.
func (e *Engines) Shards(held int) { e.shards.Set(float64(held)) }

// Describe implements prometheus.Collector.
func (e *Engines) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{e.waiting, e.running, e.kv, e.hits, e.queries, e.preemptions, e.age} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (e *Engines) Collect(ch chan<- prometheus.Metric) {
	now := e.now()
	for in, r := range e.view.Engines(e.stale) {
		ch <- prometheus.MustNewConstMetric(e.waiting, prometheus.GaugeValue, float64(r.Waiting), in)
		ch <- prometheus.MustNewConstMetric(e.running, prometheus.GaugeValue, float64(r.Running), in)
		if r.KVKnown {
			ch <- prometheus.MustNewConstMetric(e.kv, prometheus.GaugeValue, r.KVUsage, in)
		}
		if r.PrefixKnown {
			ch <- prometheus.MustNewConstMetric(e.hits, prometheus.CounterValue, r.PrefixHits, in)
			ch <- prometheus.MustNewConstMetric(e.queries, prometheus.CounterValue, r.PrefixQueries, in)
		}
		ch <- prometheus.MustNewConstMetric(e.preemptions, prometheus.CounterValue, r.Preemptions, in)
		ch <- prometheus.MustNewConstMetric(e.age, prometheus.GaugeValue, max(now.Sub(r.At).Seconds(), 0), in)
	}
}
