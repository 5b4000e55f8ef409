package simulator

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/lab/emulator"
	"github.com/tetherproxy/tether/lab/workload"
	"github.com/tetherproxy/tether/prefix"
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

// indexRequest is one request a content-reading router saw: its
// conversation (as it was then), its chain and where it went.
type indexRequest struct {
	conv  *conversation
	chain []uint64
	inst  int
}

// recordRequests runs p for a few simulated minutes at 64 instances and
// 60 requests/s and returns its requests, with the index capacity in
// blocks.
func recordRequests(b *testing.B, p Policy) ([]indexRequest, int) {
	b.Helper()
	r, err := newRunner(Options{Policy: p, Instances: 64, Rate: 60, Duration: 3 * time.Minute, ThinkScale: 1, Stream: true,
		Workload: workload.Config{Seed: 1}, Seed: 1})
	if err != nil {
		b.Fatal(err)
	}
	rec := &recordingRouter{router: r.router}
	r.router = rec
	if _, err := r.run(b.Context()); err != nil {
		b.Fatal(err)
	}
	return rec.requests, r.opts.Cache.CapacityTokens / emulator.BlockSize
}

// recordingRouter routes as router does and keeps every request.
type recordingRouter struct {
	router
	requests []indexRequest
}

func (r *recordingRouter) route(ctx context.Context, k *call) (int, affinity.Kind, error) {
	i, kind, err := r.router.route(ctx, k)
	c := *k.conv
	c.hashes = slices.Clone(k.conv.chain())
	r.requests = append(r.requests, indexRequest{conv: &c, chain: c.hashes, inst: i})
	return i, kind, err
}

// BenchmarkGIEIndex replays three minutes of GIE's requests at 64
// instances and 60 requests/s (their matches and additions) into its
// indexer: in runs (gieIndex) and in its own shape, per hash (gieHashes).
func BenchmarkGIEIndex(b *testing.B) {
	requests, capacity := recordRequests(b, GIEPrefix)
	b.Run("runs", func(b *testing.B) {
		var spans []gieSpan
		depth := make([]int, 64)
		for b.Loop() {
			x := newGIEIndex(64, capacity)
			for _, q := range requests {
				spans = gieSpans(spans, q.conv, min(len(q.chain), gieMaxPrefixBlocks))
				x.match(spans, depth)
				x.add(spans, q.inst)
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(requests)), "ns/request")
	})
	b.Run("hashes", func(b *testing.B) {
		depth := make([]int, 64)
		for b.Loop() {
			x := newGIEHashes(64, capacity)
			for _, q := range requests {
				hashes := q.chain[:min(len(q.chain), gieMaxPrefixBlocks)]
				x.match(hashes, depth)
				x.add(hashes, q.inst)
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(requests)), "ns/request")
	})
}

// BenchmarkPrefixIndex replays three minutes of cache-aware placement's
// index calls at 64 instances and 60 requests/s (a match over every
// instance, then a record, for each open decision: here every request)
// into prefix.Index and into contentRuns.
func BenchmarkPrefixIndex(b *testing.B) {
	requests, capacity := recordRequests(b, GIEPrefix)
	names := make([]string, 64)
	for i := range names {
		names[i] = fmt.Sprintf("a100-%d", i)
	}
	depth := make([]int, 64)
	now := func(q indexRequest) time.Time {
		return virtualTime(int64(q.conv.shape.index) * int64(time.Millisecond))
	}
	b.Run("runs", func(b *testing.B) {
		for b.Loop() {
			x := newContentRuns(capacity)
			for _, q := range requests {
				x.conv = q.conv
				x.Match(q.chain, names, depth)
				x.Record(names[q.inst], q.chain, now(q))
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(requests)), "ns/request")
	})
	b.Run("prefix.Index", func(b *testing.B) {
		for b.Loop() {
			x := prefix.NewIndex(capacity)
			for _, q := range requests {
				x.Match(q.chain, names, depth)
				x.Record(names[q.inst], q.chain, now(q))
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(requests)), "ns/request")
	})
}
