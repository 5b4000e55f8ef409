// Package pace sends load open loop.
//   - Arrivals come on a schedule: evenly spaced at a rate, or at gaps the
//     caller draws.
//   - Each starts on its own goroutine, so a slow answer never delays the
//     next arrival.
//   - The work in flight is bounded.
//   - The schedule is bounded in count and in time, and stops by itself.
//
// The tests and the lab all pace their load with it: loadgen, bench and
// the chaos harness.
//
// An arrival's latency is best measured from its Due time, not from when
// its work started. A sender that falls behind then shows as latency
// instead of hiding it.
package pace

import (
	"context"
	"errors"
	"math"
	"sync"
	"time"
)

// Schedule says when arrivals are due.
type Schedule struct {
	// Rate spaces the arrivals evenly. Arrival n is due at Start + n/Rate.
	Rate float64
	// Gap, when set, replaces Rate. It is called for the wait before each
	// arrival, the first included. The exponential gaps of a Poisson
	// process are one use.
	Gap func() time.Duration
	// Count bounds the arrivals. 0 means no bound but For.
	Count int
	// For bounds the schedule in time. No arrival is due at or after
	// Start + For. 0 means no bound but Count. One of them must be set.
	For time.Duration
	// Start is the schedule's origin. The zero time means when Run starts.
	Start time.Time
	// MaxInFlight bounds the work running at once. An arrival due while
	// MaxInFlight works run is dropped. 0 means no bound.
	MaxInFlight int
}

// Arrival is one arrival of a schedule.
type Arrival struct {
	N       int           // 0, 1, 2 … in schedule order
	Due     time.Time     // when it was due
	Late    time.Duration // how long after Due the pacer got to it
	Dropped bool          // MaxInFlight works were running: none is started for it
}

// Run waits for each arrival in turn and calls next(a) on its own
// goroutine, in schedule order. So next may keep state without a lock.
// Unless a.Dropped, the function next returns runs on a new goroutine. A
// nil function means nothing to run. Run stops at the schedule's bounds or
// when ctx ends. It returns once every work it started has returned. It
// fails at once on a schedule with no rate or no bound.
func (s Schedule) Run(ctx context.Context, next func(Arrival) func()) error {
	switch {
	case s.Gap == nil && (!(s.Rate > 0) || math.IsInf(s.Rate, 0)):
		return errors.New("pace: a schedule needs a rate above 0, or a gap")
	case s.Count <= 0 && s.For <= 0:
		return errors.New("pace: a schedule needs a count or a duration")
	}
	if s.Start.IsZero() {
		s.Start = time.Now()
	}
	interval := time.Duration(0)
	if s.Gap == nil {
		interval = time.Duration(float64(time.Second) / s.Rate)
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	var inFlight chan struct{}
	if s.MaxInFlight > 0 {
		inFlight = make(chan struct{}, s.MaxInFlight)
	}
	timer := time.NewTimer(time.Hour) // Reset before every wait
	defer timer.Stop()
	var offset time.Duration
	for n := 0; s.Count <= 0 || n < s.Count; n++ {
		if s.Gap != nil {
			offset += s.Gap()
		} else {
			offset = time.Duration(n) * interval
		}
		if s.For > 0 && offset >= s.For {
			return nil
		}
		due := s.Start.Add(offset)
		timer.Reset(time.Until(due))
		select {
		case <-ctx.Done():
			return nil
		case <-timer.C:
		}
		if ctx.Err() != nil { // both were ready
			return nil
		}
		a := Arrival{N: n, Due: due, Late: time.Since(due)}
		if inFlight != nil {
			select {
			case inFlight <- struct{}{}:
			default:
				a.Dropped = true
			}
		}
		work := next(a)
		switch {
		case a.Dropped:
		case work == nil:
			if inFlight != nil {
				<-inFlight
			}
		default:
			wg.Go(func() {
				if inFlight != nil {
					defer func() { <-inFlight }()
				}
				work()
			})
		}
	}
	return nil
}
