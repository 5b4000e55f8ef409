package memory

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/store/storetest"
)

func TestConformance(t *testing.T) {
	storetest.Run(t, storetest.Harness{
		New: func(*testing.T) storetest.Store { return New() },
		// The store's clock is candidate.Since, which the suite moves itself.
		Advance: func(*testing.T, time.Duration) {},
		Peeks:   true,
	})
}

// TestSweepBoundsMemory checks that expired bindings and links do not pile
// up when their keys are never touched again: the maps stay near the live
// set.
func TestSweepBoundsMemory(t *testing.T) {
	s := New()
	ctx := t.Context()
	lt := bindings.Lifetime{Idle: time.Second}
	now := time.UnixMilli(1_750_000_000_000)
	const total, live = 100_000, 100 // each key lives 100 calls' worth of time
	for i := range total {
		now = now.Add(lt.Idle / live)
		l := bindings.Lookup{Key: fmt.Sprint(i), Aliases: []string{fmt.Sprint("alias-", i)}, Candidate: bindings.Binding{Instance: "a", Since: now}, Lifetime: lt}
		if _, err := s.GetOrBind(ctx, l); err != nil {
			t.Fatal(err)
		}
	}
	if n := s.Len(); n > 2*minFullSweep {
		t.Errorf("Len() = %d after %d one-off keys with about %d live, want at most %d", n, total, live, 2*minFullSweep)
	}
}

// TestSampleSweep checks the incremental sweep alone: a map below the
// full-sweep size still loses its expired entries as calls go by.
func TestSampleSweep(t *testing.T) {
	s := New()
	ctx := t.Context()
	lt := bindings.Lifetime{Idle: time.Second}
	now := time.UnixMilli(1_750_000_000_000)
	for i := range 500 {
		l := bindings.Lookup{Key: fmt.Sprint(i), Aliases: []string{fmt.Sprint("alias-", i)}, Candidate: bindings.Binding{Instance: "a", Since: now}, Lifetime: lt}
		if _, err := s.GetOrBind(ctx, l); err != nil {
			t.Fatal(err)
		}
	}
	now = now.Add(time.Hour)
	for range 100 * sampleEvery {
		l := bindings.Lookup{Key: "hot", Candidate: bindings.Binding{Instance: "a", Since: now}, Lifetime: lt}
		if _, err := s.GetOrBind(ctx, l); err != nil {
			t.Fatal(err)
		}
	}
	if n := s.Len(); n != 1 {
		t.Errorf("Len() = %d, want 1 (only the hot key is live)", n)
	}
	// The sweep took the swept sessions out of the index too.
	s.mu.Lock()
	n := len(s.index["a"])
	s.mu.Unlock()
	if n != 1 {
		t.Errorf("index of a holds %d sessions, want 1", n)
	}
}

func BenchmarkGetOrBind(b *testing.B) {
	storetest.Benchmark(b, New())
}

// TestSyncLoadCountsLive checks SyncLoad's session counts, which come from
// the expiry heap and the index, against each key's binding as Show sees
// it, over random binds, uses (with idle lifetimes that shorten as well as
// lengthen the expiry), moves and syncs.
func TestSyncLoadCountsLive(t *testing.T) {
	s := New()
	ctx := t.Context()
	rng := rand.New(rand.NewPCG(1, 2))
	instances := []string{"a", "b", "c"}
	now := time.UnixMilli(1_750_000_000_000)
	for step := range 20_000 {
		now = now.Add(time.Duration(rng.IntN(50)) * time.Millisecond)
		key := fmt.Sprint(rng.IntN(400))
		lt := bindings.Lifetime{Idle: time.Duration(1+rng.IntN(3000)) * time.Millisecond}
		in := instances[rng.IntN(len(instances))]
		var err error
		if rng.IntN(4) == 0 {
			_, err = s.Replace(ctx, key, instances[rng.IntN(len(instances))], bindings.Binding{Instance: in, Since: now}, lt)
		} else {
			_, err = s.GetOrBind(ctx, bindings.Lookup{Key: key, Candidate: bindings.Binding{Instance: in, Since: now}, Lifetime: lt})
		}
		if err != nil {
			t.Fatal(err)
		}
		if step%97 != 0 {
			continue
		}
		want := map[string]int{}
		for k := range 400 {
			if sess, ok, err := s.Show(ctx, fmt.Sprint(k), now); err != nil {
				t.Fatal(err)
			} else if ok {
				want[sess.Binding.Instance]++
			}
		}
		st, err := s.SyncLoad(ctx, fleet.LoadReport{Replica: "r"}, instances, time.Second, now)
		if err != nil {
			t.Fatal(err)
		}
		for _, in := range instances {
			if st.Active[in] != want[in] {
				t.Fatalf("step %d: Active[%s] = %d, want %d", step, in, st.Active[in], want[in])
			}
		}
	}
	s.mu.Lock()
	n, b := len(s.expiry), len(s.bindings)
	s.mu.Unlock()
	if n > 2*b+minFullSweep+1 {
		t.Errorf("expiry heap holds %d items for %d bindings", n, b)
	}
}
