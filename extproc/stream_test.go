package extproc_test

import (
	"context"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/extproc"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/prefix"
	"github.com/tetherproxy/tether/store/memory"
)

// scriptStream is one ext_proc stream in memory. Recv hands out in, then
// returns end (io.EOF when nil). Send keeps the replies, and fails from
// reply failFrom on (0: never).
type scriptStream struct {
	grpc.ServerStream // not called; nil
	ctx               context.Context
	in                []*extprocv3.ProcessingRequest
	end               error
	failFrom          int
	out               []*extprocv3.ProcessingResponse
}

func (s *scriptStream) Context() context.Context { return s.ctx }

func (s *scriptStream) Recv() (*extprocv3.ProcessingRequest, error) {
	if len(s.in) == 0 {
		if s.end == nil {
			return nil, io.EOF
		}
		return nil, s.end
	}
	m := s.in[0]
	s.in = s.in[1:]
	return m, nil
}

func (s *scriptStream) Send(r *extprocv3.ProcessingResponse) error {
	s.out = append(s.out, r)
	if s.failFrom > 0 && len(s.out) >= s.failFrom {
		return status.Error(codes.Unavailable, "send failed")
	}
	return nil
}

// ledger checks the decider's side: every decision finished once, and
// audited once.
type ledger struct {
	extproc.Decider
	mu                        sync.Mutex
	decided, finished, audits int
}

func (l *ledger) Decide(ctx context.Context, r affinity.Request) (affinity.Decision, error) {
	d, err := l.Decider.Decide(ctx, r)
	if err == nil {
		l.mu.Lock()
		l.decided++
		l.mu.Unlock()
	}
	return d, err
}

func (l *ledger) Finish(d affinity.Decision, o fleet.Outcome) {
	l.mu.Lock()
	l.finished++
	l.mu.Unlock()
	l.Decider.Finish(d, o)
}

func (l *ledger) Audit(string, string, identity.Identity, affinity.Decision, time.Time) {
	l.mu.Lock()
	l.audits++
	l.mu.Unlock()
}

// TestStreamTransitions walks a stream through its states, in the orders
// Envoy sends and in bad ones. Whatever the order, every decision is
// audited once and finished once, and nothing stays pending. An apart
// stream's decisions finish when their tickets come back.
func TestStreamTransitions(t *testing.T) {
	secret := []byte("0123456789abcdef")
	ids, err := identity.New(identity.Config{Secret: secret})
	if err != nil {
		t.Fatal(err)
	}
	hasher, err := prefix.NewHasher(64, 0)
	if err != nil {
		t.Fatal(err)
	}
	// A new session's placement is open: its headers reply asks for the body.
	chat := func(session string) *extprocv3.ProcessingRequest {
		return reqHeaders(":path", "/v1/chat/completions", "x-session-id", session, "content-length", "100")
	}
	// One with no body is routed by its headers alone.
	get := func(session string) *extprocv3.ProcessingRequest {
		return reqHeaders(":path", "/v1/chat/completions", "x-session-id", session, "content-length", "0")
	}
	body := reqBody(chatBody(strings.Repeat("a shared document ", 100), "q"), true)
	ok := withUpstream(respHeaders(":status", "200"), "127.0.0.1:9001")
	trailers := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}}
	observed := func(m *extprocv3.ProcessingRequest) *extprocv3.ProcessingRequest {
		c := proto.Clone(m).(*extprocv3.ProcessingRequest)
		c.ObservabilityMode = true
		return c
	}
	const (
		inline = iota
		apart
		observing
	)
	cases := []struct {
		name     string
		kind     int
		in       []*extprocv3.ProcessingRequest
		end      error // how the stream ends (nil: Envoy closes it)
		failFrom int   // the first reply that fails
		replies  int
		code     codes.Code // what Process returns
		asks     bool       // the first reply asks for the body
	}{
		{name: "inline: headers, response", in: []*extprocv3.ProcessingRequest{get("s1"), ok}, replies: 2},
		{name: "inline: headers, body, response", in: []*extprocv3.ProcessingRequest{chat("b1"), body, ok}, replies: 3, asks: true},
		{name: "inline: response before request headers", in: []*extprocv3.ProcessingRequest{ok, get("s2"), ok}, replies: 3},
		{name: "inline: a body with no headers", in: []*extprocv3.ProcessingRequest{body, ok}, replies: 2},
		{name: "inline: request headers twice", in: []*extprocv3.ProcessingRequest{get("s3"), get("s3"), ok}, replies: 3},
		{name: "inline: request headers twice, the body awaited", in: []*extprocv3.ProcessingRequest{chat("b2"), chat("b3"), body, ok}, replies: 4, asks: true},
		{name: "inline: trailers without a body", in: []*extprocv3.ProcessingRequest{chat("b4"), trailers, ok}, replies: 3, asks: true},
		{name: "inline: response twice", in: []*extprocv3.ProcessingRequest{get("s4"), ok, ok}, replies: 3},
		{name: "inline: ends before the body", in: []*extprocv3.ProcessingRequest{chat("b5")}, end: status.Error(codes.Unavailable, "gone"), replies: 1, code: codes.Unavailable, asks: true},
		{name: "inline: ends before the response", in: []*extprocv3.ProcessingRequest{get("s5")}, end: status.Error(codes.Canceled, "canceled"), replies: 1},
		{name: "inline: the headers reply fails", in: []*extprocv3.ProcessingRequest{get("s6"), ok}, failFrom: 1, replies: 1, code: codes.Unavailable},
		{name: "inline: observability messages ignored", in: []*extprocv3.ProcessingRequest{get("s7"), observed(ok), ok}, replies: 2},
		{name: "inline: a message with no phase", in: []*extprocv3.ProcessingRequest{get("s8"), {}}, replies: 1, code: codes.InvalidArgument},
		{name: "apart: headers", kind: apart, in: []*extprocv3.ProcessingRequest{get("s9")}, replies: 1},
		{name: "apart: headers, body", kind: apart, in: []*extprocv3.ProcessingRequest{chat("b6"), body}, replies: 2, asks: true},
		{name: "apart: request headers twice, the body awaited", kind: apart, in: []*extprocv3.ProcessingRequest{chat("b7"), chat("b8"), body}, replies: 3, asks: true},
		{name: "apart: response while the body is awaited", kind: apart, in: []*extprocv3.ProcessingRequest{chat("b9"), ok}, replies: 2, asks: true},
		{name: "apart: response before request headers", kind: apart, in: []*extprocv3.ProcessingRequest{ok, get("s10")}, replies: 1},
		{name: "apart: ends before the body", kind: apart, in: []*extprocv3.ProcessingRequest{chat("b10")}, replies: 1, asks: true},
		{name: "apart: the headers reply fails", kind: apart, in: []*extprocv3.ProcessingRequest{get("s11")}, failFrom: 1, replies: 1, code: codes.Unavailable},
		{name: "apart: the body reply fails", kind: apart, in: []*extprocv3.ProcessingRequest{chat("b11"), body}, failFrom: 2, replies: 2, code: codes.Unavailable, asks: true},
		{name: "observing: no response", kind: observing, in: []*extprocv3.ProcessingRequest{observed(get("s12"))}},
		{name: "observing: response only", kind: observing, in: []*extprocv3.ProcessingRequest{observed(ok), observed(ok)}},
		{name: "observing: routing messages answered, not routed", kind: observing, in: []*extprocv3.ProcessingRequest{observed(body), get("s13"), ok, observed(ok)}, replies: 2},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			fl := fleet.New([]fleet.Instance{{Name: "a", Address: "127.0.0.1:9001", Weight: 1}, {Name: "b", Address: "127.0.0.1:9002", Weight: 1}})
			dec := affinity.New(memory.New(), fl, affinity.Policy{
				Mode: affinity.Sticky, Lifetime: bindings.Lifetime{Idle: time.Hour},
				Content: affinity.Content{Enabled: true, MinBlocks: 2, BlockTokens: 16, QueuedTokens: 1024, RunningTokens: 128},
			}, affinity.WithPrefixIndex(prefix.NewIndex(1<<10)))
			l, rec := &ledger{Decider: dec}, &recorded{}
			srv := extproc.New(ids, l, rec, extproc.Options{
				ClusterHeader: "x-tether-cluster", Logger: zerolog.Nop(), Auditor: l, DebugHeaders: true,
				Tickets: extproc.NewTickets(secret), Instances: fl, Prompts: hasher, MaxBody: 8 << 10,
			})
			ctx := context.Background()
			if c.kind == apart {
				ctx = metadata.NewIncomingContext(ctx, metadata.Pairs(extproc.ApartMarker, "1"))
			}
			st := &scriptStream{ctx: ctx, in: c.in, end: c.end, failFrom: c.failFrom}
			err := srv.Process(st)
			if status.Code(err) != c.code {
				t.Fatalf("Process returned %v, want %v", err, c.code)
			}
			if len(st.out) != c.replies {
				t.Fatalf("%d replies, want %d", len(st.out), c.replies)
			}
			if asks := len(st.out) > 0 && st.out[0].GetModeOverride() != nil; asks != c.asks {
				t.Fatalf("the first reply asks for the body: %v, want %v", asks, c.asks)
			}
			// The ticket Envoy holds last comes back, as an observing stream
			// brings it.
			var ticket string
			for i, r := range st.out {
				if c.failFrom > 0 && i+1 >= c.failFrom {
					break
				}
				if v := r.GetDynamicMetadata().GetFields()[extproc.MetadataNamespace].GetStructValue().GetFields()["t"].GetStringValue(); v != "" {
					ticket = v
				}
			}
			if ticket != "" {
				report := observed(reqHeaders())
				report.MetadataContext = ticketContext(ticket)
				if err := srv.Process(&scriptStream{ctx: context.Background(), in: []*extprocv3.ProcessingRequest{report, observed(ok)}}); err != nil {
					t.Fatal(err)
				}
			}
			if a, s := srv.Pending(); a != 0 || s != 0 {
				t.Errorf("pending %d apart, %d on their stream; want none", a, s)
			}
			if l.finished != l.decided || l.audits != l.decided {
				t.Errorf("%d decisions: %d finished, %d audited; want each once", l.decided, l.finished, l.audits)
			}
			if c.kind == observing && (l.decided != 0 || len(rec.outcomes) != 1 || rec.outcomes[extproc.ReportUndecided] != 1) {
				t.Errorf("an observing stream with no ticket: %d decisions, reports %v; want none, and one report", l.decided, rec.outcomes)
			}
		})
	}
}

// ticketContext is the forwarded dynamic metadata holding ticket.
func ticketContext(ticket string) *corev3.Metadata {
	return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
		extproc.MetadataNamespace: {Fields: map[string]*structpb.Value{"t": structpb.NewStringValue(ticket)}},
	}}
}
