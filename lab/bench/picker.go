package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync/atomic"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
)

// The stateless picker is the least an endpoint picker behind a gateway
// can do (the Gateway API Inference Extension's protocol, as tether
// answers it: docs/gateway-api.md). For each stream it reads the request
// headers, hashes the session header to one of its endpoints (ip:port)
// and answers the headers at once with the endpoint in
// x-gateway-destination-endpoint, as a header and in the dynamic metadata
// envoy.lb, and clear_route_cache, as tether's reply does. Under
// FULL_DUPLEX_STREAMED it echoes every request and response body chunk
// back unchanged, and answers trailers and response headers empty. It
// keeps nothing. It runs as a process of its own (`tether-lab bench
// picker`, ServePicker), as the ext_proc floor does: the gateway
// scenario's bound (gateway.go).

// Names of the protocol (extproc/gateway.go holds tether's).
const (
	pickerDestinationHeader = "x-gateway-destination-endpoint"
	pickerMetadataLB        = "envoy.lb"
)

// PickerRoutes is what the picker routes by: the session header it hashes
// and the endpoints, ip:port, it chooses from.
type PickerRoutes struct {
	SessionHeader string
	Endpoints     []string
}

// check refuses routes the picker cannot route by.
func (r PickerRoutes) check() error {
	if len(r.Endpoints) == 0 || r.SessionHeader == "" {
		return fmt.Errorf("stateless picker: session header %q, %d endpoints: want the header and an endpoint", r.SessionHeader, len(r.Endpoints))
	}
	return nil
}

// endpointFor is the endpoint the picker sends session to: the 32-bit
// FNV-1a hash of its value modulo the endpoints, as the floor picks.
func (r PickerRoutes) endpointFor(session string) string {
	return r.Endpoints[FloorRoutes{Clusters: r.Endpoints}.pick([]byte(session))]
}

// pickerProcessor answers each stream as the picker does, and counts the
// request headers it answered: the proof that Envoy called it rather than
// failing open.
type pickerProcessor struct {
	extprocv3.UnimplementedExternalProcessorServer
	routes   FloorRoutes // the endpoints as "clusters", for pick
	session  string
	replies  []*extprocv3.ProcessingResponse // one per endpoint, alike
	requests atomic.Int64
}

func newPickerProcessor(r PickerRoutes) (*pickerProcessor, error) {
	if err := r.check(); err != nil {
		return nil, err
	}
	p := &pickerProcessor{routes: FloorRoutes{Clusters: r.Endpoints}, session: r.SessionHeader}
	// gRPC only reads a reply it sends, so each is shared by the requests
	// sent to its endpoint.
	for _, e := range r.Endpoints {
		p.replies = append(p.replies, destinationReply(e))
	}
	return p, nil
}

// destinationReply answers request headers with endpoint as the
// destination, in the header and in envoy.lb.
func destinationReply(endpoint string) *extprocv3.ProcessingResponse {
	md := &structpb.Struct{Fields: map[string]*structpb.Value{
		pickerMetadataLB: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
			pickerDestinationHeader: structpb.NewStringValue(endpoint),
		}}),
	}}
	return &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{
			Response: &extprocv3.CommonResponse{
				HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{{
					Header: &corev3.HeaderValue{Key: pickerDestinationHeader, RawValue: []byte(endpoint)},
				}}},
				ClearRouteCache: true,
			},
		}},
		DynamicMetadata: md,
	}
}

// sessionOf is the value of the session header in hs, nil without it.
func (p *pickerProcessor) sessionOf(hs *extprocv3.HttpHeaders) []byte {
	for _, h := range hs.GetHeaders().GetHeaders() {
		if h.GetKey() == p.session {
			if raw := h.GetRawValue(); len(raw) > 0 {
				return raw
			}
			return []byte(h.GetValue())
		}
	}
	return nil
}

// streamedEcho is a body chunk's reply under FULL_DUPLEX_STREAMED: the
// chunk, unchanged.
func streamedEcho(body []byte, end bool) *extprocv3.BodyResponse {
	return &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{
		BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
			StreamedResponse: &extprocv3.StreamedBodyResponse{Body: body, EndOfStream: end},
		}},
	}}
}

// reply is the picker's answer to one message of a stream.
func (p *pickerProcessor) reply(req *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, error) {
	switch r := req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		p.requests.Add(1)
		return p.replies[p.routes.pick(p.sessionOf(r.RequestHeaders))], nil
	case *extprocv3.ProcessingRequest_RequestBody:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
			RequestBody: streamedEcho(r.RequestBody.GetBody(), r.RequestBody.GetEndOfStream())}}, nil
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
			RequestTrailers: &extprocv3.TrailersResponse{}}}, nil
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
			ResponseHeaders: &extprocv3.HeadersResponse{}}}, nil
	case *extprocv3.ProcessingRequest_ResponseBody:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
			ResponseBody: streamedEcho(r.ResponseBody.GetBody(), r.ResponseBody.GetEndOfStream())}}, nil
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
			ResponseTrailers: &extprocv3.TrailersResponse{}}}, nil
	}
	return nil, status.Errorf(codes.Unimplemented, "stateless picker: %T is not answered", req.GetRequest())
}

func (p *pickerProcessor) Process(s extprocv3.ExternalProcessor_ProcessServer) error {
	for {
		req, err := s.Recv()
		if errors.Is(err, io.EOF) || status.Code(err) == codes.Canceled {
			return nil
		}
		if err != nil {
			return err
		}
		reply, err := p.reply(req)
		if err != nil {
			return err
		}
		if err := s.Send(reply); err != nil {
			return err
		}
	}
}

// PickerReadyMessage is the message of the JSON line `tether-lab bench
// picker` logs on standard error once it listens, with FloorReady's
// fields.
const PickerReadyMessage = "stateless picker ready"

// ServePicker serves the stateless picker for r, its ext_proc gRPC server
// on extproc and its admin endpoint on admin (loopback host:port each,
// port 0 for any; GET /requests answers with FloorCount), calls ready
// once both listen, and stops them when ctx ends.
func ServePicker(ctx context.Context, r PickerRoutes, extproc, admin string, ready func(FloorReady)) error {
	p, err := newPickerProcessor(r)
	if err != nil {
		return err
	}
	glis, err := listenLoopback(extproc)
	if err != nil {
		return fmt.Errorf("stateless picker: %w", err)
	}
	alis, err := listenLoopback(admin)
	if err != nil {
		_ = glis.Close()
		return fmt.Errorf("stateless picker admin: %w", err)
	}
	gs := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(gs, p)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /requests", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(FloorCount{Requests: p.requests.Load()})
	})
	hs := &http.Server{Handler: mux}
	done := make(chan error, 2)
	go func() { done <- gs.Serve(glis) }()
	go func() { done <- hs.Serve(alis) }()
	ready(FloorReady{Extproc: glis.Addr().String(), Admin: alis.Addr().String()})
	select {
	case <-ctx.Done():
		err = nil
	case err = <-done:
		err = fmt.Errorf("stateless picker: %w", err)
	}
	gs.Stop()
	_ = hs.Close()
	return err
}
