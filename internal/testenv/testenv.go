// Package testenv starts and finds the real components tests run against:
// redis-server and Envoy. A missing component skips the test on a developer
// machine and fails it under CI=true, so CI can never go green by skipping.
package testenv

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/internal/syncbuf"
)

const (
	startTimeout = 10 * time.Second
	stopTimeout  = 10 * time.Second
)

// Require skips (or, under CI=true, fails) the test when err says a
// component it needs is missing. A nil err means the component is there.
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

// RepoRoot is the directory holding go.mod, found by walking up from the
// working directory (a test's working directory is its package directory).
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("repo root: %w", err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("repo root: no go.mod above the working directory")
		}
		dir = parent
	}
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
	proc    *process // the current server; nil while stopped
	durable bool     // Durable was called: restarts load the append-only file
}

// RedisServer starts redis-server ($REDIS_SERVER_BIN, else from PATH) with
// persistence off, waits until it answers PING and stops it when the test
// ends. It skips or fails the test (see Require) when the binary is missing.
func RedisServer(t testing.TB) *Redis {
	t.Helper()
	bin := redisBin(t, "redis-server", "REDIS_SERVER_BIN")

	// Unix socket paths are limited to about 100 bytes; t.TempDir() paths
	// carry the test name and can exceed that.
	dir, err := os.MkdirTemp("", "tr")
	if err != nil {
		t.Fatalf("redis-server: %v", err)
	}
	r := &Redis{t: t, bin: bin, dir: dir, sock: filepath.Join(dir, "r.sock")}
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
		// Fail fast while the server is stopped (outage tests): one dial
		// per attempt instead of five with back-off.
		DialerRetries:         1,
		ContextTimeoutEnabled: true,
	})
	r.Start()
	return r
}

// redisBin returns the binary named by the environment variable env, else
// name from PATH, skipping or failing the test (see Require) when missing.
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

// Start starts the server (again, after Stop or Kill) on the same socket
// and waits until it answers. The data set starts empty (persistence is
// off) unless Durable was called: then it is what the append-only file
// holds.
func (r *Redis) Start() {
	r.t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.proc != nil {
		return
	}
	_ = os.Remove(r.sock) // a stale socket from a killed server
	aof := "no"
	if r.durable {
		aof = "yes"
	}
	p, err := startProcess(r.bin,
		"--port", "0",
		"--unixsocket", r.sock,
		"--unixsocketperm", "700",
		"--dir", r.dir,
		"--save", "",
		"--appendonly", aof,
		"--appendfsync", "always",
		"--daemonize", "no",
		"--logfile", "",
	)
	if err != nil {
		r.t.Fatalf("redis-server: start: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	if err := waitPing(ctx, &goredis.Options{Network: "unix", Addr: r.sock}, p.done); err != nil {
		p.kill()
		r.t.Fatalf("redis-server did not become ready: %v\n%s", err, p.out.String())
	}
	r.proc = p
}

// Durable turns on the append-only file with an fsync per write, on the
// running server and for its restarts, and waits until the file holds the
// data set: from then on Kill loses nothing, as on a production Redis
// with persistence.
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
	r.mu.Lock()
	p := r.proc
	r.proc = nil
	r.mu.Unlock()
	if p != nil {
		p.kill()
	}
}

// Stop stops the server (SIGTERM, then SIGKILL after a deadline) and waits
// for it to exit. Stopping a stopped server does nothing.
func (r *Redis) Stop() {
	r.mu.Lock()
	p := r.proc
	r.proc = nil
	r.mu.Unlock()
	if p != nil {
		p.stop()
	}
}

// process is a started child process and its combined output.
type process struct {
	cmd  *exec.Cmd
	out  *syncbuf.Buffer // stdout and stderr
	done chan struct{}   // closed when the process has exited
}

func startProcess(bin string, args ...string) (*process, error) {
	cmd := exec.Command(bin, args...)
	out := &syncbuf.Buffer{}
	cmd.Stdout, cmd.Stderr = out, out
	setDeathSignal(cmd)
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &process{cmd: cmd, out: out, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// stop sends SIGTERM, then SIGKILL after stopTimeout, and waits for the exit.
func (p *process) stop() {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(stopTimeout):
		p.kill()
	}
}

// kill kills the process and waits for it to exit.
func (p *process) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// waitPing polls PING on the server o names until it answers, the process
// dies (done) or ctx ends.
func waitPing(ctx context.Context, o *goredis.Options, done <-chan struct{}) error {
	o.MaxRetries = -1 // this loop is the retry
	o.DialerRetries = 1
	o.DialTimeout = time.Second
	o.ContextTimeoutEnabled = true
	probe := goredis.NewClient(o)
	defer probe.Close()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		err := probe.Ping(ctx).Err()
		if err == nil {
			return nil
		}
		select {
		case <-done:
			return fmt.Errorf("process exited: last ping: %w", err)
		case <-ctx.Done():
			return fmt.Errorf("%w: last ping: %v", ctx.Err(), err)
		case <-tick.C:
		}
	}
}
