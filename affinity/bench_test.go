package affinity_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/internal/testenv"
	"github.com/tetherproxy/tether/store"
	"github.com/tetherproxy/tether/store/memory"
	redisstore "github.com/tetherproxy/tether/store/redis"
)

// BenchmarkDecide measures one sticky decision end to end in the decision
// core: rendezvous placement plus the store's get-or-bind, for each store.
// "hit" is a follow-up turn of a known session, "bind" a new session.
// "embedded" is what redis.url = "embedded" opens (store.Open, as the
// server calls it: the memory store); "miniredis" is the Redis store on
// an in-process miniredis, which "embedded" was before.
// Compare stores within one run; absolute figures depend on the machine.
func BenchmarkDecide(b *testing.B) {
	fl := instances(8)
	for i := range fl {
		fl[i].KVSessions = 20 // the default: the hit path's placement takes the hash's choice
	}
	stores := []struct {
		name string
		open func(b *testing.B) affinity.Store
	}{
		{"memory", func(*testing.B) affinity.Store { return memory.New() }},
		{"embedded", func(b *testing.B) affinity.Store { return openStore(b, store.Embedded) }},
		{"miniredis", openMiniredis},
		{"redis-server", func(b *testing.B) affinity.Store { return openStore(b, testenv.RedisServer(b).URL()) }},
	}
	for _, st := range stores {
		b.Run(st.name, func(b *testing.B) {
			s := st.open(b)
			d := affinity.New(s, fleet.New(fl), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime})
			ctx := context.Background()
			b.Run("hit", func(b *testing.B) {
				id := session("bench-hit")
				if _, err := d.Decide(ctx, id); err != nil {
					b.Fatal(err)
				}
				b.ReportAllocs()
				for b.Loop() {
					if got, _ := d.Decide(ctx, id); got.Kind != affinity.KindHit {
						b.Fatalf("decision %s", got.Kind)
					}
				}
			})
			b.Run("hit-fallbacks", func(b *testing.B) {
				// A gateway's request: the decision names two fallbacks.
				id := session("bench-hit")
				id.Fallbacks = 2
				b.ReportAllocs()
				for b.Loop() {
					if got, _ := d.Decide(ctx, id); len(got.Fallbacks) != 2 {
						b.Fatalf("fallbacks %v", got.Fallbacks)
					}
				}
			})
			b.Run("bind", func(b *testing.B) {
				b.ReportAllocs()
				i := 0
				for b.Loop() {
					i++
					if got, _ := d.Decide(ctx, session(fmt.Sprintf("%s-bind-%d", b.Name(), i))); got.Kind != affinity.KindBind {
						b.Fatalf("decision %s", got.Kind)
					}
				}
			})
			b.Run("hit-parallel", func(b *testing.B) {
				b.ReportAllocs()
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						_, _ = d.Decide(ctx, session("bench-hit"))
					}
				})
			})
		})
	}
	b.Run("memory-64-instances/hit", func(b *testing.B) {
		// A larger fleet: a hit is not ranked (affinity.Peeker), so its
		// cost grows only with the scans of the fleet's list.
		fl := instances(64)
		for i := range fl {
			fl[i].KVSessions = 20
		}
		d := affinity.New(memory.New(), fleet.New(fl), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime})
		ctx, id := context.Background(), session("bench-hit")
		if _, err := d.Decide(ctx, id); err != nil {
			b.Fatal(err)
		}
		b.ReportAllocs()
		for b.Loop() {
			if got, _ := d.Decide(ctx, id); got.Kind != affinity.KindHit {
				b.Fatalf("decision %s", got.Kind)
			}
		}
	})
	b.Run("random", func(b *testing.B) {
		d := affinity.New(memory.New(), fleet.New(instances(8)), affinity.Policy{Mode: affinity.Random})
		b.ReportAllocs()
		for b.Loop() {
			_, _ = d.Decide(context.Background(), session("x"))
		}
	})
}

func BenchmarkRendezvous(b *testing.B) {
	for _, n := range []int{8, 64, 512} {
		ins := instances(n)
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			for b.Loop() {
				affinity.Rendezvous("s:8f14e45fceea167a5a36dedd", ins)
			}
		})
	}
}

// openStore opens url as the server does (store.Open).
func openStore(b *testing.B, url string) affinity.Store {
	b.Helper()
	s, err := store.Open(context.Background(), url, store.Options{})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { s.Close() })
	return s
}

// openMiniredis is the Redis store on an in-process miniredis.
func openMiniredis(b *testing.B) affinity.Store {
	b.Helper()
	m := miniredis.RunT(b)
	c := goredis.NewClient(&goredis.Options{Addr: m.Addr()})
	b.Cleanup(func() { _ = c.Close() })
	s, err := redisstore.New(c, redisstore.Options{})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = s.Close() })
	return s
}

// BenchmarkDecideBreaker is the hit path (memory store) with the instance
// breaker: without one, with every circuit closed (the common case: one
// atomic load), and with one circuit open (every decision then filters
// the fleet under the breaker's lock). Compare within one run.
func BenchmarkDecideBreaker(b *testing.B) {
	fl := instances(8)
	ctx := context.Background()
	for _, tc := range []struct {
		name    string
		breaker bool
		open    string
	}{{"none", false, ""}, {"quiet", true, ""}, {"one-open", true, fl[7].Name}} {
		b.Run(tc.name, func(b *testing.B) {
			var opts []affinity.Option
			if tc.breaker {
				br := fleet.NewBreaker(fleet.DefaultBreaker, nil, nil)
				if tc.open != "" {
					br.Opened(tc.open, time.Now().Add(time.Hour))
				}
				opts = append(opts, affinity.WithBreaker(br))
			}
			d := affinity.New(memory.New(), fleet.New(fl), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime}, opts...)
			id := session("bench-hit")
			first, err := d.Decide(ctx, id)
			if err != nil || first.Instance.Name == tc.open {
				b.Skipf("placed on %s (%v)", first.Instance.Name, err)
			}
			b.ReportAllocs()
			for b.Loop() {
				got, _ := d.Decide(ctx, id)
				d.Finish(got, fleet.Outcome{Answered: true})
			}
		})
	}
}
