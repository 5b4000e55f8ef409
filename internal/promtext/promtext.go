// Package promtext reads the Prometheus text format, as tether's /metrics
// serves it, for the tests and the lab. It holds one parser,
// prometheus/common's expfmt, and the few questions they ask of it.
package promtext

import (
	"context"
	"fmt"
	"io"
	"net/http"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Metrics are the metric families of one scrape, by name.
type Metrics map[string]*dto.MetricFamily

// Parse reads the text format. Names are validated as UTF-8, which is
// what client_golang accepts. A TextParser must be made with a scheme,
// since its zero value has none.
func Parse(r io.Reader) (Metrics, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(r)
	if err != nil {
		return nil, fmt.Errorf("prometheus text: %w", err)
	}
	return fams, nil
}

// Get scrapes url with client and parses the answer.
func Get(ctx context.Context, client *http.Client, url string) (Metrics, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	m, err := Parse(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", url, err)
	}
	return m, nil
}

// Sum is the sum of the samples of the counter or gauge name whose labels
// include every pair of labels. nil labels match all samples. Sum is 0
// when there is none.
func (m Metrics) Sum(name string, labels map[string]string) float64 {
	sum := 0.0
	for _, s := range m[name].GetMetric() {
		if hasLabels(s, labels) {
			sum += value(s)
		}
	}
	return sum
}

// SumBy sums the samples of name by the value of their label label. The
// samples without it sum under "".
func (m Metrics) SumBy(name, label string) map[string]float64 {
	out := map[string]float64{}
	for _, s := range m[name].GetMetric() {
		k := ""
		for _, l := range s.GetLabel() {
			if l.GetName() == label {
				k = l.GetValue()
			}
		}
		out[k] += value(s)
	}
	return out
}

// Value is the value of the unlabelled counter or gauge name, and whether
// it was exported.
func (m Metrics) Value(name string) (float64, bool) {
	for _, s := range m[name].GetMetric() {
		if len(s.GetLabel()) == 0 {
			return value(s), true
		}
	}
	return 0, false
}

func hasLabels(s *dto.Metric, want map[string]string) bool {
	n := 0
	for _, l := range s.GetLabel() {
		if v, ok := want[l.GetName()]; ok && v == l.GetValue() {
			n++
		}
	}
	return n == len(want)
}

// value is a counter's, gauge's or untyped sample's value. Histograms and
// summaries have none.
func value(s *dto.Metric) float64 {
	switch {
	case s.Counter != nil:
		return s.GetCounter().GetValue()
	case s.Gauge != nil:
		return s.GetGauge().GetValue()
	case s.Untyped != nil:
		return s.GetUntyped().GetValue()
	}
	return 0
}
