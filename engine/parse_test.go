package engine

import (
	"bytes"
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/tetherproxy/tether/fleet"
)

func fixture(t testing.TB, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// The recorded expositions, each read as its engine: the values are those
// make_fixtures.py sets.
func TestParseRecorded(t *testing.T) {
	for _, tt := range []struct {
		file string
		kind Kind
		want Sample
	}{
		{"vllm-0.12-dp2.txt", VLLM, Sample{Engines: 2, EngineReading: fleet.EngineReading{
			// engine 0: 12 running, 3 waiting, 0.4375 used, 1048576/393216 tokens, 5 preemptions
			// engine 1:  9 running, 0 waiting, 0.3125 used,  524288/131072 tokens, 2 preemptions
			Waiting: 3, Running: 21, KVUsage: 0.375, KVKnown: true,
			PrefixHits: 524288, PrefixQueries: 1572864, PrefixKnown: true,
			Preemptions: 7,
			CacheTokens: 29127 * 16, // cache_config_info of each engine: the API server's sum over both, not added again
		}}},
		{"vllm-0.8.txt", VLLM, Sample{Engines: 1, EngineReading: fleet.EngineReading{
			Waiting: 1, Running: 6, KVUsage: 0.625, KVKnown: true, // gpu_cache_usage_perc
			PrefixHits: 5120, PrefixQueries: 20480, PrefixKnown: true, // gpu_prefix_cache_*
			Preemptions: 4,
			CacheTokens: 27864 * 16, // cache_config_info without the engine label
		}}},
		{"vllm-0.5-v0.txt", VLLM, Sample{Engines: 1, EngineReading: fleet.EngineReading{
			Waiting: 17, Running: 31, KVUsage: 0.96875, KVKnown: true,
			Preemptions: 96, // no engine label, no prefix counters
			CacheTokens: 27540 * 16,
		}}},
		{"sglang-dp2.txt", SGLang, Sample{Engines: 2, EngineReading: fleet.EngineReading{
			// dp 0: 7 running, 2 queued, 0.5 used, 300000 computed + 700000 cached, 3 retracted
			// dp 1: 5 running, 1 queued, 0.25 used, 200000 computed + 300000 cached, 1 retracted
			Waiting: 3, Running: 12, KVUsage: 0.375, KVKnown: true,
			PrefixHits: 1000000, PrefixQueries: 1500000, PrefixKnown: true, // realtime_tokens_total, not the tokenizer's
			Preemptions: 4,
			CacheTokens: 2 * 131072, // max_total_num_tokens of each dp rank's pool, added
		}}},
		{"sglang-old.txt", SGLang, Sample{Engines: 1, EngineReading: fleet.EngineReading{
			Waiting: 4, Running: 14, KVUsage: 0.875, KVKnown: true,
			PrefixHits: 352000, PrefixQueries: 640000, PrefixKnown: true, // cached_tokens_total, prompt_tokens_total
		}}},
	} {
		t.Run(tt.file, func(t *testing.T) {
			got, err := Parse(tt.kind, bytes.NewReader(fixture(t, tt.file)))
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("Parse (-want +got):\n%s", diff)
			}
		})
	}
}

// An exposition read as the other engine has none of its gauges.
func TestParseWrongKind(t *testing.T) {
	for _, tt := range []struct {
		file string
		kind Kind
	}{{"vllm-0.12-dp2.txt", SGLang}, {"sglang-dp2.txt", VLLM}} {
		_, err := Parse(tt.kind, bytes.NewReader(fixture(t, tt.file)))
		if Reason(err) != ReasonMissing {
			t.Errorf("%s as %s: %v, want reason missing", tt.file, tt.kind, err)
		}
	}
}

const vllmHead = `# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
`

const sglangHead = `# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="0"} 4.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="m",tp_rank="0"} 2.0
`

func TestParseCases(t *testing.T) {
	for _, tt := range []struct {
		name string
		kind Kind
		text string
		want Sample
	}{
		{"vllm counters in OpenMetrics form", VLLM, `# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 800.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e+09
# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 200.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e+09
# HELP vllm:num_preemptions Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e+09
# EOF
`, Sample{Engines: 1, EngineReading: fleet.EngineReading{Waiting: 2, Running: 4, PrefixHits: 200, PrefixQueries: 800, PrefixKnown: true, Preemptions: 3}}},
		{"vllm counter family without the suffix", VLLM, vllmHead + `# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries{engine="0",model_name="m"} 80
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits{engine="0",model_name="m"} 20
`, Sample{Engines: 1, EngineReading: fleet.EngineReading{Waiting: 2, Running: 4, PrefixHits: 20, PrefixQueries: 80, PrefixKnown: true}}},
		{"vllm new usage gauge wins", VLLM, vllmHead + `# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.9
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
`, Sample{Engines: 1, EngineReading: fleet.EngineReading{Waiting: 2, Running: 4, KVUsage: 0.25, KVKnown: true}}},
		{"vllm new prefix counters win", VLLM, vllmHead + `# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m"} 9
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 9
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 10
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 5
`, Sample{Engines: 1, EngineReading: fleet.EngineReading{Waiting: 2, Running: 4, PrefixHits: 5, PrefixQueries: 10, PrefixKnown: true}}},
		{"vllm without usage", VLLM, vllmHead, Sample{Engines: 1, EngineReading: fleet.EngineReading{Waiting: 2, Running: 4}}},
		{"vllm zero engines idle", VLLM, `vllm:num_requests_running{engine="0"} 0
vllm:num_requests_running{engine="1"} 0
vllm:num_requests_running{engine="2"} 0
vllm:num_requests_waiting{engine="0"} 0
vllm:num_requests_waiting{engine="1"} 0
vllm:num_requests_waiting{engine="2"} 0
vllm:kv_cache_usage_perc{engine="0"} 0
vllm:kv_cache_usage_perc{engine="1"} 1
vllm:kv_cache_usage_perc{engine="2"} 0.5
`, Sample{Engines: 3, EngineReading: fleet.EngineReading{KVUsage: 0.5, KVKnown: true}}}, // no TYPE lines: untyped, still read
		{"sglang priority breakdown dropped", SGLang, `# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",priority=""} 6
sglang:num_running_reqs{model_name="m",priority="0"} 4
sglang:num_running_reqs{model_name="m",priority="1"} 2
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",priority=""} 3
sglang:num_queue_reqs{model_name="m",priority="0"} 3
`, Sample{Engines: 1, EngineReading: fleet.EngineReading{Waiting: 3, Running: 6}}},
		{"sglang every scheduler reporting", SGLang, `# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",model_name="m",tp_rank="0"} 5
sglang:num_running_reqs{dp_rank="0",model_name="m",tp_rank="1"} 5
sglang:num_running_reqs{dp_rank="1",model_name="m",tp_rank="2"} 3
sglang:num_running_reqs{dp_rank="1",model_name="m",tp_rank="3"} 3
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",model_name="m",tp_rank="0"} 1
sglang:num_queue_reqs{dp_rank="0",model_name="m",tp_rank="1"} 1
sglang:num_queue_reqs{dp_rank="1",model_name="m",tp_rank="2"} 0
sglang:num_queue_reqs{dp_rank="1",model_name="m",tp_rank="3"} 0
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",model_name="m",tp_rank="0"} 0.5
sglang:token_usage{dp_rank="0",model_name="m",tp_rank="1"} 0.5
sglang:token_usage{dp_rank="1",model_name="m",tp_rank="2"} 0.25
sglang:token_usage{dp_rank="1",model_name="m",tp_rank="3"} 0.25
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{dp_rank="0",model_name="m",tp_rank="0"} 2
sglang:num_retracted_requests_total{dp_rank="0",model_name="m",tp_rank="1"} 2
`, Sample{Engines: 2, EngineReading: fleet.EngineReading{Waiting: 1, Running: 8, KVUsage: 0.375, KVKnown: true, Preemptions: 2}}},
		{"sglang NaN in a family not read", SGLang, sglangHead + `# TYPE sglang:fwd_occupancy gauge
sglang:fwd_occupancy{engine_type="unified",model_name="m",tp_rank="0"} NaN
`, Sample{Engines: 1, EngineReading: fleet.EngineReading{Waiting: 2, Running: 4}}},
		{"sglang tokenizer counters by source and stream", SGLang, sglangHead + `# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{engine_type="unified",is_streaming="false",model_name="m"} 600
sglang:prompt_tokens_total{engine_type="unified",is_streaming="true",model_name="m"} 400
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{cache_source="device",engine_type="unified",model_name="m"} 300
sglang:cached_tokens_total{cache_source="host",engine_type="unified",model_name="m"} 50
`, Sample{Engines: 1, EngineReading: fleet.EngineReading{Waiting: 2, Running: 4, PrefixHits: 350, PrefixQueries: 1000, PrefixKnown: true}}},
		{"sglang no cache hit yet", SGLang, sglangHead + `# HELP sglang:cached_tokens_total Number of cached prompt tokens.
# TYPE sglang:cached_tokens_total counter
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="m"} 640
`, Sample{Engines: 1, EngineReading: fleet.EngineReading{Waiting: 2, Running: 4, PrefixQueries: 640, PrefixKnown: true}}},
		{"sglang realtime compute only", SGLang, sglangHead + `# TYPE sglang:realtime_tokens_total counter
sglang:realtime_tokens_total{mode="prefill_compute",model_name="m",tp_rank="0"} 900
sglang:realtime_tokens_total{mode="decode",model_name="m",tp_rank="0"} 50
`, Sample{Engines: 1, EngineReading: fleet.EngineReading{Waiting: 2, Running: 4, PrefixQueries: 900, PrefixKnown: true}}},
		{"sglang realtime decode only is no prefix figure", SGLang, sglangHead + `# TYPE sglang:realtime_tokens_total counter
sglang:realtime_tokens_total{mode="decode",model_name="m",tp_rank="0"} 50
`, Sample{Engines: 1, EngineReading: fleet.EngineReading{Waiting: 2, Running: 4}}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Parse(tt.kind, strings.NewReader(tt.text))
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("Parse (-want +got):\n%s", diff)
			}
		})
	}
}

func TestParseRefuses(t *testing.T) {
	for _, tt := range []struct {
		name, reason string
		kind         Kind
		text         string
	}{
		{"html page", ReasonParse, VLLM, "<!DOCTYPE html>\n<html><body><h1>502 Bad Gateway</h1></body></html>\n"},
		{"json", ReasonParse, SGLang, `{"detail":"Not Found"}`},
		{"plain words", ReasonParse, VLLM, "Internal Server Error\n"},
		{"cut in a label", ReasonParse, VLLM, vllmHead + `vllm:kv_cache_usage_perc{engine="0",model_na`},
		{"two HELP lines", ReasonParse, VLLM, vllmHead + "# HELP vllm:num_requests_waiting again\n"},
		{"value not a number", ReasonParse, VLLM, vllmHead + "vllm:kv_cache_usage_perc{engine=\"0\"} lots\n"},

		{"empty", ReasonMissing, VLLM, ""},
		{"another exporter", ReasonMissing, VLLM, "# TYPE node_load1 gauge\nnode_load1 0.5\n"},
		{"no waiting", ReasonMissing, VLLM, "vllm:num_requests_running{engine=\"0\"} 1\n"},
		{"no running", ReasonMissing, SGLang, "sglang:num_queue_reqs 1\n"},
		{"only a priority breakdown", ReasonMissing, SGLang, "sglang:num_running_reqs{priority=\"1\"} 1\nsglang:num_queue_reqs 1\n"},

		{"NaN waiting", ReasonBadValue, VLLM, `vllm:num_requests_running{engine="0"} 1
vllm:num_requests_waiting{engine="0"} NaN
`},
		{"infinite running", ReasonBadValue, SGLang, "sglang:num_running_reqs +Inf\nsglang:num_queue_reqs 0\n"},
		{"negative waiting", ReasonBadValue, VLLM, `vllm:num_requests_running{engine="0"} 1
vllm:num_requests_waiting{engine="1"} -1
`},
		{"usage above 1", ReasonBadValue, VLLM, vllmHead + "vllm:kv_cache_usage_perc{engine=\"0\"} 1.5\n"},
		{"negative usage", ReasonBadValue, SGLang, sglangHead + "sglang:token_usage -0.1\n"},
		{"NaN usage", ReasonBadValue, VLLM, vllmHead + "vllm:gpu_cache_usage_perc{engine=\"0\"} NaN\n"},
		{"negative counter", ReasonBadValue, VLLM, vllmHead + "vllm:num_preemptions_total{engine=\"0\"} -4\n"},
		{"infinite counter", ReasonBadValue, VLLM, vllmHead + `vllm:prefix_cache_queries_total{engine="0"} +Inf
vllm:prefix_cache_hits_total{engine="0"} 1
`},
		{"NaN hits", ReasonBadValue, VLLM, vllmHead + `vllm:prefix_cache_queries_total{engine="0"} 1
vllm:prefix_cache_hits_total{engine="0"} NaN
`},
		{"NaN tokenizer counter", ReasonBadValue, SGLang, sglangHead + "sglang:prompt_tokens_total NaN\n"},
		{"negative realtime counter", ReasonBadValue, SGLang, sglangHead + "sglang:realtime_tokens_total{mode=\"prefill_cache\"} -1\n"},
		{"a billion waiting", ReasonBadValue, VLLM, `vllm:num_requests_running{engine="0"} 1
vllm:num_requests_waiting{engine="0"} 2e9
`},
		{"waiting as a histogram", ReasonBadValue, VLLM, `vllm:num_requests_running{engine="0"} 1
# TYPE vllm:num_requests_waiting histogram
vllm:num_requests_waiting_bucket{le="+Inf"} 1
vllm:num_requests_waiting_sum 1
vllm:num_requests_waiting_count 1
`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s, err := Parse(tt.kind, strings.NewReader(tt.text))
			if Reason(err) != tt.reason {
				t.Fatalf("Parse = %+v, %v; want reason %s", s, err, tt.reason)
			}
			if s != (Sample{}) {
				t.Errorf("a refused exposition gave %+v", s)
			}
			var e *Error
			if !errors.As(err, &e) || e.Err == nil || !strings.Contains(err.Error(), tt.reason) {
				t.Errorf("error %q: want an *Error that says why", err)
			}
		})
	}
}

func TestParseGeneric(t *testing.T) {
	for _, k := range []Kind{Generic, "", "tgi"} {
		_, err := Parse(k, bytes.NewReader(fixture(t, "vllm-0.12-dp2.txt")))
		if err == nil || Reason(err) != ReasonOther {
			t.Errorf("Parse(%q): %v, want an error of no reason", k, err)
		}
	}
}

type failingReader struct{}

func (failingReader) Read([]byte) (int, error) { return 0, errors.New("disk on fire") }

func TestParseReadError(t *testing.T) {
	_, err := Parse(VLLM, failingReader{})
	if Reason(err) != ReasonParse || !strings.Contains(err.Error(), "disk on fire") {
		t.Errorf("Parse of a failing reader: %v", err)
	}
}

func TestReason(t *testing.T) {
	base := errors.New("refused")
	e := &Error{Reason: ReasonConnect, Err: base}
	wrapped := errors.Join(errors.New("scrape gpu-a"), e)
	for _, tt := range []struct {
		err  error
		want string
	}{
		{nil, ""},
		{base, ReasonOther},
		{e, ReasonConnect},
		{wrapped, ReasonConnect},
	} {
		if got := Reason(tt.err); got != tt.want {
			t.Errorf("Reason(%v) = %q, want %q", tt.err, got, tt.want)
		}
	}
	if !errors.Is(wrapped, base) {
		t.Error("Error does not unwrap to its cause")
	}
	if got := (&Error{Reason: ReasonMissing}).Error(); got != "engine: missing" {
		t.Errorf("Error() = %q", got)
	}
	seen := map[string]bool{}
	for _, r := range Reasons() {
		if seen[r] || r == "" {
			t.Errorf("Reasons has %q twice or empty", r)
		}
		seen[r] = true
	}
	if len(seen) != 9 {
		t.Errorf("Reasons = %v", Reasons())
	}
}

// wholeSample is what Parse says of an exposition parsed whole into fams.
func wholeSample(sp *spec, fams families) (Sample, error) {
	s, err := sp.sample(fams)
	if err == nil {
		s.CacheTokens = sp.capacity(fams)
	}
	return s, err
}

// The line filter (lines.go) decides what expfmt parses, never how.
func TestParseLines(t *testing.T) {
	for _, file := range []string{"vllm-0.12-dp2.txt", "vllm-0.8.txt", "vllm-0.5-v0.txt", "sglang-dp2.txt", "sglang-old.txt"} {
		body := fixture(t, file)
		kind := VLLM
		if strings.HasPrefix(file, "sglang") {
			kind = SGLang
		}
		sp, _ := specOf(kind)
		fams, err := textParse(body)
		if err != nil {
			t.Fatal(err)
		}
		whole, err := wholeSample(sp, fams)
		if err != nil {
			t.Fatal(err)
		}
		got, err := Parse(kind, bytes.NewReader(body))
		if err != nil || got != whole {
			t.Errorf("%s: the lines read give %+v, %v; the whole exposition %+v", file, got, err, whole)
		}
		if kept := sp.names.relevant(body, nil); len(kept) > len(body)/10 {
			t.Errorf("%s: %d of %d bytes kept", file, len(kept), len(body))
		}
	}

	for _, tt := range []struct {
		name, text, reason string
		want               Sample
	}{
		{name: "garbage in a family not read", text: vllmHead + "vllm:iteration_tokens_total_bucket{le=\"1\"} many\n",
			want: Sample{Engines: 1, EngineReading: fleet.EngineReading{Waiting: 2, Running: 4}}},
		{name: "comments of every kind", text: "# a comment\n#\n# UNIT vllm:x seconds\n" + vllmHead + "# EOF\n",
			want: Sample{Engines: 1, EngineReading: fleet.EngineReading{Waiting: 2, Running: 4}}},
		{name: "leading blanks", text: " \tvllm:num_requests_running{engine=\"0\"} 1\n  vllm:num_requests_waiting{engine=\"0\"} 2\n",
			want: Sample{Engines: 1, EngineReading: fleet.EngineReading{Waiting: 2, Running: 1}}},
		{name: "quoted names are kept for expfmt", text: vllmHead + "{\"vllm:kv_cache_usage_perc\",engine=\"0\"} 0.5\n",
			want: Sample{Engines: 1, EngineReading: fleet.EngineReading{Waiting: 2, Running: 4, KVUsage: 0.5, KVKnown: true}}},
		{name: "cut inside a line of a family not read", text: vllmHead + "vllm:iteration_tokens_total_bucket{le=\"1\",mo", reason: ReasonParse},
		{name: "cut inside a line read", text: vllmHead + "vllm:kv_cache_usage_perc{engine=\"0\"} 0.5", reason: ReasonParse},
		{name: "HELP of a family read, twice", text: "# HELP vllm:kv_cache_usage_perc a\n# HELP vllm:kv_cache_usage_perc b\n" + vllmHead, reason: ReasonParse},
		{name: "TYPE after the samples", text: vllmHead + "# TYPE vllm:num_requests_waiting gauge\n", reason: ReasonParse},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Parse(VLLM, strings.NewReader(tt.text))
			if Reason(err) != tt.reason || (tt.reason == "" && got != tt.want) {
				t.Errorf("Parse = %+v, %v; want %+v, reason %q", got, err, tt.want, tt.reason)
			}
		})
	}
}

// Parse rounds the requests waiting and running, held within 0 and a
// billion.
func TestCount(t *testing.T) {
	for _, tt := range []struct {
		in   float64
		want int
	}{{0, 0}, {2.4, 2}, {2.5, 3}, {-3, 0}, {math.NaN(), 0}, {math.Inf(1), 1e9}, {5e12, 1e9}} {
		if got := count(tt.in); got != tt.want {
			t.Errorf("count %v = %d, want %d", tt.in, got, tt.want)
		}
	}
}
