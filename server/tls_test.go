package server

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/syncbuf"
	"github.com/tetherproxy/tether/internal/testenv"
)

// pkiFixture: a CA, tether's server certificate (127.0.0.1), a client
// certificate from the CA and one from another CA, in files under a
// temporary directory.
type pkiFixture struct {
	dir                        string
	ca, other                  *testenv.CA
	serverCert, serverKey, cas string // files
	client, stranger           tls.Certificate
}

func newPKI(t *testing.T) *pkiFixture {
	t.Helper()
	now := time.Now()
	f := &pkiFixture{dir: t.TempDir(), ca: testenv.NewCA(t, "tether test CA"), other: testenv.NewCA(t, "another CA")}
	c, k := f.ca.Issue(t, "tether.test", true, now.Add(-time.Hour), now.Add(24*time.Hour))
	f.serverCert, f.serverKey = testenv.WritePair(t, f.dir, "tls", c, k)
	f.cas = testenv.WriteFile(t, filepath.Join(f.dir, "ca.crt"), f.ca.PEM)
	var err error
	if f.client, err = tls.X509KeyPair(f.ca.Issue(t, "envoy.test", false, now.Add(-time.Hour), now.Add(24*time.Hour))); err != nil {
		t.Fatal(err)
	}
	if f.stranger, err = tls.X509KeyPair(f.other.Issue(t, "envoy.test", false, now.Add(-time.Hour), now.Add(24*time.Hour))); err != nil {
		t.Fatal(err)
	}
	return f
}

// config is testConfig with [tls] on f's files, mutual TLS when mutual.
func (f *pkiFixture) config(mutual bool) config.Config {
	c := testConfig()
	c.TLS.CertFile, c.TLS.KeyFile = f.serverCert, f.serverKey
	c.TLS.Envoy.CAFile = "/envoy/ca.crt"
	if mutual {
		c.TLS.ClientCAFile = f.cas
		c.TLS.Envoy.CertFile, c.TLS.Envoy.KeyFile = "/envoy/client.crt", "/envoy/client.key"
	}
	return c
}

// clientTLS trusts f's CA and presents certs.
func (f *pkiFixture) clientTLS(certs ...tls.Certificate) *tls.Config {
	pool := x509.NewCertPool()
	pool.AddCert(f.ca.Cert)
	return &tls.Config{RootCAs: pool, Certificates: certs, MinVersion: tls.VersionTLS12}
}

// forcedTLS is clientTLS presenting cert whatever the server asks for.
func (f *pkiFixture) forcedTLS(cert tls.Certificate) *tls.Config {
	c := f.clientTLS()
	c.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &cert, nil }
	return c
}

// runLogged is run with every log line kept and the xDS address too.
func runLogged(t *testing.T, cfg config.Config) (addrs map[string]string, logs *syncbuf.Buffer, stop func() error) {
	t.Helper()
	logs = &syncbuf.Buffer{}
	ready := make(chan map[string]string, 1)
	w := writerFunc(func(p []byte) (int, error) {
		_, _ = logs.Write(p)
		var m map[string]any
		if json.Unmarshal(p, &m) == nil && m["message"] == "tether ready" {
			a := map[string]string{}
			for _, k := range []string{"extproc", "admin", "xds"} {
				a[k], _ = m[k].(string)
			}
			select {
			case ready <- a:
			default:
			}
		}
		return len(p), nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, cfg, Options{Logger: zerolog.New(w)}) }()
	select {
	case addrs = <-ready:
	case err := <-done:
		cancel()
		t.Fatalf("Run returned before ready: %v\n%s", err, logs)
	case <-time.After(10 * time.Second):
		cancel()
		_ = <-done
		t.Fatalf("not ready within 10s:\n%s", logs)
	}
	var stopped bool
	var result error
	stop = func() error {
		if !stopped {
			stopped = true
			cancel()
			select {
			case result = <-done:
			case <-time.After(15 * time.Second):
				t.Fatal("Run did not return within 15s of cancel")
			}
		}
		return result
	}
	t.Cleanup(func() { _ = stop() })
	return addrs, logs, stop
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

func dial(t *testing.T, addr string, creds credentials.TransportCredentials) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// exercise calls the health service and ext_proc on extproc and opens an
// ADS stream on xds; it returns the first error.
func exercise(t *testing.T, extproc, xds string, creds credentials.TransportCredentials) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn := dial(t, extproc, creds)
	// The server, and the services an endpoint picker answers for.
	for _, service := range []string{"", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"} {
		h, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: service})
		if err != nil {
			return err
		}
		if h.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("health of %q: %v", service, h.GetStatus())
		}
	}
	s, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		return err
	}
	hm := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: "x-session-id", RawValue: []byte("s")}}}
	if err := s.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: hm}}}); err != nil {
		return err
	}
	r, err := s.Recv()
	if err != nil {
		return err
	}
	if got := string(r.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders()[0].GetHeader().GetRawValue()); got != "inst-a" {
		t.Fatalf("ext_proc routed to %q", got)
	}
	_ = s.CloseSend()

	ads, err := discoveryv3.NewAggregatedDiscoveryServiceClient(dial(t, xds, creds)).StreamAggregatedResources(ctx)
	if err != nil {
		return err
	}
	if err := ads.Send(&discoveryv3.DiscoveryRequest{Node: &corev3.Node{Id: "tls-test"}, TypeUrl: resource.ClusterType}); err != nil {
		return err
	}
	resp, err := ads.Recv()
	if err != nil {
		return err
	}
	if len(resp.GetResources()) == 0 {
		t.Fatal("ADS over TLS: no clusters")
	}
	return nil
}

// TestMutualTLS: with [tls] and a client CA, ext_proc, the health service
// Envoy's checks use and ADS answer a client with a certificate from the
// CA, and refuse every other client.
func TestMutualTLS(t *testing.T) {
	f := newPKI(t)
	addrs, _, stop := runLogged(t, f.config(true))
	extproc, xds, admin := addrs["extproc"], addrs["xds"], addrs["admin"]

	if err := exercise(t, extproc, xds, credentials.NewTLS(f.clientTLS(f.client))); err != nil {
		t.Fatalf("a client with a valid certificate: %v", err)
	}
	for _, tc := range []struct {
		name  string
		creds credentials.TransportCredentials
	}{
		{"no client certificate", credentials.NewTLS(f.clientTLS())},
		// Sent whatever CAs tether asks for, as Envoy does (Go's client
		// would otherwise send no certificate at all).
		{"a certificate from another CA", credentials.NewTLS(f.forcedTLS(f.stranger))},
		{"plaintext", insecure.NewCredentials()},
		{"a client that does not trust tether's CA", credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{f.client}})},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := exercise(t, extproc, xds, tc.creds)
			if status.Code(err) != codes.Unavailable {
				t.Fatalf("err = %v, want Unavailable (refused at the handshake)", err)
			}
			t.Logf("refused: %v", err)
		})
	}
	// The ADS server alone refuses a client without a certificate too.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ads, err := discoveryv3.NewAggregatedDiscoveryServiceClient(dial(t, xds, credentials.NewTLS(f.clientTLS()))).StreamAggregatedResources(ctx)
	if err == nil {
		_ = ads.Send(&discoveryv3.DiscoveryRequest{TypeUrl: resource.ClusterType})
		_, err = ads.Recv()
	}
	if status.Code(err) != codes.Unavailable {
		t.Errorf("ADS without a client certificate: %v", err)
	}
	if code, body := get(t, "http://"+admin+"/metrics"); code != 200 || !strings.Contains(body, "tether_tls_certificate_expiry_timestamp_seconds") {
		t.Errorf("/metrics: %d, no certificate expiry gauge", code)
	}
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
}

// TestServerTLSWithoutClientCA: TLS alone takes any client that trusts
// tether's certificate, and still refuses plaintext.
func TestServerTLSWithoutClientCA(t *testing.T) {
	f := newPKI(t)
	addrs, _, _ := runLogged(t, f.config(false))
	if err := exercise(t, addrs["extproc"], addrs["xds"], credentials.NewTLS(f.clientTLS())); err != nil {
		t.Fatalf("TLS client without a certificate: %v", err)
	}
	if err := exercise(t, addrs["extproc"], addrs["xds"], insecure.NewCredentials()); status.Code(err) != codes.Unavailable {
		t.Fatalf("plaintext: %v, want Unavailable", err)
	}
}

// TestTLSStartRefuses: tether does not start on files it cannot serve
// with, and says which key, which file and why.
func TestTLSStartRefuses(t *testing.T) {
	f := newPKI(t)
	now := time.Now()
	past := time.Date(2020, 1, 1, 0, 0, 0, 0, time.UTC)
	oldCert, oldKey := f.ca.Issue(t, "tether.test", true, past, past.AddDate(1, 0, 0))
	soonCert, soonKey := f.ca.Issue(t, "tether.test", true, now.Add(48*time.Hour), now.Add(96*time.Hour))
	_, otherKey := f.ca.Issue(t, "tether.test", true, now.Add(-time.Hour), now.Add(time.Hour))
	leaf, _ := f.ca.Issue(t, "envoy.test", false, now.Add(-time.Hour), now.Add(time.Hour))
	file := func(name string, data []byte) string { return testenv.WriteFile(t, filepath.Join(f.dir, name), data) }
	for _, tc := range []struct {
		name string
		edit func(*config.TLS)
		want []string
	}{
		{"expired certificate", func(c *config.TLS) {
			c.CertFile, c.KeyFile = file("old.crt", oldCert), file("old.key", oldKey)
		}, []string{"tls.cert_file", "old.crt", "expired on 2021-01-01T00:00:00Z", "valid from 2020-01-01T00:00:00Z to 2021-01-01T00:00:00Z"}},
		{"certificate not yet valid", func(c *config.TLS) {
			c.CertFile, c.KeyFile = file("soon.crt", soonCert), file("soon.key", soonKey)
		}, []string{"tls.cert_file", "soon.crt", "not valid until"}},
		{"key of another certificate", func(c *config.TLS) { c.KeyFile = file("other.key", otherKey) },
			[]string{"tls.key_file", "other.key", "not the key of tls.cert_file", "private key does not match public key"}},
		{"client CA file holds a client's certificate", func(c *config.TLS) { c.ClientCAFile = file("leaf.crt", leaf) },
			[]string{"tls.client_ca_file", "leaf.crt", "not a CA certificate"}},
		{"client CA file without certificates", func(c *config.TLS) { c.ClientCAFile = file("empty.crt", []byte("\n")) },
			[]string{"tls.client_ca_file", "empty.crt", "no PEM certificate"}},
		{"unreadable key", func(c *config.TLS) { c.KeyFile = filepath.Join(f.dir, "missing.key") },
			[]string{"tls.key_file", "missing.key", "no such file"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := f.config(true)
			tc.edit(&cfg.TLS)
			err := Run(context.Background(), cfg, Options{Logger: zerolog.Nop()})
			if err == nil {
				t.Fatal("Run started")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
}

// TestCertificateReloadThroughRun: a client connecting after the files
// changed sees the new certificate, on the same running tether.
func TestCertificateReloadThroughRun(t *testing.T) {
	f := newPKI(t)
	addrs, _, _ := runLogged(t, f.config(true))
	peer := func() *x509.Certificate {
		t.Helper()
		cfg := f.clientTLS(f.client)
		cfg.NextProtos, cfg.ServerName = []string{"h2"}, "127.0.0.1"
		conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addrs["extproc"], cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		return conn.ConnectionState().PeerCertificates[0]
	}
	first := peer().SerialNumber
	now := time.Now()
	c, k := f.ca.Issue(t, "tether.test", true, now.Add(-time.Hour), now.Add(48*time.Hour))
	testenv.WriteFile(t, f.serverKey, k)
	testenv.WriteFile(t, f.serverCert, c)
	touch(t, f.serverCert, f.serverKey)
	deadline := time.Now().Add(10 * time.Second)
	for peer().SerialNumber.Cmp(first) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the renewed certificate was not served within 10s")
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// touch moves the files' modification time forward a second.
func touch(t *testing.T, paths ...string) {
	t.Helper()
	for _, p := range paths {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		mt := fi.ModTime().Add(time.Second)
		if err := os.Chtimes(p, mt, mt); err != nil {
			t.Fatal(err)
		}
	}
}

const adminToken = "tok-3f9a1c2e7b5d4a60-admin"

func request(t *testing.T, method, url, auth string) (int, http.Header, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	c := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var b strings.Builder
	buf := make([]byte, 4096)
	for {
		n, err := resp.Body.Read(buf)
		b.Write(buf[:n])
		if err != nil {
			break
		}
	}
	return resp.StatusCode, resp.Header, b.String()
}

// TestAdminToken: with a token, the admin API answers only a request that
// carries it, except the probes; the token never reaches the logs.
func TestAdminToken(t *testing.T) {
	for _, from := range []string{"env", "file"} {
		t.Run(from, func(t *testing.T) {
			cfg := testConfig()
			cfg.Server.AdminTokenEnv = "TETHER_TEST_ADMIN_TOKEN"
			if from == "env" {
				t.Setenv("TETHER_TEST_ADMIN_TOKEN", adminToken)
			} else {
				t.Setenv("TETHER_TEST_ADMIN_TOKEN", "")
				cfg.Server.AdminTokenFile = testenv.WriteFile(t, filepath.Join(t.TempDir(), "token"), []byte(adminToken+"\n"))
			}
			addrs, logs, stop := runLogged(t, cfg)
			base := "http://" + addrs["admin"]
			for _, tc := range []struct {
				method, path, auth string
				want               int
			}{
				{"GET", "/healthz", "", 200},
				{"GET", "/readyz", "", 200},
				{"GET", "/metrics", "", 401},
				{"GET", "/metrics", "Bearer wrong-token-0123456789", 401},
				{"GET", "/metrics", "Basic " + adminToken, 401},
				{"GET", "/metrics", adminToken, 401},
				{"GET", "/metrics", "Bearer " + adminToken + "x", 401},
				{"GET", "/metrics", "Bearer " + adminToken, 200},
				{"GET", "/metrics", "bearer " + adminToken, 200},
				{"GET", "/v1/instances", "", 401},
				{"GET", "/v1/instances", "Bearer " + adminToken, 200},
				{"DELETE", "/v1/instances/a", "", 401},
				{"GET", "/v1/xds", "", 401},
				{"GET", "/healthz/../metrics", "", 401},
				{"GET", "/nowhere", "", 401},
			} {
				code, h, body := request(t, tc.method, base+tc.path, tc.auth)
				if code != tc.want {
					t.Errorf("%s %s (auth %q): %d, want %d: %s", tc.method, tc.path, tc.auth, code, tc.want, body)
				}
				if code == 401 && !strings.HasPrefix(h.Get("WWW-Authenticate"), "Bearer") {
					t.Errorf("%s %s: 401 without WWW-Authenticate: Bearer", tc.method, tc.path)
				}
				if strings.Contains(body, adminToken) {
					t.Errorf("%s %s: the body shows the token", tc.method, tc.path)
				}
			}
			if err := stop(); err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(logs.String(), "requires a bearer token") {
				t.Errorf("no log line says the token is on:\n%s", logs)
			}
			if strings.Contains(logs.String(), adminToken) {
				t.Errorf("the token is in the logs:\n%s", logs)
			}
		})
	}
}

// TestAdminTokenRefusesWeak: a token tether cannot use stops the start,
// without showing it.
func TestAdminTokenRefusesWeak(t *testing.T) {
	cfg := testConfig()
	cfg.Server.AdminTokenEnv = "TETHER_TEST_ADMIN_TOKEN"
	t.Setenv("TETHER_TEST_ADMIN_TOKEN", "tiny-tok")
	err := Run(context.Background(), cfg, Options{Logger: zerolog.Nop()})
	if err == nil || !strings.Contains(err.Error(), "$TETHER_TEST_ADMIN_TOKEN") || strings.Contains(err.Error(), "tiny-tok") {
		t.Fatalf("Run: %v", err)
	}
}

// TestTLSWithoutADSStarts: the Istio setup, the ADS server off and tether
// on mutual TLS with no [tls.envoy] (the mesh configures Envoy's side),
// passes config.Load and starts: ext_proc answers over mutual TLS, and
// the log says Envoy's TLS is not generated.
func TestTLSWithoutADSStarts(t *testing.T) {
	f := newPKI(t)
	path := testenv.WriteFile(t, filepath.Join(f.dir, "tether.toml"), fmt.Appendf(nil, `
[server]
extproc_addr = "127.0.0.1:0"
admin_addr = "127.0.0.1:0"
[xds]
addr = ""
[tls]
cert_file = %q
key_file = %q
client_ca_file = %q
[[instances]]
name = "a"
address = "127.0.0.1:1"
`, f.serverCert, f.serverKey, f.cas))
	cfg, err := config.Load(path)
	if err != nil {
		t.Fatalf("config validate would refuse it: %v", err)
	}
	addrs, logs, stop := runLogged(t, cfg)
	if addrs["xds"] != "" {
		t.Fatalf("ADS server on at %s", addrs["xds"])
	}
	conn := dial(t, addrs["extproc"], credentials.NewTLS(f.clientTLS(f.client)))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if h, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil || h.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health over mutual TLS: %v, %v", h, err)
	}
	if !strings.Contains(logs.String(), "tether generates no TLS for Envoy's side") {
		t.Errorf("no note that Envoy's TLS is not generated:\n%s", logs)
	}
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
}
