package testenv

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/tetherproxy/tether/internal/launch"
)

const (
	// initdbTimeout bounds initdb. It takes about a second on an idle
	// machine, 4 to 6 s on a loaded one.
	initdbTimeout = time.Minute
	// postgresReadyTimeout bounds one start of the server, until it
	// accepts a connection. That is well under a second when idle.
	postgresReadyTimeout = 15 * time.Second
	// postgresUser is the superuser of a test server. It logs in without a
	// password (trust), over 127.0.0.1 or the unix socket.
	postgresUser = "tether"
)

// noPostgresError is what makes a test skip, or fail under CI=true. The
// binaries are not installed, or nobody but root could run them.
type noPostgresError struct{ msg string }

func (e *noPostgresError) Error() string { return e.msg }

func isNoPostgres(err error) bool {
	var e *noPostgresError
	return errors.As(err, &e)
}

// Postgres starts a PostgreSQL server private to the test and returns its
// DSN: superuser "tether", database "postgres", 127.0.0.1 on a free port,
// sslmode=disable. The server runs with fsync off in a temporary
// directory. That directory also holds its unix socket. The test's cleanup
// stops the server and removes the directory. Postgres skips or fails the
// test (see Require) when the binaries are missing.
//
// The binaries are found in this order:
//   - $POSTGRES_BIN_DIR;
//   - the directory of `postgres` on PATH, symbolic links followed;
//   - the newest /usr/lib/postgresql/<major>/bin. That is Debian's place,
//     off PATH. `make tools` installs the package.
//
// PostgreSQL refuses to run as root. Under root, initdb and the server
// run as the "postgres" system user the Debian package creates.
//
// A test package with several PostgreSQL tests shares one server with a
// SharedPostgres instead, since initdb takes about a second.
func Postgres(t testing.TB) string {
	t.Helper()
	s, err := startPostgres(loopbackPort)
	if isNoPostgres(err) {
		Require(t, "postgresql", err)
		return ""
	}
	if err != nil {
		t.Fatalf("postgresql: %v", err)
	}
	t.Cleanup(s.stop)
	return s.dsn
}

// SharedPostgres is one PostgreSQL server for a whole test package,
// started by the first test that asks for it. Declare it next to TestMain
// and call Stop after the tests have run:
//
//	var pg testenv.SharedPostgres
//
//	func TestMain(m *testing.M) {
//		code := m.Run()
//		pg.Stop()
//		os.Exit(code)
//	}
//
// Tests share the server: each should work in its own database, schema or
// tables.
type SharedPostgres struct {
	once sync.Once
	s    *postgresServer
	err  error
}

// DSN starts the server on first use and returns its DSN (see Postgres).
// It skips or fails the test when the binaries are missing. It fails the
// test when the server did not start. Every later caller then fails the
// same way.
func (p *SharedPostgres) DSN(t testing.TB) string {
	t.Helper()
	p.once.Do(func() { p.s, p.err = startPostgres(loopbackPort) })
	if isNoPostgres(p.err) {
		Require(t, "postgresql", p.err)
		return ""
	}
	if p.err != nil {
		t.Fatalf("postgresql: %v", p.err)
	}
	return p.s.dsn
}

// Stop stops the server, if one was started, and removes its directory.
func (p *SharedPostgres) Stop() {
	p.once.Do(func() { p.err = errors.New("stopped") }) // never start after Stop
	if p.s != nil {
		p.s.stop()
	}
}

// postgresServer is a running server and the directory it owns.
type postgresServer struct {
	dir  string
	dsn  string
	proc *launch.Proc
}

// stop asks for a fast shutdown with SIGINT, which disconnects clients.
// SIGTERM would wait for them. stop kills the server after stopTimeout,
// and removes its directory.
func (s *postgresServer) stop() {
	s.proc.StopWith(syscall.SIGINT, stopTimeout)
	_ = os.RemoveAll(s.dir)
}

// startPostgres runs initdb in a new directory and starts the server on a
// port from draw.
func startPostgres(draw func() (int, error)) (*postgresServer, error) {
	bin, err := postgresBinDir()
	if err != nil {
		return nil, err
	}
	cred, err := postgresCredential()
	if err != nil {
		return nil, err
	}
	// Under /tmp, not t.TempDir(). The postgres user must reach it, and a
	// unix socket path must stay under about 100 bytes.
	base := ""
	if cred != nil {
		base = "/tmp"
	}
	dir, err := os.MkdirTemp(base, "tpg")
	if err != nil {
		return nil, err
	}
	if cred != nil {
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			_ = os.RemoveAll(dir)
			return nil, err
		}
	}
	s, err := startPostgresIn(bin, dir, cred, draw)
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	return s, nil
}

func startPostgresIn(bin, dir string, cred *syscall.Credential, draw func() (int, error)) (*postgresServer, error) {
	ctx, cancel := context.WithTimeout(context.Background(), initdbTimeout)
	defer cancel()
	data := filepath.Join(dir, "data")
	initdb := postgresCommand(ctx, cred, dir, filepath.Join(bin, "initdb"),
		"-D", data, "-U", postgresUser, "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync")
	ip, err := launch.Start("initdb", initdb, nil)
	if err != nil {
		return nil, err
	}
	if <-ip.Done(); ip.ExitCode() != 0 {
		return nil, fmt.Errorf("initdb: exit code %d (%w)\n%s", ip.ExitCode(), ctx.Err(), ip.Output())
	}
	return onFreePort(draw, func(port int) (*postgresServer, error) {
		cmd := postgresCommand(context.Background(), cred, dir, filepath.Join(bin, "postgres"),
			"-D", data,
			"-c", "listen_addresses=127.0.0.1",
			"-c", "port="+strconv.Itoa(port),
			"-c", "unix_socket_directories="+dir,
			"-c", "fsync=off",
			"-c", "synchronous_commit=off",
			"-c", "full_page_writes=off",
			"-c", "max_connections=100",
			"-c", "shared_buffers=32MB",
			"-c", "logging_collector=off",
		)
		dsn := fmt.Sprintf("postgres://%s@127.0.0.1:%d/postgres?sslmode=disable", postgresUser, port)
		ctx, cancel := context.WithTimeout(context.Background(), postgresReadyTimeout)
		defer cancel()
		p, err := launch.StartProven(ctx, "postgres", cmd, nil, "a connection to its data directory", postgresProof(dsn, data))
		if err != nil {
			return nil, fmt.Errorf("postgres on port %d: %w", port, err)
		}
		return &postgresServer{dir: dir, dsn: dsn, proc: p}, nil
	})
}

// postgresCommand builds a command that runs as cred in dir. A nil cred
// runs as the test binary's user. The command uses the C locale, so
// messages are stable to match. launch.Start adds the death signal of the
// test's other servers.
func postgresCommand(ctx context.Context, cred *syscall.Credential, dir, bin string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "LC_ALL=C", "LANG=C")
	if cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	}
	return cmd
}

// postgresProof is the proof of the PostgreSQL server at dsn (see
// launch.StartProven). It connects, and checks that the server's data
// directory is data. Another directory means another server holds the
// port.
func postgresProof(dsn, data string) func(context.Context, *launch.Proc) error {
	return func(ctx context.Context, _ *launch.Proc) error {
		ctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		c, err := pgconn.Connect(ctx, dsn)
		if err != nil {
			return err
		}
		defer func() { _ = c.Close(ctx) }()
		rs, err := c.Exec(ctx, "SHOW data_directory").ReadAll()
		if err != nil {
			return fmt.Errorf("show data_directory: %w", err)
		}
		if len(rs) != 1 || len(rs[0].Rows) != 1 || len(rs[0].Rows[0]) != 1 {
			return errors.New("show data_directory: not one value")
		}
		if got := string(rs[0].Rows[0][0]); got != data {
			return fmt.Errorf("the server at %s serves %s, not %s: %w", c.Conn().RemoteAddr(), got, data, launch.ErrPortTaken)
		}
		return nil
	}
}

// postgresBinDir finds the directory holding initdb and postgres.
func postgresBinDir() (string, error) {
	has := func(dir string) bool {
		return executable(filepath.Join(dir, "postgres")) == nil && executable(filepath.Join(dir, "initdb")) == nil
	}
	if dir := os.Getenv("POSTGRES_BIN_DIR"); dir != "" {
		if !has(dir) {
			return "", &noPostgresError{"POSTGRES_BIN_DIR=" + dir + " lacks postgres or initdb"}
		}
		return dir, nil
	}
	if p, err := exec.LookPath("postgres"); err == nil {
		if r, err := filepath.EvalSymlinks(p); err == nil {
			p = r
		}
		if dir := filepath.Dir(p); has(dir) {
			return dir, nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	slices.SortFunc(dirs, func(a, b string) int { // newest first: 15 > 9.6
		return compareVersions(filepath.Base(filepath.Dir(b)), filepath.Base(filepath.Dir(a)))
	})
	for _, dir := range dirs {
		if has(dir) {
			return dir, nil
		}
	}
	return "", &noPostgresError{"no postgres and initdb on PATH or in /usr/lib/postgresql/*/bin"}
}

// compareVersions compares dotted numeric versions ("9.6" < "15").
func compareVersions(a, b string) int {
	as, bs := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; i < len(as) || i < len(bs); i++ {
		var x, y int
		if i < len(as) {
			x, _ = strconv.Atoi(as[i])
		}
		if i < len(bs) {
			y, _ = strconv.Atoi(bs[i])
		}
		if x != y {
			return x - y
		}
	}
	return 0
}

// postgresCredential is nil unless the test runs as root. Then it is the
// "postgres" system user's, since PostgreSQL refuses to run as root.
func postgresCredential() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, &noPostgresError{"running as root, and no postgres user to run the server as: " + err.Error()}
	}
	uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
	gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
	if err := errors.Join(err1, err2); err != nil {
		return nil, fmt.Errorf("postgres user: %w", err)
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}
