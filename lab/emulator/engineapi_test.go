package emulator

import (
	"bytes"
	"encoding/json"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// keysOf is the sorted keys of a JSON object.
func keysOf(t *testing.T, b []byte) []string {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("not a JSON object: %v\n%s", err, b)
	}
	var keys []string
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

func sorted(s ...string) []string { slices.Sort(s); return s }

// Each engine answers its own paths, and 404 to the other's.
func TestEnginePaths(t *testing.T) {
	for _, tt := range []struct {
		engine     string
		own, other []string
	}{
		{EngineVLLM, []string{"/health", "/version", "/v1/models", "/metrics"}, []string{"/health_generate", "/get_model_info", "/get_server_info"}},
		{EngineSGLang, []string{"/health", "/health_generate", "/get_model_info", "/get_server_info", "/v1/models", "/metrics"}, []string{"/version"}},
	} {
		t.Run(tt.engine, func(t *testing.T) {
			srv := newServer(t, Instance{Name: "gpu-e", Engine: tt.engine})
			for _, p := range tt.own {
				if resp, body := do(t, srv, "GET", p, nil); resp.StatusCode != http.StatusOK {
					t.Errorf("GET %s: %d %s", p, resp.StatusCode, body)
				}
			}
			for _, p := range tt.other {
				if resp, body := do(t, srv, "GET", p, nil); resp.StatusCode != http.StatusNotFound {
					t.Errorf("GET %s: %d %s, want 404", p, resp.StatusCode, body)
				}
			}
		})
	}
}

// /health (and SGLang's /health_generate) answer 200 with an empty body and
// no Content-Type, to GET and HEAD, and 503 once the instance is down.
func TestHealth(t *testing.T) {
	for engine, paths := range map[string][]string{EngineVLLM: {"/health"}, EngineSGLang: {"/health", "/health_generate"}} {
		srv := newServer(t, Instance{Name: "gpu-e", Engine: engine})
		for _, p := range paths {
			for _, method := range []string{"GET", "HEAD"} {
				resp, body := do(t, srv, method, p, nil)
				if resp.StatusCode != http.StatusOK || len(body) != 0 || resp.Header.Get("Content-Type") != "" || resp.ContentLength != 0 {
					t.Errorf("%s %s %s: %d, Content-Type %q, Content-Length %d, body %q; want 200, none, 0, empty",
						engine, method, p, resp.StatusCode, resp.Header.Get("Content-Type"), resp.ContentLength, body)
				}
			}
			if resp, _ := do(t, srv, "POST", p, nil); resp.StatusCode != http.StatusMethodNotAllowed {
				t.Errorf("%s POST %s: %d, want 405", engine, p, resp.StatusCode)
			}
		}
		do(t, srv, "POST", pathFaults, strings.NewReader(`{"down":true}`))
		for _, p := range paths {
			if resp, _ := do(t, srv, "GET", p, nil); resp.StatusCode != http.StatusServiceUnavailable {
				t.Errorf("%s GET %s of a down instance: %d, want 503", engine, p, resp.StatusCode)
			}
		}
	}
}

func TestVLLMVersion(t *testing.T) {
	resp, body := do(t, newServer(t, Instance{Name: "gpu-e"}), "GET", "/version", nil)
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q", ct)
	}
	var v map[string]string
	if err := json.Unmarshal(body, &v); err != nil || !cmp.Equal(v, map[string]string{"version": VLLMVersion}) {
		t.Errorf("/version %s (%v)", body, err)
	}
}

// /v1/models is the engine's model card: vLLM's with root, parent (null),
// max_model_len and one permission; SGLang's with root and max_model_len.
func TestModelCards(t *testing.T) {
	now := time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC)
	clock := func() time.Time { return now }
	t.Run("vllm", func(t *testing.T) {
		resp, body := do(t, newServer(t, Instance{Name: "gpu-e", Model: "m", Now: clock}), "GET", "/v1/models", nil)
		if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
			t.Errorf("Content-Type %q", ct)
		}
		var list struct {
			Object string            `json:"object"`
			Data   []json.RawMessage `json:"data"`
		}
		if err := json.Unmarshal(body, &list); err != nil || list.Object != "list" || len(list.Data) != 1 {
			t.Fatalf("/v1/models %s (%v)", body, err)
		}
		card := list.Data[0]
		if diff := cmp.Diff(sorted("id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"), keysOf(t, card)); diff != "" {
			t.Errorf("card keys (-want +got):\n%s", diff)
		}
		var m model
		strictDecode(t, card, &m)
		if m.ID != "m" || m.Object != "model" || m.Created != now.Unix() || m.OwnedBy != "vllm" || m.Root != "m" ||
			string(m.Parent) != "null" || m.MaxModelLen != MaxModelLen || len(m.Permission) != 1 {
			t.Errorf("card %+v", m)
		}
		var perms []json.RawMessage
		_ = json.Unmarshal(mustField(t, card, "permission"), &perms)
		if diff := cmp.Diff(sorted("id", "object", "created", "allow_create_engine", "allow_sampling", "allow_logprobs",
			"allow_search_indices", "allow_view", "allow_fine_tuning", "organization", "group", "is_blocking"), keysOf(t, perms[0])); diff != "" {
			t.Errorf("permission keys (-want +got):\n%s", diff)
		}
		p := m.Permission[0]
		if !strings.HasPrefix(p.ID, "modelperm-") || len(p.ID) != len("modelperm-")+32 || p.Object != "model_permission" ||
			p.Created != now.Unix() || p.AllowCreateEngine || !p.AllowSampling || !p.AllowLogprobs || p.AllowSearchIndices ||
			!p.AllowView || p.AllowFineTuning || p.Organization != "*" || p.Group != nil || p.IsBlocking {
			t.Errorf("permission %+v", p)
		}
	})
	t.Run("sglang", func(t *testing.T) {
		_, body := do(t, newServer(t, Instance{Name: "gpu-e", Model: "m", Engine: EngineSGLang, Now: clock}), "GET", "/v1/models", nil)
		var list struct {
			Data []json.RawMessage `json:"data"`
		}
		if err := json.Unmarshal(body, &list); err != nil || len(list.Data) != 1 {
			t.Fatalf("/v1/models %s (%v)", body, err)
		}
		if diff := cmp.Diff(sorted("id", "object", "created", "owned_by", "root", "max_model_len"), keysOf(t, list.Data[0])); diff != "" {
			t.Errorf("card keys (-want +got):\n%s", diff)
		}
		var m model
		strictDecode(t, list.Data[0], &m)
		if diff := cmp.Diff(model{ID: "m", Object: "model", Created: now.Unix(), OwnedBy: "sglang", Root: "m", MaxModelLen: MaxModelLen}, m); diff != "" {
			t.Errorf("card (-want +got):\n%s", diff)
		}
	})
}

func mustField(t *testing.T, obj []byte, key string) json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(obj, &m); err != nil || m[key] == nil {
		t.Fatalf("no %q in %s (%v)", key, obj, err)
	}
	return m[key]
}

func TestSGLangModelInfo(t *testing.T) {
	resp, body := do(t, newServer(t, Instance{Name: "gpu-e", Model: "m", Engine: EngineSGLang}), "GET", "/get_model_info", nil)
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q", ct)
	}
	want := `{"model_path":"m","tokenizer_path":"m","is_generation":true,"preferred_sampling_params":null,"weight_version":"default"}`
	if got := string(bytes.TrimSpace(body)); got != want {
		t.Errorf("/get_model_info\n got %s\nwant %s", got, want)
	}
}

// /get_server_info carries what routers read: dp_size (sgl-router makes a
// worker per rank), max_total_num_tokens (the KV pool), the internal states.
func TestSGLangServerInfo(t *testing.T) {
	for _, tt := range []struct {
		name     string
		in       Instance
		capacity int
	}{
		{"GPU", Instance{}, 100_000 / BlockSize * BlockSize},
		{"Fixed", Instance{Name: "gpu-e", Engine: EngineSGLang, Model: "m"}, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			in := tt.in
			if tt.name == "GPU" {
				g, err := NewGPU(GPUConfig{Profile: ProfileA100(), Cache: CacheConfig{CapacityTokens: 100_000}})
				if err != nil {
					t.Fatal(err)
				}
				in = Instance{Name: "gpu-e", Engine: EngineSGLang, Model: "m", LatencyModel: g}
			}
			resp, body := do(t, newServer(t, in), "GET", "/get_server_info", nil)
			if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "application/json" {
				t.Fatalf("%d %q", resp.StatusCode, resp.Header.Get("Content-Type"))
			}
			var info sglangServerInfo
			strictDecode(t, body, &info)
			if info.DPSize != 1 || info.TPSize != 1 || info.ModelPath != "m" || info.ServedModelName != "m" ||
				info.MaxTotalNumTokens != tt.capacity || info.Version != SGLangVersion || info.Status != "ready" ||
				len(info.InternalStates) != 1 || info.InternalStates[0].MemoryUsage.TokenCapacity != tt.capacity ||
				info.MaxReqInputLen < 1 || info.MaxReqInputLen > MaxModelLen-1 || info.PageSize != BlockSize {
				t.Errorf("/get_server_info %+v", info)
			}
			for _, key := range []string{"dp_size", "max_total_num_tokens", "internal_states", "version", "model_path"} {
				mustField(t, body, key)
			}
		})
	}
}

// vllm:cache_config_info: the KV cache's configuration in its labels, with
// num_gpu_blocks the capacity in 16-token blocks, value 1.
func TestVLLMCacheConfigInfo(t *testing.T) {
	g, err := NewGPU(GPUConfig{Profile: ProfileA100(), Cache: CacheConfig{CapacityTokens: 100_000}})
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name   string
		in     Instance
		blocks string
	}{
		{"GPU", Instance{Name: "gpu-e", LatencyModel: g}, "6250"},
		{"Fixed", Instance{Name: "gpu-e"}, "None"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, body := do(t, newServer(t, tt.in), "GET", "/metrics", nil)
			want := `vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",` +
				`enable_prefix_caching="` + map[string]string{"GPU": "True", "Fixed": "False"}[tt.name] + `",engine="0",gpu_memory_utilization="0.9",` +
				`is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="` + tt.blocks + `",num_gpu_blocks_override="None",` +
				`prefix_caching_hash_algo="sha256",sliding_window="None",swap_space="4"} 1` + "\n"
			if !strings.Contains(string(body), "# TYPE vllm:cache_config_info gauge\n"+want) {
				t.Errorf("no\n%s\nin\n%s", want, body)
			}
		})
	}
	_, body := do(t, newServer(t, Instance{Name: "gpu-e", Engine: EngineSGLang}), "GET", "/metrics", nil)
	if strings.Contains(string(body), "cache_config_info") {
		t.Error("SGLang's /metrics has vLLM's cache_config_info")
	}
}
