package bench

import (
	"context"
	"encoding/json"
	"net/http"
	"strconv"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3filter "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/testing/protocmp"
	"google.golang.org/protobuf/types/known/structpb"
)

var testPickerRoutes = PickerRoutes{SessionHeader: "x-session-id",
	Endpoints: []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"}}

// servePicker serves the picker for r on loopback, as `tether-lab bench
// picker` does, until the test ends, and returns its addresses.
func servePicker(t *testing.T, r PickerRoutes) FloorReady {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ready, done := make(chan FloorReady, 1), make(chan error, 1)
	go func() { done <- ServePicker(ctx, r, "127.0.0.1:0", "127.0.0.1:0", func(f FloorReady) { ready <- f }) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("picker: %v", err)
		}
	})
	select {
	case f := <-ready:
		return f
	case err := <-done:
		t.Fatalf("picker: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("picker not ready")
	}
	return FloorReady{}
}

// destinationWant is the reply to request headers that sends the request
// to endpoint, written out as tether's gateway reply is shaped: the
// header in raw_value, clear_route_cache, and the same value in envoy.lb.
func destinationWant(endpoint string) *extprocv3.ProcessingResponse {
	md, err := structpb.NewStruct(map[string]any{"envoy.lb": map[string]any{"x-gateway-destination-endpoint": endpoint}})
	if err != nil {
		panic(err)
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{
		Response: &extprocv3.CommonResponse{
			HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{{
				Header: &corev3.HeaderValue{Key: "x-gateway-destination-endpoint", RawValue: []byte(endpoint)},
			}}},
			ClearRouteCache: true,
		},
	}}, DynamicMetadata: md}
}

func streamedWant(body string, end, response bool) *extprocv3.ProcessingResponse {
	b := &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
		Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{Body: []byte(body), EndOfStream: end}},
	}}}
	if response {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: b}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: b}}
}

// TestPickerFullDuplexExchange drives one stream as Envoy does under
// FULL_DUPLEX_STREAMED: the headers are answered at once with the hashed
// endpoint, each body chunk comes back unchanged, trailers and response
// headers get empty replies; then a second stream of the same session
// gets the same endpoint, and the admin count says two requests.
func TestPickerFullDuplexExchange(t *testing.T) {
	f := servePicker(t, testPickerRoutes)
	want := testPickerRoutes.endpointFor("chat-7")
	duplex := &extprocv3.ProtocolConfiguration{
		RequestBodyMode:  extprocv3filter.ProcessingMode_FULL_DUPLEX_STREAMED,
		ResponseBodyMode: extprocv3filter.ProcessingMode_FULL_DUPLEX_STREAMED,
	}
	headers := requestHeaders(&corev3.HeaderValue{Key: "x-session-id", RawValue: []byte("chat-7")})
	headers.ProtocolConfig = duplex
	body := func(chunk string, end, response bool) *extprocv3.ProcessingRequest {
		b := &extprocv3.HttpBody{Body: []byte(chunk), EndOfStream: end}
		if response {
			return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: b}}
		}
		return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: b}}
	}
	exchange := []struct {
		req  *extprocv3.ProcessingRequest
		want *extprocv3.ProcessingResponse
	}{
		{headers, destinationWant(want)},
		{body(`{"model":"m",`, false, false), streamedWant(`{"model":"m",`, false, false)},
		{body(`"messages":[]}`, false, false), streamedWant(`"messages":[]}`, false, false)},
		{&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}},
			&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}}},
		{&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{}}},
			&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}}},
		{body(`{"choices":[]}`, false, true), streamedWant(`{"choices":[]}`, false, true)},
		{body("", true, true), streamedWant("", true, true)},
		{&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}},
			&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}}}},
	}
	s := floorStream(t, f)
	for i, x := range exchange {
		if err := s.Send(x.req); err != nil {
			t.Fatal(err)
		}
		got, err := s.Recv()
		if err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
		if d := cmp.Diff(x.want, got, protocmp.Transform()); d != "" {
			t.Errorf("message %d: reply (-want +got):\n%s", i, d)
		}
	}
	// The same session on a stream of its own: the same endpoint.
	s2 := floorStream(t, f)
	if err := s2.Send(headers); err != nil {
		t.Fatal(err)
	}
	got, err := s2.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(destinationWant(want), got, protocmp.Transform()); d != "" {
		t.Errorf("second stream: reply (-want +got):\n%s", d)
	}
	resp, err := http.Get("http://" + f.Admin + "/requests")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var c FloorCount
	if err := json.NewDecoder(resp.Body).Decode(&c); err != nil || c.Requests != 2 {
		t.Errorf("GET /requests: %+v, %v; want 2 requests", c, err)
	}
}

// TestPickerSpreadsSessions: the hash sends sessions to every endpoint,
// and a request without the session header to one endpoint.
func TestPickerSpreadsSessions(t *testing.T) {
	p, err := newPickerProcessor(testPickerRoutes)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for i := 0; i < 64; i++ {
		session := "s-" + strconv.Itoa(i)
		reply, err := p.reply(requestHeaders(&corev3.HeaderValue{Key: "x-session-id", Value: session}))
		if err != nil {
			t.Fatal(err)
		}
		got := string(reply.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders()[0].GetHeader().GetRawValue())
		if want := testPickerRoutes.endpointFor(session); got != want {
			t.Fatalf("session %q: %s, want %s", session, got, want)
		}
		if md := reply.GetDynamicMetadata().GetFields()["envoy.lb"].GetStructValue().GetFields()["x-gateway-destination-endpoint"].GetStringValue(); md != got {
			t.Fatalf("session %q: metadata %q, header %q", session, md, got)
		}
		seen[got] = true
	}
	if len(seen) != len(testPickerRoutes.Endpoints) {
		t.Errorf("64 sessions reached %d of %d endpoints", len(seen), len(testPickerRoutes.Endpoints))
	}
	if _, err := p.reply(requestHeaders()); err != nil {
		t.Errorf("no session header: %v", err)
	}
}

func TestPickerRefusesBadRoutes(t *testing.T) {
	for _, r := range []PickerRoutes{{SessionHeader: "x-session-id"}, {Endpoints: []string{"10.0.0.1:8000"}}} {
		if _, err := newPickerProcessor(r); err == nil {
			t.Errorf("%+v: no error", r)
		}
	}
	if err := ServePicker(context.Background(), testPickerRoutes, "0.0.0.0:0", "127.0.0.1:0", func(FloorReady) {}); err == nil {
		t.Error("served on 0.0.0.0")
	}
}
