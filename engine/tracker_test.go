package engine

import (
	"fmt"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/tetherproxy/tether/fleet"
)

var t0 = time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC)

func sample(hits, queries, preempt float64) Sample {
	return Sample{Engines: 2, EngineReading: fleet.EngineReading{
		Waiting: 3, Running: 21, KVUsage: 0.375, KVKnown: true,
		PrefixHits: hits, PrefixQueries: queries, PrefixKnown: true,
		Preemptions: preempt}}
}

func TestTrackerRates(t *testing.T) {
	tr := NewTracker()

	first, err := tr.Observe("gpu-a", sample(1000, 4000, 5), t0)
	if err != nil {
		t.Fatal(err)
	}
	want := fleet.EngineReading{
		Waiting: 3, Running: 21, KVUsage: 0.375, KVKnown: true,
		PrefixHits: 1000, PrefixQueries: 4000, PrefixKnown: true, Preemptions: 5,
		At: t0,
	}
	if diff := cmp.Diff(want, first); diff != "" {
		t.Errorf("first reading (-want +got):\n%s", diff)
	}

	second, err := tr.Observe("gpu-a", sample(1600, 5000, 6), t0.Add(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	want.PrefixHits, want.PrefixQueries, want.Preemptions = 1600, 5000, 6
	want.HitRate, want.QueryRate, want.PreemptionRate, want.RatesKnown = 300, 500, 0.5, true
	want.At = t0.Add(2 * time.Second)
	if diff := cmp.Diff(want, second); diff != "" {
		t.Errorf("second reading (-want +got):\n%s", diff)
	}

	// Another instance starts on its own.
	other, err := tr.Observe("gpu-b", sample(1, 1, 1), t0.Add(2*time.Second))
	if err != nil || other.RatesKnown {
		t.Errorf("first reading of gpu-b: %+v, %v", other, err)
	}
}

func TestTrackerCounterReset(t *testing.T) {
	for _, tt := range []struct {
		name  string
		after Sample
	}{
		{"hits", sample(10, 6000, 6)},
		{"queries", sample(1700, 100, 6)},
		{"preemptions", sample(1700, 6000, 0)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			tr := NewTracker()
			_, _ = tr.Observe("gpu-a", sample(1600, 5000, 6), t0)
			r, err := tr.Observe("gpu-a", tt.after, t0.Add(time.Second))
			if Reason(err) != ReasonCounterReset {
				t.Fatalf("a counter going back: %v, want reason counter_reset", err)
			}
			if r.RatesKnown || r.HitRate != 0 || r.QueryRate != 0 || r.PreemptionRate != 0 {
				t.Errorf("rates across a reset: %+v", r)
			}
			if r.Waiting != 3 || r.PrefixHits != tt.after.PrefixHits || !r.At.Equal(t0.Add(time.Second)) {
				t.Errorf("the reading beside the reset is not the sample's: %+v", r)
			}
			// The restarted engine's sample is the new reference.
			next := tt.after
			next.PrefixHits += 50
			next.PrefixQueries += 100
			r, err = tr.Observe("gpu-a", next, t0.Add(2*time.Second))
			if err != nil || !r.RatesKnown || r.HitRate != 50 || r.QueryRate != 100 || r.PreemptionRate != 0 {
				t.Errorf("after the reset: %+v, %v", r, err)
			}
		})
	}
}

func TestTrackerNoRates(t *testing.T) {
	for _, tt := range []struct {
		name   string
		before Sample
		after  Sample
		at     time.Duration
	}{
		{"same instant", sample(1, 1, 1), sample(2, 2, 2), 0},
		{"earlier", sample(1, 1, 1), sample(2, 2, 2), -time.Second},
		{"engine count changed", sample(1, 1, 1), func() Sample { s := sample(2, 2, 2); s.Engines = 1; return s }(), time.Second},
		{"prefix counters appeared", func() Sample { s := sample(0, 0, 1); s.PrefixKnown = false; return s }(), sample(2, 2, 2), time.Second},
		{"prefix counters went", sample(1, 1, 1), func() Sample { s := sample(0, 0, 2); s.PrefixKnown = false; return s }(), time.Second},
		{"NaN counter", sample(1, 1, 1), sample(math.NaN(), 2, 2), time.Second},
		{"infinite counter", sample(1, 1, 1), sample(2, math.Inf(1), 2), time.Second},
	} {
		t.Run(tt.name, func(t *testing.T) {
			tr := NewTracker()
			_, _ = tr.Observe("gpu-a", tt.before, t0)
			r, err := tr.Observe("gpu-a", tt.after, t0.Add(tt.at))
			if err != nil {
				t.Errorf("error %v", err)
			}
			if r.RatesKnown || r.HitRate != 0 || r.QueryRate != 0 || r.PreemptionRate != 0 {
				t.Errorf("rates: %+v", r)
			}
		})
	}
}

// A reading out of order does not displace the newer reference.
func TestTrackerKeepsNewerReference(t *testing.T) {
	tr := NewTracker()
	_, _ = tr.Observe("gpu-a", sample(100, 100, 0), t0.Add(time.Second))
	_, _ = tr.Observe("gpu-a", sample(0, 0, 0), t0) // late, older
	r, err := tr.Observe("gpu-a", sample(110, 120, 0), t0.Add(2*time.Second))
	if err != nil || !r.RatesKnown || r.HitRate != 10 || r.QueryRate != 20 {
		t.Errorf("after a late sample: %+v, %v", r, err)
	}
}

// Without prefix counters the preemption rate is still known.
func TestTrackerWithoutPrefix(t *testing.T) {
	tr := NewTracker()
	s := Sample{Engines: 1, EngineReading: fleet.EngineReading{Waiting: 1, Running: 2, Preemptions: 10}}
	_, _ = tr.Observe("v0", s, t0)
	s.Preemptions = 14
	r, err := tr.Observe("v0", s, t0.Add(4*time.Second))
	if err != nil || !r.RatesKnown || r.PreemptionRate != 1 || r.PrefixKnown || r.HitRate != 0 || r.QueryRate != 0 {
		t.Errorf("%+v, %v", r, err)
	}
}

func TestTrackerForget(t *testing.T) {
	tr := NewTracker()
	_, _ = tr.Observe("gpu-a", sample(100, 100, 10), t0)
	tr.Forget("gpu-a")
	tr.Forget("never-seen")
	r, err := tr.Observe("gpu-a", sample(1, 1, 1), t0.Add(time.Second))
	if err != nil || r.RatesKnown {
		t.Errorf("after Forget: %+v, %v (want a first reading, no reset)", r, err)
	}
}

func TestTrackerConcurrent(t *testing.T) {
	tr := NewTracker()
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 200 {
				inst := fmt.Sprintf("gpu-%d", i%5)
				at := t0.Add(time.Duration(g*1000+i) * time.Millisecond)
				r, err := tr.Observe(inst, sample(float64(i), float64(2*i), 0), at)
				if err == nil && (r.HitRate < 0 || r.QueryRate < 0 || r.PreemptionRate < 0) {
					t.Errorf("negative rate %+v", r)
				}
				if i%50 == 0 {
					tr.Forget(inst)
				}
			}
		})
	}
	wg.Wait()
}
