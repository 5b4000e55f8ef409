package server

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"runtime"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3filter "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/experimental"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/extproc"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/metrics"
	"github.com/tetherproxy/tether/store/memory"
)

// BenchmarkExtProcServerOptions runs one exchange per stream (request
// headers, then response headers, as Envoy sends them) against the
// ext_proc server built with gRPC's defaults and with each of the tunings,
// side by side in one run: serially, and from 16 goroutines on one
// connection as Envoy's worker multiplexes its requests.
func BenchmarkExtProcServerOptions(b *testing.B) {
	for _, v := range []struct {
		name string
		opts []grpc.ServerOption
	}{
		{"defaults", nil},
		{"windows", []grpc.ServerOption{grpc.StaticStreamWindowSize(streamWindow), grpc.StaticConnWindowSize(connWindow)}},
		{"tuned", extprocServerOptions()},
		{"tuned+workers", append(extprocServerOptions(), grpc.NumStreamWorkers(uint32(runtime.GOMAXPROCS(0))))},
	} {
		b.Run(v.name+"/serial", func(b *testing.B) {
			c := benchClient(b, v.opts)
			b.ReportAllocs()
			for b.Loop() {
				benchStream(b, c, benchMsgs)
			}
		})
		b.Run(v.name+"/parallel", func(b *testing.B) {
			c := benchClient(b, v.opts)
			b.ReportAllocs()
			b.SetParallelism(8)
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					benchStream(b, c, benchMsgs)
				}
			})
		})
	}
}

// BenchmarkGatewayExchange is one request as a gateway in Istio's style
// sends it (both bodies FULL_DUPLEX_STREAMED): the request headers, the
// request body in one chunk of 1 KB or 32 KB, the response headers and a
// short response body, each echoed. gRPC's defaults beside tether's
// options, side by side in one run, 8 goroutines on one connection.
func BenchmarkGatewayExchange(b *testing.B) {
	for _, size := range []int{1 << 10, 32 << 10} {
		msgs := gatewayMsgs(size)
		for _, v := range []struct {
			name string
			opts []grpc.ServerOption
		}{
			{"defaults", nil},
			{"defaults+pool", []grpc.ServerOption{experimental.BufferPool(bufferPool()), grpc.ForceServerCodecV2(codec{bufferPool()})}},
			{"tuned", extprocServerOptions()},
		} {
			b.Run(fmt.Sprintf("body=%dKB/%s", size>>10, v.name), func(b *testing.B) {
				c := benchClient(b, v.opts)
				b.ReportAllocs()
				b.SetBytes(int64(size))
				b.SetParallelism(4)
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						benchStream(b, c, msgs)
					}
				})
			})
		}
	}
}

// gatewayMsgs is benchMsgs as a gateway sends them, bodies streamed both
// ways, with a request body of size bytes.
func gatewayMsgs(size int) []*extprocv3.ProcessingRequest {
	duplex := &extprocv3.ProtocolConfiguration{
		RequestBodyMode:  extprocv3filter.ProcessingMode_FULL_DUPLEX_STREAMED,
		ResponseBodyMode: extprocv3filter.ProcessingMode_FULL_DUPLEX_STREAMED,
	}
	headers := proto.Clone(benchMsgs[0]).(*extprocv3.ProcessingRequest)
	headers.ProtocolConfig = duplex
	body := bytes.Repeat([]byte("a"), size)
	answer := []byte(`{"choices":[{"message":{"content":"ok"}}],"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":8}}}`)
	return []*extprocv3.ProcessingRequest{
		headers,
		{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: true}}},
		benchMsgs[1],
		{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: answer, EndOfStream: true}}},
	}
}

var benchMsgs = func() []*extprocv3.ProcessingRequest {
	hdrs := func(kv ...string) *extprocv3.HttpHeaders {
		m := &corev3.HeaderMap{}
		for i := 0; i < len(kv); i += 2 {
			m.Headers = append(m.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
		}
		return &extprocv3.HttpHeaders{Headers: m}
	}
	attrs, _ := structpb.NewStruct(map[string]any{extproc.AttrResponseCode: 200.0, extproc.AttrUpstreamAddress: "127.0.0.1:8001"})
	return []*extprocv3.ProcessingRequest{
		{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: hdrs(
			":method", "POST", ":path", "/v1/chat/completions", ":authority", "llm.example.org",
			"x-session-id", "8f14e45f-ceea-467f", "user-agent", "bench", "content-type", "application/json",
			"x-request-id", "5b8f1c2e-0d3a-4f6b-9c1d-2e3f4a5b6c7d")}},
		{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: hdrs(":status", "200", "content-type", "application/json")},
			Attributes: map[string]*structpb.Struct{"envoy.filters.http.ext_proc": attrs}},
	}
}()

// benchClient serves tether's processor (sticky, two instances, memory
// store, tickets, the Prometheus recorder) with opts on a loopback
// listener, and returns a client on one connection.
func benchClient(b *testing.B, opts []grpc.ServerOption) extprocv3.ExternalProcessorClient {
	secret := []byte("0123456789abcdef")
	ids, err := identity.New(identity.Config{Secret: secret})
	if err != nil {
		b.Fatal(err)
	}
	instances := fleet.New([]fleet.Instance{{Name: "a", Weight: 1}, {Name: "b", Weight: 1}})
	dec := affinity.New(memory.New(), instances, affinity.Policy{
		Mode: affinity.Sticky, Lifetime: bindings.Lifetime{Idle: time.Minute, Max: time.Hour},
	})
	srv := extproc.New(ids, dec, metrics.New(prometheus.NewRegistry()), extproc.Options{
		ClusterHeader: "x-tether-cluster", Logger: zerolog.Nop(),
		Tickets: extproc.NewTickets(secret), Instances: instances,
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	gs := grpc.NewServer(opts...)
	extprocv3.RegisterExternalProcessorServer(gs, srv)
	go func() { _ = gs.Serve(ln) }() // returns when Stop closes ln
	// The client, Envoy's stand-in, on tether's pool in every variant: what
	// differs between them is the server.
	pool := bufferPool()
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		experimental.WithBufferPool(pool), grpc.WithDefaultCallOptions(grpc.ForceCodecV2(codec{pool})))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = conn.Close(); gs.Stop() })
	return extprocv3.NewExternalProcessorClient(conn)
}

func benchStream(b *testing.B, c extprocv3.ExternalProcessorClient, msgs []*extprocv3.ProcessingRequest) {
	s, err := c.Process(context.Background())
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
