package redis

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/internal/testenv"
)

// BenchmarkRedisCost measures what sessions cost Redis through the real
// store: the server's CPU (INFO cpu, used_cpu_user + used_cpu_sys, on
// each of a Cluster's masters) read before and after each phase, over
// what the phase did. Each case starts its own servers. Two replicas
// (two stores, each with its own client) share the Redis, with the
// default lifetimes (idle 30 minutes, max 30 minutes). The phases:
//
//   - bind: costSessions new sessions, each bound by one of the replicas;
//   - first: each session's first request on the other replica, which
//     asks Redis (a round trip) and caches the session;
//   - hit: for costRounds × costGap (10 s) each session is used every
//     costGap, on either replica at random, the requests spread evenly in
//     time (4,000 a second); then both replicas write back what they
//     still hold.
//
// Each is reported as redis-µs/bind, redis-µs/first and redis-µs/hit
// (and busiest-redis-µs/… on a Cluster: its busiest master, for binds the
// one holding the {fleet} slot); redis-µs/s-idle is what the same Redis
// spends a second with the replicas connected and nothing to do (its own
// timers, the cache's PINGs), which every phase includes. The cases: a
// standalone Redis with the hit cache and its defaults, with two
// replicas and with one; with a write back every flush (WriteBack =
// FlushInterval, as the cache wrote back before coalescing); without the
// cache (one round trip per hit); and a 3-master Cluster, with the cache
// (a write back is one session a call there) and without.
//
//	go test -run '^$' -bench RedisCost -benchtime 1x ./store/redis/
func BenchmarkRedisCost(b *testing.B) {
	cached := Options{Timeout: 5 * time.Second, Cache: CacheOptions{Enabled: true}}
	eachFlush := cached
	eachFlush.Cache.WriteBack = DefaultCacheFlushInterval
	uncached := Options{Timeout: 5 * time.Second}
	standalone := func(b *testing.B) (string, func(testing.TB, context.Context) []time.Duration) {
		server := testenv.RedisServer(b)
		return server.URL(), func(t testing.TB, ctx context.Context) []time.Duration {
			return []time.Duration{redisCPU(t, ctx, server.Client())}
		}
	}
	cluster := func(b *testing.B) (string, func(testing.TB, context.Context) []time.Duration) {
		c := testenv.RedisCluster(b)
		a := c.Addrs()
		return "redis+cluster://" + a[0] + "?addr=" + a[1] + "&addr=" + a[2], func(t testing.TB, ctx context.Context) []time.Duration {
			var mu sync.Mutex
			var cpu []time.Duration
			err := c.Client().ForEachMaster(ctx, func(ctx context.Context, m *goredis.Client) error {
				d := redisCPU(t, ctx, m)
				mu.Lock()
				cpu = append(cpu, d)
				mu.Unlock()
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			return cpu
		}
	}
	for i, tc := range []struct {
		name     string
		server   func(*testing.B) (string, func(testing.TB, context.Context) []time.Duration)
		opts     Options
		replicas int
	}{
		{"standalone/cached", standalone, cached, 2},
		{"standalone/cached-one-replica", standalone, cached, 1},
		{"standalone/cached-write-back-each-flush", standalone, eachFlush, 2},
		{"standalone/uncached", standalone, uncached, 2},
		{"cluster/cached", cluster, cached, 2},
		{"cluster/uncached", cluster, uncached, 2},
	} {
		b.Run(tc.name, func(b *testing.B) {
			url, cpu := tc.server(b)
			opts := tc.opts
			opts.Prefix = fmt.Sprintf("cost%d:", i)
			redisCost(b, url, opts, tc.replicas, cpu)
		})
	}
}

const (
	costSessions = 2000
	costRounds   = 20
	costGap      = 500 * time.Millisecond
)

// redisCost runs BenchmarkRedisCost's phases on the Redis at url, with
// n replicas (with one, the first request phase is a second hit on it).
func redisCost(b *testing.B, url string, opts Options, n int, cpu func(testing.TB, context.Context) []time.Duration) {
	ctx := b.Context()
	reps := make([]*Store, n)
	for i := range reps {
		reps[i] = openCached(b, url, opts)
	}
	lt := bindings.Lifetime{Idle: 30 * time.Minute, Max: 30 * time.Minute}
	look := func(i int) bindings.Lookup {
		return bindings.Lookup{Key: fmt.Sprint("cost/", i), Candidate: bindings.Binding{Instance: fmt.Sprint("gpu-", i%8), Since: time.Now()}, Lifetime: lt}
	}
	// phase runs f and reports Redis's CPU over it per n, in total and on
	// the busiest server.
	phase := func(name string, n int, f func()) (total, busiest float64) {
		before := cpu(b, ctx)
		f()
		after := cpu(b, ctx)
		var sum, top time.Duration
		for i := range after {
			d := after[i] - before[i]
			sum += d
			top = max(top, d)
		}
		total, busiest = sum.Seconds()*1e6/float64(n), top.Seconds()*1e6/float64(n)
		b.ReportMetric(total, "redis-µs/"+name)
		if len(after) > 1 {
			b.ReportMetric(busiest, "busiest-redis-µs/"+name)
		}
		return total, busiest
	}
	idle, _ := phase("s-idle", 2, func() { time.Sleep(2 * time.Second) })
	get := func(s *Store, i int, want bindings.Origin) {
		if res, err := s.GetOrBind(ctx, look(i)); err != nil || res.Origin != want {
			b.Fatalf("session %d: %+v, %v; want %v", i, res, err, want)
		}
	}
	bind, busiestBind := phase("bind", costSessions, func() {
		for i := range costSessions {
			get(reps[i%n], i, bindings.Created)
		}
	})
	first, _ := phase("first", costSessions, func() {
		for i := range costSessions {
			get(reps[(i+1)%n], i, bindings.Found)
		}
	})
	rng := rand.New(rand.NewPCG(1, 2))
	hits := costSessions * costRounds
	var took time.Duration
	hit, busiestHit := phase("hit", hits, func() {
		start := time.Now()
		for r := range costRounds {
			for i := range costSessions {
				at := start.Add(time.Duration(r)*costGap + time.Duration(i)*costGap/costSessions)
				if d := time.Until(at); d > time.Millisecond {
					time.Sleep(d)
				}
				get(reps[rng.IntN(n)], i, bindings.Found)
			}
		}
		took = time.Since(start)
		for _, s := range reps {
			s.flushCache(ctx)
		}
	})
	st := reps[0].CacheStats()
	b.Logf("Redis CPU: %.1f µs a bind (%.1f on the busiest server), %.1f µs a session's first request on a replica, "+
		"%.2f µs a hit (%.2f on the busiest server; %.2f less the idle %.1f µs/s) over %d hits in %v. "+
		"The busiest server's core carries %.0f binds/s or %.0f hits/s. Replica 0's cache: %d hits, %d misses, %d sessions written back",
		bind, busiestBind, first, hit, busiestHit, hit-idle*took.Seconds()/float64(hits), idle, hits, took.Round(time.Millisecond),
		1e6/busiestBind, 1e6/busiestHit, st.Hits, st.Misses, st.WriteBacks)
}

// BenchmarkWriteBackBatch measures what writing back one session costs
// Redis, by how many sessions a touch call carries: 2,000 sessions
// written back ten times over, one call each (a pipeline of calls), or
// touchBatch a call. Reported as redis-µs/session (INFO cpu, as
// BenchmarkRedisCost).
//
//	go test -run '^$' -bench WriteBackBatch -benchtime 1x ./store/redis/
func BenchmarkWriteBackBatch(b *testing.B) {
	r := testenv.RedisServer(b)
	s := openCached(b, r.URL(), Options{Timeout: 5 * time.Second})
	ctx := b.Context()
	const n, rounds = 2000, 10
	lt := bindings.Lifetime{Idle: 30 * time.Minute}
	ts := make([]*touch, n)
	for i := range ts {
		l := bindings.Lookup{Key: fmt.Sprint("wb/", i), Candidate: bindings.Binding{Instance: "gpu-0", Since: time.Now()}, Lifetime: lt}
		res, err := s.GetOrBind(ctx, l)
		if err != nil {
			b.Fatal(err)
		}
		ts[i] = &touch{key: l.Key, instance: res.Binding.Instance, since: res.Binding.Since.UnixMilli(), count: 3,
			now: time.Now().UnixMilli(), at: time.Now(), idle: lt.Idle}
	}
	for _, per := range []int{1, 8, touchBatch} {
		b.Run(fmt.Sprint(per, "-a-call"), func(b *testing.B) {
			before := redisCPU(b, ctx, r.Client())
			for range rounds {
				calls := s.touchCalls(ts, per)
				s.exec(ctx, calls, nil)
				for _, c := range calls {
					if _, err := c.cmd.Slice(); err != nil {
						b.Fatal(err)
					}
				}
			}
			cpu := redisCPU(b, ctx, r.Client()) - before
			b.ReportMetric(cpu.Seconds()*1e6/(n*rounds), "redis-µs/session")
		})
	}
}

// BenchmarkClusterInvalidationBroadcast weighs classic pub/sub, which the
// hit cache's invalidations use, against Redis 7's sharded pub/sub on a
// 3-master Cluster: two subscribers (two replicas of tether), and
// messages the size of an invalidation published on each master in turn,
// as the scripts that change bindings publish on the session's master.
// Classic PUBLISH reaches the other masters over the cluster bus; sharded
// SPUBLISH stays on its shard, whose channel every subscriber must then
// hold on every master. Reported: the Redis CPU (INFO cpu, summed over
// the masters) per message, each way.
//
//	go test -run '^$' -bench ClusterInvalidationBroadcast -benchtime 1x ./store/redis/
func BenchmarkClusterInvalidationBroadcast(b *testing.B) {
	c := testenv.RedisCluster(b)
	ctx := b.Context()
	var masters []*goredis.Client
	if err := c.Client().ForEachMaster(ctx, func(_ context.Context, m *goredis.Client) error {
		masters = append(masters, m)
		return nil
	}); err != nil {
		b.Fatal(err)
	}
	if len(masters) != 3 {
		b.Fatalf("%d masters", len(masters))
	}
	// A sharded channel on each master: a hash tag its slots hold.
	sharded := make([]string, len(masters))
	for i, m := range masters {
		for tag := 0; sharded[i] == ""; tag++ {
			ch := fmt.Sprintf("{inv%d}invalidate", tag)
			owner, err := c.Client().MasterForKey(ctx, ch)
			if err != nil {
				b.Fatal(err)
			}
			if owner.Options().Addr == m.Options().Addr {
				sharded[i] = ch
			}
		}
	}
	cpu := func() time.Duration {
		var sum time.Duration
		for _, m := range masters {
			sum += redisCPU(b, ctx, m)
		}
		return sum
	}
	const messages, subscribers = 20_000, 2
	payload := "0123456789abcdef tether:{" + strings.Repeat("k", 43) + "}:b" // an origin and a binding key
	for _, way := range []struct {
		name      string
		subscribe func(*goredis.ClusterClient) []*goredis.PubSub
		publish   func(m int) error
	}{
		{"classic", func(cc *goredis.ClusterClient) []*goredis.PubSub {
			return []*goredis.PubSub{cc.Subscribe(ctx, "tether:invalidate")}
		}, func(m int) error { return masters[m].Publish(ctx, "tether:invalidate", payload).Err() }},
		{"sharded", func(cc *goredis.ClusterClient) []*goredis.PubSub {
			var ps []*goredis.PubSub
			for _, ch := range sharded {
				ps = append(ps, cc.SSubscribe(ctx, ch))
			}
			return ps
		}, func(m int) error { return masters[m].SPublish(ctx, sharded[m], payload).Err() }},
	} {
		b.Run(way.name, func(b *testing.B) {
			var received sync.WaitGroup
			for range subscribers {
				cc := goredis.NewClusterClient(&goredis.ClusterOptions{Addrs: c.Addrs()})
				b.Cleanup(func() { _ = cc.Close() })
				for _, ps := range way.subscribe(cc) {
					if _, err := ps.Receive(ctx); err != nil {
						b.Fatal(err)
					}
					b.Cleanup(func() { _ = ps.Close() })
					received.Add(1)
					go func() {
						defer received.Done()
						ch := ps.Channel()
						for n := 0; n < messages/len(masters) || way.name == "classic" && n < messages; n++ {
							select {
							case <-ch:
							case <-time.After(10 * time.Second):
								return
							}
						}
					}()
				}
			}
			before := cpu()
			for i := range messages {
				if err := way.publish(i % len(masters)); err != nil {
					b.Fatal(err)
				}
			}
			received.Wait()
			used := cpu() - before
			b.ReportMetric(float64(used.Microseconds())/messages, "redis-µs/message")
			b.Logf("%s: Redis CPU %.2f µs a message over the three masters (%d messages, %d subscribers)",
				way.name, float64(used.Microseconds())/messages, messages, subscribers)
		})
	}
}
