//go:build e2e

package e2e

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"text/template"
	"time"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/launch"
	"github.com/tetherproxy/tether/internal/syncbuf"
	"github.com/tetherproxy/tether/internal/testenv"
)

// TestAttach attaches tether to an Envoy configured by hand, as a user who
// keeps their own listener and routes does (docs/attach.md): the listener,
// the ext_proc filter and the routes below are written out here, not made
// by xds.Build. Two ways to get the clusters the routes name:
//
//   - clusters over CDS: Envoy's bootstrap subscribes to CDS (and so EDS)
//     from tether's ADS server, and takes no listener or routes from it;
//   - static clusters: the user writes inst-<name> and pool-<version>
//     themselves and tether's ADS server is off. This case also runs the
//     smallest filter, request headers only.
//
// A third case takes the clusters over CDS and the response phase off the
// request path: the routing filter marked x-tether-outcomes-apart and an
// observing filter, as docs/attach.md writes them; every request's end
// then reaches tether once, by its ticket.
//
// Each checks sticky routing (every turn of a session on one instance,
// sessions spread over the fleet), that a client cannot pick its own
// cluster, and fail-open: with tether stopped, every request is still
// answered and at least 90% of sessions reach the instance tether bound
// them to (TestFailOpenAgreesWithTether's goal for session ids).
func TestAttach(t *testing.T) {
	t.Run("clusters over CDS", func(t *testing.T) { attach(t, true, "inline") })
	t.Run("static clusters", func(t *testing.T) { attach(t, false, "smallest") })
	t.Run("clusters over CDS, outcomes observed", func(t *testing.T) { attach(t, true, "observe") })
}

// attachConfig fills userEnvoy: the hand-written bootstrap of a user's
// Envoy.
type attachConfig struct {
	ExtProc   string // tether's ext_proc server, host and port
	ADS       string // tether's ADS server; "" for static clusters
	Responses bool   // the filter sends response headers too
	Observe   bool   // an observing filter hears the responses (Responses false)
	Instances []attachInstance
}

type attachInstance struct {
	Name, Host string
	Port       int
}

// userEnvoy is an Envoy configuration as a user writes it. The listener,
// routes and ext_proc filter are the user's; the clusters come over CDS
// from tether's ADS server (.ADS set), or are written out below.
var userEnvoy = template.Must(template.New("envoy").Funcs(template.FuncMap{
	"hostOf": func(hp string) string { h, _, _ := net.SplitHostPort(hp); return h },
	"portOf": func(hp string) string { _, p, _ := net.SplitHostPort(hp); return p },
}).Parse(`
admin:
  address:
    socket_address: {address: 127.0.0.1, port_value: 0}
node:
  id: my-gateway
  cluster: my-gateway
{{- if .ADS}}
dynamic_resources:
  ads_config:
    api_type: GRPC
    transport_api_version: V3
    grpc_services:
    - envoy_grpc: {cluster_name: tether-xds}
  cds_config:
    ads: {}
    resource_api_version: V3
{{- end}}
static_resources:
  listeners:
  - name: my-llm-listener
    address:
      socket_address: {address: 127.0.0.1, port_value: 0}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: my_llm
          # A client must not choose its own instance: drop its
          # x-tether-cluster before any filter or route sees it.
          early_header_mutation_extensions:
          - name: envoy.http.early_header_mutation.header_mutation
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation
              mutations:
              - remove: x-tether-cluster
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {cluster_name: tether}
{{- if .Observe}}
                initial_metadata: [{key: x-tether-outcomes-apart, value: "1"}]
{{- end}}
              failure_mode_allow: true
              message_timeout: 1s
              processing_mode:
                request_header_mode: SEND
{{- if .Responses}}
                response_header_mode: SEND
{{- else}}
                response_header_mode: SKIP
{{- end}}
                request_trailer_mode: SKIP
                response_trailer_mode: SKIP
{{- if .Responses}}
              response_attributes: [upstream.address, response.code]
{{- end}}
{{- if .Observe}}
              metadata_options:
                receiving_namespaces: {untyped: [tether]}
          - name: tether.observe
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {cluster_name: tether}
              failure_mode_allow: true
              observability_mode: true
              deferred_close_timeout: 1s
              processing_mode: {request_header_mode: SEND, response_header_mode: SEND, request_trailer_mode: SKIP, response_trailer_mode: SKIP}
              response_attributes: [upstream.address, response.code]
              metadata_options:
                forwarding_namespaces: {untyped: [tether]}
{{- end}}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
          route_config:
            name: my-routes
{{- if .ADS}}
            # The routes name clusters that arrive later, over CDS.
            validate_clusters: false
{{- end}}
            virtual_hosts:
            - name: llm
              domains: ["*"]
              routes:
              - match:
                  prefix: /
                  headers:
                  - name: x-tether-cluster
                    present_match: true
                route:
                  cluster_header: x-tether-cluster
                  timeout: 300s
              - match: {prefix: /}
                route:
                  cluster: pool-v1
                  timeout: 300s
                  hash_policy:
                  - header: {header_name: x-session-id}
                    terminal: true
                  - header: {header_name: authorization}
                    terminal: true
                  - header: {header_name: x-device-id}
                  - header: {header_name: x-user-id}
                    terminal: true
  clusters:
  - name: tether
    type: STATIC
    connect_timeout: 0.25s
    lb_policy: LEAST_REQUEST
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
    load_assignment:
      cluster_name: tether
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {address: {{hostOf .ExtProc}}, port_value: {{portOf .ExtProc}}}
{{- if .ADS}}
  - name: tether-xds
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
    load_assignment:
      cluster_name: tether-xds
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {address: {{hostOf .ADS}}, port_value: {{portOf .ADS}}}
{{- else}}
{{- range .Instances}}
  - name: inst-{{.Name}}
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: inst-{{.Name}}
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {address: {{.Host}}, port_value: {{.Port}}}
{{- end}}
  - name: pool-v1
    type: STATIC
    connect_timeout: 1s
    lb_policy: RING_HASH
    load_assignment:
      cluster_name: pool-v1
      endpoints:
      - lb_endpoints:
{{- range .Instances}}
        - endpoint:
            address:
              socket_address: {address: {{.Host}}, port_value: {{.Port}}}
          load_balancing_weight: 1
          metadata:
            filter_metadata:
              envoy.lb: {hash_key: {{.Name}}}
{{- end}}
{{- end}}
`))

// attach runs TestAttach's checks with clusters over CDS (cds) or static
// clusters.
// attach runs one case; filter is "inline" (the response phase on the
// routing stream), "smallest" (request headers only) or "observe".
func attach(t *testing.T, cds bool, filter string) {
	const sessions, turns = 200, 3
	rds := testenv.RedisServer(t)
	inst := startFleet(t, 4)
	cfg := baseConfig(rds.URL(), inst)
	if !cds {
		cfg.XDS.Addr = "" // the user's Envoy has every cluster already
	}
	tt := startTether(t, cfg)

	ac := attachConfig{ExtProc: tt.extproc, ADS: tt.xds, Responses: filter == "inline", Observe: filter == "observe"}
	for _, in := range inst {
		host, port, err := net.SplitHostPort(in.Address)
		if err != nil {
			t.Fatal(err)
		}
		p, _ := strconv.Atoi(port)
		ac.Instances = append(ac.Instances, attachInstance{Name: in.Name, Host: host, Port: p})
	}
	px := startUserEnvoy(t, ac)
	if cds {
		waitClusters(t, px, inst)
		checkSubscribed(t, tt)
	}

	// Sticky: every turn of a session on one instance, through tether.
	bound := make([]string, sessions)
	var mu sync.Mutex
	spread := map[string]int{}
	parallel(sessions, 4, func(i int) {
		h := map[string]string{"x-session-id": fmt.Sprintf("attach-%d", i)}
		for turn := 0; turn < turns; turn++ {
			a := chat(t, px, h)
			if a.status != 200 || a.instance == "" {
				t.Errorf("session %d turn %d: %+v", i, turn, a)
				return
			}
			if ac.Responses { // the response phase carries tether's debug headers
				want := map[bool]string{true: "bind", false: "hit"}[turn == 0]
				if a.decision != want || a.tethered != a.instance {
					t.Errorf("session %d turn %d: %+v, want %s on the instance tether chose", i, turn, a, want)
				}
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
	t.Logf("sticky: %d sessions × %d turns, every turn on its session's instance; sessions per instance %v", sessions, turns, spread)
	if len(spread) < 2 {
		t.Fatalf("every session went to one instance: %v", spread)
	}
	// Without the response phase the answers carry no debug headers:
	// tether's counters show that it decided every request.
	binds, all := tt.metric(t, "tether_requests_total", `decision="bind"`), tt.metric(t, "tether_requests_total")
	if binds != sessions || all != sessions*turns {
		t.Errorf("tether decided %.0f requests (%.0f binds), want %d (%d)", all, binds, sessions*turns, sessions)
	}
	if ac.Observe {
		// Each request's end came back by its ticket, once, and none is
		// left in flight.
		waitFor(t, 10*time.Second, "every outcome applied", func() bool {
			return tt.metric(t, "tether_outcomes_total", `result="applied"`) == sessions*turns
		})
		if n := tt.metric(t, "tether_outcomes_total"); n != sessions*turns {
			t.Errorf("%.0f outcome reports for %d requests", n, sessions*turns)
		}
		waitFor(t, 10*time.Second, "no request left in flight", func() bool { return tt.metric(t, "tether_instance_in_flight") == 0 })
	}

	// A client naming a cluster is ignored: tether's answer wins while it
	// runs, and the early header mutation drops the header before the
	// fail-open route below could take it.
	forged := map[string]string{"x-session-id": "attach-0", "x-tether-cluster": "inst-" + other(inst, bound[0])}
	if a := chat(t, px, forged); a.instance != bound[0] {
		t.Errorf("a client's x-tether-cluster moved session 0 from %s to %s", bound[0], a.instance)
	}

	overrides := tt.metric(t, "tether_failopen_overrides_total")
	tt.Stop()
	allowedBefore := counter(t, px, "http.my_llm.ext_proc.failure_mode_allowed")

	same := 0
	perInstance := map[string]int{}
	parallel(sessions, 4, func(i int) {
		a := chat(t, px, map[string]string{"x-session-id": fmt.Sprintf("attach-%d", i)})
		if a.status != 200 {
			t.Errorf("session %d with tether stopped: status %d", i, a.status)
		}
		mu.Lock()
		defer mu.Unlock()
		perInstance[a.instance]++
		if a.instance == bound[i] {
			same++
		}
	})
	allowed := counter(t, px, "http.my_llm.ext_proc.failure_mode_allowed") - allowedBefore
	share := float64(same) / sessions
	t.Logf("fail-open: %d/%d sessions (%.0f%%) reached their bound instance with tether stopped (%d requests failed open; spread %v)",
		same, sessions, 100*share, allowed, perInstance)
	if allowed < sessions {
		t.Errorf("only %d of %d requests failed open: tether is not down", allowed, sessions)
	}
	t.Logf("fail-open overrides (bounded load or a full KV cache passed over the pool's choice): %.0f of %d binds", overrides, sessions)
	if share < 0.9 {
		t.Errorf("%.0f%% of sessions kept their instance with tether stopped, want at least 90%%", 100*share)
	}
	for i := 0; i < 20; i++ {
		h := map[string]string{"x-session-id": fmt.Sprintf("attach-%d", i), "x-tether-cluster": "inst-" + other(inst, bound[i])}
		want := chat(t, px, map[string]string{"x-session-id": fmt.Sprintf("attach-%d", i)}).instance
		if a := chat(t, px, h); a.status != 200 || a.instance != want {
			t.Errorf("session %d with tether stopped and a forged x-tether-cluster: %+v, the pool sends it to %s", i, a, want)
		}
	}
}

// other is an instance that is not name.
func other(inst []config.Instance, name string) string {
	for _, in := range inst {
		if in.Name != name {
			return in.Name
		}
	}
	return name
}

// startUserEnvoy runs Envoy on userEnvoy filled with ac.
func startUserEnvoy(t *testing.T, ac attachConfig) *proxy {
	t.Helper()
	return startEnvoyFrom(t, userEnvoy, ac)
}

// startEnvoyFrom runs Envoy on the bootstrap tmpl makes of data, and
// logs both when the test fails.
func startEnvoyFrom(t *testing.T, tmpl *template.Template, data any) *proxy {
	t.Helper()
	var b bytes.Buffer
	if err := tmpl.Execute(&b, data); err != nil {
		t.Fatal(err)
	}
	logs := &syncbuf.Buffer{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("envoy configuration:\n%s\nenvoy logs:\n%s", b.String(), logs)
		}
	})
	e := testenv.Envoy(t, launch.EnvoyOptions{Bootstrap: b.Bytes(), Concurrency: 2, LogLevel: "warn", Log: logs})
	testenv.WaitServing(t, e)
	return &proxy{url: e.URL(), admin: e.Admin}
}

// waitClusters waits until Envoy has every instance's cluster and the
// pool from CDS, each with its endpoints from EDS.
func waitClusters(t *testing.T, px *proxy, inst []config.Instance) {
	t.Helper()
	want := []string{"pool-v1"}
	for _, in := range inst {
		want = append(want, "inst-"+in.Name)
	}
	waitFor(t, 10*time.Second, "the clusters over CDS", func() bool {
		body := adminGet(t, px, "/clusters")
		for _, c := range want {
			if !strings.Contains(body, c+"::"+"127.0.0.1") {
				return false
			}
		}
		return true
	})
}

// checkSubscribed checks that the Envoy took clusters and endpoints from
// tether's ADS server, acknowledged its version, and asked for nothing else.
func checkSubscribed(t *testing.T, tt *tether) {
	t.Helper()
	var st struct {
		Version string `json:"version"`
		Nodes   []struct {
			ID    string            `json:"id"`
			Acked map[string]string `json:"acked"`
		} `json:"nodes"`
	}
	want := []string{
		"type.googleapis.com/envoy.config.cluster.v3.Cluster",
		"type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
	}
	waitFor(t, 10*time.Second, "the Envoy to acknowledge clusters and endpoints", func() bool {
		getJSON(t, "http://"+tt.admin+"/v1/xds", &st)
		if len(st.Nodes) != 1 || len(st.Nodes[0].Acked) != len(want) {
			return false
		}
		for _, typ := range want {
			if st.Nodes[0].Acked[typ] != st.Version {
				return false
			}
		}
		return true
	})
	t.Logf("ADS: node %s acknowledged version %s for %d types: %v", st.Nodes[0].ID, st.Version, len(st.Nodes[0].Acked), st.Nodes[0].Acked)
}

// counter is one of Envoy's counters (0 when it is absent).
func counter(t *testing.T, px *proxy, name string) int {
	t.Helper()
	v := envoyStat(t, px, name)
	if v == "" {
		return 0
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		t.Fatalf("stat %s: %q", name, v)
	}
	return n
}

func adminGet(t *testing.T, px *proxy, path string) string {
	t.Helper()
	resp, err := http.Get(px.admin + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("GET %s: %v %s", path, err, resp.Status)
	}
	return string(b)
}
