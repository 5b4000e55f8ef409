package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestConfigValidateReadsTheStoreURL: `tether config validate` runs the
// store's own URL parser, names redis.url and never shows a password.
func TestConfigValidateReadsTheStoreURL(t *testing.T) {
	for _, tc := range []struct{ url, want string }{
		{"redis://127.0.0.1:6379/notadb", "invalid database number"},
		{"redis+cluster://:hunter2@10.0.0.1:7000?addr=10.0.0.2:port", `invalid port`},
		{"redis+cluster://10.0.0.1:7000?master_name=m", "master_name"},
		{"redis+sentinel://u:hunter2@10.0.0.1:26379?addr=10.0.0.2:26379&password=hunter2", "without master_name"},
		{"rediss+sentinel://10.0.0.1?master_name=m", "without host:port"},
		{"redis://h:1/x?password=hunter2&pool=1", "redis.url"},
		// "embedded" with what only a real Redis has.
		{"embedded?addr=10.0.0.2:7000&password=hunter2", "in-process memory store"},
		{"embedded+cluster://:hunter2@10.0.0.1:7000?addr=10.0.0.2:7000", "Cluster scheme"},
		{"rediss+embedded://10.0.0.1:6380", "TLS"},
		{"embedded://user:hunter2@10.0.0.1:6379/2", "credentials"},
	} {
		path := filepath.Join(t.TempDir(), "tether.toml")
		if err := os.WriteFile(path, []byte("[redis]\nurl = \""+tc.url+"\"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		cmd := newConfigCmd()
		var out bytes.Buffer
		cmd.SetOut(&out)
		cmd.SetErr(&out)
		cmd.SetArgs([]string{"validate", path})
		err := cmd.Execute()
		if err == nil {
			t.Errorf("%s: validate passed, want an error", tc.url)
			continue
		}
		msg := err.Error() + out.String()
		if !strings.Contains(msg, "redis.url") || !strings.Contains(msg, tc.want) {
			t.Errorf("%s: %q does not name redis.url and %q", tc.url, err, tc.want)
		}
		if strings.Contains(msg, "hunter2") {
			t.Errorf("%s: %q shows the password", tc.url, msg)
		}
	}
}

// TestConfigValidateChecksTheAdminToken: `tether config validate` refuses
// the token in $server.admin_token_env that `tether serve` would refuse,
// names the variable and never shows the token.
func TestConfigValidateChecksTheAdminToken(t *testing.T) {
	const env = "TETHER_TEST_VALIDATE_TOKEN"
	for _, tc := range []struct {
		name, token, want string // want "": valid
	}{
		{"unset", "", ""},
		{"strong", "0123456789abcdef-strong", ""},
		{"short", "s3cret", "shorter than 16 bytes"},
		{"white space", "s3cret s3cret s3cret", "white space"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv(env, tc.token)
			path := filepath.Join(t.TempDir(), "tether.toml")
			if err := os.WriteFile(path, []byte("[server]\nadmin_token_env = \""+env+"\"\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			cmd := newConfigCmd()
			var out bytes.Buffer
			cmd.SetOut(&out)
			cmd.SetErr(&out)
			cmd.SetArgs([]string{"validate", path})
			err := cmd.Execute()
			if tc.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil {
				t.Fatal("validate passed, want an error")
			}
			msg := err.Error() + out.String()
			for _, w := range []string{path, "$" + env, tc.want} {
				if !strings.Contains(msg, w) {
					t.Errorf("%q does not mention %q", err, w)
				}
			}
			if strings.Contains(msg, "s3cret") {
				t.Errorf("%q shows the token", msg)
			}
		})
	}
}

// TestConfigValidatePrintsTheEffectiveMode: `tether config validate`
// prints the mode requests are routed by, as routing.mode, sticky_enabled
// and adaptive_sticky add up: sticky_enabled = 0 routes everything at
// random whatever the mode says, and adaptive_sticky = 1 alone is
// adaptive.
func TestConfigValidatePrintsTheEffectiveMode(t *testing.T) {
	for _, tc := range []struct{ file, want string }{
		{"", "mode sticky"},
		{"[routing]\nmode = \"sticky\"\nsticky_enabled = 0\n", "mode random"},
		{"[routing]\nadaptive_sticky = 1\n", "mode adaptive"},
		{"[routing]\nmode = \"random\"\n", "mode random"},
		{"[routing]\nmode = \"hybrid\"\n[[routing.rules]]\nname = \"core\"\npath_prefix = \"/v1/\"\nmode = \"sticky\"\n", "mode hybrid"},
		{"[routing]\nmode = \"hybrid\"\nsticky_enabled = 0\n[[routing.rules]]\nname = \"core\"\npath_prefix = \"/v1/\"\nmode = \"sticky\"\n", "mode random"},
	} {
		path := filepath.Join(t.TempDir(), "tether.toml")
		if err := os.WriteFile(path, []byte(tc.file), 0o600); err != nil {
			t.Fatal(err)
		}
		cmd := newConfigCmd()
		var out bytes.Buffer
		cmd.SetOut(&out)
		cmd.SetArgs([]string{"validate", path})
		if err := cmd.Execute(); err != nil {
			t.Fatalf("%q: %v", tc.file, err)
		}
		if !strings.Contains(out.String(), tc.want) {
			t.Errorf("%q: printed %q, want %q", tc.file, out.String(), tc.want)
		}
	}
}
