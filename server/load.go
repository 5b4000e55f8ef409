package server

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/engine"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/metrics"
	"github.com/tetherproxy/tether/plan"
	"github.com/tetherproxy/tether/replicas"
)

// newPoller is the engine scraper of this replica. One replica scrapes
// each shard of the fleet's engines, by lease (replicas.Shards), and
// shares the readings through the load sync. Failures are logged at most
// once a round, and the same failure at most every 30 s.
func newPoller(sc plan.Scrape, replica string, fl *fleet.Fleet, load *affinity.Load, leases replicas.Leases,
	reg prometheus.Registerer, log zerolog.Logger) *engine.Poller {
	warn := log.Sample(&zerolog.BurstSampler{Burst: 1, Period: 30 * time.Second})
	return &engine.Poller{
		Instances: fl.All, Load: load,
		Shards:   &replicas.Shards{Replica: replica, Leases: leases, Interval: sc.Interval},
		Scraper:  &engine.Scraper{Timeout: sc.Timeout, MaxBody: sc.MaxBody},
		Tracker:  engine.NewTracker(),
		Interval: sc.Interval,
		Recorder: metrics.NewEngines(reg, load, sc.Staleness),
		Log: func(failed int, summary string) {
			warn.Warn().Int("failed", failed).Str("first", summary).Msg("engine scrapes failed; their readings expire, the instances stay in service")
		},
	}
}
