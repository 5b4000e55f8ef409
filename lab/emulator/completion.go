package emulator

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
)

const (
	pathChat        = "/v1/chat/completions"
	pathCompletions = "/v1/completions"

	finishStop   = "stop"
	finishLength = "length"
	finishAbort  = "abort" // the client left (vLLM's finished_reason)
)

// The indexes of counters.finished, in the order of finishReasons.
const (
	finishStopIndex = iota
	finishLengthIndex
	finishAbortIndex
	numFinishReasons
)

// finishReason is the finished_reason label value of
// vllm:request_success_total of counters.finished[i].
func finishReason(i int) string {
	switch i {
	case finishLengthIndex:
		return finishLength
	case finishAbortIndex:
		return finishAbort
	}
	return finishStop
}

func finishIndex(reason string) int {
	if reason == finishLength {
		return finishLengthIndex
	}
	return finishStopIndex
}

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
	h.serveJob(w, r, j)
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
	h.serveJob(w, r, j)
}

// serveJob answers a valid completion request: an injected error, or the
// answer after the work the latency model prices, the whole answer at once
// or streamed with its chunks paced over the decode time.
func (h *handler) serveJob(w http.ResponseWriter, r *http.Request, j job) {
	ctx := r.Context()
	if j.model == "" {
		j.model = h.model
	}
	f := h.faults.Load()
	h.counters.requests.Add(1)
	if f.ErrorRate > 0 && h.draw() < f.ErrorRate {
		h.counters.injectedErrors.Add(1)
		if h.sleep(ctx, f.ExtraLatency.Duration) != nil {
			h.counters.cancelled.Add(1)
			return
		}
		writeError(w, f.ErrorStatus, fmt.Sprintf("Injected fault: instance %s fails %g%% of its requests with status %d.",
			h.name, f.ErrorRate*100, f.ErrorStatus), "", "injected_fault")
		return
	}

	depth := int(h.inFlight.Add(1) - 1)
	defer h.inFlight.Add(-1)
	if u, ok := h.latency.(Utilizer); ok && h.reportHeaders { // before this request's own work
		w.Header().Set(GPUUtilizationHeader, strconv.FormatFloat(100*u.Utilization(h.now()), 'f', 1, 64))
	}
	out, cost := h.work(r, j, depth)
	w.Header().Set(CachedTokensHeader, strconv.Itoa(out.usage.PromptTokensDetails.CachedTokens))
	if h.reportHeaders {
		w.Header().Set(QueueDepthHeader, strconv.Itoa(depth))
	}

	ttft := f.ExtraLatency.Duration + cost.Wait
	first := ttft
	if !j.stream {
		first += cost.Decode
	}
	if h.sleep(ctx, first) != nil {
		h.abort()
		return
	}
	out.created = h.now().Unix()
	switch {
	case j.stream && j.endpoint == pathChat:
		h.streamChat(w, r, j, out, cost.Decode)
	case j.stream:
		h.streamCompletion(w, r, j, out, cost.Decode)
	case j.endpoint == pathChat:
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
	default:
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
	if ctx.Err() != nil {
		h.abort() // the client left during a paced stream
		return
	}
	h.finish(out.finish, ttft, ttft+cost.Decode)
}

// abort records a request whose client left before its answer ended: the
// engine aborts it (vLLM's finished_reason "abort").
func (h *handler) abort() {
	h.counters.cancelled.Add(1)
	h.counters.finished[finishAbortIndex].Add(1)
}

// finish records a request answered in full, with its modelled time to
// first token and end-to-end latency.
func (h *handler) finish(reason string, ttft, e2e time.Duration) {
	h.counters.finished[finishIndex(reason)].Add(1)
	h.metrics.ttft.observe(ttft.Seconds())
	h.metrics.e2e.observe(e2e.Seconds())
}

// draw returns a uniform number in [0, 1) from the injected source.
func (h *handler) draw() float64 {
	h.rndMu.Lock()
	defer h.rndMu.Unlock()
	return h.rnd.Float64()
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

// answerWords is the generated text as words: "served by <name>", cut at
// maxTokens; with ignoreEOS repeated until it is exactly maxTokens long.
func answerWords(name string, maxTokens int, ignoreEOS bool) ([]string, string) {
	words := strings.Fields("served by " + name)
	if ignoreEOS {
		for len(words) < maxTokens {
			words = append(words, words[len(words)%3])
		}
	}
	if len(words) >= maxTokens && (ignoreEOS || len(words) > maxTokens) {
		return words[:maxTokens], finishLength
	}
	return words, finishStop
}

// work generates the answer to j and asks the latency model what it costs.
// depth is the number of completion requests in flight before this one.
func (h *handler) work(r *http.Request, j job, depth int) (output, Cost) {
	words, finish := answerWords(h.name, j.maxTokens, j.ignoreEOS)
	completion := len(words) * len(j.prompts) // CountTokens of each choice's text

	cost := h.latency.Cost(Request{
		Instance:         h.name,
		Endpoint:         j.endpoint,
		Model:            j.model,
		Prompt:           j.prompt(),
		PromptTokens:     j.promptTokens,
		CompletionTokens: completion,
		Stream:           j.stream,
		Completion:       strings.Join(words, " "),
		Session:          r.Header.Get(SessionHeader),
		Arrived:          h.now(),
		InFlight:         depth,
	})
	cached := min(max(cost.CachedTokens, 0), j.promptTokens)
	h.counters.promptTokens.Add(int64(j.promptTokens))
	h.counters.cachedTokens.Add(int64(cached))
	h.counters.completionTokens.Add(int64(completion))
	if h.engineModel != nil { // a model with a prefix cache looked the prompt up
		h.counters.prefixQueries.Add(int64(j.promptTokens))
		h.counters.prefixHits.Add(int64(cached))
		rate := 0.0
		if j.promptTokens > 0 {
			rate = float64(cached) / float64(j.promptTokens)
		}
		h.counters.lastHitRate.Store(math.Float64bits(rate))
	}

	prefix := "chatcmpl-"
	if j.endpoint == pathCompletions {
		prefix = "cmpl-"
	}
	return output{
		id:     prefix + rand.Text(),
		words:  words,
		finish: finish,
		usage: usage{
			PromptTokens:        j.promptTokens,
			CompletionTokens:    completion,
			TotalTokens:         j.promptTokens + completion,
			PromptTokensDetails: promptTokensDetails{CachedTokens: cached},
		},
	}, cost
}

// pacer spreads a decode time over the chunks of a stream: the first word
// goes out at once (it came with the prefill), the others at even intervals
// over d. With a single word, d passes before the finish chunk.
type pacer struct {
	d     time.Duration
	words int
}

// before is the pause before word i.
func (p pacer) before(i int) time.Duration {
	if i == 0 || p.words < 2 {
		return 0
	}
	gaps := time.Duration(p.words - 1)
	return p.d*time.Duration(i)/gaps - p.d*time.Duration(i-1)/gaps
}

// beforeFinish is the pause between the last word and the finish chunk.
func (p pacer) beforeFinish() time.Duration {
	if p.words < 2 {
		return p.d
	}
	return 0
}

// streamChat answers a chat job as Server-Sent Events the way the OpenAI API
// does: a first chunk with the role, one chunk per word, a chunk with the
// finish reason, with include_usage a chunk with no choices and the usage,
// then "data: [DONE]".
func (h *handler) streamChat(w http.ResponseWriter, r *http.Request, j job, out output, decode time.Duration) {
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
	s := startSSE(w, r, h.sleep)
	pace := pacer{d: decode, words: len(out.words)}
	empty := ""
	s.event(chunk(delta(chatDelta{Role: "assistant", Content: &empty}, nil), nil))
	for i, p := range out.pieces() {
		s.pause(pace.before(i))
		s.event(chunk(delta(chatDelta{Content: &p}, nil), nil))
	}
	s.pause(pace.beforeFinish())
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
func (h *handler) streamCompletion(w http.ResponseWriter, r *http.Request, j job, out output, decode time.Duration) {
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
	s := startSSE(w, r, h.sleep)
	pace := pacer{d: decode, words: len(out.words)}
	for k, p := range out.pieces() {
		s.pause(pace.before(k))
		for i := range j.prompts {
			s.event(chunk([]completionChoice{{Text: p, Index: i}}, nil))
		}
	}
	s.pause(pace.beforeFinish())
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
	w     http.ResponseWriter
	r     *http.Request
	rc    *http.ResponseController
	sleep func(context.Context, time.Duration) error
	err   error
}

func startSSE(w http.ResponseWriter, r *http.Request, sleep func(context.Context, time.Duration) error) *sse {
	hd := w.Header()
	hd.Set("Content-Type", "text/event-stream; charset=utf-8")
	hd.Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	return &sse{w: w, r: r, rc: http.NewResponseController(w), sleep: sleep}
}

// pause waits d between two events, unless the stream has already failed;
// a cancelled request ends the stream.
func (s *sse) pause(d time.Duration) {
	if s.err != nil || d <= 0 {
		return
	}
	s.err = s.sleep(s.r.Context(), d)
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
