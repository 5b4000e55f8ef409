package extproc_test

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3filter "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/extproc"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/store/memory"
)

// The fuzz input is a list of records, each an op byte, a uvarint length
// and that many bytes of payload. Ops (op % opCount):
const (
	opMessage      = iota // payload: a ProcessingRequest; one that does not unmarshal is skipped
	opEOF                 // the stream ends: Envoy closed it (Recv returns io.EOF)
	opCancel              // the stream ends: Envoy went away (ctx canceled, Recv returns Canceled)
	opRecvError           // the stream ends: the transport broke (Recv returns Unavailable)
	opSendError           // the next Send fails (Unavailable)
	opCancelCtx           // the stream's context ends, but messages keep coming
	opFleet               // the fleet becomes fleets[payload[0] % 4] (no payload: without "c", the only v2 instance)
	opAdvanceClock        // the clock moves payload[0] minutes on (sessions expire, queue readings age)
	opCount
)

type record struct {
	op      byte
	payload []byte
}

// parseRecords reads the fuzz input; a truncated last record takes what is left.
func parseRecords(data []byte) []record {
	var out []record
	for len(data) > 0 {
		op := data[0] % opCount
		data = data[1:]
		n, k := binary.Uvarint(data)
		if k <= 0 || n > uint64(len(data)-k) {
			out = append(out, record{op, data})
			break
		}
		data = data[k:]
		out = append(out, record{op, data[:n]})
		data = data[n:]
	}
	return out
}

func encodeRecords(rs ...record) []byte {
	var b []byte
	for _, r := range rs {
		b = append(b, r.op)
		b = binary.AppendUvarint(b, uint64(len(r.payload)))
		b = append(b, r.payload...)
	}
	return b
}

func msgRecord(tb testing.TB, m *extprocv3.ProcessingRequest) record {
	b, err := proto.Marshal(m)
	if err != nil {
		tb.Fatal(err)
	}
	return record{opMessage, b}
}

// fuzzFleet: two on-demand instances of v1, one spot instance of v2.
var fuzzFleet = []fleet.Instance{
	{Name: "a", Version: "v1", Weight: 1},
	{Name: "b", Version: "v1", Weight: 2, KVSessions: 1},
	{Name: "c", Version: "v2", Weight: 1, Capacity: fleet.Spot},
}

// fleets are what opFleet switches between: all, without v2, none, and
// "c" serving v1 instead.
var fleets = [][]fleet.Instance{fuzzFleet, fuzzFleet[:2], nil,
	{fuzzFleet[0], fuzzFleet[1], {Name: "c", Version: "v1", Weight: 1, Capacity: fleet.Spot}}}

// fuzzPolicy reaches most decision kinds one replica over the memory store
// can: sticky, adaptive (queue-depth saturation, high priority), random
// rules, versions with a canary, strict version affinity (a refused
// request), expiry and renewal. Migrations, drains and store failures need
// an operator or Redis and are tested in affinity.
func fuzzPolicy() affinity.Policy {
	return affinity.Policy{
		Mode:     affinity.Sticky,
		Lifetime: bindings.Lifetime{Idle: 30 * time.Minute, Max: time.Hour},
		Rules: []affinity.Rule{
			{Name: "random", Header: "x-route", Value: "random", Mode: affinity.Random},
			{Name: "adaptive", Header: "x-route", Value: "adaptive", Mode: affinity.Adaptive, Idle: time.Minute},
			{Name: "vip", Header: "x-route", Value: "vip", Mode: affinity.Adaptive, Priority: affinity.High},
			{Name: "v2", PathPrefix: "/v2/", Version: "v2"},
			{Name: "gone", Header: "x-route", Value: "gone", Version: "v9"},
		},
		Versions:        []affinity.VersionWeight{{Name: "v1", Weight: 3}, {Name: "v2", Weight: 1, Canary: true}},
		VersionAffinity: affinity.Strict,
		CanaryHeader:    "x-canary",
		Saturation:      affinity.Saturation{QueueDepth: 4},
	}
}

// countingDecider wraps the real decider and checks that every decision is
// finished exactly once, with a queue depth that is a reading when known.
type countingDecider struct {
	*affinity.Decider
	t    *testing.T
	open map[string]int // instance → decisions not yet finished
}

func (c *countingDecider) Decide(ctx context.Context, req affinity.Request) (affinity.Decision, error) {
	d, err := c.Decider.Decide(ctx, req)
	if err == nil {
		c.open[d.Instance.Name]++
	}
	return d, err
}

func (c *countingDecider) Refine(ctx context.Context, d affinity.Decision, chain []uint64) affinity.Decision {
	next := c.Decider.Refine(ctx, d, chain)
	c.open[d.Instance.Name]--
	c.open[next.Instance.Name]++
	return next
}

func (c *countingDecider) Finish(d affinity.Decision, a fleet.Outcome) {
	if c.open[d.Instance.Name]--; c.open[d.Instance.Name] < 0 {
		c.t.Errorf("Finish for instance %q without an unfinished decision", d.Instance.Name)
	}
	if a.QueueKnown && (a.Queue < 0 || !a.Answered) {
		c.t.Errorf("Finish with queue depth %d reported as known (answered %v)", a.Queue, a.Answered)
	}
	if a.Failed && !a.Answered {
		c.t.Errorf("Finish with a failure but no answer")
	}
	c.Decider.Finish(d, a)
}

// fuzzEnv is one fuzz run's world: a fresh store, fleet, clock and server,
// so that a crasher replays alone.
type fuzzEnv struct {
	fleet *fleet.Fleet
	now   time.Time
	dec   *countingDecider
	srv   *extproc.Server
}

func newFuzzEnv(t *testing.T, ids *identity.Extractor, debug bool) *fuzzEnv {
	// The clock starts now: the server counts the requests it routed
	// (Pending) on the real clock, by the decisions' times.
	e := &fuzzEnv{fleet: fleet.New(fuzzFleet), now: time.Now()}
	clock := func() time.Time { return e.now }
	// A breaker that opens on the second failure and cools down in a
	// second, so the fuzzer's 5xx answers and clock jumps drive circuits
	// through open, half-open and closed, and sessions down the ladder.
	br := fleet.NewBreaker(fleet.BreakerConfig{Threshold: 1, Window: time.Minute, Cooldown: time.Second}, clock, nil)
	inner := affinity.New(memory.New(), e.fleet, fuzzPolicy(),
		affinity.WithClock(clock), affinity.WithBreaker(br),
		affinity.WithRand(func() uint64 { return 0x9e3779b97f4a7c15 }))
	e.dec = &countingDecider{Decider: inner, t: t, open: map[string]int{}}
	// A debug logger writing nowhere, so the log lines are built too.
	log := zerolog.New(io.Discard).Level(zerolog.DebugLevel)
	e.srv = extproc.New(ids, e.dec, &recorded{}, extproc.Options{
		ClusterHeader: "x-tether-cluster", QueueHeader: "x-queue-depth", DebugHeaders: debug, Logger: log,
	})
	return e
}

func (e *fuzzEnv) setFleet(arg []byte) {
	i := 1
	if len(arg) > 0 {
		i = int(arg[0]) % len(fleets)
	}
	e.fleet.Replace(fleets[i])
}

// fakeStream is the server side of one ext_proc stream, in memory: Recv
// plays the stream's records, Send records the replies.
type fakeStream struct {
	grpc.ServerStream // nil: Process uses only Context, Recv and Send
	env               *fuzzEnv
	ctx               context.Context
	cancel            context.CancelFunc
	records           []record
	failSend          bool

	received []*extprocv3.ProcessingRequest  // what Recv returned, in order
	sent     []*extprocv3.ProcessingResponse // what Send was given, in order
	end      error                           // what the stream ended with, if Recv ended it
	sendErr  error                           // the error Send returned, if it failed
}

var (
	errTransport = status.Error(codes.Unavailable, "transport is closing")
	errSend      = status.Error(codes.Unavailable, "send failed")
)

func (s *fakeStream) Context() context.Context { return s.ctx }

func (s *fakeStream) Recv() (*extprocv3.ProcessingRequest, error) {
	for len(s.records) > 0 {
		r := s.records[0]
		s.records = s.records[1:]
		switch r.op {
		case opMessage:
			m := &extprocv3.ProcessingRequest{}
			if err := proto.Unmarshal(r.payload, m); err != nil {
				continue // not a message Envoy could send
			}
			s.received = append(s.received, m)
			return m, nil
		case opEOF:
			s.end = io.EOF
		case opCancel:
			s.cancel()
			s.end = status.Error(codes.Canceled, context.Canceled.Error())
		case opRecvError:
			s.end = errTransport
		case opSendError:
			s.failSend = true
			continue
		case opCancelCtx:
			s.cancel()
			continue
		case opFleet:
			s.env.setFleet(r.payload)
			continue
		case opAdvanceClock:
			if len(r.payload) > 0 {
				s.env.now = s.env.now.Add(time.Duration(r.payload[0]) * time.Minute)
			}
			continue
		}
		return nil, s.end
	}
	s.end = io.EOF
	return nil, io.EOF
}

func (s *fakeStream) Send(m *extprocv3.ProcessingResponse) error {
	s.sent = append(s.sent, m)
	if s.failSend {
		s.sendErr = errSend
		return errSend
	}
	return nil
}

// splitStreams cuts the records into streams after each record that ends one.
func splitStreams(rs []record) [][]record {
	var out [][]record
	start := 0
	for i, r := range rs {
		if r.op == opEOF || r.op == opCancel || r.op == opRecvError {
			out = append(out, rs[start:i+1])
			start = i + 1
		}
	}
	if start < len(rs) {
		out = append(out, rs[start:])
	}
	return out
}

// FuzzProcess drives the real Server (real identity, real decider over the
// memory store) with arbitrary sequences of ProcessingRequest messages on
// in-memory streams. Every reply must be a valid reply to the phase it
// answers; Process ends with nil or a gRPC status; no decision is left in
// flight and none is finished twice.
func FuzzProcess(f *testing.F) {
	for _, seed := range fuzzSeeds(f) {
		f.Add(seed)
	}
	ids, err := identity.New(identity.Config{Secret: []byte("0123456789abcdef")})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		rs := parseRecords(data)
		env := newFuzzEnv(t, ids, len(data) > 0 && data[0]&0x80 == 0) // the op byte's top bit turns debug headers off
		for i, recs := range splitStreams(rs) {
			ctx, cancel := context.WithCancel(context.Background())
			s := &fakeStream{env: env, ctx: ctx, cancel: cancel, records: recs}
			err := env.srv.Process(s)
			cancel()
			checkStream(t, i, s, err)
			for _, in := range fuzzFleet {
				if n := env.dec.open[in.Name]; n != 0 {
					t.Fatalf("stream %d: %d decisions on %q never finished", i, n, in.Name)
				}
				if n := env.dec.Load().InFlight(in.Name); n != 0 {
					t.Fatalf("stream %d: %d requests still in flight to %q after the stream ended", i, n, in.Name)
				}
			}
			if apart, stream := env.srv.Pending(); apart != 0 || stream != 0 {
				t.Fatalf("stream %d: the server awaits the end of %d requests (%d apart) after the stream ended", i, apart+stream, apart)
			}
		}
	})
}

// checkStream checks one stream's replies and how Process ended.
func checkStream(t *testing.T, i int, s *fakeStream, err error) {
	t.Helper()
	// Which way the stream should have ended. Messages in observability
	// mode get no reply.
	var replied []*extprocv3.ProcessingRequest
	for _, m := range s.received {
		if !m.GetObservabilityMode() {
			replied = append(replied, m)
		}
	}
	n := len(replied)
	noPhase := n > 0 && replied[n-1].GetRequest() == nil && replied[n-1] == s.received[len(s.received)-1]
	var wantCode codes.Code
	wantSent := n
	switch {
	case noPhase:
		wantCode, wantSent = codes.InvalidArgument, n-1
	case s.sendErr != nil:
		wantCode = status.Code(errSend)
	case errors.Is(s.end, errTransport):
		wantCode = status.Code(errTransport)
	case s.end == nil && !observed(s.received):
		t.Fatalf("stream %d: Process returned (%v) before the stream ended", i, err)
	}
	if wantCode == codes.OK {
		if err != nil {
			t.Fatalf("stream %d: Process returned %v for a stream that ended with %v", i, err, s.end)
		}
	} else if st, ok := status.FromError(err); !ok || st.Code() != wantCode {
		t.Fatalf("stream %d: Process returned %v, want a gRPC status %v", i, err, wantCode)
	}
	if len(s.sent) != wantSent {
		t.Fatalf("stream %d: %d replies to %d messages (Process returned %v)", i, len(s.sent), n, err)
	}
	for j, resp := range s.sent {
		if msg := checkReply(replied[j], resp); msg != "" {
			t.Fatalf("stream %d, message %d (%T): %s\nreply: %v", i, j, replied[j].GetRequest(), msg, resp)
		}
	}
}

// observed reports whether the last message read is an observing
// filter's response headers: the observation is complete, and Process
// closes the stream without waiting for Envoy to.
func observed(received []*extprocv3.ProcessingRequest) bool {
	if len(received) == 0 {
		return false
	}
	last := received[len(received)-1]
	return last.GetObservabilityMode() && last.GetResponseHeaders() != nil
}

// checkReply says what is wrong with resp as the answer to req, or "".
func checkReply(req *extprocv3.ProcessingRequest, resp *extprocv3.ProcessingResponse) string {
	if resp == nil {
		return "nil reply"
	}
	// Envoy validates replies against the proto's rules before using them.
	if err := resp.ValidateAll(); err != nil {
		return "invalid reply: " + err.Error()
	}
	var common *extprocv3.CommonResponse
	switch req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		switch r := resp.GetResponse().(type) {
		case *extprocv3.ProcessingResponse_RequestHeaders:
			common = r.RequestHeaders.GetResponse()
			if m := common.GetHeaderMutation(); m != nil && len(m.GetSetHeaders()) == 0 {
				// Unrouted: the client's destination goes, nothing else.
				if rm := m.GetRemoveHeaders(); len(rm) != 1 || rm[0] != extproc.HeaderDestination {
					return "request headers: an unrouted reply removes the destination alone"
				}
			} else if m != nil {
				if set := m.GetSetHeaders(); set[0].GetHeader().GetKey() != "x-tether-cluster" ||
					len(set) > 2 || len(set) == 2 && set[1].GetHeader().GetKey() != extproc.HeaderDestination {
					return "request headers: the mutation is not the routing header and the destination"
				}
				cluster := string(m.GetSetHeaders()[0].GetHeader().GetRawValue())
				if !knownCluster(cluster) {
					return "routed to unknown cluster " + cluster
				}
			}
		case *extprocv3.ProcessingResponse_ImmediateResponse:
			ir := r.ImmediateResponse
			if ir.GetStatus().GetCode() != 503 {
				return "an immediate response that is not a 503"
			}
			if msg := checkMutation(ir.GetHeaders()); msg != "" {
				return msg
			}
		default:
			return "request headers answered with " + kind(resp)
		}
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		r, ok := resp.GetResponse().(*extprocv3.ProcessingResponse_ResponseHeaders)
		if !ok {
			return "response headers answered with " + kind(resp)
		}
		common = r.ResponseHeaders.GetResponse()
		if common.GetClearRouteCache() {
			return "clear_route_cache on a response"
		}
	case *extprocv3.ProcessingRequest_RequestBody:
		if resp.GetRequestBody() == nil {
			return "request body answered with " + kind(resp)
		}
	case *extprocv3.ProcessingRequest_ResponseBody:
		if resp.GetResponseBody() == nil {
			return "response body answered with " + kind(resp)
		}
	case *extprocv3.ProcessingRequest_RequestTrailers:
		if resp.GetRequestTrailers() == nil {
			return "request trailers answered with " + kind(resp)
		}
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		if resp.GetResponseTrailers() == nil {
			return "response trailers answered with " + kind(resp)
		}
	default:
		return "a reply to a message with no phase"
	}
	if common.GetClearRouteCache() && common.GetHeaderMutation() == nil {
		return "clear_route_cache without a header mutation (Envoy ignores it)"
	}
	if common.GetStatus() != extprocv3.CommonResponse_CONTINUE || common.GetBodyMutation() != nil || common.GetTrailers() != nil {
		return "a reply that does more than continue and set headers"
	}
	if resp.GetModeOverride() != nil {
		return "a reply that changes the processing mode"
	}
	if md := resp.GetDynamicMetadata(); md != nil {
		if _, isHeaders := req.GetRequest().(*extprocv3.ProcessingRequest_RequestHeaders); !isHeaders {
			return "dynamic metadata outside the request-headers reply"
		}
		for ns := range md.GetFields() {
			if ns != extproc.MetadataNamespace && ns != extproc.MetadataLB {
				return "dynamic metadata outside tether's namespace: " + ns
			}
		}
	}
	return checkMutation(common.GetHeaderMutation())
}

// checkMutation applies Envoy's header mutation rules (see responses.go).
func checkMutation(m *extprocv3.HeaderMutation) string {
	for _, h := range m.GetRemoveHeaders() {
		if h != extproc.HeaderDestination {
			return "a mutation removes a header other than a client's destination: " + h
		}
	}
	for _, o := range m.GetSetHeaders() {
		h := o.GetHeader()
		switch {
		case h == nil:
			return "a set header with no header"
		case h.GetValue() != "" && len(h.GetRawValue()) > 0:
			return "header " + h.GetKey() + " sets both value and raw_value"
		case o.GetAppend() != nil:
			return "header " + h.GetKey() + " sets the deprecated append"
		}
	}
	return ""
}

func knownCluster(c string) bool {
	for _, in := range fuzzFleet {
		if c == in.Cluster() {
			return true
		}
	}
	return false
}

// kind names the reply's oneof case.
func kind(resp *extprocv3.ProcessingResponse) string {
	switch resp.GetResponse().(type) {
	case nil:
		return "an empty reply"
	case *extprocv3.ProcessingResponse_RequestHeaders:
		return "request_headers"
	case *extprocv3.ProcessingResponse_ResponseHeaders:
		return "response_headers"
	case *extprocv3.ProcessingResponse_RequestBody:
		return "request_body"
	case *extprocv3.ProcessingResponse_ResponseBody:
		return "response_body"
	case *extprocv3.ProcessingResponse_RequestTrailers:
		return "request_trailers"
	case *extprocv3.ProcessingResponse_ResponseTrailers:
		return "response_trailers"
	case *extprocv3.ProcessingResponse_ImmediateResponse:
		return "immediate_response"
	}
	return "an unknown reply"
}

// fuzzSeeds are the shapes of real traffic and the odd ones around them.
func fuzzSeeds(tb testing.TB) [][]byte {
	m := func(p *extprocv3.ProcessingRequest) record { return msgRecord(tb, p) }
	eof := record{op: opEOF}
	body := func(end bool) *extprocv3.ProcessingRequest {
		return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte(`{"model":"m"}`), EndOfStream: end}}}
	}
	respBody := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: []byte("data: {}\n\n"), EndOfStream: true}}}
	reqTrailers := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{Trailers: hdrs("grpc-status", "0").GetHeaders()}}}
	respTrailers := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}}
	chat := reqHeaders(":method", "POST", ":path", "/v1/chat/completions", ":authority", "llm", "x-session-id", "conv-1", "x-request-id", "r1")
	ok := respHeaders(":status", "200", "x-queue-depth", "2")
	// Both value and raw_value set by the sender (raw_value wins), and value alone.
	both := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
		Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: "x-session-id", Value: "v", RawValue: []byte("raw")}, {Key: ":path", Value: "/v2/old-style"}}},
	}}}
	// Everything else Envoy may attach to a message.
	attrs, _ := structpb.NewStruct(map[string]any{"request.path": "/v1/chat/completions"})
	rich := reqHeaders("x-session-id", "conv-2", "authorization", "Bearer abc.def")
	rich.Attributes = map[string]*structpb.Struct{"envoy.filters.http.ext_proc": attrs}
	rich.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"tether": attrs}}
	rich.ObservabilityMode = true
	rich.GetRequestHeaders().EndOfStream = true

	// A gateway's stream: bodies both ways, full duplex, and a subset hint.
	duplex := proto.Clone(chat).(*extprocv3.ProcessingRequest)
	duplex.ProtocolConfig = &extprocv3.ProtocolConfiguration{
		RequestBodyMode:  extprocv3filter.ProcessingMode_FULL_DUPLEX_STREAMED,
		ResponseBodyMode: extprocv3filter.ProcessingMode_FULL_DUPLEX_STREAMED,
	}
	hint, _ := structpb.NewStruct(map[string]any{"x-gateway-destination-endpoint-subset": []any{"127.0.0.1:1", "[::1]:2"}})
	duplex.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"envoy.lb.subset_hint": hint}}
	buffered := proto.Clone(chat).(*extprocv3.ProcessingRequest)
	buffered.ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: extprocv3filter.ProcessingMode_BUFFERED}
	usage := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{
		Body: []byte(`data: {"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":4}}}` + "\n\n"), EndOfStream: true}}}

	streams := [][]record{
		// Gateways' streams: full duplex with a hint, and buffered.
		{m(duplex), m(body(false)), m(body(true)), m(reqTrailers), m(ok), m(respBody), m(usage), m(respTrailers), eof},
		{m(duplex), m(reqTrailers), eof},
		{m(buffered), m(body(true)), m(ok), eof},
		// A request and its response, then the same session again.
		{m(chat), m(ok), eof, m(chat), m(respHeaders(":status", "503")), eof},
		// No answer came; then two request phases on one stream.
		{m(chat), eof, m(chat), m(chat), m(ok), eof},
		// A response before any request; duplicate response phases.
		{m(respHeaders(":status", "200")), m(chat), m(ok), m(ok), eof},
		// Every phase Envoy could send, in order.
		{m(chat), m(body(false)), m(body(true)), m(reqTrailers), m(ok), m(respBody), m(respTrailers), eof},
		// A message with no phase ends the stream, whatever follows.
		{m(chat), m(&extprocv3.ProcessingRequest{}), m(ok), eof},
		{m(&extprocv3.ProcessingRequest{}), eof},
		// Empty headers, no headers at all, oversized and binary values.
		{m(reqHeaders()), m(respHeaders()), eof},
		{m(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{}}),
			m(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{}}), eof},
		{m(reqHeaders("x-session-id", strings.Repeat("x", 70<<10), "x-request-id", strings.Repeat("é", 100))),
			m(respHeaders(":status", strings.Repeat("9", 40), "x-queue-depth", "99999999999999999999")), eof},
		{m(reqHeaders("x-session-id", "a\x00\xff\r\nb", "authorization", "Bearer \x7f", "x-device-id", "d", "x-user-id", "u")),
			m(respHeaders(":status", "-1", "x-queue-depth", "-3")), eof},
		{m(both), m(rich), m(ok), eof},
		// Strict version affinity: a v2 session loses its only instance
		// (refused), then every instance goes, then all come back.
		{m(reqHeaders(":path", "/v2/chat", "x-session-id", "s2")), m(ok), eof,
			{op: opFleet}, m(reqHeaders(":path", "/v2/chat", "x-session-id", "s2")), m(ok), eof,
			{opFleet, []byte{2}}, m(reqHeaders("x-session-id", "s2")), m(ok), eof,
			{opFleet, []byte{0}}, m(reqHeaders("x-session-id", "s2")), m(ok), eof,
			{opFleet, []byte{3}}, m(reqHeaders("x-session-id", "s2")), m(ok), eof},
		// Adaptive: the instance reports a deep queue, the session spills;
		// a high-priority one stays.
		{m(reqHeaders("x-route", "adaptive", "x-session-id", "s3")), m(respHeaders(":status", "200", "x-queue-depth", "9")), eof,
			m(reqHeaders("x-route", "adaptive", "x-session-id", "s3")), m(ok), eof,
			m(reqHeaders("x-route", "vip", "x-session-id", "s4")), m(respHeaders(":status", "200", "x-queue-depth", "9")), eof,
			m(reqHeaders("x-route", "vip", "x-session-id", "s4")), m(ok), eof},
		// Random rules, a missing version, anonymous, canary forced either way.
		{m(reqHeaders("x-route", "random")), m(ok), eof, m(reqHeaders("x-route", "gone", "x-session-id", "s5")), m(ok), eof,
			m(reqHeaders()), m(ok), eof, m(reqHeaders("x-canary", "always", "x-session-id", "s6")), m(ok), eof,
			m(reqHeaders("x-canary", "never", "x-session-id", "s7")), m(ok), eof},
		// Time passes: renewal past the maximum lifetime, then idle expiry;
		// the queue reading ages.
		{m(chat), m(respHeaders(":status", "200", "x-queue-depth", "9")), eof, {opAdvanceClock, []byte{25}}, m(chat), m(ok), eof,
			{opAdvanceClock, []byte{25}}, m(chat), m(ok), eof, {opAdvanceClock, []byte{25}}, m(chat), m(ok), eof,
			{opAdvanceClock, []byte{40}}, m(chat), eof},
		// Envoy goes away, the transport breaks, a send fails.
		{m(chat), {op: opCancel}, m(chat), {op: opRecvError}, m(chat), {op: opSendError}, m(chat), m(ok), eof},
		{{op: opSendError}, m(chat), eof, m(chat), {op: opSendError}, m(ok), eof},
		// The request's context ends before the decision.
		{{op: opCancelCtx}, m(chat), m(ok), eof, m(chat), {op: opCancelCtx}, m(ok), eof},
	}
	var out [][]byte
	for _, s := range streams {
		out = append(out, encodeRecords(s...))
	}
	// The same with debug headers off (top bit of the first op byte).
	for _, s := range out[:4] {
		off := append([]byte(nil), s...)
		off[0] |= 0x80
		out = append(out, off)
	}
	// Not records at all.
	out = append(out, nil, []byte{0xff}, []byte("\x00\xff\xff\xff\xff\x0f"))
	return out
}
