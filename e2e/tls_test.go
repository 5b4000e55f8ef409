//go:build e2e

package e2e

import (
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/syncbuf"
	"github.com/tetherproxy/tether/internal/testenv"
	"github.com/tetherproxy/tether/plan"
	"github.com/tetherproxy/tether/xds"
)

// tlsSNI is the name in tether's certificate that Envoy asks for and checks.
const tlsSNI = "tether.e2e.test"

// mtlsConfig is baseConfig with tether's gRPC servers on mutual TLS: a CA
// signs tether's certificate (tlsSNI and 127.0.0.1) and Envoy's client
// certificate, all written to the test's temp dir. With strangerEnvoy,
// Envoy's certificate comes from another CA instead.
func mtlsConfig(t *testing.T, inst []config.Instance, strangerEnvoy bool) config.Config {
	t.Helper()
	dir := t.TempDir()
	now := time.Now()
	ca := testenv.NewCA(t, "tether-ca")
	caFile := testenv.WriteFile(t, filepath.Join(dir, "tether-ca.crt"), ca.PEM)
	cert, key := tetherCert(t, ca, dir)
	signer := ca
	if strangerEnvoy {
		signer = testenv.NewCA(t, "other-ca")
	}
	c, k := signer.Issue(t, "envoy", false, now.Add(-time.Hour), now.Add(24*time.Hour))
	ecert, ekey := testenv.WritePair(t, dir, "envoy", c, k)
	cfg := baseConfig("embedded", inst)
	cfg.TLS = config.TLS{
		CertFile: cert, KeyFile: key, ClientCAFile: caFile, MinVersion: "1.2",
		Envoy: config.EnvoyTLS{CertFile: ecert, KeyFile: ekey, CAFile: caFile, SNI: tlsSNI},
	}
	return cfg
}

// tetherCert issues tether's server certificate (tlsSNI, 127.0.0.1) from
// ca, writes it and its key to dir, and returns the two paths.
func tetherCert(t *testing.T, ca *testenv.CA, dir string) (cert, key string) {
	t.Helper()
	now := time.Now()
	c, k := ca.Issue(t, tlsSNI, true, now.Add(-time.Hour), now.Add(24*time.Hour))
	return testenv.WritePair(t, dir, "tether", c, k)
}

// sticks sends n requests of one session and checks tether decided each
// and Envoy kept them on one instance.
func sticks(t *testing.T, px *proxy, session string, n int) {
	t.Helper()
	var first string
	for i := 0; i < n; i++ {
		a := chat(t, px, map[string]string{"x-session-id": session})
		if a.status != 200 || a.decision == "" {
			t.Fatalf("request %d of %s: %+v, want 200 with x-tether-decision", i, session, a)
		}
		if i == 0 {
			first = a.instance
		} else if a.instance != first || a.decision != "hit" {
			t.Fatalf("request %d of %s: %+v, want a hit on %s", i, session, a, first)
		}
	}
}

// TestTLSEnvoyExtProcMutual: Envoy, on the static bootstrap tether's
// builder makes, calls ext_proc over mutual TLS with its client
// certificate, checking tether's certificate and name; tether decides and
// sessions stick.
func TestTLSEnvoyExtProcMutual(t *testing.T) {
	cfg := mtlsConfig(t, startFleet(t, 4), false)
	tt := startTether(t, cfg)
	px := startEnvoy(t, cfg, tt.extproc)
	for s := 0; s < 3; s++ {
		sticks(t, px, fmt.Sprintf("tls-session-%d", s), 5)
	}
	if n := px.stat(t, "cluster.tether-extproc.ssl.handshake"); n == 0 {
		t.Error("no TLS handshake on the tether-extproc cluster")
	}
	if n := px.stat(t, "cluster.tether-extproc.ssl.connection_error"); n != 0 {
		t.Errorf("%d TLS connection errors on the tether-extproc cluster", n)
	}
	if got := tt.metric(t, "tether_requests_total"); got < 15 {
		t.Errorf("tether decided %v requests, want 15", got)
	}
}

// TestTLSEnvoyOverADS: Envoy fetches its whole configuration over mutual
// TLS ADS, and the tether-extproc cluster it gets speaks mutual TLS too.
func TestTLSEnvoyOverADS(t *testing.T) {
	cfg := mtlsConfig(t, startFleet(t, 4), false)
	tt := startTether(t, cfg)
	b, err := xds.ADSBootstrap("e2e-tls", "127.0.0.1:0", tt.xds, envoyTLS(t, cfg))
	if err != nil {
		t.Fatal(err)
	}
	px := runEnvoy(t, b)
	sticks(t, px, "ads-tls-session", 5)
	for _, c := range []string{xds.ADSCluster, xds.ExtProcCluster} {
		if n := px.stat(t, "cluster."+c+".ssl.handshake"); n == 0 {
			t.Errorf("no TLS handshake on %s", c)
		}
	}
	st := tt.xdsState(t)
	if len(st.Nodes) != 1 || st.Nodes[0].ID != "e2e-tls" || len(st.Nodes[0].Acked) < 4 {
		t.Fatalf("xds state: %+v", st)
	}
}

// TestTLSMinVersion13: with min_version = "1.3", Envoy still reaches
// tether over mutual TLS, on the static bootstrap and over ADS, and speaks
// TLS 1.3 to it. Envoy's upstream default maximum is TLS 1.2, so the
// generated transport socket must raise it.
func TestTLSMinVersion13(t *testing.T) {
	for _, tc := range []struct {
		name     string
		clusters []string
		envoy    func(t *testing.T, cfg config.Config, tt *tether) *proxy
	}{
		{name: "static", clusters: []string{xds.ExtProcCluster}, envoy: func(t *testing.T, cfg config.Config, tt *tether) *proxy {
			return startEnvoy(t, cfg, tt.extproc)
		}},
		{name: "ADS", clusters: []string{xds.ADSCluster, xds.ExtProcCluster}, envoy: func(t *testing.T, cfg config.Config, tt *tether) *proxy {
			b, err := xds.ADSBootstrap("e2e-tls13", "127.0.0.1:0", tt.xds, envoyTLS(t, cfg))
			if err != nil {
				t.Fatal(err)
			}
			return runEnvoy(t, b)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := mtlsConfig(t, startFleet(t, 2), false)
			cfg.TLS.MinVersion = "1.3"
			tt := startTether(t, cfg)
			px := tc.envoy(t, cfg, tt)
			sticks(t, px, "tls13-session", 5)
			for _, c := range tc.clusters {
				if n := px.stat(t, "cluster."+c+".ssl.versions.TLSv1.3"); n == 0 {
					t.Errorf("no TLS 1.3 connection on %s", c)
				}
				if n := px.stat(t, "cluster."+c+".ssl.connection_error"); n != 0 {
					t.Errorf("%d TLS connection errors on %s", n, c)
				}
			}
			if got := tt.metric(t, "tether_requests_total"); got < 5 {
				t.Errorf("tether decided %v requests, want 5", got)
			}
		})
	}
}

// TestTLSEnvoyFromAnotherCA: tether refuses an Envoy whose client
// certificate another CA signed. Requests still flow (failure_mode_allow,
// the default route), but tether decides none: no x-tether-decision,
// tether counts no request, and Envoy counts failed TLS connections and a
// failed health check on the tether-extproc cluster.
func TestTLSEnvoyFromAnotherCA(t *testing.T) {
	cfg := mtlsConfig(t, startFleet(t, 4), true)
	tt := startTether(t, cfg)
	px := startEnvoy(t, cfg, tt.extproc)
	for i := 0; i < 5; i++ {
		a := chat(t, px, map[string]string{"x-session-id": "refused"})
		if a.status != 200 || a.decision != "" || a.tethered != "" {
			t.Fatalf("request %d: %+v, want 200 on the default route without tether", i, a)
		}
	}
	waitFor(t, 10*time.Second, "Envoy to count a failed health check of tether", func() bool {
		return px.stat(t, "cluster.tether-extproc.health_check.failure") > 0
	})
	stats := map[string]int{}
	for _, s := range []string{"ssl.handshake", "ssl.connection_error", "upstream_cx_total", "health_check.failure"} {
		stats[s] = px.stat(t, "cluster.tether-extproc."+s)
	}
	t.Logf("Envoy's tether-extproc cluster: %v", stats)
	if stats["ssl.connection_error"] == 0 {
		t.Error("Envoy counts no failed TLS connection to tether")
	}
	if got := tt.metric(t, "tether_requests_total"); got != 0 {
		t.Errorf("tether decided %v requests for a refused Envoy", got)
	}
}

// TestTLSADSFromAnotherCA: an Envoy whose client certificate another CA
// signed gets no configuration: tether lists no node, and Envoy counts the
// refused connections on its ADS cluster.
func TestTLSADSFromAnotherCA(t *testing.T) {
	cfg := mtlsConfig(t, startFleet(t, 2), true)
	tt := startTether(t, cfg)
	b, err := xds.ADSBootstrap("e2e-tls-refused", "127.0.0.1:0", tt.xds, envoyTLS(t, cfg))
	if err != nil {
		t.Fatal(err)
	}
	logs := &syncbuf.Buffer{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("envoy logs:\n%s", logs)
		}
	})
	p := launchEnvoy(t, b, logs)
	px := &proxy{admin: p.Admin}
	waitFor(t, 20*time.Second, "Envoy to count a refused ADS connection", func() bool {
		return px.stat(t, "cluster."+xds.ADSCluster+".ssl.connection_error") > 0
	})
	t.Logf("Envoy's %s cluster: ssl.handshake %d, ssl.connection_error %d, upstream_cx_total %d", xds.ADSCluster,
		px.stat(t, "cluster."+xds.ADSCluster+".ssl.handshake"), px.stat(t, "cluster."+xds.ADSCluster+".ssl.connection_error"),
		px.stat(t, "cluster."+xds.ADSCluster+".upstream_cx_total"))
	if n := px.stat(t, "control_plane.connected_state"); n != 0 {
		t.Errorf("control_plane.connected_state = %d, want 0", n)
	}
	if st := tt.xdsState(t); len(st.Nodes) != 0 {
		t.Errorf("tether serves a refused Envoy: %+v", st.Nodes)
	}
}

// envoyTLS makes a bootstrap's ADS cluster reach tether as cfg's [tls]
// and [tls.envoy] say.
func envoyTLS(t *testing.T, cfg config.Config) xds.BootstrapOption {
	t.Helper()
	p, err := plan.FromConfig(cfg, plan.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return xds.WithTLS(p.Envoy.TLS)
}
