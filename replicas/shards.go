package replicas

import (
	"context"
	"fmt"
	"hash/fnv"
	"sync"
	"time"

	"github.com/tetherproxy/tether/fleet"
)

// ScrapeShards is how many leases the fleet's engines are split into:
// each shard's instances are scraped by the one replica that holds its
// lease, so ten replicas in front of 64 instances make 64 scrapes per
// interval, not 640.
const ScrapeShards = 8

// leaseTerms is how many scrape intervals a lease lasts without renewal: a
// replica that dies is replaced within that many intervals plus one.
const leaseTerms = 3

// Shards splits the engine scrapes between the replicas (engine.Poller
// asks it, every round, which instances are this replica's). It is safe
// for concurrent use.
type Shards struct {
	Replica string
	Leases  Leases
	// Interval is the scrape interval: a lease lasts leaseTerms of them.
	Interval time.Duration

	mu   sync.Mutex
	held map[int]bool // the shards this replica holds
}

// ShardOf is the shard of instance name.
func ShardOf(name string) int {
	h := fnv.New32a()
	_, _ = h.Write([]byte(name))
	return int(h.Sum32() % ScrapeShards)
}

func leaseName(shard int) string { return fmt.Sprintf("engines/%d", shard) }

// Take takes or renews the lease of each shard that holds one of
// instances, and returns the instances of the shards this replica holds,
// and how many shards that is. A lease the store could not answer for is
// taken as held (err says so): while the store is down every replica
// scrapes every instance, which costs scrapes, not readings.
func (s *Shards) Take(ctx context.Context, instances []fleet.Instance, now time.Time) (mine []fleet.Instance, held int, err error) {
	byShard := map[int][]fleet.Instance{}
	for _, in := range instances {
		sh := ShardOf(in.Name)
		byShard[sh] = append(byShard[sh], in)
	}
	taken := map[int]bool{}
	for sh, ins := range byShard {
		ok, lerr := s.Leases.Lease(ctx, leaseName(sh), s.Replica, leaseTerms*s.Interval, now)
		if lerr != nil {
			err, ok = lerr, true
		}
		if ok {
			taken[sh] = true
			mine = append(mine, ins...)
		}
	}
	s.mu.Lock()
	s.held = taken
	s.mu.Unlock()
	return mine, len(taken), err
}

// Release gives up the leases this replica holds, so another replica
// takes over at once (a replica stopping).
func (s *Shards) Release() {
	s.mu.Lock()
	held := s.held
	s.held = nil
	s.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	for sh := range held {
		_ = s.Leases.Release(ctx, leaseName(sh), s.Replica)
	}
}
