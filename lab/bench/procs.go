package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/BurntSushi/toml"
	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/syncbuf"
	"github.com/tetherproxy/tether/xds"
)

// proc is one child process; its output is kept for error reports.
type proc struct {
	name string
	cmd  *exec.Cmd
	out  *syncbuf.Buffer
	done chan struct{}
}

func start(name string, bin string, args ...string) (*proc, error) {
	p := &proc{name: name, cmd: exec.Command(bin, args...), out: &syncbuf.Buffer{}, done: make(chan struct{})}
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	go func() { _ = p.cmd.Wait(); close(p.done) }()
	return p, nil
}

// stop sends SIGTERM and waits (bounded), then kills.
func (p *proc) stop() {
	if p == nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// cpuSeconds is the user+system CPU time the process has used.
func (p *proc) cpuSeconds() (float64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.cmd.Process.Pid))
	if err != nil {
		return 0, err
	}
	// Fields after the command name, which is in parentheses and may hold spaces.
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return 0, errors.New("short /proc stat")
	}
	ut, _ := strconv.ParseFloat(f[11], 64)
	st, _ := strconv.ParseFloat(f[12], 64)
	return (ut + st) / 100, nil // USER_HZ is 100 on Linux
}

// poll calls cond (with a context bounded by d) until it holds, the
// process exits, or the deadline passes.
func poll(ctx context.Context, p *proc, d time.Duration, what string, cond func(context.Context) bool) error {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for !cond(ctx) {
		if p != nil && p.exited() {
			return fmt.Errorf("%s exited while waiting for %s:\n%s", p.name, what, tail(p.out.String(), 2000))
		}
		select {
		case <-ctx.Done():
			msg := ""
			if p != nil {
				msg = "\n" + tail(p.out.String(), 2000)
			}
			return fmt.Errorf("waiting for %s: %w%s", what, ctx.Err(), msg)
		case <-t.C:
		}
	}
	return nil
}

func tail(s string, n int) string {
	if len(s) > n {
		return "…" + s[len(s)-n:]
	}
	return s
}

// redisServer is a redis-server on a unix socket in dir.
type redisServer struct {
	*proc
	url    string
	client *goredis.Client
}

func startRedis(ctx context.Context, bin, dir string) (*redisServer, error) {
	sock := filepath.Join(dir, "r.sock")
	p, err := start("redis-server", bin, "--port", "0", "--unixsocket", sock, "--save", "", "--appendonly", "no")
	if err != nil {
		return nil, err
	}
	r := &redisServer{proc: p, url: "unix://" + sock, client: goredis.NewClient(&goredis.Options{Network: "unix", Addr: sock})}
	if err := poll(ctx, p, 10*time.Second, "redis-server", func(ctx context.Context) bool { return r.client.Ping(ctx).Err() == nil }); err != nil {
		r.close()
		return nil, err
	}
	return r, nil
}

func (r *redisServer) close() {
	if r == nil {
		return
	}
	_ = r.client.Close()
	r.stop()
}

// tetherProc is a running `tether serve`.
type tetherProc struct {
	*proc
	extproc, admin, xds string
	configPath          string
}

func startTether(ctx context.Context, bin, dir, secret string, cfg config.Config) (*tetherProc, error) {
	path := filepath.Join(dir, "tether.toml")
	var b bytes.Buffer
	if err := toml.NewEncoder(&b).Encode(cfg); err != nil {
		return nil, err
	}
	if err := os.WriteFile(path, b.Bytes(), 0o600); err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, "serve", "--config", path)
	cmd.Env = append(os.Environ(), "TETHER_IDENTITY_SECRET="+secret)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	p := &proc{name: "tether", cmd: cmd, out: &syncbuf.Buffer{}, done: make(chan struct{})}
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start tether: %w", err)
	}
	t := &tetherProc{proc: p, configPath: path}
	var mu sync.Mutex
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			fmt.Fprintln(p.out, line)
			var ev struct{ Message, Extproc, Admin, XDS string }
			if json.Unmarshal([]byte(line), &ev) == nil && ev.Message == "tether ready" {
				mu.Lock()
				t.extproc, t.admin, t.xds = ev.Extproc, ev.Admin, ev.XDS
				mu.Unlock()
			}
		}
		_, _ = io.Copy(io.Discard, stderr)
		_ = cmd.Wait()
		close(p.done)
	}()
	err = poll(ctx, p, 20*time.Second, "tether ready", func(context.Context) bool { mu.Lock(); defer mu.Unlock(); return t.admin != "" })
	if err != nil {
		t.stop()
		return nil, err
	}
	return t, nil
}

// envoyProc is Envoy on the ADS bootstrap.
type envoyProc struct {
	*proc
	admin string // http://host:port
	url   string // http://host:port of the listener
}

func startEnvoy(ctx context.Context, bin, dir, ads string) (*envoyProc, error) {
	b, err := xds.ADSBootstrap("tether-bench", "127.0.0.1:0", ads)
	if err != nil {
		return nil, err
	}
	y, err := xds.YAML(b, "")
	if err != nil {
		return nil, err
	}
	cfgPath, adminPath := filepath.Join(dir, "envoy.yaml"), filepath.Join(dir, "envoy-admin.addr")
	_ = os.Remove(adminPath)
	if err := os.WriteFile(cfgPath, y, 0o600); err != nil {
		return nil, err
	}
	p, err := start("envoy", bin, "-c", cfgPath, "--admin-address-path", adminPath,
		"--disable-hot-restart", "--concurrency", "1", "--log-level", "error")
	if err != nil {
		return nil, err
	}
	e := &envoyProc{proc: p}
	err = poll(ctx, p, 30*time.Second, "envoy listener", func(ctx context.Context) bool {
		a, err := os.ReadFile(adminPath)
		if err != nil || len(a) == 0 {
			return false
		}
		e.admin = "http://" + strings.TrimSpace(string(a))
		var ls struct {
			ListenerStatuses []struct {
				LocalAddress struct {
					SocketAddress struct {
						Address   string `json:"address"`
						PortValue int    `json:"port_value"`
					} `json:"socket_address"`
				} `json:"local_address"`
			} `json:"listener_statuses"`
		}
		if getJSON(ctx, e.admin+"/listeners?format=json", &ls) != nil || len(ls.ListenerStatuses) != 1 {
			return false
		}
		sa := ls.ListenerStatuses[0].LocalAddress.SocketAddress
		if sa.PortValue == 0 {
			return false
		}
		e.url = "http://" + net.JoinHostPort(sa.Address, strconv.Itoa(sa.PortValue))
		return true
	})
	if err != nil {
		e.stop()
		return nil, err
	}
	return e, nil
}

// adminClient talks to admin endpoints (Envoy's, tether's, the
// instances'); a hung one fails the call instead of the run.
var adminClient = &http.Client{Timeout: 5 * time.Second}

func getJSON(ctx context.Context, url string, v any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := adminClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}

func postJSON(ctx context.Context, url string, body any) error {
	var b bytes.Buffer
	if body != nil {
		if err := json.NewEncoder(&b).Encode(body); err != nil {
			return err
		}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, &b)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := adminClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("POST %s: %s %s", url, resp.Status, msg)
	}
	return nil
}
