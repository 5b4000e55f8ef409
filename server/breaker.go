package server

import (
	"context"
	"strconv"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/metrics"
)

// breakerSyncEvery is how often a replica reads the shared circuits: a
// circuit another replica opened or closed holds here this late (a
// circuit opened by this replica's own reports holds at once).
const breakerSyncEvery = time.Second

// evacuator moves an instance's sessions away (affinity.Decider).
type evacuator interface {
	Evacuate(ctx context.Context, idx affinity.SessionIndex, instance string) (int, error)
}

// breakerShare connects one replica's breaker to the others.
type breakerShare struct {
	breaker *fleet.Breaker
	store   affinity.Circuits
	index   affinity.SessionIndex
	mover   evacuator
	fleet   *fleet.Fleet
	replica string
	rec     *metrics.Breaker
	log     zerolog.Logger
}

// run forwards the breaker's reports to the store and applies the shared
// circuits every breakerSyncEvery, until ctx ends. When one of this
// replica's reports opens a circuit, this replica (and only it) moves the
// instance's sessions away. A store that fails leaves each replica with
// its own view, which still opens circuits on its own count.
func (b *breakerShare) run(ctx context.Context) {
	warn := b.log.Sample(&zerolog.BurstSampler{Burst: 1, Period: 30 * time.Second})
	t := time.NewTicker(breakerSyncEvery)
	defer t.Stop()
	var evacuations sync.WaitGroup
	defer evacuations.Wait()
	seq := 0
	for {
		select {
		case <-ctx.Done():
			return
		case r := <-b.breaker.Reports():
			seq++
			if err := b.share(ctx, r, seq, &evacuations); err != nil && ctx.Err() == nil {
				b.rec.StoreError()
				warn.Warn().Err(err).Str("instance", r.Instance).Msg("breaker report not shared; this replica's view decides")
			}
		case <-t.C:
			sctx, cancel := context.WithTimeout(ctx, breakerSyncEvery/2)
			open, err := b.store.Circuits(sctx, time.Now())
			cancel()
			if err != nil {
				if ctx.Err() == nil {
					b.rec.StoreError()
					warn.Warn().Err(err).Msg("shared circuits not read; this replica's view decides")
				}
				continue
			}
			b.breaker.Sync(open, func(in string) bool { _, ok := b.fleet.Lookup(in); return ok })
		}
	}
}

// share sends one report.
func (b *breakerShare) share(ctx context.Context, r fleet.Report, seq int, evacuations *sync.WaitGroup) error {
	sctx, cancel := context.WithTimeout(ctx, breakerSyncEvery/2)
	defer cancel()
	if r.Recovered {
		_, err := b.store.ReportRecovered(sctx, r.Instance, r.At)
		return err
	}
	opened, until, err := b.store.ReportFailure(sctx, r.Instance, r.At, b.replica+":"+strconv.Itoa(seq), b.breaker.Config())
	if err != nil || until.IsZero() {
		return err
	}
	b.breaker.Opened(r.Instance, until)
	if opened {
		b.log.Warn().Str("instance", r.Instance).Time("until", until).Msg("instance breaker opened; moving its sessions")
		evacuations.Add(1)
		go func() {
			defer evacuations.Done()
			b.evacuate(ctx, r.Instance)
		}()
	}
	return nil
}

// evacuateTimeout bounds one instance's evacuation; sessions it does not
// reach move at their next request.
const evacuateTimeout = 30 * time.Second

func (b *breakerShare) evacuate(ctx context.Context, instance string) {
	ctx, cancel := context.WithTimeout(ctx, evacuateTimeout)
	defer cancel()
	start := time.Now()
	n, err := b.mover.Evacuate(ctx, b.index, instance)
	b.rec.Evacuated(instance, n)
	ev := b.log.Info()
	if err != nil {
		ev = b.log.Warn().Err(err)
	}
	ev.Str("instance", instance).Int("moved", n).Dur("took", time.Since(start)).Msg("sessions moved off an unavailable instance")
}
