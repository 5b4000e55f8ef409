package extproc

import (
	"errors"
	"strconv"
	"sync"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/fleet"
)

// This file brings how a request ended to the decider and the metrics.
// Envoy tells it in one of three ways, chosen by envoy.outcomes:
//   - inline: the routing stream's response headers (onResponseHeaders);
//   - access_log: an entry of Envoy's access log (accesslog.go);
//   - observe: an observing filter's stream (Server.observe).
//
// Each gives an observation, and finish reads it against the decision.
// The last two arrive apart from the routing stream, with its ticket.
// redeem first finds the decision in the ticket.

// The results of redeeming an outcome report, as the recorder counts them
// (tether_outcomes_total).
const (
	ReportApplied   = "applied"   // the decider and the metrics heard it
	ReportUndecided = "undecided" // no ticket: tether did not decide the request
	ReportMalformed = "malformed" // a ticket that does not parse
	ReportForged    = "forged"    // a ticket without this deployment's signature
	ReportLate      = "late"      // decided longer ago than a request counts as in flight
	ReportDuplicate = "duplicate" // this ticket's outcome was applied already
)

// getter reads a header (ext_proc's list, the access log's map).
type getter interface{ Get(string) string }

// observation is how one request ended, as Envoy reported it. finish
// reads it against the decision.
type observation struct {
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

// redeem finishes the decision o's ticket carries. It does so once per
// ticket on this replica, and only within affinity.FlightHorizon. A report
// without a valid ticket is only counted.
func (s *Server) redeem(o observation) {
	t, err := s.opts.Tickets.read(o.ticket)
	if err != nil {
		s.rec.Reported(reportOf(err))
		return
	}
	now := time.Now()
	if age := now.Sub(t.at); age > affinity.FlightHorizon || age < -time.Minute {
		s.rec.Reported(ReportLate)
		return
	}
	if !s.seen.add(t.id, now) {
		s.rec.Reported(ReportDuplicate)
		return
	}
	in, ok := s.opts.Instances.Lookup(t.instance)
	if !ok {
		in = fleet.Instance{Name: t.instance} // removed since: its request still ends
	}
	if o.elapsed == 0 {
		o.elapsed = max(now.Sub(t.at), 0)
	}
	s.rec.Reported(ReportApplied)
	if s.opts.Tickets.own(t.id) {
		s.pending.add(t.at, true, -1)
	}
	s.finish(t.decision(in), o)
}

// finish reads o against the decision d its request was routed by, and
// tells the recorder and the decider how the request ended.
func (s *Server) finish(d affinity.Decision, o observation) {
	if o.none {
		// No answer at all: the client went away, or the request never
		// left Envoy. It says nothing about the instance.
		s.decider.Finish(d, fleet.Outcome{})
		return
	}
	if o.headers == nil {
		o.headers = headers{}
	}
	peer := o.upstream.elsewhere(d.Instance.Address)
	// Envoy's own replies that never reached an instance say nothing
	// about it: neither a failure nor, for a half-open circuit, the good
	// answer that would close it.
	neutral := !peer && (o.upstream.none() || o.overloaded)
	out := s.readReports(o.headers, o.status)
	out.Elapsed, out.Answered, out.Peer = o.elapsed, !neutral, peer
	out.Failed = peer || (!neutral && failed(o.status))
	// A peer's queue depth is not the instance's.
	out.QueueKnown = out.QueueKnown && !peer && !neutral
	s.rec.Response(d, out)
	s.decider.Finish(d, out)
}

func reportOf(err error) string {
	switch {
	case errors.Is(err, errNoTicket):
		return ReportUndecided
	case errors.Is(err, errForged):
		return ReportForged
	}
	return ReportMalformed
}

// seenTickets remembers the tickets applied in the last one to two flight
// horizons, and refuses their duplicates. It holds at most 2 × seenMax of
// them, some 40 bytes each: memory stays bounded whatever arrives. Below
// seenMax / FlightHorizon reports a second per replica (about 145), every
// duplicate of a ticket in flight is caught.
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
