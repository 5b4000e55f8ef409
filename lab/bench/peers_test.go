package bench

import (
	"context"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/lab/emulator"
	"github.com/tetherproxy/tether/lab/loadgen"
)

func TestPeerArgs(t *testing.T) {
	got := peerRouters[0].args([]string{"http://127.0.0.1:1", "http://127.0.0.1:2"}, "20001", "20002")
	want := []string{"-m", "sglang_router.launch_router", "--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2",
		"--policy", "cache_aware", "--host", "127.0.0.1", "--port", "20001", "--prometheus-host", "127.0.0.1", "--prometheus-port", "20002"}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Error(diff)
	}
	if v := peerRouters[1].args(nil, "1", "2"); v[1] != "vllm_router.launch_router" || !strings.Contains(strings.Join(v, " "), "--policy consistent_hash") {
		t.Errorf("vllm-router: %v", v)
	}
}

func TestPeerEnv(t *testing.T) {
	got := peerEnv([]string{"PATH=/bin", "PYTHONPATH=/elsewhere", "HF_ENDPOINT=https://hub", "HOME=/root"}, "/p", "http://127.0.0.1:9", "/h")
	want := []string{"PATH=/bin", "HOME=/root", "HF_ENDPOINT=http://127.0.0.1:9", "HF_HOME=/h", "HF_HUB_OFFLINE=1", "PYTHONPATH=/p"}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Error(diff)
	}
}

func TestDistVersion(t *testing.T) {
	dir := t.TempDir()
	if _, err := distVersion(dir, "sglang_router"); err == nil {
		t.Error("no .dist-info: want an error")
	}
	for _, d := range []string{"sglang_router-0.3.2.dist-info", "sglang_router_rs", "aiohttp-3.14.5.dist-info"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if v, err := distVersion(dir, "sglang_router"); err != nil || v != "0.3.2" {
		t.Errorf("version %q, %v; want 0.3.2", v, err)
	}
	if err := os.Mkdir(filepath.Join(dir, "sglang_router-0.3.1.dist-info"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := distVersion(dir, "sglang_router"); err == nil {
		t.Error("two versions: want an error")
	}
}

// A /proc/net/tcp table: a listener on 127.0.0.1:20001 (0x4E21), a
// connection from that port, and a listener on 0.0.0.0:29000 (0x7148).
const procNetTCP = `  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:4E21 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5551 1 0000000000000000 100 0 0 10 0
   1: 0100007F:4E21 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 5552 1 0000000000000000 20 4 30 10 -1
   2: 00000000:7148 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5553 1 0000000000000000 100 0 0 10 0
`

func TestListeningInodes(t *testing.T) {
	for _, tc := range []struct {
		port int
		want []string
	}{{20001, []string{"5551"}}, {29000, []string{"5553"}}, {40000, nil}} {
		if got := listeningInodes(procNetTCP, tc.port); !cmp.Equal(got, tc.want) {
			t.Errorf("port %d: %v, want %v", tc.port, got, tc.want)
		}
	}
}

func TestListensOn(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := ln.Addr().(*net.TCPAddr).Port
	if ok, err := listensOn(os.Getpid(), port); err != nil || !ok {
		t.Errorf("this process on its own port %d: %v, %v", port, ok, err)
	}
	// PID 1 is not this test: it does not hold the listener.
	if ok, _ := listensOn(1, port); ok {
		t.Errorf("process 1 listens on port %d", port)
	}
}

func TestSameWorkers(t *testing.T) {
	want := []string{"http://127.0.0.1:2", "http://127.0.0.1:1"}
	for _, tc := range []struct {
		name   string
		listed []peerWorker
		ok     bool
	}{
		{"same, any order", []peerWorker{{"http://127.0.0.1:1", true}, {"http://127.0.0.1:2", true}}, true},
		{"one not healthy", []peerWorker{{"http://127.0.0.1:1", true}, {"http://127.0.0.1:2", false}}, false},
		{"one missing", []peerWorker{{"http://127.0.0.1:1", true}}, false},
		{"another's", []peerWorker{{"http://127.0.0.1:1", true}, {"http://127.0.0.1:3", true}}, false},
		{"none", nil, false},
	} {
		if err := sameWorkers(tc.listed, want); (err == nil) != tc.ok {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
}

func TestRequestSpread(t *testing.T) {
	got := requestSpread([]emulator.Stats{{Requests: 10}, {Requests: 30}, {Requests: 0}, {Requests: 40}})
	want := Spread{MinRequests: 0, MaxRequests: 40, Imbalance: 2}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Error(diff)
	}
	if got := requestSpread(nil); got != (Spread{}) {
		t.Errorf("no instances: %+v", got)
	}
}

// TestPeerRowArithmetic checks the figures of a peer row from the
// instances' stats and the load generator's summary: GPU-time imbalance
// over prefill and decode, requests per instance by the instances'
// counts, failures by kind.
func TestPeerRowArithmetic(t *testing.T) {
	stats := []emulator.Stats{
		{Requests: 3, Model: &emulator.ModelStats{PrefillGPUSeconds: 1, DecodeGPUSeconds: 2}},
		{Requests: 1, Model: &emulator.ModelStats{PrefillGPUSeconds: 0.5, DecodeGPUSeconds: 0.5}},
	}
	s := loadgen.Summary{Requests: 9, OK: 4, Failed: 2, Cancelled: 3,
		Errors: map[string]int{"HTTP 503: busy": 2, "cancelled: drain deadline passed": 3}}
	got := peerRowOf("w", "r", s, stats, Smoke)
	if got.Imbalance != 1.5 || got.Spread.MinRequests != 1 || got.Spread.MaxRequests != 3 {
		t.Errorf("imbalance %v, requests %d–%d; want 1.5, 1–3", got.Imbalance, got.Spread.MinRequests, got.Spread.MaxRequests)
	}
	if got.Failed != 5 || got.Errors != 2 || got.Cancelled != 3 || !cmp.Equal(got.ErrorKinds, map[string]int{"HTTP 503: busy": 2}) {
		t.Errorf("failed %d (%d errors %v, %d cancelled); want 5 (2 errors, 3 cancelled)", got.Failed, got.Errors, got.ErrorKinds, got.Cancelled)
	}
}

func TestPeersMarkdown(t *testing.T) {
	r := &Report{Started: time.Unix(0, 0), Scale: Full,
		Peers: []PeerRow{{Workload: "KV pressure", QualityRow: QualityRow{Policy: "sglang-router 0.3.2 cache_aware", HitRate: 0.25,
			TTFTP50: 100 * time.Millisecond, TTFTP99: time.Second, Imbalance: 1.25, Requests: 500, Failed: 3, Spread: Spread{MinRequests: 50, MaxRequests: 80}},
			Errors: 1, Cancelled: 2, ErrorKinds: map[string]int{"HTTP 502: bad gateway": 1}}},
		PeerRouters: []PeerRouter{{Name: "sglang-router 0.3.2 cache_aware", Version: "0.3.2", Policy: "cache_aware", Command: "python3 -m x", HubRequests: 2}},
	}
	md := r.Markdown(Meta{Command: "tether-lab bench --scale full --only peers", Commit: "abc", Machine: "linux/amd64, 2 CPUs"}, nil)
	for _, want := range []string{
		"### The peers through the bench's fleet (issue 32)",
		"tether-lab bench --scale full --only peers",
		"| KV pressure | sglang-router 0.3.2 cache_aware | 25.0% | 100.0 ms | 1000.0 ms | 1.25 | 50–80 | 500 | 1, 2 |",
		"- KV pressure, sglang-router 0.3.2 cache_aware: 1 × `HTTP 502: bad gateway`",
		"| sglang-router 0.3.2 cache_aware | 0.3.2 | cache_aware | `python3 -m x` | 2 |",
		"caches of 8192 tokens",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("missing %q in:\n%s", want, md)
		}
	}
}

// TestPeerRoutersServe starts each installed peer router in front of two
// emulated instances of its engine, as the peers scenario does, and
// replays a little of the field's mix through it. The peers are not part
// of make test (only make bench installs them, with scripts/tools.sh
// peers): without them the test skips, under CI=true too.
func TestPeerRoutersServe(t *testing.T) {
	if testing.Short() {
		t.Skip("starts the peer routers")
	}
	// The package's directory is lab/bench, two below the repository's.
	dir, err := filepath.Abs(filepath.Join("..", "..", ".tools", "peers"))
	if err != nil {
		t.Fatal(err)
	}
	peers, err := installedPeers(dir)
	if err != nil {
		t.Skipf("peer routers not installed, skipping (scripts/tools.sh peers; they are not part of make test, so CI=true skips too): %v", err)
	}
	h, err := startHub()
	if err != nil {
		t.Fatal(err)
	}
	defer h.close()
	sc := Scale{Name: "test", Rate: 5, Duration: 2 * time.Second, ThinkScale: 0.02, TimeScale: 0.05}
	r := &peerRun{opts: Options{Scale: sc, Seed: 3, Log: io.Discard}, dir: t.TempDir(), python: filepath.Join(dir, "python"),
		hub: h, home: t.TempDir(), rng: rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 3)),
		w: peerWorkloads(3)[0], instances: map[*simFleet][]config.Instance{}}
	for _, engine := range []string{emulator.EngineVLLM, emulator.EngineSGLang} {
		f, ins, err := a100FleetEngine(sc, 2, emulator.CacheConfig{}, engine)
		if err != nil {
			t.Fatal(err)
		}
		defer f.close()
		r.instances[f] = ins
		if engine == emulator.EngineVLLM {
			r.vllm = f
		} else {
			r.sglang = f
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for _, p := range peers {
		t.Run(p.pkg, func(t *testing.T) {
			row, err := r.peer(ctx, p)
			if err != nil {
				t.Fatal(err)
			}
			if row.Requests == 0 || row.Failed != 0 || row.Spread.MaxRequests == 0 || row.Policy != p.name() {
				t.Errorf("row %+v: want requests, none failed, named %q", row, p.name())
			}
		})
	}
}
