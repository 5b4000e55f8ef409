//go:build e2e

package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	alsdatav3 "github.com/envoyproxy/go-control-plane/envoy/data/accesslog/v3"
	alsv3 "github.com/envoyproxy/go-control-plane/envoy/service/accesslog/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/structpb"
	"sigs.k8s.io/yaml"

	// The bootstrap names these extensions by type URL.
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/grpc/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
)

// replyCase is one way an upstream request can fail (or not), and what the
// client, Envoy's access log and the ext_proc response phase see of it.
type replyCase struct {
	name      string
	cluster   string // what the ext_proc server puts in x-route
	behaviour string // x-case: what the instance (or the test) does
	want      replySeen
}

type replySeen struct {
	status  int    // what the client gets; 0: no response at all
	flags   string // Envoy's response flags (access log), "-" for none
	phase   bool   // a response-headers message reached the ext_proc server
	details string // response code details (access log), compared by prefix
	// phaseDetails is the response.code_details attribute the response
	// phase gets, when it differs from the final details.
	phaseDetails string
	upstream     bool   // the response phase saw x-envoy-upstream-service-time
	extra        string // another header the response phase saw ("name: value"), or ""
	attempts     int    // requests the instance received
	// host is the upstream.address attribute of the response phase: the
	// "instance", the "closed" port, or "" when Envoy picked no host.
	host string
}

// TestEnvoyRepliesReachResponsePhase records, with the real Envoy, which
// failed upstream requests reach an ext_proc filter's response-headers phase
// (response_header_mode SEND), with which :status and headers, and which
// response flags Envoy logs for them. tether's instance breaker is fed from
// that phase: this test is the ground truth for what it can count. The
// routing is tether's: the ext_proc server names the cluster in a header
// (raw_value, clear_route_cache) and the route takes it from cluster_header.
// docs/envoy-replies.md explains the findings.
func TestEnvoyRepliesReachResponsePhase(t *testing.T) {
	rec := startReplyRecorder(t)
	up := startReplyInstance(t)
	closed := closedPort(t)
	p := runEnvoy(t, repliesBootstrap(t, rec.addr, up.addr, closed))

	const (
		refusedDetails = "upstream_reset_before_response_started{remote_connection_failure"
		via            = "via_upstream"
	)
	cases := []replyCase{
		{"instance 500", "instance", "status-500", replySeen{status: 500, flags: "-", phase: true, details: via, upstream: true, attempts: 1, host: "instance"}},
		{"instance 503", "instance", "status-503", replySeen{status: 503, flags: "-", phase: true, details: via, upstream: true, attempts: 1, host: "instance"}},
		{"instance 507", "instance", "status-507", replySeen{status: 507, flags: "-", phase: true, details: via, upstream: true, attempts: 1, host: "instance"}},
		{"connection refused", "refused", "ok", replySeen{status: 503, flags: "UF", phase: true, details: refusedDetails, host: "closed"}},
		{"route timeout", "instance", "timeout", replySeen{status: 504, flags: "UT", phase: true, details: "response_timeout", attempts: 1, host: "instance"}},
		{"no healthy host", "empty", "ok", replySeen{status: 503, flags: "UH", phase: true, details: "no_healthy_upstream"}},
		{"unknown cluster", "no-such-cluster", "ok", replySeen{status: 503, flags: "NC", phase: true, details: "cluster_not_found"}},
		{"reset before headers", "instance", "reset-before-headers", replySeen{status: 503, flags: "UC", phase: true,
			details: "upstream_reset_before_response_started{connection_termination}", attempts: 1, host: "instance"}},
		{"reset after headers", "instance", "reset-after-headers", replySeen{status: 200, flags: "UPE", phase: true,
			details: "upstream_reset_after_response_started{protocol_error}", phaseDetails: via, upstream: true, attempts: 1, host: "instance"}},
		{"reset after headers, chunked", "instance", "reset-after-headers-chunked", replySeen{status: 200, flags: "UPE", phase: true,
			details: "upstream_reset_after_response_started{protocol_error}", phaseDetails: via, upstream: true, attempts: 1, host: "instance"}},
		{"RST after headers", "instance", "rst-after-headers", replySeen{status: 200, flags: "UPE", phase: true,
			details: "upstream_reset_after_response_started{protocol_error}", phaseDetails: via, upstream: true, attempts: 1, host: "instance"}},
		{"circuit breaker overflow", "narrow", "overflow", replySeen{status: 503, flags: "UO", phase: true,
			details: "upstream_reset_before_response_started{overflow}", extra: "x-envoy-overloaded: true"}},
		{"client disconnects", "instance", "client-gone", replySeen{status: 0, flags: "DC", phase: false, details: "downstream_remote_disconnect", attempts: 1}},
		{"refused, retried once", "refused", "retry-refused", replySeen{status: 503, flags: "UF,URX", phase: true, details: refusedDetails, host: "closed"}},
		{"instance 503, retried once", "instance", "retry-503", replySeen{status: 503, flags: "URX", phase: true, details: via, upstream: true, attempts: 2, host: "instance"}},
	}

	var table strings.Builder
	fmt.Fprintf(&table, "\n%-28s %-6s %-7s %-6s %-7s %-9s %-4s %s\n", "case", "client", "flags", "phase", ":status", "x-e-u-s-t", "hits",
		"details | response-phase headers | response-phase attributes")
	for i, c := range cases {
		probe := fmt.Sprintf("probe-%d", i)
		got := runReplyCase(t, p, rec, up, probe, c)
		fmt.Fprintf(&table, "%-28s %-6d %-7s %-6v %-7s %-9v %-4d %s | %s | %s\n", c.name, got.status, got.flags,
			got.phase, got.phaseStatus, got.upstream, got.attempts, got.details, got.headerNames, joined(got.attrs))
		checkReplyOutcome(t, c, got, map[string]string{"instance": up.addr, "closed": closed})
	}
	t.Log(table.String())
}

// replyObserved is what one case produced.
type replyObserved struct {
	replySeen
	flagBits    uint64            // the flags as Envoy's bit vector (response.flags)
	phaseStatus string            // :status in the response-headers message
	headerNames string            // header names in the response-headers message
	attrs       map[string]string // the response attributes Envoy sent with it
	headers     map[string]string
}

func checkReplyOutcome(t *testing.T, c replyCase, got replyObserved, hosts map[string]string) {
	t.Helper()
	w := c.want
	if got.status != w.status {
		t.Errorf("%s: client got status %d, want %d", c.name, got.status, w.status)
	}
	if got.flags != w.flags {
		t.Errorf("%s: response flags %q, want %q", c.name, got.flags, w.flags)
	}
	if !strings.HasPrefix(got.details, w.details) {
		t.Errorf("%s: response code details %q, want prefix %q", c.name, got.details, w.details)
	}
	if got.phase != w.phase {
		t.Errorf("%s: response phase reached = %v, want %v", c.name, got.phase, w.phase)
	}
	if got.attempts != w.attempts {
		t.Errorf("%s: instance received %d requests, want %d", c.name, got.attempts, w.attempts)
	}
	if !w.phase {
		return
	}
	if want := fmt.Sprint(w.status); got.phaseStatus != want {
		t.Errorf("%s: response phase :status %q, want %q", c.name, got.phaseStatus, want)
	}
	if got.upstream != w.upstream {
		t.Errorf("%s: x-envoy-upstream-service-time in the response phase = %v, want %v", c.name, got.upstream, w.upstream)
	}
	// x-instance is the instance's own header: it comes only with its answers.
	if _, ok := got.headers["x-instance"]; ok != w.upstream {
		t.Errorf("%s: the instance's x-instance header in the response phase = %v, want %v", c.name, ok, w.upstream)
	}
	if w.extra != "" {
		name, value, _ := strings.Cut(w.extra, ": ")
		if got.headers[name] != value {
			t.Errorf("%s: response phase header %s = %q, want %q", c.name, name, got.headers[name], value)
		}
	} else if v, ok := got.headers["x-envoy-overloaded"]; ok {
		t.Errorf("%s: unexpected x-envoy-overloaded: %s", c.name, v)
	}
	// The response attributes say what the access log says, so an ext_proc
	// server can tell Envoy's replies without any header; except after a
	// reset that comes once the headers are through: the response phase is
	// over by then and saw a clean answer.
	phaseDetails, phaseFlags := w.phaseDetails, got.flagBits
	if phaseDetails == "" {
		phaseDetails = got.details
	} else {
		phaseFlags = 0
	}
	if f := got.attrs["response.flags"]; f != fmt.Sprint(phaseFlags) {
		t.Errorf("%s: response attribute response.flags %s, want %d", c.name, f, phaseFlags)
	}
	if d := got.attrs["response.code_details"]; d != phaseDetails {
		t.Errorf("%s: response attribute response.code_details %q, want %q", c.name, d, phaseDetails)
	}
	if a := got.attrs["upstream.address"]; a != hosts[w.host] {
		t.Errorf("%s: response attribute upstream.address %q, want %q (%s)", c.name, a, hosts[w.host], w.host)
	}
	if code := got.attrs["response.code"]; code != got.phaseStatus {
		t.Errorf("%s: response attribute response.code %q, want the :status %q", c.name, code, got.phaseStatus)
	}
}

// runReplyCase sends the case's request(s) through Envoy and gathers what
// the client, the ext_proc server and the access log saw.
func runReplyCase(t *testing.T, p *proxy, rec *replyRecorder, up *replyInstance, probe string, c replyCase) replyObserved {
	t.Helper()
	var got replyObserved
	switch c.behaviour {
	case "overflow":
		// The narrow cluster has one connection and one pending slot: hold
		// one request at the instance, queue a second, then send the probe.
		// All three share one HTTP/2 connection, so one Envoy worker (one
		// connection pool) handles them: a pool on another worker would open
		// its own first connection despite max_connections.
		h2c := &http.Transport{Protocols: new(http.Protocols)}
		h2c.Protocols.SetUnencryptedHTTP2(true)
		defer h2c.CloseIdleConnections()
		held, queued := probe+"-held", probe+"-queued"
		arrived := up.signal("arrived " + held)
		var wg sync.WaitGroup
		var heldStatus, queuedStatus int
		defer func() { up.fire("release " + held); wg.Wait() }()
		wg.Add(1)
		go func() {
			defer wg.Done()
			heldStatus, _ = replyRequestVia(context.Background(), h2c, p, held, "hold", c.cluster, nil)
		}()
		select {
		case <-arrived:
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: the held request never reached the instance", c.name)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			queuedStatus, _ = replyRequestVia(context.Background(), h2c, p, queued, "ok", c.cluster, nil)
		}()
		waitFor(t, 5*time.Second, "a queued request on the narrow cluster", func() bool {
			return envoyStat(t, p, "cluster.narrow.upstream_rq_pending_active") == "1"
		})
		got.status, _ = replyRequestVia(context.Background(), h2c, p, probe, "ok", c.cluster, nil)
		up.fire("release " + held)
		wg.Wait()
		if heldStatus != http.StatusOK || queuedStatus != http.StatusOK {
			t.Errorf("%s: the held and queued requests got %d and %d, want 200", c.name, heldStatus, queuedStatus)
		}
	case "client-gone":
		ctx, cancel := context.WithCancel(context.Background())
		arrived := up.signal("arrived " + probe)
		go func() {
			select {
			case <-arrived:
			case <-time.After(5 * time.Second):
			}
			cancel()
		}()
		var err error
		got.status, err = replyRequest(ctx, p, probe, c.behaviour, c.cluster)
		cancel()
		if !errors.Is(err, context.Canceled) {
			t.Errorf("%s: client error %v, want context canceled", c.name, err)
		}
	default:
		tr := &http.Transport{DisableKeepAlives: true}
		defer tr.CloseIdleConnections()
		var bodyErr error
		got.status, bodyErr = replyRequestVia(context.Background(), tr, p, probe, c.behaviour, c.cluster,
			func() { up.fire("headers " + probe) })
		if strings.Contains(c.behaviour, "after-headers") && bodyErr == nil {
			t.Errorf("%s: the client read the whole body, want a truncated one", c.name)
		}
	}

	// The exchange is over when the ext_proc stream has ended and the
	// access log entry has arrived.
	var ex replyExchange
	var entry *alsdatav3.HTTPAccessLogEntry
	waitFor(t, 10*time.Second, c.name+": ext_proc stream end and access log", func() bool {
		var ok bool
		ex, ok = rec.exchange(probe)
		entry = rec.logEntry(probe)
		return ok && ex.ended && entry != nil
	})
	got.phase = ex.response != nil
	got.headers = ex.response
	got.phaseStatus = ex.response[":status"]
	_, got.upstream = ex.response["x-envoy-upstream-service-time"]
	names := make([]string, 0, len(ex.response))
	for k := range ex.response {
		names = append(names, k)
	}
	sort.Strings(names)
	got.headerNames = strings.Join(names, ",")
	got.attrs = ex.attrs
	got.flags, got.flagBits = responseFlags(entry.GetCommonProperties().GetResponseFlags())
	got.details = entry.GetResponse().GetResponseCodeDetails()
	got.attempts = up.hits(probe)
	if logged := int(entry.GetResponse().GetResponseCode().GetValue()); logged != got.status {
		t.Errorf("%s: access log status %d, client status %d", c.name, logged, got.status)
	}
	return got
}

// envoyStat is one of Envoy's stats, as the admin interface prints it.
func envoyStat(t *testing.T, p *proxy, name string) string {
	t.Helper()
	filter := "^" + strings.ReplaceAll(name, ".", `\.`) + "$"
	resp, err := http.Get(p.admin + "/stats?filter=" + url.QueryEscape(filter))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	_, v, _ := strings.Cut(strings.TrimSpace(string(b)), ": ")
	return v
}

// replyRequest sends one request through Envoy on its own connection. It
// returns the status (0 when no response came) and the error that ended the
// request or the reading of its body.
func replyRequest(ctx context.Context, p *proxy, probe, behaviour, cluster string) (int, error) {
	tr := &http.Transport{DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	return replyRequestVia(ctx, tr, p, probe, behaviour, cluster, nil)
}

// replyRequestVia is replyRequest on the connections of tr, calling
// onHeaders (unless nil) once the response headers are in.
func replyRequestVia(ctx context.Context, tr *http.Transport, p *proxy, probe, behaviour, cluster string, onHeaders func()) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.url+"/v1/chat/completions", strings.NewReader(`{"model":"m"}`))
	if err != nil {
		return 0, err
	}
	req.Header.Set("x-probe", probe)
	req.Header.Set("x-case", behaviour)
	req.Header.Set("x-target", cluster)
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if onHeaders != nil {
		onHeaders()
	}
	_, err = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, err
}

// responseFlags renders Envoy's access-log response flags as the short codes
// of %RESPONSE_FLAGS%, in field order, or "-" when none is set, and as the
// bit vector of the response.flags attribute (field n is bit n-1).
func responseFlags(f *alsdatav3.ResponseFlags) (string, uint64) {
	short := map[string]string{
		"failed_local_healthcheck":             "LH",
		"no_healthy_upstream":                  "UH",
		"upstream_request_timeout":             "UT",
		"local_reset":                          "LR",
		"upstream_remote_reset":                "UR",
		"upstream_connection_failure":          "UF",
		"upstream_connection_termination":      "UC",
		"upstream_overflow":                    "UO",
		"no_route_found":                       "NR",
		"delay_injected":                       "DI",
		"fault_injected":                       "FI",
		"rate_limited":                         "RL",
		"rate_limit_service_error":             "RLSE",
		"downstream_connection_termination":    "DC",
		"upstream_retry_limit_exceeded":        "URX",
		"stream_idle_timeout":                  "SI",
		"invalid_envoy_request_headers":        "IH",
		"downstream_protocol_error":            "DPE",
		"upstream_max_stream_duration_reached": "UMSDR",
		"response_from_cache_filter":           "RFCF",
		"no_filter_config_found":               "NFCF",
		"duration_timeout":                     "DT",
		"upstream_protocol_error":              "UPE",
		"no_cluster_found":                     "NC",
		"overload_manager":                     "OM",
		"dns_resolution_failure":               "DF",
		"downstream_remote_reset":              "DR",
	}
	var set []string
	var bits uint64
	f.ProtoReflect().Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		name := string(fd.Name())
		bits |= 1 << (fd.Number() - 1)
		if fd.Kind() == protoreflect.MessageKind {
			set = append(set, name) // unauthorized_details
		} else if v.Bool() {
			if s, ok := short[name]; ok {
				name = s
			}
			set = append(set, name)
		}
		return true
	})
	// Range walks fields in no fixed order; %RESPONSE_FLAGS% lists them by
	// field number, and so do we.
	fields := f.ProtoReflect().Descriptor().Fields()
	order := map[string]int{}
	for i := 0; i < fields.Len(); i++ {
		fd := fields.Get(i)
		name := string(fd.Name())
		if s, ok := short[name]; ok {
			name = s
		}
		order[name] = int(fd.Number())
	}
	sort.Slice(set, func(i, j int) bool { return order[set[i]] < order[set[j]] })
	if len(set) == 0 {
		return "-", 0
	}
	return strings.Join(set, ","), bits
}

// replyExchange is what the ext_proc server saw of one request.
type replyExchange struct {
	response map[string]string // response-headers message; nil when none came
	attrs    map[string]string // the response attributes sent with it
	ended    bool              // the stream is over
}

// replyRecorder is an ext_proc server that routes each request to the
// cluster its x-target header names and records the response phase, and an
// access log server that keeps Envoy's entries, on one loopback gRPC server.
type replyRecorder struct {
	extprocv3.UnimplementedExternalProcessorServer
	alsv3.UnimplementedAccessLogServiceServer
	addr string

	mu   sync.Mutex
	ex   map[string]*replyExchange
	logs map[string]*alsdatav3.HTTPAccessLogEntry
}

func startReplyRecorder(t *testing.T) *replyRecorder {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &replyRecorder{addr: ln.Addr().String(), ex: map[string]*replyExchange{}, logs: map[string]*alsdatav3.HTTPAccessLogEntry{}}
	g := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(g, r)
	alsv3.RegisterAccessLogServiceServer(g, r)
	done := make(chan struct{})
	go func() { defer close(done); _ = g.Serve(ln) }()
	t.Cleanup(func() { g.Stop(); <-done })
	return r
}

func (r *replyRecorder) exchange(probe string) (replyExchange, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	ex, ok := r.ex[probe]
	if !ok {
		return replyExchange{}, false
	}
	return *ex, true
}

func (r *replyRecorder) logEntry(probe string) *alsdatav3.HTTPAccessLogEntry {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.logs[probe]
}

func (r *replyRecorder) Process(s grpc.BidiStreamingServer[extprocv3.ProcessingRequest, extprocv3.ProcessingResponse]) error {
	var probe string
	defer func() {
		r.mu.Lock()
		if ex, ok := r.ex[probe]; ok {
			ex.ended = true
		}
		r.mu.Unlock()
	}()
	for {
		req, err := s.Recv()
		if err != nil {
			return nil
		}
		var resp *extprocv3.ProcessingResponse
		switch m := req.Request.(type) {
		case *extprocv3.ProcessingRequest_RequestHeaders:
			h := replyHeaders(m.RequestHeaders.GetHeaders())
			probe = h["x-probe"]
			r.mu.Lock()
			r.ex[probe] = &replyExchange{}
			r.mu.Unlock()
			resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
				RequestHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{
					HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{{
						Header: &corev3.HeaderValue{Key: "x-route", RawValue: []byte(h["x-target"])},
					}}},
					ClearRouteCache: true,
				}},
			}}
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			h := replyHeaders(m.ResponseHeaders.GetHeaders())
			attrs := replyAttributes(req.GetAttributes())
			r.mu.Lock()
			if ex, ok := r.ex[probe]; ok {
				ex.response, ex.attrs = h, attrs
			}
			r.mu.Unlock()
			resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
				ResponseHeaders: &extprocv3.HeadersResponse{},
			}}
		default:
			return fmt.Errorf("unexpected ext_proc message %T", m)
		}
		if err := s.Send(resp); err != nil {
			return nil
		}
	}
}

func (r *replyRecorder) StreamAccessLogs(s grpc.ClientStreamingServer[alsv3.StreamAccessLogsMessage, alsv3.StreamAccessLogsResponse]) error {
	for {
		msg, err := s.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				return s.SendAndClose(&alsv3.StreamAccessLogsResponse{})
			}
			return nil
		}
		r.mu.Lock()
		for _, e := range msg.GetHttpLogs().GetLogEntry() {
			r.logs[e.GetRequest().GetRequestHeaders()["x-probe"]] = e
		}
		r.mu.Unlock()
	}
}

func replyHeaders(m *corev3.HeaderMap) map[string]string {
	h := map[string]string{}
	for _, kv := range m.GetHeaders() {
		v := kv.GetValue()
		if raw := kv.GetRawValue(); len(raw) > 0 {
			v = string(raw)
		}
		h[kv.GetKey()] = v
	}
	return h
}

// replyAttributes flattens the attributes Envoy sends (one struct per
// filter name) to one map of strings.
func replyAttributes(m map[string]*structpb.Struct) map[string]string {
	out := map[string]string{}
	for _, s := range m {
		for k, v := range s.GetFields() {
			val := fmt.Sprint(v.AsInterface())
			if n, ok := v.GetKind().(*structpb.Value_NumberValue); ok {
				val = strconv.FormatFloat(n.NumberValue, 'f', -1, 64)
			}
			out[k] = val
		}
	}
	return out
}

// joined is m as sorted "k=v" pairs.
func joined(m map[string]string) string {
	kv := make([]string, 0, len(m))
	for k, v := range m {
		kv = append(kv, k+"="+v)
	}
	sort.Strings(kv)
	return strings.Join(kv, " ")
}

// replyInstance is a loopback HTTP/1.1 upstream whose behaviour each request
// picks with x-case. Signals (channels closed once, by name) let a test and
// a request wait for each other.
type replyInstance struct {
	addr string
	stop chan struct{}

	mu      sync.Mutex
	count   map[string]int
	signals map[string]chan struct{}
}

func startReplyInstance(t *testing.T) *replyInstance {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u := &replyInstance{addr: ln.Addr().String(), stop: make(chan struct{}),
		count: map[string]int{}, signals: map[string]chan struct{}{}}
	srv := &http.Server{Handler: u, ReadHeaderTimeout: 5 * time.Second}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ln) }()
	t.Cleanup(func() {
		close(u.stop)
		_ = srv.Close()
		<-done
	})
	return u
}

// signal is the channel closed when name fires.
func (u *replyInstance) signal(name string) <-chan struct{} {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.signalLocked(name)
}

func (u *replyInstance) signalLocked(name string) chan struct{} {
	c, ok := u.signals[name]
	if !ok {
		c = make(chan struct{})
		u.signals[name] = c
	}
	return c
}

// fire closes name's channel, once.
func (u *replyInstance) fire(name string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	c := u.signalLocked(name)
	select {
	case <-c:
	default:
		close(c)
	}
}

// await waits for name to fire, the request to end, the instance to stop or
// 5 s, whichever comes first.
func (u *replyInstance) await(r *http.Request, name string) {
	select {
	case <-u.signal(name):
	case <-r.Context().Done():
	case <-u.stop:
	case <-time.After(5 * time.Second):
	}
}

// hits is how many requests with x-probe probe reached the instance.
func (u *replyInstance) hits(probe string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.count[probe]
}

func (u *replyInstance) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	probe := r.Header.Get("x-probe")
	u.mu.Lock()
	u.count[probe]++
	u.mu.Unlock()
	u.fire("arrived " + probe)
	_, _ = io.Copy(io.Discard, r.Body)

	w.Header().Set("x-instance", "replies")
	behaviour := r.Header.Get("x-case")
	switch {
	case strings.HasPrefix(behaviour, "status-"), behaviour == "retry-503":
		code := http.StatusServiceUnavailable
		if s, ok := strings.CutPrefix(behaviour, "status-"); ok {
			_, _ = fmt.Sscan(s, &code)
		}
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(code)
		fmt.Fprintf(w, "the instance says %d\n", code)
	case behaviour == "timeout", behaviour == "client-gone":
		u.await(r, "never")
	case behaviour == "hold":
		u.await(r, "release "+probe)
		fmt.Fprintln(w, "released")
	case behaviour == "reset-before-headers":
		if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
			_ = conn.Close() // the reset is the point
		}
	case strings.Contains(behaviour, "after-headers"):
		// A 200 whose body promises more than it carries; the connection
		// dies once the client has the headers, so the reset comes after
		// the response phase, not while its message is in flight.
		conn, buf, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		if tc, ok := conn.(*net.TCPConn); ok && strings.HasPrefix(behaviour, "rst-") {
			_ = tc.SetLinger(0) // close sends RST, not FIN
		}
		framing := "Content-Length: 1000\r\n\r\npartial answer"
		if strings.HasSuffix(behaviour, "-chunked") {
			framing = "Transfer-Encoding: chunked\r\n\r\ne\r\npartial answer\r\n"
		}
		fmt.Fprint(buf, "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nx-instance: replies\r\n"+framing)
		if buf.Flush() == nil {
			u.await(r, "headers "+probe)
		}
	default:
		fmt.Fprintln(w, "ok")
	}
}

// closedPort is a loopback address nothing listens on.
func closedPort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	return addr
}

// repliesBootstrap is a static Envoy config on loopback: ext_proc (headers
// both ways) and a gRPC access log to the recorder, routes that take the
// cluster from x-route, and one cluster per failure.
func repliesBootstrap(t *testing.T, recorder, instance, closed string) *bootstrapv3.Bootstrap {
	t.Helper()
	ep := func(cluster, hostport string) string {
		host, port, err := net.SplitHostPort(hostport)
		if err != nil {
			t.Fatal(err)
		}
		return fmt.Sprintf(`{cluster_name: %s, endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: %s, port_value: %s}}}}]}]}`,
			cluster, host, port)
	}
	const retry = `retry_policy: {retry_on: "connect-failure,refused-stream,reset,gateway-error", num_retries: 1}`
	cfg := fmt.Sprintf(`
admin:
  address: {socket_address: {address: 127.0.0.1, port_value: 0}}
static_resources:
  listeners:
  - name: replies
    address: {socket_address: {address: 127.0.0.1, port_value: 0}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: replies
          access_log:
          - name: envoy.access_loggers.http_grpc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig
              common_config:
                log_name: replies
                transport_api_version: V3
                grpc_service: {envoy_grpc: {cluster_name: recorder}}
                buffer_flush_interval: 0.02s
                buffer_size_bytes: 1
              additional_request_headers_to_log: [x-probe]
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: {envoy_grpc: {cluster_name: recorder}}
              failure_mode_allow: false
              message_timeout: 2s
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: NONE
                response_body_mode: NONE
                request_trailer_mode: SKIP
                response_trailer_mode: SKIP
              response_attributes: [response.code, response.code_details, response.flags, upstream.address]
          - name: envoy.filters.http.router
            typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
          route_config:
            name: replies
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {prefix: /, headers: [{name: x-route, present_match: true}, {name: x-case, string_match: {exact: timeout}}]}
                route: {cluster_header: x-route, timeout: 0.3s}
              - match: {prefix: /, headers: [{name: x-route, present_match: true}, {name: x-case, string_match: {prefix: retry-}}]}
                route: {cluster_header: x-route, timeout: 5s, %[5]s}
              - match: {prefix: /, headers: [{name: x-route, present_match: true}]}
                route: {cluster_header: x-route, timeout: 5s}
              - match: {prefix: /}
                direct_response: {status: 418, body: {inline_string: "ext_proc did not route"}}
  clusters:
  - name: recorder
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
    load_assignment: %[1]s
  - name: instance
    type: STATIC
    connect_timeout: 1s
    load_assignment: %[2]s
  - name: refused
    type: STATIC
    connect_timeout: 1s
    load_assignment: %[3]s
  - name: empty
    type: STATIC
    connect_timeout: 1s
    load_assignment: {cluster_name: empty}
  - name: narrow
    type: STATIC
    connect_timeout: 1s
    circuit_breakers:
      thresholds: [{max_connections: 1, max_pending_requests: 1, max_requests: 1}]
    load_assignment: %[4]s
`, ep("recorder", recorder), ep("instance", instance), ep("refused", closed), ep("narrow", instance), retry)
	j, err := yaml.YAMLToJSON([]byte(cfg))
	if err != nil {
		t.Fatal(err)
	}
	b := &bootstrapv3.Bootstrap{}
	if err := protojson.Unmarshal(j, b); err != nil {
		t.Fatalf("replies bootstrap: %v", err)
	}
	if err := b.ValidateAll(); err != nil {
		t.Fatalf("replies bootstrap: %v", err)
	}
	return b
}
