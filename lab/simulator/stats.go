package simulator

import (
	"math"
	"math/bits"
	"slices"
	"time"

	"github.com/tetherproxy/tether/lab/loadgen"
)

// exactLatencies is how many latencies a run keeps exactly; beyond that it
// keeps a histogram, so memory stays bounded however long the run.
const exactLatencies = 1 << 18

// subBits sets the histogram's resolution: 2^subBits buckets per power of
// two, so a bucket's midpoint is within 1/2^(subBits+1) (0.05%) of every
// value in it.
const subBits = 10

// latencies collects durations and gives loadgen's percentiles: exactly
// (nearest rank over the sorted values, as loadgen.Summarize) while there
// are at most exactLatencies of them, then from a log-linear histogram
// (values below 2048 ns exact, above within 0.05%), with max exact and mean
// exact up to floating-point rounding.
type latencies struct {
	exact  []time.Duration
	counts []uint64 // nil while exact
	n      int64
	sum    float64
	max    time.Duration
}

func (l *latencies) add(d time.Duration) {
	d = max(d, 0)
	l.n++
	l.sum += float64(d)
	l.max = max(l.max, d)
	if l.counts == nil {
		if len(l.exact) < exactLatencies {
			l.exact = append(l.exact, d)
			return
		}
		l.counts = make([]uint64, bucketOf(math.MaxInt64)+1)
		for _, v := range l.exact {
			l.counts[bucketOf(v)]++
		}
		l.exact = nil
	}
	l.counts[bucketOf(d)]++
}

// bucketOf is the histogram bucket of d ≥ 0.
func bucketOf(d time.Duration) int {
	v := uint64(d)
	shift := max(bits.Len64(v)-(subBits+1), 0)
	return shift<<subBits + int(v>>shift)
}

// bucketValue is the midpoint of bucket i.
func bucketValue(i int) time.Duration {
	if i < 2<<subBits {
		return time.Duration(i)
	}
	shift := i>>subBits - 1
	low := uint64(i-shift<<subBits) << shift
	return time.Duration(low + (uint64(1)<<shift-1)/2)
}

func (l *latencies) percentiles() loadgen.Percentiles {
	if l.n == 0 {
		return loadgen.Percentiles{}
	}
	if l.counts == nil {
		// loadgen's percentiles, to the nanosecond.
		ds := l.exact
		slices.Sort(ds)
		var total time.Duration
		for _, d := range ds {
			total += d
		}
		rank := func(p float64) time.Duration {
			i := int(math.Ceil(p*float64(len(ds)))) - 1
			return ds[min(max(i, 0), len(ds)-1)]
		}
		return loadgen.Percentiles{P50: rank(0.5), P90: rank(0.9), P99: rank(0.99), Max: ds[len(ds)-1], Mean: total / time.Duration(len(ds))}
	}
	rank := func(p float64) time.Duration {
		want := uint64(min(max(int64(math.Ceil(p*float64(l.n))), 1), l.n))
		var seen uint64
		for i, c := range l.counts {
			if seen += c; seen >= want {
				return min(bucketValue(i), l.max)
			}
		}
		return l.max
	}
	return loadgen.Percentiles{P50: rank(0.5), P90: rank(0.9), P99: rank(0.99), Max: l.max, Mean: time.Duration(l.sum / float64(l.n))}
}

// tally adds up the figures of a set of requests, as loadgen.Summarize.
type tally struct {
	requests, ok               int
	prompt, cached, completion int64
	followUps, sameInstance    int
	latency                    latencies
}

func (t *tally) hitRate() float64    { return ratio(float64(t.cached), float64(t.prompt)) }
func (t *tally) continuity() float64 { return ratio(float64(t.sameInstance), float64(t.followUps)) }

func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}
