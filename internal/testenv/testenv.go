// Package testenv starts and finds the real components tests run against:
//   - redis-server: alone, in a cluster, or behind a sentinel;
//   - Envoy;
//   - PostgreSQL;
//   - Prometheus.
//
// Each is started through internal/launch. A missing component skips the
// test on a developer machine and fails it under CI=true. So CI can never
// go green by skipping.
package testenv

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/internal/launch"
)

const (
	startTimeout = 10 * time.Second
	stopTimeout  = 10 * time.Second
	// envoyTimeout bounds each of Envoy's waits: starting, and getting its
	// configuration. The configuration may come from tether's ADS server.
	envoyTimeout = 30 * time.Second
)

// Require skips the test when err says a component it needs is missing.
// Under CI=true it fails the test instead. A nil err means the component
// is there.
func Require(t testing.TB, what string, err error) {
	t.Helper()
	if err == nil {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("%s is required under CI=true but unavailable: %v (install it with `make tools`)", what, err)
		return
	}
	t.Skipf("%s unavailable, skipping: %v (install it with `make tools`)", what, err)
}

// rootModule is the module path of the repository root's go.mod: the
// product. The lab (lab/) and the e2e tests (e2e/) are modules of their
// own, with their own go.mod files below the root.
const rootModule = "github.com/tetherproxy/tether"

// RepoRoot is the repository root: the directory whose go.mod is the
// product's. It is found by walking up from the working directory, past
// the go.mod of the lab's module or the e2e tests'. A test's working
// directory is its package directory.
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("repo root: %w", err)
	}
	for {
		if data, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil && modulePath(data) == rootModule {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("repo root: no go.mod of module %s above the working directory", rootModule)
		}
		dir = parent
	}
}

// modulePath is the path a go.mod's module directive names, or "" if
// none.
func modulePath(gomod []byte) string {
	for _, l := range strings.Split(string(gomod), "\n") {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(l), "module"); ok && rest != strings.TrimLeft(rest, " \t") {
			if i := strings.Index(rest, "//"); i >= 0 {
				rest = rest[:i]
			}
			return strings.Trim(strings.TrimSpace(rest), `"`)
		}
	}
	return ""
}

// EnvoyBin returns the Envoy binary: $ENVOY_BIN, else the one `make tools`
// installs under .tools/envoy. It skips or fails the test (see Require)
// when neither is executable.
func EnvoyBin(t testing.TB) string {
	t.Helper()
	if p := os.Getenv("ENVOY_BIN"); p != "" {
		Require(t, "envoy", executable(p))
		return p
	}
	root, err := RepoRoot()
	if err != nil {
		Require(t, "envoy", err)
		return ""
	}
	p := filepath.Join(root, ".tools", "envoy", "envoy", "_bin", "envoy")
	Require(t, "envoy", executable(p))
	return p
}

// Envoy starts Envoy as launch.StartEnvoy does, and stops it when the test
// ends. An empty o.Bin means EnvoyBin. An empty o.Dir means a directory of
// the test's. It returns once Envoy's admin address is known. WaitServing
// waits for its listener. It fails the test when Envoy does not start, and
// skips it (see Require) when there is no Envoy.
func Envoy(t testing.TB, o launch.EnvoyOptions) *launch.Envoy {
	t.Helper()
	if o.Bin == "" {
		o.Bin = EnvoyBin(t)
	}
	if o.Dir == "" {
		o.Dir = t.TempDir()
	}
	var e *launch.Envoy
	within(t, envoyTimeout, func(ctx context.Context) (err error) {
		e, err = launch.StartEnvoy(ctx, o)
		return err
	})
	t.Cleanup(func() { e.Stop(stopTimeout) })
	return e
}

// WaitServing waits until e's listener is bound (see
// launch.Envoy.WaitServing), failing the test after envoyTimeout.
func WaitServing(t testing.TB, e *launch.Envoy) {
	t.Helper()
	within(t, envoyTimeout, e.WaitServing)
}

// within calls f with a context that ends after d, and fails the test on
// f's error.
func within(t testing.TB, d time.Duration, f func(context.Context) error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	if err := f(ctx); err != nil {
		t.Fatal(err)
	}
}

func executable(p string) error {
	fi, err := os.Stat(p)
	switch {
	case err != nil:
		return err
	case fi.IsDir() || fi.Mode()&0o111 == 0:
		return fmt.Errorf("%s is not an executable file", p)
	}
	return nil
}

// Redis is a redis-server process private to one test, listening only on a
// unix socket.
type Redis struct {
	t      testing.TB
	bin    string
	dir    string
	sock   string
	client goredis.UniversalClient

	mu      sync.Mutex
	proc    *launch.Redis // the current server; nil while stopped
	durable bool          // Durable was called: restarts load the append-only file
}

// RedisServer starts redis-server with persistence off. The binary is
// $REDIS_SERVER_BIN, else taken from PATH. RedisServer waits until the
// server answers PING, and stops it when the test ends. It skips or fails
// the test (see Require) when the binary is missing.
func RedisServer(t testing.TB) *Redis {
	t.Helper()
	bin := redisBin(t, "redis-server", "REDIS_SERVER_BIN")

	// Unix socket paths are limited to about 100 bytes. t.TempDir() paths
	// carry the test name and can exceed that.
	dir, err := os.MkdirTemp("", "tr")
	if err != nil {
		t.Fatalf("redis-server: %v", err)
	}
	r := &Redis{t: t, bin: bin, dir: dir, sock: launch.RedisSocket(dir)}
	t.Cleanup(func() {
		r.Stop()
		if r.client != nil {
			_ = r.client.Close()
		}
		_ = os.RemoveAll(dir)
	})
	r.client = goredis.NewClient(&goredis.Options{
		Network: "unix",
		Addr:    r.sock,
		// Fail fast while the server is stopped, as in outage tests. One
		// dial per attempt instead of five with back-off.
		DialerRetries:         1,
		ContextTimeoutEnabled: true,
	})
	r.Start()
	return r
}

// redisBin returns the binary named by the environment variable env, else
// name from PATH. It skips or fails the test (see Require) when missing.
func redisBin(t testing.TB, name, env string) string {
	t.Helper()
	bin := os.Getenv(env)
	var err error
	if bin == "" {
		bin, err = exec.LookPath(name)
	} else {
		err = executable(bin)
	}
	Require(t, name, err)
	return bin
}

// URL is the server's address as a store URL ("unix:///…/r.sock").
func (r *Redis) URL() string { return "unix://" + r.sock }

// Client is a client connected to the server, closed when the test ends. It
// reconnects by itself after Stop and Start.
func (r *Redis) Client() goredis.UniversalClient { return r.client }

// Start starts the server again on the same socket, after Stop or Kill,
// and waits until it answers. The data set starts empty, since persistence
// is off. If Durable was called, it is what the append-only file holds.
func (r *Redis) Start() {
	r.t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.proc != nil {
		return
	}
	within(r.t, startTimeout, func(ctx context.Context) (err error) {
		r.proc, err = launch.StartRedis(ctx, launch.RedisOptions{Bin: r.bin, Dir: r.dir, Durable: r.durable})
		return err
	})
}

// Durable turns on the append-only file with an fsync per write, on the
// running server and for its restarts. It waits until the file holds the
// data set. From then on Kill loses nothing, as on a production Redis with
// persistence.
func (r *Redis) Durable(ctx context.Context) error {
	r.mu.Lock()
	r.durable = true
	r.mu.Unlock()
	for _, kv := range [][2]string{{"appendfsync", "always"}, {"appendonly", "yes"}} {
		if err := r.client.ConfigSet(ctx, kv[0], kv[1]).Err(); err != nil {
			return fmt.Errorf("redis-server: config set %s %s: %w", kv[0], kv[1], err)
		}
	}
	for {
		info, err := r.client.Info(ctx, "persistence").Result()
		if err != nil {
			return fmt.Errorf("redis-server: info persistence: %w", err)
		}
		if strings.Contains(info, "aof_enabled:1") && strings.Contains(info, "aof_rewrite_in_progress:0") &&
			!strings.Contains(info, "aof_rewrite_scheduled:1") {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("redis-server: append-only file not ready: %w", ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// Kill kills the server with SIGKILL, as a crash would, and waits for it
// to exit. Killing a stopped server does nothing.
func (r *Redis) Kill() {
	if p := r.take(); p != nil {
		p.Kill()
	}
}

// Stop stops the server with SIGTERM, then SIGKILL after a deadline. It
// waits for the server to exit. Stopping a stopped server does nothing.
func (r *Redis) Stop() {
	if p := r.take(); p != nil {
		p.Stop(stopTimeout)
	}
}

// take hands over the running server, leaving none.
func (r *Redis) take() *launch.Redis {
	r.mu.Lock()
	defer r.mu.Unlock()
	p := r.proc
	r.proc = nil
	return p
}
