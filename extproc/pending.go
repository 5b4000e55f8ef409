package extproc

import (
	"strings"
	"sync"
	"time"

	"github.com/tetherproxy/tether/affinity"
)

// pending counts the requests this process routed whose end it has not
// heard of yet: a stop waits for them (Server.Pending), so that how they
// ended still reaches the breaker, the metrics and the in-flight counts.
// Those whose end is reported apart (a ticket, in the access log or on an
// observing stream) and those whose end comes on their routing stream are
// counted apart: only the first may be heard by another replica. A request
// counts by the minute it was decided in and stops counting after
// affinity.FlightHorizon, so an end that never arrives (an access-log batch
// Envoy dropped, an Envoy restarted) does not hold every later stop to its
// drain timeout.
type pending struct {
	mu            sync.Mutex
	apart, stream *affinity.Flights
	newest        time.Time // the newest decision counted
}

func newPending() *pending {
	return &pending{apart: affinity.NewFlights(time.Now), stream: affinity.NewFlights(time.Now)}
}

// add counts n requests decided at at (negative: ended), reported apart
// or on their stream.
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
// heard yet: apart, those whose end is reported apart (Envoy's access
// log, an observing stream), which another replica may hear instead, as
// Envoy spreads its access-log streams over the replicas; stream, those
// whose end comes on their own routing stream.
func (s *Server) Pending() (apart, stream int) {
	p := s.pending
	p.mu.Lock()
	defer p.mu.Unlock()
	return max(p.apart.Sum(), 0), max(p.stream.Sum(), 0)
}

// own reports whether a ticket's id is one this process issued.
func (k *Tickets) own(id string) bool {
	rest, ok := strings.CutPrefix(id, k.issuer)
	return ok && strings.HasPrefix(rest, "-")
}

// LastDecision is when this process last routed a request (zero: never).
func (s *Server) LastDecision() time.Time {
	p := s.pending
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.newest
}
