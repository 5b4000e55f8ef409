package testenv

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// CA is a certificate authority made for one test, so no certificate or
// key is ever committed to the repository. Its keys are ECDSA P-256.
type CA struct {
	Cert *x509.Certificate
	Key  crypto.Signer
	PEM  []byte // Cert, PEM-encoded: the contents of a CA file
}

// NewCA makes a self-signed CA with common name name. It is valid from an
// hour ago for a day.
func NewCA(t testing.TB, name string) *CA {
	t.Helper()
	k := newKey(t)
	now := time.Now()
	tpl := &x509.Certificate{
		SerialNumber: serial(t), Subject: pkix.Name{CommonName: name},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tpl, tpl, k.Public(), k)
	if err != nil {
		t.Fatalf("testenv: CA %q: %v", name, err)
	}
	c, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatalf("testenv: CA %q: %v", name, err)
	}
	return &CA{Cert: c, Key: k, PEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// Issue signs a leaf certificate, not a CA, for name. name is its common
// name and a DNS name. It is valid from notBefore to notAfter. Issue
// returns it and its PKCS #8 key as PEM. A server certificate also names
// 127.0.0.1, ::1 and localhost, and is for server authentication. Any
// other is for client authentication.
func (ca *CA) Issue(t testing.TB, name string, server bool, notBefore, notAfter time.Time) (certPEM, keyPEM []byte) {
	t.Helper()
	k := newKey(t)
	tpl := &x509.Certificate{
		SerialNumber: serial(t), Subject: pkix.Name{CommonName: name}, DNSNames: []string{name},
		NotBefore: notBefore, NotAfter: notAfter, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if server {
		if name != "localhost" {
			tpl.DNSNames = append(tpl.DNSNames, "localhost")
		}
		tpl.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}
		tpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	}
	der, err := x509.CreateCertificate(rand.Reader, tpl, ca.Cert, k.Public(), ca.Key)
	if err != nil {
		t.Fatalf("testenv: certificate %q: %v", name, err)
	}
	kb, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		t.Fatalf("testenv: key of %q: %v", name, err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kb})
}

// WriteFile writes data to path, mode 0600, and returns path. It writes
// through a temporary file and a rename. So a process watching path never
// reads it half-written.
func WriteFile(t testing.TB, path string, data []byte) string {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
	return path
}

// WritePair writes a certificate and its key, as Issue returns them, to
// dir/name.crt and dir/name.key and returns the two paths.
func WritePair(t testing.TB, dir, name string, certPEM, keyPEM []byte) (certFile, keyFile string) {
	t.Helper()
	return WriteFile(t, filepath.Join(dir, name+".crt"), certPEM), WriteFile(t, filepath.Join(dir, name+".key"), keyPEM)
}

func newKey(t testing.TB) *ecdsa.PrivateKey {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatalf("testenv: key: %v", err)
	}
	return k
}

// serial is a random certificate serial number. So two certificates from
// one CA, such as a renewal, never share one.
func serial(t testing.TB) *big.Int {
	t.Helper()
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		t.Fatalf("testenv: serial number: %v", err)
	}
	return n
}
