package extproc

import (
	"errors"
	"strconv"
	"sync"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/fleet"
)

// This file is how a request ended reaching the decider and the metrics
// when it arrives apart from the blocking exchange: from Envoy's access
// log (accesslog.go) or from an observing ext_proc filter (Process). Both
// hand settle an ending, with the ticket the routing reply put in the
// request's dynamic metadata.

// Outcome results, as the recorder counts them.
const (
	OutcomeApplied   = "applied"   // the decider and the metrics heard it
	OutcomeUndecided = "undecided" // no ticket: tether did not decide the request (fail-open, refused, not routed by tether)
	OutcomeMalformed = "malformed" // a ticket that does not parse
	OutcomeForged    = "forged"    // a ticket without this deployment's signature
	OutcomeLate      = "late"      // decided longer ago than a request counts as in flight
	OutcomeDuplicate = "duplicate" // this ticket's outcome was applied already
)

// getter reads a header (ext_proc's list, the access log's map).
type getter interface{ Get(string) string }

// ending is how one request ended, as Envoy reported it.
type ending struct {
	ticket     string
	none       bool // the request ended without response headers
	status     int
	upstream   upstream // the host that answered
	overloaded bool     // Envoy's circuit breaker turned the request away
	headers    getter   // nil: none
	// elapsed is the time to the instance's response headers; 0: since
	// the decision, by this replica's clock.
	elapsed time.Duration
}

// settle applies e to the decision its ticket carries: once per ticket on
// this replica, never for a request tether did not decide, and within the
// horizon a request counts as in flight (affinity.FlightHorizon).
func (s *Server) settle(e ending) {
	t, err := s.opts.Tickets.read(e.ticket)
	if err != nil {
		s.rec.Outcome(outcomeOf(err))
		return
	}
	now := time.Now()
	if age := now.Sub(t.at); age > affinity.FlightHorizon || age < -time.Minute {
		s.rec.Outcome(OutcomeLate)
		return
	}
	if !s.seen.add(t.id, now) {
		s.rec.Outcome(OutcomeDuplicate)
		return
	}
	in, ok := s.opts.Instances.Lookup(t.instance)
	if !ok {
		in = fleet.Instance{Name: t.instance} // removed since: its request still ends
	}
	if e.elapsed == 0 {
		e.elapsed = max(now.Sub(t.at), 0)
	}
	s.rec.Outcome(OutcomeApplied)
	s.finish(t.decision(in), e)
}

// finish tells the recorder and the decider how d's request ended.
func (s *Server) finish(d affinity.Decision, e ending) {
	if e.none {
		// No answer at all: the client went away, or the request never
		// left Envoy. It says nothing about the instance.
		s.decider.Finish(d, affinity.Answer{})
		return
	}
	if e.headers == nil {
		e.headers = headers(nil)
	}
	peer := e.upstream.elsewhere(d.Instance.Address)
	// Envoy's own replies that never reached an instance say nothing
	// about it: neither a failure nor, for a half-open circuit, the good
	// answer that would close it.
	neutral := !peer && (e.upstream.none() || e.overloaded)
	rep := s.reports(e.headers, e.status)
	rep.Elapsed, rep.Served, rep.Peer = e.elapsed, !neutral, peer
	s.rec.Response(d, rep.Reply)
	s.decider.Finish(d, affinity.Answer{
		Answered: !neutral, Failed: peer || (!neutral && failed(e.status)),
		// A peer's queue depth is not the instance's.
		Queue: rep.queue, QueueKnown: rep.queueKnown && !peer && !neutral,
	})
}

func outcomeOf(err error) string {
	switch {
	case errors.Is(err, errNoTicket):
		return OutcomeUndecided
	case errors.Is(err, errForged):
		return OutcomeForged
	}
	return OutcomeMalformed
}

// seenTickets remembers the tickets applied within one to two flight
// horizons, at most 2 × seenMax of them (some 40 bytes each): a duplicate of
// one of them is refused, so below seenMax / FlightHorizon (about 145) reports a
// second per replica every duplicate of a ticket still in flight is;
// memory stays bounded whatever arrives.
type seenTickets struct {
	mu        sync.Mutex
	cur, prev map[string]struct{}
	since     time.Time
}

const (
	seenWindow = affinity.FlightHorizon
	seenMax    = 1 << 17
)

// add reports whether id is new, and remembers it.
func (s *seenTickets) add(id string, now time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cur == nil || now.Sub(s.since) >= seenWindow || len(s.cur) >= seenMax {
		s.prev, s.cur, s.since = s.cur, make(map[string]struct{}, len(s.cur)), now
	}
	if _, ok := s.cur[id]; ok {
		return false
	}
	if _, ok := s.prev[id]; ok {
		return false
	}
	s.cur[id] = struct{}{}
	return true
}

// statusOf reads an HTTP status ("" or unreadable: 0).
func statusOf(v string) int {
	n, _ := strconv.Atoi(v)
	return n
}
