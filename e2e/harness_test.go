//go:build e2e

// Package e2e runs tether as users do: the real binary, real Envoy, real
// redis-server, and emulated instances, all on loopback. Run with
// `make test` (or go test -tags e2e ./e2e/).
package e2e

import (
	"bytes"
	"context"
	"encoding/json"
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
	"sync/atomic"
	"testing"
	"time"

	"github.com/BurntSushi/toml"
	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	"google.golang.org/protobuf/proto"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/internal/launch"
	"github.com/tetherproxy/tether/internal/promtext"
	"github.com/tetherproxy/tether/internal/syncbuf"
	"github.com/tetherproxy/tether/internal/testenv"
	"github.com/tetherproxy/tether/lab/emulator"
	"github.com/tetherproxy/tether/plan"
	"github.com/tetherproxy/tether/xds"
)

// secret is the identity secret every tether in these tests shares.
const secret = "e2e-identity-secret-0123456789"

var tetherBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "tether-e2e")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	tetherBin = filepath.Join(dir, "tether")
	// Built in the product's module (the repository root), as make build
	// builds it: e2e is a module of its own, whose go.sum holds what the
	// tests import, not all that tether does.
	build := exec.Command("go", "build", "-o", tetherBin, "./cmd/tether")
	build.Dir = ".."
	if out, err := build.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build tether: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	if err := os.RemoveAll(dir); err != nil {
		fmt.Fprintln(os.Stderr, err)
	}
	os.Exit(code)
}

// startFleet serves n emulated instances in-process, half in each of two
// zones, and returns them as config entries.
func startFleet(t *testing.T, n int) []config.Instance {
	t.Helper()
	inst, _ := startFaultyFleet(t, n)
	return inst
}

// startFaultyFleet is startFleet plus a switch per instance that makes it
// answer every request with 503, as an overloaded model server does.
func startFaultyFleet(t *testing.T, n int) ([]config.Instance, map[string]*atomic.Bool) {
	t.Helper()
	broken := map[string]*atomic.Bool{}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	out := make([]config.Instance, n)
	for i := range out {
		zone := []string{"zone-a", "zone-b"}[i*2/n]
		name := fmt.Sprintf("a100-%s-%d", zone[len(zone)-1:], i)
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		h, err := emulator.NewHandler(emulator.Instance{Name: name, Latency: time.Millisecond, Model: "v1"})
		if err != nil {
			t.Fatal(err)
		}
		off := &atomic.Bool{}
		broken[name] = off
		faulty := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if off.Load() {
				w.Header().Set("x-instance", name)
				http.Error(w, "overloaded", http.StatusServiceUnavailable)
				return
			}
			h.ServeHTTP(w, r)
		})
		wg.Add(1)
		go func() { defer wg.Done(); _ = emulator.Serve(ctx, ln, faulty) }()
		out[i] = config.Instance{Name: name, Address: ln.Addr().String(), Zone: zone, Version: "v1", Weight: 1}
	}
	return out, broken
}

// startInstances serves one emulated instance per spec, under the spec's
// name, and returns the specs with their addresses filled in. Unset zone,
// version and weight become zone-a, v1 and 1.
func startInstances(t *testing.T, specs ...config.Instance) []config.Instance {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	out := append([]config.Instance(nil), specs...)
	for i := range out {
		in := &out[i]
		if in.Zone == "" {
			in.Zone = "zone-a"
		}
		if in.Version == "" {
			in.Version = "v1"
		}
		if in.Weight == 0 {
			in.Weight = 1
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		// A batch of at most 4, as vLLM's --max-num-seqs: more requests in
		// flight count as waiting on /metrics (the adaptive tests saturate
		// an instance so).
		h, err := emulator.NewHandler(emulator.Instance{Name: in.Name, Latency: time.Millisecond, Model: in.Version, MaxRunning: 4})
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() { defer wg.Done(); _ = emulator.Serve(ctx, ln, h) }()
		in.Address = ln.Addr().String()
	}
	return out
}

// baseConfig is a tether config for instances on store redisURL, with
// loopback listeners on free ports and debug headers on.
func baseConfig(redisURL string, instances []config.Instance) config.Config {
	c := config.Default()
	c.Server.ExtProcAddr = "127.0.0.1:0"
	c.Server.AdminAddr = "127.0.0.1:0"
	c.Server.DebugHeaders = true
	c.Server.DrainTimeout = config.Dur(5 * time.Second)
	// Every test stops its tethers; TestChaosTetherReplicaStopped is the
	// one that needs the drain delay.
	c.Server.DrainDelay = config.Dur(0)
	c.XDS.Addr = "127.0.0.1:0"
	c.Envoy.ListenerAddr = "127.0.0.1:0"
	c.Redis.URL = redisURL
	// -race CI machines are slow: give Envoy and the store room, keeping
	// the store's timeout inside Envoy's.
	c.Envoy.MessageTimeout = config.Dur(time.Second)
	c.Redis.Timeout = config.Dur(500 * time.Millisecond)
	c.Instances = append([]config.Instance(nil), instances...)
	return c
}

// tether is one running tether process.
type tether struct {
	t        *testing.T
	proc     *launch.Tether
	extproc  string
	admin    string
	xds      string // "" when the ADS server is off
	path     string // the config file it watches
	logs     *syncbuf.Buffer
	stopOnce sync.Once
}

// startTether writes cfg to a file and runs `tether serve --config` on it.
func startTether(t *testing.T, cfg config.Config) *tether {
	t.Helper()
	path := filepath.Join(t.TempDir(), "tether.toml")
	writeConfig(t, path, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	proc, err := launch.StartTether(ctx, launch.TetherOptions{
		Bin: tetherBin, Config: path, Env: []string{"TETHER_IDENTITY_SECRET=" + secret},
	})
	if err != nil {
		t.Fatal(err)
	}
	p := &tether{t: t, proc: proc, extproc: proc.Extproc, admin: proc.Admin, xds: proc.XDS, path: path, logs: proc.Log()}
	t.Cleanup(func() {
		p.Stop()
		if t.Failed() {
			t.Logf("tether logs:\n%s", p.logs)
		}
	})
	return p
}

// writeConfig writes cfg as TOML, atomically (write, then rename), as
// editors and config management do.
func writeConfig(t *testing.T, path string, cfg config.Config) {
	t.Helper()
	testenv.WriteFile(t, path, encodeConfig(t, cfg))
}

// encodeConfig is cfg as a TOML file.
func encodeConfig(t *testing.T, cfg config.Config) []byte {
	t.Helper()
	var b bytes.Buffer
	if err := toml.NewEncoder(&b).Encode(cfg); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// Stop sends SIGTERM and waits for a clean exit.
func (p *tether) Stop() {
	p.stopOnce.Do(func() {
		if p.proc.Stop(15 * time.Second) {
			p.t.Errorf("tether did not stop within 15s of SIGTERM")
		} else if code := p.proc.ExitCode(); code != 0 {
			p.t.Errorf("tether exited with %d after SIGTERM:\n%s", code, p.logs)
		}
	})
}

// metric returns the sum of a counter's or gauge's samples whose labels
// include all of labels ("k=\"v\"" strings), from tether's /metrics.
func (p *tether) metric(t *testing.T, name string, labels ...string) float64 {
	t.Helper()
	want := map[string]string{}
	for _, l := range labels {
		k, v, ok := strings.Cut(l, "=")
		uv, err := strconv.Unquote(v)
		if !ok || err != nil {
			t.Fatalf("metric %s: label %q: want k=\"v\"", name, l)
		}
		want[k] = uv
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	m, err := promtext.Get(ctx, http.DefaultClient, "http://"+p.admin+"/metrics")
	if err != nil {
		t.Fatal(err)
	}
	return m.Sum(name, want)
}

// proxy is one running Envoy.
type proxy struct {
	url   string // http://127.0.0.1:port of the listener
	admin string
}

// startEnvoy runs Envoy on the static bootstrap for cfg's instances, calling
// the ext_proc servers at extproc, on ports Envoy picks itself.
func startEnvoy(t *testing.T, cfg config.Config, extproc ...string) *proxy {
	t.Helper()
	cfg.Envoy.ListenerAddr = "127.0.0.1:0"
	b, err := staticBootstrap(cfg, extproc)
	if err != nil {
		t.Fatal(err)
	}
	return runEnvoy(t, b)
}

// staticBootstrap is the static bootstrap for cfg, calling the ext_proc
// servers at extproc.
func staticBootstrap(cfg config.Config, extproc []string) (*bootstrapv3.Bootstrap, error) {
	p, err := plan.FromConfig(cfg, plan.Options{})
	if err != nil {
		return nil, err
	}
	spec := p.Envoy
	spec.ExtProc = extproc
	return xds.StaticBootstrap(spec, "127.0.0.1:0")
}

// startEnvoyADS runs Envoy on the ADS bootstrap alone: everything else comes
// from tether's xDS server at ads.
func startEnvoyADS(t *testing.T, ads string) *proxy {
	t.Helper()
	b, err := xds.ADSBootstrap("e2e-"+strings.ReplaceAll(t.Name(), "/", "-"), "127.0.0.1:0", ads)
	if err != nil {
		t.Fatal(err)
	}
	return runEnvoy(t, b)
}

// runEnvoy starts Envoy on bootstrap and returns once it serves.
func runEnvoy(t *testing.T, bootstrap proto.Message) *proxy {
	t.Helper()
	logs := &syncbuf.Buffer{}
	t.Cleanup(func() { // after Envoy's stop, so the logs are whole
		if t.Failed() {
			t.Logf("envoy logs:\n%s", logs)
		}
	})
	e := launchEnvoy(t, bootstrap, logs)
	testenv.WaitServing(t, e)
	return &proxy{url: e.URL(), admin: e.Admin}
}

// launchEnvoy starts Envoy on bootstrap, its output going to logs, and
// stops it when the test ends. testenv.WaitServing waits until it serves.
func launchEnvoy(t *testing.T, bootstrap proto.Message, logs *syncbuf.Buffer) *launch.Envoy {
	t.Helper()
	yaml, err := xds.YAML(bootstrap, "")
	if err != nil {
		t.Fatal(err)
	}
	return testenv.Envoy(t, launch.EnvoyOptions{Bootstrap: yaml, Concurrency: 2, LogLevel: "warn", Log: logs})
}

func getJSON(t *testing.T, url string, v any) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		t.Fatalf("%s: %v", url, err)
	}
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// answer is what a client learns from one response.
type answer struct {
	status   int
	instance string // x-instance, set by the emulated instance itself
	decision string // x-tether-decision, set by tether ("" when tether was not involved)
	tethered string // x-tether-instance
}

var client = &http.Client{
	Timeout:   30 * time.Second,
	Transport: &http.Transport{MaxIdleConnsPerHost: 64},
}

// chat sends one chat completion through Envoy with headers h.
func chat(t *testing.T, p *proxy, h map[string]string) answer {
	t.Helper()
	a, err := tryChat(p, h)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func tryChat(p *proxy, h map[string]string) (answer, error) { return tryChatWith(client, p, h) }

// tryChatWith is tryChat on client c.
func tryChatWith(c *http.Client, p *proxy, h map[string]string) (answer, error) {
	body := `{"model":"llama-3.1-8b","messages":[{"role":"user","content":"hello there"}],"max_tokens":8}`
	req, err := http.NewRequest(http.MethodPost, p.url+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		return answer{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range h {
		req.Header.Set(k, v)
	}
	resp, err := c.Do(req)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return answer{}, err
	}
	return answer{
		status:   resp.StatusCode,
		instance: resp.Header.Get("x-instance"),
		decision: resp.Header.Get("x-tether-decision"),
		tethered: resp.Header.Get("x-tether-instance"),
	}, nil
}

// parallel runs fn(i) for i in [0,n) on workers goroutines.
func parallel(n, workers int, fn func(i int)) {
	var wg sync.WaitGroup
	next := make(chan int)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				fn(i)
			}
		}()
	}
	for i := 0; i < n; i++ {
		next <- i
	}
	close(next)
	wg.Wait()
}

// extractor keys callers exactly as the tethers under test do.
func extractor(t *testing.T) *identity.Extractor {
	t.Helper()
	e, err := identity.New(identity.Config{Secret: []byte(secret)})
	if err != nil {
		t.Fatal(err)
	}
	return e
}
