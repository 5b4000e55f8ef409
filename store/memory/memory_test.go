package memory

import (
	"fmt"
	"testing"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/store/storetest"
)

func TestConformance(t *testing.T) {
	storetest.Run(t, storetest.Harness{
		New: func(*testing.T) storetest.Store { return New() },
		// The store's clock is candidate.Since, which the suite moves itself.
		Advance: func(*testing.T, time.Duration) {},
	})
}

// TestSweepBoundsMemory checks that expired bindings and links do not pile
// up when their keys are never touched again: the maps stay near the live
// set.
func TestSweepBoundsMemory(t *testing.T) {
	s := New()
	ctx := t.Context()
	lt := affinity.Lifetime{Idle: time.Second}
	now := time.UnixMilli(1_750_000_000_000)
	const total, live = 100_000, 100 // each key lives 100 calls' worth of time
	for i := range total {
		now = now.Add(lt.Idle / live)
		l := affinity.Lookup{Key: fmt.Sprint(i), Aliases: []string{fmt.Sprint("alias-", i)}, Candidate: affinity.Binding{Instance: "a", Since: now}, Lifetime: lt}
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
	lt := affinity.Lifetime{Idle: time.Second}
	now := time.UnixMilli(1_750_000_000_000)
	for i := range 500 {
		l := affinity.Lookup{Key: fmt.Sprint(i), Aliases: []string{fmt.Sprint("alias-", i)}, Candidate: affinity.Binding{Instance: "a", Since: now}, Lifetime: lt}
		if _, err := s.GetOrBind(ctx, l); err != nil {
			t.Fatal(err)
		}
	}
	now = now.Add(time.Hour)
	for range 100 * sampleEvery {
		l := affinity.Lookup{Key: "hot", Candidate: affinity.Binding{Instance: "a", Since: now}, Lifetime: lt}
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
