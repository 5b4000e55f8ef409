package testenv

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"
)

// fakeTB records what Require does instead of ending the test.
type fakeTB struct {
	testing.TB
	fatal, skip string
}

func (f *fakeTB) Helper()                        {}
func (f *fakeTB) Fatalf(format string, a ...any) { f.fatal = fmt.Sprintf(format, a...) }
func (f *fakeTB) Skipf(format string, a ...any)  { f.skip = fmt.Sprintf(format, a...) }

func TestRequire(t *testing.T) {
	missing := errors.New("not in PATH")
	tests := []struct {
		name      string
		ci        string
		err       error
		wantFatal bool
		wantSkip  bool
	}{
		{"present", "true", nil, false, false},
		{"missing locally skips", "", missing, false, true},
		{"missing under CI fails", "true", missing, true, false},
		{"CI must be exactly true", "1", missing, false, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv("CI", tt.ci)
			f := &fakeTB{TB: t}
			Require(f, "widget", tt.err)
			if got := f.fatal != ""; got != tt.wantFatal {
				t.Errorf("fatal = %q, want fatal: %v", f.fatal, tt.wantFatal)
			}
			if got := f.skip != ""; got != tt.wantSkip {
				t.Errorf("skip = %q, want skip: %v", f.skip, tt.wantSkip)
			}
			for _, msg := range []string{f.fatal, f.skip} {
				if msg != "" && (!strings.Contains(msg, "widget") || !strings.Contains(msg, "make tools")) {
					t.Errorf("message %q should name the component and `make tools`", msg)
				}
			}
		})
	}
}

func TestEnvoyBinFromEnv(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "envoy")
	if err := os.WriteFile(bin, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("ENVOY_BIN", bin)
	if got := EnvoyBin(t); got != bin {
		t.Errorf("EnvoyBin() = %q, want %q", got, bin)
	}

	t.Setenv("CI", "true")
	t.Setenv("ENVOY_BIN", filepath.Join(dir, "missing"))
	f := &fakeTB{TB: t}
	EnvoyBin(f)
	if !strings.Contains(f.fatal, "envoy") {
		t.Errorf("missing ENVOY_BIN under CI: fatal = %q, want a failure naming envoy", f.fatal)
	}
}

func TestRepoRoot(t *testing.T) {
	root, err := RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "internal", "testenv")); err != nil {
		t.Errorf("RepoRoot() = %q does not hold internal/testenv: %v", root, err)
	}
}

// TestRepoRootSkipsNestedModules: from a package of a module below the
// root (lab/, e2e/), RepoRoot is the root, the product's module.
func TestRepoRootSkipsNestedModules(t *testing.T) {
	tmp := t.TempDir()
	pkg := filepath.Join(tmp, "e2e", "pkg")
	if err := os.MkdirAll(pkg, 0o755); err != nil {
		t.Fatal(err)
	}
	for dir, mod := range map[string]string{
		tmp:                       "module github.com/tetherproxy/tether // the product\n\ngo 1.26\n",
		filepath.Join(tmp, "e2e"): "// e2e\nmodule \"github.com/tetherproxy/tether/e2e\"\n",
	} {
		if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte(mod), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	t.Chdir(pkg)
	root, err := RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	// The temporary directory may sit behind a symbolic link (macOS /var).
	want, _ := filepath.EvalSymlinks(tmp)
	if got, _ := filepath.EvalSymlinks(root); got != want {
		t.Errorf("RepoRoot() = %q, want %q (the product's go.mod, not e2e's)", root, tmp)
	}
}

func TestRedisServerStopStart(t *testing.T) {
	r := RedisServer(t)
	if !strings.HasPrefix(r.URL(), "unix:///") || len(r.sock) > 100 {
		t.Errorf("URL() = %q, want a short unix:// socket path", r.URL())
	}
	ctx := t.Context()
	c := r.Client()
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET: %v", err)
	}

	r.Stop()
	r.Stop() // idempotent
	pingStart := time.Now()
	if err := c.Ping(ctx).Err(); err == nil {
		t.Fatal("PING answered with the server stopped")
	}
	t.Logf("PING failed after %v with the server stopped", time.Since(pingStart))

	start := time.Now()
	r.Start()
	t.Logf("restart took %v", time.Since(start))
	deadline := time.Now().Add(5 * time.Second)
	var err error
	for time.Now().Before(deadline) {
		if err = c.Ping(ctx).Err(); err == nil {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("client did not reconnect after Start: %v", err)
	}
	t.Logf("client reconnected %v after Start began", time.Since(start))
	if n, err := c.Exists(ctx, "k").Result(); err != nil || n != 0 {
		t.Errorf("EXISTS k after restart = %d, %v; want 0 (no persistence)", n, err)
	}
}

func TestRedisCluster(t *testing.T) {
	start := time.Now()
	c := RedisCluster(t)
	t.Logf("cluster of %v formed in %v", c.Addrs(), time.Since(start))
	ctx := t.Context()
	client := c.Client()
	if len(c.Addrs()) != 3 {
		t.Fatalf("Addrs() = %v, want 3 masters", c.Addrs())
	}
	// Keys spread over the slots land on every master.
	for i := range 64 {
		if err := client.Set(ctx, fmt.Sprint("k", i), "v", 0).Err(); err != nil {
			t.Fatalf("SET k%d: %v", i, err)
		}
	}
	var masters atomic.Int32 // ForEachMaster runs concurrently
	err := client.ForEachMaster(ctx, func(ctx context.Context, m *goredis.Client) error {
		n, err := m.DBSize(ctx).Result()
		if n > 0 {
			masters.Add(1)
		}
		return err
	})
	if err != nil || masters.Load() != 3 {
		t.Errorf("masters holding keys = %d (err %v), want 3", masters.Load(), err)
	}
	// A multi-key command across slots is refused: this is a real cluster.
	node := goredis.NewClient(&goredis.Options{Addr: c.Addrs()[0]})
	defer node.Close()
	if err := node.MGet(ctx, "a", "b", "c").Err(); err == nil || !strings.Contains(err.Error(), "CROSSSLOT") && !strings.Contains(err.Error(), "MOVED") {
		t.Errorf("MGET across slots on one node: err = %v, want CROSSSLOT or MOVED", err)
	}
}

func TestRedisSentinel(t *testing.T) {
	start := time.Now()
	s := RedisSentinel(t, "sentinel-test-password")
	t.Logf("master %s behind sentinel %s ready in %v; URL %s", s.MasterAddr(), s.Addr(), time.Since(start), s.URL())
	ctx := t.Context()
	c := goredis.NewFailoverClient(&goredis.FailoverOptions{
		MasterName:            SentinelMaster,
		SentinelAddrs:         []string{s.Addr()},
		Password:              "sentinel-test-password",
		ContextTimeoutEnabled: true,
	})
	defer c.Close()
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET through the sentinel: %v", err)
	}
	// The write reached the master the sentinel names.
	m := goredis.NewClient(&goredis.Options{Addr: s.MasterAddr(), Password: "sentinel-test-password"})
	defer m.Close()
	if v, err := m.Get(ctx, "k").Result(); err != nil || v != "v" {
		t.Errorf("GET k on the master = %q, %v; want \"v\"", v, err)
	}
	if want := "redis+sentinel://" + s.Addr() + "?master_name=mymaster&password=sentinel-test-password"; s.URL() != want {
		t.Errorf("URL() = %q, want %q", s.URL(), want)
	}
}

func TestRedisSentinelFailover(t *testing.T) {
	const password = "sentinel-test-password"
	start := time.Now()
	s := RedisSentinelWithReplica(t, password)
	old, replica := s.MasterAddr(), s.ReplicaAddr()
	t.Logf("master %s, replica %s behind sentinel %s ready in %v", old, replica, s.Addr(), time.Since(start))
	ctx := t.Context()
	c := goredis.NewFailoverClient(&goredis.FailoverOptions{
		MasterName:            SentinelMaster,
		SentinelAddrs:         []string{s.Addr()},
		Password:              password,
		ContextTimeoutEnabled: true,
	})
	defer c.Close()
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET through the sentinel: %v", err)
	}
	start = time.Now()
	master, err := s.Failover(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("failover to %s in %v", master, time.Since(start))
	if master != replica || s.MasterAddr() != replica || s.ReplicaAddr() != old {
		t.Fatalf("after Failover: returned %s, master %s, replica %s; want master %s, replica %s", master, s.MasterAddr(), s.ReplicaAddr(), replica, old)
	}
	// The write reached the new master before the failover.
	m := goredis.NewClient(&goredis.Options{Addr: master, Password: password})
	defer m.Close()
	if v, err := m.Get(ctx, "k").Result(); err != nil || v != "v" {
		t.Errorf("GET k on the new master = %q, %v; want \"v\"", v, err)
	}
	start = time.Now()
	if err := s.WaitDemoted(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("old master a replica of the new one %v after the failover", time.Since(start))
	if err := c.Set(ctx, "k", "w", 0).Err(); err != nil {
		t.Errorf("SET through the sentinel after the failover: %v", err)
	}
}
