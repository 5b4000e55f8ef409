package bench

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/tetherproxy/tether/internal/promtext"
	"github.com/tetherproxy/tether/lab/loadgen"
	"github.com/tetherproxy/tether/lab/workload"
)

func TestChurnPhase(t *testing.T) {
	ms := time.Millisecond
	rec := func(conv string, turn int, start, lat time.Duration, out loadgen.Fate, inst string, id workload.IdentityKind) loadgen.Record {
		return loadgen.Record{Conversation: conv, Turn: turn, Start: start, Latency: lat, Fate: out, Instance: inst,
			Identity: id, PromptTokens: 100, CachedTokens: 50}
	}
	sess, anon := workload.IdentitySession, workload.IdentityAnonymous
	recs := []loadgen.Record{
		rec("a", 0, 0, 10*ms, loadgen.OK, "i1", sess),
		rec("a", 1, 90*ms, 20*ms, loadgen.OK, "i2", sess), // ends at 110: phase 2, moved
		rec("b", 0, 0, 10*ms, loadgen.OK, "i1", anon),
		rec("b", 1, 120*ms, 10*ms, loadgen.OK, "i3", anon),     // anonymous: not counted as moved
		rec("c", 0, 105*ms, 10*ms, loadgen.Failed, "", sess),   // failed in phase 2
		rec("d", 0, 130*ms, 0, loadgen.Dropped, "", sess),      // the load generator's: left out
		rec("e", 0, 140*ms, 10*ms, loadgen.OK, "victim", sess), // answered by the victim
		rec("e", 1, 160*ms, 10*ms, loadgen.OK, "victim", sess), // kept its instance
	}
	got := churnPhase("p", "two", "victim", recs, 100*ms, 200*ms)
	want := ChurnRow{Policy: "p", Phase: "two", Requests: 5, Failed: 1, Moved: 1, FollowUps: 2, VictimServed: 2, HitRate: 0.5}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Error(diff)
	}
	if first := churnPhase("p", "one", "victim", recs, 0, 100*ms); first.Requests != 2 || first.FollowUps != 0 {
		t.Errorf("phase one: %+v", first)
	}
}

func TestPercentileNearestRank(t *testing.T) {
	var d []time.Duration
	for i := 1; i <= 160; i++ {
		d = append(d, time.Duration(i))
	}
	for _, tc := range []struct {
		q    float64
		want time.Duration
	}{{0.5, 80}, {0.99, 159}, {1, 160}, {0.001, 1}} {
		if got := percentile(d, tc.q); got != tc.want {
			t.Errorf("p%v = %v, want %v", tc.q, got, tc.want)
		}
	}
	if percentile(nil, 0.5) != 0 {
		t.Error("empty input")
	}
}

func TestWriteInto(t *testing.T) {
	dir := t.TempDir()
	section := MarkerStart + "\nnew\n" + MarkerEnd + "\n"
	for _, tc := range []struct{ name, before, want string }{
		{"absent file", "", "\n\n" + section},
		{"no section yet", "# B\n\nkeep\n", "# B\n\nkeep\n\n" + section},
		{"section in the middle", "head\n" + MarkerStart + "\nold\n" + MarkerEnd + "\ntail\n", "head\n" + section + "tail\n"},
		{"file ends at the marker", "head\n" + MarkerStart + "\nold\n" + MarkerEnd, "head\n" + section},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "-"))
			if tc.before != "" {
				if err := os.WriteFile(p, []byte(tc.before), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			if err := WriteInto(p, section); err != nil {
				t.Fatal(err)
			}
			got, _ := os.ReadFile(p)
			if diff := cmp.Diff(tc.want, string(got)); diff != "" {
				t.Error(diff)
			}
		})
	}
}

func TestMarkdownHasEveryTable(t *testing.T) {
	r := &Report{Started: time.Unix(0, 0), Scale: Smoke,
		Overhead: []OverheadRow{{Name: "Envoy alone", P50: time.Millisecond, Throughput: 100},
			{Name: "ext_proc floor", Floor: true, P50: 1500 * time.Microsecond, Throughput: 40, FloorCPUPerRequest: 90 * time.Microsecond},
			{Name: "tether sticky", OnPath: true, Store: true, P50: 2 * time.Millisecond, Throughput: 50, TetherCPUPerRequest: 300 * time.Microsecond,
				RedisCommands: map[string]float64{"get": 1}, RedisCommandsPerRequest: 1}},
		Quality: []QualityRow{{Policy: "tether sticky", HitRate: 0.5}, {Policy: "Envoy ring hash"},
			{Policy: "tether adaptive", Decisions: 10, Spilled: 0.25, Spread: Spread{MinRequests: 3, MaxRequests: 9, Imbalance: 1.5, QueueP50: 2, QueueP99: 7, BusiestQueueP99: 8}}},
		Hotspot:    []HotspotRow{{Policy: "tether adaptive", Tenant: Traffic{Requests: 80, TTFTP99: 250 * time.Millisecond, Spilled: 0.075, Instances: 2}, Decisions: 100, Spilled: 0.05}},
		Churn:      []ChurnRow{{Policy: "tether sticky", Phase: "steady"}},
		Saturation: Saturation{Waiting: 5, KVUsage: 0.8, InFlight: 6, QueueDepth: 12},
	}
	md := r.Markdown(Meta{Command: "cmd", Commit: "abc", Machine: "m"}, []string{"docs/bench/x.png"})
	for _, want := range []string{MarkerStart, MarkerEnd, "### Overhead", "| tether sticky | 0.00 ms", "| 2.00 ms |", "| 0.50 | 1.25 | 0 µs | 300 µs | 0 µs | 1.00 (GET 1.00) | 0.0% | 0 of 0 | 0 |",
		"| ext_proc floor | 0 | 40/s | 0.40 | 1.00 | 0 µs | 90 µs | – |",
		"#### Overhead goals", "| tether sticky | Redis commands per sticky hit | = 0.00 | – | 1.00 | no |",
		"| tether sticky | added p50, at 100 requests/s | ≤ 0.30 ms | 0.50 ms | 1.00 ms | no |", "vs Envoy alone | ≥ 0.75× | 0.40× | 0.50× | no |",
		"| tether sticky | throughput vs the floor | ≥ 0.90× | – | 1.25× | yes |", "| tether sticky | added p50 over the floor, at 100 requests/s | ≤ 0.10 ms | – | 0.50 ms | no |", "### Routing quality", "50.0%",
		"`saturation_waiting = 5` and\n`saturation_kv_usage = 0.8`", "### Hot spot",
		"| tether adaptive | hot tenant | 80 | 0 | 0.0% | 0.0 ms | 250.0 ms | 7.5% | 2 |", "### Load spread",
		"| quality | Envoy ring hash | – |", "| quality | tether adaptive | 25.0% | 3–9 | 1.50 | 2 | 7 | 8 |", "| hot spot | tether adaptive | 5.0% |",
		"### Churn", "![x](docs/bench/x.png)", "commit abc"} {
		if !strings.Contains(md, want) {
			t.Errorf("markdown lacks %q", want)
		}
	}
}

func TestParseDecisions(t *testing.T) {
	text := `# HELP tether_requests_total Routing decisions …
# TYPE tether_requests_total counter
tether_requests_total{decision="bind",mode="adaptive",source="session"} 12
tether_requests_total{decision="hit",mode="adaptive",source="session"} 30
tether_requests_total{decision="hit",mode="adaptive",source="token"} 8
tether_requests_total{decision="spilled",mode="adaptive",source="token"} 10 1700000000000
tether_requests_totally{decision="spilled"} 99
tether_store_errors_total 0
`
	got, err := parseDecisions(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(map[string]float64{"bind": 12, "hit": 38, "spilled": 10}, got); diff != "" {
		t.Error(diff)
	}
	if share, n := spilledShare(got); share != 10.0/60 || n != 60 {
		t.Errorf("spilled share %v of %d", share, n)
	}
	if share, n := spilledShare(nil); share != 0 || n != 0 {
		t.Errorf("no decisions: %v of %d", share, n)
	}
	if _, err := parseDecisions(strings.NewReader(`tether_requests_total{mode="sticky"} 1`)); err == nil {
		t.Error("a line without a decision label parsed")
	}
}

func TestSpreadOf(t *testing.T) {
	depths := map[string][]int{"a": {0, 1, 2, 3}, "b": {9, 1}}
	got := spreadOf([]string{"a", "b", "c"}, []string{"a", "a", "a", "b", "", "b", "b", "b", "b"}, depths)
	// a 3, b 5, c 0: mean 8/3. Depths 0 1 1 2 3 9: p50 1 (third of six), p99 9.
	want := Spread{MinRequests: 0, MaxRequests: 5, Imbalance: 5 / (8.0 / 3), QueueP50: 1, QueueP99: 9, BusiestQueueP99: 9}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Error(diff)
	}
	if (spreadOf(nil, nil, nil) != Spread{}) {
		t.Error("empty spread")
	}
}

func TestTrafficOf(t *testing.T) {
	ms := time.Millisecond
	got := trafficOf([]sample{
		{ok: true, ttft: 10 * ms, instance: "a", decision: "hit", prompt: 100, cached: 50},
		{ok: true, ttft: 30 * ms, instance: "b", decision: "spilled", prompt: 100, cached: 0},
		{ok: true, ttft: 20 * ms, instance: "b", decision: "hit", prompt: 200, cached: 150},
		{ok: false, instance: "c"}, // failed: counted, not measured
	})
	want := Traffic{Requests: 4, Failed: 1, HitRate: 0.5, TTFTP50: 20 * ms, TTFTP99: 30 * ms, Spilled: 1.0 / 3, Instances: 2}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Error(diff)
	}
}

func TestHotTenantSchedule(t *testing.T) {
	// A server that answers like the emulator: the tenant's requests are
	// sent on schedule, carry its token, and their answers are read.
	var mu sync.Mutex
	var tokens []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		tokens = append(tokens, r.Header.Get("Authorization"))
		mu.Unlock()
		w.Header().Set("x-instance", "i1")
		w.Header().Set("x-tether-decision", "hit")
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n")
		fmt.Fprint(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1020,\"prompt_tokens_details\":{\"cached_tokens\":1000}}}\n\n")
		fmt.Fprint(w, "data: [DONE]\n\n")
	}))
	defer srv.Close()
	sc := Scale{HotRate: 100, HotDocTokens: 20}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	job := hotJob(sc, 1, 0, 100*time.Millisecond)
	got, err := hotTenant(ctx, srv.Client(), srv.URL, sc, job, time.Now(), 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 10 {
		t.Fatalf("%d requests, want 10 (100/s for 100ms)", len(got))
	}
	tr := trafficOf(got)
	if tr.Failed != 0 || tr.HitRate != 1000.0/1020 || tr.Instances != 1 {
		t.Errorf("%+v", tr)
	}
	for _, tok := range tokens {
		if tok != hotToken {
			t.Errorf("token %q", tok)
		}
	}
}

// parseDecisions is decisions on a /metrics text.
func parseDecisions(r io.Reader) (map[string]float64, error) {
	m, err := promtext.Parse(r)
	if err != nil {
		return nil, err
	}
	return decisionCounts(m)
}
