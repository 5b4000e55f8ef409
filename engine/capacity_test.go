package engine

import (
	"strings"
	"testing"

	"github.com/tetherproxy/tether/fleet"
)

// cacheInfo is one series of vllm:cache_config_info in the shape vLLM writes
// it (values made up): every field of its CacheConfig a label, in the order of
// metrics_info (prometheus_client does not sort them), each value as Python's
// str() gives it, and the engine label last.
func cacheInfo(engine, blockSize, numGPUBlocks string) string {
	return `vllm:cache_config_info{block_size="` + blockSize + `",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",` +
		`enable_prefix_caching="True",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",` +
		`num_gpu_blocks="` + numGPUBlocks + `",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",` +
		`sliding_window="None",swap_space="4",engine="` + engine + `"} 1.0` + "\n"
}

const cacheInfoHead = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n"

const sglangCapHead = "# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.\n# TYPE sglang:max_total_num_tokens gauge\n"

func sglangCap(dpRank, tpRank, v string) string {
	labels := `engine_type="unified",model_name="m",pp_rank="0",tp_rank="` + tpRank + `"`
	if dpRank != "" {
		labels = `dp_rank="` + dpRank + `",` + labels
	}
	return "sglang:max_total_num_tokens{" + labels + "} " + v + "\n"
}

// The capacity is read when it can be, and is otherwise 0: never an error,
// never a sample refused, whatever its lines say.
func TestCacheTokens(t *testing.T) {
	vllmLoad := Sample{Engines: 1, EngineReading: fleet.EngineReading{Waiting: 2, Running: 4}}
	sglangLoad := Sample{Engines: 1, EngineReading: fleet.EngineReading{Waiting: 2, Running: 4}}
	for _, tt := range []struct {
		name string
		kind Kind
		text string
		want int
	}{
		{"vLLM, one engine", VLLM, vllmHead + cacheInfoHead + cacheInfo("0", "16", "27864"), 27864 * 16},
		{"vLLM, the engines' copies of the server's sum", VLLM,
			vllmHead + cacheInfoHead + cacheInfo("0", "16", "58254") + cacheInfo("1", "16", "58254"), 58254 * 16},
		{"vLLM, V0: no engine label", VLLM, vllmHead + cacheInfoHead +
			`vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="False",gpu_memory_utilization="0.9",num_cpu_blocks="2048",num_gpu_blocks="27540",num_gpu_blocks_override="None",sliding_window="None",swap_space_bytes="4294967296"} 1.0` + "\n",
			27540 * 16},
		{"vLLM, a block size of 32", VLLM, vllmHead + cacheInfoHead + cacheInfo("0", "32", "1000"), 32000},
		{"vLLM, no cache_config_info", VLLM, vllmHead, 0},
		{"vLLM, num_gpu_blocks not yet set", VLLM, vllmHead + cacheInfoHead + cacheInfo("0", "16", "None"), 0},
		{"vLLM, one engine's series unusable", VLLM,
			vllmHead + cacheInfoHead + cacheInfo("0", "16", "None") + cacheInfo("1", "16", "100"), 1600},
		{"vLLM, no num_gpu_blocks label", VLLM, vllmHead + cacheInfoHead + `vllm:cache_config_info{block_size="16",engine="0"} 1.0` + "\n", 0},
		{"vLLM, no block_size label", VLLM, vllmHead + cacheInfoHead + `vllm:cache_config_info{num_gpu_blocks="100",engine="0"} 1.0` + "\n", 0},
		{"vLLM, blocks not a number", VLLM, vllmHead + cacheInfoHead + cacheInfo("0", "16", "many"), 0},
		{"vLLM, blocks a float", VLLM, vllmHead + cacheInfoHead + cacheInfo("0", "16", "100.5"), 0},
		{"vLLM, block size not a number", VLLM, vllmHead + cacheInfoHead + cacheInfo("0", "sixteen", "100"), 0},
		{"vLLM, zero blocks", VLLM, vllmHead + cacheInfoHead + cacheInfo("0", "16", "0"), 0},
		{"vLLM, zero block size", VLLM, vllmHead + cacheInfoHead + cacheInfo("0", "0", "100"), 0},
		{"vLLM, negative blocks", VLLM, vllmHead + cacheInfoHead + cacheInfo("0", "16", "-100"), 0},
		{"vLLM, a product past the bound", VLLM, vllmHead + cacheInfoHead + cacheInfo("0", "1048576", "1048577"), 0},
		{"vLLM, a product that overflows int64", VLLM, vllmHead + cacheInfoHead + cacheInfo("0", "1099511627776", "1099511627776"), 0},
		{"vLLM, blocks past int64", VLLM, vllmHead + cacheInfoHead + cacheInfo("0", "16", "99999999999999999999999"), 0},
		{"vLLM, a malformed line of the family", VLLM, vllmHead + cacheInfoHead + `vllm:cache_config_info{num_gpu_blocks="1",block_size= 1.0` + "\n", 0},
		{"vLLM, the family as a histogram", VLLM, vllmHead + "# TYPE vllm:cache_config_info histogram\n" +
			`vllm:cache_config_info_bucket{le="+Inf"} 1` + "\nvllm:cache_config_info_sum 1\nvllm:cache_config_info_count 1\n", 0},
		{"vLLM, SGLang's gauge is not read", VLLM, vllmHead + sglangCapHead + sglangCap("", "0", "131072.0"), 0},

		{"SGLang, one scheduler", SGLang, sglangHead + sglangCapHead + sglangCap("", "0", "131072.0"), 131072},
		{"SGLang, two dp ranks, each two TP ranks", SGLang, sglangHead + sglangCapHead +
			sglangCap("0", "0", "131072.0") + sglangCap("0", "1", "131072.0") + sglangCap("1", "2", "98304.0") + sglangCap("1", "3", "98304.0"),
			131072 + 98304},
		{"SGLang, not published (older releases)", SGLang, sglangHead, 0},
		{"SGLang, zero", SGLang, sglangHead + sglangCapHead + sglangCap("", "0", "0.0"), 0},
		{"SGLang, one rank zero", SGLang, sglangHead + sglangCapHead + sglangCap("0", "0", "131072.0") + sglangCap("1", "0", "0.0"), 0},
		{"SGLang, negative", SGLang, sglangHead + sglangCapHead + sglangCap("", "0", "-5.0"), 0},
		{"SGLang, NaN", SGLang, sglangHead + sglangCapHead + sglangCap("", "0", "NaN"), 0},
		{"SGLang, +Inf", SGLang, sglangHead + sglangCapHead + sglangCap("", "0", "+Inf"), 0},
		{"SGLang, a fraction", SGLang, sglangHead + sglangCapHead + sglangCap("", "0", "1.5"), 0},
		{"SGLang, huge", SGLang, sglangHead + sglangCapHead + sglangCap("", "0", "1e300"), 0},
		{"SGLang, ranks that add up past the bound", SGLang, sglangHead + sglangCapHead +
			sglangCap("0", "0", "1099511627776") + sglangCap("1", "0", "1"), 0},
		{"SGLang, not a number", SGLang, sglangHead + sglangCapHead + sglangCap("", "0", "lots"), 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Parse(tt.kind, strings.NewReader(tt.text))
			if err != nil {
				t.Fatalf("Parse: %v; the capacity refused the sample", err)
			}
			want := vllmLoad
			if tt.kind == SGLang {
				want = sglangLoad
			}
			want.CacheTokens = tt.want
			if got != want {
				t.Errorf("Parse = %+v, want %+v", got, want)
			}
		})
	}
}

// A sample refused for its load says nothing of the capacity either.
func TestCacheTokensOfARefusedSample(t *testing.T) {
	text := cacheInfoHead + cacheInfo("0", "16", "100") + "vllm:num_requests_running{engine=\"0\"} -1\nvllm:num_requests_waiting{engine=\"0\"} 0\n"
	if s, err := Parse(VLLM, strings.NewReader(text)); Reason(err) != ReasonBadValue || s != (Sample{}) {
		t.Errorf("Parse = %+v, %v; want nothing, reason bad_value", s, err)
	}
}

// The reading carries the capacity.
func TestTrackerCarriesCacheTokens(t *testing.T) {
	r, err := NewTracker().Observe("a", Sample{Engines: 1, EngineReading: fleet.EngineReading{CacheTokens: 4096}}, t0)
	if err != nil || r.CacheTokens != 4096 {
		t.Errorf("Observe = %+v, %v; want CacheTokens 4096", r, err)
	}
}
