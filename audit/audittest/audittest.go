// Package audittest holds what the tests of the audit sinks share:
//   - a sealer on random keys;
//   - a clock the test moves by hand;
//   - the Redis servers a Redis sink is tested on;
//   - a TestMain that stops the shared PostgreSQL server before looking
//     for leaked goroutines.
package audittest

import (
	"crypto/rand"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	goredis "github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/tetherproxy/tether/audit"
	"github.com/tetherproxy/tether/internal/testenv"
)

// Sealer returns a sealer on a random key "k2" and a random pseudonym key.
func Sealer(t testing.TB) *audit.Sealer {
	t.Helper()
	key := func() []byte {
		b := make([]byte, audit.KeySize)
		_, _ = rand.Read(b)
		return b
	}
	s, err := audit.NewSealer([]audit.Key{{ID: "k2", Bytes: key()}}, key())
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// Clock is an injectable clock a test moves by hand.
type Clock struct {
	mu sync.Mutex
	t  time.Time
}

// NewClock returns a clock at t.
func NewClock(t time.Time) *Clock { return &Clock{t: t} }

// Now is the clock's time.
func (c *Clock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }

// Add moves the clock by d.
func (c *Clock) Add(d time.Duration) { c.mu.Lock(); c.t = c.t.Add(d); c.mu.Unlock() }

// RedisBackends runs fn on miniredis and on a real redis-server.
func RedisBackends(t *testing.T, fn func(t *testing.T, c goredis.UniversalClient)) {
	t.Run("miniredis", func(t *testing.T) {
		m := miniredis.RunT(t)
		c := goredis.NewClient(&goredis.Options{Addr: m.Addr(), ContextTimeoutEnabled: true})
		t.Cleanup(func() { _ = c.Close() })
		fn(t, c)
	})
	t.Run("redis-server", func(t *testing.T) {
		fn(t, testenv.RedisServer(t).Client())
	})
}

// Main runs a package's tests. Then it stops its shared PostgreSQL server
// pg, if a test started it, before goleak looks for goroutines left
// behind.
func Main(m *testing.M, pg *testenv.SharedPostgres) { goleak.VerifyTestMain(stopPostgres{m, pg}) }

type stopPostgres struct {
	m  *testing.M
	pg *testenv.SharedPostgres
}

func (s stopPostgres) Run() int {
	defer s.pg.Stop()
	return s.m.Run()
}
