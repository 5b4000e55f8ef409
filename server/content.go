package server

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/plan"
	"github.com/tetherproxy/tether/prefix"
)

// capacities keeps each instance's share of the prefix index at what its
// KV cache holds. That is the capacity its engine publishes, as any
// replica read it: vllm:cache_config_info or sglang:max_total_num_tokens.
// Without it, it is content.cache_tokens. An instance that left the fleet
// has its share dropped. run applies them every interval until ctx ends.
type capacities struct {
	index     *prefix.Index
	load      *affinity.Load
	instances func() []fleet.Instance
	content   atomic.Pointer[plan.Content] // [content] as it stands (live)
	stale     time.Duration
	interval  time.Duration
}

func (c *capacities) run(ctx context.Context) {
	t := time.NewTicker(c.interval)
	defer t.Stop()
	for {
		c.apply(time.Now())
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (c *capacities) apply(now time.Time) {
	ct := c.content.Load()
	readings := c.load.Engines(c.stale)
	fleet := map[string]bool{}
	for _, in := range c.instances() {
		fleet[in.Name] = true
		blocks := ct.IndexBlocks(ct.CacheTokens)
		if r, ok := readings[in.Name]; ok && r.CacheTokens > 0 {
			blocks = ct.IndexBlocks(r.CacheTokens)
		}
		c.index.SetCapacity(in.Name, blocks, now)
	}
	for _, st := range c.index.Stats() {
		if !fleet[st.Instance] && st.Blocks > 0 {
			c.index.Forget(st.Instance)
		}
	}
}
