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
