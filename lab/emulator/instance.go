// Package emulator emulates the GPU instances tether routes to: small
// OpenAI-compatible HTTP servers that answer chat and text completions and
// say, in the generated text, in the system_fingerprint and in the x-instance
// header, which instance served the request. The local stack, the e2e tests
// and the benchmarks run them in place of real model servers.
//
// How long an instance works on a request is the business of its
// LatencyModel: Fixed waits the same time for every request; GPU keeps a
// prefix KV cache (KVCache) and prices prefill, decode and queueing by the
// figures measured on an H200 (ProfileH200) or derived from them for an A100
// (ProfileA100, an estimate). Each instance serves its engine's metrics on
// GET /metrics, as vLLM or SGLang name them (Instance.Engine), takes fault
// injection and reports its counters through /admin/ endpoints.
//
// The emulator belongs to no part of the data path and imports none of it.
package emulator

import (
	crand "crypto/rand"
	"fmt"
	"math/rand/v2"
	"net/http"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/rs/zerolog"
)

const (
	// DefaultLatency is the time an instance works on a request when
	// Instance.Latency is zero.
	DefaultLatency = 2 * time.Millisecond

	// DefaultModel is the served model name of an instance that sets no
	// Instance.Model: the id GET /v1/models lists, the model_name label of
	// its metrics, and the model of answers to requests that name none.
	DefaultModel = "tether-sim"

	// EngineVLLM names the engine whose metrics an instance serves on GET
	// /metrics (Instance.Engine) with vLLM's V1 names (vllm:…).
	EngineVLLM = "vllm"
	// EngineSGLang names SGLang's (sglang:…).
	EngineSGLang = "sglang"

	// maxModelLen bounds a served model name (Instance.Model).
	maxModelLen = 1024

	// MaxBodyBytes bounds a request body; a larger body is answered 413.
	MaxBodyBytes = 8 << 20

	// MaxTokensLimit caps max_tokens and max_completion_tokens: larger values
	// are lowered to it, and it is the limit of a request that sets neither.
	MaxTokensLimit = 4096

	// InstanceHeader is the response header that names the instance on every
	// answer, errors included.
	InstanceHeader = "x-instance"

	// CachedTokensHeader is the response header of a completion answer that
	// gives the prompt tokens served from the KV cache (the same number as
	// usage.prompt_tokens_details.cached_tokens).
	CachedTokensHeader = "x-kv-cached-tokens"

	// QueueDepthHeader is the response header of a completion answer that
	// gives the number of completion requests the instance was already
	// working on when the request arrived. Emulator-only: sent only with
	// Instance.ReportHeaders (real engines report load on GET /metrics).
	QueueDepthHeader = "x-queue-depth"

	// GPUUtilizationHeader is the response header of a completion answer
	// that gives, in percent, how busy the emulated GPU was over the
	// second before the request arrived (Utilizer; only models that
	// implement it). Emulator-only: sent only with Instance.ReportHeaders.
	GPUUtilizationHeader = "x-gpu-utilization"

	// SessionHeader is the request header whose value a latency model
	// receives as Request.Session: the KV cache counts conversations by it.
	SessionHeader = "x-session-id"

	// maxNameLen bounds an instance name (it travels in a response header).
	maxNameLen = 253
)

// Instance configures one emulated GPU instance.
type Instance struct {
	// Name identifies the instance in the x-instance header, the
	// system_fingerprint and the generated text. Required; visible ASCII
	// without spaces, at most 253 bytes.
	Name string

	// Latency is the fixed time the instance works on every completion
	// request before it answers. Zero means DefaultLatency; negative is an
	// error. Leave it zero when LatencyModel is set.
	Latency time.Duration

	// LatencyModel, when set, decides the work per request instead of
	// Latency: NewGPU gives the calibrated model with a KV cache. A model
	// that keeps state (StatefulModel) must serve one instance only.
	LatencyModel LatencyModel

	// Logger receives one debug line per request. The zero value discards.
	Logger zerolog.Logger

	// Now is the clock that stamps Request.Arrived and the created field
	// of answers. Nil means time.Now.
	Now func() time.Time

	// Rand is the random source of injected errors (POST /admin/faults).
	// Nil means a source seeded from crypto/rand. The handler serialises
	// its draws.
	Rand rand.Source

	// Model is the served model name: the id GET /v1/models lists, the
	// model_name label of GET /metrics, and the model of answers to
	// requests that name none (requests naming another model are served
	// too, and answered with the name they gave). Empty means
	// DefaultModel. tether's configuration calls it the instance's version.
	Model string

	// Engine is the engine whose metrics GET /metrics serves: EngineVLLM
	// (empty means it) or EngineSGLang.
	Engine string

	// ReportHeaders adds the emulator-only load headers to completion
	// answers: QueueDepthHeader, and GPUUtilizationHeader for models that
	// report it. Off by default, as real engines send neither.
	ReportHeaders bool

	// MaxRunning caps the batch of an instance without a latency model of
	// its own scheduler (Latency, Fixed), as vLLM's --max-num-seqs does:
	// past it, requests in flight count as waiting on GET /metrics. They
	// are not slowed down for it. 0: no cap, nothing waits.
	MaxRunning int
}

// Validate reports the first problem with the configuration.
func (in Instance) Validate() error {
	if in.Name == "" {
		return fmt.Errorf("emulator: instance name is empty")
	}
	if len(in.Name) > maxNameLen {
		return fmt.Errorf("emulator: instance name %q… is %d bytes, more than %d", in.Name[:32], len(in.Name), maxNameLen)
	}
	for i := 0; i < len(in.Name); i++ {
		if c := in.Name[i]; c <= ' ' || c > '~' {
			return fmt.Errorf("emulator: instance name %q: byte %d (%#x) is not visible ASCII", in.Name, i, c)
		}
	}
	if in.Latency < 0 {
		return fmt.Errorf("emulator: instance %q: latency %v is negative", in.Name, in.Latency)
	}
	if in.MaxRunning < 0 {
		return fmt.Errorf("emulator: instance %q: max running %d is negative", in.Name, in.MaxRunning)
	}
	if in.Latency != 0 && in.LatencyModel != nil {
		return fmt.Errorf("emulator: instance %q: set either latency (%v) or a latency model, not both", in.Name, in.Latency)
	}
	if err := validModel(in.Model); err != nil {
		return fmt.Errorf("emulator: instance %q: %w", in.Name, err)
	}
	switch in.Engine {
	case "", EngineVLLM, EngineSGLang:
	default:
		return fmt.Errorf("emulator: instance %q: engine %q: want %q or %q", in.Name, in.Engine, EngineVLLM, EngineSGLang)
	}
	return nil
}

// validModel checks a served model name: empty (DefaultModel), or UTF-8
// without control characters, at most maxModelLen bytes.
func validModel(m string) error {
	if len(m) > maxModelLen {
		return fmt.Errorf("model name of %d bytes: at most %d", len(m), maxModelLen)
	}
	if !utf8.ValidString(m) {
		return fmt.Errorf("model name %q is not valid UTF-8", m)
	}
	for _, r := range m {
		if unicode.IsControl(r) {
			return fmt.Errorf("model name %q holds a control character", m)
		}
	}
	return nil
}

// NewHandler returns the HTTP handler of one emulated instance. It serves
//
//	POST /v1/chat/completions
//	POST /v1/completions
//	GET  /v1/models (the engine's model card)
//	GET  /healthz (the emulator's own)
//	GET  /health
//	GET  /metrics (the engine's metrics, Prometheus text)
//	GET  /version (vLLM)
//	GET  /health_generate, /get_model_info, /get_server_info (SGLang)
//
// and answers anything else with an OpenAI-style error. See the package
// README for the details.
func NewHandler(in Instance) (http.Handler, error) {
	if err := in.Validate(); err != nil {
		return nil, err
	}
	lm := in.LatencyModel
	if lm == nil {
		d := in.Latency
		if d == 0 {
			d = DefaultLatency
		}
		lm = Fixed(d)
	}
	now := in.Now
	if now == nil {
		now = time.Now
	}
	src := in.Rand
	if src == nil {
		var seed [32]byte
		_, _ = crand.Read(seed[:]) // never fails (crypto/rand.Read)
		src = rand.NewChaCha8(seed)
	}
	served := in.Model
	if served == "" {
		served = DefaultModel
	}
	engine := in.Engine
	if engine == "" {
		engine = EngineVLLM
	}
	h := &handler{
		name:          in.Name,
		model:         served,
		engine:        engine,
		reportHeaders: in.ReportHeaders,
		maxRunning:    in.MaxRunning,
		latency:       lm,
		log:           in.Logger,
		now:           now,
		rnd:           rand.New(src),
		sleep:         wait,
		permissionID:  permissionIDOf(in.Name),
	}
	h.engineModel, _ = lm.(EngineReporter)
	h.faults.Store(noFaults())
	h.metrics = newEngineMetrics(h)
	h.routes = map[string]route{
		pathChat:        {http.MethodPost: h.chatCompletions},
		pathCompletions: {http.MethodPost: h.completions},
		"/v1/models":    {http.MethodGet: h.models},
		"/healthz":      {http.MethodGet: h.healthz},
		pathMetrics:     {http.MethodGet: h.serveMetrics},
		pathFaults:      {http.MethodGet: h.getFaults, http.MethodPost: h.setFaults, http.MethodDelete: h.clearFaults},
		pathStats:       {http.MethodGet: h.getStats},
		pathReset:       {http.MethodPost: h.reset},
	}
	for path, rt := range h.engineRoutes() {
		h.routes[path] = rt
	}
	return h, nil
}

// Request is what a LatencyModel learns about one valid completion request.
type Request struct {
	Instance string // name of the instance serving it
	Endpoint string // "/v1/chat/completions" or "/v1/completions"
	Model    string
	// Prompt is the text the prompt tokens were counted on: the message
	// contents (chat) or the prompts (completions), joined by "\n".
	Prompt           string
	PromptTokens     int
	CompletionTokens int // tokens the answer will carry, all choices together
	Stream           bool

	// Completion is the text of the answer (of one choice). A cache model
	// stores its blocks after the prompt's: the next turn of a
	// conversation carries it.
	Completion string
	// Session is the value of the x-session-id request header, or empty.
	Session string
	// Arrived is when the request arrived, by the instance's clock.
	Arrived time.Time
	// InFlight is the number of completion requests the instance was
	// already working on when this one arrived (what the x-queue-depth
	// header reports).
	InFlight int
}

// Cost is a LatencyModel's verdict on one request.
type Cost struct {
	// Wait is how long the instance works before it answers: before the
	// first byte of a streamed answer, which carries the first token. The
	// wait ends early when the request is cancelled.
	Wait time.Duration
	// Decode is how long the rest of the answer takes after Wait: a
	// streamed answer paces its remaining chunks evenly over it, a whole
	// answer is written after Wait+Decode.
	Decode time.Duration
	// CachedTokens is the number of prompt tokens served from the KV cache,
	// reported as usage.prompt_tokens_details.cached_tokens and in the
	// x-kv-cached-tokens header. It is clamped to [0, PromptTokens].
	CachedTokens int
	// Queued is the part of Wait spent waiting for other requests (for the
	// record; the handler waits Wait).
	Queued time.Duration
}

// LatencyModel decides how long an instance works on a request. Cost is
// called once per valid completion request, from concurrent goroutines.
type LatencyModel interface {
	Cost(r Request) Cost
}

// Fixed is the LatencyModel that waits the same time for every request and
// reports no cached tokens.
type Fixed time.Duration

// Cost implements LatencyModel.
func (f Fixed) Cost(Request) Cost { return Cost{Wait: time.Duration(f)} }

var _ LatencyModel = Fixed(0)
