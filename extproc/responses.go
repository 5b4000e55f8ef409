package extproc

import (
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// This file is the one place that builds ext_proc replies, so Envoy's rules
// live here only:
//   - header values go in raw_value, never also in value (Envoy rejects both);
//   - the deprecated append field is left unset, which means overwrite: a
//     client cannot pre-set the routing header;
//   - clear_route_cache only takes effect when the same reply carries a
//     header mutation, so the routing header and the bit travel together.

// header is one header to set.
type header struct{ key, value string }

func setHeaders(hs ...header) *extprocv3.HeaderMutation {
	if len(hs) == 0 {
		return nil
	}
	m := &extprocv3.HeaderMutation{SetHeaders: make([]*corev3.HeaderValueOption, len(hs))}
	for i, h := range hs {
		m.SetHeaders[i] = &corev3.HeaderValueOption{
			Header: &corev3.HeaderValue{Key: h.key, RawValue: []byte(h.value)},
		}
	}
	return m
}

// routeTo answers the request-headers phase: route to cluster via the header
// Envoy's route matches on, and re-select the route. md (nil: none) goes
// in the request's dynamic metadata (Server.metadata).
func routeTo(clusterHeader, cluster string, md *structpb.Struct) *extprocv3.ProcessingResponse {
	resp := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
		RequestHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{
			HeaderMutation:  setHeaders(header{clusterHeader, cluster}),
			ClearRouteCache: true,
		}},
	}}
	resp.DynamicMetadata = md
	return resp
}

// passRequest answers the request-headers phase without a decision: Envoy
// keeps the default route (the pool cluster, hashed on the session header).
func passRequest(md *structpb.Struct) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
		RequestHeaders: &extprocv3.HeadersResponse{},
	}, DynamicMetadata: md}
}

// annotateResponse answers the response-headers phase, adding hs (the debug
// headers) to what the client sees.
func annotateResponse(hs ...header) *extprocv3.ProcessingResponse {
	var common *extprocv3.CommonResponse
	if m := setHeaders(hs...); m != nil {
		common = &extprocv3.CommonResponse{HeaderMutation: m}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
		ResponseHeaders: &extprocv3.HeadersResponse{Response: common},
	}}
}

// continueOther answers the phases tether does not configure (bodies,
// trailers) with an empty "continue", in case Envoy is set to send them.
func continueOther(req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
	switch req.Request.(type) {
	case *extprocv3.ProcessingRequest_RequestBody:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{}}}
	case *extprocv3.ProcessingRequest_ResponseBody:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{}}}
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}}
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}}}
	}
	return nil
}

// refuse answers the request-headers phase with an immediate reply: Envoy
// sends status and body to the client without routing the request.
func refuse(status int, body string) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{
		ImmediateResponse: &extprocv3.ImmediateResponse{
			Status:  &typev3.HttpStatus{Code: typev3.StatusCode(status)},
			Body:    []byte(body),
			Headers: setHeaders(header{"content-type", "text/plain"}),
			Details: "tether_refused",
		},
	}}
}
