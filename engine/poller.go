package engine

import (
	"context"
	"fmt"
	"hash/fnv"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/fleet"
)

// Shards is how many leases the fleet's engines are split into: each shard's
// instances are scraped by the one replica that holds its lease, so ten
// replicas in front of 64 instances make 64 scrapes per interval, not 640.
const Shards = 8

// leaseTerms is how many intervals a lease lasts without renewal: a replica
// that dies is replaced within that many intervals plus one.
const leaseTerms = 3

// Recorder counts the scrapes (the metrics package implements it).
type Recorder interface {
	// Scraped records one scrape of instance: how long it took, and the
	// reason it failed ("" when it did not; a reading with a counter that
	// went backwards is used and reported as ReasonCounterReset).
	Scraped(instance string, took time.Duration, reason string)
	// Shards records how many shards this replica holds.
	Shards(held int)
}

// Logger receives at most one line per round: the failures of that round.
type Logger func(failed int, summary string)

// Poller scrapes, every Interval, the engines of the instances whose shard
// lease this replica holds, and hands each reading to the load view, which
// shares it with the other replicas on its next sync. A failed scrape
// leaves the last reading to expire: it never marks an instance unhealthy
// (Envoy's outlier detection and the instance breaker decide that).
type Poller struct {
	Replica   string
	Instances func() []fleet.Instance // the current fleet
	Load      *affinity.Load
	Leases    affinity.Leases
	Scraper   *Scraper
	Tracker   *Tracker
	Interval  time.Duration
	Recorder  Recorder // nil: not counted
	Log       Logger   // nil: not logged
	Now       func() time.Time

	mu      sync.Mutex
	held    map[int]bool    // the shards this replica holds
	scraped map[string]bool // the instances whose readings it publishes
}

// ShardOf is the shard of instance name.
func ShardOf(name string) int {
	h := fnv.New32a()
	_, _ = h.Write([]byte(name))
	return int(h.Sum32() % Shards)
}

func leaseName(shard int) string { return fmt.Sprintf("engines/%d", shard) }

// Run polls until ctx ends, then gives up its leases so another replica
// takes over at once.
func (p *Poller) Run(ctx context.Context) {
	t := time.NewTicker(p.Interval)
	defer t.Stop()
	for {
		p.Round(ctx)
		select {
		case <-ctx.Done():
			p.release()
			return
		case <-t.C:
		}
	}
}

// Round takes or renews the leases of the shards that hold scraped
// instances, scrapes the instances of the shards it holds, and forgets the
// readings of those it no longer scrapes.
func (p *Poller) Round(ctx context.Context) {
	now := p.now()
	byShard := map[int][]fleet.Instance{}
	for _, in := range p.Instances() {
		if in.Engine != "" && in.MetricsURL != "" {
			s := ShardOf(in.Name)
			byShard[s] = append(byShard[s], in)
		}
	}
	var mine []fleet.Instance
	var leaseErr error
	held := map[int]bool{}
	for s, ins := range byShard {
		ok, err := p.Leases.Lease(ctx, leaseName(s), p.Replica, leaseTerms*p.Interval, now)
		if err != nil {
			// The store is unreachable, so no replica can share readings:
			// each scrapes for itself until it is back.
			leaseErr, ok = err, true
		}
		if ok {
			held[s] = true
			mine = append(mine, ins...)
		}
	}
	p.mu.Lock()
	if p.held == nil {
		p.held, p.scraped = map[int]bool{}, map[string]bool{}
	}
	p.held = held
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
		p.Recorder.Shards(len(held))
	}
	failures := p.scrape(ctx, mine)
	if leaseErr != nil {
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
		var r affinity.EngineReading
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

// release gives up the leases this replica holds.
func (p *Poller) release() {
	p.mu.Lock()
	held := p.held
	p.held = nil
	p.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	for s := range held {
		_ = p.Leases.Release(ctx, leaseName(s), p.Replica)
	}
}

func (p *Poller) now() time.Time {
	if p.Now != nil {
		return p.Now()
	}
	return time.Now()
}
