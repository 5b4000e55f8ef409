package engine

import (
	"math"
	"sync"
	"time"

	"github.com/tetherproxy/tether/fleet"
)

// Tracker turns successive samples of each instance into readings with
// rates. Safe for concurrent use.
type Tracker struct {
	mu   sync.Mutex
	last map[string]observation
}

type observation struct {
	s  Sample
	at time.Time
}

// NewTracker returns a Tracker that has seen nothing.
func NewTracker() *Tracker {
	return &Tracker{last: make(map[string]observation)}
}

// Observe returns the reading of s taken at at, with the rates since the
// instance's sample before. There are no rates, and RatesKnown is false:
//
//   - for the first sample of an instance;
//   - when at is not after the sample before, which stays the reference;
//   - when the number of engines changed, or whether the prefix counters
//     are known;
//   - when a counter went backwards, as on an engine restart.
//
// In the last case the error is an *Error with ReasonCounterReset. The
// reading is still valid and should be used. A rate is never negative.
func (t *Tracker) Observe(instance string, s Sample, at time.Time) (fleet.EngineReading, error) {
	r := s.EngineReading
	r.At = at
	r.HitRate, r.QueryRate, r.PreemptionRate, r.RatesKnown = 0, 0, 0, false
	t.mu.Lock()
	prev, seen := t.last[instance]
	if seen && !at.After(prev.at) {
		t.mu.Unlock()
		return r, nil
	}
	t.last[instance] = observation{s: s, at: at}
	t.mu.Unlock()

	if !seen || prev.s.Engines != s.Engines || prev.s.PrefixKnown != s.PrefixKnown {
		return r, nil
	}
	if what, was, is := backwards(prev.s, s); what != "" {
		return r, errorf(ReasonCounterReset, "instance %s: %s went from %v to %v", instance, what, was, is)
	}
	dt := at.Sub(prev.at).Seconds()
	r.PreemptionRate = (s.Preemptions - prev.s.Preemptions) / dt
	if s.PrefixKnown {
		r.HitRate = (s.PrefixHits - prev.s.PrefixHits) / dt
		r.QueryRate = (s.PrefixQueries - prev.s.PrefixQueries) / dt
	}
	r.RatesKnown = rate(r.PreemptionRate) && rate(r.HitRate) && rate(r.QueryRate)
	if !r.RatesKnown {
		r.PreemptionRate, r.HitRate, r.QueryRate = 0, 0, 0
	}
	return r, nil
}

// Forget drops what the Tracker knows of instance, as when it leaves the
// fleet. Its next sample is a first one.
func (t *Tracker) Forget(instance string) {
	t.mu.Lock()
	delete(t.last, instance)
	t.mu.Unlock()
}

// backwards names the first counter lower in s than in prev.
func backwards(prev, s Sample) (what string, was, is float64) {
	switch {
	case s.Preemptions < prev.Preemptions:
		return "preemptions", prev.Preemptions, s.Preemptions
	case s.PrefixKnown && s.PrefixQueries < prev.PrefixQueries:
		return "prefix-cache query tokens", prev.PrefixQueries, s.PrefixQueries
	case s.PrefixKnown && s.PrefixHits < prev.PrefixHits:
		return "prefix-cache hit tokens", prev.PrefixHits, s.PrefixHits
	}
	return "", 0, 0
}

func rate(v float64) bool { return v >= 0 && !math.IsInf(v, 0) }
