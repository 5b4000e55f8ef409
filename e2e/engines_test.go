//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"math"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/promtext"
	"github.com/tetherproxy/tether/internal/testenv"
	"github.com/tetherproxy/tether/lab/emulator"
	"github.com/tetherproxy/tether/replicas"
)

// engineStats reads an emulated instance's own counters.
func engineStats(t *testing.T, in config.Instance) emulator.Stats {
	t.Helper()
	var s emulator.Stats
	getJSON(t, "http://"+in.Address+"/admin/stats", &s)
	return s
}

// engineReadings is what one tether exports of the engines: the age of
// each instance's reading, its shards, its scrapes.
type engineReadings struct {
	age            map[string]float64
	hits, queries  map[string]float64
	shards, scrape float64
}

func (p *tether) engines(t *testing.T) (engineReadings, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	m, err := promtext.Get(ctx, http.DefaultClient, "http://"+p.admin+"/metrics")
	if err != nil {
		return engineReadings{}, err
	}
	r := engineReadings{age: map[string]float64{}, hits: map[string]float64{}, queries: map[string]float64{},
		shards: m.Sum("tether_engine_scrape_shards", nil), scrape: m.Sum("tether_engine_scrapes_total", nil)}
	for name, into := range map[string]map[string]float64{
		"tether_engine_reading_age_seconds":             r.age,
		"tether_engine_prefix_cache_hit_tokens_total":   r.hits,
		"tether_engine_prefix_cache_query_tokens_total": r.queries,
	} {
		for _, s := range m[name].GetMetric() {
			for _, l := range s.GetLabel() {
				if l.GetName() == "upstream" {
					into[l.GetValue()] = s.GetGauge().GetValue() + s.GetCounter().GetValue()
				}
			}
		}
	}
	return r, nil
}

// TestEngineReadingsSharedByReplicas: three tether replicas on one
// redis-server scrape each vLLM instance about once per interval between
// them, not three times; when the replica that scrapes is killed, another
// takes over within 5 s, and meanwhile no replica exports (or uses, the
// two read the same filter) a reading older than the staleness bound.
func TestEngineReadingsSharedByReplicas(t *testing.T) {
	// The default interval, so the lease's three intervals are the
	// default's. A replica that does not scrape an instance has its
	// reading from its last load sync, which had it from the scraper's
	// last sync: up to an interval and two syncs old. The staleness bound
	// leaves that half an interval of slack; a reading of the killed
	// replica most often expires by it before its report does.
	const interval = config.DefaultScrapeInterval
	const staleness = interval + 2*replicas.LoadSyncEvery + interval/2
	inst := gpus(t, 6, 0)
	cfg := baseConfig(testenv.RedisServer(t).URL(), inst)
	cfg.Engines.Default = config.EngineVLLM
	cfg.Engines.Staleness = config.Dur(staleness)
	reps := []*tether{startTether(t, cfg), startTether(t, cfg), startTether(t, cfg)}

	scrapes := func() map[string]int64 {
		out := map[string]int64{}
		for _, in := range inst {
			out[in.Name] = engineStats(t, in).MetricsScrapes
		}
		return out
	}
	waitFor(t, 10*time.Second, "every instance scraped", func() bool {
		for _, n := range scrapes() {
			if n == 0 {
				return false
			}
		}
		return true
	})
	const window = 6 * time.Second
	before := scrapes()
	time.Sleep(window)
	after := scrapes()
	want := float64(window / interval)
	for _, in := range inst {
		n := float64(after[in.Name] - before[in.Name])
		t.Logf("%s: %.0f scrapes in %v at an interval of %v, by three replicas", in.Name, n, window, interval)
		if n < 0.7*want || n > 1.4*want {
			t.Errorf("%s scraped %.0f times in %v; one scrape per %v for the whole fleet is %.0f", in.Name, n, window, interval, want)
		}
	}

	// Kill every replica that holds a shard but one replica (the last one
	// standing must be able to take over).
	var victims, survivors []*tether
	for _, r := range reps {
		er, err := r.engines(t)
		if err != nil {
			t.Fatal(err)
		}
		if er.shards > 0 && len(victims) < len(reps)-1 {
			victims = append(victims, r)
		} else {
			survivors = append(survivors, r)
		}
	}
	if len(victims) == 0 {
		t.Fatal("no replica holds a shard")
	}
	// Poll the survivors' readings from before the kill until well after.
	var (
		mu       sync.Mutex
		worst    float64
		tooOld   []string
		pollDone = make(chan struct{})
		stopPoll = make(chan struct{})
	)
	go func() {
		defer close(pollDone)
		for {
			for i, r := range survivors {
				er, err := r.engines(t)
				if err != nil {
					continue
				}
				mu.Lock()
				for up, age := range er.age {
					worst = math.Max(worst, age)
					if age > staleness.Seconds()+0.05 {
						tooOld = append(tooOld, fmt.Sprintf("survivor %d: %s %.2fs", i, up, age))
					}
				}
				mu.Unlock()
			}
			select {
			case <-stopPoll:
				return
			case <-time.After(50 * time.Millisecond):
			}
		}
	}()
	time.Sleep(500 * time.Millisecond)
	base := scrapes()
	killed := time.Now()
	for _, v := range victims {
		v.stopOnce.Do(v.proc.Kill) // SIGKILL: its leases are not given back
	}
	pending := map[string]bool{}
	for _, in := range inst {
		pending[in.Name] = true
	}
	var took time.Duration
	for len(pending) > 0 {
		if time.Since(killed) > 10*time.Second {
			t.Fatalf("instances %v not scraped again 10 s after the scraping replicas were killed", pending)
		}
		now := scrapes()
		for name := range pending {
			// The first count may still be the victim's last scrape, in flight.
			if now[name] > base[name]+1 {
				delete(pending, name)
			}
		}
		took = time.Since(killed)
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(2 * staleness)
	close(stopPoll)
	<-pollDone
	t.Logf("killed %d of 3 replicas (those holding shards); every instance scraped again %v later; the survivors' oldest exported reading: %.2fs (bound %v)",
		len(victims), took.Round(10*time.Millisecond), worst, staleness)
	if took > 5*time.Second {
		t.Errorf("takeover took %v, want at most 5 s", took)
	}
	if len(tooOld) > 0 {
		t.Errorf("readings older than the %v bound exported: %v", staleness, tooOld[:min(len(tooOld), 5)])
	}
	// Every survivor, scraping or not, keeps a fresh reading of every
	// instance through more than a load sync.
	var held, oldest float64
	for end := time.Now().Add(replicas.LoadSyncEvery + interval/2); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		held = 0
		for i, r := range survivors {
			er, err := r.engines(t)
			if err != nil {
				t.Fatal(err)
			}
			held += er.shards
			if len(er.age) != len(inst) {
				t.Fatalf("survivor %d (%.0f shards) has fresh readings of %d instances, want %d: %v", i, er.shards, len(er.age), len(inst), er.age)
			}
			for _, age := range er.age {
				oldest = max(oldest, age)
			}
		}
	}
	t.Logf("after the takeover the survivors' oldest reading was %.2fs", oldest)
	if held == 0 {
		t.Error("no survivor holds a shard")
	}
}

// startGPUInstances serves n emulated A100s (time ×scale) with a prefix KV
// cache, batches capped at 4 as in gpus.
func startGPUInstances(t *testing.T, n int, scale float64) []config.Instance {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	out := make([]config.Instance, n)
	for i := range out {
		name := fmt.Sprintf("gpu-%d", i)
		m, err := emulator.NewGPU(emulator.GPUConfig{Profile: emulator.ProfileA100(), TimeScale: scale})
		if err != nil {
			t.Fatal(err)
		}
		h, err := emulator.NewHandler(emulator.Instance{Name: name, LatencyModel: m, Model: "v1"})
		if err != nil {
			t.Fatal(err)
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() { _ = emulator.Serve(ctx, ln, h) })
		out[i] = config.Instance{Name: name, Address: ln.Addr().String(), Zone: "zone-a", Version: "v1", Weight: 1}
	}
	return out
}

// TestEngineHitRatioMatchesEngines: the KV-cache hit ratio tether exports
// per instance (the engines' counters, mirrored from their /metrics) is
// the emulated engines' own, within one point, over a window of sticky
// conversations through Envoy.
func TestEngineHitRatioMatchesEngines(t *testing.T) {
	inst := startGPUInstances(t, 3, 0.02)
	cfg := baseConfig(testenv.RedisServer(t).URL(), inst)
	cfg.Engines.Default = config.EngineVLLM
	cfg.Engines.ScrapeInterval = config.Dur(250 * time.Millisecond)
	cfg.Engines.ScrapeTimeout = config.Dur(250 * time.Millisecond)
	tt := startTether(t, cfg)
	px := startEnvoy(t, cfg, tt.extproc)

	system := strings.Repeat("You are a careful assistant for the tether test suite. ", 60)
	send := func(round int) {
		parallel(60, 6, func(s int) {
			body := fmt.Sprintf(`{"model":"v1","max_tokens":8,"messages":[{"role":"system","content":%q},{"role":"user","content":"question %d of session %d"}]}`,
				system, round, s)
			req, err := http.NewRequest(http.MethodPost, px.url+"/v1/chat/completions", strings.NewReader(body))
			if err != nil {
				t.Error(err)
				return
			}
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("x-session-id", fmt.Sprintf("ratio-%d", s))
			resp, err := client.Do(req)
			if err != nil {
				t.Error(err)
				return
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Errorf("session %d round %d: status %d", s, round, resp.StatusCode)
			}
		})
	}
	// quiet waits until tether's mirror of every engine's counters equals
	// the engine's (no traffic: a scrape or two), and returns both.
	type counts struct{ hits, queries float64 }
	quiet := func() (tether, engine map[string]counts) {
		var er engineReadings
		waitFor(t, 5*time.Second, "tether's readings to catch up with the engines", func() bool {
			var err error
			if er, err = tt.engines(t); err != nil {
				return false
			}
			engine = map[string]counts{}
			for _, in := range inst {
				s := engineStats(t, in)
				engine[in.Name] = counts{float64(s.PrefixCacheHits), float64(s.PrefixCacheQueries)}
				if er.hits[in.Name] != float64(s.PrefixCacheHits) || er.queries[in.Name] != float64(s.PrefixCacheQueries) {
					return false
				}
			}
			return true
		})
		tether = map[string]counts{}
		for _, in := range inst {
			tether[in.Name] = counts{er.hits[in.Name], er.queries[in.Name]}
		}
		return tether, engine
	}
	send(0) // cold caches
	t0, e0 := quiet()
	for round := 1; round <= 3; round++ {
		send(round)
	}
	t1, e1 := quiet()
	for _, in := range inst {
		n := in.Name
		tq, eq := t1[n].queries-t0[n].queries, e1[n].queries-e0[n].queries
		if tq <= 0 || eq <= 0 {
			t.Errorf("%s: no prefix-cache queries in the window (tether %v, engine %v)", n, tq, eq)
			continue
		}
		tr, er := (t1[n].hits-t0[n].hits)/tq, (e1[n].hits-e0[n].hits)/eq
		t.Logf("%s: KV-cache hit ratio over the window: tether %.4f, the engine's own counters %.4f (%.0f tokens looked up)", n, tr, er, eq)
		if math.Abs(tr-er) > 0.01 {
			t.Errorf("%s: tether's hit ratio %.4f, the engine's %.4f: more than a point apart", n, tr, er)
		}
		if er < 0.5 {
			t.Errorf("%s: hit ratio %.2f on warm sticky sessions sharing a system prompt: the window measured nothing", n, er)
		}
	}
}
