// Package extproc is Envoy's external processor. Envoy opens one gRPC
// stream per HTTP request. Its request headers go through identity, then
// the decision, and come back as the routing header. How it ended reaches
// the decider as a fleet.Outcome. Envoy protos stop here: the decision core
// sees plain structs.
package extproc

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/rs/zerolog"
	"google.golang.org/grpc/codes"
	grpcmd "google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/prefix"
)

// Identifier extracts the caller's identity.
type Identifier interface {
	Extract(identity.Headers) identity.Identity
}

// Decider picks the instance, and hears how the request ended.
type Decider interface {
	Decide(context.Context, affinity.Request) (affinity.Decision, error)
	// Refine places a decision whose placement is open (Decision.Open)
	// by its prompt's chained block hashes.
	Refine(ctx context.Context, d affinity.Decision, chain []uint64) affinity.Decision
	// Finish is called once per decision with how the request ended.
	Finish(d affinity.Decision, o fleet.Outcome)
}

// Recorder counts what happens.
type Recorder interface {
	Decision(identity.Identity, affinity.Decision, time.Duration)
	DecisionFailed(id identity.Identity, reason string)
	// Response records how a decided request ended, when it had
	// response headers.
	Response(d affinity.Decision, o fleet.Outcome)
	// Reported counts an outcome report that arrived apart from its
	// stream, by result (ReportApplied, ReportDuplicate, ...).
	Reported(result string)
	// Content counts a decision whose placement was open, by what its
	// body did (ContentPlaced, ContentIdentity, a prefix.Reason, ...).
	Content(result string)
	// Usage records what the engine reported of a decided request's
	// prompt at the end of a streamed answer (Usage): its tokens, and
	// those its KV cache held. ok is false when the answer ended without a
	// usage object tether could read.
	Usage(d affinity.Decision, prompt, cached int, ok bool)
}

// Prompts turns a request's body into its prompt's chained block hashes
// (prefix.Hasher), or the reason it has none.
type Prompts interface {
	Chain(dst []uint64, body []byte) ([]uint64, prefix.Reason)
}

// What became of a decision whose placement was open (Recorder.Content),
// besides the prefix.Reason of a body that gave no prompt.
const (
	// ContentPlaced: placed by what the caches hold of the prompt, weighed
	// against each instance's work. It may be where identity placed it.
	ContentPlaced = "placed"
	// ContentIdentity: the prompt was read, but no instance holds enough
	// of it. Identity placement stands.
	ContentIdentity = "identity"
	// ContentOverLimit: the body was longer than Envoy's buffer for it.
	ContentOverLimit = "over_limit"
	// ContentEncoded: the body is compressed, so it is not asked for.
	ContentEncoded = "encoded"
	// ContentIncomplete: the body never arrived. The client left, or Envoy
	// refused the mode override.
	ContentIncomplete = "incomplete"
)

// Instances looks up an instance (fleet.Fleet): by name for a ticket, by
// address for a gateway's subset hint.
type Instances interface {
	Lookup(name string) (fleet.Instance, bool)
	AtAddress(addr string) (fleet.Instance, bool)
}

// Auditor hears every decision, for the routing audit. Audit must not
// block: it runs on the request path.
type Auditor interface {
	// Audit records one decision. requestID is Envoy's x-request-id as
	// received, and userID the raw user header. Either may be empty.
	// Neither has been checked.
	Audit(requestID, userID string, id identity.Identity, d affinity.Decision, at time.Time)
}

// Options configure the Server.
type Options struct {
	ClusterHeader string  // request header Envoy routes on
	UserHeader    string  // request header holding the user id, for the audit
	Auditor       Auditor // nil: no routing audit
	QueueHeader   string  // response header in which instances report their queue depth
	OOMHeader     string  // response header in which instances report running out of memory ("true"/"1")
	GPUHeader     string  // response header in which instances report GPU utilisation in percent (0–100)
	DebugHeaders  bool    // add x-tether-instance / x-tether-decision to responses
	Logger        zerolog.Logger
	// Tickets serves apart streams: those that carry ApartMarker. Each
	// decision's ticket goes in the routing reply's dynamic metadata. The
	// report that brings it back finishes the decision: an access-log
	// entry, or an observing stream. nil: every routing stream is inline.
	Tickets *Tickets
	// Instances resolves a ticket's instance and a subset hint's
	// endpoints. It is required with Tickets. nil: a subset hint names
	// nothing.
	Instances Instances
	// Fallbacks is how many instances a routing reply names after its own
	// in HeaderDestination, for a gateway's retries (DefaultFallbacks).
	Fallbacks int
	// Prompts reads the prompt of a request whose placement is open, such
	// as a new session. The headers reply routes by identity and asks
	// Envoy for the body. The reply to the body routes where Refine places
	// it. nil: never a body.
	Prompts Prompts
	// MaxBody is the longest body read (content.max_body_bytes). Envoy
	// bounds what it buffers. But a body that arrived whole before the
	// headers reply comes in one piece, however long.
	MaxBody int
}

// Debug response headers.
const (
	HeaderInstance = "x-tether-instance"
	HeaderDecision = "x-tether-decision"
)

// The headers the handler reads by their own names, besides those Options
// name and those its Identifier and Decider read.
const (
	HeaderPath            = ":path"              // the path routing rules match on
	HeaderRequestID       = "x-request-id"       // logs and the audit
	HeaderContentLength   = "content-length"     // a body to ask for (Options.Prompts)
	HeaderContentEncoding = "content-encoding"   // a body it could read
	HeaderStatus          = ":status"            // how the request ended
	HeaderOverloaded      = "x-envoy-overloaded" // Envoy's circuit breaker turned it away
)

// RequestHeaders are the request headers the handler reads itself: the
// path, the request id and the user header for the audit. Its Identifier
// and Decider declare their own. bodies says it may ask for a body:
// Prompts is set, and the policy places by content. It then also reads
// whether the body is there and readable. Envoy need send no other
// (forward_rules).
func (o Options) RequestHeaders(bodies bool) []string {
	out := []string{HeaderPath, HeaderRequestID, o.UserHeader}
	if bodies {
		out = append(out, HeaderContentLength, HeaderContentEncoding)
	}
	return out
}

// ResponseHeaders are the response headers the handler reads: the status,
// Envoy's overload mark and the instances' reports. They come on an
// inline stream or an observing one.
func (o Options) ResponseHeaders() []string {
	return []string{HeaderStatus, HeaderOverloaded, o.QueueHeader, o.OOMHeader, o.GPUHeader}
}

// Server implements envoy.service.ext_proc.v3.ExternalProcessor.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer
	ids     Identifier
	decider Decider
	rec     Recorder
	opts    Options
	// warn logs per-request trouble at most a few lines a second. A store
	// outage fails every request; the metrics count each.
	warn    zerolog.Logger
	seen    seenTickets // outcomes applied lately, against duplicates
	pending *pending    // requests routed here whose end is still to come
	// read hears the name of every header the handler reads (tests).
	read func(name string)
	// What the replies share: the routing header's mutation per instance,
	// and the response phase's reply without debug headers.
	routes *routes
	plain  *extprocv3.ProcessingResponse
}

// New returns a Server.
func New(ids Identifier, decider Decider, rec Recorder, opts Options) *Server {
	warn := opts.Logger.Sample(&zerolog.BurstSampler{Burst: 5, Period: time.Second})
	return &Server{ids: ids, decider: decider, rec: rec, opts: opts, warn: warn,
		routes: newRoutes(opts.ClusterHeader), plain: annotateResponse(), pending: newPending()}
}

// Process serves one stream: one HTTP request, routed or observed. Each
// message moves the stream on (stream.go). The stream's end ends whatever
// it still awaited.
func (s *Server) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	ctx := stream.Context()
	var ex exchange
	defer s.advance(&ex, unanswered, observation{})
	for {
		req, err := stream.Recv()
		if errors.Is(err, io.EOF) || status.Code(err) == codes.Canceled {
			return nil
		}
		if err != nil {
			return err
		}
		if ex.kind == unopened {
			ex = s.open(ctx, req)
		}
		resps, err := s.reply(ctx, &ex, req)
		if err != nil {
			return err
		}
		for _, resp := range resps {
			if err := stream.Send(resp); err != nil {
				s.unsent(&ex, req)
				return err
			}
		}
		if ex.done() {
			return nil
		}
	}
}

// errNoPhase ends a stream whose message has no phase.
var errNoPhase = status.Error(codes.InvalidArgument, "processing request carries no known phase")

// reply handles one message and returns its replies. A message in
// observability mode gets none: Envoy does not read it. Under
// FULL_DUPLEX_STREAMED a request whose body places it gets none until the
// body has come, then two: the headers reply and the body.
func (s *Server) reply(ctx context.Context, ex *exchange, req *extprocv3.ProcessingRequest) ([]*extprocv3.ProcessingResponse, error) {
	var resp *extprocv3.ProcessingResponse
	switch {
	case req.GetObservabilityMode():
		if ex.kind == observing {
			s.observe(ex, req)
		}
		return nil, nil
	case ex.kind == observing: // it sends in observability mode only: let anything else through
		resp = continueOther(req)
	case req.GetRequestBody() != nil && ex.bodies.duplex():
		return s.onStreamedBody(ctx, req.GetRequestBody(), ex), nil
	case req.GetRequestTrailers() != nil && ex.holding:
		// Trailers end the body: it places the request, and they follow.
		resps := s.release(ctx, ex, true, false)
		return append(resps, continueOther(req)), nil
	default:
		resp = s.route(ctx, ex, req)
	}
	switch {
	case resp == nil && ex.holding:
		return nil, nil // the headers reply waits for the body
	case resp == nil:
		return nil, errNoPhase
	}
	ex.out[0] = resp
	return ex.out[:1], nil
}

// route answers a routing stream's message by its phase. A phase it does
// nothing with gets an empty reply. nil: no phase.
func (s *Server) route(ctx context.Context, ex *exchange, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
	switch r := req.Request.(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return s.onRequestHeaders(ctx, r.RequestHeaders, req.GetMetadataContext(), ex)
	case *extprocv3.ProcessingRequest_RequestBody:
		return s.onRequestBody(ctx, r.RequestBody, ex)
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return s.onResponseHeaders(r.ResponseHeaders, upstreamOf(req), ex)
	case *extprocv3.ProcessingRequest_ResponseBody:
		if ex.bodies.duplexResponse() {
			s.readUsage(ex, r.ResponseBody)
			return echoResponse(r.ResponseBody.GetBody(), r.ResponseBody.GetEndOfStream())
		}
	}
	return continueOther(req)
}

// readUsage keeps the end of a decided request's streamed answer. At the
// answer's end it records the usage the engine reported there.
func (s *Server) readUsage(ex *exchange, msg *extprocv3.HttpBody) {
	if ex.decision.Instance.Name == "" {
		return
	}
	ex.answer.add(msg.GetBody())
	if msg.GetEndOfStream() {
		u, ok := usageOf(ex.answer.b)
		s.rec.Usage(ex.decision, u.Prompt, u.Cached, ok)
		ex.answer.b = nil
	}
}

// unsent handles a reply that never reached Envoy. On an apart stream, a
// lost request-headers reply is a lost ticket: no report will bring the
// end, so the stream ends the decision. A later reply's loss leaves Envoy
// the first reply's ticket.
func (s *Server) unsent(ex *exchange, req *extprocv3.ProcessingRequest) {
	if _, headers := req.Request.(*extprocv3.ProcessingRequest_RequestHeaders); headers && ex.kind == apart {
		s.advance(ex, lost, observation{})
	}
}

// onRequestHeaders: headers → identity → decision → routing header. md is
// the request's metadata, where a gateway may send a subset hint.
func (s *Server) onRequestHeaders(ctx context.Context, msg *extprocv3.HttpHeaders, md *corev3.Metadata, ex *exchange) *extprocv3.ProcessingResponse {
	s.advance(ex, restarted, observation{}) // Envoy sends one; a second ends the first request unanswered
	start := time.Now()
	*ex = exchange{kind: ex.kind, state: ex.state, bodies: ex.bodies, start: start} // a new request: forget the last
	h := s.headers(msg)
	var hi identity.Headers = h // boxed once for both
	id := s.ids.Extract(hi)
	subset, hinted, err := s.subsetOf(md.GetFilterMetadata())
	if err == nil && hinted && len(subset) == 0 {
		err = affinity.ErrNoEligible // no endpoint of the hint is one tether knows
	}
	var d affinity.Decision
	if err == nil {
		d, err = s.decider.Decide(ctx, affinity.Request{ID: id, Path: h.Get(HeaderPath), Headers: hi, Subset: subset, Fallbacks: s.opts.Fallbacks})
	}
	if err != nil {
		return s.undecided(ex, h, id, err, hinted)
	}
	s.rec.Decision(id, d, time.Since(start))
	ex.decision = d
	ev := decided
	if d.Open && s.opts.Prompts != nil && s.wantBody(h, msg.GetEndOfStream(), ex.bodies) {
		ev = askedBody // audited once the body places it
	}
	if s.opts.Auditor != nil {
		ex.requestID, ex.user, ex.id = h.Get(HeaderRequestID), h.Get(s.opts.UserHeader), id
	}
	s.advance(ex, ev, observation{})
	if d.Err != nil {
		s.warn.Warn().Err(d.Err).Str("session", id.Key).Msg("binding store failed; placed by rendezvous hashing")
	}
	if e := s.opts.Logger.Debug(); e.Enabled() {
		e.Str("request_id", requestID(h)).Str("session", id.Key).Str("source", string(id.Source)).
			Str("instance", d.Instance.Name).Str("decision", string(d.Kind)).Msg("routed")
	}
	switch {
	case ev == askedBody && ex.bodies.duplex():
		ex.holding = true // the body comes next, and places the request
		return nil
	case ev == askedBody && !ex.bodies.sent():
		return readBody(s.mutation(&d), s.metadata(ex, &d), ex.kind == apart)
	}
	return routeTo(s.mutation(&d), s.metadata(ex, &d))
}

// mutation is the routing reply's headers for d: tether's routing header
// and the gateway's destination. Without fallbacks they are the same for
// every request to the instance, and shared.
func (s *Server) mutation(d *affinity.Decision) *extprocv3.HeaderMutation {
	if len(d.Fallbacks) == 0 || d.Instance.Address == "" {
		return s.routes.mutation(d.Instance)
	}
	return setHeaders(header{s.routes.header, d.Instance.Cluster()}, header{HeaderDestination, destination(d)})
}

// undecided answers request headers the decider could not place. Most go
// on to Envoy's default route, without a destination a client set. A
// gateway's request with no eligible endpoint, and two failures of
// policy, refuse the request instead. hinted: the gateway sent a subset
// hint.
func (s *Server) undecided(ex *exchange, h headers, id identity.Identity, err error, hinted bool) *extprocv3.ProcessingResponse {
	ex.failure = failureReason(err)
	s.rec.DecisionFailed(id, ex.failure)
	switch {
	case errors.Is(err, errBadSubset), errors.Is(err, affinity.ErrNoEligible),
		hinted && errors.Is(err, affinity.ErrNoInstance):
		// The endpoint picker protocol: the pick must come from the hint.
		s.warn.Warn().Err(err).Str("request_id", requestID(h)).Msg("refused: no eligible endpoint in the gateway's subset")
		return s.refused(ex, h, id, err.Error()+"\n")
	case errors.Is(err, affinity.ErrNoVersion):
		// Strict version affinity: the default route would change the
		// session's model.
		s.warn.Warn().Err(err).Str("request_id", requestID(h)).Msg("refused: no instance of the session's model version")
		return s.refused(ex, h, id, err.Error()+" (version_affinity = \"strict\")\n")
	case errors.Is(err, affinity.ErrInstanceUnavailable):
		// fallback_policy = "none": the operator wants a clear failure
		// rather than the session on another instance.
		s.warn.Warn().Err(err).Str("request_id", requestID(h)).Msg("refused: the session's instance is unavailable")
		return s.refused(ex, h, id, err.Error()+"; retry when it recovers\n")
	}
	s.warn.Warn().Err(err).Str("request_id", requestID(h)).Msg("no decision; Envoy uses its default route")
	return unrouted(s.metadata(ex, nil))
}

// refused answers request headers with a 503. The routing audit records
// the request, its decision "refused:" and the failure's reason.
func (s *Server) refused(ex *exchange, h headers, id identity.Identity, body string) *extprocv3.ProcessingResponse {
	if s.opts.Auditor != nil {
		d := affinity.Decision{Kind: affinity.Kind("refused:" + ex.failure)}
		s.opts.Auditor.Audit(h.Get(HeaderRequestID), h.Get(s.opts.UserHeader), id, d, ex.start)
	}
	return refuse(503, body)
}

// wantBody says whether a request whose placement is open may have its
// body read. Not when it has none: its headers end the stream. Not when
// the data plane streams it in chunks a reply cannot answer with a route.
// Not when it is compressed: that is counted.
func (s *Server) wantBody(h headers, end bool, b bodies) bool {
	if end || h.Get(HeaderContentLength) == "0" || b.sent() && !b.whole() && !b.duplex() {
		return false
	}
	if enc := h.Get(HeaderContentEncoding); enc != "" && !strings.EqualFold(enc, "identity") {
		s.rec.Content(ContentEncoded)
		return false
	}
	return true
}

// onRequestBody: the body the headers reply asked for → its prompt →
// Refine → the routing header again, where it moved. A body not asked for
// is let through.
func (s *Server) onRequestBody(ctx context.Context, msg *extprocv3.HttpBody, ex *exchange) *extprocv3.ProcessingResponse {
	if ex.state != reading {
		return rerouteTo(nil, nil)
	}
	d := ex.decision
	next, result := d, ContentOverLimit // BUFFERED_PARTIAL sends what fit in Envoy's buffer
	if msg.GetEndOfStream() {
		next, result = s.place(ctx, d, msg.GetBody())
	}
	ex.decision = next
	s.rec.Content(result)
	s.advance(ex, gotBody, observation{})
	if !next.ByContent || next.Instance.Name == d.Instance.Name {
		return rerouteTo(nil, nil)
	}
	if e := s.opts.Logger.Debug(); e.Enabled() {
		e.Str("session", next.Key).Str("from", d.Instance.Name).Str("instance", next.Instance.Name).
			Int("blocks", next.Matched).Msg("placed by content")
	}
	return rerouteTo(s.mutation(&next), s.metadata(ex, &next))
}

// onStreamedBody answers a request body chunk under FULL_DUPLEX_STREAMED.
// A request already routed gets the chunk back at once. One whose headers
// reply waits collects its body; at its end, or past MaxBody, the body
// places it, and the headers reply goes with the body collected.
func (s *Server) onStreamedBody(ctx context.Context, msg *extprocv3.HttpBody, ex *exchange) []*extprocv3.ProcessingResponse {
	if !ex.holding {
		ex.out[0] = echoRequest(msg.GetBody(), msg.GetEndOfStream())
		return ex.out[:1]
	}
	ex.held = append(ex.held, msg.GetBody()...)
	over := s.opts.MaxBody > 0 && len(ex.held) > s.opts.MaxBody
	if !msg.GetEndOfStream() && !over {
		return nil
	}
	return s.release(ctx, ex, !over, msg.GetEndOfStream())
}

// release sends the headers reply a streamed body held, once the body
// places the request (whole) or cannot (past MaxBody, or trailers came
// first), and the body collected after it. end: the body ends there.
func (s *Server) release(ctx context.Context, ex *exchange, whole, end bool) []*extprocv3.ProcessingResponse {
	d := ex.decision
	next, result := d, ContentOverLimit
	if whole {
		next, result = s.place(ctx, d, ex.held)
	}
	ex.decision, ex.holding = next, false
	s.rec.Content(result)
	s.advance(ex, gotBody, observation{})
	ex.out[0] = routeTo(s.mutation(&next), s.metadata(ex, &next))
	ex.out[1] = echoRequest(ex.held, end)
	ex.held = nil
	return ex.out[:2]
}

// place has the decider place d by the prompt of body, a whole body. It
// returns the decision the request goes with, and what became of it
// (Recorder.Content).
func (s *Server) place(ctx context.Context, d affinity.Decision, body []byte) (affinity.Decision, string) {
	if s.opts.MaxBody > 0 && len(body) > s.opts.MaxBody {
		return d, ContentOverLimit
	}
	var buf [256]uint64
	chain, reason := s.opts.Prompts.Chain(buf[:0], body)
	if reason != "" {
		return d, string(reason)
	}
	next := s.decider.Refine(ctx, d, chain)
	if !next.ByContent {
		return next, ContentIdentity
	}
	return next, ContentPlaced
}

// metadata is what the routing reply writes in the request's dynamic
// metadata, or nil for nothing. An apart stream writes the decision's
// ticket. With debug headers, the decision goes too, for Envoy to copy
// into the response. d nil: the decision failed.
func (s *Server) metadata(ex *exchange, d *affinity.Decision) *structpb.Struct {
	var ticket, dest string
	if d != nil {
		dest = destination(d)
	}
	if d != nil && ex.kind == apart {
		ticket = s.opts.Tickets.Issue(*d)
	}
	switch {
	case !s.opts.DebugHeaders:
		return metadata(dest, ticket)
	case d != nil:
		return metadata(dest, ticket, header{MetadataInstance, d.Instance.Name}, header{MetadataDecision, string(d.Kind)})
	}
	return metadata(dest, ticket, header{MetadataDecision, "none:" + ex.failure})
}

// observe reads an observing stream's message. The response headers say
// how the request ended: its ticket is redeemed at once. Other messages
// say nothing.
func (s *Server) observe(ex *exchange, req *extprocv3.ProcessingRequest) {
	if r, ok := req.Request.(*extprocv3.ProcessingRequest_ResponseHeaders); ok {
		s.advance(ex, answered, s.answer(r.ResponseHeaders, upstreamOf(req), 0))
	}
}

// answer is the observation of response headers msg. elapsed 0: since the
// decision, by this replica's clock.
func (s *Server) answer(msg *extprocv3.HttpHeaders, up upstream, elapsed time.Duration) observation {
	h := s.headers(msg)
	return observation{
		status: statusOf(h.Get(HeaderStatus)), upstream: up,
		overloaded: h.Get(HeaderOverloaded) == "true", headers: h, elapsed: elapsed,
	}
}

// marked reports whether a stream carries ApartMarker.
func marked(ctx context.Context) bool {
	v := grpcmd.ValueFromIncomingContext(ctx, ApartMarker)
	return len(v) == 1 && v[0] == "1"
}

// ticketOf reads the ticket from the tether namespace of Envoy's dynamic
// metadata ("" when there is none).
func ticketOf(md *structpb.Struct) string {
	return md.GetFields()[ticketField].GetStringValue()
}

// onResponseHeaders hears how the request ended, on an inline stream. With
// debug headers, it adds the decision to the response.
func (s *Server) onResponseHeaders(msg *extprocv3.HttpHeaders, up upstream, ex *exchange) *extprocv3.ProcessingResponse {
	s.advance(ex, answered, s.answer(msg, up, time.Since(ex.start)))
	switch {
	case !s.opts.DebugHeaders:
		return s.plain
	case ex.state == idle:
		return annotateResponse(header{HeaderDecision, "none:" + ex.failure})
	}
	return annotateResponse(
		header{HeaderInstance, ex.decision.Instance.Name},
		header{HeaderDecision, string(ex.decision.Kind)},
	)
}

// readReports reads what the instance reports in its response headers:
// its queue depth, running out of memory, its GPU utilisation in percent.
// Status 507 also says out of memory. A header present but unreadable is
// ignored and named in BadReports.
func (s *Server) readReports(h getter, status int) fleet.Outcome {
	o := fleet.Outcome{Status: status, OOM: status == http.StatusInsufficientStorage}
	if v := h.Get(s.opts.QueueHeader); v != "" && s.opts.QueueHeader != "" {
		q, err := strconv.Atoi(v)
		if o.QueueKnown = err == nil && q >= 0; o.QueueKnown {
			o.Queue = q
		} else {
			o.BadReports = append(o.BadReports, "queue_depth")
		}
	}
	if v := h.Get(s.opts.OOMHeader); v != "" && s.opts.OOMHeader != "" {
		switch strings.ToLower(v) {
		case "1", "true", "yes":
			o.OOM = true
		case "0", "false", "no":
		default:
			o.BadReports = append(o.BadReports, "oom")
		}
	}
	if v := h.Get(s.opts.GPUHeader); v != "" && s.opts.GPUHeader != "" {
		pct, err := strconv.ParseFloat(strings.TrimSuffix(v, "%"), 64)
		if o.GPUKnown = err == nil && pct >= 0 && pct <= 100; o.GPUKnown {
			o.GPU = pct / 100
		} else {
			o.BadReports = append(o.BadReports, "gpu_utilization")
		}
	}
	return o
}

// failed says whether a status counts against the instance: any 5xx. It
// is the instance's own, or Envoy's when it could not reach it. finish
// leaves out Envoy's replies that never reached the instance.
// docs/envoy-replies.md lists what reaches the response phase.
func failed(status int) bool { return status >= 500 && status <= 599 }

// The response attributes the filter asks for (response_attributes). The
// status is always there, so it shows that Envoy sends attributes at all.
const (
	AttrUpstreamAddress = "upstream.address"
	AttrResponseCode    = "response.code"
)

// upstream is what the response attributes say about the host that
// answered.
type upstream struct {
	attrs   bool   // Envoy sent the attributes
	address string // the host that answered ("" none)
}

// upstreamOf reads the attributes Envoy sent, one struct per filter
// name. Without an upstream address among them, the endpoint a gateway
// reports as the one that served the request stands in.
func upstreamOf(req *extprocv3.ProcessingRequest) upstream {
	var u upstream
	for _, st := range req.GetAttributes() {
		f := st.GetFields()
		if _, ok := f[AttrResponseCode]; ok {
			u.attrs = true
		}
		if v, ok := f[AttrUpstreamAddress]; ok {
			u.attrs, u.address = true, v.GetStringValue()
		}
	}
	if served := servedOf(req.GetMetadataContext().GetFilterMetadata()); u.address == "" && served != "" {
		u.attrs, u.address = true, served
	}
	return u
}

// none says Envoy sent attributes but picked no host. The reply is then
// about Envoy's configuration or load, not the instance's health.
func (u upstream) none() bool { return u.attrs && u.address == "" }

// elsewhere reports whether the answer came from another host than the
// chosen instance's address: Envoy retried on a peer, or went past the
// instance because it had ejected it. The instance failed the request
// even though the client got an answer.
func (u upstream) elsewhere(chosen string) bool {
	if u.address == "" || chosen == "" {
		return false
	}
	a, err1 := netip.ParseAddrPort(u.address)
	c, err2 := netip.ParseAddrPort(chosen)
	if err1 != nil || err2 != nil {
		return u.address != chosen
	}
	return a.Addr().Unmap() != c.Addr().Unmap() || a.Port() != c.Port()
}

func failureReason(err error) string {
	switch {
	case errors.Is(err, affinity.ErrNoInstance):
		return "no_instance"
	case errors.Is(err, affinity.ErrNoEligible):
		return "no_eligible"
	case errors.Is(err, errBadSubset):
		return "bad_subset"
	case errors.Is(err, affinity.ErrNoVersion):
		return "no_version"
	case errors.Is(err, affinity.ErrInstanceUnavailable):
		return "unavailable"
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return "canceled"
	}
	return "error"
}

// requestID is Envoy's x-request-id for logs, cut short. A client can
// send its own, of any length.
func requestID(h headers) string {
	id := h.Get(HeaderRequestID)
	if len(id) > 64 {
		id = id[:64]
	}
	return id
}

// headers reads Envoy's header list without copying it into a map. A
// request has a dozen headers, and identity asks for a handful. Every
// header the handler reads, it reads here.
type headers struct {
	list []*corev3.HeaderValue
	read func(name string) // Server.read
}

// headers is the view of msg's headers.
func (s *Server) headers(msg *extprocv3.HttpHeaders) headers {
	return headers{list: msg.GetHeaders().GetHeaders(), read: s.read}
}

func (hs headers) Get(name string) string {
	if hs.read != nil {
		hs.read(name)
	}
	for _, h := range hs.list {
		if h.GetKey() == name {
			if raw := h.GetRawValue(); len(raw) > 0 {
				return string(raw)
			}
			return h.GetValue()
		}
	}
	return ""
}
