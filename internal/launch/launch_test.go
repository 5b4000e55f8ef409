package launch_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/internal/launch"
	"github.com/tetherproxy/tether/internal/testenv"
)

// sh starts a shell script as a launched process and stops it when the
// test ends.
func sh(t *testing.T, script string) *launch.Proc {
	t.Helper()
	p, err := launch.Start("sh", exec.Command("/bin/sh", "-c", script), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Stop(time.Second) })
	return p
}

func wait(t *testing.T, p *launch.Proc) {
	t.Helper()
	select {
	case <-p.Done():
	case <-time.After(10 * time.Second):
		t.Fatalf("%s did not exit", p.Name())
	}
}

func TestStartKeepsOutputAndExitCode(t *testing.T) {
	p := sh(t, "echo out; echo err >&2; exit 3")
	wait(t, p)
	if !p.Exited() || p.ExitCode() != 3 {
		t.Errorf("exited %v, code %d; want 3", p.Exited(), p.ExitCode())
	}
	if out := p.Output(); !strings.Contains(out, "out\n") || !strings.Contains(out, "err\n") {
		t.Errorf("output %q lacks stdout or stderr", out)
	}
	if p.Stop(time.Second) {
		t.Error("Stop of an exited process killed it")
	}
}

func TestStartFailsForAMissingBinary(t *testing.T) {
	_, err := launch.Start("nothing", exec.Command(filepath.Join(t.TempDir(), "missing")), nil)
	if err == nil || !strings.Contains(err.Error(), "start nothing") {
		t.Errorf("err = %v, want it to name the process", err)
	}
}

func TestStopTermsThenKills(t *testing.T) {
	p := sh(t, "exec sleep 30")
	begun := time.Now()
	if p.Stop(5 * time.Second) {
		t.Error("a process that exits on SIGTERM was killed")
	}
	if !p.Exited() || time.Since(begun) > 4*time.Second {
		t.Errorf("exited %v after %v", p.Exited(), time.Since(begun))
	}

	// SIGTERM ignored (an ignored signal stays ignored across exec): Stop
	// kills at the bound.
	p = sh(t, `trap "" TERM; echo ready; exec sleep 30`)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.Poll(ctx, "ready", func(context.Context) error {
		if !strings.Contains(p.Output(), "ready") {
			return errors.New("not yet")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	begun = time.Now()
	if !p.Stop(300 * time.Millisecond) {
		t.Error("a process ignoring SIGTERM was not killed")
	}
	if took := time.Since(begun); !p.Exited() || took < 300*time.Millisecond || took > 5*time.Second {
		t.Errorf("exited %v after %v, want a kill at 300ms", p.Exited(), took)
	}
}

func TestPollEnds(t *testing.T) {
	notYet := func(context.Context) error { return errors.New("still cold") }

	p := sh(t, "echo boom; exit 1")
	err := p.Poll(context.Background(), "warmth", notYet)
	if err == nil || !strings.Contains(err.Error(), "exited") || !strings.Contains(err.Error(), "boom") ||
		!strings.Contains(err.Error(), "still cold") {
		t.Errorf("exit: err = %v, want it to say the process exited, its output and the last error", err)
	}

	p = sh(t, "exec sleep 30")
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	err = p.Poll(ctx, "warmth", notYet)
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "warmth") {
		t.Errorf("deadline: err = %v, want the deadline and what was awaited", err)
	}

	// Another process answers: the wait ends at once.
	err = p.Poll(context.Background(), "warmth", func(context.Context) error {
		return fmt.Errorf("someone else: %w", launch.ErrPortTaken)
	})
	if !errors.Is(err, launch.ErrPortTaken) || p.Exited() {
		t.Errorf("another process answering: err = %v, want %v at once", err, launch.ErrPortTaken)
	}

	n := 0
	err = p.Poll(context.Background(), "the third call", func(context.Context) error {
		if n++; n < 3 {
			return errors.New("not yet")
		}
		return nil
	})
	if err != nil || n != 3 {
		t.Errorf("err = %v after %d calls, want nil after 3", err, n)
	}
}

// TestPollSaysAPortWasTaken: a process that exits saying its address was
// in use (as redis-server, PostgreSQL, Envoy and Go programs do) fails the
// wait with ErrPortTaken, so a caller that drew the port can draw another.
// Any other exit does not.
func TestPollSaysAPortWasTaken(t *testing.T) {
	notYet := func(context.Context) error { return errors.New("not yet") }
	for _, tc := range []struct {
		output string
		taken  bool
	}{
		{"Could not create server TCP listening socket 127.0.0.1:22560: bind: Address already in use", true},
		{"listen tcp 127.0.0.1:9090: bind: address already in use", true},
		{"FATAL:  configuration file contains errors", false},
	} {
		p := sh(t, "echo '"+tc.output+"' >&2; exit 1")
		err := p.Poll(context.Background(), "warmth", notYet)
		if err == nil || errors.Is(err, launch.ErrPortTaken) != tc.taken || !strings.Contains(err.Error(), tc.output) {
			t.Errorf("exit saying %q: err = %v; want the output, and ErrPortTaken %v", tc.output, err, tc.taken)
		}
	}
}

// fakeTether writes a script that acts as `tether serve`: it checks its
// arguments, logs a line, then the ready line, and waits.
func fakeTether(t *testing.T, body string) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "tether")
	script := "#!/bin/sh\n" + body + "\n"
	if err := os.WriteFile(bin, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return bin
}

func TestStartTetherReadsTheReadyLine(t *testing.T) {
	bin := fakeTether(t, `[ "$1 $2 $3" = "serve --config /etc/t.toml" ] || { echo "args: $*" >&2; exit 2; }
echo '{"level":"info","message":"starting","secret_set":"'"$SECRET"'"}' >&2
printf '{"level":"info","extproc":"127.0.0.1:1001","admin":"127.0.0.1:1002",' >&2
sleep 0.1
echo '"xds":"127.0.0.1:1003","message":"tether ready"}' >&2
echo '{"level":"info","extproc":"127.0.0.1:9","admin":"127.0.0.1:9","message":"tether ready"}' >&2
exec sleep 30`)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	tt, err := launch.StartTether(ctx, launch.TetherOptions{Bin: bin, Config: "/etc/t.toml", Env: []string{"SECRET=yes"}})
	if err != nil {
		t.Fatal(err)
	}
	defer tt.Stop(time.Second)
	if tt.Extproc != "127.0.0.1:1001" || tt.Admin != "127.0.0.1:1002" || tt.XDS != "127.0.0.1:1003" {
		t.Errorf("addresses %q %q %q: want those of the first ready line", tt.Extproc, tt.Admin, tt.XDS)
	}
	if !strings.Contains(tt.Output(), `"secret_set":"yes"`) {
		t.Errorf("output %q: want the environment passed and the lines kept", tt.Output())
	}
}

func TestStartTetherFailsWhenItExits(t *testing.T) {
	bin := fakeTether(t, `echo '{"level":"error","message":"config: routing.mode \"x\": unknown"}' >&2; exit 1`)
	_, err := launch.StartTether(context.Background(), launch.TetherOptions{Bin: bin, Config: "t.toml"})
	if err == nil || !strings.Contains(err.Error(), "exited (code 1)") || !strings.Contains(err.Error(), "routing.mode") {
		t.Errorf("err = %v, want the exit and the log line", err)
	}
}

// TestStartReadyRefusesAReadyLineItCannotRead: a ready line whose fields
// do not decode fails the start rather than leaving them empty.
func TestStartReadyRefusesAReadyLineItCannotRead(t *testing.T) {
	cmd := exec.Command("/bin/sh", "-c", `echo '{"message":"up","addr":7}' >&2; exec sleep 30`)
	var ev struct{ Addr string }
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	p, err := launch.StartReady(ctx, "sh", cmd, nil, "up", &ev)
	if err == nil {
		p.Stop(time.Second)
	}
	if err == nil || !strings.Contains(err.Error(), "sh: ready line") {
		t.Errorf("err = %v, want the ready line refused", err)
	}
}

func TestStartRedis(t *testing.T) {
	bin, err := exec.LookPath("redis-server")
	testenv.Require(t, "redis-server", err)
	dir, err := os.MkdirTemp("", "tl") // a short path, for the socket
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := func(durable bool) (*launch.Redis, *goredis.Client) {
		t.Helper()
		r, err := launch.StartRedis(ctx, launch.RedisOptions{Bin: bin, Dir: dir, Durable: durable})
		if err != nil {
			t.Fatal(err)
		}
		c := goredis.NewClient(&goredis.Options{Network: "unix", Addr: r.Socket})
		t.Cleanup(func() { _ = c.Close(); r.Stop(10 * time.Second) })
		return r, c
	}

	r, c := start(true)
	if r.URL() != "unix://"+launch.RedisSocket(dir) {
		t.Errorf("URL %s, socket %s", r.URL(), launch.RedisSocket(dir))
	}
	// The proof holds for the server and for no other process.
	proof := launch.RedisProof(goredis.Options{Network: "unix", Addr: r.Socket})
	if err := proof(ctx, r.Proc); err != nil {
		t.Errorf("the proof of the server started: %v", err)
	}
	if err := proof(ctx, sh(t, "exec sleep 30")); !errors.Is(err, launch.ErrPortTaken) {
		t.Errorf("the proof of another process: err = %v, want %v", err, launch.ErrPortTaken)
	}
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	r.Kill() // as a crash; the append-only file keeps the write

	r, c = start(true) // on the socket the killed server left
	if v, err := c.Get(ctx, "k").Result(); err != nil || v != "v" {
		t.Errorf("durable restart: GET k = %q, %v; want the value written before the kill", v, err)
	}
	if r.Stop(10 * time.Second) {
		t.Error("redis-server was killed: SIGTERM should stop it")
	}

	_, c = start(false) // persistence off: the file is not loaded
	if n, err := c.DBSize(ctx).Result(); err != nil || n != 0 {
		t.Errorf("DBSIZE = %d, %v; want an empty data set", n, err)
	}
}

func TestStartEnvoyFindsAdminAndListener(t *testing.T) {
	bin := testenv.EnvoyBin(t)
	// One listener that answers every connection with a fixed reply.
	bootstrap := `
admin:
  address: {socket_address: {address: 127.0.0.1, port_value: 0}}
static_resources:
  listeners:
  - name: only
    address: {socket_address: {address: 127.0.0.1, port_value: 0}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.direct_response
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.direct_response.v3.Config
          response: {inline_string: launched}
`
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	e, err := launch.StartEnvoy(ctx, launch.EnvoyOptions{Bin: bin, Dir: t.TempDir(), Bootstrap: []byte(bootstrap)})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Stop(10 * time.Second)
	if !strings.HasPrefix(e.Admin, "http://127.0.0.1:") || e.Listener != "" {
		t.Errorf("admin %q, listener %q before WaitServing", e.Admin, e.Listener)
	}
	if err := e.WaitServing(ctx); err != nil {
		t.Fatal(err)
	}
	if e.URL() != "http://"+e.Listener {
		t.Errorf("URL %q for listener %q", e.URL(), e.Listener)
	}
	conn, err := net.DialTimeout("tcp", e.Listener, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
	reply, err := io.ReadAll(conn)
	if err != nil || string(reply) != "launched" {
		t.Errorf("the listener at %s answered %q, %v", e.Listener, reply, err)
	}
}

// TestStartEnvoyRefusesAnotherEnvoy: a process that names another
// Envoy's admin API as its own is not taken for the Envoy started.
func TestStartEnvoyRefusesAnotherEnvoy(t *testing.T) {
	bin := testenv.EnvoyBin(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	other, err := launch.StartEnvoy(ctx, launch.EnvoyOptions{Bin: bin, Dir: t.TempDir(),
		Bootstrap: []byte("admin:\n  address: {socket_address: {address: 127.0.0.1, port_value: 0}}\n")})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Stop(10 * time.Second)
	// Started as `envoy -c FILE --admin-address-path FILE …`, it writes the
	// other's admin address there and stays up.
	fake := filepath.Join(t.TempDir(), "envoy")
	script := "#!/bin/sh\nprintf '%s' " + strings.TrimPrefix(other.Admin, "http://") + " > \"$4\"\nexec sleep 30\n"
	if err := os.WriteFile(fake, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	e, err := launch.StartEnvoy(ctx, launch.EnvoyOptions{Bin: fake, Dir: t.TempDir(), Bootstrap: []byte("{}")})
	if err == nil {
		e.Stop(time.Second)
	}
	if !errors.Is(err, launch.ErrPortTaken) || ctx.Err() != nil {
		t.Errorf("err = %v, want %v at once", err, launch.ErrPortTaken)
	}
}

func TestStartEnvoyFailsOnABadBootstrap(t *testing.T) {
	bin := testenv.EnvoyBin(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := launch.StartEnvoy(ctx, launch.EnvoyOptions{Bin: bin, Dir: t.TempDir(), Bootstrap: []byte("admin: {address: 7}\n")})
	if err == nil || !strings.Contains(err.Error(), "exited") {
		t.Errorf("err = %v, want Envoy's exit", err)
	}
}
