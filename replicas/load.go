package replicas

import (
	"context"
	"time"

	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/fleet"
)

const (
	// LoadSyncEvery is how often a replica publishes its load and reads
	// the others'. Bounded-load placement and adaptive saturation see the
	// other replicas this late; a replica's own placements count at once.
	LoadSyncEvery = time.Second
	// LoadReportTTL is how long a report stands: a replica that stops syncing (killed, partitioned)
	// drops out of the others' sums after this long.
	LoadReportTTL = 3 * LoadSyncEvery
)

// LoadView is one replica's view of the fleet's load (affinity.Load): what
// it reports at a sync, and where the sync's answer goes.
type LoadView interface {
	// Report is this replica's part, for the others.
	Report(replica string) fleet.LoadReport
	// Apply takes in the fleet's load the sync brought back.
	Apply(fleet.LoadState)
}

// LoadSync exchanges one replica's load with the others through the store.
type LoadSync struct {
	Replica string
	View    LoadView
	Store   LoadSyncer
	// Instances lists the fleet's instances (fleet.Fleet.All).
	Instances func() []fleet.Instance
	// OnFailure hears every failed sync (a metric); nil: none.
	OnFailure func()
	Log       zerolog.Logger
}

// Sync runs one exchange: this replica's report out, the fleet's load in.
// A failed sync leaves the view as it was (its own placements keep
// counting until one succeeds).
func (s *LoadSync) Sync(ctx context.Context, now time.Time) error {
	all := s.Instances()
	names := make([]string, len(all))
	for i, in := range all {
		names[i] = in.Name
	}
	st, err := s.Store.SyncLoad(ctx, s.View.Report(s.Replica), names, LoadReportTTL, now)
	if err != nil {
		return err
	}
	s.View.Apply(st)
	return nil
}

// Run syncs every LoadSyncEvery until ctx ends. A failed sync keeps the
// last view and is counted; decisions go on with it.
func (s *LoadSync) Run(ctx context.Context) {
	warn := s.Log.Sample(&zerolog.BurstSampler{Burst: 1, Period: 30 * time.Second})
	t := time.NewTicker(LoadSyncEvery)
	defer t.Stop()
	for {
		sctx, cancel := context.WithTimeout(ctx, LoadSyncEvery/2)
		err := s.Sync(sctx, time.Now())
		cancel()
		if err != nil && ctx.Err() == nil {
			if s.OnFailure != nil {
				s.OnFailure()
			}
			warn.Warn().Err(err).Msg("load sync failed; placement uses the last view")
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
