package extproc

import (
	"maps"
	"sync"
	"sync/atomic"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3filter "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tetherproxy/tether/fleet"
)

// This file is the one place that builds ext_proc replies. So Envoy's rules
// live here only:
//
//   - Header values go in raw_value, never also in value. Envoy rejects
//     both.
//   - The deprecated append field is left unset, which means overwrite. So
//     a client cannot pre-set the routing header.
//   - clear_route_cache only takes effect when the same reply carries a
//     header mutation. So the routing header and the bit travel together.

// header is one header to set, or one metadata field.
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

// routeTo answers the request headers: route with m, the routing header's
// mutation, and re-select the route. md goes in the request's dynamic
// metadata; nil: none.
func routeTo(m *extprocv3.HeaderMutation, md *structpb.Struct) *extprocv3.ProcessingResponse {
	// The reply's four messages in one allocation.
	r := &struct {
		resp   extprocv3.ProcessingResponse
		phase  extprocv3.ProcessingResponse_RequestHeaders
		hr     extprocv3.HeadersResponse
		common extprocv3.CommonResponse
	}{}
	r.common.HeaderMutation, r.common.ClearRouteCache = m, true
	r.hr.Response = &r.common
	r.phase.RequestHeaders = &r.hr
	r.resp.Response, r.resp.DynamicMetadata = &r.phase, md
	return &r.resp
}

// readBody is routeTo that also asks Envoy for the request's body. Its
// mode_override is BUFFERED_PARTIAL: Envoy buffers the body up to its
// limit and sends what it has. A longer body arrives marked incomplete,
// where BUFFERED would fail the request. The route set here stands unless
// the reply to the body sets another (rerouteTo). apart: the stream has no
// response phase.
func readBody(m *extprocv3.HeaderMutation, md *structpb.Struct, apart bool) *extprocv3.ProcessingResponse {
	r := routeTo(m, md)
	r.ModeOverride = bodyModes[0]
	if apart {
		r.ModeOverride = bodyModes[1]
	}
	return r
}

// bodyModes are readBody's overrides, inline and apart. Each is the
// routing filter's processing mode with the request body buffered. Envoy
// takes an override whole: a mode left at DEFAULT would turn the response
// phase on. Envoy checks it against the filter's allowed_override_modes,
// which xds writes alike.
var bodyModes = [2]*extprocv3filter.ProcessingMode{
	bodyMode(extprocv3filter.ProcessingMode_SEND),
	bodyMode(extprocv3filter.ProcessingMode_SKIP),
}

func bodyMode(response extprocv3filter.ProcessingMode_HeaderSendMode) *extprocv3filter.ProcessingMode {
	return &extprocv3filter.ProcessingMode{
		RequestHeaderMode:   extprocv3filter.ProcessingMode_SEND,
		ResponseHeaderMode:  response,
		RequestBodyMode:     extprocv3filter.ProcessingMode_BUFFERED_PARTIAL,
		ResponseBodyMode:    extprocv3filter.ProcessingMode_NONE,
		RequestTrailerMode:  extprocv3filter.ProcessingMode_SKIP,
		ResponseTrailerMode: extprocv3filter.ProcessingMode_SKIP,
	}
}

// rerouteTo answers the request body: route with m and re-select the
// route. m nil: go on as the headers reply routed.
func rerouteTo(m *extprocv3.HeaderMutation, md *structpb.Struct) *extprocv3.ProcessingResponse {
	var common *extprocv3.CommonResponse
	if m != nil {
		common = &extprocv3.CommonResponse{HeaderMutation: m, ClearRouteCache: true}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
		RequestBody: &extprocv3.BodyResponse{Response: common},
	}, DynamicMetadata: md}
}

// routes holds the routing header's mutation per instance. It is the same
// for every request to the instance, so their replies share it. gRPC only
// reads a reply, and marshalling one message from several goroutines is
// safe. Nothing else touches it. Each reply's own messages and metadata
// are built per request.
type routes struct {
	header string // the routing header
	mu     sync.Mutex
	// Copied on write: instances are added seldom, read on every request.
	byName atomic.Pointer[map[string]*extprocv3.HeaderMutation]
}

// maxRoutes bounds routes: a fleet that renames its instances all the
// time builds mutations per request past it rather than growing.
const maxRoutes = 4096

func newRoutes(header string) *routes {
	r := &routes{header: header}
	r.byName.Store(&map[string]*extprocv3.HeaderMutation{})
	return r
}

// mutation returns the routing header's mutation for in.
func (r *routes) mutation(in fleet.Instance) *extprocv3.HeaderMutation {
	if m, ok := (*r.byName.Load())[in.Name]; ok {
		return m
	}
	hs := []header{{r.header, in.Cluster()}, {HeaderDestination, in.Address}}
	if in.Address == "" {
		hs = hs[:1] // nothing to name a gateway
	}
	m := setHeaders(hs...)
	r.mu.Lock()
	defer r.mu.Unlock()
	cur := *r.byName.Load()
	if old, ok := cur[in.Name]; ok {
		return old
	}
	if len(cur) < maxRoutes {
		next := make(map[string]*extprocv3.HeaderMutation, len(cur)+1)
		maps.Copy(next, cur)
		next[in.Name] = m
		r.byName.Store(&next)
	}
	return m
}

// metadata is the request's dynamic metadata. In MetadataLB goes dest,
// the gateway's destination, if any. In tether's namespace go the ticket,
// if any, and fields. nil: nothing to write.
func metadata(dest, ticket string, fields ...header) *structpb.Struct {
	if dest == "" && ticket == "" && len(fields) == 0 {
		return nil
	}
	if ticket == "" && len(fields) == 0 {
		return destinationMetadata(dest)
	}
	// The messages in one allocation, the maps apart.
	m := &struct {
		outer, inner structpb.Struct
		ns, tv       structpb.Value
		nsKind       structpb.Value_StructValue
		tvKind       structpb.Value_StringValue
	}{}
	m.inner.Fields = make(map[string]*structpb.Value, 1+len(fields))
	if ticket != "" {
		m.tvKind.StringValue = ticket
		m.tv.Kind = &m.tvKind
		m.inner.Fields[ticketField] = &m.tv
	}
	for _, f := range fields {
		m.inner.Fields[f.key] = structpb.NewStringValue(f.value)
	}
	m.nsKind.StructValue = &m.inner
	m.ns.Kind = &m.nsKind
	m.outer.Fields = map[string]*structpb.Value{MetadataNamespace: &m.ns}
	if dest != "" {
		m.outer.Fields[MetadataLB] = destinationMetadata(dest).Fields[MetadataLB]
	}
	return &m.outer
}

// destinationMetadata is dest in MetadataLB, under HeaderDestination.
func destinationMetadata(dest string) *structpb.Struct {
	// The messages in one allocation, the maps apart.
	m := &struct {
		outer, inner structpb.Struct
		ns, dv       structpb.Value
		nsKind       structpb.Value_StructValue
		dvKind       structpb.Value_StringValue
	}{}
	m.dvKind.StringValue = dest
	m.dv.Kind = &m.dvKind
	m.inner.Fields = map[string]*structpb.Value{HeaderDestination: &m.dv}
	m.nsKind.StructValue = &m.inner
	m.ns.Kind = &m.nsKind
	m.outer.Fields = map[string]*structpb.Value{MetadataLB: &m.ns}
	return &m.outer
}

// unrouted answers the request headers without a route, and removes a
// destination the client set. Envoy keeps its default route: the pool
// cluster, hashed on the session header.
func unrouted(md *structpb.Struct) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
		RequestHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{
			HeaderMutation: &extprocv3.HeaderMutation{RemoveHeaders: []string{HeaderDestination}},
		}},
	}, DynamicMetadata: md}
}

// passRequest answers the request headers without a route and without a
// change.
func passRequest(md *structpb.Struct) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
		RequestHeaders: &extprocv3.HeadersResponse{},
	}, DynamicMetadata: md}
}

// annotateResponse answers the response headers, adding hs to what the
// client sees. Without headers the reply is always the same: a Server
// shares one (Server.plain).
func annotateResponse(hs ...header) *extprocv3.ProcessingResponse {
	var common *extprocv3.CommonResponse
	if m := setHeaders(hs...); m != nil {
		common = &extprocv3.CommonResponse{HeaderMutation: m}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
		ResponseHeaders: &extprocv3.HeadersResponse{Response: common},
	}}
}

// continueOther answers a message tether does nothing with by an empty
// "continue" of its phase. nil: a message with no phase.
func continueOther(req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
	switch req.Request.(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return passRequest(nil)
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return annotateResponse()
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

// refuse answers the request headers with an immediate reply. Envoy sends
// status and body to the client without routing the request.
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
