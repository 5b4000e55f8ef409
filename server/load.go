package server

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/engine"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/metrics"
	"github.com/tetherproxy/tether/plan"
)

const (
	// loadSyncEvery is how often a replica publishes its load and reads the
	// others'. Bounded-load placement and adaptive saturation see the other
	// replicas this late; this replica's own placements count at once.
	loadSyncEvery = time.Second
	// loadReportTTL: a replica that stops syncing (killed, partitioned)
	// drops out of the others' sums after this long.
	loadReportTTL = 3 * loadSyncEvery
)

// replicaName names this process in load reports: host, pid and a random
// suffix, so two replicas never share a name, even across restarts.
func replicaName() string {
	host, _ := os.Hostname()
	var b [3]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%s-%d-%s", host, os.Getpid(), hex.EncodeToString(b[:]))
}

// syncLoad exchanges load with the other replicas through the store until
// ctx ends. A failed sync keeps the last view and is counted; decisions go
// on with it.
func syncLoad(ctx context.Context, load *affinity.Load, fl *fleet.Fleet, log zerolog.Logger, failures prometheus.Counter) {
	warn := log.Sample(&zerolog.BurstSampler{Burst: 1, Period: 30 * time.Second})
	t := time.NewTicker(loadSyncEvery)
	defer t.Stop()
	for {
		all := fl.All()
		names := make([]string, len(all))
		for i, in := range all {
			names[i] = in.Name
		}
		sctx, cancel := context.WithTimeout(ctx, loadSyncEvery/2)
		err := load.Sync(sctx, names, loadReportTTL, time.Now())
		cancel()
		if err != nil && ctx.Err() == nil {
			failures.Inc()
			warn.Warn().Err(err).Msg("load sync failed; placement uses the last view")
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// newPoller is the engine scraper of this replica: one replica scrapes
// each shard of the fleet's engines, by lease, and shares the readings
// through the load sync. Its failures are logged at most once a round, and
// the same failure at most every 30 s.
func newPoller(sc plan.Scrape, replica string, fl *fleet.Fleet, load *affinity.Load, leases affinity.Leases,
	reg prometheus.Registerer, log zerolog.Logger) *engine.Poller {
	warn := log.Sample(&zerolog.BurstSampler{Burst: 1, Period: 30 * time.Second})
	return &engine.Poller{
		Replica: replica, Instances: fl.All, Load: load, Leases: leases,
		Scraper:  &engine.Scraper{Timeout: sc.Timeout, MaxBody: sc.MaxBody},
		Tracker:  engine.NewTracker(),
		Interval: sc.Interval,
		Recorder: metrics.NewEngines(reg, load, sc.Staleness),
		Log: func(failed int, summary string) {
			warn.Warn().Int("failed", failed).Str("first", summary).Msg("engine scrapes failed; their readings expire, the instances stay in service")
		},
	}
}
