//go:build e2e

package e2e

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"text/template"
	"time"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/testenv"
	"github.com/tetherproxy/tether/store"
)

// TestGatewayStyles puts tether behind an Envoy configured as a gateway
// configures it for an InferencePool's endpoint picker, in the two styles
// the gateways use, and drives sessions through it:
//
//   - override_host: the pool's cluster holds every endpoint and picks the
//     one the picker names in the envoy.lb dynamic metadata, with round
//     robin as the fallback (Istio);
//   - original_dst: the pool is an ORIGINAL_DST cluster that sends the
//     request to the address in x-gateway-destination-endpoint (Envoy AI
//     Gateway, kgateway).
//
// In both, tether runs as it runs behind its own Envoy: same
// configuration, no switch. Every turn of a session lands on one instance,
// the sessions spread, the instance is the one tether chose, and a client
// that names its own destination is overridden. The same sessions, sent
// in the same order, are bound to the same instances as through tether's
// own Envoy.
func TestGatewayStyles(t *testing.T) {
	own := ownEnvoyBindings(t)
	for _, gc := range []gatewayConfig{
		{Style: "override_host", Bodies: "NONE"},
		{Style: "override_host", Bodies: "FULL_DUPLEX_STREAMED"}, // Istio
		{Style: "original_dst", Bodies: "NONE"},
		{Style: "original_dst", Bodies: "BUFFERED"}, // kgateway
	} {
		t.Run(gc.Style+", bodies "+gc.Bodies, func(t *testing.T) {
			bound := gatewayStyle(t, gc)
			agree := 0
			for i := range bound {
				if bound[i] == own[i] {
					agree++
				}
			}
			t.Logf("bindings agree with tether's own Envoy for %d of %d sessions", agree, len(bound))
			if agree != len(bound) {
				t.Errorf("bindings agree with tether's own Envoy for %d of %d sessions", agree, len(bound))
			}
		})
	}
}

// gatewaySessions and gatewayTurns are the workload of TestGatewayStyles:
// sent one request at a time, so that every run sees the same load.
const gatewaySessions, gatewayTurns = 60, 3

func gatewaySession(i int) string { return fmt.Sprintf("gateway-%d", i) }

// ownEnvoyBindings sends TestGatewayStyles' workload through tether's own
// Envoy and returns the instance each session was bound to.
func ownEnvoyBindings(t *testing.T) []string {
	t.Helper()
	inst := startFleet(t, 4)
	cfg := baseConfig(store.Embedded, inst)
	tt := startTether(t, cfg)
	px := startEnvoy(t, cfg, tt.extproc)
	bound := make([]string, gatewaySessions)
	for i := range gatewaySessions {
		for range gatewayTurns {
			a := chat(t, px, map[string]string{"x-session-id": gatewaySession(i)})
			if a.status != 200 || bound[i] != "" && a.instance != bound[i] {
				t.Fatalf("own Envoy, session %d: %+v, bound to %q", i, a, bound[i])
			}
			bound[i] = a.instance
		}
	}
	return bound
}

type gatewayConfig struct {
	Style     string
	Bodies    string // the request body mode; FULL_DUPLEX_STREAMED streams the response's too
	ExtProc   string
	Replica   string // a second tether behind the same gateway; "" for none
	Retries   bool   // the route retries a 5xx on the next endpoint named
	PickerTLS bool   // the gateway calls the picker over TLS, checking nothing
	Endpoints []gatewayEndpoint
}

type gatewayEndpoint struct {
	Host string
	Port int
}

// gatewayEnvoy is what a gateway generates for one InferencePool, reduced
// to what routes a request: the picker's ext_proc filter and the pool's
// cluster.
var gatewayEnvoy = template.Must(template.New("gateway").Funcs(template.FuncMap{
	"hostOf": func(hp string) string { h, _, _ := net.SplitHostPort(hp); return h },
	"portOf": func(hp string) string { _, p, _ := net.SplitHostPort(hp); return p },
}).Parse(`
admin:
  address:
    socket_address: {address: 127.0.0.1, port_value: 0}
node: {id: gateway, cluster: gateway}
static_resources:
  listeners:
  - name: gateway
    address:
      socket_address: {address: 127.0.0.1, port_value: 0}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: gateway
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {cluster_name: picker}
              failure_mode_allow: true
              message_timeout: 1s
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: {{.Bodies}}
{{- if eq .Bodies "FULL_DUPLEX_STREAMED"}}
                response_body_mode: FULL_DUPLEX_STREAMED
                request_trailer_mode: SEND
                response_trailer_mode: SEND
{{- else}}
                response_body_mode: NONE
                request_trailer_mode: SKIP
                response_trailer_mode: SKIP
{{- end}}
              # What a gateway lets the picker read and write: the subset
              # hint and the served endpoint in, the destination out.
              metadata_options:
                forwarding_namespaces: {untyped: [envoy.lb.subset_hint, envoy.lb]}
                receiving_namespaces: {untyped: [envoy.lb]}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
          route_config:
            name: pool
            virtual_hosts:
            - name: pool
              domains: ["*"]
              routes:
              - match: {prefix: /}
                route:
                  cluster: pool
                  timeout: 300s
{{- if .Retries}}
                  retry_policy: {retry_on: "5xx,reset,connect-failure", num_retries: 2}
{{- end}}
  clusters:
  - name: picker
    type: STATIC
    connect_timeout: 0.25s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
{{- if .PickerTLS}}
    # As kgateway generates it: no CA to check tether's certificate
    # against, no client certificate, no ALPN named (Envoy offers h2 for an
    # HTTP/2 cluster, and gRPC refuses a client that offers none).
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context: {validation_context: {}}
{{- end}}
    load_assignment:
      cluster_name: picker
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {address: {{hostOf .ExtProc}}, port_value: {{portOf .ExtProc}}}
{{- if .Replica}}
        - endpoint:
            address:
              socket_address: {address: {{hostOf .Replica}}, port_value: {{portOf .Replica}}}
{{- end}}
{{- if eq .Style "original_dst"}}
  - name: pool
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 1s
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint
{{- else}}
  - name: pool
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: pool
      endpoints:
      - lb_endpoints:
{{- range .Endpoints}}
        - endpoint:
            address:
              socket_address: {address: {{.Host}}, port_value: {{.Port}}}
{{- end}}
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - metadata:
                key: envoy.lb
                path:
                - key: x-gateway-destination-endpoint
            selected_host_key:
              key: envoy.lb
              path:
              - key: x-gateway-destination-endpoint-served
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.round_robin
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin
{{- end}}
`))

func gatewayStyle(t *testing.T, gc gatewayConfig) []string {
	const sessions, turns = gatewaySessions, gatewayTurns
	style := gc.Style + "-" + gc.Bodies
	inst := startFleet(t, 4)
	cfg := baseConfig(store.Embedded, inst)
	cfg.XDS.Addr = "" // the gateway has its own clusters
	if gc.PickerTLS {
		style += "-tls"
		cfg.TLS = pickerTLS(t, cfg.TLS)
	}
	tt := startTether(t, cfg)

	gc.ExtProc = tt.extproc
	gc.Endpoints = gatewayEndpoints(t, inst)
	px := startGateway(t, gc)

	bound := make([]string, sessions)
	var mu sync.Mutex
	spread := map[string]int{}
	parallel(sessions, 1, func(i int) {
		h := map[string]string{"x-session-id": gatewaySession(i)}
		for turn := range turns {
			a := chat(t, px, h)
			if a.status != 200 || a.instance == "" || a.instance != a.tethered {
				t.Errorf("session %d turn %d: %+v, want 200 from the instance tether chose", i, turn, a)
				return
			}
			if turn == 0 {
				bound[i] = a.instance
				mu.Lock()
				spread[a.instance]++
				mu.Unlock()
			} else if a.instance != bound[i] {
				t.Errorf("session %d turn %d went to %s, turn 0 to %s", i, turn, a.instance, bound[i])
			}
		}
	})
	if t.Failed() {
		t.FailNow()
	}
	t.Logf("%s: %d sessions × %d turns, every turn on its session's instance; sessions per instance %v", style, sessions, turns, spread)
	if len(spread) < 2 {
		t.Fatalf("every session went to one instance: %v", spread)
	}
	if gc.PickerTLS {
		stats := pickerStats(t, px)
		t.Logf("%s: %v", style, stats)
		if stats["cluster.picker.ssl.handshake"] == 0 || stats["cluster.picker.ssl.connection_error"] != 0 {
			t.Errorf("the gateway's picker cluster: %v, want TLS handshakes and no TLS connection error", stats)
		}
	}
	// With the bodies sent, every new session was placed by its prompt: the
	// body came whole to tether before the request was routed.
	if gc.Bodies == "FULL_DUPLEX_STREAMED" {
		// The answers streamed back through tether: their usage counted.
		// The prompts are two tokens, under one KV block: none is cached.
		prompt, cached := tt.metric(t, "tether_prompt_tokens_total"), tt.metric(t, "tether_prompt_tokens_total", `cached="true"`)
		missing := tt.metric(t, "tether_answers_without_usage_total")
		t.Logf("%s: usage of the answers: %.0f prompt tokens, %.0f cached; %.0f answers without", style, prompt, cached, missing)
		if prompt < sessions*turns || missing != 0 {
			t.Errorf("usage read from %d answers: %.0f prompt tokens, %.0f cached, %.0f answers without", sessions*turns, prompt, cached, missing)
		}
	}
	if gc.Bodies != "NONE" {
		read := tt.metric(t, "tether_content_decisions_total")
		if incomplete := tt.metric(t, "tether_content_decisions_total", `result="incomplete"`); read < sessions || incomplete != 0 {
			t.Errorf("%.0f content decisions (%.0f incomplete) for %d new sessions", read, incomplete, sessions)
		}
	}

	// With the bodies sent, anonymous requests opening with one long
	// document land together, where the first left it cached.
	if gc.Bodies != "NONE" {
		doc := document(7, 1500) // about 12 KB
		first := post(t, px, chatBody(doc, "what does it say?"))
		for i := range 6 {
			a := post(t, px, chatBody(doc, fmt.Sprintf("question %d?", i)))
			if a.status != 200 || a.decision != "anonymous" || a.instance != first.instance {
				t.Errorf("anonymous request %d with the document: %+v, want it on %s with the first", i, a, first.instance)
			}
		}
	}

	// A streamed answer passes whole, event by event.
	stream := `{"model":"llama-3.1-8b","messages":[{"role":"user","content":"tell me more"}],"max_tokens":16,"stream":true,"stream_options":{"include_usage":true}}`
	req, err := http.NewRequest(http.MethodPost, px.url+"/v1/chat/completions", strings.NewReader(stream))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("x-session-id", gatewaySession(1))
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	events, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != 200 || !strings.HasSuffix(strings.TrimSpace(string(events)), "data: [DONE]") ||
		!strings.Contains(string(events), `"usage"`) || resp.Header.Get("x-instance") != bound[1] {
		t.Errorf("streamed answer: %d from %s (session on %s), %v:\n%s", resp.StatusCode, resp.Header.Get("x-instance"), bound[1], err, events)
	}

	// A client that names its own destination is overridden: an
	// ORIGINAL_DST cluster would otherwise send it anywhere.
	var elsewhere string
	for _, in := range inst {
		if in.Name != bound[0] {
			elsewhere = in.Address
		}
	}
	h := map[string]string{"x-session-id": gatewaySession(0), "x-gateway-destination-endpoint": elsewhere}
	if a := chat(t, px, h); a.instance != bound[0] {
		t.Errorf("a client's own destination %s took the session from %s to %s", elsewhere, bound[0], a.instance)
	}
	return bound
}

// TestGatewayOverTLS: kgateway's style (ORIGINAL_DST on
// x-gateway-destination-endpoint, request bodies BUFFERED) with the picker
// on TLS, as Envoy AI Gateway and kgateway call it. The gateway checks no
// certificate and presents none; tether serves its certificate and asks
// for none (pickerTLS), as it does for those two and for GKE. Sessions
// stick as in plaintext, over TLS connections. A gateway that calls the
// same tether in plaintext gets no decision: its ext_proc streams fail and
// its requests fall open, with no destination named, which the
// ORIGINAL_DST pool answers with 503.
func TestGatewayOverTLS(t *testing.T) {
	gc := gatewayConfig{Style: "original_dst", Bodies: "BUFFERED", PickerTLS: true}
	t.Run("TLS", func(t *testing.T) { gatewayStyle(t, gc) })
	t.Run("plaintext gateway", func(t *testing.T) {
		inst := startFleet(t, 2)
		cfg := baseConfig(store.Embedded, inst)
		cfg.XDS.Addr = ""
		cfg.TLS = pickerTLS(t, cfg.TLS)
		tt := startTether(t, cfg)
		gc.ExtProc, gc.PickerTLS = tt.extproc, false
		px := startGateway(t, gc)
		const requests = 5
		for i := range requests {
			a := chat(t, px, map[string]string{"x-session-id": gatewaySession(i)})
			if a.status != 503 || a.instance != "" || a.decision != "" || a.tethered != "" {
				t.Errorf("request %d through a plaintext gateway: %+v, want 503 from the gateway, no decision from tether", i, a)
			}
		}
		stats := pickerStats(t, px)
		t.Logf("plaintext gateway, tether on TLS: %v", stats)
		if stats["http.gateway.ext_proc.streams_failed"] == 0 || stats["http.gateway.ext_proc.failure_mode_allowed"] != requests {
			t.Errorf("the gateway's ext_proc filter: %v, want failed streams and %d requests let through", stats, requests)
		}
		if got := tt.metric(t, "tether_requests_total"); got != 0 {
			t.Errorf("tether decided %.0f requests from a plaintext gateway", got)
		}
	})
}

// pickerTLS is tls with tether serving TLS as deploy/gateway-api's
// tether.yaml has it for Envoy AI Gateway, kgateway and GKE: a certificate
// and key, from a CA the gateway does not know, and nothing else, so no
// client certificate is asked for (no client_ca_file).
func pickerTLS(t *testing.T, tls config.TLS) config.TLS {
	t.Helper()
	tls.CertFile, tls.KeyFile = tetherCert(t, testenv.NewCA(t, "picker-ca"), t.TempDir())
	tls.ClientCAFile, tls.RequireClientCert = "", nil
	return tls
}

// pickerStats are the gateway's counters of its calls to the picker: the
// picker cluster's connections and TLS, and the ext_proc filter's streams.
func pickerStats(t *testing.T, px *proxy) map[string]int {
	t.Helper()
	stats := map[string]int{}
	for _, s := range []string{
		"cluster.picker.upstream_cx_total", "cluster.picker.upstream_cx_destroy_remote",
		"cluster.picker.ssl.handshake", "cluster.picker.ssl.connection_error",
		"http.gateway.ext_proc.streams_started", "http.gateway.ext_proc.streams_failed",
		"http.gateway.ext_proc.failure_mode_allowed",
	} {
		stats[s] = px.stat(t, s)
	}
	return stats
}

// gatewayEndpoints are the pool's endpoints: the instances' addresses.
func gatewayEndpoints(t *testing.T, inst []config.Instance) []gatewayEndpoint {
	t.Helper()
	var out []gatewayEndpoint
	for _, in := range inst {
		host, port, err := net.SplitHostPort(in.Address)
		if err != nil {
			t.Fatal(err)
		}
		p, _ := strconv.Atoi(port)
		out = append(out, gatewayEndpoint{Host: host, Port: p})
	}
	return out
}

// startGateway runs Envoy on gatewayEnvoy filled with gc.
func startGateway(t *testing.T, gc gatewayConfig) *proxy {
	t.Helper()
	return startEnvoyFrom(t, gatewayEnvoy, gc)
}

// TestGatewayHitDoesNotWaitForBody: behind a gateway that streams bodies
// both ways (Istio's FULL_DUPLEX_STREAMED), a request whose session is
// bound leaves for its instance on its headers. The instance has the
// request's headers while the client still holds the body's last chunk.
// A new session's 250 KB body, which tether reads to place it, reaches
// the instance whole.
func TestGatewayHitDoesNotWaitForBody(t *testing.T) {
	const big = 250 << 10
	arrived := make(chan struct{}, 4)
	var mu sync.Mutex
	var bodies []int
	stub := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{} // the headers are here; the body may not be
		n, err := io.Copy(io.Discard, r.Body)
		mu.Lock()
		bodies = append(bodies, int(n))
		mu.Unlock()
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		w.Header().Set("x-instance", "stub")
		fmt.Fprint(w, `{"choices":[]}`)
	}))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	stub.Listener = ln
	stub.Start()
	t.Cleanup(stub.Close)

	host, port, _ := net.SplitHostPort(ln.Addr().String())
	p, _ := strconv.Atoi(port)
	cfg := baseConfig(store.Embedded, []config.Instance{{Name: "stub", Address: ln.Addr().String(), Engine: "generic"}})
	cfg.XDS.Addr = ""
	tt := startTether(t, cfg)
	px := startGateway(t, gatewayConfig{Style: "override_host", Bodies: "FULL_DUPLEX_STREAMED", ExtProc: tt.extproc,
		Endpoints: []gatewayEndpoint{{Host: host, Port: p}}})

	send := func(body io.Reader) (*http.Response, error) {
		req, err := http.NewRequest(http.MethodPost, px.url+"/v1/chat/completions", body)
		if err != nil {
			return nil, err
		}
		req.Header.Set("x-session-id", "streamed")
		req.Header.Set("content-type", "application/json")
		return client.Do(req)
	}
	// The session's first request: tether reads its body to place it.
	doc := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("x", big) + `"}]}`
	resp, err := send(strings.NewReader(doc))
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	<-arrived
	mu.Lock()
	if resp.StatusCode != 200 || len(bodies) != 1 || bodies[0] != len(doc) {
		t.Fatalf("first request: status %d, the instance read %v bytes of %d", resp.StatusCode, bodies, len(doc))
	}
	mu.Unlock()

	// A hit: the client sends the first chunk and holds the last until the
	// instance has the request.
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		resp, err := send(pr)
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				err = fmt.Errorf("status %d", resp.StatusCode)
			}
		}
		done <- err
	}()
	if _, err := pw.Write([]byte(`{"model":"m","messages":[{"role":"user",`)); err != nil {
		t.Fatal(err)
	}
	select {
	case <-arrived:
	case <-time.After(10 * time.Second):
		t.Fatal("the instance did not get the hit's headers before its last body chunk was sent")
	}
	if _, err := pw.Write([]byte(`"content":"and the rest"}]}`)); err != nil {
		t.Fatal(err)
	}
	if err := pw.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got := tt.metric(t, "tether_requests_total", `decision="hit"`); got != 1 {
		t.Errorf("%.0f hits, want 1", got)
	}
}

// TestGatewayTwoReplicas: two tethers on one Redis behind one gateway
// (override_host, Istio's style). Envoy spreads the picker's streams over
// both, and every turn of a session lands on its instance, whichever
// replica decides. Then both stop: the gateway's fail-open (round robin)
// answers every request, and the test reports how many turns still reach
// their session's instance.
func TestGatewayTwoReplicas(t *testing.T) {
	const sessions, turns = 40, 4
	rds := testenv.RedisServer(t)
	inst := startFleet(t, 4)
	cfg := baseConfig(rds.URL(), inst)
	cfg.XDS.Addr = ""
	a, b := startTether(t, cfg), startTether(t, cfg)
	gc := gatewayConfig{Style: "override_host", Bodies: "NONE", ExtProc: a.extproc, Replica: b.extproc}
	gc.Endpoints = gatewayEndpoints(t, inst)
	px := startGateway(t, gc)

	bound := make([]string, sessions)
	parallel(sessions, 4, func(i int) {
		h := map[string]string{"x-session-id": fmt.Sprintf("replicas-%d", i)}
		for turn := range turns {
			r := chat(t, px, h)
			switch {
			case r.status != 200 || r.instance != r.tethered:
				t.Errorf("session %d turn %d: %+v", i, turn, r)
			case turn == 0:
				bound[i] = r.instance
			case r.instance != bound[i]:
				t.Errorf("session %d turn %d went to %s, turn 0 to %s", i, turn, r.instance, bound[i])
			}
		}
	})
	if t.Failed() {
		t.FailNow()
	}
	na, nb := a.metric(t, "tether_requests_total"), b.metric(t, "tether_requests_total")
	t.Logf("two replicas: %d sessions × %d turns on their instances; decided %.0f and %.0f", sessions, turns, na, nb)
	if na == 0 || nb == 0 || na+nb != sessions*turns {
		t.Errorf("replicas decided %.0f and %.0f of %d requests; want both, and all", na, nb, sessions*turns)
	}

	// Both replicas gone: the gateway routes on round robin.
	a.Stop()
	b.Stop()
	kept := 0
	for i := range sessions {
		r := chat(t, px, map[string]string{"x-session-id": fmt.Sprintf("replicas-%d", i)})
		if r.status != 200 {
			t.Fatalf("with tether down, session %d: %+v", i, r)
		}
		if r.instance == bound[i] {
			kept++
		}
	}
	t.Logf("tether down: every request answered by round robin; %d of %d sessions reached their instance", kept, sessions)
}

// TestGatewayRetryGoesToTheFallback: with server.destination_fallbacks
// set, behind Istio's override_host, an instance that starts failing has
// its sessions' requests retried on their fallback. The gateway reports
// the endpoint that served (x-gateway-destination-endpoint-served); tether
// counts the failure against the instance it chose, opens its breaker, and
// moves each session to the instance its retry reached.
func TestGatewayRetryGoesToTheFallback(t *testing.T) {
	const sessions = 40
	inst, broken := startFaultyFleet(t, 4)
	cfg := baseConfig(store.Embedded, inst)
	cfg.XDS.Addr = ""
	cfg.Server.DestinationFallbacks = 2
	tt := startTether(t, cfg)
	gc := gatewayConfig{Style: "override_host", Bodies: "NONE", ExtProc: tt.extproc, Retries: true}
	gc.Endpoints = gatewayEndpoints(t, inst)
	px := startGateway(t, gc)

	session := func(i int) map[string]string { return map[string]string{"x-session-id": fmt.Sprintf("retry-%d", i)} }
	bound := make([]string, sessions)
	for i := range sessions {
		a := chat(t, px, session(i))
		if a.status != 200 || a.instance != a.tethered {
			t.Fatalf("session %d: %+v", i, a)
		}
		bound[i] = a.instance
	}
	failing := bound[0]
	broken[failing].Store(true)

	// Each of its sessions is answered by its fallback, where tether still
	// chose the failing instance.
	retried := map[int]string{}
	for i := range sessions {
		if bound[i] != failing {
			continue
		}
		a := chat(t, px, session(i))
		if a.status != 200 || a.instance == failing {
			t.Fatalf("session %d on failing %s: %+v, want 200 from a fallback", i, failing, a)
		}
		if a.tethered == failing {
			retried[i] = a.instance
		}
	}
	if len(retried) == 0 {
		t.Fatalf("no request was retried on a fallback: the breaker opened first")
	}
	// The breaker opens on what the gateway reported served; the sessions
	// move, each to the instance its retry reached.
	waitFor(t, 10*time.Second, "the failing instance's breaker to open", func() bool {
		return tt.metric(t, "tether_instance_breaker_state", `upstream="`+failing+`"`) == 1
	})
	for i, fallback := range retried {
		a := chat(t, px, session(i))
		if a.status != 200 || a.tethered != fallback || a.instance != fallback {
			t.Errorf("session %d: retried on %s, then %+v", i, fallback, a)
		}
	}
	t.Logf("%d sessions on %s: %d retried on their fallback, and moved there", countOf(bound, failing), failing, len(retried))
}

func countOf(list []string, v string) int {
	n := 0
	for _, x := range list {
		if x == v {
			n++
		}
	}
	return n
}
