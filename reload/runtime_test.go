package reload

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/syncbuf"
	"github.com/tetherproxy/tether/xds"
)

// testConfig is a configuration of one instance, listening on loopback.
func testConfig() config.Config {
	c := config.Default()
	c.Server.ExtProcAddr = "127.0.0.1:0"
	c.Server.AdminAddr = "127.0.0.1:0"
	c.XDS.Addr = "127.0.0.1:0"
	c.Instances = []config.Instance{{Name: "a", Address: "127.0.0.1:1", Weight: 1, Version: "v1"}}
	return c
}

func fleetConfig(names ...string) config.Config {
	c := testConfig()
	c.Instances = nil
	for i, n := range names {
		c.Instances = append(c.Instances, config.Instance{Name: n, Address: fmt.Sprintf("127.0.0.1:%d", 1000+i), Version: "v1", Weight: 1})
	}
	if len(names) > 0 {
		// As every configuration Apply is handed: validated, and so
		// resolved (config.Validate).
		if err := c.Validate(); err != nil {
			panic(err)
		}
	}
	return c
}

func TestApply(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	reg := prometheus.NewRegistry()
	ads := xds.NewServer(ctx, zerolog.Nop(), reg)
	rt := New("127.0.0.1:50051", ads, zerolog.Nop(), reg)

	v1, err := rt.Apply(ctx, fleetConfig("a", "b"), "start")
	if err != nil || v1 == "" || ads.Version() != v1 {
		t.Fatalf("first apply: %q, %v (published %q)", v1, err, ads.Version())
	}
	if got := len(rt.fleet.All()); got != 2 {
		t.Fatalf("fleet has %d instances", got)
	}
	// Same configuration: nothing published, counted as unchanged.
	if v, err := rt.Apply(ctx, fleetConfig("a", "b"), "file"); err != nil || v != v1 {
		t.Fatalf("unchanged apply: %q, %v", v, err)
	}
	if n := testutil.ToFloat64(rt.reloads.WithLabelValues("file", "unchanged")); n != 1 {
		t.Fatalf("unchanged count %v", n)
	}
	// A weight change changes the fleet, and the pool endpoints'
	// load_balancing_weight (the fail-open ring): a new version.
	w := fleetConfig("a", "b")
	w.Instances[0].Weight = 3
	vw, err := rt.Apply(ctx, w, "file")
	if err != nil || vw == v1 || ads.Version() != vw {
		t.Fatalf("weight change: %q, %v (published %q; before %q)", vw, err, ads.Version(), v1)
	}
	if in, _ := rt.fleet.Lookup("a"); in.Weight != 3 {
		t.Fatalf("weight not applied: %+v", in)
	}
	// Invalid (config.Validate refuses it): refused, counted, nothing
	// changes.
	if _, _, err := rt.Edit(ctx, "file", func(c *config.Config) { c.Instances[1].Name = "a" }); !errors.Is(err, ErrInvalid) {
		t.Fatalf("duplicate names: err %v", err)
	}
	if _, _, err := rt.Edit(ctx, "admin", func(c *config.Config) { c.Routing.Mode = "sometimes" }); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a bad mode: err %v", err)
	}
	if n := testutil.ToFloat64(rt.reloads.WithLabelValues("file", "invalid")) + testutil.ToFloat64(rt.reloads.WithLabelValues("admin", "invalid")); n != 2 {
		t.Fatalf("invalid count %v", n)
	}
	if ads.Version() != vw || len(rt.fleet.All()) != 2 {
		t.Fatal("a refused configuration changed the state")
	}
	// A new instance: new version, fleet follows.
	v2, err := rt.Apply(ctx, fleetConfig("a", "b", "c"), "admin")
	if err != nil || v2 == v1 || len(rt.fleet.All()) != 3 {
		t.Fatalf("add: %q, %v, %d instances", v2, err, len(rt.fleet.All()))
	}
}

// startADS serves an ADS server on loopback until ctx ends or the test
// does, and returns it with its address.
func startADS(ctx context.Context, t *testing.T, reg prometheus.Registerer) (*xds.Server, string) {
	t.Helper()
	ads := xds.NewServer(ctx, zerolog.Nop(), reg)
	gs := grpc.NewServer()
	ads.Register(gs)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = gs.Serve(lis) }()
	t.Cleanup(gs.Stop)
	return ads, lis.Addr().String()
}

// served fetches the resources of one type the ADS server serves now,
// over a stream of its own that it closes before returning.
func served(t *testing.T, ads *xds.Server, addr, typeURL string) []*anypb.Any {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer func() {
		cancel()
		deadline := time.Now().Add(5 * time.Second)
		for len(ads.Nodes()) != 0 {
			if time.Now().After(deadline) {
				t.Fatal("ADS stream still open 5s after it was closed")
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	s, err := discoveryv3.NewAggregatedDiscoveryServiceClient(conn).StreamAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	req := &discoveryv3.DiscoveryRequest{Node: &corev3.Node{Id: "runtime-test"}, TypeUrl: typeURL}
	if typeURL == resource.RouteType {
		req.ResourceNames = []string{xds.RouteName}
	}
	if err := s.Send(req); err != nil {
		t.Fatal(err)
	}
	resp, err := s.Recv()
	if err != nil {
		t.Fatal(err)
	}
	return resp.GetResources()
}

// servedExtProcTLS returns the TLS context of the tether-extproc cluster
// served now, nil when it has none.
func servedExtProcTLS(t *testing.T, ads *xds.Server, addr string) *tlsv3.UpstreamTlsContext {
	t.Helper()
	for _, a := range served(t, ads, addr, resource.ClusterType) {
		var c clusterv3.Cluster
		if err := a.UnmarshalTo(&c); err != nil {
			t.Fatal(err)
		}
		if c.GetName() != xds.ExtProcCluster {
			continue
		}
		ts := c.GetTransportSocket()
		if ts == nil {
			return nil
		}
		var u tlsv3.UpstreamTlsContext
		if err := ts.GetTypedConfig().UnmarshalTo(&u); err != nil {
			t.Fatal(err)
		}
		return &u
	}
	t.Fatalf("no %s cluster served", xds.ExtProcCluster)
	return nil
}

// TestApplyKeepsServerTLS: tether's own servers keep the [tls] they
// started with until a restart, so the tether-extproc cluster Envoy is
// served keeps it too (else Envoy's handshakes would fail and every
// request skip tether); only [tls.envoy] follows a live edit, while it
// fits that [tls].
func TestApplyKeepsServerTLS(t *testing.T) {
	mtls := func(c *config.Config) {
		c.TLS = config.TLS{
			CertFile: "/tether/tls.crt", KeyFile: "/tether/tls.key", ClientCAFile: "/tether/ca.crt", MinVersion: "1.2",
			Envoy: config.EnvoyTLS{CAFile: "/envoy/ca.crt", CertFile: "/envoy/client.crt", KeyFile: "/envoy/client.key", SNI: "tether.test"},
		}
	}
	plain := func(*config.Config) {}
	// want describes the served context: nil for none, else the minimum
	// version and Envoy's certificate file ("" for none).
	type want struct {
		tls      bool
		min      tlsv3.TlsParameters_TlsProtocol
		certFile string
	}
	started := want{true, tlsv3.TlsParameters_TLSv1_2, "/envoy/client.crt"}
	for _, tc := range []struct {
		name        string
		start, edit func(*config.Config)
		want        want
	}{
		{"TLS turned off", mtls, func(c *config.Config) { c.TLS = config.TLS{MinVersion: "1.2"} }, started},
		{"TLS turned on", plain, mtls, want{}},
		{"min_version raised", mtls, func(c *config.Config) { c.TLS.MinVersion = "1.3" }, started},
		{"client CA dropped", mtls, func(c *config.Config) { c.TLS.ClientCAFile = "" }, started},
		// tether still asks for a client certificate: Envoy keeps its own.
		{"client CA and Envoy's certificate dropped", mtls, func(c *config.Config) {
			c.TLS.ClientCAFile, c.TLS.Envoy.CertFile, c.TLS.Envoy.KeyFile = "", "", ""
		}, started},
		{"Envoy's certificate moved", mtls, func(c *config.Config) {
			c.TLS.Envoy.CertFile, c.TLS.Envoy.KeyFile = "/envoy/new.crt", "/envoy/new.key"
		}, want{true, tlsv3.TlsParameters_TLSv1_2, "/envoy/new.crt"}},
		{"Envoy's certificate moved, min_version raised", mtls, func(c *config.Config) {
			c.TLS.MinVersion = "1.3"
			c.TLS.Envoy.CertFile, c.TLS.Envoy.KeyFile = "/envoy/new.crt", "/envoy/new.key"
		}, want{true, tlsv3.TlsParameters_TLSv1_2, "/envoy/new.crt"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			reg := prometheus.NewRegistry()
			ads, addr := startADS(ctx, t, reg)
			rt := New("127.0.0.1:50051", ads, zerolog.Nop(), reg)

			cfg := fleetConfig("a", "b")
			tc.start(&cfg)
			if _, err := rt.Apply(ctx, cfg, "start"); err != nil {
				t.Fatal(err)
			}
			before := servedExtProcTLS(t, ads, addr)
			next := fleetConfig("a", "b", "c") // and a change that is served
			tc.start(&next)
			tc.edit(&next)
			if _, err := rt.Apply(ctx, next, "file"); err != nil {
				t.Fatal(err)
			}
			if n := len(rt.fleet.All()); n != 3 {
				t.Errorf("fleet has %d instances, want the new one too", n)
			}
			got := servedExtProcTLS(t, ads, addr)
			if (got != nil) != tc.want.tls {
				t.Fatalf("served TLS context %v, want one: %t", got, tc.want.tls)
			}
			if got == nil {
				return
			}
			if m := got.GetCommonTlsContext().GetTlsParams().GetTlsMinimumProtocolVersion(); m != tc.want.min {
				t.Errorf("minimum version %v, want %v", m, tc.want.min)
			}
			cert := ""
			if cs := got.GetCommonTlsContext().GetTlsCertificates(); len(cs) > 0 {
				cert = cs[0].GetCertificateChain().GetFilename()
			}
			if cert != tc.want.certFile {
				t.Errorf("Envoy's certificate %q, want %q", cert, tc.want.certFile)
			}
			if tc.want == started && !proto.Equal(got, before) {
				t.Errorf("served TLS changed:\nbefore %v\nafter  %v", before, got)
			}
		})
	}
}

// TestApplyKeepsRoutingHeaders: the routing header and the identity
// headers change in tether only at a restart, so a live edit of them must
// not reach Envoy either; the rest of the change is served.
func TestApplyKeepsRoutingHeaders(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	reg := prometheus.NewRegistry()
	ads, addr := startADS(ctx, t, reg)
	logs := &syncbuf.Buffer{}
	rt := New("127.0.0.1:50051", ads, zerolog.New(logs), reg)
	start := fleetConfig("a", "b")
	if _, err := rt.Apply(ctx, start, "start"); err != nil {
		t.Fatal(err)
	}
	next := fleetConfig("a", "b", "c")
	next.Routing.ClusterHeader = "x-edited-cluster"
	next.Identity.SessionHeader = "x-edited-session"
	if _, err := rt.Apply(ctx, next, "file"); err != nil {
		t.Fatal(err)
	}
	if n := len(rt.fleet.All()); n != 3 {
		t.Errorf("fleet has %d instances, want the new one too", n)
	}
	routes := served(t, ads, addr, resource.RouteType)
	if len(routes) != 1 {
		t.Fatalf("%d route configurations served, want 1", len(routes))
	}
	var rc routev3.RouteConfiguration
	if err := routes[0].UnmarshalTo(&rc); err != nil {
		t.Fatal(err)
	}
	tether := rc.GetVirtualHosts()[0].GetRoutes()[0]
	if h := tether.GetMatch().GetHeaders()[0].GetName(); h != start.Routing.ClusterHeader {
		t.Errorf("tether's route matches %q, want %q, the header tether still sets", h, start.Routing.ClusterHeader)
	}
	if h := tether.GetRoute().GetClusterHeader(); h != start.Routing.ClusterHeader {
		t.Errorf("tether's route reads the cluster from %q, want %q", h, start.Routing.ClusterHeader)
	}
	if h := tether.GetRoute().GetHashPolicy()[0].GetHeader().GetHeaderName(); h != start.Identity.SessionHeader {
		t.Errorf("first hash policy on %q, want %q, the session header tether still reads", h, start.Identity.SessionHeader)
	}
	for _, key := range []string{"routing.cluster_header", "identity.session_header"} {
		if !strings.Contains(logs.String(), `"key":"`+key+`"`) {
			t.Errorf("no restart-only warning naming %s:\n%s", key, logs)
		}
	}

	// Valid as a file, but not with the header tether still routes on: a
	// rule on it would never match, since Envoy strips it from requests.
	clash := next
	clash.Routing.Rules = []config.Rule{{Name: "old-header", Header: start.Routing.ClusterHeader, Mode: config.ModeRandom}}
	if err := clash.Validate(); err != nil {
		t.Fatalf("test setup: the file itself should validate: %v", err)
	}
	_, err := rt.Apply(ctx, clash, "file")
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "routing.rules[0].header") ||
		!strings.Contains(err.Error(), "until a restart") {
		t.Errorf("apply of a rule on the running cluster header: %v, want refused naming routing.rules[0].header", err)
	}
	if n := testutil.ToFloat64(rt.reloads.WithLabelValues("file", "invalid")); n != 1 {
		t.Errorf("invalid count %v, want 1", n)
	}
}

// TestApplyExtProcEndpoints: envoy.extproc_endpoints is live: the
// replicas Envoy is told to call follow an edit, and an empty list means
// this replica alone.
func TestApplyExtProcEndpoints(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	reg := prometheus.NewRegistry()
	ads, addr := startADS(ctx, t, reg)
	rt := New("127.0.0.1:50051", ads, zerolog.Nop(), reg)
	replicas := func() []string {
		t.Helper()
		var out []string
		for _, a := range served(t, ads, addr, resource.EndpointType) {
			var cla endpointv3.ClusterLoadAssignment
			if err := a.UnmarshalTo(&cla); err != nil {
				t.Fatal(err)
			}
			if cla.GetClusterName() != xds.ExtProcCluster {
				continue
			}
			for _, le := range cla.GetEndpoints() {
				for _, e := range le.GetLbEndpoints() {
					sa := e.GetEndpoint().GetAddress().GetSocketAddress()
					out = append(out, net.JoinHostPort(sa.GetAddress(), fmt.Sprint(sa.GetPortValue())))
				}
			}
		}
		return out
	}
	cfg := fleetConfig("a")
	for _, tc := range []struct {
		endpoints, want []string
	}{
		{nil, []string{"127.0.0.1:50051"}},
		{[]string{"10.0.0.7:50051", "10.0.0.8:50051"}, []string{"10.0.0.7:50051", "10.0.0.8:50051"}},
		{nil, []string{"127.0.0.1:50051"}},
	} {
		cfg.Envoy.ExtProcEndpoints = tc.endpoints
		if _, err := rt.Apply(ctx, cfg, "file"); err != nil {
			t.Fatal(err)
		}
		if got := replicas(); !slices.Equal(got, tc.want) {
			t.Errorf("extproc_endpoints %v: Envoy is told to call %v, want %v", tc.endpoints, got, tc.want)
		}
	}
}

// TestRestartOnlyWarned: a change to a restart-only section alone (nothing
// Envoy or the decision sees) is logged with the section's name, once; a
// return to the running value is not.
func TestRestartOnlyWarned(t *testing.T) {
	withTLS := func(c *config.Config) {
		c.TLS = config.TLS{CertFile: "/t.crt", KeyFile: "/t.key", MinVersion: "1.2", Envoy: config.EnvoyTLS{
			CAFile: "/envoy/ca.crt", CertFile: "/envoy/client.crt", KeyFile: "/envoy/client.key",
		}}
	}
	for _, tc := range []struct {
		key  string
		edit func(*config.Config)
	}{
		{"server.log_level", func(c *config.Config) { c.Server.LogLevel = "debug" }},
		{"audit.sample_rate", func(c *config.Config) { c.Audit.SampleRate = 0.5 }},
		{"tls.client_ca_file", func(c *config.Config) { c.TLS.ClientCAFile = "/ca.crt" }},
		{"tls.min_version", func(c *config.Config) { c.TLS.MinVersion = "1.3" }},
	} {
		t.Run(tc.key, func(t *testing.T) {
			ctx := context.Background()
			logs := &syncbuf.Buffer{}
			reg := prometheus.NewRegistry()
			rt := New("127.0.0.1:50051", nil, zerolog.New(logs), reg)
			start := fleetConfig("a", "b")
			withTLS(&start)
			if err := start.Validate(); err != nil {
				t.Fatal(err)
			}
			if _, err := rt.Apply(ctx, start, "start"); err != nil {
				t.Fatal(err)
			}
			next := fleetConfig("a", "b")
			withTLS(&next)
			tc.edit(&next)
			if err := next.Validate(); err != nil {
				t.Fatal(err)
			}
			warned := func() int {
				n := 0
				for l := range strings.SplitSeq(logs.String(), "\n") {
					if strings.Contains(l, "only after a restart") && strings.Contains(l, `"key":"`+tc.key+`"`) {
						n++
					}
				}
				return n
			}
			for i := range 2 {
				if _, err := rt.Apply(ctx, next, "file"); err != nil {
					t.Fatal(err)
				}
				if n := warned(); n != 1 {
					t.Fatalf("apply %d: %d warnings naming %s, want 1:\n%s", i+1, n, tc.key, logs)
				}
			}
			if n := testutil.ToFloat64(rt.reloads.WithLabelValues("file", "unchanged")); n != 2 {
				t.Errorf("unchanged count %v, want 2", n)
			}
			if _, err := rt.Apply(ctx, start, "file"); err != nil {
				t.Fatal(err)
			}
			if n := warned(); n != 1 {
				t.Errorf("back to the running value: %d warnings, want still 1:\n%s", n, logs)
			}
		})
	}
}
