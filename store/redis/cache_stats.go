package redis

// The hit cache's statistics.

// CacheStats counts what the hit cache did.
type CacheStats struct {
	Hits, Misses     uint64 // lookups served from the cache, and not
	Invalidations    uint64 // entries dropped by a message
	Flushes          uint64 // whole-cache flushes (subscription lost)
	Malformed        uint64 // invalidation messages that named no binding
	WriteBacks       uint64 // sessions written back
	Dropped          uint64 // hits sent to Redis because the write-back queue was full
	WriteBackErrors  uint64 // write-back pipelines that failed
	Entries, Pending int    // cached sessions, write backs queued now
	Subscribed       bool   // serving from the cache
}

func (c *hitCache) stats() CacheStats {
	st := CacheStats{
		Hits: c.hits.Load(), Misses: c.misses.Load(), Invalidations: c.invalidations.Load(),
		Flushes: c.flushes.Load(), Malformed: c.malformed.Load(), WriteBacks: c.writeBacks.Load(),
		Dropped: c.dropped.Load(), WriteBackErrors: c.writeBackErrors.Load(), Subscribed: c.ready.Load(),
	}
	for i := range c.shards {
		sh := &c.shards[i]
		sh.mu.Lock()
		st.Entries += len(sh.entries)
		sh.mu.Unlock()
	}
	c.qmu.Lock()
	st.Pending = len(c.queue)
	c.qmu.Unlock()
	return st
}
