package emulator

import (
	"encoding/json"
	"fmt"
	"strings"
)

// This file holds the OpenAI wire types the emulator reads and writes, and
// the checks that turn a request body into a job.

// ---- requests ----

type chatRequest struct {
	Model               string         `json:"model"`
	Messages            []chatMessage  `json:"messages"`
	MaxTokens           *int           `json:"max_tokens"`
	MaxCompletionTokens *int           `json:"max_completion_tokens"`
	N                   *int           `json:"n"`
	Stream              bool           `json:"stream"`
	StreamOptions       *streamOptions `json:"stream_options"`
	IgnoreEOS           bool           `json:"ignore_eos"` // vLLM's extension: answer exactly the token limit
}

type chatMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"` // string, array of content parts, or null
}

type contentPart struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

type completionRequest struct {
	Model         string          `json:"model"`
	Prompt        json.RawMessage `json:"prompt"` // string or array of strings
	MaxTokens     *int            `json:"max_tokens"`
	N             *int            `json:"n"`
	Stream        bool            `json:"stream"`
	StreamOptions *streamOptions  `json:"stream_options"`
	IgnoreEOS     bool            `json:"ignore_eos"`
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

// job is a validated completion request, whichever endpoint it came from.
type job struct {
	endpoint     string
	model        string   // as the request named it; empty: the served model
	prompts      []string // chat: one entry, the joined message contents
	promptTokens int
	maxTokens    int
	stream       bool
	includeUsage bool
	ignoreEOS    bool // answer exactly maxTokens words
}

// prompt is the text the prompt tokens were counted on.
func (j job) prompt() string { return strings.Join(j.prompts, "\n") }

// reqError is a request the emulator refuses with a 400.
type reqError struct {
	message string
	param   string
	code    string
}

func invalid(param, code, format string, args ...any) *reqError {
	return &reqError{message: fmt.Sprintf(format, args...), param: param, code: code}
}

func (r chatRequest) job() (job, *reqError) {
	if r.Messages == nil {
		return job{}, invalid("messages", "missing_required_parameter", "Missing required parameter: 'messages'.")
	}
	if len(r.Messages) == 0 {
		return job{}, invalid("messages", "empty_array", "Invalid 'messages': empty array. Expected an array with minimum length 1.")
	}
	texts := make([]string, 0, len(r.Messages))
	for i, m := range r.Messages {
		if m.Role == "" {
			return job{}, invalid(fmt.Sprintf("messages[%d].role", i), "missing_required_parameter",
				"Missing required parameter: 'messages[%d].role'.", i)
		}
		text, err := messageText(m.Content)
		if err != nil {
			return job{}, invalid(fmt.Sprintf("messages[%d].content", i), "invalid_type",
				"Invalid 'messages[%d].content': %v.", i, err)
		}
		texts = append(texts, text)
	}
	if e := checkN(r.N); e != nil {
		return job{}, e
	}
	maxTokens, e := resolveMaxTokens(
		namedInt{"max_completion_tokens", r.MaxCompletionTokens},
		namedInt{"max_tokens", r.MaxTokens},
	)
	if e != nil {
		return job{}, e
	}
	prompt := strings.Join(texts, "\n")
	return job{
		endpoint:     pathChat,
		model:        r.Model,
		prompts:      []string{prompt},
		promptTokens: CountTokens(prompt),
		maxTokens:    maxTokens,
		stream:       r.Stream,
		includeUsage: r.Stream && r.StreamOptions != nil && r.StreamOptions.IncludeUsage,
		ignoreEOS:    r.IgnoreEOS,
	}, nil
}

func (r completionRequest) job() (job, *reqError) {
	prompts, e := promptTexts(r.Prompt)
	if e != nil {
		return job{}, e
	}
	if e := checkN(r.N); e != nil {
		return job{}, e
	}
	maxTokens, e := resolveMaxTokens(namedInt{"max_tokens", r.MaxTokens})
	if e != nil {
		return job{}, e
	}
	tokens := 0
	for _, p := range prompts {
		tokens += CountTokens(p)
	}
	return job{
		endpoint:     pathCompletions,
		model:        r.Model,
		prompts:      prompts,
		promptTokens: tokens,
		maxTokens:    maxTokens,
		stream:       r.Stream,
		includeUsage: r.Stream && r.StreamOptions != nil && r.StreamOptions.IncludeUsage,
		ignoreEOS:    r.IgnoreEOS,
	}, nil
}

// messageText returns the text of a message's content: a string, an array of
// content parts (the text of the "text" parts, joined by "\n"; other parts
// such as images are ignored), or null (an assistant message with tool calls).
func messageText(raw json.RawMessage) (string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var parts []contentPart
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", fmt.Errorf("expected a string or an array of content parts")
	}
	texts := make([]string, 0, len(parts))
	for _, p := range parts {
		if p.Type == "text" {
			texts = append(texts, p.Text)
		}
	}
	return strings.Join(texts, "\n"), nil
}

// promptTexts returns the prompts of a completion request: a string is one
// prompt, an array of strings is one prompt per entry (one choice each).
func promptTexts(raw json.RawMessage) ([]string, *reqError) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, invalid("prompt", "missing_required_parameter", "Missing required parameter: 'prompt'.")
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return []string{s}, nil
	}
	var list []string
	if err := json.Unmarshal(raw, &list); err != nil {
		return nil, invalid("prompt", "invalid_type",
			"Invalid 'prompt': expected a string or an array of strings (token arrays are not supported by the emulator).")
	}
	if len(list) == 0 {
		return nil, invalid("prompt", "empty_array", "Invalid 'prompt': empty array. Expected an array with minimum length 1.")
	}
	return list, nil
}

func checkN(n *int) *reqError {
	if n != nil && *n != 1 {
		return invalid("n", "unsupported_value", "Invalid 'n': %d. The emulator generates exactly 1 choice per prompt.", *n)
	}
	return nil
}

type namedInt struct {
	name string
	v    *int
}

// resolveMaxTokens checks every given limit (each must be ≥ 1) and returns the
// first one set, capped at MaxTokensLimit; MaxTokensLimit when none is set.
func resolveMaxTokens(limits ...namedInt) (int, *reqError) {
	chosen := MaxTokensLimit
	set := false
	for _, l := range limits {
		if l.v == nil {
			continue
		}
		if *l.v < 1 {
			return 0, invalid(l.name, "integer_below_min_value",
				"Invalid '%s': integer below minimum value. Expected a value >= 1, but got %d instead.", l.name, *l.v)
		}
		if !set {
			chosen, set = min(*l.v, MaxTokensLimit), true
		}
	}
	return chosen, nil
}

// ---- responses ----

type usage struct {
	PromptTokens            int                     `json:"prompt_tokens"`
	CompletionTokens        int                     `json:"completion_tokens"`
	TotalTokens             int                     `json:"total_tokens"`
	PromptTokensDetails     promptTokensDetails     `json:"prompt_tokens_details"`
	CompletionTokensDetails completionTokensDetails `json:"completion_tokens_details"`
}

type promptTokensDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

type completionTokensDetails struct {
	ReasoningTokens int `json:"reasoning_tokens"`
}

// logprobs is always null: the emulator computes none.
type logprobs struct{}

type chatCompletion struct {
	ID                string       `json:"id"`
	Object            string       `json:"object"` // "chat.completion"
	Created           int64        `json:"created"`
	Model             string       `json:"model"`
	SystemFingerprint string       `json:"system_fingerprint"`
	Choices           []chatChoice `json:"choices"`
	Usage             usage        `json:"usage"`
}

type chatChoice struct {
	Index        int       `json:"index"`
	Message      chatReply `json:"message"`
	Logprobs     *logprobs `json:"logprobs"`
	FinishReason string    `json:"finish_reason"`
}

type chatReply struct {
	Role    string  `json:"role"`
	Content string  `json:"content"`
	Refusal *string `json:"refusal"`
}

type chatChunk struct {
	ID                string            `json:"id"`
	Object            string            `json:"object"` // "chat.completion.chunk"
	Created           int64             `json:"created"`
	Model             string            `json:"model"`
	SystemFingerprint string            `json:"system_fingerprint"`
	Choices           []chatChunkChoice `json:"choices"`
	Usage             *usage            `json:"usage,omitempty"` // only on the last chunk, with include_usage
}

type chatChunkChoice struct {
	Index        int       `json:"index"`
	Delta        chatDelta `json:"delta"`
	Logprobs     *logprobs `json:"logprobs"`
	FinishReason *string   `json:"finish_reason"`
}

type chatDelta struct {
	Role    string  `json:"role,omitempty"`
	Content *string `json:"content,omitempty"`
}

type textCompletion struct {
	ID                string             `json:"id"`
	Object            string             `json:"object"` // "text_completion", also for chunks
	Created           int64              `json:"created"`
	Model             string             `json:"model"`
	SystemFingerprint string             `json:"system_fingerprint"`
	Choices           []completionChoice `json:"choices"`
	Usage             *usage             `json:"usage,omitempty"` // always on a full answer; streamed only with include_usage
}

type completionChoice struct {
	Text         string    `json:"text"`
	Index        int       `json:"index"`
	Logprobs     *logprobs `json:"logprobs"`
	FinishReason *string   `json:"finish_reason"`
}

type modelList struct {
	Object string  `json:"object"`
	Data   []model `json:"data"`
}

// model is the model card of GET /v1/models: vLLM's ModelCard, and
// SGLang's, which lacks parent and permission.
type model struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	OwnedBy string `json:"owned_by"`
	Root    string `json:"root"`
	// Parent is null in vLLM's card, absent from SGLang's.
	Parent      json.RawMessage   `json:"parent,omitempty"`
	MaxModelLen int               `json:"max_model_len"`
	Permission  []modelPermission `json:"permission,omitempty"`
}

// modelPermission is vLLM's ModelPermission, with its defaults.
type modelPermission struct {
	ID                 string  `json:"id"`
	Object             string  `json:"object"`
	Created            int64   `json:"created"`
	AllowCreateEngine  bool    `json:"allow_create_engine"`
	AllowSampling      bool    `json:"allow_sampling"`
	AllowLogprobs      bool    `json:"allow_logprobs"`
	AllowSearchIndices bool    `json:"allow_search_indices"`
	AllowView          bool    `json:"allow_view"`
	AllowFineTuning    bool    `json:"allow_fine_tuning"`
	Organization       string  `json:"organization"`
	Group              *string `json:"group"`
	IsBlocking         bool    `json:"is_blocking"`
}

// sglangModelInfo is SGLang's GET /get_model_info.
type sglangModelInfo struct {
	ModelPath               string          `json:"model_path"`
	TokenizerPath           string          `json:"tokenizer_path"`
	IsGeneration            bool            `json:"is_generation"`
	PreferredSamplingParams json.RawMessage `json:"preferred_sampling_params"`
	WeightVersion           string          `json:"weight_version"`
}

// sglangServerInfo is the part of SGLang's GET /get_server_info the
// emulator writes: server arguments, the scheduler's start-up info, the
// internal states (one per dp rank) and the version, in one flat object.
type sglangServerInfo struct {
	ModelPath          string                `json:"model_path"`
	TokenizerPath      string                `json:"tokenizer_path"`
	ServedModelName    string                `json:"served_model_name"`
	TPSize             int                   `json:"tp_size"`
	DPSize             int                   `json:"dp_size"`
	PPSize             int                   `json:"pp_size"`
	PageSize           int                   `json:"page_size"`
	ContextLength      *int                  `json:"context_length"`
	MaxRunningRequests *int                  `json:"max_running_requests"`
	SchedulePolicy     string                `json:"schedule_policy"`
	DisableRadixCache  bool                  `json:"disable_radix_cache"`
	EnableMetrics      bool                  `json:"enable_metrics"`
	DisaggregationMode string                `json:"disaggregation_mode"`
	WeightVersion      string                `json:"weight_version"`
	Status             string                `json:"status"`
	MaxTotalNumTokens  int                   `json:"max_total_num_tokens"`
	MaxReqInputLen     int                   `json:"max_req_input_len"`
	InternalStates     []sglangInternalState `json:"internal_states"`
	Version            string                `json:"version"`
}

type sglangInternalState struct {
	LastGenThroughput float64           `json:"last_gen_throughput"`
	MemoryUsage       sglangMemoryUsage `json:"memory_usage"`
}

type sglangMemoryUsage struct {
	KVCacheGB     float64 `json:"kvcache"`
	TokenCapacity int     `json:"token_capacity"`
}

type health struct {
	Status   string `json:"status"`
	Instance string `json:"instance"`
}

type errorResponse struct {
	Error apiError `json:"error"`
}

type apiError struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}
