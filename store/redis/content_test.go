package redis

import (
	"bytes"
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/internal/testenv"
	"github.com/tetherproxy/tether/prefix"
	"github.com/tetherproxy/tether/replicas"
)

var _ replicas.ContentBus = (*Store)(nil)

// inbox collects what a content subscription hears.
type inbox struct {
	mu   sync.Mutex
	msgs [][]byte
}

func (b *inbox) on(msg []byte) {
	b.mu.Lock()
	b.msgs = append(b.msgs, bytes.Clone(msg))
	b.mu.Unlock()
}

func (b *inbox) has(msg []byte) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, m := range b.msgs {
		if bytes.Equal(m, msg) {
			return true
		}
	}
	return false
}

func subscribeContent(t *testing.T, ctx context.Context, s *Store) *inbox {
	t.Helper()
	b := &inbox{}
	done := make(chan struct{})
	go func() { defer close(done); s.SubscribeContent(ctx, b.on) }()
	t.Cleanup(func() { <-done })
	return b
}

// publishUntil publishes msg (a new one each round, from mk) until every
// inbox has one: a subscription is not there the moment it is asked for.
func publishUntil(t *testing.T, ctx context.Context, s *Store, mk func(i int) []byte, boxes ...*inbox) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for i := 0; ; i++ {
		msg := mk(i)
		if err := s.PublishContent(ctx, msg); err != nil && time.Now().After(deadline) {
			t.Fatalf("PublishContent: %v", err)
		}
		wait := time.Now().Add(100 * time.Millisecond)
		for time.Now().Before(wait) {
			all := true
			for _, b := range boxes {
				all = all && b.has(msg)
			}
			if all {
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
		if time.Now().After(deadline) {
			t.Fatalf("message %d not heard by every subscriber in 10s", i)
		}
	}
}

// TestContentBus: on a standalone Redis, a Cluster and behind a Sentinel,
// what one store publishes on <prefix>content every store subscribed
// hears, its own included; on a standalone Redis, the subscription comes
// back after the server restarts.
func TestContentBus(t *testing.T) {
	tests := []struct {
		name string
		url  func(t *testing.T) (string, *testenv.Redis)
	}{
		{"standalone", func(t *testing.T) (string, *testenv.Redis) {
			r := testenv.RedisServer(t)
			return r.URL(), r
		}},
		{"cluster", func(t *testing.T) (string, *testenv.Redis) {
			a := testenv.RedisCluster(t).Addrs()
			return "redis+cluster://" + a[0] + "?addr=" + a[1] + "&addr=" + a[2], nil
		}},
		{"sentinel", func(t *testing.T) (string, *testenv.Redis) {
			return testenv.RedisSentinel(t, "sentinel-"+secret).URL(), nil
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			url, server := tt.url(t)
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			a := openCached(t, url, urlOptions)
			b := openCached(t, url, urlOptions)
			ina, inb := subscribeContent(t, ctx, a), subscribeContent(t, ctx, b)
			mk := func(i int) []byte { return []byte("\x01\x00" + tt.name + strconv.Itoa(i)) }
			publishUntil(t, ctx, a, mk, ina, inb)
			if server == nil {
				return
			}
			server.Stop()
			server.Start()
			mk = func(i int) []byte { return []byte("after restart " + strconv.Itoa(i)) }
			publishUntil(t, ctx, b, mk, ina, inb)
		})
	}
}

// BenchmarkContentShareRedisCost measures what sharing the prefix index
// costs Redis per content decision: N decisions' records published
// through a real redis-server to two subscribed replicas, the server's CPU
// (INFO cpu, used_cpu_user + used_cpu_sys) before and after over N,
// reported as redis-µs/decision. Each decision is published alone (a quiet
// fleet: one record per 20 ms message), the most it costs; at load,
// records share messages. A benchmark, not a test: it measures, and
// TestContentBus holds the delivery.
//
//	go test -run XXX -bench ContentShareRedisCost -benchtime 1x ./store/redis/
func BenchmarkContentShareRedisCost(b *testing.B) {
	t := b
	r := testenv.RedisServer(t)
	ctx, cancel := context.WithCancel(b.Context())
	pub := openCached(t, r.URL(), urlOptions)
	var subs []*replicas.ContentShare
	runs := sync.WaitGroup{}
	defer func() { cancel(); runs.Wait() }()
	for i := range 2 {
		s := openCached(t, r.URL(), urlOptions)
		sh := replicas.NewContentShare(fmt.Sprintf("sub-%d", i), prefix.NewIndex(1<<20), s, nil, zerolog.Nop())
		subs = append(subs, sh)
		runs.Go(func() { sh.Run(ctx) })
	}
	bus := &sizedBus{Store: pub}
	share := replicas.NewContentShare("pub", prefix.NewIndex(1<<20), bus, nil, zerolog.Nop())
	// Wait for both subscriptions.
	warm := make([]uint64, 4)
	for i := 0; subs[0].Stats().Applied == 0 || subs[1].Stats().Applied == 0; i++ {
		if i > 500 {
			t.Fatal("subscribers never received")
		}
		share.Record("warm", warm, time.Now())
		if err := share.Flush(ctx); err != nil {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	for _, tc := range []struct {
		name   string
		blocks int
		n      int
	}{{"1KB", 4, 20_000}, {"32KB", 128, 10_000}, {"400KB", 1600, 2_000}} {
		chains := make([][]uint64, 64)
		for i := range chains {
			chains[i] = make([]uint64, tc.blocks)
			for k := range chains[i] {
				chains[i][k] = uint64(i)<<40 | uint64(k)*0x9e3779b97f4a7c15
			}
		}
		base := [2]uint64{subs[0].Stats().Received, subs[1].Stats().Received}
		before := redisCPU(t, ctx, r.Client())
		start := time.Now()
		for i := range tc.n {
			share.Record("gpu-"+strconv.Itoa(i%8), chains[i%len(chains)], time.Now())
			if err := share.Flush(ctx); err != nil {
				t.Fatal(err)
			}
		}
		deadline := time.Now().Add(30 * time.Second)
		for subs[0].Stats().Received-base[0] < uint64(tc.n) || subs[1].Stats().Received-base[1] < uint64(tc.n) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: subscribers received %d and %d of %d", tc.name,
					subs[0].Stats().Received-base[0], subs[1].Stats().Received-base[1], tc.n)
			}
			time.Sleep(5 * time.Millisecond)
		}
		took := time.Since(start)
		cpu := redisCPU(t, ctx, r.Client()) - before
		b.ReportMetric(cpu.Seconds()*1e6/float64(tc.n), tc.name+"-redis-µs/decision")
		b.Logf("%-6s prompt (%4d blocks, a %6d-byte message, 2 subscribers): Redis CPU %6.1f µs per decision (%d decisions in %v)",
			tc.name, tc.blocks, bus.last.Load(), cpu.Seconds()*1e6/float64(tc.n), tc.n, took.Round(time.Millisecond))
	}
}

// sizedBus notes the size of the last message published.
type sizedBus struct {
	*Store
	last atomic.Int64
}

func (b *sizedBus) PublishContent(ctx context.Context, msg []byte) error {
	b.last.Store(int64(len(msg)))
	return b.Store.PublishContent(ctx, msg)
}

// redisCPU reads used_cpu_user + used_cpu_sys of INFO cpu.
func redisCPU(t testing.TB, ctx context.Context, c goredis.UniversalClient) time.Duration {
	t.Helper()
	info, err := c.Info(ctx, "cpu").Result()
	if err != nil {
		t.Fatal(err)
	}
	var total float64
	for line := range strings.SplitSeq(info, "\n") {
		k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
		if ok && (k == "used_cpu_user" || k == "used_cpu_sys") {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatalf("INFO cpu %s: %v", k, err)
			}
			total += f
		}
	}
	return time.Duration(total * float64(time.Second))
}
