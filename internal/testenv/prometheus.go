package testenv

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/tetherproxy/tether/internal/launch"
)

// Prometheus is a Prometheus server private to one test, on loopback.
type Prometheus struct {
	URL string // http://127.0.0.1:port
	p   *launch.Proc
}

// PrometheusServer starts Prometheus with config, and stops it when the
// test ends. The binary is $PROMETHEUS_BIN, else taken from PATH. config
// is a prometheus.yml body. Rule files it names are read relative to the
// test's working directory, so give absolute paths. PrometheusServer skips
// or fails the test (see Require) when the binary is missing.
func PrometheusServer(t testing.TB, config string) *Prometheus {
	t.Helper()
	bin := redisBin(t, "prometheus", "PROMETHEUS_BIN")
	dir := t.TempDir()
	cfg := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfg, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	prom, err := startPrometheus(bin, cfg, filepath.Join(dir, "data"), loopbackPort)
	if err != nil {
		t.Fatalf("prometheus: %v", err)
	}
	t.Cleanup(func() { prom.p.Stop(stopTimeout) })
	return prom
}

// startPrometheus starts Prometheus on the config file cfg and the data
// directory data. It listens on a loopback port from draw.
// startPrometheus waits until it is ready and proves it is the one started
// (prometheusProof). Prometheus cannot take a listener from the test.
// Another process may hold the port, and then another is drawn.
func startPrometheus(bin, cfg, data string, draw func() (int, error)) (*Prometheus, error) {
	return onFreePort(draw, func(port int) (*Prometheus, error) {
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		url := "http://" + addr
		ctx, cancel := context.WithTimeout(context.Background(), 2*startTimeout)
		defer cancel()
		p, err := launch.StartProven(ctx, "prometheus", exec.Command(bin,
			"--config.file="+cfg,
			"--storage.tsdb.path="+data,
			"--web.listen-address="+addr,
			"--log.level=warn",
		), nil, "200 from /-/ready and its flags", prometheusProof(url, cfg))
		if err != nil {
			return nil, err
		}
		return &Prometheus{URL: url, p: p}, nil
	})
}

// prometheusProof is the proof of the Prometheus at url (see
// launch.StartProven). It must be ready, and the config file its flags
// name must be cfg. Another file means another Prometheus holds the port.
func prometheusProof(url, cfg string) func(context.Context, *launch.Proc) error {
	return func(ctx context.Context, _ *launch.Proc) error {
		if _, err := httpGet(ctx, url+"/-/ready"); err != nil {
			return err
		}
		body, err := httpGet(ctx, url+"/api/v1/status/flags")
		if err != nil {
			return err
		}
		var flags struct {
			Data map[string]string `json:"data"`
		}
		if err := json.Unmarshal(body, &flags); err != nil {
			return fmt.Errorf("prometheus flags: %w", err)
		}
		if got := flags.Data["config.file"]; got != cfg {
			return fmt.Errorf("%s is a Prometheus on %q, not on %q: %w", url, got, cfg, launch.ErrPortTaken)
		}
		return nil
	}
}

// httpGet returns the body of url's 200 answer. It gives up on a call
// after two seconds.
func httpGet(ctx context.Context, url string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	switch {
	case err != nil:
		return nil, fmt.Errorf("GET %s: %w", url, err)
	case resp.StatusCode != http.StatusOK:
		return nil, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return body, nil
}

// Logs is what Prometheus printed so far.
func (p *Prometheus) Logs() string { return p.p.Output() }

// Query evaluates an instant PromQL query and returns its samples. There
// is one value per series, keyed by its labels as Prometheus renders
// them. A scalar gives a single value under "".
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

// UnhealthyRules lists the loaded rules Prometheus reports as not
// healthy, as "name: error". It fails the test when the rules API does not
// answer or no rule is loaded at all.
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
