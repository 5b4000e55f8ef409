package bench

// The soak run (`tether-lab bench soak`, `make soak`): not a scenario of the
// suite and not part of any test target. It keeps tether under a steady,
// bounded load for minutes, with sessions bound, hit and expired all the
// while, and samples what a leak would show: tether's resident memory, its
// Go heap in use and its goroutine count.

import (
	"context"
	"errors"
	"fmt"
	"image/color"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/pace"
	"github.com/tetherproxy/tether/internal/progress"
	"github.com/tetherproxy/tether/internal/promtext"
	"github.com/tetherproxy/tether/lab/emulator"
)

// SoakOptions configure a soak run. Zero fields take the defaults
// (DefaultSoak); Validate names a bad field and its value.
type SoakOptions struct {
	TetherBin, EnvoyBin, RedisBin string
	// Duration of the load; the run stops by itself after it.
	Duration time.Duration
	// Rate is the open-loop request rate, requests per second.
	Rate float64
	// Every is the time between two samples.
	Every time.Duration
	// IdleTimeout is tether's routing.idle_timeout: short, so that the
	// bindings of retired sessions expire during the run.
	IdleTimeout time.Duration
	// Instances is the number of emulated instances (answering after
	// InstanceLatency, no GPU model).
	Instances       int
	InstanceLatency time.Duration
	// Sessions session ids and Tokens API tokens are in use at any time;
	// each is used for Turns requests, then retired for a fresh one.
	Sessions, Tokens, Turns int
	// Log receives progress lines; Progress, when not nil, a progress bar.
	Log, Progress io.Writer
}

// DefaultSoak is what `make soak` runs: 150 requests/s for ten minutes. Of
// every 20 requests 15 carry a session id, 3 an API token and 2 nothing
// (anonymous, routed at random). A session id then gets a request every
// 300/112.5 ≈ 2.7 s (a hit: well within the idle timeout) for 20 turns,
// about 53 s, and is retired; its binding expires 30 s later. About seven
// new bindings a second are created and as many expire.
var DefaultSoak = SoakOptions{
	Duration: 10 * time.Minute, Rate: 150, Every: 10 * time.Second, IdleTimeout: 30 * time.Second,
	Instances: 4, InstanceLatency: 5 * time.Millisecond, Sessions: 300, Tokens: 40, Turns: 20,
}

// Verdict rule: tether is flat when the least-squares line through the
// second half's RSS samples rises by less than soakRSSGrowth of its value
// at the start of that half, and the last minute's mean goroutine count is
// within soakGoroutineBand of the first minute's (at least
// soakGoroutineFloor goroutines either way).
const (
	soakRSSGrowth      = 0.05
	soakGoroutineBand  = 0.10
	soakGoroutineFloor = 3
)

// withDefaults fills the zero fields from DefaultSoak.
func (o SoakOptions) withDefaults() SoakOptions {
	d := DefaultSoak
	set := func(v *time.Duration, def time.Duration) {
		if *v == 0 {
			*v = def
		}
	}
	seti := func(v *int, def int) {
		if *v == 0 {
			*v = def
		}
	}
	set(&o.Duration, d.Duration)
	set(&o.Every, d.Every)
	set(&o.IdleTimeout, d.IdleTimeout)
	set(&o.InstanceLatency, d.InstanceLatency)
	if o.Rate == 0 {
		o.Rate = d.Rate
	}
	seti(&o.Instances, d.Instances)
	seti(&o.Sessions, d.Sessions)
	seti(&o.Tokens, d.Tokens)
	seti(&o.Turns, d.Turns)
	if o.Log == nil {
		o.Log = io.Discard
	}
	return o
}

// Validate checks a run's options once defaults are filled in.
func (o SoakOptions) Validate() error {
	var errs []error
	bad := func(key string, v any, want string) { errs = append(errs, fmt.Errorf("soak %s %v: %s", key, v, want)) }
	if o.Every <= 0 {
		bad("every", o.Every, "want more than 0")
	} else if o.Duration < 2*o.Every {
		bad("duration", o.Duration, fmt.Sprintf("want at least two samples (2 × every, %v)", 2*o.Every))
	}
	if o.Rate <= 0 || o.Rate > 5000 || math.IsNaN(o.Rate) {
		bad("rate", o.Rate, "want more than 0 and at most 5000 requests/s")
	}
	if o.IdleTimeout < time.Second {
		bad("idle timeout", o.IdleTimeout, "want at least 1s (tether's minimum)")
	}
	if o.Instances < 1 || o.Instances > 64 {
		bad("instances", o.Instances, "want 1 to 64")
	}
	if o.InstanceLatency < 0 {
		bad("instance latency", o.InstanceLatency, "want 0 or more")
	}
	for _, f := range []struct {
		key string
		v   int
	}{{"sessions", o.Sessions}, {"tokens", o.Tokens}, {"turns", o.Turns}} {
		if f.v < 1 {
			bad(f.key, f.v, "want at least 1")
		}
	}
	return errors.Join(errs...)
}

// SessionGap is how often one session id is used: the time between two
// requests of the same session, which must stay under the idle timeout for
// its turns to be hits.
func (o SoakOptions) SessionGap() time.Duration {
	return time.Duration(float64(o.Sessions) / (o.Rate * 15 / 20) * float64(time.Second))
}

// soakCaller is who sends one request: a session id, an API token, or
// neither (anonymous).
type soakCaller struct{ session, token string }

// caller is the n-th request's caller. Of every 20 requests the first 2 are
// anonymous, the next 3 carry a token, the last 15 a session id; each kind
// rotates through its own pool.
func (o SoakOptions) caller(n int) soakCaller {
	q, r := n/20, n%20
	switch {
	case r < 2:
		return soakCaller{}
	case r < 5:
		slot, gen := rotate(q*3+r-2, o.Tokens, o.Turns)
		return soakCaller{token: fmt.Sprintf("soak-token-%d-%d", slot, gen)}
	default:
		slot, gen := rotate(q*15+r-5, o.Sessions, o.Turns)
		return soakCaller{session: fmt.Sprintf("soak-%d-%d", slot, gen)}
	}
}

// rotate maps the n-th use of a pool of slots to a slot and the generation
// of its name: slots are used in turn, and each name lasts turns uses of
// its slot before a fresh one replaces it. Slot k changes names k%turns
// passes out of step, so that a few names retire on every pass instead of
// the whole pool at once.
func rotate(n, slots, turns int) (slot, gen int) {
	slot = n % slots
	return slot, (n/slots + slot%turns) / turns
}

// SoakSample is one reading, At after the load began.
type SoakSample struct {
	At time.Duration
	// RSS is tether's VmRSS, HeapInuse its go_memstats_heap_inuse_bytes.
	RSS, HeapInuse int64
	Goroutines     int
	// RedisKeys is redis-server's DBSIZE: bindings, index entries and links,
	// which stay bounded when expiry keeps up.
	RedisKeys int64
	// Sent, Failed and Dropped count the requests so far, InFlight those
	// unanswered at the sample; P99 is the latency of those answered since
	// the previous sample, Lag the most a send was late on its schedule.
	Sent, Failed, Dropped, InFlight int64
	P99, Lag                        time.Duration
	// Load is the machine's one-minute load average.
	Load float64
}

// SoakReport is one soak run.
type SoakReport struct {
	Started time.Time
	Options SoakOptions
	Samples []SoakSample
	// Requests sent, failed (an error or not 200), dropped (the client had
	// 512 in flight already); Failures counts the failed by kind.
	Sent, Failed, Dropped int64
	Failures              map[string]int64
	// Decisions are tether's routing decisions by kind (tether_requests_total).
	Decisions map[string]float64
	// LoadAvg is the machine's one-minute load average at the start and the
	// end: how busy the machine was besides.
	LoadAvg [2]float64
	Summary SoakSummary
}

// Soak starts redis-server, the emulated instances, tether (sticky, on
// redis-server) and Envoy, sends o.Rate requests a second through Envoy for
// o.Duration and samples tether every o.Every.
func Soak(ctx context.Context, o SoakOptions) (*SoakReport, error) {
	o = o.withDefaults()
	if err := o.Validate(); err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "tether-soak")
	if err != nil {
		return nil, err
	}
	defer func() { _ = os.RemoveAll(dir) }() // scratch files only

	fleet := newSimFleet(func(string) (emulator.LatencyModel, error) { return emulator.Fixed(o.InstanceLatency), nil })
	defer fleet.close()
	var instances []config.Instance
	for i := 0; i < o.Instances; i++ {
		in, err := fleet.add(fmt.Sprintf("soak-%d", i), []string{"zone-a", "zone-b"}[i%2])
		if err != nil {
			return nil, err
		}
		instances = append(instances, in)
	}
	sticky := policy{name: "tether sticky", store: true, edit: func(c *config.Config) {
		c.Routing.Mode = config.ModeSticky
		c.Routing.IdleTimeout = config.Dur(o.IdleTimeout)
	}}
	fmt.Fprintf(o.Log, "soak: starting redis-server, %d instances, tether and Envoy\n", o.Instances)
	st, err := startStack(ctx, Options{TetherBin: o.TetherBin, EnvoyBin: o.EnvoyBin, RedisBin: o.RedisBin}, dir, sticky, instances)
	if err != nil {
		return nil, err
	}
	defer st.close()
	client := newLoadClient()
	defer client.CloseIdleConnections()

	// Every kind of caller gets through before the clock starts.
	pctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	err = st.envoy.Poll(pctx, "an answer through Envoy for every kind of caller", func(ctx context.Context) error {
		for i := 0; i < 20; i++ {
			if err := sendAs(ctx, client, st.envoy.URL(), o.caller(i), nil); err != nil {
				return err
			}
		}
		return nil
	})
	cancel()
	if err != nil {
		return nil, err
	}

	r := &SoakReport{Started: time.Now(), Options: o}
	r.LoadAvg[0], _ = loadAvg()
	first, err := sampleSoak(ctx, st, 0, &soakLoad{})
	if err != nil {
		return nil, err
	}
	r.Samples = append(r.Samples, first)
	fmt.Fprintf(o.Log, "soak: %.0f requests/s for %s, a sample every %s\n", o.Rate, o.Duration, o.Every)

	load := &soakLoad{}
	lctx, stopLoad := context.WithCancel(ctx)
	defer stopLoad()
	begin := time.Now()
	loadDone := make(chan error, 1)
	go func() { loadDone <- load.run(lctx, client, st.envoy.URL(), o, begin) }()
	bar := startSoakBar(o.Progress, o.Duration, begin, load, first)
	for k := 1; time.Duration(k)*o.Every <= o.Duration && err == nil; k++ {
		at := time.Duration(k) * o.Every
		if !sleepUntil(ctx, begin.Add(at)) {
			err = ctx.Err()
			break
		}
		var s SoakSample
		if s, err = sampleSoak(ctx, st, at, load); err == nil {
			r.Samples = append(r.Samples, s)
			bar.show(s)
		}
	}
	if err != nil {
		stopLoad()
	}
	if lerr := <-loadDone; err == nil {
		err = lerr
	}
	bar.stop()
	if err != nil {
		return r, fmt.Errorf("soak: %w", err)
	}
	r.Sent, r.Failed, r.Dropped = load.sent.Load(), load.failed.Load(), load.dropped.Load()
	load.mu.Lock()
	r.Failures = load.failures
	load.mu.Unlock()
	r.LoadAvg[1], _ = loadAvg()
	if r.Decisions, err = decisions(ctx, st.tether.Admin); err != nil {
		return r, err
	}
	r.Summary = summarize(r.Samples, o.Duration)
	return r, nil
}

// soakLoad sends the requests and counts them.
type soakLoad struct {
	sent, failed, dropped, inflight atomic.Int64
	mu                              sync.Mutex
	lat                             []time.Duration // of the answers since the last take
	lag                             time.Duration   // the most a send was late since the last take
	failures                        map[string]int64
}

// run sends o.Rate requests a second from begin for o.Duration (open loop:
// at most 512 in flight, the rest dropped) and returns when the last one
// is answered.
func (l *soakLoad) run(ctx context.Context, client *http.Client, url string, o SoakOptions, begin time.Time) error {
	const maxInFlight = 512
	return pace.Schedule{Rate: o.Rate, For: o.Duration, Start: begin, MaxInFlight: maxInFlight}.Run(ctx, func(a pace.Arrival) func() {
		l.mu.Lock()
		l.lag = max(l.lag, a.Late)
		l.mu.Unlock()
		if a.Dropped {
			l.dropped.Add(1)
			return nil
		}
		l.inflight.Add(1)
		l.sent.Add(1)
		c := o.caller(a.N)
		return func() {
			defer l.inflight.Add(-1)
			err := sendAs(ctx, client, url, c, nil)
			took := time.Since(a.Due)
			l.mu.Lock()
			defer l.mu.Unlock()
			if err != nil {
				l.failed.Add(1)
				if l.failures == nil {
					l.failures = map[string]int64{}
				}
				l.failures[failureKind(err)]++
				return
			}
			l.lat = append(l.lat, took)
		}
	})
}

// take returns the p99 latency of the answers since the last take and the
// most a send was late against its schedule (the load generator starved
// of CPU, or the whole machine paused).
func (l *soakLoad) take() (p99, lag time.Duration) {
	l.mu.Lock()
	lat := l.lat
	l.lat, lag, l.lag = nil, l.lag, 0
	l.mu.Unlock()
	sortDurations(lat)
	return percentile(lat, 0.99), lag
}

// failureKind names what went wrong with a request: "status 503", "client
// timeout", "transport".
func failureKind(err error) string {
	var st statusError
	var ne net.Error
	switch {
	case errors.As(err, &st):
		return fmt.Sprintf("status %d", int(st))
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
		return "client timeout"
	default:
		return "transport"
	}
}

// statusError is an answer other than 200.
type statusError int

func (e statusError) Error() string { return fmt.Sprintf("status %d", int(e)) }

// sendAs posts one tiny request as caller c.
func sendAs(ctx context.Context, client *http.Client, url string, c soakCaller, extra http.Header) error {
	_, err := postTiny(ctx, client, url, c, extra)
	return err
}

// postTiny posts one tiny request from caller c, with the extra headers
// (canonical keys, shared: they are only read), and returns the answer's
// headers.
func postTiny(ctx context.Context, client *http.Client, url string, c soakCaller, extra http.Header) (http.Header, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions", strings.NewReader(tinyBody))
	if err != nil {
		return nil, err
	}
	for k, v := range extra {
		req.Header[k] = v
	}
	req.Header.Set("Content-Type", "application/json")
	if c.session != "" {
		req.Header.Set("x-session-id", c.session)
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, statusError(resp.StatusCode)
	}
	return resp.Header, nil
}

// sampleSoak reads tether's RSS, heap and goroutines, and redis-server's
// key count.
func sampleSoak(ctx context.Context, st *stack, at time.Duration, l *soakLoad) (SoakSample, error) {
	s := SoakSample{At: at, Sent: l.sent.Load(), Failed: l.failed.Load(), Dropped: l.dropped.Load(), InFlight: l.inflight.Load()}
	s.P99, s.Lag = l.take()
	s.Load, _ = loadAvg()
	var err error
	if s.RSS, err = rss(st.tether.Pid()); err != nil {
		return s, fmt.Errorf("tether RSS at %s: %w", at, err)
	}
	g, err := scrapeGauges(ctx, st.tether.Admin, "go_goroutines", "go_memstats_heap_inuse_bytes")
	if err != nil {
		return s, fmt.Errorf("tether metrics at %s: %w", at, err)
	}
	s.Goroutines, s.HeapInuse = int(g["go_goroutines"]), int64(g["go_memstats_heap_inuse_bytes"])
	if s.RedisKeys, err = st.rdb.DBSize(ctx).Result(); err != nil {
		return s, fmt.Errorf("redis-server DBSIZE at %s: %w", at, err)
	}
	return s, nil
}

// rss is process pid's resident set size, from /proc/<pid>/status.
func rss(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	return parseVmRSS(string(b))
}

// parseVmRSS reads the VmRSS line of a /proc/<pid>/status ("VmRSS:   1234
// kB") in bytes.
func parseVmRSS(status string) (int64, error) {
	for _, line := range strings.Split(status, "\n") {
		rest, ok := strings.CutPrefix(line, "VmRSS:")
		if !ok {
			continue
		}
		f := strings.Fields(rest)
		if len(f) != 2 || f[1] != "kB" {
			return 0, fmt.Errorf("VmRSS line %q: want a number of kB", line)
		}
		kb, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil || kb < 0 {
			return 0, fmt.Errorf("VmRSS line %q: want a number of kB", line)
		}
		return kb << 10, nil
	}
	return 0, errors.New("no VmRSS line in /proc status")
}

// scrapeGauges reads the named unlabelled metrics from tether's /metrics.
func scrapeGauges(ctx context.Context, admin string, names ...string) (map[string]float64, error) {
	m, err := scrape(ctx, admin)
	if err != nil {
		return nil, err
	}
	return gauges(m, names...)
}

// gauges are the values of the unlabelled metrics names; each must be
// there.
func gauges(m promtext.Metrics, names ...string) (map[string]float64, error) {
	out := map[string]float64{}
	for _, n := range names {
		v, ok := m.Value(n)
		if !ok {
			return nil, fmt.Errorf("metric %s: not exported", n)
		}
		out[n] = v
	}
	return out, nil
}

// loadAvg is the machine's one-minute load average.
func loadAvg() (float64, error) {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0, err
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0, errors.New("empty /proc/loadavg")
	}
	return strconv.ParseFloat(f[0], 64)
}

// SoakMeans are the mean readings of a window of samples.
type SoakMeans struct {
	RSS, Heap, Goroutines float64
	N                     int // samples in the window
}

// SoakSummary is what the samples say.
type SoakSummary struct {
	// First is the first minute of load (0 < t ≤ 1 min: the sample before
	// the load is left out), Last the last (t > duration − 1 min).
	First, Last SoakMeans
	// Slopes per minute of the least-squares lines through the second
	// half's samples (t ≥ duration/2).
	RSSSlope, HeapSlope, GoroutineSlope float64
	// RSSGrowth is how much the RSS line rises over the second half, over
	// its value at the start of the half.
	RSSGrowth float64
	// GoroutineChange is last minute's mean goroutines over first minute's,
	// minus 1.
	GoroutineChange float64
	// Flat is the verdict; Why says what broke the rule when it is not.
	Flat bool
	Why  []string
}

// summarize applies the verdict rule (see soakRSSGrowth) to the samples of
// a run of duration d.
func summarize(samples []SoakSample, d time.Duration) SoakSummary {
	var s SoakSummary
	mean := func(in func(time.Duration) bool) SoakMeans {
		var m SoakMeans
		for _, x := range samples {
			if in(x.At) {
				m.RSS += float64(x.RSS)
				m.Heap += float64(x.HeapInuse)
				m.Goroutines += float64(x.Goroutines)
				m.N++
			}
		}
		if m.N > 0 {
			m.RSS, m.Heap, m.Goroutines = m.RSS/float64(m.N), m.Heap/float64(m.N), m.Goroutines/float64(m.N)
		}
		return m
	}
	s.First = mean(func(t time.Duration) bool { return t > 0 && t <= time.Minute })
	s.Last = mean(func(t time.Duration) bool { return t > d-time.Minute })

	var xs, rss, heap, gor []float64
	for _, x := range samples {
		if x.At >= d/2 {
			xs = append(xs, x.At.Minutes())
			rss = append(rss, float64(x.RSS))
			heap = append(heap, float64(x.HeapInuse))
			gor = append(gor, float64(x.Goroutines))
		}
	}
	var a float64
	var ok bool
	if s.RSSSlope, a, ok = fitLine(xs, rss); ok {
		s.HeapSlope, _, _ = fitLine(xs, heap)
		s.GoroutineSlope, _, _ = fitLine(xs, gor)
		from := a + s.RSSSlope*xs[0]
		if from > 0 {
			s.RSSGrowth = s.RSSSlope * (xs[len(xs)-1] - xs[0]) / from
		}
	}
	if s.First.Goroutines > 0 {
		s.GoroutineChange = s.Last.Goroutines/s.First.Goroutines - 1
	}

	switch {
	case !ok:
		s.Why = append(s.Why, "fewer than two samples in the second half")
	case s.RSSGrowth >= soakRSSGrowth:
		s.Why = append(s.Why, fmt.Sprintf("RSS grew %.1f%% over the second half (rule: under %.0f%%)", 100*s.RSSGrowth, 100*soakRSSGrowth))
	}
	band := max(soakGoroutineBand*s.First.Goroutines, soakGoroutineFloor)
	switch {
	case s.First.N == 0 || s.Last.N == 0:
		s.Why = append(s.Why, "no samples in the first or the last minute")
	case math.Abs(s.Last.Goroutines-s.First.Goroutines) > band:
		s.Why = append(s.Why, fmt.Sprintf("goroutines went from %.1f to %.1f on average (rule: within ±%.1f)", s.First.Goroutines, s.Last.Goroutines, band))
	}
	s.Flat = len(s.Why) == 0
	return s
}

// fitLine is the least-squares line y = a + b·x; ok is false with fewer
// than two distinct xs.
func fitLine(xs, ys []float64) (b, a float64, ok bool) {
	n := float64(len(xs))
	if len(xs) < 2 || len(xs) != len(ys) {
		return 0, 0, false
	}
	var mx, my float64
	for i := range xs {
		mx += xs[i]
		my += ys[i]
	}
	mx, my = mx/n, my/n
	var sxy, sxx float64
	for i := range xs {
		sxy += (xs[i] - mx) * (ys[i] - my)
		sxx += (xs[i] - mx) * (xs[i] - mx)
	}
	if sxx == 0 {
		return 0, 0, false
	}
	b = sxy / sxx
	return b, my - b*mx, true
}

// soakBar is the progress bar of the load, redrawn every second, with the
// latest sample in its line.
type soakBar struct {
	bar  *progress.Bar
	load *soakLoad
	mu   sync.Mutex
	last SoakSample
}

// startSoakBar draws on w; nil (no bar) when w is nil.
func startSoakBar(w io.Writer, d time.Duration, begin time.Time, load *soakLoad, first SoakSample) *soakBar {
	if w == nil {
		return nil
	}
	b := &soakBar{load: load, last: first}
	b.bar = progress.Poll(w, progress.Options{Total: int64(d.Seconds()), Description: b.status()}, time.Second,
		func() (int64, string) { return int64(time.Since(begin).Seconds()), b.status() })
	return b
}

func (b *soakBar) status() string {
	b.mu.Lock()
	s := b.last
	b.mu.Unlock()
	return fmt.Sprintf("sent %d, failed %d | tether RSS %.1f MiB, %d goroutines",
		b.load.sent.Load(), b.load.failed.Load(), mib(float64(s.RSS)), s.Goroutines)
}

// show puts the latest sample in the bar's line.
func (b *soakBar) show(s SoakSample) {
	if b == nil {
		return
	}
	b.mu.Lock()
	b.last = s
	b.mu.Unlock()
}

// stop leaves the bar full, on its own line.
func (b *soakBar) stop() {
	if b != nil {
		b.bar.Finish()
	}
}

func mib(bytes float64) float64 { return bytes / (1 << 20) }

// Markdown renders the run as a document of its own; chart, when not
// empty, is the chart's path relative to it.
func (r *SoakReport) Markdown(m Meta, chart string) string {
	o, s := r.Options, r.Summary
	var b strings.Builder
	w := func(format string, a ...any) { fmt.Fprintf(&b, format, a...) }
	w("# Soak: tether's memory and goroutines under steady load\n\n")
	w("```sh\n%s\n```\n\n", m.Command)
	w("Run of %s, commit %s, %s.\n", r.Started.UTC().Format("2006-01-02 15:04 MST"), m.Commit, m.Machine)
	w("The load generator, Envoy (one worker), tether, redis-server and the emulated instances share\n")
	w("this machine's cores with whatever else runs on it (one-minute load average %.2f at the start,\n", r.LoadAvg[0])
	w("%.2f at the end): read the figures for their trend, not their size.\n\n", r.LoadAvg[1])
	w("%s\n\n", soakPreamble(o))

	if s.Flat {
		w("**Verdict: flat.**\n\n")
	} else {
		w("**Verdict: not flat.** %s.\n\n", strings.Join(s.Why, "; "))
	}
	w("The rule: tether is flat when the least-squares line through the second half's RSS samples rises\n")
	w("by less than %.0f%% of its value at the start of that half (it rose %+.1f%%), and the last minute's\n", 100*soakRSSGrowth, 100*s.RSSGrowth)
	w("mean goroutine count is within ±%.0f%% (at least ±%d) of the first minute's (it moved %+.1f%%). The\n", 100*soakGoroutineBand, soakGoroutineFloor, 100*s.GoroutineChange)
	w("first minute is the samples with 0 < t ≤ 1 min, the last minute those with t > %s; the slopes\n", o.Duration-time.Minute)
	w("are of least-squares lines through the samples with t ≥ %s.\n\n", o.Duration/2)

	w("| tether | first minute (mean) | last minute (mean) | slope over the second half |\n")
	w("|---|---:|---:|---:|\n")
	w("| RSS | %.1f MiB | %.1f MiB | %+.3f MiB/min |\n", mib(s.First.RSS), mib(s.Last.RSS), mib(s.RSSSlope))
	w("| Go heap in use | %.1f MiB | %.1f MiB | %+.3f MiB/min |\n", mib(s.First.Heap), mib(s.Last.Heap), mib(s.HeapSlope))
	w("| goroutines | %.1f | %.1f | %+.2f /min |\n\n", s.First.Goroutines, s.Last.Goroutines, s.GoroutineSlope)

	w("Requests: %d sent, %d failed (%.3f%%", r.Sent, r.Failed, 100*float64(r.Failed)/float64(max(r.Sent, 1)))
	if len(r.Failures) > 0 {
		w(": %s", countList(r.Failures))
	}
	w("), %d dropped by the client (512 in flight already). Tether's routing decisions: %s.\n\n",
		r.Dropped, countList(r.Decisions))
	if chart != "" {
		w("![tether RSS, heap and goroutines over the soak](%s)\n\n", chart)
	}

	w("Samples. t is the time since the load began (the t = 0 sample is taken before it and left out of\n")
	w("the averages). Requests are counted from the start; in flight at the sample. Latency p99 is of\n")
	w("the requests answered since the previous sample, timed from when each was due; sender lag is the\n")
	w("most a send was late on its schedule in that time (the load generator starved of CPU, or the\n")
	w("machine paused); load is the machine's one-minute load average:\n\n")
	w("| t | RSS | Go heap in use | goroutines | Redis keys | sent | failed | dropped | in flight | latency p99 | sender lag | load |\n")
	w("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, x := range r.Samples {
		p99 := "–"
		if x.P99 > 0 {
			p99 = ms(x.P99)
		}
		w("| %s | %.1f MiB | %.1f MiB | %d | %d | %d | %d | %d | %d | %s | %s | %.2f |\n", x.At.Round(time.Second),
			mib(float64(x.RSS)), mib(float64(x.HeapInuse)), x.Goroutines, x.RedisKeys, x.Sent, x.Failed, x.Dropped, x.InFlight,
			p99, ms(x.Lag), x.Load)
	}
	return b.String()
}

func soakPreamble(o SoakOptions) string {
	return fmt.Sprintf("%d emulated instances that answer after %s, tether in sticky mode on redis-server with\n"+
		"`routing.idle_timeout = %s`, Envoy in front. %.0f requests/s (open loop, tiny chat completions) for %s:\n"+
		"of every 20 requests, 15 carry a session id, 3 an API token (`Authorization: Bearer`) and 2 neither\n"+
		"(anonymous). %d session ids and %d tokens are in use at a time; each serves %d requests and is\n"+
		"then replaced by a fresh one (a few at a time), so bindings are created, hit (one session id is used\n"+
		"every %.1f s) and, once retired, expire throughout the run. A sample every %s: tether's VmRSS from\n"+
		"/proc, go_goroutines and go_memstats_heap_inuse_bytes from its /metrics, redis-server's DBSIZE.",
		o.Instances, o.InstanceLatency, o.IdleTimeout, o.Rate, o.Duration, o.Sessions, o.Tokens, o.Turns,
		o.SessionGap().Seconds(), o.Every)
}

// countList is "hit 12, bind 3", the largest first.
func countList[N int64 | float64](d map[string]N) string {
	if len(d) == 0 {
		return "none"
	}
	kinds := make([]string, 0, len(d))
	for k := range d {
		kinds = append(kinds, k)
	}
	sort.Slice(kinds, func(i, j int) bool {
		if d[kinds[i]] != d[kinds[j]] {
			return d[kinds[i]] > d[kinds[j]]
		}
		return kinds[i] < kinds[j]
	})
	parts := make([]string, len(kinds))
	for i, k := range kinds {
		parts[i] = fmt.Sprintf("%s %.0f", k, float64(d[k]))
	}
	return strings.Join(parts, ", ")
}

// Chart writes a PNG of tether's RSS and heap (top) and goroutines
// (bottom) over the run to path.
func (r *SoakReport) Chart(path string) error {
	mem, gor := plot.New(), plot.New()
	mem.Title.Text = "tether under soak load"
	mem.Y.Label.Text = "MiB"
	mem.Y.Min = 0
	gor.Y.Label.Text = "goroutines"
	gor.Y.Min = 0
	gor.X.Label.Text = "minutes since the load began"
	rss, heap, g := make(plotter.XYs, len(r.Samples)), make(plotter.XYs, len(r.Samples)), make(plotter.XYs, len(r.Samples))
	for i, s := range r.Samples {
		x := s.At.Minutes()
		rss[i] = plotter.XY{X: x, Y: mib(float64(s.RSS))}
		heap[i] = plotter.XY{X: x, Y: mib(float64(s.HeapInuse))}
		g[i] = plotter.XY{X: x, Y: float64(s.Goroutines)}
	}
	for _, l := range []struct {
		p     *plot.Plot
		name  string
		xys   plotter.XYs
		color color.Color
	}{
		{mem, "RSS", rss, color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff}},
		{mem, "Go heap in use", heap, color.RGBA{R: 0xff, G: 0x7f, B: 0x0e, A: 0xff}},
		{gor, "goroutines", g, color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff}},
	} {
		line, err := plotter.NewLine(l.xys)
		if err != nil {
			return err
		}
		line.Color = l.color
		line.Width = vg.Points(1.5)
		l.p.Add(line)
		l.p.Legend.Add(l.name, line)
	}
	mem.Legend.Top = true
	gor.Legend.Top = true
	mem.Y.Max = max(mem.Y.Max*1.4, 1) // room for the legend
	gor.Y.Max = max(gor.Y.Max*1.4, 1)
	mem.X.Min, gor.X.Min = 0, 0
	mem.X.Max = max(mem.X.Max, gor.X.Max)
	gor.X.Max = mem.X.Max

	img := vgimg.NewWith(vgimg.UseWH(7*vg.Inch, 5*vg.Inch), vgimg.UseBackgroundColor(color.White))
	tiles := draw.Tiles{Rows: 2, Cols: 1, PadX: vg.Millimeter, PadY: 3 * vg.Millimeter,
		PadTop: 2 * vg.Millimeter, PadBottom: 2 * vg.Millimeter, PadLeft: 2 * vg.Millimeter, PadRight: 4 * vg.Millimeter}
	canvases := plot.Align([][]*plot.Plot{{mem}, {gor}}, tiles, draw.New(img))
	mem.Draw(canvases[0][0])
	gor.Draw(canvases[1][0])

	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		return errors.Join(err, f.Close())
	}
	return f.Close()
}
