package redis

import (
	"context"
	"fmt"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/internal/testenv"
)

// TestCircuits runs the shared breaker state on miniredis, a real
// redis-server and a real Cluster (the scripts touch only the {fleet} slot).
func TestCircuits(t *testing.T) {
	t.Run("miniredis", func(t *testing.T) {
		_, c := miniClient(t)
		testCircuits(t, newStoreT(t, c, testOptions))
	})
	t.Run("redis-server", func(t *testing.T) {
		testCircuits(t, newStoreT(t, testenv.RedisServer(t).Client(), testOptions))
	})
	t.Run("cluster", func(t *testing.T) {
		testCircuits(t, newStoreT(t, testenv.RedisCluster(t).Client(), testOptions))
	})
}

func testCircuits(t *testing.T, s *Store) {
	ctx := context.Background()
	cfg := fleet.BreakerConfig{Threshold: 3, Window: 30 * time.Second, Cooldown: 30 * time.Second}
	now := time.UnixMilli(time.Now().UnixMilli())
	seq := 0
	fail := func(replica, in string, at time.Time) (bool, time.Time) {
		t.Helper()
		seq++
		opened, until, err := s.ReportFailure(ctx, in, at, fmt.Sprintf("%s:%d", replica, seq), cfg)
		if err != nil {
			t.Fatalf("ReportFailure(%s): %v", in, err)
		}
		return opened, until
	}
	circuits := func() map[string]time.Time {
		t.Helper()
		m, err := s.Circuits(ctx, now)
		if err != nil {
			t.Fatalf("Circuits: %v", err)
		}
		return m
	}

	// Two replicas, two failures each: the fleet's count opens it, and
	// only the report that tipped it says "opened".
	for i, r := range []string{"r1", "r2", "r1"} {
		if opened, until := fail(r, "a", now.Add(time.Duration(i)*time.Second)); opened || !until.IsZero() {
			t.Fatalf("failure %d opened the circuit", i+1)
		}
	}
	opened, until := fail("r2", "a", now.Add(3*time.Second))
	if want := now.Add(33 * time.Second); !opened || !until.Equal(want) {
		t.Fatalf("4th failure: opened %v until %v, want true until %v", opened, until, want)
	}
	if opened, until2 := fail("r1", "a", now.Add(4*time.Second)); opened || !until2.Equal(until) {
		t.Fatalf("failure while open: opened %v until %v", opened, until2)
	}
	if got := circuits(); len(got) != 1 || !got["a"].Equal(until) {
		t.Fatalf("circuits = %v", got)
	}

	// A probe's success before the cooldown ends changes nothing; after,
	// it closes the circuit.
	if closed, err := s.ReportRecovered(ctx, "a", now.Add(10*time.Second)); err != nil || closed {
		t.Fatalf("recovered during the cooldown: %v, %v", closed, err)
	}
	if closed, err := s.ReportRecovered(ctx, "a", until); err != nil || !closed {
		t.Fatalf("recovered after the cooldown: %v, %v", closed, err)
	}
	if got := circuits(); len(got) != 0 {
		t.Fatalf("circuits after recovery = %v", got)
	}
	if closed, err := s.ReportRecovered(ctx, "a", until); err != nil || closed {
		t.Fatalf("recovered twice: %v, %v", closed, err)
	}

	// The window slides: failures 11 s apart never make 4 within 30 s.
	for i := range 6 {
		if opened, _ := fail("r1", "b", now.Add(time.Duration(i)*11*time.Second)); opened {
			t.Fatalf("failure %d, 11 s apart, opened the circuit", i+1)
		}
	}

	// A failed probe (a failure after the cooldown) opens it again at once.
	for i := range 4 {
		fail("r1", "c", now.Add(time.Duration(i)*time.Millisecond))
	}
	later := now.Add(time.Minute)
	if opened, until := fail("r2", "c", later); !opened || !until.Equal(later.Add(30*time.Second)) {
		t.Fatalf("failed probe: opened %v until %v", opened, until)
	}

	// Bad input and damaged state.
	if _, _, err := s.ReportFailure(ctx, "", now, "m", cfg); err == nil {
		t.Error("empty instance accepted")
	}
	if _, _, err := s.ReportFailure(ctx, "a", now, "m", fleet.BreakerConfig{}); err == nil {
		t.Error("zero window accepted")
	}
	if err := s.client.HSet(ctx, s.circuitsKey(), "damaged", "soon", "old", now.Add(-25*time.Hour).UnixMilli()).Err(); err != nil {
		t.Fatal(err)
	}
	got := circuits()
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
	s := newStoreT(t, r.Client(), DefaultOptions())
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
	if h := s.Health(); h.State != BreakerClosed {
		t.Errorf("the Redis breaker is %v after an operation", h.State)
	}
}
