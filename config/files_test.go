package config

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestSecretFromEnv(t *testing.T) {
	t.Setenv("TETHER_TEST_SECRET", "from-the-environment-0123")
	c, err := Parse([]byte("[identity]\nsecret = \"from-the-file-0123456789\"\nsecret_env = \"TETHER_TEST_SECRET\""))
	if err != nil {
		t.Fatal(err)
	}
	if got := string(c.Identity.SecretBytes()); got != "from-the-environment-0123" {
		t.Fatalf("secret %q: the environment must win", got)
	}
}

func TestAdminToken(t *testing.T) {
	const tok = "s3cret-admin-token-0123456789"
	dir := t.TempDir()
	write := func(name, s string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	c := Default()
	if c.Server.AdminTokenEnv != "TETHER_ADMIN_TOKEN" || c.Server.AdminAddr != "127.0.0.1:8090" {
		t.Fatalf("defaults: %+v", c.Server)
	}
	t.Setenv("TETHER_TEST_ADMIN", "")
	c.Server.AdminTokenEnv = "TETHER_TEST_ADMIN"
	if got, err := c.Server.AdminToken(); got != "" || err != nil {
		t.Fatalf("unset: %q, %v; want no token", got, err)
	}
	t.Setenv("TETHER_TEST_ADMIN", tok)
	if got, err := c.Server.AdminToken(); got != tok || err != nil {
		t.Fatalf("from env: %q, %v", got, err)
	}
	c.Server.AdminTokenFile = write("token", "file-token-0123456789abcdef\n")
	if got, err := c.Server.AdminToken(); got != "file-token-0123456789abcdef" || err != nil {
		t.Fatalf("from file: %q, %v; the file wins and its newline goes", got, err)
	}
	for _, tc := range []struct {
		name, file, env string
		want            []string
	}{
		{"short env", "", "tiny-tok", []string{"$TETHER_TEST_ADMIN", "shorter than 16"}},
		{"short file", write("short", "tiny-tok\n"), "", []string{"server.admin_token_file", "shorter than 16"}},
		{"empty file", write("empty", "\n"), "", []string{"server.admin_token_file", "empty"}},
		{"space inside", write("space", "tiny-tok 0123456789"), "", []string{"white space"}},
		{"missing file", filepath.Join(dir, "nope"), "", []string{"server.admin_token_file", "no such file"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := c.Server
			s.AdminTokenFile = tc.file
			t.Setenv("TETHER_TEST_ADMIN", tc.env)
			_, err := s.AdminToken()
			if err == nil {
				t.Fatal("want an error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
			if strings.Contains(err.Error(), "tiny-tok") {
				t.Errorf("error %q shows the token", err)
			}
		})
	}
	// The variable's name, not a token, goes in the file.
	_, err := Parse([]byte("[server]\nadmin_token_env = \"" + tok + "-x\""))
	if err == nil || !strings.Contains(err.Error(), "server.admin_token_env") || strings.Contains(err.Error(), tok) {
		t.Fatalf("token as admin_token_env: %v", err)
	}
	// Load checks the token file; the token itself is never in the TOML.
	p := write("tether.toml", "[server]\nadmin_token_file = \""+filepath.Join(dir, "nope")+"\"\n")
	if _, err := Load(p); err == nil || !strings.Contains(err.Error(), "server.admin_token_file") {
		t.Fatalf("Load with a missing token file: %v", err)
	}
	if _, err := Parse([]byte("[server]\nadmin_token = \"" + tok + "\"")); err == nil || !strings.Contains(err.Error(), "server.admin_token") {
		t.Fatalf("admin_token in the file: %v", err)
	}
}
