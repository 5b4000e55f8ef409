package emulator

import (
	"bytes"
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The types below mirror the response types of the official OpenAI Go client
// (github.com/openai/openai-go: ChatCompletion, ChatCompletionChunk,
// Completion, Model, the API error), with the fields the emulator emits. The
// client marks some fields `required`; requiredPaths lists them per type.
// Decoding is strict: a field the client does not know fails the test.

type oaCompletionUsage struct {
	CompletionTokens        int64 `json:"completion_tokens"`
	PromptTokens            int64 `json:"prompt_tokens"`
	TotalTokens             int64 `json:"total_tokens"`
	CompletionTokensDetails struct {
		AcceptedPredictionTokens int64 `json:"accepted_prediction_tokens"`
		AudioTokens              int64 `json:"audio_tokens"`
		ReasoningTokens          int64 `json:"reasoning_tokens"`
		RejectedPredictionTokens int64 `json:"rejected_prediction_tokens"`
	} `json:"completion_tokens_details"`
	PromptTokensDetails struct {
		AudioTokens  int64 `json:"audio_tokens"`
		CachedTokens int64 `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

type oaLogprobs struct {
	Content []json.RawMessage `json:"content"`
	Refusal []json.RawMessage `json:"refusal"`
}

type oaChatCompletion struct {
	ID      string `json:"id"`
	Choices []struct {
		FinishReason string      `json:"finish_reason"`
		Index        int64       `json:"index"`
		Logprobs     *oaLogprobs `json:"logprobs"`
		Message      struct {
			Content     string            `json:"content"`
			Refusal     string            `json:"refusal"`
			Role        string            `json:"role"`
			Annotations []json.RawMessage `json:"annotations"`
			ToolCalls   []json.RawMessage `json:"tool_calls"`
		} `json:"message"`
	} `json:"choices"`
	Created           int64             `json:"created"`
	Model             string            `json:"model"`
	Object            string            `json:"object"`
	ServiceTier       string            `json:"service_tier"`
	SystemFingerprint string            `json:"system_fingerprint"`
	Usage             oaCompletionUsage `json:"usage"`
}

type oaChatCompletionChunk struct {
	ID      string `json:"id"`
	Choices []struct {
		Delta struct {
			Content   string            `json:"content"`
			Refusal   string            `json:"refusal"`
			Role      string            `json:"role"`
			ToolCalls []json.RawMessage `json:"tool_calls"`
		} `json:"delta"`
		FinishReason string      `json:"finish_reason"`
		Index        int64       `json:"index"`
		Logprobs     *oaLogprobs `json:"logprobs"`
	} `json:"choices"`
	Created           int64              `json:"created"`
	Model             string             `json:"model"`
	Object            string             `json:"object"`
	ServiceTier       string             `json:"service_tier"`
	SystemFingerprint string             `json:"system_fingerprint"`
	Usage             *oaCompletionUsage `json:"usage"`
}

type oaCompletion struct {
	ID      string `json:"id"`
	Choices []struct {
		FinishReason string          `json:"finish_reason"`
		Index        int64           `json:"index"`
		Logprobs     json.RawMessage `json:"logprobs"`
		Text         string          `json:"text"`
	} `json:"choices"`
	Created           int64              `json:"created"`
	Model             string             `json:"model"`
	Object            string             `json:"object"`
	SystemFingerprint string             `json:"system_fingerprint"`
	Usage             *oaCompletionUsage `json:"usage"`
}

type oaModelList struct {
	Object string `json:"object"`
	Data   []struct {
		ID      string `json:"id"`
		Created int64  `json:"created"`
		Object  string `json:"object"`
		OwnedBy string `json:"owned_by"`
		// What vLLM's ModelCard adds to OpenAI's Model (SGLang's adds
		// root and max_model_len); the client keeps them as extra fields.
		Root        string            `json:"root"`
		Parent      *string           `json:"parent"`
		MaxModelLen int64             `json:"max_model_len"`
		Permission  []json.RawMessage `json:"permission"`
	} `json:"data"`
}

type oaError struct {
	Error struct {
		Code    *string `json:"code"`
		Message string  `json:"message"`
		Param   *string `json:"param"`
		Type    string  `json:"type"`
	} `json:"error"`
}

// strictDecode decodes b into v, failing on fields v does not declare.
func strictDecode(t *testing.T, b []byte, v any) {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		t.Fatalf("decoding into %T: %v\n%s", v, err, b)
	}
}

// requirePaths fails unless every dotted path ("choices.0.message.role") is
// present in the JSON b (null counts as present: the client's required
// fields may be null).
func requirePaths(t *testing.T, b []byte, paths ...string) {
	t.Helper()
	var root any
	if err := json.Unmarshal(b, &root); err != nil {
		t.Fatal(err)
	}
	for _, p := range paths {
		cur := root
		for _, key := range strings.Split(p, ".") {
			var ok bool
			switch c := cur.(type) {
			case map[string]any:
				cur, ok = c[key]
			case []any:
				i, err := strconv.Atoi(key)
				if ok = err == nil && i < len(c); ok {
					cur = c[i]
				}
			}
			if !ok {
				t.Errorf("required field %s missing in %s", p, b)
				break
			}
		}
	}
}

var (
	usagePaths      = []string{"usage.prompt_tokens", "usage.completion_tokens", "usage.total_tokens", "usage.prompt_tokens_details.cached_tokens"}
	chatPaths       = append([]string{"id", "object", "created", "model", "choices.0.index", "choices.0.finish_reason", "choices.0.logprobs", "choices.0.message.role", "choices.0.message.content", "choices.0.message.refusal"}, usagePaths...)
	chunkPaths      = []string{"id", "object", "created", "model", "choices"}
	chunkPathsDelta = append([]string{"choices.0.index", "choices.0.delta", "choices.0.finish_reason"}, chunkPaths...)
	completionPaths = append([]string{"id", "object", "created", "model", "choices.0.index", "choices.0.text", "choices.0.logprobs", "choices.0.finish_reason"}, usagePaths...)
	modelPaths      = []string{"object", "data.0.id", "data.0.object", "data.0.created", "data.0.owned_by"}
	errorPaths      = []string{"error.message", "error.type", "error.param", "error.code"}
)

func TestShapesMatchTheOpenAIClient(t *testing.T) {
	srv := newServer(t, Instance{Name: "gpu-o", Latency: time.Microsecond})
	const chatBody = `{"model":"gpt-4o-mini","messages":[{"role":"developer","content":"terse"},{"role":"user","content":"hello world"}],"max_completion_tokens":64}`

	t.Run("chat.completion", func(t *testing.T) {
		_, b := do(t, srv, "POST", "/v1/chat/completions", strings.NewReader(chatBody))
		requirePaths(t, b, chatPaths...)
		var c oaChatCompletion
		strictDecode(t, b, &c)
		if c.Object != "chat.completion" || c.Model != "gpt-4o-mini" || c.SystemFingerprint != "gpu-o" ||
			len(c.Choices) != 1 || c.Choices[0].Message.Role != "assistant" ||
			c.Choices[0].Message.Content != "served by gpu-o" || c.Choices[0].FinishReason != "stop" ||
			c.Usage.PromptTokens != 3 || c.Usage.CompletionTokens != 3 || c.Usage.TotalTokens != 6 ||
			c.Usage.PromptTokensDetails.CachedTokens != 0 || !strings.HasPrefix(c.ID, "chatcmpl-") || c.Created == 0 {
			t.Errorf("chat completion %+v", c)
		}
	})

	t.Run("chat.completion.chunk", func(t *testing.T) {
		body := strings.Replace(chatBody, `"max_completion_tokens":64`, `"stream":true,"stream_options":{"include_usage":true}`, 1)
		_, b := do(t, srv, "POST", "/v1/chat/completions", strings.NewReader(body))
		events := parseSSE(t, b)
		var text strings.Builder
		for i, ev := range events[:len(events)-1] {
			var c oaChatCompletionChunk
			strictDecode(t, []byte(ev), &c)
			if c.Object != "chat.completion.chunk" {
				t.Errorf("chunk %d object %q", i, c.Object)
			}
			if len(c.Choices) > 0 {
				requirePaths(t, []byte(ev), chunkPathsDelta...)
				text.WriteString(c.Choices[0].Delta.Content)
			} else {
				requirePaths(t, []byte(ev), append(chunkPaths, usagePaths...)...)
			}
		}
		if text.String() != "served by gpu-o" {
			t.Errorf("streamed text %q", text.String())
		}
	})

	t.Run("text_completion", func(t *testing.T) {
		_, b := do(t, srv, "POST", "/v1/completions", strings.NewReader(`{"model":"gpt-3.5-turbo-instruct","prompt":"Say this is a test","max_tokens":7}`))
		requirePaths(t, b, completionPaths...)
		var c oaCompletion
		strictDecode(t, b, &c)
		if c.Object != "text_completion" || len(c.Choices) != 1 || c.Choices[0].Text != "served by gpu-o" ||
			string(c.Choices[0].Logprobs) != "null" || c.Usage == nil || c.Usage.PromptTokens != 5 || !strings.HasPrefix(c.ID, "cmpl-") {
			t.Errorf("completion %+v", c)
		}
	})

	t.Run("text_completion stream", func(t *testing.T) {
		_, b := do(t, srv, "POST", "/v1/completions", strings.NewReader(`{"prompt":"x","stream":true}`))
		events := parseSSE(t, b)
		for _, ev := range events[:len(events)-1] {
			var c oaCompletion
			strictDecode(t, []byte(ev), &c)
			requirePaths(t, []byte(ev), "id", "object", "created", "model", "choices.0.index", "choices.0.text", "choices.0.logprobs", "choices.0.finish_reason")
		}
	})

	t.Run("models", func(t *testing.T) {
		_, b := do(t, srv, "GET", "/v1/models", nil)
		requirePaths(t, b, modelPaths...)
		var m oaModelList
		strictDecode(t, b, &m)
		if m.Object != "list" || len(m.Data) != 1 || m.Data[0].ID != DefaultModel || m.Data[0].Object != "model" {
			t.Errorf("models %+v", m)
		}
	})

	t.Run("error", func(t *testing.T) {
		_, b := do(t, srv, "POST", "/v1/chat/completions", strings.NewReader(`{"messages":[]}`))
		requirePaths(t, b, errorPaths...)
		var e oaError
		strictDecode(t, b, &e)
		if e.Error.Type != "invalid_request_error" || e.Error.Param == nil || *e.Error.Param != "messages" {
			t.Errorf("error %+v", e)
		}
	})
}

// TestShapesWithTheGPUModel checks the answers of an instance with the KV
// cache model, whose usage reports cached tokens, against the same client
// types.
func TestShapesWithTheGPUModel(t *testing.T) {
	g, err := NewGPU(GPUConfig{Profile: ProfileA100(), TimeScale: 0.0001})
	if err != nil {
		t.Fatal(err)
	}
	srv := newServer(t, Instance{Name: "gpu-o", LatencyModel: g})
	system := strings.Repeat("You are a careful assistant. ", 20) // 100 tokens: 6 blocks
	chat := func(user string, extra string) string {
		return `{"model":"m","messages":[{"role":"system","content":"` + system + `"},{"role":"user","content":"` + user + `"}]` + extra + `}`
	}
	do(t, srv, "POST", "/v1/chat/completions", strings.NewReader(chat("warm up", "")))

	t.Run("chat.completion", func(t *testing.T) {
		resp, b := do(t, srv, "POST", "/v1/chat/completions", strings.NewReader(chat("hello world", `,"max_tokens":20,"ignore_eos":true`)))
		requirePaths(t, b, chatPaths...)
		var c oaChatCompletion
		strictDecode(t, b, &c)
		if c.Usage.PromptTokens != 102 || c.Usage.PromptTokensDetails.CachedTokens != 96 || c.Usage.CompletionTokens != 20 ||
			c.Choices[0].FinishReason != "length" || resp.Header.Get(CachedTokensHeader) != "96" {
			t.Errorf("chat completion %+v, %s=%q", c, CachedTokensHeader, resp.Header.Get(CachedTokensHeader))
		}
	})
	t.Run("chat.completion.chunk", func(t *testing.T) {
		_, b := do(t, srv, "POST", "/v1/chat/completions", strings.NewReader(chat("stream it", `,"stream":true,"stream_options":{"include_usage":true}`)))
		events := parseSSE(t, b)
		var last oaChatCompletionChunk
		for _, ev := range events[:len(events)-1] {
			last = oaChatCompletionChunk{}
			strictDecode(t, []byte(ev), &last)
		}
		requirePaths(t, []byte(events[len(events)-2]), append(chunkPaths, usagePaths...)...)
		if last.Usage == nil || last.Usage.PromptTokensDetails.CachedTokens != 96 {
			t.Errorf("last chunk usage %+v", last.Usage)
		}
	})
	t.Run("text_completion", func(t *testing.T) {
		_, b := do(t, srv, "POST", "/v1/completions", strings.NewReader(`{"model":"m","prompt":"`+system+` go on"}`))
		requirePaths(t, b, completionPaths...)
		var c oaCompletion
		strictDecode(t, b, &c)
		if c.Usage == nil || c.Usage.PromptTokensDetails.CachedTokens != 96 {
			t.Errorf("completion usage %+v", c.Usage)
		}
	})
}
