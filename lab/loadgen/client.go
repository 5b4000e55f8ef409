package loadgen

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"
	"time"

	"github.com/tetherproxy/tether/lab/workload"
)

// Bounds on what is read from an answer.
const (
	maxResponseBytes = 16 << 20 // a whole answer or a whole stream
	maxEventBytes    = 1 << 20  // one line of a stream
	maxErrorBytes    = 4 << 10  // the body of an error answer, for the record
)

// chatRequest is the body of POST /v1/chat/completions.
type chatRequest struct {
	Model         string             `json:"model"`
	Messages      []workload.Message `json:"messages"`
	MaxTokens     int                `json:"max_tokens"`
	IgnoreEOS     bool               `json:"ignore_eos"` // vLLM's extension: answer exactly max_tokens
	Stream        bool               `json:"stream"`
	StreamOptions *streamOptions     `json:"stream_options,omitempty"`
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

// chatAnswer is the part of a chat.completion, a chat.completion.chunk or
// an error answer that a record needs.
type chatAnswer struct {
	Choices []struct {
		Message struct {
			Content string `json:"content"`
		} `json:"message"`
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		PromptTokensDetails *struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
	Error *struct {
		Message string `json:"message"`
	} `json:"error"`
}

// send sends turn k of conv, given the answers to the turns before it, and
// fills rec with what happened. It returns the answer's text, to be fed
// back in the next turn. ctx ends at the drain deadline.
func (r *runner) send(ctx context.Context, rec *Record, conv workload.Conversation, k int, answers []string) string {
	msgs, err := conv.Messages(k, answers)
	if err != nil {
		rec.Fate, rec.Error = Failed, err.Error()
		return ""
	}
	body, err := json.Marshal(chatRequest{
		Model:         r.opts.Model,
		Messages:      msgs,
		MaxTokens:     conv.Turns[k].MaxTokens,
		IgnoreEOS:     true,
		Stream:        r.opts.Stream,
		StreamOptions: r.streamOptions(),
	})
	if err != nil {
		rec.Fate, rec.Error = Failed, fmt.Sprintf("encode request: %v", err)
		return ""
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.url, bytes.NewReader(body))
	if err != nil {
		rec.Fate, rec.Error = Failed, err.Error()
		return ""
	}
	req.Header.Set("Content-Type", "application/json")
	for _, h := range conv.Identity.Headers {
		req.Header.Set(h.Name, h.Value)
	}

	start := time.Now()
	rec.Start = start.Sub(r.start)
	ans, err := r.exchange(req, rec, start)
	rec.Latency = time.Since(start)
	switch {
	case err == nil:
		rec.Fate = OK
	case ctx.Err() != nil:
		rec.Fate, rec.Error = Cancelled, "cancelled: "+context.Cause(ctx).Error()
	default:
		rec.Fate, rec.Error = Failed, err.Error()
	}
	return ans
}

func (r *runner) streamOptions() *streamOptions {
	if !r.opts.Stream {
		return nil
	}
	return &streamOptions{IncludeUsage: true}
}

// exchange does the HTTP exchange and reads the answer into rec.
func (r *runner) exchange(req *http.Request, rec *Record, start time.Time) (string, error) {
	resp, err := r.client.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	// Read what is left (a little, bounded) so the connection can serve
	// the next request.
	defer func() { _, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxErrorBytes)) }()
	rec.Status = resp.StatusCode
	rec.Instance = resp.Header.Get(InstanceHeader)
	rec.TetherDecision = resp.Header.Get(DecisionHeader)
	rec.TetherInstance = resp.Header.Get(TetherInstanceHeader)

	body := &firstByte{r: io.LimitReader(resp.Body, maxResponseBytes)}
	defer func() {
		if !body.at.IsZero() {
			rec.TTFB = body.at.Sub(start)
		}
	}()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return "", fmt.Errorf("HTTP %d: %s", resp.StatusCode, errorMessage(io.LimitReader(body, maxErrorBytes)))
	}
	var ans answer
	if mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type")); mt == "text/event-stream" {
		ans, err = readStream(body)
	} else {
		ans, err = readWhole(body)
	}
	if err != nil {
		return "", err
	}
	rec.PromptTokens, rec.CachedTokens, rec.CompletionTokens = ans.prompt, ans.cached, ans.completion
	return ans.text, nil
}

// answer is what was read from a 2xx answer.
type answer struct {
	text                       string
	prompt, cached, completion int
}

func (a *answer) usage(c *chatAnswer) {
	if u := c.Usage; u != nil {
		a.prompt, a.completion = u.PromptTokens, u.CompletionTokens
		if u.PromptTokensDetails != nil {
			a.cached = u.PromptTokensDetails.CachedTokens
		}
	}
}

// readWhole reads a chat.completion.
func readWhole(body io.Reader) (answer, error) {
	var c chatAnswer
	if err := json.NewDecoder(body).Decode(&c); err != nil {
		return answer{}, fmt.Errorf("read answer: %w", err)
	}
	if len(c.Choices) == 0 {
		return answer{}, errors.New("read answer: no choices")
	}
	a := answer{text: c.Choices[0].Message.Content}
	a.usage(&c)
	return a, nil
}

// readStream reads a stream of chat.completion.chunk events up to
// "data: [DONE]": the deltas of the first choice make the text, the last
// chunk (stream_options.include_usage) the usage.
func readStream(body io.Reader) (answer, error) {
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 0, 64<<10), maxEventBytes)
	var a answer
	var text strings.Builder
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data:")
		if !ok {
			continue // blank lines between events, comments, other fields
		}
		data = strings.TrimSpace(data)
		if data == "[DONE]" {
			a.text = text.String()
			return a, nil
		}
		var c chatAnswer
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			return answer{}, fmt.Errorf("read stream: event: %w", err)
		}
		if c.Error != nil {
			return answer{}, fmt.Errorf("read stream: error event: %s", c.Error.Message)
		}
		if len(c.Choices) > 0 {
			text.WriteString(c.Choices[0].Delta.Content)
		}
		a.usage(&c)
	}
	if err := sc.Err(); err != nil {
		return answer{}, fmt.Errorf("read stream: %w", err)
	}
	return answer{}, errors.New("read stream: ended without data: [DONE]")
}

// errorMessage returns the message of an OpenAI-style error answer, or the
// start of the body.
func errorMessage(body io.Reader) string {
	b, _ := io.ReadAll(body)
	var c chatAnswer
	if json.Unmarshal(b, &c) == nil && c.Error != nil && c.Error.Message != "" {
		return c.Error.Message
	}
	s := strings.TrimSpace(string(b))
	if len(s) > 200 {
		s = s[:200] + "…"
	}
	if s == "" {
		return "(empty body)"
	}
	return s
}

// firstByte notes when the first byte of a body was read.
type firstByte struct {
	r  io.Reader
	at time.Time
}

func (f *firstByte) Read(p []byte) (int, error) {
	n, err := f.r.Read(p)
	if n > 0 && f.at.IsZero() {
		f.at = time.Now()
	}
	return n, err
}
