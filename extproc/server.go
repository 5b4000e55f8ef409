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

// Decider picks the instance.
type Decider interface {
	Decide(context.Context, identity.Identity) (affinity.Decision, error)
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
	decision affinity.Decision
	failure  string
}

// Process serves one HTTP request's stream.
func (s *Server) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	ctx := stream.Context()
	var ex exchange
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
	h := headers(msg.GetHeaders().GetHeaders())
	id := s.ids.Extract(h)
	start := time.Now()
	d, err := s.decider.Decide(ctx, id)
	if err != nil {
		ex.failure = failureReason(err)
		s.rec.DecisionFailed(id, ex.failure)
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
	if ex.decided {
		code, _ := strconv.Atoi(headers(msg.GetHeaders().GetHeaders()).Get(":status"))
		s.rec.Response(ex.decision.Instance.Name, code)
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
