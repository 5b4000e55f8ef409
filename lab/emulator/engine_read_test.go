package emulator

import (
	"bytes"
	"fmt"
	"testing"

	"github.com/tetherproxy/tether/engine"
)

// TestTetherReadsTheEmulator: what tether's engine package reads of the
// emulator's /metrics, in either engine's format, is the emulator's own
// count of prefix-cache hits and queries and its queues, exactly.
func TestTetherReadsTheEmulator(t *testing.T) {
	for _, kind := range []engine.Kind{engine.VLLM, engine.SGLang} {
		t.Run(string(kind), func(t *testing.T) {
			g, err := NewGPU(GPUConfig{Profile: ProfileA100(), TimeScale: 0.0001})
			if err != nil {
				t.Fatal(err)
			}
			hh, err := NewHandler(Instance{Name: "gpu-r", LatencyModel: g, Engine: string(kind), Model: "v1"})
			if err != nil {
				t.Fatal(err)
			}
			h := hh.(*handler)
			for i := range 6 {
				body := fmt.Sprintf(`{"messages":[{"role":"system","content":"%s"},{"role":"user","content":"turn %d"}]}`,
					bytes.Repeat([]byte("shared instructions "), 200), i)
				if w := call(t, h, "POST", "/v1/chat/completions", body); w.Code != 200 {
					t.Fatalf("request %d: %d %s", i, w.Code, w.Body)
				}
			}
			w := call(t, h, "GET", "/metrics", "")
			s, err := engine.Parse(kind, w.Body)
			if err != nil {
				t.Fatalf("tether cannot read the emulator's %s metrics: %v", kind, err)
			}
			st := h.stats()
			if !s.PrefixKnown || s.PrefixHits != float64(st.PrefixCacheHits) || s.PrefixQueries != float64(st.PrefixCacheQueries) {
				t.Errorf("tether reads hits %v / queries %v (known %v); the emulator counted %d / %d",
					s.PrefixHits, s.PrefixQueries, s.PrefixKnown, st.PrefixCacheHits, st.PrefixCacheQueries)
			}
			if st.PrefixCacheHits == 0 {
				t.Error("no prefix-cache hits: the shared instructions were never reused")
			}
			if s.Waiting != 0 || s.Running != 0 || !s.KVKnown || s.KVUsage != 0 || s.Engines != 1 {
				t.Errorf("idle instance read as %+v", s)
			}
			if want := ProfileA100().KVCapacityTokens / BlockSize * BlockSize; s.CacheTokens != want {
				t.Errorf("tether reads a KV capacity of %d tokens; the emulator's is %d", s.CacheTokens, want)
			}
		})
	}
}

// TestTetherReadsNoCapacityOfFixed: an instance without a KV cache (Fixed)
// publishes none tether could take for one.
func TestTetherReadsNoCapacityOfFixed(t *testing.T) {
	for _, kind := range []engine.Kind{engine.VLLM, engine.SGLang} {
		hh, err := NewHandler(Instance{Name: "gpu-f", Engine: string(kind)})
		if err != nil {
			t.Fatal(err)
		}
		s, err := engine.Parse(kind, call(t, hh.(*handler), "GET", "/metrics", "").Body)
		if err != nil || s.CacheTokens != 0 {
			t.Errorf("%s: %+v, %v; want a sample without capacity", kind, s, err)
		}
	}
}
