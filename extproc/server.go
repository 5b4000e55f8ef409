// Package extproc is Envoy's external processor: one gRPC stream per HTTP
// request. Request headers go through identity, then the decision, then come
// back as the routing header; response headers report the instance's status.
// Envoy protos stop here: the decision core sees plain structs.
package extproc

import (
	"context"
	"errors"
	"io"
	"strconv"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/rs/zerolog"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/identity"
)

// Identifier extracts the caller's identity.
type Identifier interface {
	Extract(identity.Headers) identity.Identity
}

// Decider picks the instance, and hears how the request ended.
type Decider interface {
	Decide(context.Context, affinity.Request) (affinity.Decision, error)
	// Finish is called once per decision: queue is the queue depth the
	// instance reported (known false when it did not, or never answered).
	Finish(d affinity.Decision, queue int, known bool)
}

// Recorder counts what happens.
type Recorder interface {
	Decision(identity.Identity, affinity.Decision, time.Duration)
	DecisionFailed(id identity.Identity, reason string)
	Response(instance string, status int)
}

// Options configure the Server.
type Options struct {
	ClusterHeader string // request header Envoy routes on
	QueueHeader   string // response header in which instances report their queue depth
	DebugHeaders  bool   // add x-tether-instance / x-tether-decision to responses
	Logger        zerolog.Logger
}

// Debug response headers.
const (
	HeaderInstance = "x-tether-instance"
	HeaderDecision = "x-tether-decision"
)

// Server implements envoy.service.ext_proc.v3.ExternalProcessor.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer
	ids     Identifier
	decider Decider
	rec     Recorder
	opts    Options
	// warn logs per-request trouble (a store outage fails every request)
	// at most a few lines a second; the metrics count every one.
	warn zerolog.Logger
}

// New returns a Server.
func New(ids Identifier, decider Decider, rec Recorder, opts Options) *Server {
	warn := opts.Logger.Sample(&zerolog.BurstSampler{Burst: 5, Period: time.Second})
	return &Server{ids: ids, decider: decider, rec: rec, opts: opts, warn: warn}
}

// exchange is what one stream (one HTTP request) remembers between phases.
type exchange struct {
	decided  bool
	finished bool // the decider heard how the request ended
	decision affinity.Decision
	failure  string
}

// Process serves one HTTP request's stream.
func (s *Server) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	ctx := stream.Context()
	var ex exchange
	defer func() {
		if ex.decided && !ex.finished { // the stream ended before the instance answered
			s.decider.Finish(ex.decision, 0, false)
		}
	}()
	for {
		req, err := stream.Recv()
		if errors.Is(err, io.EOF) || status.Code(err) == codes.Canceled {
			return nil
		}
		if err != nil {
			return err
		}
		var resp *extprocv3.ProcessingResponse
		switch r := req.Request.(type) {
		case *extprocv3.ProcessingRequest_RequestHeaders:
			resp = s.onRequestHeaders(ctx, r.RequestHeaders, &ex)
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			resp = s.onResponseHeaders(r.ResponseHeaders, &ex)
		default:
			resp = continueOther(req)
		}
		if resp == nil {
			return status.Error(codes.InvalidArgument, "processing request carries no known phase")
		}
		if err := stream.Send(resp); err != nil {
			return err
		}
	}
}

// onRequestHeaders: headers → identity → decision → routing header.
func (s *Server) onRequestHeaders(ctx context.Context, msg *extprocv3.HttpHeaders, ex *exchange) *extprocv3.ProcessingResponse {
	if ex.decided && !ex.finished {
		// A second request-headers message on one stream (Envoy sends one):
		// the first decision ends unanswered, so its in-flight count does too.
		s.decider.Finish(ex.decision, 0, false)
	}
	*ex = exchange{}
	h := headers(msg.GetHeaders().GetHeaders())
	id := s.ids.Extract(h)
	start := time.Now()
	d, err := s.decider.Decide(ctx, affinity.Request{ID: id, Path: h.Get(":path"), Headers: h})
	if err != nil {
		ex.failure = failureReason(err)
		s.rec.DecisionFailed(id, ex.failure)
		if errors.Is(err, affinity.ErrNoVersion) {
			// Strict version affinity: the default route would change the
			// session's model, so the request is refused instead.
			s.warn.Warn().Err(err).Str("request_id", requestID(h)).Msg("refused: no instance of the session's model version")
			return refuse(503, err.Error()+" (version_affinity = \"strict\")\n")
		}
		s.warn.Warn().Err(err).Str("request_id", requestID(h)).Msg("no decision; Envoy uses its default route")
		return passRequest()
	}
	s.rec.Decision(id, d, time.Since(start))
	ex.decided, ex.decision = true, d
	if d.Err != nil {
		s.warn.Warn().Err(d.Err).Str("session", id.Key).Msg("binding store failed; placed by rendezvous hashing")
	}
	if e := s.opts.Logger.Debug(); e.Enabled() {
		e.Str("request_id", requestID(h)).Str("session", id.Key).Str("source", string(id.Source)).
			Str("instance", d.Instance.Name).Str("decision", string(d.Kind)).Msg("routed")
	}
	return routeTo(s.opts.ClusterHeader, d.Instance.Cluster())
}

// onResponseHeaders records the instance's status and adds debug headers.
func (s *Server) onResponseHeaders(msg *extprocv3.HttpHeaders, ex *exchange) *extprocv3.ProcessingResponse {
	if ex.decided && !ex.finished {
		h := headers(msg.GetHeaders().GetHeaders())
		code, _ := strconv.Atoi(h.Get(":status"))
		s.rec.Response(ex.decision.Instance.Name, code)
		queue, err := strconv.Atoi(h.Get(s.opts.QueueHeader))
		s.decider.Finish(ex.decision, queue, err == nil && queue >= 0 && s.opts.QueueHeader != "")
		ex.finished = true
	}
	if !s.opts.DebugHeaders {
		return annotateResponse()
	}
	if !ex.decided {
		return annotateResponse(header{HeaderDecision, "none:" + ex.failure})
	}
	return annotateResponse(
		header{HeaderInstance, ex.decision.Instance.Name},
		header{HeaderDecision, string(ex.decision.Kind)},
	)
}

func failureReason(err error) string {
	switch {
	case errors.Is(err, affinity.ErrNoInstance):
		return "no_instance"
	case errors.Is(err, affinity.ErrNoVersion):
		return "no_version"
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return "canceled"
	}
	return "error"
}

// requestID is Envoy's x-request-id for logs, cut short: a client can send
// its own, of any length.
func requestID(h headers) string {
	id := h.Get("x-request-id")
	if len(id) > 64 {
		id = id[:64]
	}
	return id
}

// headers reads Envoy's header list without copying it into a map: a
// request has a dozen headers and identity asks for a handful.
type headers []*corev3.HeaderValue

func (hs headers) Get(name string) string {
	for _, h := range hs {
		if h.GetKey() == name {
			if raw := h.GetRawValue(); len(raw) > 0 {
				return string(raw)
			}
			return h.GetValue()
		}
	}
	return ""
}
