package metrics

import (
	"strconv"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestChildrenCountIntoTheVector: a cached child is the vector's own, from
// several goroutines at once, and past maxChildren counts still land.
func TestChildrenCountIntoTheVector(t *testing.T) {
	v := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "c_total", Help: "c"}, []string{"k"})
	c := newChildren(func(k int) prometheus.Counter { return v.WithLabelValues(strconv.Itoa(k)) })
	const n = maxChildren + 10
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for k := range n {
				c.of(k).Inc()
			}
		})
	}
	wg.Wait()
	for _, k := range []int{0, maxChildren - 1, maxChildren, n - 1} {
		if got := testutil.ToFloat64(v.WithLabelValues(strconv.Itoa(k))); got != 4 {
			t.Errorf("child %d counted %v, want 4", k, got)
		}
	}
	if got := len(*c.m.Load()); got != maxChildren {
		t.Errorf("%d children cached, want the bound %d", got, maxChildren)
	}
}
