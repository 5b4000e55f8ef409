package metrics

import "github.com/prometheus/client_golang/prometheus"

// FleetView is what the per-instance gauges read at each scrape. Its
// numbers are this replica's view of the whole fleet: its own requests
// plus the other replicas' last load reports. So every replica exports
// about the same values: aggregate them with max, not sum.
type FleetView interface {
	// Instances names every instance of the configured fleet.
	Instances() []string
	// InFlight is the requests in flight to the instance, fleet-wide.
	InFlight(instance string) int
	// Queue is the queue depth the instance last reported (its pending
	// queue), 0 when it reports none.
	Queue(instance string) int
	// Active is the sessions bound to the instance.
	Active(instance string) int
	// Available reports whether the instance takes requests: healthy, not
	// drained, and its breaker not open.
	Available(instance string) bool
}

// instances is a collector that reads a FleetView when scraped, so an
// instance that leaves the fleet leaves the gauges with it.
type instances struct {
	view                               FleetView
	inFlight, queue, active, available *prometheus.Desc
}

// NewInstances registers the per-instance gauges read from view.
func NewInstances(reg prometheus.Registerer, view FleetView) {
	label := []string{"upstream"}
	reg.MustRegister(&instances{
		view: view,
		inFlight: prometheus.NewDesc("tether_instance_in_flight",
			"Requests in flight to the instance across the fleet's replicas, as this replica last heard (aggregate with max).", label, nil),
		queue: prometheus.NewDesc("tether_instance_queue_depth",
			"Queue depth the instance last reported in its response header (pending requests on the GPU), 0 when none is fresh.", label, nil),
		active: prometheus.NewDesc("tether_instance_sessions",
			"Sessions bound to the instance (the heat map), from the fleet's session index as this replica last read it (aggregate with max).", label, nil),
		available: prometheus.NewDesc("tether_instance_available",
			"1 when the instance takes requests (healthy, not drained, its breaker not open), else 0.", label, nil),
	})
}

func (c *instances) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.inFlight
	ch <- c.queue
	ch <- c.active
	ch <- c.available
}

func (c *instances) Collect(ch chan<- prometheus.Metric) {
	for _, in := range c.view.Instances() {
		up := 0.0
		if c.view.Available(in) {
			up = 1
		}
		ch <- prometheus.MustNewConstMetric(c.inFlight, prometheus.GaugeValue, float64(c.view.InFlight(in)), in)
		ch <- prometheus.MustNewConstMetric(c.queue, prometheus.GaugeValue, float64(c.view.Queue(in)), in)
		ch <- prometheus.MustNewConstMetric(c.active, prometheus.GaugeValue, float64(c.view.Active(in)), in)
		ch <- prometheus.MustNewConstMetric(c.available, prometheus.GaugeValue, up, in)
	}
}
