package extproc

import (
	"sync"
	"time"

	"github.com/tetherproxy/tether/affinity"
)

// pending counts the requests this process routed whose end it has not
// heard yet. A stop waits for them (Server.Pending), so how they ended
// still reaches the breaker, the metrics and the in-flight counts. Apart
// and inline requests count separately: another replica may hear an apart
// one's end. A request counts by the minute it was decided in, and stops
// counting after affinity.FlightHorizon. So an end that never arrives does
// not hold every later stop to its drain timeout. Envoy may drop an
// access-log batch, or restart.
type pending struct {
	mu            sync.Mutex
	apart, stream *affinity.Flights
	newest        time.Time // the newest decision counted
}

func newPending() *pending {
	return &pending{apart: affinity.NewFlights(time.Now), stream: affinity.NewFlights(time.Now)}
}

// add counts n requests decided at at, apart or inline. n < 0: their end
// was heard. It has two callers: a stream's advance, and redeem for a
// ticket this process issued.
func (p *pending) add(at time.Time, apart bool, n int) {
	p.mu.Lock()
	if n > 0 && at.After(p.newest) {
		p.newest = at
	}
	if apart {
		p.apart.Add(at, n)
	} else {
		p.stream.Add(at, n)
	}
	p.mu.Unlock()
}

// Pending is how many requests this process routed whose end it has not
// heard yet. apart counts those whose end a report brings. Another replica
// may hear it: Envoy spreads its access-log streams over the replicas.
// stream counts those whose end comes on their own routing stream.
func (s *Server) Pending() (apart, stream int) {
	p := s.pending
	p.mu.Lock()
	defer p.mu.Unlock()
	return max(p.apart.Sum(), 0), max(p.stream.Sum(), 0)
}

// LastDecision is when this process last routed a request (zero: never).
func (s *Server) LastDecision() time.Time {
	p := s.pending
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.newest
}
