package extproc_test

import (
	"context"
	"crypto/rand"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/audit"
	auditfile "github.com/tetherproxy/tether/audit/file"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/extproc"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/store/memory"
)

// discardSink takes every record and keeps none: the audit=on benchmark
// then measures what the request path pays (building, sealing and queueing
// a record) and the writer goroutine's share of the CPU, not a disk or a
// network.
type discardSink struct{}

func (discardSink) Write(context.Context, []audit.Record) error            { return nil }
func (discardSink) Delete(context.Context, string) (int, error)            { return 0, nil }
func (discardSink) Export(context.Context, string) ([]audit.Record, error) { return nil, nil }
func (discardSink) Close() error                                           { return nil }

// BenchmarkAuditOverhead is BenchmarkProcess's exchange (a follow-up turn:
// request headers, then response headers, over loopback gRPC, memory
// store) with the routing audit off (Options.Auditor nil) and on: a real
// audit.Recorder and audit.Writer at sample_rate 1, so every decision is
// recorded, with Envoy's x-request-id kept and the user id sealed
// (AES-256-GCM) and pseudonymised (HMAC-SHA256) per request, the worst
// case. audit=on writes to a sink that discards; audit=on,sink=file to
// the file sink (audit/file) in a temporary directory (JSON lines, fsync
// per batch).
func BenchmarkAuditOverhead(b *testing.B) {
	for _, bc := range []struct {
		name string
		sink func(b *testing.B) audit.Sink
	}{
		{"audit=off", nil},
		{"audit=on", func(*testing.B) audit.Sink { return discardSink{} }},
		{"audit=on,sink=file", func(b *testing.B) audit.Sink {
			s, err := auditfile.New(auditfile.Config{Dir: b.TempDir(), Retention: audit.MaxRetention})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { _ = s.Close() })
			return s
		}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			var w *audit.Writer
			opts := extproc.Options{ClusterHeader: "x-tether-cluster", UserHeader: "x-user-id", DebugHeaders: true, Logger: zerolog.Nop()}
			if bc.sink != nil {
				w, opts.Auditor = benchAuditor(b, bc.sink(b))
			}
			c := serve(b, newBenchServer(b, opts))
			msgs := []*extprocv3.ProcessingRequest{
				reqHeaders(":method", "POST", ":path", "/v1/chat/completions", "x-session-id", "8f14e45f-ceea-467f",
					"user-agent", "bench", "x-user-id", "user-7f3c@example.org", "x-request-id", "5b8f1c2e-0d3a-4f6b-9c1d-2e3f4a5b6c7d"),
				withUpstream(respHeaders(":status", "200"), "127.0.0.1:8001"),
			}
			benchExchange(b, c, msgs)
			if w != nil {
				b.StopTimer()
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				if err := w.Close(ctx); err != nil {
					b.Fatal(err)
				}
				if w.Written() == 0 || w.Failed() != 0 {
					b.Fatalf("audit: written %d, failed %d", w.Written(), w.Failed())
				}
				b.ReportMetric(float64(w.Dropped())/float64(w.Written()+w.Dropped()), "dropped/record")
			}
		})
	}
}

// newBenchServer is start's processor (two instances, sticky, memory
// store) with opts.
func newBenchServer(b *testing.B, opts extproc.Options) *extproc.Server {
	ids, err := identity.New(identity.Config{Secret: []byte("0123456789abcdef")})
	if err != nil {
		b.Fatal(err)
	}
	dec := affinity.New(memory.New(), fleet.New(two), affinity.Policy{
		Mode: affinity.Sticky, Lifetime: bindings.Lifetime{Idle: time.Minute, Max: time.Hour},
	})
	return extproc.New(ids, dec, &recorded{}, opts)
}

// benchAuditor is tether's audit on sink: a Writer at the default buffer
// and batch, sample rate 1, and a Recorder with fresh keys.
func benchAuditor(b *testing.B, sink audit.Sink) (*audit.Writer, extproc.Auditor) {
	key := func() []byte {
		k := make([]byte, audit.KeySize)
		_, _ = rand.Read(k)
		return k
	}
	sealer, err := audit.NewSealer([]audit.Key{{ID: "k1", Bytes: key()}}, key())
	if err != nil {
		b.Fatal(err)
	}
	w, err := audit.NewWriter(sink, audit.WriterConfig{SampleRate: 1})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = w.Close(context.Background()) })
	rec, err := audit.NewRecorder(w, sealer, audit.RecorderConfig{})
	if err != nil {
		b.Fatal(err)
	}
	return w, rec
}
