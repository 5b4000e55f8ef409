package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"sync"
	"text/template"
	"time"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/launch"
	"github.com/tetherproxy/tether/lab/emulator"
)

// The gateway scenario (issue 34): tether as an InferencePool's endpoint
// picker behind Envoy configured in Istio's style (docs/gateway-api.md):
// an override_host cluster over the four zero-latency instances, picking
// the endpoint the picker names in the envoy.lb metadata, and the ext_proc
// filter streaming both bodies FULL_DUPLEX_STREAMED. Beside it, in the
// same run and in alternation as paired.go alternates the floor and
// tether: the same Envoy with no ext_proc filter (the bound), the
// stateless picker (picker.go), and each router with the bodies not sent
// (body modes NONE), so that what echoing the chunks costs shows apart
// from what routing costs. Each request is a chat body of 1 KB or 32 KB
// carrying a session id.

// gatewayBodySizes are the chat bodies of the goal, in bytes.
var gatewayBodySizes = []int{1 << 10, 32 << 10}

// Body modes of the gateway's ext_proc filter.
const (
	bodiesNone   = "NONE"
	bodiesDuplex = "FULL_DUPLEX_STREAMED"
)

// Routers behind the gateway.
const (
	routerNone   = ""
	routerPicker = "picker"
	routerTether = "tether"
)

// gatewayConfig is one configuration of the gateway scenario.
type gatewayConfig struct {
	name, router, bodies string
}

var (
	gatewayAlone        = gatewayConfig{name: "Envoy alone (no ext_proc)", router: routerNone}
	gatewayPickerNone   = gatewayConfig{name: "stateless picker, bodies not sent", router: routerPicker, bodies: bodiesNone}
	gatewayPickerDuplex = gatewayConfig{name: "stateless picker, bodies streamed", router: routerPicker, bodies: bodiesDuplex}
	gatewayTetherNone   = gatewayConfig{name: "tether, bodies not sent", router: routerTether, bodies: bodiesNone}
	gatewayTetherDuplex = gatewayConfig{name: "tether, bodies streamed", router: routerTether, bodies: bodiesDuplex}
	gatewayConfigs      = []gatewayConfig{gatewayAlone, gatewayPickerNone, gatewayPickerDuplex, gatewayTetherNone, gatewayTetherDuplex}
)

// GatewayRow is one configuration with one body size, summed over the
// rounds of the alternation.
type GatewayRow struct {
	Name, Router, Bodies string
	BodyBytes            int
	// One connection: Serial requests, their p50 and p99.
	Serial               int
	SerialP50, SerialP99 time.Duration
	// The open loop at Rate a second (the same for every configuration of
	// a body size).
	Rate            float64
	P50, P99        time.Duration
	Failed, Dropped int
	// The closed loop: Requests answered in Took on Scale.OverheadWorkers
	// connections, each sending for a session bound before.
	Requests int64
	Took     time.Duration
	// RoundThroughputs are the closed loop's requests a second, round by
	// round.
	RoundThroughputs []float64
	// CPU per request in the closed loop: Envoy's, the router's.
	EnvoyCPUPerRequest, RouterCPUPerRequest time.Duration
	// Decisions: tether's decisions in the closed loop, or the request
	// headers the picker answered; HitShare, the share of tether's that
	// were hits.
	Decisions int
	HitShare  float64
}

// Throughput is the closed loop's requests per second.
func (g GatewayRow) Throughput() float64 { return ratio(float64(g.Requests), g.Took.Seconds()) }

// gatewayEnvoy is the gateway's bootstrap: Istio's override_host style, as
// e2e/gateway_test.go runs it, with no ext_proc filter when ExtProc is
// empty.
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
{{- if .ExtProc}}
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
                response_body_mode: {{.Bodies}}
{{- if eq .Bodies "FULL_DUPLEX_STREAMED"}}
                request_trailer_mode: SEND
                response_trailer_mode: SEND
{{- else}}
                request_trailer_mode: SKIP
                response_trailer_mode: SKIP
{{- end}}
              metadata_options:
                forwarding_namespaces: {untyped: [envoy.lb.subset_hint, envoy.lb]}
                receiving_namespaces: {untyped: [envoy.lb]}
{{- end}}
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
                route: {cluster: pool, timeout: 300s}
  clusters:
{{- if .ExtProc}}
  - name: picker
    type: STATIC
    connect_timeout: 0.25s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
    load_assignment:
      cluster_name: picker
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {address: {{hostOf .ExtProc}}, port_value: {{portOf .ExtProc}}}
{{- end}}
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
              socket_address: {address: {{hostOf .}}, port_value: {{portOf .}}}
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
`))

// gatewayBootstrap is the gateway's bootstrap for the router at extproc
// ("" for none) with body mode bodies, over endpoints.
func gatewayBootstrap(extproc, bodies string, endpoints []string) ([]byte, error) {
	var b bytes.Buffer
	err := gatewayEnvoy.Execute(&b, struct {
		ExtProc, Bodies string
		Endpoints       []string
	}{extproc, bodies, endpoints})
	return b.Bytes(), err
}

// gatewayStack is one configuration's processes: the router (tether or
// the picker; none for Envoy alone) and the gateway's Envoy.
type gatewayStack struct {
	cfg    gatewayConfig
	envoy  *launch.Envoy
	tether *launch.Tether
	picker *launch.Proc
	// pickerAdmin is the picker's admin address; routes what it routes by
	// and names the instances by address.
	pickerAdmin string
	routes      PickerRoutes
	names       map[string]string
}

// startGatewayStack starts c's router and Envoy in dir.
func startGatewayStack(ctx context.Context, opts Options, dir string, c gatewayConfig, instances []config.Instance, endpoints []string) (*gatewayStack, error) {
	s := &gatewayStack{cfg: c, routes: PickerRoutes{SessionHeader: config.DefaultSessionHeader, Endpoints: endpoints}, names: map[string]string{}}
	for _, in := range instances {
		s.names[in.Address] = in.Name
	}
	var extproc string
	var err error
	switch c.router {
	case routerTether:
		// tether as deployed: the embedded store, cache-aware placement
		// on (the default); no xDS, as the gateway has its own clusters.
		cfg := baseConfig(opts.Scale, instances)
		cfg.XDS.Addr = ""
		cfg.Redis.URL = "embedded"
		cfg.Content = config.Default().Content
		var args []string
		if opts.CPUProfiles != "" {
			args = []string{"--cpuprofile", profilePath(opts.CPUProfiles, "gateway "+c.name)}
		}
		if s.tether, err = startTether(ctx, opts.TetherBin, dir, secret, cfg, args); err != nil {
			return nil, err
		}
		extproc = s.tether.Extproc
	case routerPicker:
		var ready FloorReady
		if s.picker, ready, err = startPicker(ctx, opts.LabBin, s.routes); err != nil {
			return nil, err
		}
		extproc, s.pickerAdmin = ready.Extproc, ready.Admin
	}
	boot, err := gatewayBootstrap(extproc, c.bodies, endpoints)
	if err != nil {
		s.close()
		return nil, err
	}
	ectx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if s.envoy, err = launch.StartEnvoy(ectx, launch.EnvoyOptions{Bin: opts.EnvoyBin, Dir: dir, Bootstrap: boot, LogLevel: "error"}); err != nil {
		s.close()
		return nil, err
	}
	if err := s.envoy.WaitServing(ectx); err != nil {
		s.close()
		return nil, err
	}
	return s, nil
}

// startPicker runs `bin bench picker` (bin is tether-lab) for routes, on
// loopback, and returns once it listens.
func startPicker(ctx context.Context, bin string, routes PickerRoutes) (*launch.Proc, FloorReady, error) {
	var ready FloorReady
	if bin == "" {
		return nil, ready, errors.New("stateless picker: Options needs LabBin, the tether-lab binary")
	}
	args := []string{"bench", "picker", "--session-header", routes.SessionHeader}
	for _, e := range routes.Endpoints {
		args = append(args, "--endpoint", e)
	}
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	p, err := launch.StartReady(ctx, "stateless picker", exec.Command(bin, args...), nil, PickerReadyMessage, &ready)
	return p, ready, err
}

func (s *gatewayStack) close() {
	if s.envoy != nil {
		s.envoy.Stop(stopTimeout)
	}
	if s.tether != nil {
		s.tether.Stop(stopTimeout)
	}
	if s.picker != nil {
		s.picker.Stop(stopTimeout)
	}
}

// cpu is the CPU seconds Envoy and the router (0 without) have used.
func (s *gatewayStack) cpu() (envoy, router float64, err error) {
	if envoy, err = cpuSeconds(s.envoy.Pid()); err != nil {
		return 0, 0, fmt.Errorf("envoy cpu: %w", err)
	}
	switch {
	case s.tether != nil:
		router, err = cpuSeconds(s.tether.Pid())
	case s.picker != nil:
		router, err = cpuSeconds(s.picker.Pid())
	}
	return envoy, router, err
}

// decisions is tether's decisions by kind, or the picker's answered
// request headers under "answered"; nil for Envoy alone.
func (s *gatewayStack) decisions(ctx context.Context) (map[string]float64, error) {
	switch {
	case s.tether != nil:
		m, err := scrape(ctx, s.tether.Admin)
		if err != nil {
			return nil, err
		}
		return decisionCounts(m)
	case s.picker != nil:
		var c FloorCount
		if err := getJSON(ctx, "http://"+s.pickerAdmin+"/requests", &c); err != nil {
			return nil, err
		}
		return map[string]float64{"answered": float64(c.Requests)}, nil
	}
	return nil, nil
}

// runGateway starts the fleet and the configurations side by side and
// measures each body size through them in alternation.
func runGateway(ctx context.Context, opts Options, dir string) ([]GatewayRow, error) {
	fleet := newSimFleet(func(string) (emulator.LatencyModel, error) { return emulator.Fixed(0), nil })
	defer fleet.close()
	var instances []config.Instance
	var endpoints []string
	for i := 0; i < 4; i++ {
		in, err := fleet.add(fmt.Sprintf("zero-%d", i), "z")
		if err != nil {
			return nil, err
		}
		instances, endpoints = append(instances, in), append(endpoints, in.Address)
	}
	stacks, err := startGatewayStacks(ctx, opts, dir, instances, endpoints)
	defer func() {
		var wg sync.WaitGroup
		for _, s := range stacks {
			if s != nil {
				wg.Add(1)
				go func() { defer wg.Done(); s.close() }()
			}
		}
		wg.Wait()
	}()
	if err != nil {
		return nil, err
	}
	var rows []GatewayRow
	for _, n := range gatewayBodySizes {
		b, err := newChatBody(n)
		if err != nil {
			return rows, err
		}
		fmt.Fprintf(opts.Log, "gateway: %s bodies, %d configurations in alternation\n", bodySize(b.size), len(stacks))
		got, err := gatewayOnce(ctx, stacks, b, opts.Scale)
		rows = append(rows, got...)
		if err != nil {
			return rows, fmt.Errorf("%s bodies: %w", bodySize(b.size), err)
		}
	}
	return rows, nil
}

// startGatewayStacks starts every configuration at once, each in a
// directory of its own; on an error, it returns those that started.
func startGatewayStacks(ctx context.Context, opts Options, dir string, instances []config.Instance, endpoints []string) ([]*gatewayStack, error) {
	stacks := make([]*gatewayStack, len(gatewayConfigs))
	errs := make([]error, len(gatewayConfigs))
	var wg sync.WaitGroup
	for i, c := range gatewayConfigs {
		sub, err := os.MkdirTemp(dir, "gateway")
		if err != nil {
			return stacks, err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if stacks[i], errs[i] = startGatewayStack(ctx, opts, sub, c, instances, endpoints); errs[i] != nil {
				errs[i] = fmt.Errorf("%s: %w", c.name, errs[i])
			}
		}()
	}
	wg.Wait()
	return stacks, errors.Join(errs...)
}

// gatewaySide is one configuration's connections and sums in a body
// size's alternation.
type gatewaySide struct {
	st                  *gatewayStack
	url                 string
	client, one         *http.Client
	serial, lat         []time.Duration
	envoyCPU, routerCPU float64
	decisions           map[string]float64
	row                 GatewayRow
}

// gatewayOnce measures body b through every stack in alternation:
// pairedRounds rounds, each configuration in turn (the order rotated and
// reversed from round to round), each turn a slice of the one-connection
// loop, the open loop and the closed loop.
func gatewayOnce(ctx context.Context, stacks []*gatewayStack, b chatBody, sc Scale) ([]GatewayRow, error) {
	size := bodySize(b.size)
	sides := make([]*gatewaySide, len(stacks))
	for i, st := range stacks {
		s, err := newGatewaySide(ctx, st, b, sc)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", st.cfg.name, err)
		}
		defer s.client.CloseIdleConnections()
		defer s.one.CloseIdleConnections()
		sides[i] = s
	}
	rate, err := gatewayRate(ctx, sides[0], b, sc)
	if err != nil {
		return nil, err
	}
	serialN := max(1, sc.BodySerial/pairedRounds)
	slice := sc.OverheadDuration / pairedRounds
	for r := 0; r < pairedRounds; r++ {
		for _, s := range gatewayOrder(sides, r) {
			serialReq := b.sessionRequest(func(w, i int) string { return size + "-" + sessionFor(w, r*serialN+i) })
			openReq := b.sessionRequest(func(w, i int) string { return size + "-" + sessionFor(w+64*r, i) })
			if err := s.round(ctx, b, sc, rate, serialN, slice, serialReq, openReq); err != nil {
				return nil, fmt.Errorf("%s, round %d: %w", s.st.cfg.name, r, err)
			}
		}
	}
	var rows []GatewayRow
	for _, s := range sides {
		rows = append(rows, s.finish())
	}
	return rows, nil
}

// gatewayOrder is the order of round r: the sides rotated by r, reversed
// in odd rounds, so that a drift over the run falls on each alike.
func gatewayOrder(sides []*gatewaySide, r int) []*gatewaySide {
	n := len(sides)
	order := make([]*gatewaySide, n)
	for i := range sides {
		j := (i + r) % n
		if r%2 == 1 {
			j = n - 1 - j
		}
		order[j] = sides[i]
	}
	return order
}

// newGatewaySide warms st's connections with body b, binds the closed
// loop's sessions and, for the picker, proves that it routes.
func newGatewaySide(ctx context.Context, st *gatewayStack, b chatBody, sc Scale) (*gatewaySide, error) {
	s := &gatewaySide{st: st, url: st.envoy.URL(), client: newLoadClient(),
		one: &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 1, MaxConnsPerHost: 1}},
		row: GatewayRow{Name: st.cfg.name, Router: st.cfg.router, Bodies: st.cfg.bodies, BodyBytes: b.size}}
	size := bodySize(b.size)
	closedLoop(ctx, s.client, s.url, 4, min(bodyWarm, sc.BodyDuration), b.sessionRequest(func(w, i int) string { return size + "-warm-" + sessionFor(w, i) }))
	for w := 0; w < sc.OverheadWorkers; w++ {
		if err := b.send(ctx, s.client, s.url, w, gatewayHitSession(size, w)); err != nil {
			return s, fmt.Errorf("bind hit session %d: %w", w, err)
		}
	}
	if st.picker != nil {
		if err := checkPickerRoutes(ctx, s.client, s.url, st.routes, st.names, b); err != nil {
			return s, err
		}
	}
	return s, nil
}

// gatewayHitSession is the session the closed loop's connection w sends
// for with bodies of size.
func gatewayHitSession(size string, w int) string { return fmt.Sprintf("%s-hit-%d", size, w) }

// gatewayRate is the open loop's rate for body b: half what Envoy alone
// (side) answers with it in a short closed loop, at most
// Scale.OverheadRate.
func gatewayRate(ctx context.Context, side *gatewaySide, b chatBody, sc Scale) (float64, error) {
	d := min(bodyWarm, sc.BodyDuration)
	ok, _ := closedLoop(ctx, side.client, side.url, sc.OverheadWorkers, d, b.request())
	rate := min(sc.OverheadRate, math.Round(float64(ok)/d.Seconds()*bodyRateShare))
	if rate < 1 {
		return 0, fmt.Errorf("open-loop rate %.1f/s: Envoy alone answered %d requests in %s", rate, ok, d)
	}
	return rate, nil
}

// round is one side's turn in a round: serialN requests on one
// connection, the open loop at rate for slice, the closed loop for slice
// with CPU and decisions.
func (s *gatewaySide) round(ctx context.Context, b chatBody, sc Scale, rate float64, serialN int, slice time.Duration, serialReq, openReq request) error {
	lat, failed := serial(ctx, s.one, s.url, serialN, serialReq)
	s.serial, s.row.Failed = append(s.serial, lat...), s.row.Failed+failed
	s.row.Rate = rate
	lat, failed, dropped, err := fixedRate(ctx, s.client, s.url, rate, slice, openReq)
	if err != nil {
		return err
	}
	s.lat, s.row.Failed, s.row.Dropped = append(s.lat, lat...), s.row.Failed+failed, s.row.Dropped+dropped
	d0, err := s.st.decisions(ctx)
	if err != nil {
		return err
	}
	e0, r0, err := s.st.cpu()
	if err != nil {
		return err
	}
	size := bodySize(b.size)
	t0 := time.Now()
	ok, bad := closedLoop(ctx, s.client, s.url, sc.OverheadWorkers, slice, b.sessionRequest(func(w, _ int) string { return gatewayHitSession(size, w) }))
	took := time.Since(t0)
	e1, r1, err := s.st.cpu()
	if err != nil {
		return err
	}
	d1, err := s.st.decisions(ctx)
	if err != nil {
		return err
	}
	s.row.Requests, s.row.Took, s.row.Failed = s.row.Requests+ok, s.row.Took+took, s.row.Failed+int(bad)
	s.row.RoundThroughputs = append(s.row.RoundThroughputs, float64(ok)/took.Seconds())
	s.envoyCPU, s.routerCPU = s.envoyCPU+e1-e0, s.routerCPU+r1-r0
	if s.decisions == nil {
		s.decisions = map[string]float64{}
	}
	for k, v := range subCounts(d1, d0) {
		s.decisions[k] += v
	}
	return nil
}

// finish sums the side's rounds into its row.
func (s *gatewaySide) finish() GatewayRow {
	sortDurations(s.serial)
	sortDurations(s.lat)
	row := s.row
	row.Serial = len(s.serial)
	row.SerialP50, row.SerialP99 = percentile(s.serial, 0.5), percentile(s.serial, 0.99)
	row.P50, row.P99 = percentile(s.lat, 0.5), percentile(s.lat, 0.99)
	perReq := func(sec float64) time.Duration {
		return time.Duration(ratio(sec, float64(row.Requests)) * float64(time.Second))
	}
	row.EnvoyCPUPerRequest, row.RouterCPUPerRequest = perReq(s.envoyCPU), perReq(s.routerCPU)
	var sum float64
	for _, v := range s.decisions {
		sum += v
	}
	row.Decisions = int(sum)
	row.HitShare = ratio(s.decisions["hit"], sum)
	return row
}

// checkPickerRoutes proves that the picker routes through this gateway:
// the request of each of floorProbes sessions is answered by the instance
// at the endpoint the picker names for it (names: the instances by
// address), and together they reach more than one instance.
func checkPickerRoutes(ctx context.Context, client *http.Client, url string, routes PickerRoutes, names map[string]string, b chatBody) error {
	seen := map[string]bool{}
	for i := 0; i < floorProbes; i++ {
		session := "route-" + strconv.Itoa(i)
		h, err := b.post(ctx, client, url, i, session)
		if err != nil {
			return fmt.Errorf("routing check, session %s: %w", session, err)
		}
		name, want := h.Get(emulator.InstanceHeader), routes.endpointFor(session)
		if name != names[want] {
			return fmt.Errorf("routing check: session %s answered by instance %q, the picker named %s (%s)", session, name, want, names[want])
		}
		seen[name] = true
	}
	if len(seen) < 2 {
		return fmt.Errorf("routing check: %d sessions all answered by %v", floorProbes, seen)
	}
	return nil
}

// gatewayRow is the row of configuration c with bodies of n bytes; nil
// without.
func (r *Report) gatewayRow(c gatewayConfig, n int) *GatewayRow {
	for i := range r.Gateway {
		if g := &r.Gateway[i]; g.Name == c.name && g.BodyBytes == n {
			return g
		}
	}
	return nil
}

// GatewayGoals are issue 34's goals: tether streaming bodies behind
// Istio's gateway against the stateless picker streaming them, with each
// body size, in the same run: the p50 it adds on one connection and in
// the open loop, and its throughput.
func (r *Report) GatewayGoals() []Goal {
	var goals []Goal
	for _, n := range gatewayBodySizes {
		t, p := r.gatewayRow(gatewayTetherDuplex, n), r.gatewayRow(gatewayPickerDuplex, n)
		if t == nil || p == nil {
			continue
		}
		path := fmt.Sprintf("tether behind Istio's gateway, %s bodies", bodySize(n))
		goals = append(goals,
			newGoal(path, "added p50 over the stateless picker, one connection", millis(t.SerialP50-p.SerialP50), millis(GoalP50OverFloor), true, "ms"),
			newGoal(path, fmt.Sprintf("added p50 over the stateless picker, at %.0f requests/s", t.Rate), millis(t.P50-p.P50), millis(GoalP50OverFloor), true, "ms"),
			newGoal(path, "throughput vs the stateless picker", ratio(t.Throughput(), p.Throughput()), GoalThroughputVsFloor, false, "×"),
		)
	}
	return goals
}

// gatewayMarkdown writes the gateway scenario's tables.
func (r *Report) gatewayMarkdown(w func(string, ...any)) {
	sc := r.Scale
	w("### Behind a gateway: tether as an endpoint picker (issue 34)\n\n")
	w("Envoy as Istio configures it for an InferencePool (docs/gateway-api.md): an `override_host` cluster over\n")
	w("the four zero-latency instances, taking the endpoint the picker names in the `envoy.lb` metadata (round\n")
	w("robin without), and the ext_proc filter with request and response bodies `FULL_DUPLEX_STREAMED`, trailers\n")
	w("`SEND` (\"bodies streamed\"), or bodies `NONE` (\"not sent\"). Envoy runs one worker thread. The routers:\n")
	w("tether (`tether serve`, embedded store, cache-aware placement on, as by default) and the stateless picker\n")
	w("(`tether-lab bench picker`, a process of its own: the FNV-1a hash of the session id picks the endpoint,\n")
	w("the headers are answered at once with it in `x-gateway-destination-endpoint` and `envoy.lb`, every body\n")
	w("chunk echoed, nothing kept). Before its runs the bench checks through Envoy that %d sessions are answered\n", floorProbes)
	w("by the instance the picker named. Every request is a chat completion of the size shown with a session id.\n")
	w("The five configurations run side by side and the bench alternates between them in %d rounds (the order\n", pairedRounds)
	w("rotated and reversed from round to round); per round and configuration %d requests on one connection\n", max(1, sc.BodySerial/pairedRounds))
	w("(a new session every ten), the open loop for %s at the rate shown (half what Envoy alone answers with\n", sc.OverheadDuration/pairedRounds)
	w("the body, at most %.0f/s; a new session every ten) and the closed loop on %d connections for %s, each\n", sc.OverheadRate, sc.OverheadWorkers, sc.OverheadDuration/pairedRounds)
	w("connection sending for a session bound before (tether: every decision a hit). Figures are over all rounds.\n\n")
	w("| configuration | body | one connection p50 | p99 | open loop rate | p50 | p99 | throughput | round by round | Envoy CPU per request | router CPU per request | decisions (hits) | failed | dropped |\n")
	w("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---:|---:|\n")
	for _, g := range r.Gateway {
		rs := slices.Sorted(slices.Values(g.RoundThroughputs))
		rounds, dec := "–", "–"
		if len(rs) > 0 {
			rounds = fmt.Sprintf("%.0f–%.0f", rs[0], rs[len(rs)-1])
		}
		switch g.Router {
		case routerTether:
			dec = fmt.Sprintf("%d (%.1f%% hits)", g.Decisions, 100*g.HitShare)
		case routerPicker:
			dec = strconv.Itoa(g.Decisions)
		}
		w("| %s | %s | %s | %s | %.0f/s | %s | %s | %.0f/s | %s | %s | %s | %s | %d | %d |\n", g.Name, bodySize(g.BodyBytes),
			ms2(g.SerialP50), ms2(g.SerialP99), g.Rate, ms2(g.P50), ms2(g.P99), g.Throughput(), rounds,
			us(g.EnvoyCPUPerRequest), us(g.RouterCPUPerRequest), dec, g.Failed, g.Dropped)
	}
	w("\nWhat each step costs, with the same body: the difference of p50s (one connection / open loop), the\n")
	w("throughput ratio, and the CPU per request Envoy and the router add together.\n\n")
	w("| step | body | p50, one connection | p50, open loop | throughput | Envoy + router CPU per request |\n")
	w("|---|---:|---:|---:|---:|---:|\n")
	for _, n := range gatewayBodySizes {
		for _, st := range []struct {
			name     string
			from, to gatewayConfig
		}{
			{"the stateless picker, bodies not sent, over Envoy alone", gatewayAlone, gatewayPickerNone},
			{"the stateless picker's echo: streamed over not sent", gatewayPickerNone, gatewayPickerDuplex},
			{"tether's echo: streamed over not sent", gatewayTetherNone, gatewayTetherDuplex},
			{"tether over the stateless picker, bodies not sent", gatewayPickerNone, gatewayTetherNone},
			{"tether over the stateless picker, bodies streamed", gatewayPickerDuplex, gatewayTetherDuplex},
		} {
			a, b := r.gatewayRow(st.from, n), r.gatewayRow(st.to, n)
			if a == nil || b == nil {
				continue
			}
			w("| %s | %s | %s | %s | %.2f× | %s |\n", st.name, bodySize(n), ms2(b.SerialP50-a.SerialP50), ms2(b.P50-a.P50),
				ratio(b.Throughput(), a.Throughput()), us(b.EnvoyCPUPerRequest+b.RouterCPUPerRequest-a.EnvoyCPUPerRequest-a.RouterCPUPerRequest))
		}
	}
	w("\n| configuration | goal | target | measured | reached |\n")
	w("|---|---|---:|---:|---|\n")
	for _, g := range r.GatewayGoals() {
		w("| %s | %s | %s | %s | %s |\n", g.Path, g.What, g.Target(), g.Figure(), g.Verdict())
	}
	w("\n")
}
