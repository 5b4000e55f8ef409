package pace

import (
	"context"
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// record runs s and returns its arrivals, and how many works ran.
func record(t *testing.T, ctx context.Context, s Schedule) ([]Arrival, int) {
	t.Helper()
	var got []Arrival
	var ran atomic.Int64
	err := s.Run(ctx, func(a Arrival) func() {
		got = append(got, a) // next runs in order on one goroutine: no lock
		return func() { ran.Add(1) }
	})
	if err != nil {
		t.Fatal(err)
	}
	return got, int(ran.Load())
}

func TestEvenScheduleBoundedInCount(t *testing.T) {
	start := time.Now()
	got, ran := record(t, context.Background(), Schedule{Rate: 400, Count: 20, Start: start})
	if len(got) != 20 || ran != 20 {
		t.Fatalf("%d arrivals, %d works; want 20 of each", len(got), ran)
	}
	for i, a := range got {
		want := start.Add(time.Duration(i) * 2500 * time.Microsecond)
		if a.N != i || !a.Due.Equal(want) || a.Dropped || a.Late < 0 {
			t.Errorf("arrival %d: %+v, want N %d due at +%v", i, a, i, want.Sub(start))
		}
	}
	if took := time.Since(start); took < 19*2500*time.Microsecond {
		t.Errorf("20 arrivals at 400/s took %v: the pacer did not wait", took)
	}
}

func TestEvenScheduleBoundedInTime(t *testing.T) {
	got, _ := record(t, context.Background(), Schedule{Rate: 100, For: 55 * time.Millisecond})
	if len(got) != 6 { // due at 0, 10 … 50 ms
		t.Errorf("%d arrivals in 55 ms at 100/s, want 6", len(got))
	}
	// Both bounds: the tighter one wins.
	got, _ = record(t, context.Background(), Schedule{Rate: 1000, For: time.Second, Count: 3})
	if len(got) != 3 {
		t.Errorf("%d arrivals, want Count's 3", len(got))
	}
}

func TestGapSchedule(t *testing.T) {
	start := time.Now()
	gaps := []time.Duration{3 * time.Millisecond, 1 * time.Millisecond, 4 * time.Millisecond, 1 * time.Millisecond, 5 * time.Millisecond}
	i := 0
	gap := func() time.Duration { g := gaps[i%len(gaps)]; i++; return g }
	got, _ := record(t, context.Background(), Schedule{Gap: gap, For: 14 * time.Millisecond, Start: start})
	// The first arrival comes after one gap: at 3, 4, 8, 9 ms; 14 is out.
	want := []time.Duration{3, 4, 8, 9}
	if len(got) != len(want) {
		t.Fatalf("%d arrivals, want %d", len(got), len(want))
	}
	for k, a := range got {
		if d := a.Due.Sub(start); d != want[k]*time.Millisecond {
			t.Errorf("arrival %d due at +%v, want +%vms", k, d, want[k])
		}
	}
}

func TestMaxInFlightDrops(t *testing.T) {
	release := make(chan struct{})
	var dropped []int
	var mu sync.Mutex
	var started int
	last := make(chan struct{})
	done := make(chan error)
	go func() {
		done <- Schedule{Rate: 1000, Count: 10, MaxInFlight: 2}.Run(context.Background(), func(a Arrival) func() {
			if a.Dropped {
				dropped = append(dropped, a.N)
				if a.N == 9 {
					close(last)
				}
				return nil
			}
			return func() {
				mu.Lock()
				started++
				mu.Unlock()
				<-release
			}
		})
	}()
	<-last // the schedule is over; Run waits for the works
	select {
	case err := <-done:
		t.Fatalf("Run returned (%v) with works still running", err)
	default:
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if started != 2 || len(dropped) != 8 || dropped[0] != 2 || dropped[7] != 9 {
		t.Errorf("started %d, dropped %v; want 2 started and arrivals 2 to 9 dropped", started, dropped)
	}
}

func TestNilWorkFreesItsSlot(t *testing.T) {
	n := 0
	err := Schedule{Rate: 2000, Count: 20, MaxInFlight: 1}.Run(context.Background(), func(a Arrival) func() {
		if a.Dropped {
			t.Errorf("arrival %d dropped: no work ever ran", a.N)
		}
		n++
		return nil
	})
	if err != nil || n != 20 {
		t.Errorf("%d arrivals, %v", n, err)
	}
}

func TestContextStops(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Millisecond)
	defer cancel()
	begun := time.Now()
	got, _ := record(t, ctx, Schedule{Rate: 50, Count: 1000})
	if took := time.Since(begun); took > 2*time.Second || len(got) == 0 || len(got) > 5 {
		t.Errorf("%d arrivals in %v: want the context to stop the schedule at 60 ms", len(got), took)
	}
}

func TestBadSchedules(t *testing.T) {
	never := func(Arrival) func() { t.Error("an arrival on a bad schedule"); return nil }
	for name, s := range map[string]Schedule{
		"no rate":     {Count: 3},
		"negative":    {Rate: -1, Count: 3},
		"NaN":         {Rate: math.NaN(), Count: 3},
		"infinite":    {Rate: math.Inf(1), Count: 3},
		"unbounded":   {Rate: 10},
		"gap, no end": {Gap: func() time.Duration { return time.Millisecond }},
	} {
		if err := s.Run(context.Background(), never); err == nil {
			t.Errorf("%s: ran", name)
		}
	}
}
