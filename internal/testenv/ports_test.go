package testenv

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/internal/launch"
)

// takenFirst is a port draw that hands out taken first, then ports from
// next. drawn records every port handed out.
func takenFirst(taken int, next func() (int, error), drawn *[]int) func() (int, error) {
	return func() (int, error) {
		port := taken
		if len(*drawn) > 0 {
			var err error
			if port, err = next(); err != nil {
				return 0, err
			}
		}
		*drawn = append(*drawn, port)
		return port, nil
	}
}

// portOf is the port of a host:port or of a URL's host.
func portOf(t *testing.T, addr string) int {
	t.Helper()
	if u, err := url.Parse(addr); err == nil && u.Host != "" {
		addr = u.Host
	}
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	port, err := strconv.Atoi(p)
	if err != nil {
		t.Fatal(err)
	}
	return port
}

func TestOnFreePort(t *testing.T) {
	taken := fmt.Errorf("bind: %w", launch.ErrPortTaken)
	broken := errors.New("bad config")
	for _, tc := range []struct {
		name    string
		results []error // start's result for each port drawn; nil starts
		draws   int
		want    error
	}{
		{"first port", []error{nil}, 1, nil},
		{"taken, then free", []error{taken, taken, nil}, 3, nil},
		{"another failure ends it", []error{taken, broken}, 2, broken},
		{"always taken", nil, portAttempts, launch.ErrPortTaken},
	} {
		t.Run(tc.name, func(t *testing.T) {
			next := 100
			draw := func() (int, error) { next++; return next, nil }
			var tried []int
			port, err := onFreePort(draw, func(port int) (int, error) {
				tried = append(tried, port)
				if i := len(tried) - 1; i < len(tc.results) {
					return port, tc.results[i]
				}
				return 0, taken
			})
			if !errors.Is(err, tc.want) || (tc.want == nil) != (err == nil) || len(tried) != tc.draws {
				t.Fatalf("err = %v after %d draws, want %v after %d", err, len(tried), tc.want, tc.draws)
			}
			if err == nil && port != tried[len(tried)-1] {
				t.Errorf("port %d, want the last drawn, %d", port, tried[len(tried)-1])
			}
		})
	}
	drawErr := errors.New("no ports")
	if _, err := onFreePort(func() (int, error) { return 0, drawErr }, func(int) (int, error) { return 0, nil }); !errors.Is(err, drawErr) {
		t.Errorf("a failed draw: err = %v, want %v", err, drawErr)
	}
}

// redisArgs is the command line of a plain redis-server on a port, in dir,
// asking for password unless it is empty.
func redisArgs(dir, password string) func(port int) ([]string, error) {
	return func(port int) ([]string, error) {
		args := []string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--dir", dir,
			"--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", ""}
		if password != "" {
			args = append(args, "--requirepass", password)
		}
		return args, nil
	}
}

// redisPid is the process_id of the redis-server at addr.
func redisPid(ctx context.Context, addr, password string) (int, error) {
	c := goredis.NewClient(&goredis.Options{Addr: addr, Password: password})
	defer c.Close()
	info, err := c.Info(ctx, "server").Result()
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "process_id:"); ok {
			return strconv.Atoi(v)
		}
	}
	return 0, fmt.Errorf("no process_id in INFO of %s", addr)
}

// TestStartOnFreePortRefusesAForeignServer: drawn a port where another
// redis-server answers (as another test package's may, go test running
// packages at once), startOnFreePort does not take that server for the
// one it started. It draws another port and returns a server whose INFO
// names its own pid, whichever of the two asks for a password.
func TestStartOnFreePortRefusesAForeignServer(t *testing.T) {
	bin := redisBin(t, "redis-server", "REDIS_SERVER_BIN")
	for _, tc := range []struct{ name, foreign, ours string }{
		{"no password", "", ""},
		{"the other asks for one", "their-password", ""},
		{"ours asks for one", "", "our-password"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), startTimeout)
			defer cancel()
			fp, faddr, err := startOnFreePort(ctx, bin, drawClusterPort, goredis.Options{Password: tc.foreign}, redisArgs(t.TempDir(), tc.foreign))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { fp.Stop(stopTimeout) })

			var drawn []int
			p, addr, err := startOnFreePort(ctx, bin, takenFirst(portOf(t, faddr), drawClusterPort, &drawn),
				goredis.Options{Password: tc.ours}, redisArgs(t.TempDir(), tc.ours))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { p.Stop(stopTimeout) })
			if addr == faddr || len(drawn) < 2 {
				t.Fatalf("started on %s after drawing %v; want a port other than the taken %s", addr, drawn, faddr)
			}
			for _, s := range []struct {
				addr, password string
				proc           *launch.Proc
			}{{faddr, tc.foreign, fp}, {addr, tc.ours, p}} {
				if pid, err := redisPid(ctx, s.addr, s.password); err != nil || pid != s.proc.Pid() {
					t.Errorf("%s answers as process %d (%v), want %d", s.addr, pid, err, s.proc.Pid())
				}
			}
		})
	}
}

// TestStartPrometheusRefusesAForeignServer: drawn a port where another
// Prometheus answers, startPrometheus draws another port rather than take
// it for its own.
func TestStartPrometheusRefusesAForeignServer(t *testing.T) {
	const config = "global:\n  scrape_interval: 1m\n"
	foreign := PrometheusServer(t, config)
	bin := redisBin(t, "prometheus", "PROMETHEUS_BIN")
	dir := t.TempDir()
	cfg := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfg, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	var drawn []int
	prom, err := startPrometheus(bin, cfg, filepath.Join(dir, "data"), takenFirst(portOf(t, foreign.URL), loopbackPort, &drawn))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { prom.p.Stop(stopTimeout) })
	if prom.URL == foreign.URL || len(drawn) < 2 {
		t.Fatalf("started at %s after drawing %v; want a port other than the taken %s", prom.URL, drawn, foreign.URL)
	}
	ctx, cancel := context.WithTimeout(t.Context(), startTimeout)
	defer cancel()
	if err := prometheusProof(prom.URL, cfg)(ctx, prom.p); err != nil {
		t.Errorf("the Prometheus started: %v", err)
	}
	if err := prometheusProof(foreign.URL, cfg)(ctx, prom.p); !errors.Is(err, launch.ErrPortTaken) {
		t.Errorf("the other Prometheus: err = %v, want %v", err, launch.ErrPortTaken)
	}
}

// TestStartPostgresRefusesAForeignServer: drawn a port where another
// PostgreSQL answers (with the same user, trusted, as every test server),
// startPostgres draws another port rather than take it for its own.
func TestStartPostgresRefusesAForeignServer(t *testing.T) {
	foreign, err := startPostgres(loopbackPort)
	if isNoPostgres(err) {
		Require(t, "postgresql", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(foreign.stop)
	var drawn []int
	s, err := startPostgres(takenFirst(portOf(t, foreign.dsn), loopbackPort, &drawn))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.stop)
	if s.dsn == foreign.dsn || len(drawn) < 2 {
		t.Fatalf("started at %s after drawing %v; want a port other than the taken %s", s.dsn, drawn, foreign.dsn)
	}
	ctx, cancel := context.WithTimeout(t.Context(), startTimeout)
	defer cancel()
	data := filepath.Join(s.dir, "data")
	if err := postgresProof(s.dsn, data)(ctx, s.proc); err != nil {
		t.Errorf("the server started: %v", err)
	}
	if err := postgresProof(foreign.dsn, data)(ctx, s.proc); !errors.Is(err, launch.ErrPortTaken) {
		t.Errorf("the other server: err = %v, want %v", err, launch.ErrPortTaken)
	}
}
