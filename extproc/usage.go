package extproc

import (
	"bytes"
	"encoding/json"
)

// Usage is what an engine reports of a request's prompt in its answer:
// the OpenAI-compatible usage object that vLLM and SGLang write at the end
// of a response, or in the last event of a stream.
type Usage struct {
	// Prompt is usage.prompt_tokens.
	Prompt int
	// Cached is usage.prompt_tokens_details.cached_tokens: the prompt
	// tokens its KV cache already held. vLLM reports it with
	// --enable-prompt-tokens-details, SGLang with its cached-token reporting.
	Cached int
}

// usageTail is how much of a response's end tether keeps to find its
// usage. The usage object is a few hundred bytes and comes last, before a
// stream's "data: [DONE]".
const usageTail = 8 << 10

// tail keeps the last usageTail bytes of a streamed response body.
type tail struct{ b []byte }

// add keeps chunk's end.
func (t *tail) add(chunk []byte) {
	if len(chunk) >= usageTail {
		t.b = append(t.b[:0], chunk[len(chunk)-usageTail:]...)
		return
	}
	if over := len(t.b) + len(chunk) - usageTail; over > 0 {
		t.b = append(t.b[:0], t.b[over:]...)
	}
	t.b = append(t.b, chunk...)
}

// usageOf finds the last usage object in the end of a response body, a
// JSON answer or a stream of server-sent events. ok is false when there is
// none, or it does not parse.
func usageOf(end []byte) (u Usage, ok bool) {
	key := []byte(`"usage"`)
	for i := bytes.LastIndex(end, key); i >= 0; i = bytes.LastIndex(end[:i], key) {
		obj := objectAt(end[i+len(key):])
		if obj == nil {
			continue
		}
		var v struct {
			PromptTokens        *int `json:"prompt_tokens"`
			PromptTokensDetails struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		}
		if json.Unmarshal(obj, &v) != nil || v.PromptTokens == nil {
			continue
		}
		return Usage{Prompt: *v.PromptTokens, Cached: v.PromptTokensDetails.CachedTokens}, true
	}
	return Usage{}, false
}

// objectAt is the JSON object that follows a key in b: after white space
// and a colon, from its brace to the brace that closes it. nil when b does
// not hold one whole.
func objectAt(b []byte) []byte {
	b = bytes.TrimLeft(b, " \t\r\n")
	if len(b) == 0 || b[0] != ':' {
		return nil
	}
	b = bytes.TrimLeft(b[1:], " \t\r\n")
	if len(b) == 0 || b[0] != '{' {
		return nil
	}
	depth, quoted, escaped := 0, false, false
	for i, c := range b {
		switch {
		case escaped:
			escaped = false
		case quoted && c == '\\':
			escaped = true
		case c == '"':
			quoted = !quoted
		case quoted:
		case c == '{':
			depth++
		case c == '}':
			if depth--; depth == 0 {
				return b[:i+1]
			}
		}
	}
	return nil
}
