package emulator

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"net/http"
)

// The paths and answers of an engine's own HTTP server besides the
// completions and /metrics: what a router probes before it registers an
// instance (health, version, the model, the server's configuration). Their
// shapes are the engines' own, read in their sources:
//
//   - vLLM: GET /health and GET /version
//     (vllm/entrypoints/serve/instrumentator/health.py and basic.py; in
//     releases before that split, vllm/entrypoints/openai/api_server.py),
//     GET /v1/models (the ModelCard and ModelPermission of
//     vllm/entrypoints/openai/protocol.py, filled by serving_models.py).
//   - SGLang: GET /health, GET /health_generate, GET /get_model_info,
//     GET /get_server_info and GET /v1/models
//     (python/sglang/srt/entrypoints/http_server.py, the ModelCard of
//     python/sglang/srt/entrypoints/openai/protocol.py).
//
// Each engine answers only its own paths: vLLM has no /health_generate,
// /get_model_info or /get_server_info, SGLang no /version, and the other
// engine's paths are answered 404, as the real servers do.

const (
	// VLLMVersion is what GET /version says of an instance in vLLM mode
	// (vllm.version.__version__ in a real one). The local part names the
	// emulator; the release is one whose /metrics the emulator imitates.
	VLLMVersion = "0.11.0+emulator"
	// SGLangVersion is the version GET /get_server_info reports in SGLang
	// mode.
	SGLangVersion = "0.5.4+emulator"

	// MaxModelLen is the context length, in tokens, the emulated model
	// announces (/v1/models' max_model_len, SGLang's context_length): that
	// of the 8B Llama whose shape the calibration measured. The emulator
	// does not enforce it.
	MaxModelLen = 131072
)

// engineRoutes are the paths only the instance's engine serves.
func (h *handler) engineRoutes() map[string]route {
	if h.engine == EngineSGLang {
		return map[string]route{
			"/health":          {http.MethodGet: h.health},
			"/health_generate": {http.MethodGet: h.health},
			"/get_model_info":  {http.MethodGet: h.sglangModelInfo},
			"/get_server_info": {http.MethodGet: h.sglangServerInfo},
		}
	}
	return map[string]route{
		"/health":  {http.MethodGet: h.health},
		"/version": {http.MethodGet: h.vllmVersion},
	}
}

// health answers GET /health (and SGLang's /health_generate): 200 with an
// empty body and no Content-Type, as both engines answer once they serve.
// An instance made down (POST /admin/faults) answers 503 before it gets
// here, as an engine that died does.
func (h *handler) health(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Length", "0")
	w.WriteHeader(http.StatusOK)
}

// vllmVersion answers vLLM's GET /version: {"version": "<release>"}.
func (h *handler) vllmVersion(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, struct {
		Version string `json:"version"`
	}{VLLMVersion})
}

// models answers GET /v1/models: the served model, in the engine's model
// card. vLLM's names its model path as root (the emulator has none but the
// served name), no parent (a LoRA adapter's would be its base model), the
// context length and one permission record; SGLang's names root and the
// context length only. created is the time of the answer, as in both.
func (h *handler) models(w http.ResponseWriter, _ *http.Request) {
	card := model{
		ID:          h.model,
		Object:      "model",
		Created:     h.now().Unix(),
		OwnedBy:     h.engine,
		Root:        h.model,
		MaxModelLen: MaxModelLen,
	}
	if h.engine == EngineVLLM {
		card.Parent = json.RawMessage("null")
		card.Permission = []modelPermission{{
			ID:                 h.permissionID,
			Object:             "model_permission",
			Created:            card.Created,
			AllowCreateEngine:  false,
			AllowSampling:      true,
			AllowLogprobs:      true,
			AllowSearchIndices: false,
			AllowView:          true,
			AllowFineTuning:    false,
			Organization:       "*",
			Group:              nil,
			IsBlocking:         false,
		}}
	}
	writeJSON(w, http.StatusOK, modelList{Object: "list", Data: []model{card}})
}

// permissionIDOf is the id of the instance's model permission: vLLM draws
// "modelperm-" and a random UUID's 32 hex digits on every answer; the
// emulator derives the digits from the instance's name, so that its answers
// are reproducible.
func permissionIDOf(name string) string {
	sum := sha256.Sum256([]byte("modelperm/" + name))
	return "modelperm-" + hex.EncodeToString(sum[:16])
}

// sglangModelInfo answers SGLang's GET /get_model_info. The emulator has no
// model path apart from the served name, and serves text generation.
func (h *handler) sglangModelInfo(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, sglangModelInfo{
		ModelPath:     h.model,
		TokenizerPath: h.model,
		IsGeneration:  true,
		WeightVersion: "default",
	})
}

// sglangServerInfo answers SGLang's GET /get_server_info: one flat object
// of the server arguments, the scheduler's start-up info
// (max_total_num_tokens, max_req_input_len), the internal state of each dp
// rank and the version. A real server writes every argument of its
// ServerArgs; the emulator writes those a router reads (sgl-router reads
// dp_size to make one worker per rank) and those that describe its cache.
func (h *handler) sglangServerInfo(w http.ResponseWriter, _ *http.Request) {
	capacity := 0
	if h.engineModel != nil {
		capacity = h.engineModel.EngineState(h.now()).CapacityTokens
	}
	maxInput := MaxModelLen - 1
	if capacity > 0 {
		maxInput = min(maxInput, capacity-1)
	}
	writeJSON(w, http.StatusOK, sglangServerInfo{
		ModelPath:          h.model,
		TokenizerPath:      h.model,
		ServedModelName:    h.model,
		TPSize:             1,
		DPSize:             1,
		PPSize:             1,
		PageSize:           BlockSize,
		ContextLength:      nil,
		MaxRunningRequests: nullableInt(h.maxRunning),
		SchedulePolicy:     "fcfs",
		DisableRadixCache:  h.engineModel == nil,
		EnableMetrics:      true,
		DisaggregationMode: "null",
		WeightVersion:      "default",
		Status:             "ready",
		MaxTotalNumTokens:  capacity,
		MaxReqInputLen:     maxInput,
		InternalStates: []sglangInternalState{{
			LastGenThroughput: 0,
			MemoryUsage:       sglangMemoryUsage{KVCacheGB: kvCacheGB(capacity), TokenCapacity: capacity},
		}},
		Version: SGLangVersion,
	})
}

// kvCacheGB is the memory of a KV cache of n tokens in GB, at 128 KiB per
// token (the emulated model's, see README), rounded as SGLang rounds it.
func kvCacheGB(n int) float64 {
	gb := float64(n) * 128 * 1024 / (1 << 30)
	return float64(int64(gb*100+0.5)) / 100
}

func nullableInt(n int) *int {
	if n <= 0 {
		return nil
	}
	return &n
}
