package testenv

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/tetherproxy/tether/internal/launch"
)

// Prometheus is a Prometheus server private to one test, on loopback.
type Prometheus struct {
	URL string // http://127.0.0.1:port
	p   *launch.Proc
}

// PrometheusServer starts Prometheus ($PROMETHEUS_BIN, else from PATH)
// with config (a prometheus.yml body; rule files it names are read
// relative to the test's working directory, so give absolute paths), and
// stops it when the test ends. It skips or fails the test (see Require)
// when the binary is missing.
func PrometheusServer(t testing.TB, config string) *Prometheus {
	t.Helper()
	bin := redisBin(t, "prometheus", "PROMETHEUS_BIN")
	dir := t.TempDir()
	cfg := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfg, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	// A free port, then Prometheus binds it; another process can take it
	// in between, so a failed start is retried on a new one.
	for attempt := 0; ; attempt++ {
		port, err := loopbackPort()
		if err != nil {
			t.Fatal(err)
		}
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		p, err := launch.Start("prometheus", exec.Command(bin,
			"--config.file="+cfg,
			"--storage.tsdb.path="+filepath.Join(dir, "data"),
			"--web.listen-address="+addr,
			"--log.level=warn",
		), nil)
		if err != nil {
			t.Fatalf("prometheus: %v", err)
		}
		prom := &Prometheus{URL: "http://" + addr, p: p}
		if err := prom.waitReady(); err != nil {
			p.Kill()
			if attempt < 2 {
				continue
			}
			t.Fatalf("prometheus did not become ready: %v", err)
		}
		t.Cleanup(func() { p.Stop(stopTimeout) })
		return prom
	}
}

func (p *Prometheus) waitReady() error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*startTimeout)
	defer cancel()
	return p.p.Poll(ctx, "200 from /-/ready", func(ctx context.Context) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.URL+"/-/ready", nil)
		if err != nil {
			return err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("GET /-/ready: %s", resp.Status)
		}
		return nil
	})
}

// Logs is what Prometheus printed so far.
func (p *Prometheus) Logs() string { return p.p.Output() }

// Query evaluates an instant PromQL query and returns its samples: one
// value per series (labels rendered by Prometheus), or a single value
// under "" for a scalar.
func (p *Prometheus) Query(ctx context.Context, q string) (map[string]float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.URL+"/api/v1/query?query="+url.QueryEscape(q), nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var body struct {
		Status string `json:"status"`
		Error  string `json:"error"`
		Data   struct {
			ResultType string          `json:"resultType"`
			Result     json.RawMessage `json:"result"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return nil, fmt.Errorf("query %q: %w", q, err)
	}
	if body.Status != "success" {
		return nil, fmt.Errorf("query %q: %s", q, body.Error)
	}
	out := map[string]float64{}
	switch body.Data.ResultType {
	case "vector":
		var vec []struct {
			Metric map[string]string `json:"metric"`
			Value  [2]any            `json:"value"`
		}
		if err := json.Unmarshal(body.Data.Result, &vec); err != nil {
			return nil, fmt.Errorf("query %q: %w", q, err)
		}
		for _, s := range vec {
			v, err := sampleValue(s.Value[1])
			if err != nil {
				return nil, fmt.Errorf("query %q: %w", q, err)
			}
			out[fmt.Sprint(s.Metric)] = v
		}
	case "scalar":
		var s [2]any
		if err := json.Unmarshal(body.Data.Result, &s); err != nil {
			return nil, fmt.Errorf("query %q: %w", q, err)
		}
		v, err := sampleValue(s[1])
		if err != nil {
			return nil, fmt.Errorf("query %q: %w", q, err)
		}
		out[""] = v
	default:
		return nil, fmt.Errorf("query %q: result type %q", q, body.Data.ResultType)
	}
	return out, nil
}

func sampleValue(v any) (float64, error) {
	s, ok := v.(string)
	if !ok {
		return 0, fmt.Errorf("sample value %v is not a string", v)
	}
	return strconv.ParseFloat(s, 64)
}

// UnhealthyRules lists the loaded rules Prometheus reports as not healthy
// ("name: error"); it fails the test when the rules API does not answer
// or no rule is loaded at all.
func (p *Prometheus) UnhealthyRules(ctx context.Context, t testing.TB) []string {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.URL+"/api/v1/rules", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var body struct {
		Data struct {
			Groups []struct {
				Rules []struct {
					Name      string `json:"name"`
					Health    string `json:"health"`
					LastError string `json:"lastError"`
				} `json:"rules"`
			} `json:"groups"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		t.Fatalf("prometheus rules: %v", err)
	}
	var bad []string
	n := 0
	for _, g := range body.Data.Groups {
		for _, r := range g.Rules {
			n++
			if r.Health != "ok" {
				bad = append(bad, r.Name+": "+r.Health+" "+r.LastError)
			}
		}
	}
	if n == 0 {
		t.Fatal("prometheus loaded no rules")
	}
	return bad
}
