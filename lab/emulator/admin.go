package emulator

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strings"
	"time"
)

const (
	adminPrefix = "/admin/"
	pathFaults  = "/admin/faults"
	pathStats   = "/admin/stats"
	pathReset   = "/admin/reset"

	// maxAdminBody bounds the body of an admin request.
	maxAdminBody = 64 << 10

	// MaxExtraLatency bounds Faults.ExtraLatency.
	MaxExtraLatency = 10 * time.Minute

	// DefaultErrorStatus is the status of injected errors when
	// Faults.ErrorStatus is not given.
	DefaultErrorStatus = http.StatusServiceUnavailable
)

// Faults are the failures an instance injects, set through its admin
// endpoint (POST /admin/faults takes this object as JSON; every field is
// optional and a missing one is off).
type Faults struct {
	// ErrorRate is the probability, from 0 to 1, that a valid completion
	// request is answered with ErrorStatus instead of a completion. The KV
	// cache does not see failed requests.
	ErrorRate float64 `json:"error_rate"`
	// ErrorStatus is the status of injected errors, 400 to 599; default 503.
	ErrorStatus int `json:"error_status"`
	// ExtraLatency is added before the first byte of every completion
	// answer, injected errors included. It is wall-clock time: the time
	// scale of the latency model does not apply. JSON: a Go duration
	// string such as "200ms"; at most MaxExtraLatency.
	ExtraLatency Duration `json:"extra_latency"`
	// Down answers 503 (code instance_down) to every request but the admin
	// ones, /healthz included, so health checks and Envoy's outlier
	// detection (consecutive 5xx) see the instance fail. Connections stay
	// open.
	Down bool `json:"down"`
}

// Duration is a time.Duration that reads and writes JSON as a Go duration
// string ("200ms").
type Duration struct{ time.Duration }

// MarshalJSON implements json.Marshaler.
func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(d.String()) }

// UnmarshalJSON implements json.Unmarshaler.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return durationError(fmt.Sprintf("expected a duration string such as \"200ms\", got JSON %s", b))
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return durationError(fmt.Sprintf("%q is not a duration such as \"200ms\" or \"1.5s\"", s))
	}
	d.Duration = v
	return nil
}

// durationError is a JSON value Duration cannot read.
type durationError string

func (e durationError) Error() string { return string(e) }

// Validate reports the first bad field, naming it.
func (f Faults) Validate() error {
	if math.IsNaN(f.ErrorRate) || f.ErrorRate < 0 || f.ErrorRate > 1 {
		return fieldError{"error_rate", fmt.Sprintf("%v is not a probability from 0 to 1", f.ErrorRate)}
	}
	if f.ErrorStatus < 400 || f.ErrorStatus > 599 {
		return fieldError{"error_status", fmt.Sprintf("%d is not an error status from 400 to 599", f.ErrorStatus)}
	}
	if d := f.ExtraLatency.Duration; d < 0 || d > MaxExtraLatency {
		return fieldError{"extra_latency", fmt.Sprintf("%v is outside 0s to %v", d, MaxExtraLatency)}
	}
	return nil
}

// fieldError is a bad field of an admin request.
type fieldError struct{ field, problem string }

func (e fieldError) Error() string { return fmt.Sprintf("invalid %s: %s", e.field, e.problem) }

// refusal is an admin request answered with an error: the status, the
// message (a sentence, as the OpenAI API writes them) and the field it
// names, if any.
type refusal struct {
	status         int
	message, param string
}

func badRequest(param, format string, args ...any) *refusal {
	return &refusal{status: http.StatusBadRequest, message: fmt.Sprintf(format, args...), param: param}
}

func noFaults() *Faults { return &Faults{ErrorStatus: DefaultErrorStatus} }

// getFaults answers GET /admin/faults with the faults in effect.
func (h *handler) getFaults(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, h.faults.Load())
}

// setFaults answers POST /admin/faults: the body replaces the faults.
func (h *handler) setFaults(w http.ResponseWriter, r *http.Request) {
	f, ref := readFaults(w, r)
	if ref != nil {
		writeError(w, ref.status, ref.message, ref.param, "invalid_faults")
		return
	}
	h.faults.Store(f)
	h.log.Info().Str("instance", h.name).Float64("error_rate", f.ErrorRate).Int("error_status", f.ErrorStatus).
		Dur("extra_latency", f.ExtraLatency.Duration).Bool("down", f.Down).Msg("faults set")
	writeJSON(w, http.StatusOK, f)
}

// clearFaults answers DELETE /admin/faults.
func (h *handler) clearFaults(w http.ResponseWriter, _ *http.Request) {
	f := noFaults()
	h.faults.Store(f)
	h.log.Info().Str("instance", h.name).Msg("faults cleared")
	writeJSON(w, http.StatusOK, f)
}

const faultsExample = `{"error_rate":0.5,"error_status":503,"extra_latency":"200ms","down":false}`

// readFaults decodes and checks a POST /admin/faults body: one JSON object
// of the Faults fields, nothing else.
func readFaults(w http.ResponseWriter, r *http.Request) (*Faults, *refusal) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxAdminBody))
	if err != nil {
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			return nil, &refusal{status: http.StatusRequestEntityTooLarge,
				message: fmt.Sprintf("The body exceeds the limit of %d bytes.", maxAdminBody)}
		}
		return nil, badRequest("", "Could not read the body: %v.", err)
	}
	trimmed := bytes.TrimSpace(body)
	if len(trimmed) == 0 || trimmed[0] != '{' {
		return nil, badRequest("", "The body must be a JSON object such as %s.", faultsExample)
	}
	f := noFaults()
	dec := json.NewDecoder(bytes.NewReader(trimmed))
	dec.DisallowUnknownFields()
	if err := dec.Decode(f); err != nil {
		return nil, faultsJSONError(err)
	}
	if dec.More() {
		return nil, badRequest("", "The body must hold one JSON object and nothing after it.")
	}
	if err := f.Validate(); err != nil {
		if fe, ok := errors.AsType[fieldError](err); ok {
			return nil, badRequest(fe.field, "Invalid '%s': %s.", fe.field, fe.problem)
		}
		return nil, badRequest("", "%v", err)
	}
	return f, nil
}

// faultsJSONError turns a decoding error into a refusal naming the field.
func faultsJSONError(err error) *refusal {
	field, problem := "", ""
	if ute, ok := errors.AsType[*json.UnmarshalTypeError](err); ok && ute.Field != "" {
		field, problem = ute.Field, fmt.Sprintf("expected %s, got JSON %s", ute.Type, ute.Value)
	} else if de, ok := errors.AsType[durationError](err); ok {
		field, problem = "extra_latency", string(de) // the only Duration of Faults
	} else if name, ok := strings.CutPrefix(err.Error(), "json: unknown field "); ok {
		field, problem = strings.Trim(name, `"`), "unknown field; the fields are error_rate, error_status, extra_latency and down"
	} else {
		return badRequest("", "The body is not valid JSON: %v.", err)
	}
	return badRequest(field, "Invalid '%s': %s.", field, problem)
}

// Stats is the answer of GET /admin/stats. Token and request counts start
// at zero when the instance starts and after POST /admin/reset.
type Stats struct {
	Instance string `json:"instance"`
	// Requests counts valid completion requests, injected errors included.
	Requests       int64 `json:"requests"`
	InjectedErrors int64 `json:"injected_errors"`
	// Cancelled counts requests whose client left before the answer ended.
	Cancelled int64 `json:"cancelled"`
	// InFlight is the number of completion requests being worked on now.
	InFlight int64 `json:"in_flight"`
	// PromptTokens, CachedTokens and CompletionTokens add up the usage of
	// every request the latency model priced.
	PromptTokens     int64 `json:"prompt_tokens"`
	CachedTokens     int64 `json:"cached_tokens"`
	CompletionTokens int64 `json:"completion_tokens"`
	// PrefixCacheQueries and PrefixCacheHits are the prefix cache's
	// counters, in tokens, that GET /metrics serves
	// (vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total;
	// SGLang's sglang:cached_tokens_total is the hits): the prompt tokens
	// looked up and those served from the cache. Both stay 0 with a model
	// without cache (Fixed).
	PrefixCacheQueries int64 `json:"prefix_cache_queries"`
	PrefixCacheHits    int64 `json:"prefix_cache_hits"`
	// Preemptions is the model's count of running requests whose blocks
	// the cache freed (vllm:num_preemptions_total); 0 with Fixed.
	Preemptions int64 `json:"preemptions"`
	// MetricsScrapes counts the GET /metrics answers served.
	MetricsScrapes int64 `json:"metrics_scrapes"`
	// Engine and ServedModel are the engine whose metrics GET /metrics
	// serves and the model name the instance serves.
	Engine      string `json:"engine"`
	ServedModel string `json:"served_model"`
	Faults      Faults `json:"faults"`
	// Model is the latency model's state (profile, KV cache, GPU time),
	// absent for models without state such as Fixed.
	Model *ModelStats `json:"model,omitempty"`
}

// stats gathers GET /admin/stats.
func (h *handler) stats() Stats {
	c := &h.counters
	s := Stats{
		Instance:         h.name,
		Requests:         c.requests.Load(),
		InjectedErrors:   c.injectedErrors.Load(),
		Cancelled:        c.cancelled.Load(),
		InFlight:         h.inFlight.Load(),
		PromptTokens:     c.promptTokens.Load(),
		CachedTokens:     c.cachedTokens.Load(),
		CompletionTokens: c.completionTokens.Load(),

		PrefixCacheQueries: c.prefixQueries.Load(),
		PrefixCacheHits:    c.prefixHits.Load(),
		MetricsScrapes:     c.scrapes.Load(),
		Engine:             h.engine,
		ServedModel:        h.model,
		Faults:             *h.faults.Load(),
	}
	if h.engineModel != nil {
		s.Preemptions = h.engineModel.EngineState(h.now()).Preemptions
	}
	if m, ok := h.latency.(StatefulModel); ok {
		ms := m.Stats()
		s.Model = &ms
	}
	return s
}

// getStats answers GET /admin/stats.
func (h *handler) getStats(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, h.stats())
}

// reset answers POST /admin/reset: it zeroes the counters (those of GET
// /metrics too, as a restarted engine's) and empties the latency model's
// state (the KV cache), as benchmarks need between runs.
// Faults stay as they are; requests in flight finish normally.
func (h *handler) reset(w http.ResponseWriter, _ *http.Request) {
	h.counters.reset()
	h.metrics.ttft.reset()
	h.metrics.e2e.reset()
	if m, ok := h.latency.(StatefulModel); ok {
		m.Reset()
	}
	h.log.Info().Str("instance", h.name).Msg("stats and cache reset")
	writeJSON(w, http.StatusOK, h.stats())
}
