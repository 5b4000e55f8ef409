package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/launch"
	"github.com/tetherproxy/tether/lab/emulator"
	"github.com/tetherproxy/tether/lab/loadgen"
	"github.com/tetherproxy/tether/lab/simulator"
	"github.com/tetherproxy/tether/lab/workload"
)

// The peers scenario: the routers of two other projects, as PyPI ships
// them (scripts/tools.sh peers installs them), in front of the bench's
// eight emulated A100s, beside tether sticky and tether cache-aware. Each
// row replays the same seeded workload at the scale's rate and duration.
// The tether rows go through Envoy; a peer is a proxy itself, so the load
// generator sends to it directly. Three workloads: the field's mix, the
// same mix on small KV caches, and the shared-documents regime.

// PeersKVPressureTokens is each instance's KV cache in the peers
// scenario's KV-pressure workload.
const PeersKVPressureTokens = 8192

// peerWorkload is one workload of the peers scenario.
type peerWorkload struct {
	name     string
	workload workload.Config
	cache    emulator.CacheConfig // zero fields: the profile's capacity, the emulator's conversation cap
}

// peerWorkloads are the peers scenario's workloads, seeded with seed.
func peerWorkloads(seed uint64) []peerWorkload {
	docs := simulator.SharedDocuments(simulator.Options{Workload: workload.Config{Seed: seed}})
	return []peerWorkload{
		{name: "default mix", workload: workload.Config{Seed: seed}},
		{name: "KV pressure", workload: workload.Config{Seed: seed}, cache: emulator.CacheConfig{CapacityTokens: PeersKVPressureTokens}},
		{name: "shared documents", workload: docs.Workload, cache: docs.Cache},
	}
}

// peerRouter is a router of another project, run with its shipped
// defaults but for its policy and its listeners.
type peerRouter struct {
	pkg    string // its PyPI name, and its directory under Options.PeersDir
	dist   string // its name in its .dist-info directory's
	module string // what `python -m` runs
	policy string
	engine string // the engine its fleet imitates: the one it is made for
}

var peerRouters = []peerRouter{
	{pkg: "sglang-router", dist: "sglang_router", module: "sglang_router.launch_router", policy: "cache_aware", engine: emulator.EngineSGLang},
	{pkg: "vllm-router", dist: "vllm_router", module: "vllm_router.launch_router", policy: "consistent_hash", engine: emulator.EngineVLLM},
}

// args are the router's arguments: its workers, its policy, and its two
// listeners on loopback. Without --prometheus-host and --prometheus-port
// sglang-router serves its metrics on 0.0.0.0:29000 and vllm-router on
// 127.0.0.1:29000.
func (r peerRouter) args(workers []string, port, metricsPort string) []string {
	a := append([]string{"-m", r.module, "--worker-urls"}, workers...)
	return append(a, "--policy", r.policy, "--host", "127.0.0.1", "--port", port,
		"--prometheus-host", "127.0.0.1", "--prometheus-port", metricsPort)
}

// peerEnv is a router's environment: base, with its packages on the
// Python path and hub as its Hugging Face hub. sglang-router fetches a
// tokenizer for the model its SGLang workers name when it registers them,
// and routes HTTP requests without one; hub is the bench's, on loopback,
// and holds none. home keeps the hub's cache out of the user's.
func peerEnv(base []string, pkgDir, hub, home string) []string {
	set := map[string]string{"PYTHONPATH": pkgDir, "HF_ENDPOINT": hub, "HF_HUB_OFFLINE": "1", "HF_HOME": home}
	var out []string
	for _, kv := range base {
		if k, _, _ := strings.Cut(kv, "="); set[k] == "" {
			out = append(out, kv)
		}
	}
	for _, k := range slices.Sorted(maps.Keys(set)) {
		out = append(out, k+"="+set[k])
	}
	return out
}

// installedPeer is a peer router found under Options.PeersDir.
type installedPeer struct {
	peerRouter
	dir, version string
}

// name is the router's row name: "sglang-router 0.3.2 cache_aware".
func (p installedPeer) name() string { return p.pkg + " " + p.version + " " + p.policy }

// installedPeers finds every peer router under dir, with its version.
func installedPeers(dir string) ([]installedPeer, error) {
	if dir == "" {
		return nil, errors.New("no peers directory (Options.PeersDir; scripts/tools.sh peers installs them into .tools/peers)")
	}
	var out []installedPeer
	for _, r := range peerRouters {
		d := filepath.Join(dir, r.pkg)
		v, err := distVersion(d, r.dist)
		if err != nil {
			return nil, fmt.Errorf("%s: %w (scripts/tools.sh peers installs it)", r.pkg, err)
		}
		out = append(out, installedPeer{peerRouter: r, dir: d, version: v})
	}
	return out, nil
}

// distVersion is the version of the distribution dist that pip installed
// into dir (--target), read from its .dist-info directory's name.
func distVersion(dir, dist string) (string, error) {
	m, err := filepath.Glob(filepath.Join(dir, dist+"-*.dist-info"))
	if err != nil {
		return "", err
	}
	if len(m) != 1 {
		return "", fmt.Errorf("%d %s-*.dist-info in %s, want one", len(m), dist, dir)
	}
	return strings.TrimSuffix(strings.TrimPrefix(filepath.Base(m[0]), dist+"-"), ".dist-info"), nil
}

// PeerRow is one router on one workload of the peers scenario. Its
// Spread's request counts are the instances' own (GET /admin/stats).
type PeerRow struct {
	Workload string
	QualityRow
	// Of Failed: the requests that ended in an error, those still running
	// when the drain ended (cancelled), and those the load generator did
	// not send (dropped at its in-flight bound).
	Errors, Cancelled, Dropped int
	// ErrorKinds counts the errors' messages (loadgen's Summary.Errors,
	// cancellations left out).
	ErrorKinds map[string]int
}

// peerRowOf is the row of a replay's summary s on instances whose stats
// are stats.
func peerRowOf(workload, name string, s loadgen.Summary, stats []emulator.Stats, sc Scale) PeerRow {
	q := qualityRow(name, s, stats, sc)
	q.Spread = requestSpread(stats)
	row := PeerRow{Workload: workload, QualityRow: q, Errors: s.Failed, Cancelled: s.Cancelled, Dropped: s.Dropped}
	for msg, n := range s.Errors {
		if !strings.HasPrefix(msg, "cancelled:") {
			if row.ErrorKinds == nil {
				row.ErrorKinds = map[string]int{}
			}
			row.ErrorKinds[msg] = n
		}
	}
	return row
}

// PeerRouter is a peer router as the run started it.
type PeerRouter struct {
	Name, Version, Policy string
	// Command is how the bench starts it, its workers and ports left out.
	Command string
	// HubRequests is how often it asked the bench's Hugging Face hub for
	// something (which answers 404) over its rows.
	HubRequests int64
}

// requestSpread is the fewest and most requests an instance received,
// and max over mean, by the instances' own counts.
func requestSpread(stats []emulator.Stats) Spread {
	var s Spread
	var total int64
	for i, st := range stats {
		n := int(st.Requests)
		if i == 0 || n < s.MinRequests {
			s.MinRequests = n
		}
		s.MaxRequests = max(s.MaxRequests, n)
		total += st.Requests
	}
	if total > 0 {
		s.Imbalance = float64(s.MaxRequests) / (float64(total) / float64(len(stats)))
	}
	return s
}

// hub stands in for the Hugging Face hub on loopback: it holds nothing
// and counts what it is asked.
type hub struct {
	srv      *http.Server
	url      string
	requests atomic.Int64
}

func startHub() (*hub, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("hub: %w", err)
	}
	h := &hub{url: "http://" + ln.Addr().String()}
	h.srv = &http.Server{ReadHeaderTimeout: 10 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.requests.Add(1)
		http.NotFound(w, r)
	})}
	go func() { _ = h.srv.Serve(ln) }()
	return h, nil
}

func (h *hub) close() { _ = h.srv.Close() }

// Ports a peer router may be given: below Linux's ephemeral range
// (32768–60999), so that no outgoing connection holds one, drawn again
// when the router finds its port taken.
const (
	peerPortMin      = 20000
	peerPorts        = 12000
	peerPortAttempts = 5
	// peerStartTimeout bounds a router's start: Python's imports, then its
	// workers' registration.
	peerStartTimeout = 60 * time.Second
)

// peerProc is a running peer router.
type peerProc struct {
	*launch.Proc
	url string // its HTTP server
}

// startPeer starts p with python in front of workers (their URLs), on
// ports drawn from rng, and returns once the process started listens on
// its port and lists exactly workers, all healthy, at GET /workers.
func startPeer(ctx context.Context, python string, p installedPeer, env, workers []string, rng *rand.Rand) (*peerProc, error) {
	ctx, cancel := context.WithTimeout(ctx, peerStartTimeout)
	defer cancel()
	var last error
	for range peerPortAttempts {
		port, metrics := peerPortMin+rng.IntN(peerPorts), peerPortMin+rng.IntN(peerPorts)
		if port == metrics {
			continue
		}
		cmd := exec.Command(python, p.args(workers, strconv.Itoa(port), strconv.Itoa(metrics))...)
		cmd.Env = env
		proc, err := launch.Start(p.pkg, cmd, nil)
		if err != nil {
			return nil, err
		}
		err = proc.Poll(ctx, fmt.Sprintf("its port %d and its workers", port), func(ctx context.Context) error {
			return peerReady(ctx, proc.Pid(), port, workers)
		})
		if err == nil {
			return &peerProc{Proc: proc, url: "http://127.0.0.1:" + strconv.Itoa(port)}, nil
		}
		proc.Kill()
		if !strings.Contains(proc.Output(), "Address already in use") {
			return nil, err
		}
		last = err
	}
	return nil, fmt.Errorf("%s: no free port in %d attempts: %w", p.pkg, peerPortAttempts, last)
}

// peerWorker is an entry of a router's GET /workers (both routers answer
// {"workers": [{"url": …, "is_healthy": …}, …]}).
type peerWorker struct {
	URL     string `json:"url"`
	Healthy bool   `json:"is_healthy"`
}

// peerReady checks that process pid listens on port, and that the router
// there serves exactly workers, all healthy.
func peerReady(ctx context.Context, pid, port int, workers []string) error {
	ok, err := listensOn(pid, port)
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("process %d does not listen on port %d", pid, port)
	}
	var got struct {
		Workers []peerWorker `json:"workers"`
	}
	if err := getJSON(ctx, "http://127.0.0.1:"+strconv.Itoa(port)+"/workers", &got); err != nil {
		return err
	}
	return sameWorkers(got.Workers, workers)
}

// sameWorkers checks that listed is want, each once and healthy.
func sameWorkers(listed []peerWorker, want []string) error {
	var urls []string
	for _, w := range listed {
		if !w.Healthy {
			return fmt.Errorf("worker %s not healthy yet", w.URL)
		}
		urls = append(urls, w.URL)
	}
	slices.Sort(urls)
	if w := slices.Sorted(slices.Values(want)); !slices.Equal(urls, w) {
		return fmt.Errorf("workers %v, want %v", urls, w)
	}
	return nil
}

// listensOn reports whether process pid holds a socket listening on
// 127.0.0.1:port (or any address) over TCP/IPv4.
func listensOn(pid, port int) (bool, error) {
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return false, fmt.Errorf("listens on: %w", err)
	}
	held := map[string]bool{}
	for _, fd := range fds {
		link, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name()))
		if ino, ok := strings.CutPrefix(link, "socket:["); err == nil && ok {
			held[strings.TrimSuffix(ino, "]")] = true
		}
	}
	table, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/tcp", pid))
	if err != nil {
		return false, fmt.Errorf("listens on: %w", err)
	}
	for _, ino := range listeningInodes(string(table), port) {
		if held[ino] {
			return true, nil
		}
	}
	return false, nil
}

// listeningInodes are the inodes of the sockets that listen on port in a
// /proc/net/tcp table (proc(5): local address as hex IP:port, state 0A
// for LISTEN, inode the tenth field).
func listeningInodes(table string, port int) []string {
	var out []string
	sc := bufio.NewScanner(strings.NewReader(table))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 10 || f[3] != "0A" {
			continue
		}
		_, hexPort, ok := strings.Cut(f[1], ":")
		if p, err := strconv.ParseUint(hexPort, 16, 16); ok && err == nil && int(p) == port {
			out = append(out, f[9])
		}
	}
	return out
}

func runPeers(ctx context.Context, opts Options, dir string) ([]PeerRow, []PeerRouter, error) {
	peers, err := installedPeers(opts.PeersDir)
	if err != nil {
		return nil, nil, err
	}
	python := opts.PeersPython
	if python == "" {
		python = filepath.Join(opts.PeersDir, "python")
	}
	h, err := startHub()
	if err != nil {
		return nil, nil, err
	}
	defer h.close()
	home, err := os.MkdirTemp(dir, "hf")
	if err != nil {
		return nil, nil, err
	}
	// The ports drawn for the routers differ from run to run: a port held
	// by another's server is drawn again, not hit at every run.
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), opts.Seed))
	routers := make([]PeerRouter, len(peers))
	for i, p := range peers {
		routers[i] = PeerRouter{Name: p.name(), Version: p.version, Policy: p.policy,
			Command: "python3 " + strings.Join(p.args([]string{"URL…"}, "PORT", "PORT2"), " ")}
	}
	var rows []PeerRow
	for _, w := range peerWorkloads(opts.Seed) {
		r := peerRun{opts: opts, dir: dir, python: python, hub: h, home: home, rng: rng, w: w}
		got, err := r.rows(ctx, peers, routers)
		rows = append(rows, got...)
		if err != nil {
			return rows, routers, fmt.Errorf("%s: %w", w.name, err)
		}
	}
	return rows, routers, nil
}

// peerRun is one workload of the peers scenario.
type peerRun struct {
	opts         Options
	dir, python  string
	hub          *hub
	home         string
	rng          *rand.Rand
	w            peerWorkload
	vllm, sglang *simFleet
	instances    map[*simFleet][]config.Instance
}

// rows runs tether sticky, tether cache-aware and each peer on the
// workload, each on fresh caches, and counts each peer's hub requests
// into routers.
func (r *peerRun) rows(ctx context.Context, peers []installedPeer, routers []PeerRouter) ([]PeerRow, error) {
	sc := r.opts.Scale
	r.instances = map[*simFleet][]config.Instance{}
	for _, engine := range []string{emulator.EngineVLLM, emulator.EngineSGLang} {
		f, ins, err := a100FleetEngine(sc, 8, r.w.cache, engine)
		if err != nil {
			return nil, err
		}
		defer f.close()
		r.instances[f] = ins
		if engine == emulator.EngineVLLM {
			r.vllm = f
		} else {
			r.sglang = f
		}
	}
	var rows []PeerRow
	// tether as a user runs it: the cache-aware row is the shipped
	// defaults, each instance's cache as its engine publishes it.
	for _, p := range []policy{policySticky, policyDefaults} {
		row, err := r.tether(ctx, p)
		if err != nil {
			return rows, fmt.Errorf("%s: %w", p.name, err)
		}
		rows = append(rows, row)
	}
	for i, p := range peers {
		before := r.hub.requests.Load()
		row, err := r.peer(ctx, p)
		routers[i].HubRequests += r.hub.requests.Load() - before
		if err != nil {
			return rows, fmt.Errorf("%s: %w", p.pkg, err)
		}
		rows = append(rows, row)
	}
	return rows, nil
}

// tether replays the workload through Envoy and tether configured by p,
// on the vLLM fleet.
func (r *peerRun) tether(ctx context.Context, p policy) (PeerRow, error) {
	r.progress(p.name)
	if err := r.vllm.reset(ctx); err != nil {
		return PeerRow{}, err
	}
	st, err := startStack(ctx, r.opts, r.dir, p, r.instances[r.vllm])
	if err != nil {
		return PeerRow{}, err
	}
	res, err := r.replay(ctx, st.envoy.URL(), r.vllm)
	st.close()
	if err != nil {
		return PeerRow{}, err
	}
	return r.row(ctx, p.name, res, r.vllm)
}

// peer replays the workload through p, on the fleet of its engine.
func (r *peerRun) peer(ctx context.Context, p installedPeer) (PeerRow, error) {
	r.progress(p.name())
	f := r.vllm
	if p.engine == emulator.EngineSGLang {
		f = r.sglang
	}
	if err := f.reset(ctx); err != nil {
		return PeerRow{}, err
	}
	var workers []string
	for _, in := range r.instances[f] {
		workers = append(workers, "http://"+in.Address)
	}
	proc, err := startPeer(ctx, r.python, p, peerEnv(os.Environ(), p.dir, r.hub.url, r.home), workers, r.rng)
	if err != nil {
		return PeerRow{}, err
	}
	res, err := r.replay(ctx, proc.url, f)
	proc.Stop(stopTimeout)
	if err != nil {
		return PeerRow{}, fmt.Errorf("%w\n%s", err, lastLines(proc.Output(), 20))
	}
	return r.row(ctx, p.name(), res, f)
}

func (r *peerRun) progress(name string) {
	fmt.Fprintf(r.opts.Log, "peers, %s: %s (%s)\n", r.w.name, name, r.opts.Scale.Duration)
}

// replay runs the workload against url, naming the model f serves, as a
// client of a real fleet would.
func (r *peerRun) replay(ctx context.Context, url string, f *simFleet) (*loadgen.Result, error) {
	sc := r.opts.Scale
	o := replayOptions(r.opts, r.w.workload, sc.Rate, sc.Duration, url, r.instances[f])
	o.Model = fleetVersion
	return loadgen.Run(ctx, o)
}

// row is the figures of a replay on f.
func (r *peerRun) row(ctx context.Context, name string, res *loadgen.Result, f *simFleet) (PeerRow, error) {
	stats, err := f.stats(ctx)
	if err != nil {
		return PeerRow{}, err
	}
	return peerRowOf(r.w.name, name, res.Summary, stats, r.opts.Scale), nil
}

// lastLines is the last n lines of s.
func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
