package extproc_test

import (
	"context"
	"errors"
	"io"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/extproc"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/metrics"
	"github.com/tetherproxy/tether/store/memory"
)

// replayStream is an ext_proc stream without gRPC: Recv hands out msgs in
// turn, then io.EOF; Send keeps nothing (fakeStream, the fuzz target's, records both). It lets a benchmark count what
// the handler itself allocates per exchange.
type replayStream struct {
	grpc.ServerStream // not called; nil
	ctx               context.Context
	msgs              []*extprocv3.ProcessingRequest
	next              int
	last              *extprocv3.ProcessingResponse // the last reply sent
}

func (s *replayStream) Context() context.Context { return s.ctx }

func (s *replayStream) Recv() (*extprocv3.ProcessingRequest, error) {
	if s.next == len(s.msgs) {
		return nil, io.EOF
	}
	s.next++
	return s.msgs[s.next-1], nil
}

func (s *replayStream) Send(r *extprocv3.ProcessingResponse) error { s.last = r; return nil }

// exchangeServer is the processor as tether serve builds it: tickets in
// every routing reply, the Prometheus recorder, debug headers off (their
// default), two instances on the memory store, in mode.
func exchangeServer(b *testing.B, mode affinity.Mode) *extproc.Server {
	secret := []byte("0123456789abcdef")
	ids, err := identity.New(identity.Config{Secret: secret})
	if err != nil {
		b.Fatal(err)
	}
	instances := fleet.New(two)
	dec := affinity.New(memory.New(), instances, affinity.Policy{
		Mode: mode, Lifetime: bindings.Lifetime{Idle: time.Minute, Max: time.Hour},
	})
	return extproc.New(ids, dec, metrics.New(prometheus.NewRegistry()), extproc.Options{
		ClusterHeader: "x-tether-cluster", Logger: zerolog.Nop(),
		Tickets: extproc.NewTickets(secret), Instances: instances,
	})
}

// exchangeMsgs is a follow-up turn as Envoy sends it: request headers,
// then response headers with the response attributes tether asks for.
func exchangeMsgs() []*extprocv3.ProcessingRequest {
	return []*extprocv3.ProcessingRequest{
		reqHeaders(":method", "POST", ":path", "/v1/chat/completions", ":authority", "llm.example.org",
			"x-session-id", "8f14e45f-ceea-467f", "user-agent", "bench", "content-type", "application/json",
			"x-request-id", "5b8f1c2e-0d3a-4f6b-9c1d-2e3f4a5b6c7d"),
		withUpstream(respHeaders(":status", "200", "content-type", "application/json"), "127.0.0.1:8001"),
	}
}

var exchangeModes = []struct {
	name string
	mode affinity.Mode
}{{"mode=random", affinity.Random}, {"mode=sticky", affinity.Sticky}}

// BenchmarkExchangeServerSide is one request's exchange in the handler
// alone (Server.Process on a stream without gRPC): what tether allocates
// per request apart from the transport.
func BenchmarkExchangeServerSide(b *testing.B) {
	for _, m := range exchangeModes {
		b.Run(m.name, func(b *testing.B) {
			srv := exchangeServer(b, m.mode)
			msgs := exchangeMsgs()
			st := &replayStream{ctx: context.Background(), msgs: msgs}
			b.ReportAllocs()
			for b.Loop() {
				st.next = 0
				if err := srv.Process(st); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkExchangeObservedServerSide is one request with outcomes
// observed (envoy.outcomes = "observe"): the routing stream
// (marked, request headers only) and the observing stream that brings
// its ticket back with the response headers. Handing the ticket over
// costs the benchmark one allocation of its own.
func BenchmarkExchangeObservedServerSide(b *testing.B) {
	for _, m := range exchangeModes {
		b.Run(m.name, func(b *testing.B) {
			srv := exchangeServer(b, m.mode)
			msgs := exchangeMsgs()
			ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(extproc.ApartMarker, "1"))
			route := &replayStream{ctx: ctx, msgs: msgs[:1]}
			ticket := &structpb.Struct{Fields: map[string]*structpb.Value{}}
			obsReq := reqHeaders(":path", "/v1/chat/completions")
			obsReq.ObservabilityMode = true
			obsReq.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{extproc.MetadataNamespace: ticket}}
			obsResp := withUpstream(respHeaders(":status", "200", "content-type", "application/json"), "127.0.0.1:8001")
			obsResp.ObservabilityMode = true
			observe := &replayStream{ctx: context.Background(), msgs: []*extprocv3.ProcessingRequest{obsReq, obsResp}}
			b.ReportAllocs()
			for b.Loop() {
				route.next, observe.next = 0, 0
				if err := srv.Process(route); err != nil {
					b.Fatal(err)
				}
				ticket.Fields["t"] = route.last.GetDynamicMetadata().GetFields()[extproc.MetadataNamespace].GetStructValue().GetFields()["t"]
				if err := srv.Process(observe); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkExchangeGRPC is the same exchange over a real loopback gRPC
// connection: a new stream per request, as Envoy opens one, client and
// server in this process (allocs/op counts both sides).
func BenchmarkExchangeGRPC(b *testing.B) {
	for _, m := range exchangeModes {
		b.Run(m.name, func(b *testing.B) {
			benchExchange(b, serve(b, exchangeServer(b, m.mode)), exchangeMsgs())
		})
	}
}

// BenchmarkExchangeApartGRPC is a routing stream whose end is reported
// apart, over loopback gRPC, as Envoy runs it: the request headers, their
// reply, then Envoy closes its side (it expects nothing more) and the
// stream ends.
func BenchmarkExchangeApartGRPC(b *testing.B) {
	secret := []byte("0123456789abcdef")
	ids, err := identity.New(identity.Config{Secret: secret})
	if err != nil {
		b.Fatal(err)
	}
	instances := fleet.New(two)
	dec := affinity.New(memory.New(), instances, affinity.Policy{
		Mode: affinity.Sticky, Lifetime: bindings.Lifetime{Idle: time.Minute, Max: time.Hour},
	})
	c := serve(b, extproc.New(ids, dec, &recorded{}, extproc.Options{
		ClusterHeader: "x-tether-cluster", Logger: zerolog.Nop(),
		Tickets: extproc.NewTickets(secret), Instances: instances,
	}))
	ctx := metadata.AppendToOutgoingContext(context.Background(), extproc.ApartMarker, "1")
	req := reqHeaders("x-session-id", "conv-1", ":path", "/v1/chat/completions")
	b.ReportAllocs()
	b.SetParallelism(8)
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			s, err := c.Process(ctx)
			if err != nil {
				b.Fatal(err)
			}
			if err := s.Send(req); err != nil {
				b.Fatal(err)
			}
			if _, err := s.Recv(); err != nil {
				b.Fatal(err)
			}
			if err := s.CloseSend(); err != nil {
				b.Fatal(err)
			}
			if _, err := s.Recv(); !errors.Is(err, io.EOF) {
				b.Fatalf("the stream ended with %v, want EOF", err)
			}
		}
	})
}
