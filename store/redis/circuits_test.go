package redis

import (
	"context"
	"fmt"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/internal/testenv"
)

// TestCircuitsDamagedState: what the conformance suite (store/storetest)
// cannot write through the interface: a field that is not a time is
// skipped, and a stale circuit is deleted from Redis, not only left out.
func TestCircuitsDamagedState(t *testing.T) {
	t.Run("miniredis", func(t *testing.T) {
		_, c := miniClient(t)
		testCircuitsDamaged(t, newStoreT(t, c, testOptions))
	})
	t.Run("redis-server", func(t *testing.T) {
		testCircuitsDamaged(t, newStoreT(t, testenv.RedisServer(t).Client(), testOptions))
	})
	t.Run("cluster", func(t *testing.T) {
		testCircuitsDamaged(t, newStoreT(t, testenv.RedisCluster(t).Client(), testOptions))
	})
}

func testCircuitsDamaged(t *testing.T, s *Store) {
	ctx := context.Background()
	cfg := fleet.BreakerConfig{Threshold: 3, Window: 30 * time.Second, Cooldown: 30 * time.Second}
	now := time.UnixMilli(time.Now().UnixMilli())
	for i := range 4 {
		if _, _, err := s.ReportFailure(ctx, "c", now.Add(time.Duration(i)*time.Millisecond), fmt.Sprint("r1:", i), cfg); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.client.HSet(ctx, s.circuitsKey(), "damaged", "soon", "old", now.Add(-25*time.Hour).UnixMilli()).Err(); err != nil {
		t.Fatal(err)
	}
	got, err := s.Circuits(ctx, now)
	if err != nil {
		t.Fatalf("Circuits: %v", err)
	}
	if _, ok := got["damaged"]; ok {
		t.Errorf("a damaged value was read as a circuit: %v", got)
	}
	if _, ok := got["old"]; ok {
		t.Errorf("a day-old half-open circuit was kept: %v", got)
	}
	if _, ok := got["c"]; !ok {
		t.Errorf("circuits lost c: %v", got)
	}
	if n, err := s.client.HExists(ctx, s.circuitsKey(), "old").Result(); err != nil || n {
		t.Errorf("stale circuit still stored: %v, %v", n, err)
	}
}

// TestOperationsOutliveTheRequestTimeout: with the request path's 10 ms
// per call, an instance holding 20,000 sessions is still listed in full
// (evacuation reads it): calls off the request path get OpTimeout.
func TestOperationsOutliveTheRequestTimeout(t *testing.T) {
	r := testenv.RedisServer(t)
	s := newStoreT(t, r.Client(), defaultOptions())
	ctx := context.Background()
	now := time.Now()
	const n = 20000
	pipe := r.Client().Pipeline()
	for i := range n {
		key := fmt.Sprintf("sess-%05d", i)
		pipe.HSet(ctx, s.bindingKey(key), "i", "a", "s", now.UnixMilli(), "v", "v1")
		pipe.PExpire(ctx, s.bindingKey(key), time.Minute)
		pipe.ZAdd(ctx, s.indexKey("a"), goredis.Z{Score: float64(now.Add(time.Minute).UnixMilli()), Member: key})
	}
	if _, err := pipe.Exec(ctx); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	got, err := s.Bound(ctx, "a", 0, now)
	if err != nil || len(got) != n {
		t.Fatalf("Bound of %d sessions with a %v request timeout: %d, %v", n, DefaultTimeout, len(got), err)
	}
	t.Logf("Bound listed %d sessions in %v", n, time.Since(start))
	if h := s.Health(); h.State != bindings.GuardClosed {
		t.Errorf("the Redis guard is %v after an operation", h.State)
	}
}
