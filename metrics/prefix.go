package metrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tetherproxy/tether/prefix"
)

// PrefixView is what the prefix-index gauges read at each scrape
// (prefix.Index).
type PrefixView interface {
	Stats() []prefix.Stat
}

// HorizonView is the cache horizon the decision uses (affinity.Decider).
type HorizonView interface {
	Horizon(instance string) (time.Duration, bool)
}

// Prefix exports the prefix index cache-aware placement reads: per
// instance, what this replica has indexed as sent there, its bound, its
// evictions, and the cache horizon the decision uses.
type Prefix struct {
	view                                 PrefixView
	horizons                             HorizonView
	blocks, capacity, evictions, horizon *prometheus.Desc
}

// NewPrefix registers the prefix-index metrics, reading view and horizons.
func NewPrefix(reg prometheus.Registerer, view PrefixView, horizons HorizonView) *Prefix {
	label := []string{"upstream"}
	p := &Prefix{
		view: view, horizons: horizons,
		blocks: prometheus.NewDesc("tether_prefix_index_blocks",
			"Prompt blocks this replica has indexed as held by the instance's KV cache (what it sent there, least recently sent evicted first).", label, nil),
		capacity: prometheus.NewDesc("tether_prefix_index_capacity_blocks",
			"The most blocks the index keeps for the instance: its engine's KV-cache capacity (vllm:cache_config_info, sglang:max_total_num_tokens), else routing.content.cache_tokens, in index blocks.", label, nil),
		evictions: prometheus.NewDesc("tether_prefix_index_evictions_total",
			"Blocks the index evicted for the instance, as its cache would have.", label, nil),
		horizon: prometheus.NewDesc("tether_cache_horizon_seconds",
			"How long a prefix nobody sends survives in the instance's KV cache: its engine's published capacity over the rate it computes new prompt tokens, else the index's own evictions (a moving mean); absent while neither knows. A session idle longer is placed again (decision expired).", label, nil),
	}
	reg.MustRegister(p)
	return p
}

// Describe implements prometheus.Collector.
func (p *Prefix) Describe(ch chan<- *prometheus.Desc) {
	ch <- p.blocks
	ch <- p.capacity
	ch <- p.evictions
	ch <- p.horizon
}

// Collect implements prometheus.Collector.
func (p *Prefix) Collect(ch chan<- prometheus.Metric) {
	for _, s := range p.view.Stats() {
		ch <- prometheus.MustNewConstMetric(p.blocks, prometheus.GaugeValue, float64(s.Blocks), s.Instance)
		ch <- prometheus.MustNewConstMetric(p.capacity, prometheus.GaugeValue, float64(s.Capacity), s.Instance)
		ch <- prometheus.MustNewConstMetric(p.evictions, prometheus.CounterValue, float64(s.Evictions), s.Instance)
		if h, ok := p.horizons.Horizon(s.Instance); ok {
			ch <- prometheus.MustNewConstMetric(p.horizon, prometheus.GaugeValue, h.Seconds(), s.Instance)
		}
	}
}
