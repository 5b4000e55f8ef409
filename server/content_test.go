package server

import (
	"testing"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/plan"
	"github.com/tetherproxy/tether/prefix"
)

// TestCapacitiesFollowEnginesAndFleet: an instance's share of the index is
// what its engine publishes, else content.cache_tokens; one that left the
// fleet is dropped.
func TestCapacitiesFollowEnginesAndFleet(t *testing.T) {
	now := time.Now()
	index := prefix.NewIndex(10)
	index.Record("gone", []uint64{1, 2, 3}, now)
	load := affinity.NewLoad()
	load.SetEngine("a", fleet.EngineReading{CacheTokens: 64_000, At: now})
	c := &capacities{index: index, load: load, stale: time.Minute,
		instances: func() []fleet.Instance { return []fleet.Instance{{Name: "a"}, {Name: "b"}} }}
	c.content.Store(&plan.Content{BlockBytes: 256, CacheTokens: 6_400})
	c.apply(now)
	got := map[string]prefix.Stat{}
	for _, s := range index.Stats() {
		got[s.Instance] = s
	}
	if got["a"].Capacity != 1000 || got["b"].Capacity != 100 {
		t.Errorf("capacities a %d, b %d; want 1000 (64,000 tokens published) and 100 (6,400 configured)", got["a"].Capacity, got["b"].Capacity)
	}
	if got["gone"].Blocks != 0 {
		t.Errorf("an instance that left keeps %d blocks", got["gone"].Blocks)
	}
}
