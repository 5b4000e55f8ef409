package simulator

import (
	"slices"
	"testing"
	"time"

	"github.com/tetherproxy/tether/lab/workload"
	"github.com/tetherproxy/tether/prefix"
)

// TestContentRunsMatchesIndex runs cache-aware placement on runs beside
// prefix.Index, making every call the decider makes on one on the other,
// and wants the same answer to each: Match's depths, the blocks each
// Record leaves, Horizon's moving mean to the nanosecond. With evictions,
// with chains longer than an instance's capacity, with shared documents
// and with instances failing.
func TestContentRunsMatchesIndex(t *testing.T) {
	failures, err := LookupRegime("failures")
	if err != nil {
		t.Fatal(err)
	}
	base := Options{Policy: CacheAware, Instances: 8, Rate: 20, Duration: 5 * time.Minute, ThinkScale: 1, Stream: true,
		Workload: workload.Config{Seed: 5}, Seed: 5}
	cases := []struct {
		name string
		opts func() Options
	}{
		{"evicting", func() Options {
			o := base
			o.Cache.CapacityTokens = 16 * 3000
			return o
		}},
		{"capacity below a chain", func() Options {
			o := base
			o.Cache.CapacityTokens = 16 * 150
			return o
		}},
		{"shared documents", func() Options { return sharedDocumentsSmall(CacheAware) }},
		{"instances failing", func() Options {
			o, err := failures.Apply(base)
			if err != nil {
				t.Fatal(err)
			}
			o.Duration, o.Scenario.Warmup, o.Scenario.Failures.Every = 12*time.Minute, time.Minute, 3*time.Minute
			o.Cache.CapacityTokens = 16 * 5000
			return o
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r, err := newRunner(tc.opts())
			if err != nil {
				t.Fatal(err)
			}
			x := r.router.(*tetherRouter).prompts
			ref := prefix.NewIndex(x.capacity)
			calls := map[string]int{}
			var trace func(contentCall)
			trace = func(c contentCall) {
				n := calls[c.op]
				calls[c.op]++
				switch c.op {
				case "match":
					want := make([]int, len(c.names))
					best := ref.Match(c.chain, c.names, want)
					if best != c.best || !slices.Equal(want, c.depth) {
						t.Fatalf("match %d (%d blocks): runs %d %v, prefix.Index %d %v", n, len(c.chain), c.best, c.depth, best, want)
					}
				case "record":
					ref.Record(c.name, c.chain, c.now)
					for _, st := range ref.Stats() {
						if st.Instance != c.name {
							continue
						}
						if got := x.blocks(c.name); got != st.Blocks {
							t.Fatalf("record %d (%d blocks on %s): runs hold %d blocks there, prefix.Index %d", n, len(c.chain), c.name, got, st.Blocks)
						}
						if st.Evictions > 0 {
							calls["evicting"]++
						}
					}
					h, ok := ref.Horizon(c.name)
					x.trace = nil
					got, gotOK := x.Horizon(c.name)
					x.trace = trace
					if h != got || ok != gotOK {
						t.Fatalf("record %d on %s: runs' horizon %v %v, prefix.Index's %v %v", n, c.name, got, gotOK, h, ok)
					}
				case "horizon":
					if h, ok := ref.Horizon(c.name); h != c.horizon || ok != c.ok {
						t.Fatalf("horizon %d of %s: runs %v %v, prefix.Index %v %v", n, c.name, c.horizon, c.ok, h, ok)
					}
				}
			}
			x.trace = trace
			if _, err := r.run(t.Context()); err != nil {
				t.Fatal(err)
			}
			t.Logf("calls %v", calls)
			if calls["match"] < 300 || calls["record"] < 300 || calls["evicting"] == 0 {
				t.Errorf("calls %v: want hundreds of matches and records, evicting", calls)
			}
		})
	}
}

// blocks is how many blocks instance holds.
func (x *contentRuns) blocks(name string) int {
	if i, ok := x.ids[name]; ok {
		return x.insts[i].n
	}
	return 0
}
