package simulator

import (
	"testing"
	"time"

	"github.com/tetherproxy/tether/lab/workload"
)

// BenchmarkRun times the event loop: one simulated minute of the field's
// mix per iteration, at a load the fleet sustains (every request priced)
// and far beyond it (the in-flight bound drops most). Events/s and
// requests/s are of the wall clock.
func BenchmarkRun(b *testing.B) {
	cases := []struct {
		name      string
		instances int
		rate      float64
	}{
		{"sustained-64x200rps", 64, 200},
		{"overloaded-8x10000rps", 8, 10000},
	}
	for _, c := range cases {
		for _, p := range Policies() {
			b.Run(c.name+"/"+string(p), func(b *testing.B) {
				var events, requests int64
				for b.Loop() {
					res, err := Run(b.Context(), Options{
						Policy: p, Instances: c.instances, Rate: c.rate, Duration: time.Minute,
						ThinkScale: 1, Stream: true, Workload: workload.Config{Seed: 1}, Seed: 1,
					})
					if err != nil {
						b.Fatal(err)
					}
					events += res.Events
					requests += int64(res.Summary.Requests)
				}
				b.ReportMetric(float64(events)/b.Elapsed().Seconds(), "events/s")
				b.ReportMetric(float64(requests)/b.Elapsed().Seconds(), "requests/s")
			})
		}
	}
}
