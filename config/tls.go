package config

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net/netip"
	"regexp"
	"strings"
	"time"
)

// TLS is the [tls] section. It holds:
//   - tether's certificate for its gRPC servers, ext_proc and xDS. Envoy
//     is the client of both, so one certificate serves both.
//   - the CA that client certificates must chain to;
//   - in [tls.envoy], the files Envoy presents and trusts in the
//     configuration tether generates for it.
//
// Without cert_file both servers speak plaintext. The admin HTTP server is
// not covered. It listens on loopback by default and takes a bearer token
// (server.admin_token_env).
type TLS struct {
	CertFile string `toml:"cert_file"`
	KeyFile  string `toml:"key_file"`
	// ClientCAFile turns on mutual TLS: a client must present a
	// certificate that chains to one of its CAs.
	ClientCAFile string `toml:"client_ca_file"`
	// RequireClientCert left out, nil, follows client_ca_file: a
	// certificate is required when that is set. false verifies a
	// certificate a client offers but lets one without any in. That is for
	// a migration only. true without client_ca_file is refused. A plain
	// bool defaulting to true could not tell that from the default.
	RequireClientCert *bool `toml:"require_client_cert"`
	// MinVersion is "1.2", the default, or "1.3". It holds for tether and
	// for the Envoy side.
	MinVersion string `toml:"min_version"`
	// Envoy is how Envoy connects. The tether-extproc cluster tether
	// serves over xDS gets a TLS transport socket with these files. So
	// does the ADS cluster of the bootstrap. The paths are on Envoy's host.
	Envoy EnvoyTLS `toml:"envoy" reload:"live"`
}

// EnvoyTLS is the [tls.envoy] section.
type EnvoyTLS struct {
	// CertFile and KeyFile are Envoy's client certificate for mutual TLS.
	CertFile string `toml:"cert_file"`
	KeyFile  string `toml:"key_file"`
	// CAFile verifies tether's certificate.
	CAFile string `toml:"ca_file"`
	// SNI is the server name Envoy sends and requires in tether's
	// certificate, as a DNS subject alternative name. "" checks the chain
	// only.
	SNI string `toml:"sni"`
}

// Enabled reports whether the gRPC servers speak TLS.
func (t TLS) Enabled() bool { return t.CertFile != "" }

// ClientAuth is how the gRPC servers treat client certificates.
func (t TLS) ClientAuth() tls.ClientAuthType {
	switch {
	case t.ClientCAFile == "":
		return tls.NoClientCert
	case t.RequireClientCert != nil && !*t.RequireClientCert:
		return tls.VerifyClientCertIfGiven
	default:
		return tls.RequireAndVerifyClientCert
	}
}

// Mutual reports whether every client must present a valid certificate.
func (t TLS) Mutual() bool { return t.ClientAuth() == tls.RequireAndVerifyClientCert }

// MinTLSVersion is min_version as a crypto/tls constant.
func (t TLS) MinTLSVersion() uint16 {
	if t.MinVersion == "1.3" {
		return tls.VersionTLS13
	}
	return tls.VersionTLS12
}

var dnsName = regexp.MustCompile(`^([a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?)(\.[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?)*$`)

// validateTLS checks how the keys fit together. CheckFiles reads the
// files.
func (c *Config) validateTLS(bad reporter) {
	t := c.TLS
	switch {
	case t.KeyFile != "" && t.CertFile == "":
		bad("tls.key_file", t.KeyFile, "set without tls.cert_file")
	case t.CertFile != "" && t.KeyFile == "":
		bad("tls.cert_file", t.CertFile, "set without tls.key_file")
	}
	if t.ClientCAFile != "" && t.CertFile == "" {
		bad("tls.client_ca_file", t.ClientCAFile, "mutual TLS needs tls.cert_file and tls.key_file too")
	}
	if t.RequireClientCert != nil && *t.RequireClientCert && t.ClientCAFile == "" {
		bad("tls.require_client_cert", true, "needs tls.client_ca_file, the CA client certificates must chain to")
	}
	switch t.MinVersion {
	case "1.2", "1.3":
	default:
		bad("tls.min_version", t.MinVersion, `want "1.2" or "1.3" (TLS 1.0 and 1.1 are deprecated, RFC 8996)`)
	}
	e := t.Envoy
	for _, f := range []struct{ key, v string }{
		{"tls.envoy.cert_file", e.CertFile}, {"tls.envoy.key_file", e.KeyFile}, {"tls.envoy.ca_file", e.CAFile}, {"tls.envoy.sni", e.SNI},
	} {
		if f.v != "" && !t.Enabled() {
			bad(f.key, f.v, "tether serves plaintext: set tls.cert_file and tls.key_file, or remove it")
		}
	}
	switch {
	case e.CertFile != "" && e.KeyFile == "":
		bad("tls.envoy.cert_file", e.CertFile, "set without tls.envoy.key_file")
	case e.KeyFile != "" && e.CertFile == "":
		bad("tls.envoy.key_file", e.KeyFile, "set without tls.envoy.cert_file")
	}
	// An IP address passes the DNS name pattern, since 127.0.0.1 is four
	// labels. But it is not a DNS name. It cannot be sent as SNI, and the
	// check tether generates matches DNS subject alternative names only.
	if _, err := netip.ParseAddr(e.SNI); err == nil {
		bad("tls.envoy.sni", e.SNI, "an IP address, not a DNS name: an IP cannot be sent as SNI and Envoy would look for it among the certificate's DNS names; name a DNS name of tether's certificate, or leave sni empty to check the chain only")
	} else if e.SNI != "" && (len(e.SNI) > 253 || !dnsName.MatchString(e.SNI)) {
		bad("tls.envoy.sni", e.SNI, "want a DNS name (an IP address cannot be sent as SNI)")
	}
	// With the ADS server on, tether generates Envoy's side, so it must
	// work. With it off, Envoy is configured elsewhere, as in Istio. Then
	// [tls.envoy] may be left out, and the generated resources carry no
	// TLS for Envoy's side. Named at all, it must be whole. xds.Build
	// follows the same rule (EnvoyMissing), so a valid configuration
	// always builds.
	for _, m := range t.EnvoyMissing() {
		switch {
		case c.XDS.Addr != "":
			bad(m.Key, "", m.Why+" (required while the ADS server is on)")
		case e != EnvoyTLS{}:
			bad(m.Key, "", m.Why+" (with the ADS server off, name all of [tls.envoy] or none of it)")
		}
	}
}

// Missing is a key [tls.envoy] lacks, and why Envoy needs it.
type Missing struct{ Key, Why string }

// EnvoyMissing lists what [tls.envoy] lacks for Envoy to reach tether's
// [tls] servers. Envoy needs tether's CA, and under mutual TLS its own
// client certificate. The list is empty while tether serves plaintext.
func (t TLS) EnvoyMissing() []Missing {
	if !t.Enabled() {
		return nil
	}
	var out []Missing
	if t.Envoy.CAFile == "" {
		out = append(out, Missing{"tls.envoy.ca_file", "required with tls.cert_file: Envoy must verify tether's certificate"})
	}
	if t.Mutual() && t.Envoy.CertFile == "" {
		out = append(out, Missing{"tls.envoy.cert_file", "required with tls.client_ca_file: tether refuses an Envoy without a client certificate"})
	}
	return out
}

// DefaultTLSMinVersion is tls.min_version left out.
const DefaultTLSMinVersion = "1.2"

// defaultTLS is plaintext. require_client_cert stays nil. Left out, it
// follows tls.client_ca_file (ClientAuth).
func defaultTLS() TLS { return TLS{MinVersion: DefaultTLSMinVersion} }

// TLSFiles is what [tls] names, read and checked.
type TLSFiles struct {
	// Certificate is tether's, with Leaf set.
	Certificate tls.Certificate
	// ClientCAs is nil without tls.client_ca_file.
	ClientCAs *x509.CertPool
}

// ReadFiles reads and checks tls.cert_file, tls.key_file and
// tls.client_ca_file. Every certificate must be valid at now. The key
// must be the certificate's. The client CA file must hold CA
// certificates. Errors name the key and the file.
func (t TLS) ReadFiles(now time.Time) (*TLSFiles, error) {
	if !t.Enabled() {
		return nil, errors.New("tls: no tls.cert_file")
	}
	certPEM, err := readSmall("tls.cert_file", t.CertFile)
	if err != nil {
		return nil, err
	}
	chain, err := pemCertificates(certPEM)
	if err != nil {
		return nil, fmt.Errorf("tls.cert_file = %q: %w", t.CertFile, err)
	}
	for i, c := range chain {
		if err := validAt(c, now); err != nil {
			what := "the certificate"
			if i > 0 {
				what = fmt.Sprintf("chain certificate %d (%s)", i, c.Subject)
			}
			return nil, fmt.Errorf("tls.cert_file = %q: %s %w", t.CertFile, what, err)
		}
	}
	keyPEM, err := readSmall("tls.key_file", t.KeyFile)
	if err != nil {
		return nil, err
	}
	if !strings.Contains(string(keyPEM), "PRIVATE KEY-----") {
		return nil, fmt.Errorf("tls.key_file = %q: no PEM private key in the file", t.KeyFile)
	}
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("tls.key_file = %q: not the key of tls.cert_file %q: %w", t.KeyFile, t.CertFile, err)
	}
	pair.Leaf = chain[0]
	out := &TLSFiles{Certificate: pair}
	if t.ClientCAFile == "" {
		return out, nil
	}
	caPEM, err := readSmall("tls.client_ca_file", t.ClientCAFile)
	if err != nil {
		return nil, err
	}
	cas, err := pemCertificates(caPEM)
	if err != nil {
		return nil, fmt.Errorf("tls.client_ca_file = %q: %w", t.ClientCAFile, err)
	}
	out.ClientCAs = x509.NewCertPool()
	for _, ca := range cas {
		if !ca.BasicConstraintsValid || !ca.IsCA {
			return nil, fmt.Errorf("tls.client_ca_file = %q: %q is not a CA certificate (want the CA that signs client certificates, not a client's or tether's own)", t.ClientCAFile, ca.Subject.String())
		}
		if err := validAt(ca, now); err != nil {
			return nil, fmt.Errorf("tls.client_ca_file = %q: CA %q %w", t.ClientCAFile, ca.Subject.String(), err)
		}
		out.ClientCAs.AddCert(ca)
	}
	return out, nil
}

// pemCertificates parses every CERTIFICATE block. Finding none is an
// error.
func pemCertificates(data []byte) ([]*x509.Certificate, error) {
	var out []*x509.Certificate
	for {
		var b *pem.Block
		b, data = pem.Decode(data)
		if b == nil {
			break
		}
		if b.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			return nil, fmt.Errorf("certificate %d: %w", len(out)+1, err)
		}
		out = append(out, c)
	}
	if len(out) == 0 {
		return nil, errors.New("no PEM certificate in the file")
	}
	return out, nil
}

// validAt says why c is not valid at now, with its dates.
func validAt(c *x509.Certificate, now time.Time) error {
	span := fmt.Sprintf("(valid from %s to %s)", c.NotBefore.UTC().Format(time.RFC3339), c.NotAfter.UTC().Format(time.RFC3339))
	switch {
	case now.After(c.NotAfter):
		return fmt.Errorf("expired on %s %s", c.NotAfter.UTC().Format(time.RFC3339), span)
	case now.Before(c.NotBefore):
		return fmt.Errorf("is not valid until %s %s", c.NotBefore.UTC().Format(time.RFC3339), span)
	}
	return nil
}
