package affinity

import (
	"testing"
	"time"
)

// TestFlightsHorizon: a request whose end is never heard of stops counting
// FlightHorizon after its decision; an end heard later changes nothing; a
// decision stamped far ahead counts nowhere.
func TestFlightsHorizon(t *testing.T) {
	now := time.Date(2026, 12, 2, 9, 0, 30, 0, time.UTC)
	l := NewLoad()
	l.now = func() time.Time { return now }
	t0 := now
	l.Begin("a", t0)
	l.Begin("a", t0)
	if got := l.InFlight("a"); got != 2 {
		t.Fatalf("in flight %d, want 2", got)
	}
	now = t0.Add(FlightHorizon - time.Minute)
	if got := l.InFlight("a"); got != 2 {
		t.Fatalf("within the horizon: %d, want 2", got)
	}
	now = t0.Add(FlightHorizon + time.Minute)
	if got := l.InFlight("a"); got != 0 {
		t.Fatalf("past the horizon: %d, want 0", got)
	}
	l.End("a", t0, 0, false) // a late report
	if got := l.localFlight("a"); got != 0 {
		t.Fatalf("a late end moved the count to %d", got)
	}
	if fl := l.localFlights(); len(fl) != 0 {
		t.Fatalf("expired counts still reported: %v", fl)
	}
	l.Begin("a", now.Add(time.Hour)) // a clock far ahead
	if got := l.localFlight("a"); got != 0 {
		t.Fatalf("a decision an hour ahead counts %d", got)
	}
}

// TestFlightsAcrossReplicas: the outcome of a request replica 1 decided
// reaches replica 2; each replica's own count is off by one, their sum
// (what the load sync adds up) is right, and neither reads below zero.
func TestFlightsAcrossReplicas(t *testing.T) {
	now := time.Now()
	r1, r2 := NewLoad(), NewLoad()
	r1.Begin("a", now)
	r2.End("a", now, 3, true)
	if a, b := r1.localFlights()["a"], r2.localFlights()["a"]; a != 1 || b != -1 || a+b != 0 {
		t.Fatalf("local counts %d and %d, want 1 and -1", a, b)
	}
	if got := r2.InFlight("a"); got != 0 {
		t.Fatalf("replica 2 reads %d in flight, want 0 (never below)", got)
	}
	if q := r2.Queue("a"); q != 3 {
		t.Fatalf("replica 2 heard queue depth %d, want 3", q)
	}
}
