package metrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tetherproxy/tether/replicas"
)

// ContentShareView is what the content share's counters read at each
// scrape (replicas.ContentShare).
type ContentShareView interface {
	Stats() replicas.ContentStats
}

// ContentShare exports what the sharing of the prefix index between
// replicas did (replicas.ContentShare).
type ContentShare struct {
	view         ContentShareView
	records, bad *prometheus.Desc
}

// NewContentShare registers the content share's metrics, reading view.
func NewContentShare(reg prometheus.Registerer, view ContentShareView) *ContentShare {
	c := &ContentShare{
		view: view,
		records: prometheus.NewDesc("tether_content_share_records_total",
			"Prefix-index records (one content decision's prompt blocks on one instance) shared between replicas, by result: "+
				"published (sent to the others), dropped (not sent: the buffer was full), unpublished (not sent: Redis failed the publish), "+
				"received (from the others), applied (recorded on this replica's index: received, less instances it does not know).",
			[]string{"result"}, nil),
		bad: prometheus.NewDesc("tether_content_share_bad_messages_total",
			"Content-share messages from other replicas that did not decode, dropped whole.", nil, nil),
	}
	reg.MustRegister(c)
	return c
}

// Describe implements prometheus.Collector.
func (c *ContentShare) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.records
	ch <- c.bad
}

// Collect implements prometheus.Collector.
func (c *ContentShare) Collect(ch chan<- prometheus.Metric) {
	s := c.view.Stats()
	for _, r := range []struct {
		result string
		n      uint64
	}{{"published", s.Published}, {"dropped", s.Dropped}, {"unpublished", s.Unpublished}, {"received", s.Received}, {"applied", s.Applied}} {
		ch <- prometheus.MustNewConstMetric(c.records, prometheus.CounterValue, float64(r.n), r.result)
	}
	ch <- prometheus.MustNewConstMetric(c.bad, prometheus.CounterValue, float64(s.Bad))
}
