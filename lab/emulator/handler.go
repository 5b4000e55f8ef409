package emulator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
)

// handler is one emulated instance. Requests are independent of each other
// except through the latency model (a KV cache), the fault settings and the
// counters, all safe for concurrent use.
type handler struct {
	name   string
	model  string // served model name (Instance.Model or DefaultModel)
	engine string // EngineVLLM or EngineSGLang: the names of GET /metrics, the engine's own paths (engineapi.go)
	// permissionID is the id of vLLM's model permission (permissionIDOf).
	permissionID string
	latency      LatencyModel
	// engineModel is latency when it reports a scheduler and a prefix
	// cache (GPU), else nil (Fixed): /metrics then knows only the
	// handler's own counts.
	engineModel EngineReporter
	// reportHeaders sends the emulator-only load headers
	// (Instance.ReportHeaders).
	reportHeaders bool
	// maxRunning caps the Fixed model's batch (Instance.MaxRunning).
	maxRunning int
	log        zerolog.Logger
	routes     map[string]route
	now        func() time.Time
	// sleep waits d or until ctx ends (wait); tests replace it to record
	// the waits instead.
	sleep func(ctx context.Context, d time.Duration) error

	rndMu sync.Mutex
	rnd   *rand.Rand

	faults   atomic.Pointer[Faults]
	inFlight atomic.Int64
	counters counters
	metrics  *engineMetrics
}

// counters are the handler's part of GET /admin/stats, and the counters
// GET /metrics serves.
type counters struct {
	requests, injectedErrors, cancelled          atomic.Int64
	promptTokens, cachedTokens, completionTokens atomic.Int64
	// prefixQueries and prefixHits count, in tokens, the prompts looked up
	// in the prefix cache and the part of them it served; both stay 0
	// with a model without cache (Fixed).
	prefixQueries, prefixHits atomic.Int64
	// finished counts the requests the engine finished, by reason
	// (finishStop, finishLength, finishAbort: the client left).
	finished [numFinishReasons]atomic.Int64
	// scrapes counts the GET /metrics answers served.
	scrapes atomic.Int64
	// lastHitRate is the float64 bits of the prefix cache hit rate of the
	// last prompt looked up (SGLang's sglang:cache_hit_rate).
	lastHitRate atomic.Uint64
}

func (c *counters) reset() {
	for _, v := range []*atomic.Int64{&c.requests, &c.injectedErrors, &c.cancelled, &c.promptTokens, &c.cachedTokens, &c.completionTokens,
		&c.prefixQueries, &c.prefixHits, &c.scrapes} {
		v.Store(0)
	}
	for i := range c.finished {
		c.finished[i].Store(0)
	}
	c.lastHitRate.Store(0)
}

// route maps the methods a path answers to their handlers; a GET handler
// also answers HEAD.
type route map[string]http.HandlerFunc

func (rt route) handler(method string) http.HandlerFunc {
	if method == http.MethodHead {
		method = http.MethodGet
	}
	return rt[method]
}

func (rt route) allowHeader() string {
	var allow []string
	for _, m := range []string{http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete} {
		if rt.handler(m) != nil {
			allow = append(allow, m)
		}
	}
	return strings.Join(allow, ", ")
}

func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	w.Header().Set(InstanceHeader, h.name)
	sw := &statusWriter{ResponseWriter: w}
	defer func() {
		h.log.Debug().
			Str("instance", h.name).
			Str("method", r.Method).
			Str("path", r.URL.Path).
			Int("status", sw.status).
			Dur("took", time.Since(start)).
			Bool("canceled", r.Context().Err() != nil).
			Msg("request")
	}()

	if h.faults.Load().Down && !strings.HasPrefix(r.URL.Path, adminPrefix) {
		writeError(sw, http.StatusServiceUnavailable,
			fmt.Sprintf("Instance %s is down (fault injected through %s).", h.name, pathFaults), "", "instance_down")
		return
	}
	rt, ok := h.routes[r.URL.Path]
	if !ok {
		writeError(sw, http.StatusNotFound, fmt.Sprintf("Invalid URL (%s %s)", r.Method, r.URL.Path), "", "unknown_url")
		return
	}
	serve := rt.handler(r.Method)
	if serve == nil {
		sw.Header().Set("Allow", rt.allowHeader())
		writeError(sw, http.StatusMethodNotAllowed,
			fmt.Sprintf("Method %s is not allowed for %s; use %s", r.Method, r.URL.Path, rt.allowHeader()), "", "method_not_allowed")
		return
	}
	serve(sw, r)
}

// healthz answers GET /healthz.
func (h *handler) healthz(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, health{Status: "ok", Instance: h.name})
}

// readJSON decodes the bounded request body into v. On failure it has already
// answered and returns false.
func readJSON(w http.ResponseWriter, r *http.Request, v any) bool {
	if r.ContentLength > MaxBodyBytes {
		writeError(w, http.StatusRequestEntityTooLarge, tooLargeMessage(), "", "request_too_large")
		return false
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxBodyBytes))
	if err != nil {
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			writeError(w, http.StatusRequestEntityTooLarge, tooLargeMessage(), "", "request_too_large")
			return false
		}
		writeError(w, http.StatusBadRequest, "Could not read the request body: "+err.Error(), "", "")
		return false
	}
	if err := json.Unmarshal(body, v); err != nil {
		msg := "We could not parse the JSON body of your request. Expected a JSON object: " + err.Error()
		param := ""
		if ute, ok := errors.AsType[*json.UnmarshalTypeError](err); ok && ute.Field != "" {
			param = ute.Field
			msg = fmt.Sprintf("Invalid type for '%s': expected %s, got JSON %s.", ute.Field, ute.Type, ute.Value)
		}
		writeError(w, http.StatusBadRequest, msg, param, "invalid_json")
		return false
	}
	return true
}

func tooLargeMessage() string {
	return fmt.Sprintf("Request body exceeds the limit of %d bytes (8 MiB).", MaxBodyBytes)
}

// wait blocks for d or until ctx ends, whichever comes first.
func wait(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// writeJSON is the one place that writes a JSON answer.
func writeJSON(w http.ResponseWriter, status int, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		// Only our own response types reach here; they always marshal.
		status = http.StatusInternalServerError
		body = []byte(`{"error":{"message":"internal error encoding the response","type":"server_error","param":null,"code":null}}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}

// writeError answers with an OpenAI-style error body. param and code are
// optional: empty encodes as null.
func writeError(w http.ResponseWriter, status int, message, param, code string) {
	typ := "invalid_request_error"
	if status >= 500 {
		typ = "server_error"
	}
	writeJSON(w, status, errorResponse{Error: apiError{
		Message: message,
		Type:    typ,
		Param:   nullable(param),
		Code:    nullable(code),
	}})
}

func nullable(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// statusWriter remembers the status for the request log. Unwrap lets
// http.ResponseController reach the underlying writer's Flush.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
