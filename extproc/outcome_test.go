package extproc_test

import (
	"context"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	accesslogdatav3 "github.com/envoyproxy/go-control-plane/envoy/data/accesslog/v3"
	accesslogv3 "github.com/envoyproxy/go-control-plane/envoy/service/accesslog/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/extproc"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/store/memory"
)

// finishes counts the decider's Finish calls per instance, and which of
// them failed.
type finishes struct {
	extproc.Decider
	mu            sync.Mutex
	done, failure map[string]int
}

func (f *finishes) Finish(d affinity.Decision, a fleet.Outcome) {
	f.mu.Lock()
	f.done[d.Instance.Name]++
	if a.Failed {
		f.failure[d.Instance.Name]++
	}
	f.mu.Unlock()
	f.Decider.Finish(d, a)
}

// counts is how many of gpu-a's decisions finished, and how many failed.
func (f *finishes) counts() (done, failed int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.done["gpu-a"], f.failure["gpu-a"]
}

// apartWorld is a server whose outcomes are reported apart, with a real
// decider, in-flight counts and breaker (it opens on the third failure).
type apartWorld struct {
	conn    *grpc.ClientConn
	fin     *finishes
	load    *affinity.Load
	breaker *fleet.Breaker
	rec     *recorded
	secret  []byte
	srv     *extproc.Server
}

func newApartWorld(t *testing.T, instances []fleet.Instance) *apartWorld {
	t.Helper()
	w := &apartWorld{secret: []byte("0123456789abcdef"), rec: &recorded{}}
	ids, err := identity.New(identity.Config{Secret: w.secret})
	if err != nil {
		t.Fatal(err)
	}
	fl := fleet.New(instances)
	w.load = affinity.NewLoad()
	w.breaker = fleet.NewBreaker(fleet.BreakerConfig{Threshold: 2, Window: time.Minute, Cooldown: time.Hour}, time.Now, nil)
	dec := affinity.New(memory.New(), fl, affinity.Policy{
		Mode: affinity.Sticky, Lifetime: bindings.Lifetime{Idle: time.Minute, Max: time.Hour},
	}, affinity.WithLoad(w.load), affinity.WithBreaker(w.breaker))
	w.fin = &finishes{Decider: dec, done: map[string]int{}, failure: map[string]int{}}
	srv := extproc.New(ids, w.fin, w.rec, extproc.Options{
		ClusterHeader: "x-tether-cluster", Logger: zerolog.Nop(),
		Tickets: extproc.NewTickets(w.secret), Instances: fl,
	})
	w.srv = srv
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(gs, srv)
	accesslogv3.RegisterAccessLogServiceServer(gs, srv.AccessLog())
	go func() { _ = gs.Serve(ln) }()
	w.conn, err = grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.conn.Close(); gs.Stop() })
	return w
}

// route runs a routing stream as Envoy's filter does with outcomes apart:
// the request headers, one reply, and the stream closes. It returns the
// ticket and the instance's cluster.
func (w *apartWorld) route(t *testing.T, apart bool, kv ...string) (ticket, cluster string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if apart {
		ctx = metadata.AppendToOutgoingContext(ctx, extproc.ApartMarker, "1")
	}
	s, err := extprocv3.NewExternalProcessorClient(w.conn).Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Send(reqHeaders(kv...)); err != nil {
		t.Fatal(err)
	}
	r, err := s.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if err := s.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Recv(); err == nil {
		t.Fatal("a second reply on the routing stream")
	}
	for _, h := range r.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == "x-tether-cluster" {
			cluster = string(h.GetHeader().GetRawValue())
		}
	}
	md := r.GetDynamicMetadata().GetFields()[extproc.MetadataNamespace].GetStructValue()
	return md.GetFields()["t"].GetStringValue(), cluster
}

// observe runs an observing stream: request headers with the forwarded
// metadata, then (unless status is 0) the response headers; no replies.
func (w *apartWorld) observe(t *testing.T, ticket string, status int, upstream string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := extprocv3.NewExternalProcessorClient(w.conn).Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	md := &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{}}
	if ticket != "" {
		md.FilterMetadata[extproc.MetadataNamespace] = &structpb.Struct{Fields: map[string]*structpb.Value{"t": structpb.NewStringValue(ticket)}}
	}
	req := reqHeaders(":path", "/v1/chat/completions")
	req.ObservabilityMode, req.MetadataContext = true, md
	msgs := []*extprocv3.ProcessingRequest{req}
	if status != 0 {
		resp := respHeaders(":status", fmt.Sprint(status))
		resp.ObservabilityMode = true
		if upstream != "" {
			resp.Attributes = map[string]*structpb.Struct{"envoy.filters.http.ext_proc": {Fields: map[string]*structpb.Value{
				"upstream.address": structpb.NewStringValue(upstream),
			}}}
		}
		msgs = append(msgs, resp)
	}
	for _, m := range msgs {
		if err := s.Send(m); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if r, err := s.Recv(); err == nil {
		t.Fatalf("a reply to an observing stream: %v", r)
	}
}

// accessLog sends entries on one access-log stream, as an Envoy worker
// does, and waits for the server to have read them all.
func (w *apartWorld) accessLog(t *testing.T, entries ...*accesslogdatav3.HTTPAccessLogEntry) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := accesslogv3.NewAccessLogServiceClient(w.conn).StreamAccessLogs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	const batch = 500
	for len(entries) > 0 {
		n := min(batch, len(entries))
		msg := &accesslogv3.StreamAccessLogsMessage{
			Identifier: &accesslogv3.StreamAccessLogsMessage_Identifier{LogName: "tether.outcomes"},
			LogEntries: &accesslogv3.StreamAccessLogsMessage_HttpLogs{HttpLogs: &accesslogv3.StreamAccessLogsMessage_HTTPAccessLogEntries{LogEntry: entries[:n]}},
		}
		if err := s.Send(msg); err != nil {
			t.Fatal(err)
		}
		entries = entries[n:]
	}
	if _, err := s.CloseAndRecv(); err != nil {
		t.Fatal(err)
	}
}

func logEntry(ticket string, status uint32, host string) *accesslogdatav3.HTTPAccessLogEntry {
	c := &accesslogdatav3.AccessLogCommon{}
	if ticket != "" {
		c.Metadata = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
			extproc.MetadataNamespace: {Fields: map[string]*structpb.Value{"t": structpb.NewStringValue(ticket)}},
		}}
	}
	if host != "" {
		h, p, _ := net.SplitHostPort(host)
		var port uint32
		_, _ = fmt.Sscan(p, &port)
		c.UpstreamRemoteAddress = &corev3.Address{Address: &corev3.Address_SocketAddress{SocketAddress: &corev3.SocketAddress{
			Address: h, PortSpecifier: &corev3.SocketAddress_PortValue{PortValue: port},
		}}}
	}
	return &accesslogdatav3.HTTPAccessLogEntry{
		CommonProperties: c,
		Response:         &accesslogdatav3.HTTPResponseProperties{ResponseCode: wrapperspb.UInt32(status)},
	}
}

var oneGPU = []fleet.Instance{{Name: "gpu-a", Address: "127.0.0.1:9001", Weight: 1}}

// TestApartDecisionFinishedByItsReport: a routing stream reported apart
// carries a ticket and leaves its decision in flight when it closes; the
// observing stream's report finishes it, once.
func TestApartDecisionFinishedByItsReport(t *testing.T) {
	w := newApartWorld(t, oneGPU)
	ticket, cluster := w.route(t, true, "x-session-id", "s1")
	if ticket == "" || cluster == "" {
		t.Fatalf("ticket %q, cluster %q", ticket, cluster)
	}
	if got := w.load.InFlight("gpu-a"); got != 1 {
		t.Fatalf("in flight after the routing stream closed: %d, want 1 (its report is still to come)", got)
	}
	if done, _ := w.fin.counts(); done != 0 {
		t.Fatalf("the routing stream's end finished the decision %d times", done)
	}
	w.observe(t, ticket, 200, "127.0.0.1:9001")
	if done, failed := w.fin.counts(); done != 1 || failed != 0 {
		t.Fatalf("after the report: %d finishes (%d failed), want 1 (0)", done, failed)
	}
	if got := w.load.InFlight("gpu-a"); got != 0 {
		t.Fatalf("in flight after the report: %d", got)
	}
	w.rec.mu.Lock()
	defer w.rec.mu.Unlock()
	if w.rec.outcomes[extproc.ReportApplied] != 1 || len(w.rec.responses) != 1 || w.rec.responses[0] != "gpu-a:200" {
		t.Fatalf("recorded %v, responses %v", w.rec.outcomes, w.rec.responses)
	}
}

// TestPendingUntilItsEndIsHeard: the server awaits the end of each
// request it routed (what a stop waits for): apart until its own ticket
// comes back, not another replica's; inline until its stream ends.
func TestPendingUntilItsEndIsHeard(t *testing.T) {
	w := newApartWorld(t, oneGPU)
	pending := func(what string, apart, stream int) {
		t.Helper()
		// A stream's end runs after the client has seen it close.
		deadline := time.Now().Add(5 * time.Second)
		for {
			a, s := w.srv.Pending()
			if a == apart && s == stream {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: pending %d apart, %d on their stream; want %d, %d", what, a, s, apart, stream)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	pending("at start", 0, 0)
	mine, _ := w.route(t, true, "x-session-id", "s1")
	pending("routed apart", 1, 0)
	// Another replica of the deployment (its own issuer) routed this one.
	in, _ := fleet.New(oneGPU).Lookup("gpu-a")
	theirs := extproc.NewTickets(w.secret).Issue(affinity.Decision{Instance: in, At: time.Now()})
	w.accessLog(t, logEntry(theirs, 200, "127.0.0.1:9001"))
	pending("another replica's ticket heard", 1, 0)
	w.accessLog(t, logEntry(mine, 200, "127.0.0.1:9001"), logEntry(mine, 200, "127.0.0.1:9001"))
	pending("its own ticket heard, twice", 0, 0)

	// Inline: pending while the routing stream is open.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := extprocv3.NewExternalProcessorClient(w.conn).Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Send(reqHeaders("x-session-id", "s2")); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Recv(); err != nil {
		t.Fatal(err)
	}
	pending("inline, stream open", 0, 1)
	if err := s.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Recv(); err == nil {
		t.Fatal("a second reply on the routing stream")
	}
	pending("inline, stream ended", 0, 0)
}

// TestInlineStreamHasNoTicket: a stream without the marker is served
// inline whatever tether's configuration says: no ticket, and its end
// finishes its decision.
func TestInlineStreamHasNoTicket(t *testing.T) {
	w := newApartWorld(t, oneGPU)
	ticket, cluster := w.route(t, false, "x-session-id", "s1")
	if ticket != "" || cluster == "" {
		t.Fatalf("ticket %q, cluster %q", ticket, cluster)
	}
	deadline := time.Now().Add(5 * time.Second)
	for done, _ := w.fin.counts(); done != 1; done, _ = w.fin.counts() {
		if time.Now().After(deadline) {
			t.Fatalf("the inline stream's end finished its decision %d times, want 1", done)
		}
		time.Sleep(5 * time.Millisecond)
	}
	// An access-log entry for it (Envoy also logging) carries no ticket.
	w.accessLog(t, logEntry("", 503, "127.0.0.1:9001"))
	if done, failed := w.fin.counts(); done != 1 || failed != 0 {
		t.Fatalf("%d finishes (%d failed) after an untracked report", done, failed)
	}
}

// TestBadOutcomeReports: reports for a request tether never decided, with
// a ticket that does not parse, one signed under another secret, one
// decided longer ago than the flight horizon, and duplicates (the same
// ticket through the access log and the observing filter, and again), a
// flood of them: each counted by its result, the decision finished once,
// the breaker hearing one failure.
func TestBadOutcomeReports(t *testing.T) {
	w := newApartWorld(t, oneGPU)
	ticket, _ := w.route(t, true, "x-session-id", "s1")

	other := extproc.NewTickets([]byte("another deployment"))
	forged := other.Issue(affinity.Decision{Instance: oneGPU[0], At: time.Now()})
	mine := extproc.NewTickets(w.secret)
	late := mine.Issue(affinity.Decision{Instance: oneGPU[0], At: time.Now().Add(-affinity.FlightHorizon - time.Minute)})
	future := mine.Issue(affinity.Decision{Instance: oneGPU[0], At: time.Now().Add(time.Hour)})
	unknown := mine.Issue(affinity.Decision{Instance: fleet.Instance{Name: "gone"}, At: time.Now()})

	entries := []*accesslogdatav3.HTTPAccessLogEntry{
		logEntry("", 500, "127.0.0.1:9001"),             // not decided by tether
		logEntry("not a ticket", 500, "127.0.0.1:9001"), // malformed
		logEntry("1|x|y|-|a||zzzz", 500, ""),            // malformed, with a separator
		logEntry(altered(ticket), 500, ""),              // its MAC altered
		logEntry(forged, 500, "127.0.0.1:9001"),         // another secret
		logEntry(late, 500, "127.0.0.1:9001"),           // beyond the horizon
		logEntry(future, 500, "127.0.0.1:9001"),         // an hour ahead
		logEntry(string(make([]byte, 4096)), 500, ""),   // oversized
		logEntry(ticket, 500, "127.0.0.1:9001"),         // the real one: applied
		logEntry(ticket, 500, "127.0.0.1:9001"),         // its duplicate
		logEntry(unknown, 502, "127.0.0.1:9002"),        // an instance since removed: applied, harmless
	}
	w.accessLog(t, entries...)
	w.observe(t, ticket, 500, "127.0.0.1:9001") // the same request, through the other path
	w.observe(t, "garbage", 500, "")
	w.observe(t, ticket, 0, "") // a stream that ends without response headers

	// A flood: the same ticket 20 000 times, and 20 000 forgeries.
	flood := make([]*accesslogdatav3.HTTPAccessLogEntry, 0, 40000)
	for i := 0; i < 20000; i++ {
		flood = append(flood, logEntry(ticket, 500, "127.0.0.1:9001"), logEntry(fmt.Sprintf("1|%d|x-%d|-|gpu-a||AAAAAAAAAAAA", time.Now().UnixMilli(), i), 500, ""))
	}
	w.accessLog(t, flood...)

	if done, failed := w.fin.counts(); done != 1 || failed != 1 {
		t.Fatalf("gpu-a: %d finishes (%d failed), want exactly 1 (1)", done, failed)
	}
	if st := w.breaker.State("gpu-a"); st != fleet.Closed {
		t.Fatalf("breaker %v after one failure reported 20 000 times (opens on the third)", st)
	}
	if got := w.load.InFlight("gpu-a"); got != 0 {
		t.Fatalf("in flight %d", got)
	}
	w.rec.mu.Lock()
	defer w.rec.mu.Unlock()
	want := map[string]int{
		extproc.ReportUndecided: 1,
		extproc.ReportMalformed: 3, // no separator, oversized, the observing stream's garbage
		extproc.ReportForged:    3 + 20000,
		extproc.ReportLate:      2,
		extproc.ReportApplied:   2,
		extproc.ReportDuplicate: 1 + 2 + 20000,
	}
	for k, v := range want {
		if w.rec.outcomes[k] != v {
			t.Errorf("%s: %d, want %d (all: %v)", k, w.rec.outcomes[k], v, w.rec.outcomes)
		}
	}
}

// altered changes a ticket's last character.
func altered(ticket string) string {
	c := byte('A')
	if ticket[len(ticket)-1] == c {
		c = 'B'
	}
	return ticket[:len(ticket)-1] + string(c)
}
