package promtext

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

const text = `# HELP tether_requests_total Routing decisions …
# TYPE tether_requests_total counter
tether_requests_total{decision="bind",mode="sticky",source="session"} 12
tether_requests_total{decision="hit",mode="sticky",source="session"} 30
tether_requests_total{decision="hit",mode="sticky",source="token"} 8 1700000000000
tether_requests_total{mode="sticky",source="none"} 1
tether_requests_totally{decision="hit"} 99
# TYPE go_goroutines gauge
go_goroutines 41
go_goroutines_extra 9
tether_instance_available{upstream="gpu-a"} 1
tether_instance_available{upstream="gpu-b"} 0
# TYPE rpc_seconds histogram
rpc_seconds_bucket{le="+Inf"} 3
rpc_seconds_sum 0.5
rpc_seconds_count 3
`

func TestQuestions(t *testing.T) {
	m, err := Parse(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"tether_requests_total", nil, 51},
		{"tether_requests_total", map[string]string{"decision": "hit"}, 38},
		{"tether_requests_total", map[string]string{"decision": "hit", "source": "token"}, 8},
		{"tether_requests_total", map[string]string{"decision": "moved"}, 0},
		{"tether_requests_total", map[string]string{"decision": "hit", "nolabel": "x"}, 0},
		{"tether_instance_available", map[string]string{"upstream": "gpu-a"}, 1},
		{"go_goroutines", nil, 41},
		{"tether_nothing_total", nil, 0},
		{"rpc_seconds", nil, 0}, // a histogram has no one value
	} {
		if got := m.Sum(tt.name, tt.labels); got != tt.want {
			t.Errorf("Sum(%s, %v) = %v, want %v", tt.name, tt.labels, got, tt.want)
		}
	}
	if diff := cmp.Diff(map[string]float64{"bind": 12, "hit": 38, "": 1}, m.SumBy("tether_requests_total", "decision")); diff != "" {
		t.Errorf("SumBy (-want +got):\n%s", diff)
	}
	if v, ok := m.Value("go_goroutines"); !ok || v != 41 {
		t.Errorf("Value(go_goroutines) = %v, %v", v, ok)
	}
	for _, name := range []string{"go_threads", "tether_instance_available"} {
		if v, ok := m.Value(name); ok {
			t.Errorf("Value(%s) = %v: want none (absent, or only labelled samples)", name, v)
		}
	}
}

func TestParseRefusesBadText(t *testing.T) {
	for _, bad := range []string{"go_goroutines lots\n", "tether_x{a=\"1\" 2\n", "# TYPE x counter\n# TYPE x gauge\nx 1\n"} {
		if _, err := Parse(strings.NewReader(bad)); err == nil {
			t.Errorf("Parse(%q) parsed", bad)
		}
	}
}

// TestGetReadsClientGolang: what client_golang serves (the format tether's
// /metrics uses) parses, and an error status is an error.
func TestGetReadsClientGolang(t *testing.T) {
	reg := prometheus.NewRegistry()
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "tether_requests_total", Help: "h"}, []string{"decision"})
	reg.MustRegister(c)
	c.WithLabelValues("hit").Add(3)
	c.WithLabelValues(`we"ird`).Add(2)
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	m, err := Get(context.Background(), srv.Client(), srv.URL+"/metrics")
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(map[string]float64{"hit": 3, `we"ird`: 2}, m.SumBy("tether_requests_total", "decision")); diff != "" {
		t.Errorf("SumBy (-want +got):\n%s", diff)
	}
	if _, err := Get(context.Background(), srv.Client(), srv.URL+"/nothing"); err == nil || !strings.Contains(err.Error(), "404") {
		t.Errorf("GET of a missing page: err = %v", err)
	}
}
