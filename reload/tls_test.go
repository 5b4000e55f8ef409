package reload

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/syncbuf"
	"github.com/tetherproxy/tether/internal/testenv"
)

// pkiFixture: a CA and tether's server certificate (127.0.0.1) from it, in
// files under a temporary directory.
type pkiFixture struct {
	ca                         *testenv.CA
	serverCert, serverKey, cas string // files
}

func newPKI(t *testing.T) *pkiFixture {
	t.Helper()
	now := time.Now()
	dir := t.TempDir()
	f := &pkiFixture{ca: testenv.NewCA(t, "tether test CA")}
	c, k := f.ca.Issue(t, "tether.test", true, now.Add(-time.Hour), now.Add(24*time.Hour))
	f.serverCert, f.serverKey = testenv.WritePair(t, dir, "tls", c, k)
	f.cas = testenv.WriteFile(t, filepath.Join(dir, "ca.crt"), f.ca.PEM)
	return f
}

// tls is [tls] on f's files, mutual TLS when mutual.
func (f *pkiFixture) tls(mutual bool) config.TLS {
	t := config.TLS{CertFile: f.serverCert, KeyFile: f.serverKey, MinVersion: config.DefaultTLSMinVersion,
		Envoy: config.EnvoyTLS{CAFile: "/envoy/ca.crt"}}
	if mutual {
		t.ClientCAFile = f.cas
		t.Envoy.CertFile, t.Envoy.KeyFile = "/envoy/client.crt", "/envoy/client.key"
	}
	return t
}

// touch moves the files' modification time a second on, so that a
// rewrite shows on file systems with coarse times.
func touch(t *testing.T, paths ...string) {
	t.Helper()
	for _, p := range paths {
		fi, err := os.Stat(p)
		if err == nil {
			mt := fi.ModTime().Add(time.Second)
			err = os.Chtimes(p, mt, mt)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}

// TestCertificateReload: new files are served without a restart; files
// that cannot be used leave the previous certificate in force.
func TestCertificateReload(t *testing.T) {
	f := newPKI(t)
	now := time.Now()
	clock := now
	logs := &syncbuf.Buffer{}
	src, err := newCertSource(f.tls(true), zerolog.New(logs), func() time.Time { return clock })
	if err != nil {
		t.Fatal(err)
	}
	first := src.config().Certificates[0].Leaf.SerialNumber

	// Renewed: both files replaced (mtimes moved on so the change shows on
	// coarse file systems).
	c, k := f.ca.Issue(t, "tether.test", true, now.Add(-time.Hour), now.Add(48*time.Hour))
	testenv.WriteFile(t, f.serverKey, k)
	testenv.WriteFile(t, f.serverCert, c)
	touch(t, f.serverCert, f.serverKey)
	if got := src.config().Certificates[0].Leaf.SerialNumber; got.Cmp(first) != 0 {
		t.Fatal("files looked at again before the check interval passed")
	}
	clock = clock.Add(2 * reloadCheck)
	second := src.config().Certificates[0].Leaf
	if second.SerialNumber.Cmp(first) == 0 || !second.NotAfter.Equal(now.Add(48*time.Hour).Truncate(time.Second)) {
		t.Fatalf("not reloaded: serial %v (first %v), not after %v", second.SerialNumber, first, second.NotAfter)
	}
	if got := src.notAfter(); !got.Equal(second.NotAfter) {
		t.Errorf("expiry gauge source %v, want %v", got, second.NotAfter)
	}

	// Half a rotation (the certificate without its key): refused, the
	// previous pair stays.
	c, _ = f.ca.Issue(t, "tether.test", true, now.Add(-time.Hour), now.Add(72*time.Hour))
	testenv.WriteFile(t, f.serverCert, c)
	touch(t, f.serverCert)
	clock = clock.Add(2 * reloadCheck)
	if got := src.config().Certificates[0].Leaf.SerialNumber; got.Cmp(second.SerialNumber) != 0 {
		t.Fatal("a certificate without its key was installed")
	}
	if !strings.Contains(logs.String(), "serving the previous certificate") || !strings.Contains(logs.String(), "not the key of tls.cert_file") {
		t.Errorf("refusal not logged:\n%s", logs)
	}
	if n := counterValue(t, src.reloads, "refused"); n != 1 {
		t.Errorf("refused reloads = %v, want 1", n)
	}
	if n := counterValue(t, src.reloads, "applied"); n != 1 {
		t.Errorf("applied reloads = %v, want 1", n)
	}
}

// TestExpiryGaugeReloads: the expiry gauge looks at the files itself (at
// most once per check interval), so a renewed certificate shows on
// /metrics without any handshake.
func TestExpiryGaugeReloads(t *testing.T) {
	f := newPKI(t)
	reg := prometheus.NewRegistry()
	if _, err := GRPCCredentials(f.tls(false), zerolog.Nop(), reg); err != nil {
		t.Fatal(err)
	}
	gauge := func() float64 {
		t.Helper()
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == "tether_tls_certificate_expiry_timestamp_seconds" {
				return mf.GetMetric()[0].GetGauge().GetValue()
			}
		}
		t.Fatal("no expiry gauge")
		return 0
	}
	now := time.Now()
	renewed := now.Add(72 * time.Hour).Truncate(time.Second)
	if gauge() == float64(renewed.Unix()) {
		t.Fatal("the first certificate already expires then")
	}
	c, k := f.ca.Issue(t, "tether.test", true, now.Add(-time.Hour), renewed)
	testenv.WriteFile(t, f.serverKey, k)
	testenv.WriteFile(t, f.serverCert, c)
	touch(t, f.serverCert, f.serverKey)
	deadline := time.Now().Add(10 * time.Second)
	for gauge() != float64(renewed.Unix()) {
		if time.Now().After(deadline) {
			t.Fatalf("gauge %v 10s after the renewal, want %v", gauge(), float64(renewed.Unix()))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func counterValue(t *testing.T, c *prometheus.CounterVec, label string) float64 {
	t.Helper()
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			if m.GetLabel()[0].GetValue() == label {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}
