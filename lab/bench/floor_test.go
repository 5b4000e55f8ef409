package bench

import (
	"context"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// TestFloorAnswersEachPhaseEmpty: the ext_proc floor answers request and
// response headers with an empty reply of their phase, and refuses what
// it does not answer instead of leaving Envoy waiting.
func TestFloorAnswersEachPhaseEmpty(t *testing.T) {
	f, err := startFloor()
	if err != nil {
		t.Fatal(err)
	}
	defer f.stop()
	conn, err := grpc.NewClient(f.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		req  *extprocv3.ProcessingRequest
		want func(*extprocv3.ProcessingResponse) bool
	}{
		{&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{}}},
			func(r *extprocv3.ProcessingResponse) bool {
				return r.GetRequestHeaders() != nil && r.GetRequestHeaders().GetResponse() == nil
			}},
		{&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{}}},
			func(r *extprocv3.ProcessingResponse) bool {
				return r.GetResponseHeaders() != nil && r.GetResponseHeaders().GetResponse() == nil
			}},
	} {
		if err := s.Send(tc.req); err != nil {
			t.Fatal(err)
		}
		r, err := s.Recv()
		if err != nil || !tc.want(r) {
			t.Fatalf("%T: reply %v, %v", tc.req.GetRequest(), r, err)
		}
	}
	if err := s.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Recv(); status.Code(err) != codes.Unimplemented {
		t.Fatalf("a body: %v, want Unimplemented", err)
	}
	if n := f.p.requests.Load(); n != 1 {
		t.Fatalf("%d request headers counted, want 1", n)
	}
}
