package sim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/rs/zerolog"
)

// handler is one emulated instance. It holds no mutable state: every request
// is independent, so one handler serves any number of connections.
type handler struct {
	name    string
	latency LatencyModel
	log     zerolog.Logger
	routes  map[string]route
}

type route struct {
	method string // GET routes also answer HEAD
	serve  http.HandlerFunc
}

func (rt route) allows(method string) bool {
	return method == rt.method || (rt.method == http.MethodGet && method == http.MethodHead)
}

func (rt route) allowHeader() string {
	if rt.method == http.MethodGet {
		return "GET, HEAD"
	}
	return rt.method
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

	rt, ok := h.routes[r.URL.Path]
	switch {
	case !ok:
		writeError(sw, http.StatusNotFound, fmt.Sprintf("Invalid URL (%s %s)", r.Method, r.URL.Path), "", "unknown_url")
	case !rt.allows(r.Method):
		sw.Header().Set("Allow", rt.allowHeader())
		writeError(sw, http.StatusMethodNotAllowed,
			fmt.Sprintf("Method %s is not allowed for %s; use %s", r.Method, r.URL.Path, rt.allowHeader()), "", "method_not_allowed")
	default:
		rt.serve(sw, r)
	}
}

// models answers GET /v1/models.
func (h *handler) models(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, modelList{
		Object: "list",
		Data:   []model{{ID: DefaultModel, Object: "model", Created: 0, OwnedBy: "tether"}},
	})
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
