package redis

import (
	"testing"
	"time"

	"github.com/tetherproxy/tether/internal/testenv"
	"github.com/tetherproxy/tether/store/storetest"
)

// The memory store's figures (store/memory) are the baseline to compare with.
func BenchmarkGetOrBind(b *testing.B) {
	opts := Options{Timeout: 5 * time.Second} // no timeouts under load
	b.Run("miniredis", func(b *testing.B) {
		_, c := miniClient(b)
		storetest.Benchmark(b, newStoreT(b, c, opts))
	})
	b.Run("redis-server", func(b *testing.B) {
		r := testenv.RedisServer(b)
		storetest.Benchmark(b, newStoreT(b, r.Client(), opts))
	})
}
