package engine

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/tetherproxy/tether/fleet"
)

// Recorder counts the scrapes. The metrics package implements it.
type Recorder interface {
	// Scraped records one scrape of instance: how long it took, and the
	// reason it failed. The reason is "" when it did not fail. A reading
	// with a counter that went backwards is used, and reported as
	// ReasonCounterReset.
	Scraped(instance string, took time.Duration, reason string)
	// Shards records how many shards this replica holds.
	Shards(held int)
}

// Logger receives at most one line per round: the failures of that round.
type Logger func(failed int, summary string)

// Shards says which instances this replica scrapes. replicas.Shards splits
// the scrapes between the replicas by leases in the store.
type Shards interface {
	// Take returns the instances of instances this replica scrapes this
	// round, and how many shards it holds. err says a lease could not be
	// read. mine then holds the instances scraped anyway.
	Take(ctx context.Context, instances []fleet.Instance, now time.Time) (mine []fleet.Instance, held int, err error)
	// Release gives the shards up when the poller stops.
	Release()
}

// Readings is where the poller puts what it reads. It is the load view,
// affinity.Load. The view shares the readings with the other replicas on
// its next sync.
type Readings interface {
	SetEngine(instance string, r fleet.EngineReading)
	ForgetEngine(instance string)
}

// Poller scrapes, every Interval, the engines of the instances Shards
// gives this replica. It hands each reading to the load view. A failed
// scrape leaves the last reading to expire. It never marks an instance
// unhealthy: Envoy's outlier detection and the instance breaker decide
// that.
type Poller struct {
	Instances func() []fleet.Instance // the current fleet
	Shards    Shards
	Load      Readings
	Scraper   *Scraper
	Tracker   *Tracker
	Interval  time.Duration
	Recorder  Recorder // nil: not counted
	Log       Logger   // nil: not logged
	Now       func() time.Time

	mu      sync.Mutex
	scraped map[string]bool // the instances whose readings it publishes
}

// Run polls until ctx ends, then gives up its leases so another replica
// takes over at once.
func (p *Poller) Run(ctx context.Context) {
	t := time.NewTicker(p.Interval)
	defer t.Stop()
	for {
		p.Round(ctx)
		select {
		case <-ctx.Done():
			p.Shards.Release()
			return
		case <-t.C:
		}
	}
}

// Round scrapes the instances Shards gives this replica, and forgets the
// readings of those it no longer scrapes.
func (p *Poller) Round(ctx context.Context) {
	var scraped []fleet.Instance
	for _, in := range p.Instances() {
		if in.Engine != "" && in.MetricsURL != "" {
			scraped = append(scraped, in)
		}
	}
	mine, held, leaseErr := p.Shards.Take(ctx, scraped, p.now())
	p.mu.Lock()
	keep := make(map[string]bool, len(mine))
	for _, in := range mine {
		keep[in.Name] = true
	}
	for name := range p.scraped {
		if !keep[name] {
			p.Load.ForgetEngine(name)
			p.Tracker.Forget(name)
		}
	}
	p.scraped = keep
	p.mu.Unlock()
	if p.Recorder != nil {
		p.Recorder.Shards(held)
	}
	failures := p.scrape(ctx, mine)
	if leaseErr != nil {
		// The store is unreachable, so no replica can share readings: each
		// scrapes for itself until it is back.
		failures = append(failures, fmt.Sprintf("leases: %v (scraping every instance here)", leaseErr))
	}
	if len(failures) > 0 && p.Log != nil && ctx.Err() == nil {
		sort.Strings(failures)
		p.Log(len(failures), strings.Join(failures[:min(len(failures), 3)], "; "))
	}
}

// scrapeWorkers bounds the scrapes in flight at once.
const scrapeWorkers = 8

// scrape reads every instance of ins, at most scrapeWorkers at a time, and
// returns a line per failure.
func (p *Poller) scrape(ctx context.Context, ins []fleet.Instance) []string {
	var (
		mu       sync.Mutex
		failures []string
		wg       sync.WaitGroup
	)
	work := make(chan fleet.Instance)
	for range min(scrapeWorkers, len(ins)) {
		wg.Go(func() {
			for in := range work {
				if msg := p.scrapeOne(ctx, in); msg != "" {
					mu.Lock()
					failures = append(failures, msg)
					mu.Unlock()
				}
			}
		})
	}
	for _, in := range ins {
		work <- in
	}
	close(work)
	wg.Wait()
	return failures
}

func (p *Poller) scrapeOne(ctx context.Context, in fleet.Instance) string {
	start := p.now()
	s, err := p.Scraper.Scrape(ctx, Kind(in.Engine), in.MetricsURL)
	took := p.now().Sub(start)
	if err == nil {
		var r fleet.EngineReading
		r, err = p.Tracker.Observe(in.Name, s, start)
		p.Load.SetEngine(in.Name, r) // a reset still gives a good reading
	}
	if ctx.Err() != nil {
		return "" // stopping: a scrape cut short says nothing of the engine
	}
	reason := Reason(err)
	if p.Recorder != nil {
		p.Recorder.Scraped(in.Name, took, reason)
	}
	if err == nil {
		return ""
	}
	return fmt.Sprintf("%s (%s): %v", in.Name, reason, err)
}

func (p *Poller) now() time.Time {
	if p.Now != nil {
		return p.Now()
	}
	return time.Now()
}
