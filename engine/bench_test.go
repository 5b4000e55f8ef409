//go:build unix

package engine

import (
	"bytes"
	"sync"
	"syscall"
	"testing"
	"time"
)

// BenchmarkParse parses one full vLLM 0.12 exposition of two data-parallel
// engines (every family it serves, ~90 KB).
func BenchmarkParse(b *testing.B) {
	body := fixture(b, "vllm-0.12-dp2.txt")
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Parse(VLLM, bytes.NewReader(body)); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkScrapeFleet scrapes 64 loopback instances, each serving that
// exposition, all at once as a scrape loop would each interval, and parses
// every answer. cpu-ms/fleet-scrape is the process's user+system CPU per
// fleet scrape; the servers run in this process too, so it includes their
// cost of answering: an upper bound on tether's. Scraping the fleet every
// second costs cpu-ms/fleet-scrape / 1000 of a core.
func BenchmarkScrapeFleet(b *testing.B) {
	const fleet = 64
	body := fixture(b, "vllm-0.12-dp2.txt")
	urls := make([]string, fleet)
	for i := range urls {
		urls[i] = serve(b, exposition(body)).URL + "/metrics"
	}
	s := &Scraper{Timeout: 5 * time.Second}
	scrapeAll := func() {
		var wg sync.WaitGroup
		for _, u := range urls {
			wg.Go(func() {
				if _, err := s.Scrape(b.Context(), VLLM, u); err != nil {
					b.Error(err)
				}
			})
		}
		wg.Wait()
	}
	scrapeAll() // connections up before the clock starts
	b.ReportAllocs()
	before := cpuTime(b)
	for b.Loop() {
		scrapeAll()
	}
	used := cpuTime(b) - before
	b.ReportMetric(float64(used.Microseconds())/1000/float64(b.N), "cpu-ms/fleet-scrape")
}

// cpuTime is the process's user plus system CPU time so far.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
