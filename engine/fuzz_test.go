package engine

import (
	"bytes"
	"errors"
	"math"
	"strings"
	"testing"
)

// FuzzParse: whatever an instance serves, Parse does not panic, refuses it
// with an *Error of a parse-time reason, or returns a sample that cannot flip
// a routing decision from garbage.
func FuzzParse(f *testing.F) {
	// The recorded expositions, cut to the lines of the families read: the
	// fuzzer minimizes what it finds interesting, which is slow on tens of KB.
	for _, name := range []string{"vllm-0.12-dp2.txt", "vllm-0.8.txt", "vllm-0.5-v0.txt", "sglang-dp2.txt", "sglang-old.txt"} {
		f.Add(readLines(fixture(f, name)), name[0] == 's')
	}
	for _, s := range []string{
		vllmHead, sglangHead, "", "<html></html>", "# EOF\n",
		vllmHead + "vllm:kv_cache_usage_perc{engine=\"0\"} 1.0000001\n",
		vllmHead + "vllm:prefix_cache_queries_total{engine=\"0\"} 1e308\nvllm:prefix_cache_queries_total{engine=\"1\"} 1e308\n",
		sglangHead + "sglang:num_running_reqs{priority=\"2\"} NaN\n",
		"vllm:num_requests_running{engine=\"\\\"\"} 1\nvllm:num_requests_waiting 1 1700000000000\n",
	} {
		f.Add([]byte(s), false)
		f.Add([]byte(s), true)
	}
	f.Fuzz(func(t *testing.T, data []byte, sglang bool) {
		kind := VLLM
		if sglang {
			kind = SGLang
		}
		s, err := Parse(kind, bytes.NewReader(data))
		// Parsing only the lines of the families read changes nothing when
		// the whole exposition parses.
		if fams, ferr := textParse(data); ferr == nil {
			sp, _ := specOf(kind)
			whole, werr := wholeSample(sp, fams)
			if whole != s || Reason(werr) != Reason(err) {
				t.Fatalf("the lines read give %+v, %v; the whole exposition %+v, %v", s, err, whole, werr)
			}
		}
		if err != nil {
			var e *Error
			if !errors.As(err, &e) {
				t.Fatalf("error %v is no *Error", err)
			}
			switch e.Reason {
			case ReasonParse, ReasonMissing, ReasonBadValue:
			default:
				t.Fatalf("reason %q from Parse", e.Reason)
			}
			if s != (Sample{}) {
				t.Fatalf("refused with a sample %+v", s)
			}
			return
		}
		if s.CacheTokens < 0 || int64(s.CacheTokens) > maxCacheTokens {
			t.Fatalf("accepted a capacity of %d tokens", s.CacheTokens)
		}
		for _, v := range []float64{s.KVUsage, s.PrefixHits, s.PrefixQueries, s.Preemptions} {
			if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
				t.Fatalf("accepted %+v", s)
			}
		}
		if s.KVUsage > 1 || (!s.KVKnown && s.KVUsage != 0) || s.Waiting < 0 || s.Running < 0 || s.Waiting > maxCount || s.Running > maxCount ||
			s.Engines < 1 || (!s.PrefixKnown && (s.PrefixHits != 0 || s.PrefixQueries != 0)) {
			t.Fatalf("accepted %+v", s)
		}
	})
}

// readLines keeps the lines of an exposition that name a family Parse reads.
func readLines(b []byte) []byte {
	var out bytes.Buffer
	for line := range strings.Lines(string(b)) {
		for _, name := range []string{
			"vllm:num_requests_", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
			"vllm:prefix_cache_", "vllm:gpu_prefix_cache_", "vllm:num_preemptions",
			"sglang:num_running_reqs ", "sglang:num_running_reqs{", "sglang:num_queue_reqs", "sglang:token_usage",
			"sglang:realtime_tokens", "sglang:prompt_tokens", "sglang:cached_tokens", "sglang:num_retracted_requests",
			"vllm:cache_config_info", "sglang:max_total_num_tokens",
		} {
			if strings.Contains(line, name) {
				out.WriteString(line)
				break
			}
		}
	}
	return out.Bytes()
}
