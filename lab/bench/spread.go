package bench

import (
	"bufio"
	"context"
	"fmt"
	"math"
	"net/http"
	"sort"
	"strconv"
	"strings"
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
	return scrapeMetrics(ctx, admin, parseDecisions)
}

// scrapeMetrics fetches tether's /metrics from admin and hands the body to
// parse.
func scrapeMetrics[T any](ctx context.Context, admin string, parse func(*bufio.Scanner) (T, error)) (T, error) {
	var zero T
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+admin+"/metrics", nil)
	if err != nil {
		return zero, err
	}
	resp, err := adminClient.Do(req)
	if err != nil {
		return zero, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return zero, fmt.Errorf("GET /metrics: %s", resp.Status)
	}
	return parse(bufio.NewScanner(resp.Body))
}

func parseDecisions(sc *bufio.Scanner) (map[string]float64, error) {
	const name = "tether_requests_total{"
	out := map[string]float64{}
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name) {
			continue
		}
		labels, value, ok := strings.Cut(line[len(name):], "} ")
		if !ok {
			return nil, fmt.Errorf("metrics line %q: no value", line)
		}
		_, kind, ok := strings.Cut(labels, `decision="`)
		if !ok {
			return nil, fmt.Errorf("metrics line %q: no decision label", line)
		}
		kind, _, _ = strings.Cut(kind, `"`)
		value, _, _ = strings.Cut(value, " ") // a timestamp may follow
		v, err := strconv.ParseFloat(value, 64)
		if err != nil {
			return nil, fmt.Errorf("metrics line %q: %w", line, err)
		}
		out[kind] += v
	}
	return out, sc.Err()
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
