package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/tetherproxy/tether/internal/promtext"
)

func TestParseVmRSS(t *testing.T) {
	const status = `Name:	tether
Umask:	0022
State:	S (sleeping)
VmPeak:	 1275968 kB
VmSize:	 1275968 kB
VmHWM:	   31240 kB
VmRSS:	   29876 kB
RssAnon:	   14628 kB
Threads:	7
`
	got, err := parseVmRSS(status)
	if err != nil || got != 29876*1024 {
		t.Errorf("parseVmRSS = %d, %v; want %d", got, err, 29876*1024)
	}
	for _, bad := range []string{
		"Name:\ttether\n",       // a kernel thread has none
		"VmRSS:\t12 MB\n",       // not kB
		"VmRSS:\tmany kB\n",     // not a number
		"VmRSS:\t-12 kB\n",      // negative
		"VmRSS:\t12 kB extra\n", // more fields
	} {
		if _, err := parseVmRSS(bad); err == nil {
			t.Errorf("parseVmRSS(%q) parsed", bad)
		}
	}
}

func TestParseGauges(t *testing.T) {
	const text = `# HELP go_goroutines Number of goroutines that currently exist.
# TYPE go_goroutines gauge
go_goroutines 41
go_goroutines_extra 9
go_memstats_heap_inuse_bytes 1.2345e+07 1700000000000
go_gc_duration_seconds{quantile="0"} 1e-05
`
	got, err := parseGauges(strings.NewReader(text), "go_goroutines", "go_memstats_heap_inuse_bytes")
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(map[string]float64{"go_goroutines": 41, "go_memstats_heap_inuse_bytes": 12345000}, got); diff != "" {
		t.Error(diff)
	}
	if _, err := parseGauges(strings.NewReader(text), "go_threads"); err == nil {
		t.Error("a missing metric parsed")
	}
	if _, err := parseGauges(strings.NewReader("go_goroutines lots\n"), "go_goroutines"); err == nil {
		t.Error("a bad value parsed")
	}
}

func TestFitLine(t *testing.T) {
	b, a, ok := fitLine([]float64{5, 6, 7, 8}, []float64{13, 15, 17, 19}) // y = 3 + 2x
	if !ok || math.Abs(b-2) > 1e-9 || math.Abs(a-3) > 1e-9 {
		t.Errorf("fitLine = %v, %v, %v; want 2, 3, true", b, a, ok)
	}
	if _, _, ok := fitLine([]float64{1, 1}, []float64{1, 2}); ok {
		t.Error("a line through one x")
	}
	if _, _, ok := fitLine([]float64{1}, []float64{1}); ok {
		t.Error("a line through one point")
	}
}

// soakRun makes samples every 10 s for d: RSS and goroutines as functions
// of the minute.
func soakRun(d time.Duration, rssMiB func(min float64) float64, goroutines func(min float64) int) []SoakSample {
	var out []SoakSample
	for at := time.Duration(0); at <= d; at += 10 * time.Second {
		m := at.Minutes()
		rss := int64(rssMiB(m) * (1 << 20))
		out = append(out, SoakSample{At: at, RSS: rss, HeapInuse: rss / 2, Goroutines: goroutines(m)})
	}
	return out
}

func TestSummarize(t *testing.T) {
	d := 10 * time.Minute
	steady := func(float64) int { return 40 }
	for _, tc := range []struct {
		name       string
		rss        func(float64) float64
		goroutines func(float64) int
		flat       bool
		why        string
	}{
		// Warm-up growth in the first minutes, then flat: the second half
		// decides.
		{"warm-up then flat", func(m float64) float64 { return 20 + 10*min(m, 3) }, steady, true, ""},
		{"slow leak", func(m float64) float64 { return 30 + 0.5*m }, steady, false, "RSS grew"}, // 2.5 MiB on 32.5: 7.7%
		{"slower than the rule", func(m float64) float64 { return 30 + 0.2*m }, steady, true, ""},
		{"shrinking", func(m float64) float64 { return 40 - m }, steady, true, ""},
		{"goroutine leak", func(float64) float64 { return 30 }, func(m float64) int { return 40 + int(m) }, false, "goroutines went from"},
		{"goroutines within the band", func(float64) float64 { return 30 }, func(m float64) int { return 40 + int(m/3) }, true, ""},
		// 10% of 10 is 1; the floor of 3 lets a request in flight at a
		// sample not decide.
		{"few goroutines, the floor", func(float64) float64 { return 30 }, func(m float64) int { return 10 + int(m/4) }, true, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := summarize(soakRun(d, tc.rss, tc.goroutines), d)
			if s.Flat != tc.flat {
				t.Errorf("flat = %v, want %v (%v)", s.Flat, tc.flat, s.Why)
			}
			if tc.why != "" && (len(s.Why) != 1 || !strings.Contains(s.Why[0], tc.why)) {
				t.Errorf("why = %q, want one reason with %q", s.Why, tc.why)
			}
		})
	}

	// The figures of one run, by hand: RSS 30 + 0.5·m MiB.
	s := summarize(soakRun(d, func(m float64) float64 { return 30 + 0.5*m }, steady), d)
	if s.First.N != 6 || s.Last.N != 6 {
		t.Errorf("windows of %d and %d samples, want 6 and 6 (t = 0 left out)", s.First.N, s.Last.N)
	}
	// First minute: t = 10 … 60 s, mean 35 s = 7/12 min; last: 550 … 600 s.
	if want := (30 + 0.5*7.0/12) * (1 << 20); math.Abs(s.First.RSS-want) > 1 {
		t.Errorf("first-minute RSS %v, want %v", s.First.RSS, want)
	}
	if want := (30 + 0.5*575.0/60) * (1 << 20); math.Abs(s.Last.RSS-want) > 1 {
		t.Errorf("last-minute RSS %v, want %v", s.Last.RSS, want)
	}
	if want := 0.5 * (1 << 20); math.Abs(s.RSSSlope-want) > 1 || math.Abs(s.HeapSlope-want/2) > 1 { // bytes/min, rounded samples
		t.Errorf("slopes %v (RSS), %v (heap); want %v, %v", s.RSSSlope, s.HeapSlope, want, want/2)
	}
	if want := 2.5 / 32.5; math.Abs(s.RSSGrowth-want) > 1e-6 {
		t.Errorf("growth %v, want %v", s.RSSGrowth, want)
	}
	if s.GoroutineSlope != 0 || s.GoroutineChange != 0 {
		t.Errorf("goroutines: slope %v, change %v", s.GoroutineSlope, s.GoroutineChange)
	}

	if s := summarize(nil, d); s.Flat || len(s.Why) != 2 {
		t.Errorf("no samples: %+v", s)
	}
}

func TestSoakCallers(t *testing.T) {
	o := SoakOptions{Sessions: 30, Tokens: 6, Turns: 4}
	kinds := map[string]int{}
	uses := map[string]int{}
	last := map[string]int{}
	for n := 0; n < 20000; n++ {
		c := o.caller(n)
		switch {
		case c.session != "" && c.token == "":
			kinds["session"]++
			uses[c.session]++
			last[c.session] = n
		case c.token != "" && c.session == "":
			kinds["token"]++
			uses[c.token]++
		case c == soakCaller{}:
			kinds["anonymous"]++
		default:
			t.Fatalf("caller %d is %+v", n, c)
		}
	}
	if diff := cmp.Diff(map[string]int{"session": 15000, "token": 3000, "anonymous": 2000}, kinds); diff != "" {
		t.Error(diff)
	}
	// Every name is used at most Turns times (the first generation of a
	// slot fewer), and names keep being retired.
	for name, n := range uses {
		if n > o.Turns {
			t.Errorf("%s used %d times, more than %d", name, n, o.Turns)
		}
	}
	if len(uses) < 15000/o.Turns {
		t.Errorf("%d names for 18000 identified requests in turns of %d", len(uses), o.Turns)
	}
	// Retirement is spread: over each stretch of one pass of the session
	// pool, only some of its slots change names.
	retired := map[int]int{} // pass → sessions used for the last time in it
	for name, n := range last {
		if uses[name] == o.Turns {
			retired[n/20*15/o.Sessions]++
		}
	}
	for pass, r := range retired {
		if r > o.Sessions/2 {
			t.Errorf("pass %d retired %d of %d sessions at once", pass, r, o.Sessions)
		}
	}
}

func TestFailureKind(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want string
	}{
		{statusError(503), "status 503"},
		{fmt.Errorf("post: %w", context.DeadlineExceeded), "client timeout"},
		{&url.Error{Op: "Post", Err: timeoutError{}}, "client timeout"},
		{errors.New("connection reset by peer"), "transport"},
	} {
		if got := failureKind(tc.err); got != tc.want {
			t.Errorf("failureKind(%v) = %q, want %q", tc.err, got, tc.want)
		}
	}
}

type timeoutError struct{}

func (timeoutError) Error() string   { return "i/o timeout" }
func (timeoutError) Timeout() bool   { return true }
func (timeoutError) Temporary() bool { return true }

func TestSoakOptions(t *testing.T) {
	o := SoakOptions{}.withDefaults()
	if err := o.Validate(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
	if gap := o.SessionGap(); gap >= o.IdleTimeout || gap < time.Second {
		t.Errorf("default session gap %v: want it well under the idle timeout %v", gap, o.IdleTimeout)
	}
	for _, tc := range []struct {
		name string
		edit func(*SoakOptions)
		want string
	}{
		{"one sample", func(o *SoakOptions) { o.Duration = 15 * time.Second }, "soak duration 15s"},
		{"no rate", func(o *SoakOptions) { o.Rate = -1 }, "soak rate -1"},
		{"short idle", func(o *SoakOptions) { o.IdleTimeout = time.Millisecond }, "soak idle timeout 1ms"},
		{"no instances", func(o *SoakOptions) { o.Instances = -1 }, "soak instances -1"},
		{"no turns", func(o *SoakOptions) { o.Turns = -2 }, "soak turns -2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := SoakOptions{}.withDefaults()
			tc.edit(&o)
			if err := o.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Validate() = %v, want an error naming %q", err, tc.want)
			}
		})
	}
}

func TestSoakMarkdownAndChart(t *testing.T) {
	d := 2 * time.Minute
	samples := soakRun(d, func(m float64) float64 { return 25 }, func(float64) int { return 33 })
	r := &SoakReport{Started: time.Unix(0, 0), Options: SoakOptions{Duration: d}.withDefaults(), Samples: samples,
		Sent: 18000, Failed: 2, Failures: map[string]int64{"client timeout": 2}, Decisions: map[string]float64{"hit": 100, "bind": 10, "random": 12}}
	r.Summary = summarize(samples, d)
	md := r.Markdown(Meta{Command: "make soak", Commit: "abc", Machine: "m"}, "bench/soak.png")
	for _, want := range []string{"**Verdict: flat.**", "| RSS | 25.0 MiB | 25.0 MiB | +0.000 MiB/min |", "| goroutines | 33.0 | 33.0 |",
		"18000 sent, 2 failed (0.011%: client timeout 2)", "hit 100, random 12, bind 10", "![tether RSS, heap and goroutines over the soak](bench/soak.png)",
		"| 2m0s | 25.0 MiB | 12.5 MiB | 33 |", "commit abc"} {
		if !strings.Contains(md, want) {
			t.Errorf("markdown lacks %q", want)
		}
	}
	path := filepath.Join(t.TempDir(), "charts", "soak.png")
	if err := r.Chart(path); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(path); err != nil || !strings.HasPrefix(string(b), "\x89PNG") {
		t.Errorf("chart: %v", err)
	}
}

// parseGauges is scrapeGauges on a /metrics text.
func parseGauges(r io.Reader, names ...string) (map[string]float64, error) {
	m, err := promtext.Parse(r)
	if err != nil {
		return nil, err
	}
	return gauges(m, names...)
}
