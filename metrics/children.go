package metrics

import (
	"maps"
	"sync"
	"sync/atomic"
)

// children caches a vector's children by their label values. The request
// path counts into a few vectors per request. WithLabelValues hashes the
// values and takes the vector's lock each time. A child, once made, stays
// the same until it is deleted, and tether never deletes these. Reads
// take no lock: the map is copied on write. Writes are rare and bounded:
// one per label combination seen for the first time.
type children[K comparable, M any] struct {
	newChild func(K) M // the vector's WithLabelValues
	mu       sync.Mutex
	m        atomic.Pointer[map[K]M]
}

// maxChildren bounds a cache: past it, children are looked up in the
// vector per call, as without the cache.
const maxChildren = 1024

func newChildren[K comparable, M any](newChild func(K) M) *children[K, M] {
	c := &children[K, M]{newChild: newChild}
	c.m.Store(&map[K]M{})
	return c
}

// of returns the child for k.
func (c *children[K, M]) of(k K) M {
	if m, ok := (*c.m.Load())[k]; ok {
		return m
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	cur := *c.m.Load()
	if m, ok := cur[k]; ok {
		return m
	}
	m := c.newChild(k)
	if len(cur) < maxChildren {
		next := make(map[K]M, len(cur)+1)
		maps.Copy(next, cur)
		next[k] = m
		c.m.Store(&next)
	}
	return m
}
