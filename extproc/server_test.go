package extproc_test

import (
	"context"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/google/go-cmp/cmp"
	"github.com/rs/zerolog"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/testing/protocmp"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/extproc"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/store/memory"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type recorded struct {
	mu        sync.Mutex
	decisions []affinity.Kind
	failures  []string
	rejected  []identity.Reason
	responses []string
	replies   []fleet.Outcome
	outcomes  map[string]int
	content   map[string]int
	usage     []extproc.Usage // Prompt -1: an answer without usage
}

func (r *recorded) Content(result string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.content == nil {
		r.content = map[string]int{}
	}
	r.content[result]++
}

func (r *recorded) Usage(_ affinity.Decision, prompt, cached int, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	u := extproc.Usage{Prompt: prompt, Cached: cached}
	if !ok {
		u = extproc.Usage{Prompt: -1}
	}
	r.usage = append(r.usage, u)
}

func (r *recorded) Reported(result string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.outcomes == nil {
		r.outcomes = map[string]int{}
	}
	r.outcomes[result]++
}

func (r *recorded) Decision(id identity.Identity, d affinity.Decision, _ time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.decisions = append(r.decisions, d.Kind)
	if id.Rejected != "" {
		r.rejected = append(r.rejected, id.Rejected)
	}
}

func (r *recorded) DecisionFailed(_ identity.Identity, reason string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.failures = append(r.failures, reason)
}

func (r *recorded) Response(d affinity.Decision, rep fleet.Outcome) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.responses = append(r.responses, d.Instance.Name+":"+strconv.Itoa(rep.Status))
	r.replies = append(r.replies, rep)
}

// start serves the processor on a loopback listener and returns a client.
func start(t testing.TB, instances []fleet.Instance, debug bool) (extprocv3.ExternalProcessorClient, *recorded) {
	t.Helper()
	ids, err := identity.New(identity.Config{Secret: []byte("0123456789abcdef")})
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorded{}
	dec := affinity.New(memory.New(), fleet.New(instances), affinity.Policy{
		Mode: affinity.Sticky, Lifetime: bindings.Lifetime{Idle: time.Minute, Max: time.Hour},
	})
	srv := extproc.New(ids, dec, rec, extproc.Options{ClusterHeader: "x-tether-cluster", DebugHeaders: debug, Logger: zerolog.Nop()})
	return serve(t, srv), rec
}

// serve runs srv on a loopback gRPC server for the test and returns a client.
func serve(t testing.TB, srv *extproc.Server) extprocv3.ExternalProcessorClient {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(gs, srv)
	go func() { _ = gs.Serve(ln) }() // returns when Stop closes ln
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(); gs.Stop() })
	return extprocv3.NewExternalProcessorClient(conn)
}

func hdrs(kv ...string) *extprocv3.HttpHeaders {
	m := &corev3.HeaderMap{}
	for i := 0; i < len(kv); i += 2 {
		m.Headers = append(m.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
	}
	return &extprocv3.HttpHeaders{Headers: m}
}

func reqHeaders(kv ...string) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: hdrs(kv...)}}
}

func respHeaders(kv ...string) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: hdrs(kv...)}}
}

func set(kv ...string) *extprocv3.HeaderMutation {
	m := &extprocv3.HeaderMutation{}
	for i := 0; i < len(kv); i += 2 {
		m.SetHeaders = append(m.SetHeaders, &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])}})
	}
	return m
}

// exchange sends msgs on one stream and returns the replies.
func exchange(t *testing.T, c extprocv3.ExternalProcessorClient, msgs ...*extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := c.Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out []*extprocv3.ProcessingResponse
	for _, m := range msgs {
		if err := s.Send(m); err != nil {
			t.Fatal(err)
		}
		r, err := s.Recv()
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, r)
	}
	if err := s.CloseSend(); err != nil {
		t.Fatal(err)
	}
	return out
}

// debugMetadata is what the routing reply writes for the debug headers.
func debugMetadata(instance, decision string) *structpb.Struct {
	st, err := structpb.NewStruct(map[string]any{"tether": map[string]any{"instance": instance, "decision": decision}})
	if err != nil {
		panic(err)
	}
	return st
}

var two = []fleet.Instance{{Name: "a", Weight: 1}, {Name: "b", Weight: 1}}

func TestRequestAndResponsePhases(t *testing.T) {
	c, rec := start(t, two, true)
	got := exchange(t, c,
		reqHeaders(":path", "/v1/chat/completions", "x-session-id", "conv-1"),
		respHeaders(":status", "200"),
	)
	cluster := string(got[0].GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders()[0].GetHeader().GetRawValue())
	name := strings.TrimPrefix(cluster, "inst-")
	if name != "a" && name != "b" {
		t.Fatalf("routing header %q", cluster)
	}
	want := fleet.Instance{Name: name}
	wantReq := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
		RequestHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{
			HeaderMutation:  set("x-tether-cluster", want.Cluster()),
			ClearRouteCache: true,
		}},
	}, DynamicMetadata: debugMetadata(name, "bind")}
	if diff := cmp.Diff(wantReq, got[0], protocmp.Transform()); diff != "" {
		t.Errorf("request-headers reply (-want +got):\n%s", diff)
	}
	wantResp := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
		ResponseHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{
			HeaderMutation: set("x-tether-instance", name, "x-tether-decision", "bind"),
		}},
	}}
	if diff := cmp.Diff(wantResp, got[1], protocmp.Transform()); diff != "" {
		t.Errorf("response-headers reply (-want +got):\n%s", diff)
	}
	// The same session again: a hit on the same instance.
	again := exchange(t, c, reqHeaders("x-session-id", "conv-1"), respHeaders(":status", "503"))
	if diff := cmp.Diff(got[0].GetRequestHeaders(), again[0].GetRequestHeaders(), protocmp.Transform()); diff != "" {
		t.Errorf("second request routed elsewhere:\n%s", diff)
	}
	if diff := cmp.Diff(debugMetadata(name, "hit"), again[0].GetDynamicMetadata(), protocmp.Transform()); diff != "" {
		t.Errorf("second request's metadata:\n%s", diff)
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if diff := cmp.Diff([]affinity.Kind{affinity.KindBind, affinity.KindHit}, rec.decisions); diff != "" {
		t.Errorf("decisions: %s", diff)
	}
	if diff := cmp.Diff([]string{name + ":200", name + ":503"}, rec.responses); diff != "" {
		t.Errorf("responses: %s", diff)
	}
}

func TestValueFieldIsReadToo(t *testing.T) {
	c, rec := start(t, two, false)
	req := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
		Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: "x-session-id", Value: "old-style"}}},
	}}}
	exchange(t, c, req)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if diff := cmp.Diff([]affinity.Kind{affinity.KindBind}, rec.decisions); diff != "" {
		t.Errorf("a header in value (not raw_value) was not read: %s", diff)
	}
}

func TestBadIdentityIsAnonymousAndCounted(t *testing.T) {
	c, rec := start(t, two, true)
	for _, kv := range [][]string{
		{"x-session-id", strings.Repeat("x", 10<<10)},
		{"x-session-id", "a\x01b"},
		{"authorization", "Bearer"},
	} {
		got := exchange(t, c, reqHeaders(kv...), respHeaders(":status", "200"))
		if got[0].GetRequestHeaders().GetResponse().GetHeaderMutation() == nil {
			t.Fatalf("%s: no routing header", kv[0])
		}
		dec := got[1].GetResponseHeaders().GetResponse().GetHeaderMutation().GetSetHeaders()[1].GetHeader()
		if string(dec.GetRawValue()) != "anonymous" {
			t.Fatalf("%s: decision %q, want anonymous", kv[0], dec.GetRawValue())
		}
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	want := []identity.Reason{identity.ReasonTooLong, identity.ReasonControlChars, identity.ReasonMalformedAuth}
	if diff := cmp.Diff(want, rec.rejected); diff != "" {
		t.Errorf("rejections: %s", diff)
	}
}

func TestNoInstanceLeavesTheDefaultRoute(t *testing.T) {
	c, rec := start(t, nil, true)
	got := exchange(t, c, reqHeaders("x-session-id", "s"), respHeaders(":status", "200"))
	if m := got[0].GetRequestHeaders().GetResponse(); !unrouted(m) {
		t.Fatalf("want the default route, the client's destination removed; got %v", m)
	}
	if v := string(got[1].GetResponseHeaders().GetResponse().GetHeaderMutation().GetSetHeaders()[0].GetHeader().GetRawValue()); v != "none:no_instance" {
		t.Fatalf("debug decision %q", v)
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if diff := cmp.Diff([]string{"no_instance"}, rec.failures); diff != "" {
		t.Error(diff)
	}
	if len(rec.responses) != 0 {
		t.Errorf("a response without a decision was attributed: %v", rec.responses)
	}
}

func TestOtherPhasesContinue(t *testing.T) {
	c, _ := start(t, two, false)
	got := exchange(t, c,
		&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{}}},
		&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{}}},
		&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}},
		&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}},
		respHeaders(), // response headers without a request phase
	)
	if got[0].GetRequestBody() == nil || got[1].GetResponseBody() == nil || got[2].GetRequestTrailers() == nil ||
		got[3].GetResponseTrailers() == nil || got[4].GetResponseHeaders() == nil {
		t.Fatalf("replies do not match their phases: %v", got)
	}
}

func TestEmptyRequestIsRefused(t *testing.T) {
	c, _ := start(t, two, false)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := c.Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Send(&extprocv3.ProcessingRequest{}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Recv(); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("err = %v, want InvalidArgument", err)
	}
}

// BenchmarkProcess is one request's whole ext_proc exchange over loopback
// gRPC (request headers, then response headers) with the memory store: what
// tether adds per request apart from the Redis round trip.
func BenchmarkProcess(b *testing.B) {
	c, _ := start(b, two, true)
	msgs := []*extprocv3.ProcessingRequest{
		reqHeaders(":method", "POST", ":path", "/v1/chat/completions", "x-session-id", "8f14e45f-ceea-467f", "user-agent", "bench"),
		// As Envoy sends it: with the response attributes tether asks for.
		withUpstream(respHeaders(":status", "200"), "127.0.0.1:8001"),
	}
	benchExchange(b, c, msgs)
}

// benchExchange runs msgs as one ext_proc stream per iteration.
func benchExchange(b *testing.B, c extprocv3.ExternalProcessorClient, msgs []*extprocv3.ProcessingRequest) {
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		s, err := c.Process(ctx)
		if err != nil {
			b.Fatal(err)
		}
		for _, m := range msgs {
			if err := s.Send(m); err != nil {
				b.Fatal(err)
			}
			if _, err := s.Recv(); err != nil {
				b.Fatal(err)
			}
		}
		_ = s.CloseSend()
	}
}

// goneDecider fails as a decision does when Envoy gave up on the request.
type goneDecider struct{}

func (goneDecider) Finish(affinity.Decision, fleet.Outcome) {}

func (goneDecider) Refine(_ context.Context, d affinity.Decision, _ []uint64) affinity.Decision {
	return d
}

func (goneDecider) Decide(context.Context, affinity.Request) (affinity.Decision, error) {
	return affinity.Decision{}, context.Canceled
}

func TestCanceledDecisionIsCountedAsSuch(t *testing.T) {
	ids, err := identity.New(identity.Config{Secret: []byte("0123456789abcdef")})
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorded{}
	srv := extproc.New(ids, goneDecider{}, rec, extproc.Options{ClusterHeader: "x-tether-cluster", Logger: zerolog.Nop()})
	got := exchange(t, serve(t, srv), reqHeaders("x-session-id", "s"))
	if !unrouted(got[0].GetRequestHeaders().GetResponse()) {
		t.Fatalf("want the default route, got %v", got[0])
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if diff := cmp.Diff([]string{"canceled"}, rec.failures); diff != "" {
		t.Error(diff)
	}
}

// TestInFlightEndsWithEveryStream: each decision counts as a request in
// flight until the instance's response headers, or until the stream ends
// without them, so a load view never drifts; the reported queue depth
// reaches it.
func TestInFlightEndsWithEveryStream(t *testing.T) {
	ids, err := identity.New(identity.Config{Secret: []byte("0123456789abcdef")})
	if err != nil {
		t.Fatal(err)
	}
	dec := affinity.New(memory.New(), fleet.New([]fleet.Instance{{Name: "a", Weight: 1}}), affinity.Policy{
		Mode: affinity.Sticky, Lifetime: bindings.Lifetime{Idle: time.Minute},
	})
	srv := extproc.New(ids, dec, &recorded{}, extproc.Options{ClusterHeader: "x-tether-cluster", QueueHeader: "x-queue-depth", Logger: zerolog.Nop()})
	c := serve(t, srv)

	exchange(t, c, reqHeaders("x-session-id", "s"), respHeaders(":status", "200", "x-queue-depth", "7"))
	exchange(t, c, reqHeaders("x-session-id", "s"))                                                                 // no answer came
	exchange(t, c, reqHeaders("x-session-id", "s"), reqHeaders("x-session-id", "s"), respHeaders(":status", "200")) // two request phases
	exchange(t, c, reqHeaders("x-session-id", "s"), respHeaders(":status", "200", "x-queue-depth", "-3"))           // a nonsense depth is ignored
	deadline := time.Now().Add(5 * time.Second)
	for dec.Load().InFlight("a") != 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond) // the server sees the last stream end after the client does
	}
	if n := dec.Load().InFlight("a"); n != 0 {
		t.Fatalf("%d requests still in flight after every stream ended", n)
	}
	if q := dec.Load().Queue("a"); q != 7 {
		t.Fatalf("queue depth %d, want the reported 7", q)
	}
}

// TestInstanceReports: what instances report in response headers reaches
// the recorder; a header present but unreadable is named, not used.
func TestInstanceReports(t *testing.T) {
	ids, err := identity.New(identity.Config{Secret: []byte("0123456789abcdef")})
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorded{}
	dec := affinity.New(memory.New(), fleet.New(two), affinity.Policy{
		Mode: affinity.Sticky, Lifetime: bindings.Lifetime{Idle: time.Minute, Max: time.Hour},
	})
	c := serve(t, extproc.New(ids, dec, rec, extproc.Options{
		ClusterHeader: "x-tether-cluster", QueueHeader: "x-queue-depth", OOMHeader: "x-oom", GPUHeader: "x-gpu-utilization",
		Logger: zerolog.Nop(),
	}))
	cases := []struct {
		resp []string
		want fleet.Outcome
	}{
		{[]string{":status", "200", "x-queue-depth", "3", "x-oom", "false", "x-gpu-utilization", "87.5"},
			fleet.Outcome{Status: 200, Queue: 3, QueueKnown: true, GPU: 0.875, GPUKnown: true}},
		{[]string{":status", "200", "x-oom", "TRUE", "x-gpu-utilization", "40%"},
			fleet.Outcome{Status: 200, OOM: true, GPU: 0.4, GPUKnown: true}},
		{[]string{":status", "507"}, fleet.Outcome{Status: 507, Failed: true, OOM: true}},
		{[]string{":status", "200", "x-queue-depth", "-1", "x-oom", "maybe", "x-gpu-utilization", "150"},
			fleet.Outcome{Status: 200, BadReports: []string{"queue_depth", "oom", "gpu_utilization"}}},
		{[]string{":status", "200", "x-gpu-utilization", "NaN"},
			fleet.Outcome{Status: 200, BadReports: []string{"gpu_utilization"}}},
	}
	for i, tc := range cases {
		exchange(t, c, reqHeaders("x-session-id", "conv-1"), respHeaders(tc.resp...))
		rec.mu.Lock()
		got := rec.replies[i]
		rec.mu.Unlock()
		if got.Elapsed <= 0 || !got.Answered || got.Peer {
			t.Errorf("case %d: elapsed %v, served %v, peer %v: want a positive time, served by the instance", i, got.Elapsed, got.Answered, got.Peer)
		}
		got.Elapsed, got.Answered = 0, false
		if diff := cmp.Diff(tc.want, got); diff != "" {
			t.Errorf("case %d %v (-want +got):\n%s", i, tc.resp, diff)
		}
	}
}

// unrouted says a headers reply leaves Envoy its default route: no header
// set, no route cleared, only a client's destination removed.
func unrouted(r *extprocv3.CommonResponse) bool {
	m := r.GetHeaderMutation()
	return !r.GetClearRouteCache() && len(m.GetSetHeaders()) == 0 &&
		len(m.GetRemoveHeaders()) == 1 && m.GetRemoveHeaders()[0] == extproc.HeaderDestination
}
