package redis

import (
	"context"
	"fmt"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/internal/testenv"
)

// The hit cache on the deployments that outgrow one Redis: a real
// 3-master Cluster and a real Sentinel, each with two stores (two
// replicas of tether) that must follow each other's moves as on a
// standalone Redis (TestCacheFollowsMoves).

func clusterURL(c *testenv.Cluster) string {
	a := c.Addrs()
	return "redis+cluster://" + a[0] + "?addr=" + a[1] + "&addr=" + a[2]
}

func TestCacheFollowsMovesOnCluster(t *testing.T) {
	t.Parallel()
	url := clusterURL(testenv.RedisCluster(t))
	a, b := openCached(t, url, cachedOptions()), openCached(t, url, cachedOptions())
	for _, s := range []*Store{a, b} {
		if mode, why := s.Hits(); mode != HitsCached || s.Health().Hits != HitsCached {
			t.Fatalf("cluster: hits %q (%q); want %q", mode, why, HitsCached)
		}
	}
	followMoves(t, a, b)
}

func TestCacheFollowsMovesBehindSentinel(t *testing.T) {
	t.Parallel()
	url := testenv.RedisSentinel(t, "").URL()
	followMoves(t, openCached(t, url, cachedOptions()), openCached(t, url, cachedOptions()))
}

// TestCacheFlushedWhenClusterSubscriptionDrops: on a Cluster the
// subscription is on one node; when it is cut, the cache is flushed, and a
// change made meanwhile (unpublished) is read from Redis once the store has
// subscribed again.
func TestCacheFlushedWhenClusterSubscriptionDrops(t *testing.T) {
	t.Parallel()
	c := testenv.RedisCluster(t)
	s := openCached(t, clusterURL(c), cachedOptions())
	ctx := t.Context()
	l := bindings.Lookup{Key: "drop", Candidate: bindings.Binding{Instance: "a", Since: since}, Lifetime: bindings.Lifetime{Idle: time.Hour}}
	warm(t, s, l)
	err := c.Client().ForEachShard(ctx, func(ctx context.Context, n *goredis.Client) error {
		return n.Do(ctx, "CLIENT", "KILL", "TYPE", "pubsub").Err()
	})
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for s.CacheStats().Flushes == 0 {
		if time.Now().After(deadline) {
			t.Fatal("cache not flushed 5s after its subscription was cut")
		}
		time.Sleep(time.Millisecond)
	}
	if err := c.Client().HSet(ctx, s.bindingKey("drop"), "i", "z").Err(); err != nil {
		t.Fatal(err)
	}
	waitSubscribed(t, s)
	res, err := s.GetOrBind(ctx, l)
	if err != nil || res.Binding.Instance != "z" {
		t.Errorf("after the subscription returned: %+v, %v; want instance z from Redis", res, err)
	}
}

// TestCacheWritesBackOnCluster: cached hits of many sessions, spread over
// the masters, are written back (one session a call: a script's keys share
// a slot) with their counts summed.
func TestCacheWritesBackOnCluster(t *testing.T) {
	t.Parallel()
	c := testenv.RedisCluster(t)
	opts := cachedOptions()
	opts.Cache.FlushInterval = 10 * time.Minute // flushed by hand below
	s := openCached(t, clusterURL(c), opts)
	ctx := t.Context()
	const sessions, hits = 40, 3
	look := func(i int) bindings.Lookup {
		return bindings.Lookup{Key: fmt.Sprint("wb/", i), Candidate: bindings.Binding{Instance: "a", Since: since}, Lifetime: bindings.Lifetime{Idle: time.Hour}}
	}
	for i := range sessions {
		warm(t, s, look(i))
	}
	s.flushCache(ctx)
	base := map[int]int{}
	for i := range sessions {
		n, err := c.Client().HGet(ctx, s.bindingKey(look(i).Key), "n").Int()
		if err != nil {
			t.Fatal(err)
		}
		base[i] = n
	}
	st0 := s.CacheStats()
	for range hits {
		for i := range sessions {
			if _, err := s.GetOrBind(ctx, look(i)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if st := s.CacheStats(); st.Hits-st0.Hits != sessions*hits {
		t.Fatalf("stats %+v after %+v; want %d cached hits", st, st0, sessions*hits)
	}
	s.flushCache(ctx)
	if st := s.CacheStats(); st.WriteBackErrors != st0.WriteBackErrors || st.WriteBacks-st0.WriteBacks != sessions {
		t.Errorf("stats %+v after %+v; want %d write backs and no error", st, st0, sessions)
	}
	for i := range sessions {
		n, err := c.Client().HGet(ctx, s.bindingKey(look(i).Key), "n").Int()
		if err != nil || n != base[i]+hits {
			t.Errorf("session %d: count %d, %v in Redis; want %d", i, n, err, base[i]+hits)
		}
	}
}

// TestCacheAcrossSentinelFailover: two stores (two replicas of tether)
// behind a Sentinel with a replica, both caching, through a failover
// (SENTINEL FAILOVER; the old master keeps running, and the sentinel makes
// it a replica of the new one seconds later). Both stores must flush
// their caches and subscribe on the new master at once: a change made on
// it without a message is read, and they follow each other's moves as
// before the failover. The test logs how long after the sentinel
// announced the switch each store flushed and subscribed again.
func TestCacheAcrossSentinelFailover(t *testing.T) {
	t.Parallel()
	sn := testenv.RedisSentinelWithReplica(t, "")
	a, b := openCached(t, sn.URL(), cachedOptions()), openCached(t, sn.URL(), cachedOptions())
	stores := []*Store{a, b}
	ctx := t.Context()
	l := bindings.Lookup{Key: "failover", Candidate: bindings.Binding{Instance: "a", Since: since}, Lifetime: bindings.Lifetime{Idle: time.Hour}}
	for _, s := range stores {
		warm(t, s, l)
	}

	// When the sentinel announces the switch, and when each store
	// flushes, then serves from its cache again.
	sc := goredis.NewSentinelClient(&goredis.Options{Addr: sn.Addr()})
	t.Cleanup(func() { _ = sc.Close() })
	sw := sc.Subscribe(ctx, "+switch-master")
	t.Cleanup(func() { _ = sw.Close() })
	if _, err := sw.Receive(ctx); err != nil {
		t.Fatal(err)
	}
	switched := make(chan time.Time, 1)
	go func() {
		if _, err := sw.ReceiveMessage(ctx); err == nil {
			switched <- time.Now()
		}
	}()
	type times struct{ flushed, back time.Time }
	watched := make(chan [2]times, 1)
	go func() {
		var ts [2]times
		var before [2]uint64
		for i, s := range stores {
			before[i] = s.CacheStats().Flushes
		}
		end := time.Now().Add(20 * time.Second)
		for time.Now().Before(end) && ctx.Err() == nil && (ts[0].back.IsZero() || ts[1].back.IsZero()) {
			for i, s := range stores {
				st, now := s.CacheStats(), time.Now()
				if ts[i].flushed.IsZero() && st.Flushes > before[i] {
					ts[i].flushed = now
				}
				if !ts[i].flushed.IsZero() && ts[i].back.IsZero() && st.Subscribed {
					ts[i].back = now
				}
			}
			time.Sleep(500 * time.Microsecond)
		}
		watched <- ts
	}()

	old := sn.MasterAddr()
	master, err := sn.Failover(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// A change on the new master that no message announces: only a flush
	// across the failover lets the stores read it.
	nm := goredis.NewClient(&goredis.Options{Addr: master, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = nm.Close() })
	if err := nm.HSet(ctx, a.bindingKey(l.Key), "i", "z").Err(); err != nil {
		t.Fatal(err)
	}
	var at time.Time
	select {
	case at = <-switched:
	case <-time.After(5 * time.Second):
		t.Fatal("no +switch-master from the sentinel 5s after the failover")
	}
	ts := <-watched
	for i, tm := range ts {
		if tm.back.IsZero() {
			t.Errorf("store %d: not flushed and subscribed again 20s after the switch (flushed: %v)", i, !tm.flushed.IsZero())
			continue
		}
		flush, back := tm.flushed.Sub(at), tm.back.Sub(at)
		t.Logf("store %d: cache flushed %v and serving again %v after the sentinel announced the switch", i, flush, back)
		if bound := time.Second; back > bound {
			t.Errorf("store %d: serving from a new subscription %v after the switch; want under %v", i, back, bound)
		}
	}
	// Both subscriptions are on the new master, none on the old one (still
	// a master: the sentinel makes it a replica seconds later).
	for _, node := range []struct {
		name, addr string
		want       int64
	}{{"new master", master, 2}, {"old master", old, 0}} {
		c := goredis.NewClient(&goredis.Options{Addr: node.addr, ContextTimeoutEnabled: true})
		n, err := c.PubSubNumSub(ctx, a.channel).Result()
		_ = c.Close()
		if err != nil || n[a.channel] != node.want {
			t.Errorf("PUBSUB NUMSUB on the %s = %v, %v; want %d subscribers", node.name, n, err, node.want)
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	for i, s := range stores {
		waitSubscribed(t, s)
		if res, err := s.GetOrBind(ctx, l); err != nil || res.Binding.Instance != "z" {
			t.Errorf("store %d after the failover: %+v, %v; want instance z from the new master", i, res, err)
		}
	}
	// And the channel works on the new master.
	followMoves(t, a, b)
	for i, s := range stores {
		if mode, why := s.Hits(); mode != HitsCached || !s.CacheStats().Subscribed {
			t.Errorf("store %d: hits %q (%q), %+v; want %q, subscribed", i, mode, why, s.CacheStats(), HitsCached)
		}
	}
}
