package extproc_test

import (
	"context"
	"slices"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/extproc"
	"github.com/tetherproxy/tether/plan"
)

// clientRequest is a chat completion's request headers as the routing
// filter sees them: what the official OpenAI Python client (1.x, on httpx)
// sends, with Envoy's pseudo-headers and the headers Envoy adds. 22
// headers, 4 of which tether reads under the default configuration.
func clientRequest() []string {
	return []string{
		":authority", "llm.example.org", ":path", "/v1/chat/completions", ":method", "POST", ":scheme", "http",
		"accept", "application/json", "accept-encoding", "gzip, deflate", "content-type", "application/json",
		"content-length", "187", "user-agent", "OpenAI/Python 1.54.3",
		"authorization", "Bearer sk-proj-8f14e45fceea167a5a36dedd4bea2543",
		"x-stainless-arch", "x64", "x-stainless-async", "false", "x-stainless-lang", "python",
		"x-stainless-os", "Linux", "x-stainless-package-version", "1.54.3", "x-stainless-retry-count", "0",
		"x-stainless-read-timeout", "600", "x-stainless-runtime", "CPython", "x-stainless-runtime-version", "3.12.3",
		"x-forwarded-proto", "http", "x-request-id", "5b8f1c2e-0d3a-4f6b-9c1d-2e3f4a5b6c7d",
		"x-envoy-expected-rq-timeout-ms", "300000",
	}
}

// BenchmarkForwardRules is one request's routing stream (outcomes
// reported apart, the default: request headers only, a sticky hit by
// bearer token) with the OpenAI client's headers, as Envoy sends them
// without forward_rules (every header) and with the default
// configuration's (the four tether reads). "decode+handle" is tether's
// side without the transport: the message decoded from its wire bytes, as
// gRPC does, then the handler; "grpc" the whole exchange over loopback
// gRPC, client and server in this process. B/msg is the request message
// on the wire.
func BenchmarkForwardRules(b *testing.B) {
	cfg := config.Default()
	cfg.Instances = []config.Instance{{Name: "a", Address: "127.0.0.1:8001", Version: "v1", Weight: 1}}
	if err := cfg.Validate(); err != nil {
		b.Fatal(err)
	}
	p, err := plan.FromConfig(cfg, plan.Options{})
	if err != nil {
		b.Fatal(err)
	}
	all := clientRequest()
	var listed []string
	for i := 0; i < len(all); i += 2 {
		if slices.Contains(p.Envoy.RequestHeaders, all[i]) {
			listed = append(listed, all[i], all[i+1])
		}
	}
	apart := metadata.NewIncomingContext(context.Background(), metadata.Pairs(extproc.ApartMarker, "1"))
	for _, c := range []struct {
		name string
		kv   []string
	}{{"headers=all", all}, {"headers=forwarded", listed}} {
		wire, err := proto.Marshal(reqHeaders(c.kv...))
		if err != nil {
			b.Fatal(err)
		}
		b.Run(c.name+"/decode+handle", func(b *testing.B) {
			srv := exchangeServer(b, affinity.Sticky)
			st := &replayStream{ctx: apart, msgs: make([]*extprocv3.ProcessingRequest, 1)}
			b.ReportAllocs()
			for b.Loop() {
				req := &extprocv3.ProcessingRequest{}
				if err := proto.Unmarshal(wire, req); err != nil {
					b.Fatal(err)
				}
				st.msgs[0], st.next = req, 0
				if err := srv.Process(st); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(len(wire)), "B/msg") // after the loop, which resets reported metrics
		})
		b.Run(c.name+"/grpc", func(b *testing.B) {
			benchExchange(b, serve(b, exchangeServer(b, affinity.Sticky)), []*extprocv3.ProcessingRequest{reqHeaders(c.kv...)})
			b.ReportMetric(float64(len(wire)), "B/msg")
		})
	}
}
