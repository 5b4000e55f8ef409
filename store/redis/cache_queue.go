package redis

// The hit cache's write-back queue: the sessions whose cached hits wait to
// be written back, in a map by key and a heap by due time.

import (
	"container/heap"
	"context"
	"time"

	"github.com/tetherproxy/tether/bindings"
)

// touch is a queued write back of a session's cached hits.
type touch struct {
	key      string
	instance string
	since    int64 // the binding's Since, ms: the write back applies to this binding only
	count    int
	now      int64 // the last hit, caller's clock ms
	at       time.Time
	idle     time.Duration
	aliases  []string
	due      time.Time // local clock: sent by the first flush from then
	pos      int       // in the cache's due heap
}

// dueHeap orders the queued write backs by due time.
type dueHeap []*touch

func (h dueHeap) Len() int           { return len(h) }
func (h dueHeap) Less(i, j int) bool { return h[i].due.Before(h[j].due) }
func (h dueHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i]; h[i].pos = i; h[j].pos = j }
func (h *dueHeap) Push(x any)        { t := x.(*touch); t.pos = len(*h); *h = append(*h, t) }
func (h *dueHeap) Pop() any {
	old := *h
	t := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return t
}

// writeBack is how long after a session's first queued hit its write back
// is sent. It is Options.WriteBack, but at most a quarter of the idle
// timeout. So a session with a short idle timeout is refreshed in time and
// still served from the cache.
func (c *hitCache) writeBack(idle time.Duration) time.Duration {
	return min(c.opts.WriteBack, idle/4)
}

// enqueue queues the write back of a cached hit, called with key's
// shard locked. It returns false when the queue is full: the hit must go
// to Redis, which refreshes the session at once.
func (c *hitCache) enqueue(key string, b bindings.Binding, now time.Time, idle time.Duration, aliases []string) bool {
	c.qmu.Lock()
	defer c.qmu.Unlock()
	t := c.queue[key]
	at := time.Now()
	if t == nil {
		if len(c.queue) >= c.opts.QueueSize {
			c.dropped.Add(1)
			return false
		}
		t = &touch{key: key, due: at.Add(c.writeBack(idle))}
		c.queue[key] = t
		heap.Push(&c.due, t)
	}
	t.instance, t.since, t.count = b.Instance, b.Since.UnixMilli(), t.count+1
	t.now, t.at, t.idle = now.UnixMilli(), at, idle
	if len(aliases) > 0 {
		t.aliases = aliases
	}
	return true
}

// take removes key's queued write back, for a caller that sends it
// itself, after waiting for a flush that is writing key back.
func (c *hitCache) take(ctx context.Context, key string) (*touch, bool) {
	c.qmu.Lock()
	t, ok := c.queue[key]
	if ok {
		delete(c.queue, key)
		heap.Remove(&c.due, t.pos)
	}
	var wait chan struct{}
	if _, busy := c.inflight[key]; busy {
		wait = c.done
	}
	c.qmu.Unlock()
	if wait != nil {
		select {
		case <-wait:
		case <-ctx.Done():
		}
	}
	return t, ok
}

// takeDue, takeAll and takeKeys remove and return queued write backs,
// with qmu held: those due at now, all of them, those of keys.
func (c *hitCache) takeDue(now time.Time) map[string]*touch {
	var q map[string]*touch
	for len(c.due) > 0 && !c.due[0].due.After(now) {
		t := heap.Pop(&c.due).(*touch)
		delete(c.queue, t.key)
		if q == nil {
			q = map[string]*touch{}
		}
		q[t.key] = t
	}
	return q
}

func (c *hitCache) takeAll(time.Time) map[string]*touch {
	q := c.queue
	c.queue, c.due = make(map[string]*touch, len(q)), nil
	return q
}

func (c *hitCache) takeKeys(keys []string) func(time.Time) map[string]*touch {
	return func(time.Time) map[string]*touch {
		var q map[string]*touch
		for _, k := range keys {
			if t, ok := c.queue[k]; ok {
				delete(c.queue, k)
				heap.Remove(&c.due, t.pos)
				if q == nil {
					q = map[string]*touch{}
				}
				q[k] = t
			}
		}
		return q
	}
}
