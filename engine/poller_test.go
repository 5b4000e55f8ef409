package engine_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/engine"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/replicas"
	"github.com/tetherproxy/tether/store/memory"
)

// vllmText is a small vLLM exposition with waiting requests.
func vllmText(waiting int, hits, queries float64) string {
	return fmt.Sprintf(`# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} %d.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} %g
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} %g
`, waiting, queries, hits)
}

// fakeEngines serves n instances' /metrics on loopback and counts scrapes.
type fakeEngines struct {
	srv     *httptest.Server
	scrapes sync.Map // instance → *atomic.Int64
	broken  atomic.Bool
}

func newFakeEngines(t *testing.T) *fakeEngines {
	f := &fakeEngines{}
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		name := strings.TrimPrefix(r.URL.Path, "/")
		c, _ := f.scrapes.LoadOrStore(name, new(atomic.Int64))
		c.(*atomic.Int64).Add(1)
		if f.broken.Load() {
			http.Error(w, "<html>gone</html>", http.StatusNotFound)
			return
		}
		fmt.Fprint(w, vllmText(6, 10, 40))
	}))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeEngines) count(name string) int64 {
	c, ok := f.scrapes.Load(name)
	if !ok {
		return 0
	}
	return c.(*atomic.Int64).Load()
}

func (f *fakeEngines) fleet(n int) []fleet.Instance {
	out := make([]fleet.Instance, n)
	for i := range out {
		name := fmt.Sprintf("gpu-%d", i)
		out[i] = fleet.Instance{Name: name, Engine: "vllm", MetricsURL: f.srv.URL + "/" + name}
	}
	return append(out, fleet.Instance{Name: "generic"}) // not scraped
}

type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// TestPollersShareTheFleet: three replicas on one store scrape each
// instance once per round between them; when the one holding a shard
// stops, another takes it over once the lease runs out, and no reading
// older than the staleness bound is used meanwhile.
func TestPollersShareTheFleet(t *testing.T) {
	f := newFakeEngines(t)
	st := memory.New()
	clk := &clock{t: time.Unix(1_700_000_000, 0)}
	ins := f.fleet(24)
	const interval = time.Second
	pollers := make([]*engine.Poller, 3)
	loads := make([]*affinity.Load, 3)
	for i := range pollers {
		loads[i] = affinity.NewLoad()
		pollers[i] = &engine.Poller{
			Instances: func() []fleet.Instance { return ins },
			Load:      loads[i], Shards: &replicas.Shards{Replica: fmt.Sprintf("r%d", i), Leases: st, Interval: interval}, Scraper: &engine.Scraper{Timeout: time.Second},
			Tracker: engine.NewTracker(), Interval: interval, Now: clk.now,
		}
	}
	round := func(ps ...*engine.Poller) {
		for _, p := range ps {
			p.Round(t.Context())
		}
		clk.add(interval)
	}
	for range 5 {
		round(pollers...)
	}
	for _, in := range ins[:24] {
		if n := f.count(in.Name); n != 5 {
			t.Errorf("%s scraped %d times in 5 rounds of 3 replicas, want 5", in.Name, n)
		}
	}
	if n := f.count("generic"); n != 0 {
		t.Errorf("a generic instance was scraped %d times", n)
	}
	// Whoever holds gpu-0's shard stops; the other two go on.
	var owner int
	for i, l := range loads {
		if _, ok := l.Engine("gpu-0", 0); ok {
			owner = i
		}
	}
	var rest []*engine.Poller
	for i, p := range pollers {
		if i != owner {
			rest = append(rest, p)
		}
	}
	before := f.count("gpu-0")
	rounds := 0
	for f.count("gpu-0") == before {
		if rounds++; rounds > 5 {
			t.Fatalf("gpu-0 not scraped again %d rounds after its scraper stopped", rounds)
		}
		round(rest...)
	}
	// The lease lasts three intervals; it was renewed just before the stop.
	if rounds > 4 {
		t.Errorf("takeover took %d rounds, want at most 4", rounds)
	}
	stale := 5 * time.Second
	for i, l := range loads {
		if r, ok := l.Engine("gpu-0", stale); ok && clk.now().Sub(r.At) > stale {
			t.Errorf("replica %d uses a reading %v old", i, clk.now().Sub(r.At))
		}
	}
}

// TestPollerFailingEngineExpires: a failing /metrics is counted and its
// reading simply ages out.
func TestPollerFailingEngineExpires(t *testing.T) {
	f := newFakeEngines(t)
	clk := &clock{t: time.Unix(1_700_000_000, 0)}
	ins := f.fleet(2)
	load := affinity.NewLoad()
	rec := &recorder{reasons: map[string]int{}}
	var logged []string
	p := &engine.Poller{
		Instances: func() []fleet.Instance { return ins }, Load: load, Shards: &replicas.Shards{Replica: "r0", Leases: memory.New(), Interval: time.Second},
		Scraper: &engine.Scraper{Timeout: time.Second}, Tracker: engine.NewTracker(), Interval: time.Second,
		Now: clk.now, Recorder: rec, Log: func(n int, s string) { logged = append(logged, s) },
	}
	p.Round(t.Context())
	if r, ok := load.Engine("gpu-0", 0); !ok || r.Waiting != 6 {
		t.Fatalf("reading after a good scrape: %+v, %v", r, ok)
	}
	f.broken.Store(true)
	for range 3 {
		clk.add(time.Second)
		p.Round(t.Context())
	}
	if rec.reasons[engine.ReasonStatus] != 6 {
		t.Errorf("errors by reason %v, want 6 status", rec.reasons)
	}
	if len(logged) != 3 || !strings.Contains(logged[0], "gpu-0") {
		t.Errorf("logged %q, want one line per round naming the instances", logged)
	}
	if _, ok := load.Engine("gpu-0", 2*time.Second); ok {
		t.Error("a 3 s old reading is used under a 2 s staleness bound")
	}
	if load.Saturated("gpu-0", affinity.Saturation{Waiting: 5, Stale: 2 * time.Second}) {
		t.Error("an instance whose /metrics fails stays saturated by its old reading")
	}
}

type recorder struct {
	mu      sync.Mutex
	reasons map[string]int
}

func (r *recorder) Scraped(_ string, _ time.Duration, reason string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if reason != "" {
		r.reasons[reason]++
	}
}

func (r *recorder) Shards(int) {}

// downLeases is a store that cannot be reached.
type downLeases struct{}

func (downLeases) Lease(context.Context, string, string, time.Duration, time.Time) (bool, error) {
	return false, errors.New("redis: connection refused")
}
func (downLeases) Release(context.Context, string, string) error { return nil }

// TestPollerScrapesWhenLeasesFail: with the store unreachable no replica
// can share readings, so each scrapes every instance for itself, and says
// so in its round's log line.
func TestPollerScrapesWhenLeasesFail(t *testing.T) {
	f := newFakeEngines(t)
	ins := f.fleet(4)
	load := affinity.NewLoad()
	var logged []string
	p := &engine.Poller{
		Instances: func() []fleet.Instance { return ins }, Load: load, Shards: &replicas.Shards{Replica: "r0", Leases: downLeases{}, Interval: time.Second},
		Scraper: &engine.Scraper{Timeout: time.Second}, Tracker: engine.NewTracker(), Interval: time.Second,
		Log: func(_ int, s string) { logged = append(logged, s) },
	}
	p.Round(t.Context())
	for _, in := range ins[:4] {
		if _, ok := load.Engine(in.Name, 0); !ok || f.count(in.Name) != 1 {
			t.Errorf("%s: scraped %d times, reading kept %v; want one scrape and its reading", in.Name, f.count(in.Name), ok)
		}
	}
	if len(logged) != 1 || !strings.Contains(logged[0], "leases") {
		t.Errorf("logged %q, want the lease failure", logged)
	}
}

// TestPollerReleasesOnStop: a replica that stops gives its leases back,
// so another scrapes its instances at its next round, not a lease later.
func TestPollerReleasesOnStop(t *testing.T) {
	f := newFakeEngines(t)
	ins := f.fleet(4)
	st := memory.New()
	clk := &clock{t: time.Unix(1_700_000_000, 0)}
	mk := func(name string) *engine.Poller {
		return &engine.Poller{
			Instances: func() []fleet.Instance { return ins }, Load: affinity.NewLoad(), Shards: &replicas.Shards{Replica: name, Leases: st, Interval: time.Hour},
			Scraper: &engine.Scraper{Timeout: time.Second}, Tracker: engine.NewTracker(), Interval: time.Hour, Now: clk.now,
		}
	}
	first, second := mk("r0"), mk("r1")
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { first.Run(ctx); close(done) }()
	// The first replica's round scrapes its instances concurrently: wait
	// for all four, or a scrape still under way is cut short by the stop.
	for _, in := range ins[:4] {
		for f.count(in.Name) == 0 {
			time.Sleep(time.Millisecond)
		}
	}
	second.Round(t.Context())
	for _, in := range ins[:4] {
		if n := f.count(in.Name); n != 1 {
			t.Fatalf("%s: %d scrapes while the first replica holds the leases, want its 1", in.Name, n)
		}
	}
	cancel()
	<-done
	second.Round(t.Context()) // the same instant: the leases have not run out
	for _, in := range ins[:4] {
		if n := f.count(in.Name); n != 2 {
			t.Errorf("%s: %d scrapes after the first replica stopped, want a second by the other", in.Name, n)
		}
	}
}
