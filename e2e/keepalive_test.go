//go:build e2e

package e2e

import (
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	upstreamhttpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/tetherproxy/tether/internal/testenv"
	"github.com/tetherproxy/tether/xds"
)

// TestEnvoyKeepalivePingsAccepted: Envoy set to ping its ext_proc
// connections (connection_keepalive, here every 5 s: as often as tether
// allows) keeps them while they sit idle between requests. gRPC's default
// enforcement policy strikes every ping after the first on a connection
// without a stream and, at the third strike (the fourth ping), closes it
// with GOAWAY "too_many_pings"; tether's (server/grpc.go) accepts a ping
// every 5 s, with or without a stream. Envoy counts its next interval from
// the acknowledgement, so its pings reach tether at least 5 s apart.
func TestEnvoyKeepalivePingsAccepted(t *testing.T) {
	if testing.Short() {
		t.Skip("waits through four keepalive intervals")
	}
	const interval = 5 * time.Second
	rds := testenv.RedisServer(t)
	inst := startFleet(t, 2)
	cfg := baseConfig(rds.URL(), inst)
	tt := startTether(t, cfg)
	cfg.Envoy.ListenerAddr = "127.0.0.1:0"
	b, err := staticBootstrap(cfg, []string{tt.extproc})
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, c := range b.GetStaticResources().GetClusters() {
		if c.GetName() != xds.ExtProcCluster {
			continue
		}
		const key = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
		var po upstreamhttpv3.HttpProtocolOptions
		if err := c.GetTypedExtensionProtocolOptions()[key].UnmarshalTo(&po); err != nil {
			t.Fatal(err)
		}
		h2 := po.GetExplicitHttpConfig().GetHttp2ProtocolOptions()
		if h2 == nil {
			t.Fatalf("cluster %s speaks no HTTP/2", c.GetName())
		}
		h2.ConnectionKeepalive = &corev3.KeepaliveSettings{
			Interval: durationpb.New(interval), Timeout: durationpb.New(2 * time.Second),
			IntervalJitter: &typev3.Percent{Value: 0},
		}
		a, err := anypb.New(&po)
		if err != nil {
			t.Fatal(err)
		}
		c.TypedExtensionProtocolOptions[key] = a
		found = true
	}
	if !found {
		t.Fatalf("no cluster %s in the bootstrap", xds.ExtProcCluster)
	}
	px := runEnvoy(t, b)

	caller := map[string]string{"x-session-id": "keepalive-1"}
	if a := chat(t, px, caller); a.status != 200 || a.instance != a.tethered {
		t.Fatalf("first request: %+v", a)
	}
	opened := px.stat(t, "cluster."+xds.ExtProcCluster+".upstream_cx_total")
	// Idle through four pings, polling for a closed connection.
	deadline := time.Now().Add(4*interval + 3*time.Second)
	for time.Now().Before(deadline) {
		// A GOAWAY counts in close_notify; Envoy then closes the
		// connection itself (destroy_local).
		if n := px.stat(t, "cluster."+xds.ExtProcCluster+".upstream_cx_close_notify"); n != 0 {
			t.Fatalf("tether sent GOAWAY on %d of Envoy's ext_proc connections while Envoy pinged them", n)
		}
		if n := px.stat(t, "cluster."+xds.ExtProcCluster+".upstream_cx_destroy"); n != 0 {
			t.Fatalf("%d of Envoy's ext_proc connections closed while Envoy pinged them", n)
		}
		time.Sleep(500 * time.Millisecond) // polling Envoy's stats, not waiting for an event
	}
	if n := px.stat(t, "cluster."+xds.ExtProcCluster+".upstream_cx_total"); n != opened {
		t.Errorf("ext_proc connections opened: %d after the idle spell, %d before", n, opened)
	}
	if a := chat(t, px, caller); a.status != 200 || a.instance != a.tethered || a.decision != "hit" {
		t.Fatalf("request after the idle spell: %+v", a)
	}
}
