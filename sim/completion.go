package sim

import (
	"crypto/rand"
	"encoding/json"
	"net/http"
	"strings"
	"time"
)

const (
	pathChat        = "/v1/chat/completions"
	pathCompletions = "/v1/completions"

	finishStop   = "stop"
	finishLength = "length"
)

// chatCompletions answers POST /v1/chat/completions.
func (h *handler) chatCompletions(w http.ResponseWriter, r *http.Request) {
	var req chatRequest
	if !readJSON(w, r, &req) {
		return
	}
	j, e := req.job()
	if e != nil {
		writeError(w, http.StatusBadRequest, e.message, e.param, e.code)
		return
	}
	out, ok := h.work(r, j)
	if !ok {
		return
	}
	if j.stream {
		h.streamChat(w, r, j, out)
		return
	}
	writeJSON(w, http.StatusOK, chatCompletion{
		ID:                out.id,
		Object:            "chat.completion",
		Created:           out.created,
		Model:             j.model,
		SystemFingerprint: h.name,
		Choices: []chatChoice{{
			Index:        0,
			Message:      chatReply{Role: "assistant", Content: out.text()},
			FinishReason: out.finish,
		}},
		Usage: out.usage,
	})
}

// completions answers POST /v1/completions: one choice per prompt.
func (h *handler) completions(w http.ResponseWriter, r *http.Request) {
	var req completionRequest
	if !readJSON(w, r, &req) {
		return
	}
	j, e := req.job()
	if e != nil {
		writeError(w, http.StatusBadRequest, e.message, e.param, e.code)
		return
	}
	out, ok := h.work(r, j)
	if !ok {
		return
	}
	if j.stream {
		h.streamCompletion(w, r, j, out)
		return
	}
	choices := make([]completionChoice, len(j.prompts))
	for i := range choices {
		choices[i] = completionChoice{Text: out.text(), Index: i, FinishReason: &out.finish}
	}
	u := out.usage
	writeJSON(w, http.StatusOK, textCompletion{
		ID:                out.id,
		Object:            "text_completion",
		Created:           out.created,
		Model:             j.model,
		SystemFingerprint: h.name,
		Choices:           choices,
		Usage:             &u,
	})
}

// output is what the instance generated for a job: the same words for every
// choice.
type output struct {
	id      string
	created int64
	words   []string // "served", "by", name; cut at max_tokens
	finish  string
	usage   usage
}

func (o output) text() string { return strings.Join(o.words, " ") }

// pieces are the streamed deltas; concatenated they give text().
func (o output) pieces() []string {
	p := make([]string, len(o.words))
	for i, w := range o.words {
		if i > 0 {
			w = " " + w
		}
		p[i] = w
	}
	return p
}

// work generates the answer to j, asks the latency model what it costs and
// waits that long. It returns false when the request was cancelled during the
// wait; nothing has been written then.
func (h *handler) work(r *http.Request, j job) (output, bool) {
	words := strings.Fields("served by " + h.name)
	finish := finishStop
	if len(words) > j.maxTokens {
		words, finish = words[:j.maxTokens], finishLength
	}
	completion := len(words) * len(j.prompts) // CountTokens of each choice's text

	cost := h.latency.Cost(Request{
		Instance:         h.name,
		Endpoint:         j.endpoint,
		Model:            j.model,
		Prompt:           j.prompt(),
		PromptTokens:     j.promptTokens,
		CompletionTokens: completion,
		Stream:           j.stream,
	})
	if err := wait(r.Context(), cost.Wait); err != nil {
		return output{}, false
	}
	prefix := "chatcmpl-"
	if j.endpoint == pathCompletions {
		prefix = "cmpl-"
	}
	return output{
		id:      prefix + rand.Text(),
		created: time.Now().Unix(),
		words:   words,
		finish:  finish,
		usage: usage{
			PromptTokens:        j.promptTokens,
			CompletionTokens:    completion,
			TotalTokens:         j.promptTokens + completion,
			PromptTokensDetails: promptTokensDetails{CachedTokens: min(max(cost.CachedTokens, 0), j.promptTokens)},
		},
	}, true
}

// streamChat answers a chat job as Server-Sent Events the way the OpenAI API
// does: a first chunk with the role, one chunk per word, a chunk with the
// finish reason, with include_usage a chunk with no choices and the usage,
// then "data: [DONE]".
func (h *handler) streamChat(w http.ResponseWriter, r *http.Request, j job, out output) {
	chunk := func(choices []chatChunkChoice, u *usage) chatChunk {
		return chatChunk{
			ID:                out.id,
			Object:            "chat.completion.chunk",
			Created:           out.created,
			Model:             j.model,
			SystemFingerprint: h.name,
			Choices:           choices,
			Usage:             u,
		}
	}
	delta := func(d chatDelta, finish *string) []chatChunkChoice {
		return []chatChunkChoice{{Index: 0, Delta: d, FinishReason: finish}}
	}
	s := startSSE(w, r)
	empty := ""
	s.event(chunk(delta(chatDelta{Role: "assistant", Content: &empty}, nil), nil))
	for _, p := range out.pieces() {
		s.event(chunk(delta(chatDelta{Content: &p}, nil), nil))
	}
	s.event(chunk(delta(chatDelta{}, &out.finish), nil))
	if j.includeUsage {
		s.event(chunk([]chatChunkChoice{}, &out.usage))
	}
	s.done()
}

// streamCompletion answers a completions job as Server-Sent Events: one
// text_completion chunk per word and prompt, a chunk per prompt with the
// finish reason, with include_usage a chunk with no choices and the usage,
// then "data: [DONE]".
func (h *handler) streamCompletion(w http.ResponseWriter, r *http.Request, j job, out output) {
	chunk := func(choices []completionChoice, u *usage) textCompletion {
		return textCompletion{
			ID:                out.id,
			Object:            "text_completion",
			Created:           out.created,
			Model:             j.model,
			SystemFingerprint: h.name,
			Choices:           choices,
			Usage:             u,
		}
	}
	s := startSSE(w, r)
	for _, p := range out.pieces() {
		for i := range j.prompts {
			s.event(chunk([]completionChoice{{Text: p, Index: i}}, nil))
		}
	}
	for i := range j.prompts {
		s.event(chunk([]completionChoice{{Text: "", Index: i, FinishReason: &out.finish}}, nil))
	}
	if j.includeUsage {
		s.event(chunk([]completionChoice{}, &out.usage))
	}
	s.done()
}

// sse writes Server-Sent Events and flushes each one. After the first failed
// write, or once the request is cancelled, it writes nothing more.
type sse struct {
	w   http.ResponseWriter
	r   *http.Request
	rc  *http.ResponseController
	err error
}

func startSSE(w http.ResponseWriter, r *http.Request) *sse {
	hd := w.Header()
	hd.Set("Content-Type", "text/event-stream; charset=utf-8")
	hd.Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	return &sse{w: w, r: r, rc: http.NewResponseController(w)}
}

func (s *sse) event(v any) {
	if s.err != nil {
		return
	}
	data, err := json.Marshal(v)
	if err != nil {
		s.err = err
		return
	}
	s.write(data)
}

func (s *sse) done() { s.write([]byte("[DONE]")) }

func (s *sse) write(data []byte) {
	if s.err != nil {
		return
	}
	if s.err = s.r.Context().Err(); s.err != nil {
		return
	}
	buf := make([]byte, 0, len(data)+8)
	buf = append(buf, "data: "...)
	buf = append(buf, data...)
	buf = append(buf, "\n\n"...)
	if _, s.err = s.w.Write(buf); s.err != nil {
		return
	}
	// A writer that cannot flush (some test recorders) still gets the events.
	_ = s.rc.Flush()
}
