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
