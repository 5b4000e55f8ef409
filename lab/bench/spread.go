package bench

import (
	"context"
	"fmt"
	"math"
	"sort"

	"github.com/tetherproxy/tether/internal/promtext"
)

// Spread is how a policy spread the load over the instances.
type Spread struct {
	// Requests answered per instance (failed ones included; an instance
	// that answered nothing counts 0), and max / mean of those.
	MinRequests, MaxRequests int
	Imbalance                float64
	// The queue depth the instances reported on their answers
	// (x-queue-depth, what adaptive routing reads): over all answers, and
	// the highest p99 of one instance.
	QueueP50, QueueP99, BusiestQueueP99 int
}

// spreadOf sums the instances that answered (one name per answer) and the
// queue depths they reported.
func spreadOf(instances []string, answeredBy []string, depths map[string][]int) Spread {
	n := map[string]int{}
	for _, in := range instances {
		n[in] = 0
	}
	for _, in := range answeredBy {
		if in != "" {
			n[in]++
		}
	}
	var s Spread
	total, first := 0, true
	for _, c := range n {
		total += c
		if first || c < s.MinRequests {
			s.MinRequests = c
		}
		s.MaxRequests = max(s.MaxRequests, c)
		first = false
	}
	if total > 0 {
		s.Imbalance = float64(s.MaxRequests) / (float64(total) / float64(len(n)))
	}
	var all []int
	for _, d := range depths {
		all = append(all, d...)
		s.BusiestQueueP99 = max(s.BusiestQueueP99, rank(d, 0.99))
	}
	s.QueueP50, s.QueueP99 = rank(all, 0.5), rank(all, 0.99)
	return s
}

// rank is the q-quantile of v by nearest rank, as percentile; 0 when v is
// empty. v is sorted in place.
func rank(v []int, q float64) int {
	if len(v) == 0 {
		return 0
	}
	sort.Ints(v)
	i := int(math.Ceil(q*float64(len(v)))) - 1
	return v[max(0, min(i, len(v)-1))]
}

// decisions reads tether_requests_total from tether's /metrics: the routing
// decisions by kind (hit, bind, spilled …), summed over mode and identity
// source.
func decisions(ctx context.Context, admin string) (map[string]float64, error) {
	m, err := scrape(ctx, admin)
	if err != nil {
		return nil, err
	}
	return decisionCounts(m)
}

// scrape reads tether's /metrics from admin.
func scrape(ctx context.Context, admin string) (promtext.Metrics, error) {
	return promtext.Get(ctx, adminClient, "http://"+admin+"/metrics")
}

// decisionCounts sums tether_requests_total by decision; every sample must
// have one.
func decisionCounts(m promtext.Metrics) (map[string]float64, error) {
	const name = "tether_requests_total"
	out := m.SumBy(name, "decision")
	if _, ok := out[""]; ok {
		return nil, fmt.Errorf("metric %s: a sample without a decision label", name)
	}
	return out, nil
}

// spilledShare is the share of tether's decisions that spilled a session
// off a saturated instance, and how many decisions there were.
func spilledShare(d map[string]float64) (share float64, total int) {
	var sum float64
	for _, v := range d {
		sum += v
	}
	if sum > 0 {
		share = d["spilled"] / sum
	}
	return share, int(sum)
}
