package config

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
	"time"
)

// CheckFiles reads what the configuration names on this host: the [tls]
// certificates and key, the client CA file, and the admin token file. The
// [tls.envoy] paths are on Envoy's host and are not read. Load calls
// CheckFiles, so `tether config validate` catches an expired certificate.
// tether reads the files again when it starts.
func (c *Config) CheckFiles(now time.Time) error {
	var errs []error
	if c.TLS.Enabled() {
		f, err := c.TLS.ReadFiles(now)
		if err != nil {
			errs = append(errs, err)
		} else if sni := c.TLS.Envoy.SNI; sni != "" {
			if err := f.Certificate.Leaf.VerifyHostname(sni); err != nil {
				errs = append(errs, fmt.Errorf("tls.envoy.sni = %q: tls.cert_file %q does not name it, so Envoy would refuse tether: %w", sni, c.TLS.CertFile, err))
			}
		}
	}
	if c.Server.AdminTokenFile != "" {
		if _, err := c.Server.AdminToken(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// AdminToken returns the admin API's bearer token. It is the content of
// server.admin_token_file when one is named, trailing white space removed.
// Otherwise it is $server.admin_token_env. "" means the API is open.
// Errors never show the token.
func (s Server) AdminToken() (string, error) {
	var tok, from string
	if s.AdminTokenFile != "" {
		b, err := readSmall("server.admin_token_file", s.AdminTokenFile)
		if err != nil {
			return "", err
		}
		tok, from = strings.TrimRight(string(b), " \t\r\n"), fmt.Sprintf("server.admin_token_file %q", s.AdminTokenFile)
		if tok == "" {
			return "", fmt.Errorf("server.admin_token_file = %q: empty", s.AdminTokenFile)
		}
	} else {
		tok, from = os.Getenv(s.AdminTokenEnv), "$"+s.AdminTokenEnv
		if tok == "" {
			return "", nil
		}
	}
	if len(tok) < MinAdminToken {
		return "", fmt.Errorf("admin token (from %s) is shorter than %d bytes", from, MinAdminToken)
	}
	if strings.ContainsAny(tok, " \t\r\n") {
		return "", fmt.Errorf("admin token (from %s) holds white space: it cannot be sent in an Authorization header", from)
	}
	return tok, nil
}

// SecretBytes returns the identity secret: from the environment variable
// named by secret_env when it is set, else from the file.
func (i Identity) SecretBytes() []byte {
	if i.SecretEnv != "" {
		if v := os.Getenv(i.SecretEnv); v != "" {
			return []byte(v)
		}
	}
	return []byte(i.Secret)
}

// maxPEM bounds a certificate, key or token file. A path such as
// /dev/zero must not hang the start.
const maxPEM = 1 << 20

// readSmall reads a regular file of at most maxPEM bytes. Errors name key.
func readSmall(key, path string) ([]byte, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("%s = %q: %w", key, path, pathErr(err))
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s = %q: not a regular file", key, path)
	}
	if fi.Size() > maxPEM {
		return nil, fmt.Errorf("%s = %q: larger than %d bytes", key, path, maxPEM)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("%s = %q: %w", key, path, pathErr(err))
	}
	return b, nil
}

// pathErr drops the path from an os error. The message names it already.
func pathErr(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}
