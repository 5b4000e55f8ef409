package replicas

import (
	"context"
	"strconv"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/fleet"
)

// CircuitSyncEvery is how often a replica reads the shared circuits: a
// circuit another replica opened or closed holds here this late (a circuit
// opened by this replica's own reports holds at once).
const CircuitSyncEvery = time.Second

// EvacuateTimeout bounds one instance's evacuation; sessions it does not
// reach move at their next request.
const EvacuateTimeout = 30 * time.Second

// Evacuator moves an instance's sessions away (affinity.Decider).
type Evacuator interface {
	Evacuate(ctx context.Context, instance string, sessions []bindings.Session) (moved int, err error)
}

// Bound lists the sessions bound to an instance (the store's session
// index; admin.SessionIndex says what it returns).
type Bound interface {
	Bound(ctx context.Context, instance string, limit int, now time.Time) ([]bindings.Session, error)
}

// CircuitRecorder hears what the sharing does (metrics.Breaker).
type CircuitRecorder interface {
	// StoreError counts a report or a read the store failed.
	StoreError()
	// Evacuated counts the sessions moved off instance.
	Evacuated(instance string, moved int)
}

// CircuitShare connects one replica's instance breaker to the others'.
type CircuitShare struct {
	Replica string
	Breaker *fleet.Breaker
	Store   Circuits
	Index   Bound
	Mover   Evacuator
	// Known reports whether an instance is in the fleet (fleet.Fleet's
	// Lookup): a shared circuit of one that left is not applied.
	Known    func(instance string) bool
	Recorder CircuitRecorder
	Log      zerolog.Logger
}

// Run forwards the breaker's reports to the store and applies the shared
// circuits every CircuitSyncEvery, until ctx ends. When one of this
// replica's reports opens a circuit, this replica (and only it) moves the
// instance's sessions away. A store that fails leaves each replica with
// its own view, which still opens circuits on its own count.
func (c *CircuitShare) Run(ctx context.Context) {
	warn := c.Log.Sample(&zerolog.BurstSampler{Burst: 1, Period: 30 * time.Second})
	t := time.NewTicker(CircuitSyncEvery)
	defer t.Stop()
	var evacuations sync.WaitGroup
	defer evacuations.Wait()
	seq := 0
	for {
		select {
		case <-ctx.Done():
			return
		case r := <-c.Breaker.Reports():
			seq++
			if err := c.share(ctx, r, seq, &evacuations); err != nil && ctx.Err() == nil {
				c.Recorder.StoreError()
				warn.Warn().Err(err).Str("instance", r.Instance).Msg("breaker report not shared; this replica's view decides")
			}
		case <-t.C:
			sctx, cancel := context.WithTimeout(ctx, CircuitSyncEvery/2)
			open, err := c.Store.Circuits(sctx, time.Now())
			cancel()
			if err != nil {
				if ctx.Err() == nil {
					c.Recorder.StoreError()
					warn.Warn().Err(err).Msg("shared circuits not read; this replica's view decides")
				}
				continue
			}
			c.Breaker.Sync(open, c.Known)
		}
	}
}

// share sends one report.
func (c *CircuitShare) share(ctx context.Context, r fleet.Report, seq int, evacuations *sync.WaitGroup) error {
	sctx, cancel := context.WithTimeout(ctx, CircuitSyncEvery/2)
	defer cancel()
	if r.Recovered {
		_, err := c.Store.ReportRecovered(sctx, r.Instance, r.At)
		return err
	}
	opened, until, err := c.Store.ReportFailure(sctx, r.Instance, r.At, c.Replica+":"+strconv.Itoa(seq), c.Breaker.Config())
	if err != nil || until.IsZero() {
		return err
	}
	c.Breaker.Opened(r.Instance, until)
	if opened {
		c.Log.Warn().Str("instance", r.Instance).Time("until", until).Msg("instance breaker opened; moving its sessions")
		evacuations.Go(func() { c.evacuate(ctx, r.Instance) })
	}
	return nil
}

func (c *CircuitShare) evacuate(ctx context.Context, instance string) {
	ctx, cancel := context.WithTimeout(ctx, EvacuateTimeout)
	defer cancel()
	start := time.Now()
	sessions, err := c.Index.Bound(ctx, instance, 0, start)
	n := 0
	if err == nil {
		n, err = c.Mover.Evacuate(ctx, instance, sessions)
	}
	c.Recorder.Evacuated(instance, n)
	ev := c.Log.Info()
	if err != nil {
		ev = c.Log.Warn().Err(err)
	}
	ev.Str("instance", instance).Int("moved", n).Dur("took", time.Since(start)).Msg("sessions moved off an unavailable instance")
}
