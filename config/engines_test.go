package config

import (
	"strings"
	"testing"
)

func TestParseEnginesBad(t *testing.T) {
	inst := func(extra string) string {
		return "[[instances]]\nname = \"a\"\naddress = \"10.0.0.1:8000\"\n" + extra
	}
	tests := []struct {
		name, toml string
		want       []string
	}{
		{"unknown default", "[engines]\ndefault = \"tgi\"", []string{"engines.default", `"tgi"`, "vllm"}},
		{"unknown instance engine", inst(`engine = "triton"`), []string{"instances[0].engine", `"triton"`}},
		{"upper-case engine", inst(`engine = "vLLM"`), []string{"instances[0].engine", `"vLLM"`}},
		{"url without scheme", inst("engine = \"vllm\"\nmetrics_url = \"10.0.0.1:8000/metrics\""), []string{"instances[0].metrics_url", "http://"}},
		{"url without host", inst("engine = \"vllm\"\nmetrics_url = \"http:///metrics\""), []string{"instances[0].metrics_url", "no host"}},
		{"url of another scheme", inst("engine = \"vllm\"\nmetrics_url = \"ftp://10.0.0.1/metrics\""), []string{"instances[0].metrics_url", "http://"}},
		{"url with credentials", inst("engine = \"vllm\"\nmetrics_url = \"http://u:p@10.0.0.1:8000/metrics\""), []string{"instances[0].metrics_url", "credentials"}},
		{"url of a generic engine", inst("metrics_url = \"http://10.0.0.1:8000/metrics\""), []string{"instances[0].metrics_url", "generic"}},
		{"staleness below interval", "[engines]\nscrape_interval = \"2s\"\nstaleness = \"1s\"", []string{"engines.staleness", "1s", "scrape_interval"}},
		{"tiny interval", "[engines]\nscrape_interval = \"1ms\"", []string{"engines.scrape_interval"}},
		{"timeout above interval", "[engines]\nscrape_timeout = \"2s\"", []string{"engines.scrape_timeout", "2s"}},
		{"zero timeout", "[engines]\nscrape_timeout = 0", []string{"engines.scrape_timeout"}},
		{"tiny body", "[engines]\nmax_body_bytes = 10", []string{"engines.max_body_bytes", "10"}},
		{"unknown key", "[engines]\ninterval = \"1s\"", []string{"engines.interval"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.toml))
			if err == nil {
				t.Fatal("want an error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
}

func TestEngineDefaults(t *testing.T) {
	c, err := Parse([]byte("[engines]\ndefault = \"vllm\"\n" +
		"[[instances]]\nname = \"a\"\naddress = \"10.0.0.1:8000\"\n" +
		"[[instances]]\nname = \"b\"\naddress = \"10.0.0.2:30000\"\nengine = \"sglang\"\nmetrics_url = \"https://b.internal:9000/m\"\n" +
		"[[instances]]\nname = \"c\"\naddress = \"10.0.0.3:8000\"\nengine = \"generic\"\n"))
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range []struct{ engine, url string }{
		{"vllm", "http://10.0.0.1:8000/metrics"},
		{"sglang", "https://b.internal:9000/m"},
		{"generic", ""}, // not scraped
	} {
		in := c.Instances[i]
		if got := in.Engine; got != want.engine {
			t.Errorf("instance %s: engine %q, want %q", in.Name, got, want.engine)
		}
		if got := in.MetricsURL; got != want.url {
			t.Errorf("instance %s: metrics URL %q, want %q", in.Name, got, want.url)
		}
	}
	d := Default()
	if d.Engines.Default != EngineGeneric || d.Routing.SaturationWaiting != 5 || d.Routing.SaturationKVUsage != 0.8 {
		t.Errorf("defaults: engine %q, waiting %d, kv usage %v", d.Engines.Default, d.Routing.SaturationWaiting, d.Routing.SaturationKVUsage)
	}
}
