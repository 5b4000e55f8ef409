package config

import (
	"crypto/tls"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tetherproxy/tether/internal/testenv"
)

func TestTLSKeys(t *testing.T) {
	const on = "[tls]\ncert_file = \"/c.pem\"\nkey_file = \"/k.pem\"\n"
	const envoy = "[tls.envoy]\nca_file = \"/e/ca.pem\"\n"
	for _, tc := range []struct {
		name, toml string
		want       []string // empty: valid
	}{
		{"plaintext", "", nil},
		{"TLS, ADS off, no Envoy side", "[xds]\naddr = \"\"\n" + on, nil},
		{"mTLS, ADS off, no Envoy side", "[xds]\naddr = \"\"\n" + on + "client_ca_file = \"/ca.pem\"\n", nil},
		// Named at all, Envoy's side must be whole: xds.Build generates it.
		{"mTLS, ADS off, Envoy side without its certificate", "[xds]\naddr = \"\"\n" + on + "client_ca_file = \"/ca.pem\"\n" + envoy,
			[]string{"tls.envoy.cert_file", "client certificate", "none of it"}},
		{"TLS, ADS off, Envoy side without tether's CA", "[xds]\naddr = \"\"\n" + on + "[tls.envoy]\nsni = \"tether.svc\"\n",
			[]string{"tls.envoy.ca_file", "verify tether", "none of it"}},
		{"TLS with Envoy's CA", on + envoy, nil},
		{"mTLS with Envoy's client certificate", on + "client_ca_file = \"/ca.pem\"\n" + envoy + "cert_file = \"/e/c.pem\"\nkey_file = \"/e/k.pem\"\nsni = \"tether.svc\"\n", nil},
		{"verify-if-given without Envoy's certificate", on + "client_ca_file = \"/ca.pem\"\nrequire_client_cert = false\n" + envoy, nil},
		{"TLS 1.3", on + "min_version = \"1.3\"\n" + envoy, nil},
		{"key without cert", "[tls]\nkey_file = \"/k.pem\"", []string{"tls.key_file", `"/k.pem"`, "without tls.cert_file"}},
		{"cert without key", "[tls]\ncert_file = \"/c.pem\"", []string{"tls.cert_file", "without tls.key_file"}},
		{"client CA without cert", "[tls]\nclient_ca_file = \"/ca.pem\"", []string{"tls.client_ca_file", `"/ca.pem"`}},
		{"require without CA", on + "require_client_cert = true\n" + envoy, []string{"tls.require_client_cert", "tls.client_ca_file"}},
		{"TLS 1.1", on + "min_version = \"1.1\"\n" + envoy, []string{"tls.min_version", `"1.1"`, "RFC 8996"}},
		{"TLS 1.0 on plaintext too", "[tls]\nmin_version = \"1.0\"", []string{"tls.min_version"}},
		{"Envoy side while plaintext", envoy, []string{"tls.envoy.ca_file", "plaintext"}},
		{"Envoy cert without key", on + envoy + "cert_file = \"/e/c.pem\"\n", []string{"tls.envoy.cert_file", "tls.envoy.key_file"}},
		{"SNI an IP and port", on + envoy + "sni = \"10.0.0.1:50051\"\n", []string{"tls.envoy.sni"}},
		// The DNS name pattern matches a dotted quad: refused by name.
		{"SNI an IPv4 address", on + envoy + "sni = \"127.0.0.1\"\n", []string{"tls.envoy.sni", `"127.0.0.1"`, "an IP address"}},
		{"SNI an IPv6 address", on + envoy + "sni = \"::1\"\n", []string{"tls.envoy.sni", `"::1"`, "an IP address"}},
		{"SNI a name with digits", on + envoy + "sni = \"tether-0.1.example\"\n", nil},
		{"ADS on without Envoy's CA", on, []string{"tls.envoy.ca_file", "verify tether"}},
		{"mTLS, ADS on, no Envoy certificate", on + "client_ca_file = \"/ca.pem\"\n" + envoy, []string{"tls.envoy.cert_file", "client certificate"}},
		{"unknown key", on + "ca_file = \"/ca.pem\"\n", []string{"tls.ca_file"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.toml))
			if len(tc.want) == 0 {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil {
				t.Fatal("want an error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
}

func TestTLSClientAuth(t *testing.T) {
	no := false
	for _, tc := range []struct {
		tls    TLS
		want   tls.ClientAuthType
		mutual bool
	}{
		{TLS{CertFile: "c"}, tls.NoClientCert, false},
		{TLS{CertFile: "c", ClientCAFile: "ca"}, tls.RequireAndVerifyClientCert, true},
		{TLS{CertFile: "c", ClientCAFile: "ca", RequireClientCert: &no}, tls.VerifyClientCertIfGiven, false},
	} {
		if got := tc.tls.ClientAuth(); got != tc.want || tc.tls.Mutual() != tc.mutual {
			t.Errorf("%+v: ClientAuth %v mutual %v, want %v %v", tc.tls, got, tc.tls.Mutual(), tc.want, tc.mutual)
		}
	}
	if d := Default().TLS; d.Enabled() || d.MinVersion != "1.2" || d.MinTLSVersion() != tls.VersionTLS12 {
		t.Errorf("default [tls] = %+v", d)
	}
	if v := (TLS{MinVersion: "1.3"}).MinTLSVersion(); v != tls.VersionTLS13 {
		t.Errorf("1.3 → %x", v)
	}
}

// TestLoadChecksTLSFiles: Load (and so `tether config validate`) reads the
// files [tls] names; Parse does not.
func TestLoadChecksTLSFiles(t *testing.T) {
	dir := t.TempDir()
	now := time.Now()
	authority := testenv.NewCA(t, "ca.test")
	ca := testenv.WriteFile(t, filepath.Join(dir, "ca.test.crt"), authority.PEM)
	writeCert := func(name string, from, to time.Time) (cert, key string) {
		c, k := authority.Issue(t, name, true, from, to)
		return testenv.WritePair(t, dir, name, c, k)
	}
	good, goodKey := writeCert("tether.test", now.Add(-time.Hour), now.Add(24*time.Hour))
	_, otherKey := writeCert("other.test", now.Add(-time.Hour), now.Add(24*time.Hour))
	old, oldKey := writeCert("old.test", time.Date(2020, 1, 1, 0, 0, 0, 0, time.UTC), time.Date(2021, 1, 1, 0, 0, 0, 0, time.UTC))
	early, earlyKey := writeCert("early.test", now.Add(24*time.Hour), now.Add(48*time.Hour))
	empty := filepath.Join(dir, "empty.pem")
	if err := os.WriteFile(empty, []byte("# nothing here\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	file := func(cert, key, clientCA, sni string) string {
		s := fmt.Sprintf("[xds]\naddr = \"\"\n[tls]\ncert_file = %q\nkey_file = %q\n", cert, key)
		if clientCA != "" {
			s += fmt.Sprintf("client_ca_file = %q\n", clientCA)
		}
		if sni != "" {
			s += fmt.Sprintf("[tls.envoy]\nca_file = \"/envoy/ca.pem\"\nsni = %q\n", sni)
			if clientCA != "" {
				s += "cert_file = \"/envoy/client.crt\"\nkey_file = \"/envoy/client.key\"\n"
			}
		}
		return s
	}
	for _, tc := range []struct {
		name, toml string
		want       []string
	}{
		{"good", file(good, goodKey, ca, "tether.test"), nil},
		{"missing cert", file(filepath.Join(dir, "nope.crt"), goodKey, "", ""), []string{"tls.cert_file", "nope.crt", "no such file"}},
		{"a directory", file(dir, goodKey, "", ""), []string{"tls.cert_file", "not a regular file"}},
		{"no PEM", file(empty, goodKey, "", ""), []string{"tls.cert_file", "empty.pem", "no PEM certificate"}},
		{"key of another certificate", file(good, otherKey, "", ""), []string{"tls.key_file", "other.test.key", "not the key of tls.cert_file", "tether.test.crt"}},
		{"key file holds a certificate", file(good, good, "", ""), []string{"tls.key_file", "no PEM private key"}},
		{"expired", file(old, oldKey, "", ""), []string{"tls.cert_file", "old.test.crt", "expired on 2021-01-01T00:00:00Z", "valid from 2020-01-01T00:00:00Z"}},
		{"not yet valid", file(early, earlyKey, "", ""), []string{"tls.cert_file", "not valid until"}},
		{"client CA without certificates", file(good, goodKey, empty, ""), []string{"tls.client_ca_file", "empty.pem", "no PEM certificate"}},
		{"client CA is a leaf", file(good, goodKey, good, ""), []string{"tls.client_ca_file", "not a CA"}},
		{"SNI the certificate lacks", file(good, goodKey, "", "tether.prod"), []string{"tls.envoy.sni", `"tether.prod"`, "does not name it"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := Parse([]byte(tc.toml)); err != nil {
				t.Fatalf("Parse reads no file, yet: %v", err)
			}
			p := filepath.Join(t.TempDir(), "tether.toml")
			if err := os.WriteFile(p, []byte(tc.toml), 0o600); err != nil {
				t.Fatal(err)
			}
			_, err := Load(p)
			if len(tc.want) == 0 {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil {
				t.Fatal("want an error")
			}
			for _, w := range append(tc.want, p) {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
}
