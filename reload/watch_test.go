package reload

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/config"
)

// TestWatchFile: a saved edit of the config file (written elsewhere and
// renamed over it, as editors and Kubernetes ConfigMaps do) reaches the
// fleet without a restart, with the overrides applied again; a file that
// does not parse is refused and counted, and the configuration in force
// stays.
func TestWatchFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "tether.toml")
	save := func(doc string) {
		t.Helper()
		tmp := filepath.Join(dir, ".tether.toml.tmp")
		if err := os.WriteFile(tmp, []byte(doc), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, path); err != nil {
			t.Fatal(err)
		}
	}
	instances := func(names ...string) string {
		var b strings.Builder
		for i, n := range names {
			fmt.Fprintf(&b, "[[instances]]\nname = %q\naddress = \"127.0.0.1:%d\"\n", n, 1000+i)
		}
		return b.String()
	}
	save(instances("a"))
	cfg, err := config.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	rt := New("127.0.0.1:50051", nil, zerolog.Nop(), reg)
	if _, err := rt.Apply(t.Context(), cfg, "start"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- rt.WatchFile(ctx, path, func(c *config.Config) { c.Server.LogLevel = "debug" }) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("WatchFile: %v", err)
		}
	}()

	// The watch starts in the background: save until it sees a save.
	within := func(what string, cond func() bool, again func()) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("%s: not within 10s", what)
			}
			again()
			time.Sleep(300 * time.Millisecond)
		}
	}
	within("an added instance reaches the fleet", func() bool { return len(rt.Fleet().All()) == 2 },
		func() { save(instances("a", "b")) })
	if lvl := rt.Current().Server.LogLevel; lvl != "debug" {
		t.Errorf("log level %q after the reload, want the override's debug", lvl)
	}
	invalid := func() float64 { return testutil.ToFloat64(rt.reloads.WithLabelValues("file", "invalid")) }
	within("a broken file is refused", func() bool { return invalid() > 0 }, func() { save("[[instances]\n") })
	if n := len(rt.Fleet().All()); n != 2 {
		t.Errorf("fleet has %d instances after a broken file, want the 2 in force", n)
	}
}
