// Package sim emulates the GPU instances tether routes to: small
// OpenAI-compatible HTTP servers that answer chat and text completions after a
// configurable latency and say, in the generated text, in the
// system_fingerprint and in the x-instance header, which instance served the
// request. The local stack, the e2e tests and the benchmarks run them in place
// of real model servers.
//
// sim belongs to no part of the data path and imports none of it.
package sim

import (
	"fmt"
	"net/http"
	"time"

	"github.com/rs/zerolog"
)

const (
	// DefaultLatency is the time an instance works on a request when
	// Instance.Latency is zero.
	DefaultLatency = 2 * time.Millisecond

	// DefaultModel is the model id listed by GET /v1/models and echoed in
	// answers to requests that name no model.
	DefaultModel = "tether-sim"

	// MaxBodyBytes bounds a request body; a larger body is answered 413.
	MaxBodyBytes = 8 << 20

	// MaxTokensLimit caps max_tokens and max_completion_tokens: larger values
	// are lowered to it, and it is the limit of a request that sets neither.
	MaxTokensLimit = 4096

	// InstanceHeader is the response header that names the instance on every
	// answer, errors included.
	InstanceHeader = "x-instance"

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
	// Latency. It is the plug for the KV-cache cost model.
	LatencyModel LatencyModel

	// Logger receives one debug line per request. The zero value discards.
	Logger zerolog.Logger
}

// Validate reports the first problem with the configuration.
func (in Instance) Validate() error {
	if in.Name == "" {
		return fmt.Errorf("sim: instance name is empty")
	}
	if len(in.Name) > maxNameLen {
		return fmt.Errorf("sim: instance name %q… is %d bytes, more than %d", in.Name[:32], len(in.Name), maxNameLen)
	}
	for i := 0; i < len(in.Name); i++ {
		if c := in.Name[i]; c <= ' ' || c > '~' {
			return fmt.Errorf("sim: instance name %q: byte %d (%#x) is not visible ASCII", in.Name, i, c)
		}
	}
	if in.Latency < 0 {
		return fmt.Errorf("sim: instance %q: latency %v is negative", in.Name, in.Latency)
	}
	if in.Latency != 0 && in.LatencyModel != nil {
		return fmt.Errorf("sim: instance %q: set either latency (%v) or a latency model, not both", in.Name, in.Latency)
	}
	return nil
}

// NewHandler returns the HTTP handler of one emulated instance. It serves
//
//	POST /v1/chat/completions
//	POST /v1/completions
//	GET  /v1/models
//	GET  /healthz
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
	h := &handler{
		name:    in.Name,
		latency: lm,
		log:     in.Logger,
	}
	h.routes = map[string]route{
		"/v1/chat/completions": {method: http.MethodPost, serve: h.chatCompletions},
		"/v1/completions":      {method: http.MethodPost, serve: h.completions},
		"/v1/models":           {method: http.MethodGet, serve: h.models},
		"/healthz":             {method: http.MethodGet, serve: h.healthz},
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
}

// Cost is a LatencyModel's verdict on one request.
type Cost struct {
	// Wait is how long the instance works before it answers (before the
	// first byte of a streamed answer). The wait ends early when the request
	// is cancelled.
	Wait time.Duration
	// CachedTokens is the number of prompt tokens served from the KV cache,
	// reported as usage.prompt_tokens_details.cached_tokens. It is clamped
	// to [0, PromptTokens].
	CachedTokens int
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
