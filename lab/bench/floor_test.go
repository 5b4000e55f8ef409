package bench

import (
	"context"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/testing/protocmp"
)

var testFloorRoutes = FloorRoutes{SessionHeader: "x-session-id", ClusterHeader: "x-tether-cluster",
	Clusters: []string{"inst-a", "inst-b", "inst-c", "inst-d"}}

// serveFloor serves the floor for r on loopback, as `tether-lab bench
// floor` does, until the test ends, and returns its addresses.
func serveFloor(t *testing.T, r FloorRoutes) FloorReady {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ready, done := make(chan FloorReady, 1), make(chan error, 1)
	go func() { done <- ServeFloor(ctx, r, "127.0.0.1:0", "127.0.0.1:0", func(f FloorReady) { ready <- f }) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("floor: %v", err)
		}
	})
	select {
	case f := <-ready:
		return f
	case err := <-done:
		t.Fatalf("floor: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("floor not ready")
	}
	return FloorReady{}
}

// floorStream is a client stream of a serving floor, closed with the test.
func floorStream(t *testing.T, f FloorReady) extprocv3.ExternalProcessor_ProcessClient {
	t.Helper()
	conn, err := grpc.NewClient(f.Extproc, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	s, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func requestHeaders(hs ...*corev3.HeaderValue) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
		Headers: &corev3.HeaderMap{Headers: append([]*corev3.HeaderValue{{Key: ":path", RawValue: []byte("/v1/chat/completions")}}, hs...)},
	}}}
}

// routeReply is the reply that routes to cluster, written out here as
// tether's own reply to a request's headers is shaped (extproc's routeTo):
// the routing header in raw_value and clear_route_cache, nothing else.
func routeReply(cluster string) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{
		Response: &extprocv3.CommonResponse{
			HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{{
				Header: &corev3.HeaderValue{Key: "x-tether-cluster", RawValue: []byte(cluster)},
			}}},
			ClearRouteCache: true,
		},
	}}}
}

// TestFloorRoutesEachRequest: the floor answers a request's headers with
// the routing header naming the cluster its session hashes to and
// clear_route_cache, the same cluster for the same session on any stream
// (raw_value or value), and every cluster for some session; response
// headers get an empty reply, and what it does not answer is refused
// instead of leaving Envoy waiting; its admin endpoint counts the request
// headers it answered.
func TestFloorRoutesEachRequest(t *testing.T) {
	f := serveFloor(t, testFloorRoutes)
	s := floorStream(t, f)
	exchange := func(s extprocv3.ExternalProcessor_ProcessClient, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
		t.Helper()
		if err := s.Send(req); err != nil {
			t.Fatal(err)
		}
		r, err := s.Recv()
		if err != nil {
			t.Fatal(err)
		}
		return r
	}

	// The hash, fixed: FNV-1a 32 of the session, modulo 4 (computed
	// apart from this code).
	for session, want := range map[string]string{"": "inst-b", "hit-0": "inst-d", "hit-1": "inst-a", "ovh-2000-0": "inst-a", "s": "inst-c"} {
		if got := testFloorRoutes.clusterFor(session); got != want {
			t.Errorf("cluster for session %q: %s, want %s", session, got, want)
		}
	}
	used := map[string]int{}
	for i := 0; i < 64; i++ {
		session := sessionFor(i, 0)
		want := testFloorRoutes.clusterFor(session)
		used[want]++
		got := exchange(s, requestHeaders(&corev3.HeaderValue{Key: "x-session-id", RawValue: []byte(session)},
			&corev3.HeaderValue{Key: "user-agent", RawValue: []byte("OpenAI/Python 2.54.0")}))
		if d := cmp.Diff(routeReply(want), got, protocmp.Transform()); d != "" {
			t.Fatalf("session %s (-want +got):\n%s", session, d)
		}
	}
	if len(used) != len(testFloorRoutes.Clusters) {
		t.Errorf("64 sessions went to %v, not to every cluster", used)
	}
	// The same session on another stream, its value in value rather than
	// raw_value; a request without the header hashes as the empty session.
	other := floorStream(t, f)
	for _, tc := range []struct {
		req  *extprocv3.ProcessingRequest
		want string
	}{
		{requestHeaders(&corev3.HeaderValue{Key: "x-session-id", Value: "hit-0"}), "inst-d"},
		{requestHeaders(), "inst-b"},
	} {
		if d := cmp.Diff(routeReply(tc.want), exchange(other, tc.req), protocmp.Transform()); d != "" {
			t.Errorf("(-want +got):\n%s", d)
		}
	}

	r := exchange(s, &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{}}})
	if r.GetResponseHeaders() == nil || r.GetResponseHeaders().GetResponse() != nil {
		t.Errorf("response headers: reply %v", r)
	}
	if err := s.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Recv(); status.Code(err) != codes.Unimplemented {
		t.Fatalf("a body: %v, want Unimplemented", err)
	}
	var c FloorCount
	if err := getJSON(context.Background(), "http://"+f.Admin+"/requests", &c); err != nil || c.Requests != 66 {
		t.Fatalf("admin: %+v, %v: want 66 request headers counted", c, err)
	}
}

// TestFloorRefusesRoutesItCannotUse: without a cluster or a header to
// route on, or off loopback, the floor does not start.
func TestFloorRefusesRoutesItCannotUse(t *testing.T) {
	for _, tc := range []struct {
		r              FloorRoutes
		extproc, admin string
	}{
		{FloorRoutes{SessionHeader: "x-session-id", ClusterHeader: "x-tether-cluster"}, "127.0.0.1:0", "127.0.0.1:0"},
		{FloorRoutes{SessionHeader: "x-session-id", Clusters: []string{"inst-a"}}, "127.0.0.1:0", "127.0.0.1:0"},
		{FloorRoutes{ClusterHeader: "x-tether-cluster", Clusters: []string{"inst-a"}}, "127.0.0.1:0", "127.0.0.1:0"},
		{testFloorRoutes, "0.0.0.0:0", "127.0.0.1:0"},
		{testFloorRoutes, "127.0.0.1:0", ":0"},
	} {
		ctx, cancel := context.WithCancel(context.Background())
		cancel() // a floor that starts stops at once
		if err := ServeFloor(ctx, tc.r, tc.extproc, tc.admin, func(FloorReady) { t.Errorf("floor started on %+v, %s, %s", tc.r, tc.extproc, tc.admin) }); err == nil {
			t.Errorf("no error for %+v, %s, %s", tc.r, tc.extproc, tc.admin)
		}
	}
}
