package extproc

import (
	"context"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/identity"
)

// This file is a stream's life. Its first message fixes its kind. Then it
// moves between four states:
//
//	idle    ─decided──────────▶ routed
//	idle    ─askedBody────────▶ reading
//	reading ─any other event──▶ routed    the body came, or it will not
//	routed  ─answered─────────▶ ended     apart: stays; its ticket brings the end
//	routed  ─unanswered───────▶ ended     apart: stays
//	routed  ─lost, restarted──▶ ended
//	ended   ─restarted────────▶ idle
//
// An observing stream starts routed. next lists these moves; advance does
// what each means. On a stream, the pending counts change in advance alone.

// kind is what a stream does.
type kind uint8

const (
	unopened  kind = iota // no message yet
	inline                // routes its request; hears the end on its response headers
	apart                 // routes its request; a report brings the end, with the ticket
	observing             // an observing filter's: reports the end of a request routed elsewhere
)

// state is where a stream stands with its request.
type state uint8

const (
	idle    state = iota // no decision yet, or the decision failed
	reading              // decided; the reply asked for the body
	routed               // decided for good; the request's end is to come
	ended                // the decider heard the end (observing: the report is redeemed)
)

// event is what happens on a stream.
type event uint8

const (
	decided    event = iota // the request headers were routed
	askedBody               // the request headers were routed, and the body asked for
	gotBody                 // the body asked for arrived
	answered                // the response headers arrived
	unanswered              // the stream ended: no answer will come on it
	lost                    // apart: the reply with the ticket never reached Envoy
	restarted               // request headers again: the stream starts over
)

// exchange is what one stream remembers between its messages.
type exchange struct {
	kind     kind
	state    state
	start    time.Time         // when the request headers arrived
	decision affinity.Decision // reading, routed, ended: the request's decision
	failure  string            // idle: why the decision failed
	ticket   string            // observing: the observed request's ticket
	// What the audit records of the request, once its decision is final.
	requestID, user string
	id              identity.Identity
	// bodies is how the data plane sends bodies, from the first message's
	// protocol_config: a gateway's filter configures them, tether's own
	// Envoy sends none unless a reply asks.
	bodies bodies
	// held is, under FULL_DUPLEX_STREAMED, the request body read so far
	// while the headers reply waits for it to place the request.
	held    []byte
	holding bool
	// answer is the end of a streamed answer, where its usage is.
	answer tail
	// out backs the replies to one message.
	out [2]*extprocv3.ProcessingResponse
}

// open fixes a stream's kind from its first message. An observing filter
// sends in observability mode. A routing filter whose outcomes are
// reported apart marks its streams (ApartMarker).
func (s *Server) open(ctx context.Context, req *extprocv3.ProcessingRequest) exchange {
	b := bodiesOf(req.GetProtocolConfig())
	switch {
	case req.GetObservabilityMode():
		md := req.GetMetadataContext().GetFilterMetadata()[MetadataNamespace]
		return exchange{kind: observing, state: routed, ticket: ticketOf(md), bodies: b}
	case s.opts.Tickets != nil && marked(ctx):
		return exchange{kind: apart, bodies: b}
	}
	return exchange{kind: inline, bodies: b}
}

// next is the state after st on ev, one step. A pair not listed keeps the
// state. advance steps until the state stays, so one event may pass
// several states.
func next(k kind, st state, ev event) state {
	switch st {
	case idle:
		switch ev {
		case decided:
			return routed
		case askedBody:
			return reading
		}
	case reading:
		if ev != askedBody {
			return routed // the body came, or it will not
		}
	case routed:
		switch {
		case ev == lost, ev == restarted:
			return ended
		case k == apart: // its ticket brings its end
		case ev == answered, ev == unanswered:
			return ended
		}
	case ended:
		if ev == restarted {
			return idle
		}
	}
	return st
}

// advance moves ex on ev, and does what each step means. o is the answer,
// on answered; any other event ends the request unanswered.
func (s *Server) advance(ex *exchange, ev event, o observation) {
	if ev != answered {
		o = observation{none: true}
	}
	for {
		from, to := ex.state, next(ex.kind, ex.state, ev)
		if to == from {
			return
		}
		ex.state = to
		if n := count(ex.kind, from, to); n != 0 {
			s.pending.add(ex.decision.At, ex.kind == apart, n)
		}
		switch {
		case from == reading && ev != gotBody:
			s.rec.Content(ContentIncomplete)
			s.audit(ex)
		case to == routed:
			s.audit(ex) // the decision is final
		case to == ended && ex.kind == observing:
			o.ticket = ex.ticket
			s.redeem(o)
		case to == ended:
			s.finish(ex.decision, o)
		}
	}
}

// count is how a step changes the pending counts. A routing stream's
// decision counts from when it is made until the decider hears its end.
func count(k kind, from, to state) int {
	switch {
	case k == observing:
		return 0
	case from == idle && (to == reading || to == routed):
		return 1
	case to == ended:
		return -1
	}
	return 0
}

// audit records a decision once it is final.
func (s *Server) audit(ex *exchange) {
	if s.opts.Auditor != nil {
		s.opts.Auditor.Audit(ex.requestID, ex.user, ex.id, ex.decision, ex.start)
	}
}

// done says whether a stream has nothing more to hear. Process then ends
// it at once, rather than wait for Envoy to close it.
func (ex *exchange) done() bool {
	switch ex.kind {
	case apart: // nothing comes after the request headers, or the body they asked for
		return ex.state != reading
	case observing:
		return ex.state == ended
	}
	return false
}
