package emulator

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// newServer serves one instance on a loopback httptest server, closed at the
// end of the test.
func newServer(t *testing.T, in Instance) *httptest.Server {
	t.Helper()
	h, err := NewHandler(in)
	if err != nil {
		t.Fatalf("NewHandler(%+v): %v", in, err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

// do sends one request and returns the response with its body read.
func do(t *testing.T, srv *httptest.Server, method, path string, body io.Reader) (*http.Response, []byte) {
	t.Helper()
	return doHeaders(t, srv, method, path, body, nil)
}

// doHeaders is do with extra request headers.
func doHeaders(t *testing.T, srv *httptest.Server, method, path string, body io.Reader, header map[string]string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, srv.URL+path, body)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: read body: %v", method, path, err)
	}
	return resp, b
}

// normalize decodes a JSON answer and blanks the fields that change per
// request (id, created) so answers compare with cmp.Diff.
func normalize(t *testing.T, b []byte) any {
	t.Helper()
	var v any
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatalf("answer is not JSON: %v\n%s", err, b)
	}
	if m, ok := v.(map[string]any); ok {
		if id, ok := m["id"].(string); ok && id != "" {
			m["id"] = "ID"
		}
		if c, ok := m["created"].(float64); ok && c > 0 {
			m["created"] = "CREATED"
		}
	}
	return v
}

func TestNewHandlerRejects(t *testing.T) {
	tests := []struct {
		name string
		in   Instance
		want string
	}{
		{"empty name", Instance{}, "name is empty"},
		{"negative latency", Instance{Name: "a", Latency: -time.Millisecond}, "latency -1ms is negative"},
		{"space in name", Instance{Name: "gpu a"}, "not visible ASCII"},
		{"newline in name", Instance{Name: "gpu\na"}, "not visible ASCII"},
		{"non-ASCII name", Instance{Name: "gpü"}, "not visible ASCII"},
		{"long name", Instance{Name: strings.Repeat("a", 254)}, "more than 253"},
		{"latency and model", Instance{Name: "a", Latency: time.Second, LatencyModel: Fixed(0)}, "not both"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h, err := NewHandler(tc.in)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("NewHandler(%+v) = %v, %v; want error containing %q", tc.in, h, err, tc.want)
			}
		})
	}
}

func TestEndpoints(t *testing.T) {
	srv := newServer(t, Instance{Name: "gpu-a", Latency: time.Microsecond})
	u := func(prompt, completion int) string {
		b, _ := json.Marshal(usage{PromptTokens: prompt, CompletionTokens: completion, TotalTokens: prompt + completion})
		return string(b)
	}
	chat := func(content, finish, u string) string {
		return `{"id":"ID","object":"chat.completion","created":"CREATED","model":"m","system_fingerprint":"gpu-a",
			"choices":[{"index":0,"message":{"role":"assistant","content":"` + content + `","refusal":null},"logprobs":null,"finish_reason":"` + finish + `"}],
			"usage":` + u + `}`
	}
	tests := []struct {
		name, method, path, body string
		want                     string // JSON, id and created normalized
	}{
		{
			name: "chat", method: "POST", path: "/v1/chat/completions",
			body: `{"model":"m","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"hello  there\n"}]}`,
			want: chat("served by gpu-a", "stop", u(5, 3)),
		},
		{
			name: "chat content parts and null content", method: "POST", path: "/v1/chat/completions",
			body: `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"one two"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"three"}]},{"role":"assistant","content":null}]}`,
			want: chat("served by gpu-a", "stop", u(3, 3)),
		},
		{
			name: "chat max_tokens cuts the answer", method: "POST", path: "/v1/chat/completions",
			body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`,
			want: chat("served by", "length", u(1, 2)),
		},
		{
			name: "chat max_completion_tokens wins over max_tokens", method: "POST", path: "/v1/chat/completions",
			body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":10,"max_completion_tokens":1}`,
			want: chat("served", "length", u(1, 1)),
		},
		{
			name: "chat max_tokens above the cap is capped", method: "POST", path: "/v1/chat/completions",
			body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1000000,"stream":false,"temperature":0.2}`,
			want: chat("served by gpu-a", "stop", u(1, 3)),
		},
		{
			name: "chat without model", method: "POST", path: "/v1/chat/completions",
			body: `{"messages":[{"role":"user","content":"hi"}]}`,
			want: strings.Replace(chat("served by gpu-a", "stop", u(1, 3)), `"model":"m"`, `"model":"tether-sim"`, 1),
		},
		{
			name: "completion", method: "POST", path: "/v1/completions",
			body: `{"model":"m","prompt":"Say this is a test","max_tokens":7}`,
			want: `{"id":"ID","object":"text_completion","created":"CREATED","model":"m","system_fingerprint":"gpu-a",
				"choices":[{"text":"served by gpu-a","index":0,"logprobs":null,"finish_reason":"stop"}],"usage":` + u(5, 3) + `}`,
		},
		{
			name: "completion with a prompt array: one choice per prompt", method: "POST", path: "/v1/completions",
			body: `{"model":"m","prompt":["a b","c"],"max_tokens":1}`,
			want: `{"id":"ID","object":"text_completion","created":"CREATED","model":"m","system_fingerprint":"gpu-a",
				"choices":[{"text":"served","index":0,"logprobs":null,"finish_reason":"length"},
				           {"text":"served","index":1,"logprobs":null,"finish_reason":"length"}],"usage":` + u(3, 2) + `}`,
		},
		{
			name: "completion with an empty prompt", method: "POST", path: "/v1/completions",
			body: `{"model":"m","prompt":""}`,
			want: `{"id":"ID","object":"text_completion","created":"CREATED","model":"m","system_fingerprint":"gpu-a",
				"choices":[{"text":"served by gpu-a","index":0,"logprobs":null,"finish_reason":"stop"}],"usage":` + u(0, 3) + `}`,
		},
		{
			name: "healthz", method: "GET", path: "/healthz",
			want: `{"status":"ok","instance":"gpu-a"}`,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			resp, body := do(t, srv, tc.method, tc.path, strings.NewReader(tc.body))
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d, want 200; body %s", resp.StatusCode, body)
			}
			if got := resp.Header.Get(InstanceHeader); got != "gpu-a" {
				t.Errorf("%s = %q, want gpu-a", InstanceHeader, got)
			}
			if got := resp.Header.Get("Content-Type"); got != "application/json" {
				t.Errorf("Content-Type = %q, want application/json", got)
			}
			if diff := cmp.Diff(normalize(t, []byte(tc.want)), normalize(t, body)); diff != "" {
				t.Errorf("answer mismatch (-want +got):\n%s", diff)
			}
		})
	}

	t.Run("HEAD healthz", func(t *testing.T) {
		resp, body := do(t, srv, "HEAD", "/healthz", nil)
		if resp.StatusCode != http.StatusOK || len(body) != 0 || resp.Header.Get(InstanceHeader) != "gpu-a" {
			t.Errorf("HEAD /healthz = %d, %q, %s=%q; want 200, empty body, gpu-a",
				resp.StatusCode, body, InstanceHeader, resp.Header.Get(InstanceHeader))
		}
	})
	t.Run("ids differ per request", func(t *testing.T) {
		ids := map[string]bool{}
		for range 3 {
			_, body := do(t, srv, "POST", "/v1/chat/completions", strings.NewReader(`{"messages":[{"role":"user","content":"hi"}]}`))
			var c struct{ ID string }
			if err := json.Unmarshal(body, &c); err != nil || !strings.HasPrefix(c.ID, "chatcmpl-") {
				t.Fatalf("id %q (%v), want chatcmpl-…", c.ID, err)
			}
			ids[c.ID] = true
		}
		if len(ids) != 3 {
			t.Errorf("3 requests gave %d distinct ids", len(ids))
		}
	})
}

// unsized hides the length of a body so the client sends it chunked, without
// a Content-Length.
type unsized struct{ io.Reader }

func TestBadInput(t *testing.T) {
	srv := newServer(t, Instance{Name: "gpu-a", Latency: time.Microsecond})
	const chatPath, cmplPath = "/v1/chat/completions", "/v1/completions"
	oversized := `{"messages":[{"role":"user","content":"` + strings.Repeat("a", MaxBodyBytes) + `"}]}`
	str := func(s string) *string { return &s }

	tests := []struct {
		name, method, path string
		body               io.Reader
		wantStatus         int
		wantParam          *string // nil: null
		wantAllow          string
	}{
		{name: "invalid JSON", method: "POST", path: chatPath, body: strings.NewReader(`{"messages":`), wantStatus: 400},
		{name: "empty body", method: "POST", path: chatPath, body: strings.NewReader(``), wantStatus: 400},
		{name: "trailing garbage", method: "POST", path: chatPath, body: strings.NewReader(`{"messages":[{"role":"user","content":"hi"}]} x`), wantStatus: 400},
		{name: "not an object", method: "POST", path: chatPath, body: strings.NewReader(`[1,2]`), wantStatus: 400},
		{name: "binary body", method: "POST", path: chatPath, body: bytes.NewReader([]byte{0xff, 0x00, 0xfe}), wantStatus: 400},
		{name: "messages missing", method: "POST", path: chatPath, body: strings.NewReader(`{"model":"m"}`), wantStatus: 400, wantParam: str("messages")},
		{name: "null body", method: "POST", path: chatPath, body: strings.NewReader(`null`), wantStatus: 400, wantParam: str("messages")},
		{name: "messages null", method: "POST", path: chatPath, body: strings.NewReader(`{"messages":null}`), wantStatus: 400, wantParam: str("messages")},
		{name: "messages empty", method: "POST", path: chatPath, body: strings.NewReader(`{"messages":[]}`), wantStatus: 400, wantParam: str("messages")},
		{name: "messages not an array", method: "POST", path: chatPath, body: strings.NewReader(`{"messages":"hi"}`), wantStatus: 400, wantParam: str("messages")},
		{name: "role missing", method: "POST", path: chatPath, body: strings.NewReader(`{"messages":[{"content":"hi"}]}`), wantStatus: 400, wantParam: str("messages[0].role")},
		{name: "content a number", method: "POST", path: chatPath, body: strings.NewReader(`{"messages":[{"role":"user","content":"a"},{"role":"user","content":7}]}`), wantStatus: 400, wantParam: str("messages[1].content")},
		{name: "max_tokens negative", method: "POST", path: chatPath, body: strings.NewReader(`{"messages":[{"role":"user","content":"hi"}],"max_tokens":-1}`), wantStatus: 400, wantParam: str("max_tokens")},
		{name: "max_tokens zero", method: "POST", path: chatPath, body: strings.NewReader(`{"messages":[{"role":"user","content":"hi"}],"max_tokens":0}`), wantStatus: 400, wantParam: str("max_tokens")},
		{name: "max_tokens a string", method: "POST", path: chatPath, body: strings.NewReader(`{"messages":[{"role":"user","content":"hi"}],"max_tokens":"10"}`), wantStatus: 400, wantParam: str("max_tokens")},
		{name: "max_tokens a fraction", method: "POST", path: chatPath, body: strings.NewReader(`{"messages":[{"role":"user","content":"hi"}],"max_tokens":1.5}`), wantStatus: 400, wantParam: str("max_tokens")},
		{name: "max_tokens beyond int64", method: "POST", path: chatPath, body: strings.NewReader(`{"messages":[{"role":"user","content":"hi"}],"max_tokens":1e40}`), wantStatus: 400, wantParam: str("max_tokens")},
		{name: "max_completion_tokens negative", method: "POST", path: chatPath, body: strings.NewReader(`{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":-5}`), wantStatus: 400, wantParam: str("max_completion_tokens")},
		{name: "n above 1", method: "POST", path: chatPath, body: strings.NewReader(`{"messages":[{"role":"user","content":"hi"}],"n":2}`), wantStatus: 400, wantParam: str("n")},
		{name: "stream not a bool", method: "POST", path: chatPath, body: strings.NewReader(`{"messages":[{"role":"user","content":"hi"}],"stream":"yes"}`), wantStatus: 400, wantParam: str("stream")},
		{name: "prompt missing", method: "POST", path: cmplPath, body: strings.NewReader(`{"model":"m"}`), wantStatus: 400, wantParam: str("prompt")},
		{name: "prompt null", method: "POST", path: cmplPath, body: strings.NewReader(`{"prompt":null}`), wantStatus: 400, wantParam: str("prompt")},
		{name: "prompt empty array", method: "POST", path: cmplPath, body: strings.NewReader(`{"prompt":[]}`), wantStatus: 400, wantParam: str("prompt")},
		{name: "prompt tokens", method: "POST", path: cmplPath, body: strings.NewReader(`{"prompt":[1,2,3]}`), wantStatus: 400, wantParam: str("prompt")},
		{name: "prompt an object", method: "POST", path: cmplPath, body: strings.NewReader(`{"prompt":{"a":1}}`), wantStatus: 400, wantParam: str("prompt")},
		{name: "completion max_tokens negative", method: "POST", path: cmplPath, body: strings.NewReader(`{"prompt":"x","max_tokens":-3}`), wantStatus: 400, wantParam: str("max_tokens")},
		{name: "completion invalid JSON", method: "POST", path: cmplPath, body: strings.NewReader(`{"prompt":"x"`), wantStatus: 400},
		{name: "body over 8 MiB with Content-Length", method: "POST", path: chatPath, body: strings.NewReader(oversized), wantStatus: 413},
		{name: "body over 8 MiB chunked", method: "POST", path: chatPath, body: unsized{strings.NewReader(oversized)}, wantStatus: 413},
		{name: "completion body over 8 MiB", method: "POST", path: cmplPath, body: unsized{strings.NewReader(`{"prompt":"` + strings.Repeat("b ", MaxBodyBytes/2) + `"}`)}, wantStatus: 413},
		{name: "GET chat", method: "GET", path: chatPath, wantStatus: 405, wantAllow: "POST"},
		{name: "PUT completions", method: "PUT", path: cmplPath, wantStatus: 405, wantAllow: "POST"},
		{name: "POST models", method: "POST", path: "/v1/models", body: strings.NewReader(`{}`), wantStatus: 405, wantAllow: "GET, HEAD"},
		{name: "DELETE healthz", method: "DELETE", path: "/healthz", wantStatus: 405, wantAllow: "GET, HEAD"},
		{name: "unknown path", method: "POST", path: "/v1/embeddings", body: strings.NewReader(`{}`), wantStatus: 404},
		{name: "root", method: "GET", path: "/", wantStatus: 404},
		{name: "trailing slash", method: "POST", path: chatPath + "/", body: strings.NewReader(`{}`), wantStatus: 404},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			resp, body := do(t, srv, tc.method, tc.path, tc.body)
			if resp.StatusCode != tc.wantStatus {
				t.Fatalf("status %d, want %d; body %s", resp.StatusCode, tc.wantStatus, body)
			}
			if got := resp.Header.Get(InstanceHeader); got != "gpu-a" {
				t.Errorf("%s = %q, want gpu-a", InstanceHeader, got)
			}
			if got := resp.Header.Get("Allow"); got != tc.wantAllow {
				t.Errorf("Allow = %q, want %q", got, tc.wantAllow)
			}
			if got := resp.Header.Get("Content-Type"); got != "application/json" {
				t.Errorf("Content-Type = %q, want application/json", got)
			}
			var e struct {
				Error struct {
					Message string          `json:"message"`
					Type    string          `json:"type"`
					Param   *string         `json:"param"`
					Code    json.RawMessage `json:"code"`
				} `json:"error"`
			}
			dec := json.NewDecoder(bytes.NewReader(body))
			dec.DisallowUnknownFields()
			if err := dec.Decode(&e); err != nil {
				t.Fatalf("error body %s: %v", body, err)
			}
			if e.Error.Type != "invalid_request_error" || e.Error.Message == "" || len(e.Error.Code) == 0 {
				t.Errorf("error = %+v; want type invalid_request_error, a message and a code (or null)", e.Error)
			}
			if diff := cmp.Diff(tc.wantParam, e.Error.Param); diff != "" {
				t.Errorf("param (-want +got):\n%s", diff)
			}
		})
	}

	t.Run("body of exactly 8 MiB is accepted", func(t *testing.T) {
		b := []byte(`{"messages":[{"role":"user","content":"hi"}]}`)
		b = append(b, bytes.Repeat([]byte(" "), MaxBodyBytes-len(b))...)
		resp, body := do(t, srv, "POST", chatPath, bytes.NewReader(b))
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d, want 200; body %.200s", resp.StatusCode, body)
		}
	})
	t.Run("server still answers after the bad input", func(t *testing.T) {
		resp, _ := do(t, srv, "GET", "/healthz", nil)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("healthz %d", resp.StatusCode)
		}
	})
}

// recordingModel records every Request and answers with cost.
type recordingModel struct {
	cost Cost
	mu   sync.Mutex
	seen []Request
}

func (m *recordingModel) Cost(r Request) Cost {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.seen = append(m.seen, r)
	return m.cost
}

func (m *recordingModel) requests() []Request {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]Request(nil), m.seen...)
}

func TestLatencyModel(t *testing.T) {
	clock := time.Date(2026, 5, 4, 3, 2, 1, 0, time.UTC)
	tests := []struct {
		name       string
		path, body string
		header     map[string]string
		cost       Cost
		want       Request
		wantCached int
	}{
		{
			name: "chat", path: "/v1/chat/completions",
			body: `{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hello there you"}],"max_tokens":2}`,
			cost: Cost{CachedTokens: 4},
			want: Request{Instance: "gpu-b", Endpoint: "/v1/chat/completions", Model: "m",
				Prompt: "be brief\nhello there you", PromptTokens: 5, CompletionTokens: 2,
				Completion: "served by", Arrived: clock},
			wantCached: 4,
		},
		{
			name: "chat with a session", path: "/v1/chat/completions",
			body:   `{"messages":[{"role":"user","content":"hi"}]}`,
			header: map[string]string{"X-Session-Id": "conv-7"},
			want: Request{Instance: "gpu-b", Endpoint: "/v1/chat/completions", Model: DefaultModel,
				Prompt: "hi", PromptTokens: 1, CompletionTokens: 3,
				Completion: "served by gpu-b", Session: "conv-7", Arrived: clock},
		},
		{
			name: "ignore_eos answers the whole max_tokens", path: "/v1/chat/completions",
			body: `{"messages":[{"role":"user","content":"hi"}],"max_tokens":7,"ignore_eos":true}`,
			want: Request{Instance: "gpu-b", Endpoint: "/v1/chat/completions", Model: DefaultModel,
				Prompt: "hi", PromptTokens: 1, CompletionTokens: 7,
				Completion: "served by gpu-b served by gpu-b served", Arrived: clock},
		},
		{
			name: "streamed completions, cached tokens clamped to the prompt", path: "/v1/completions",
			body: `{"prompt":["one","two three"],"stream":true,"stream_options":{"include_usage":true}}`,
			cost: Cost{CachedTokens: 1000},
			want: Request{Instance: "gpu-b", Endpoint: "/v1/completions", Model: DefaultModel,
				Prompt: "one\ntwo three", PromptTokens: 3, CompletionTokens: 6, Stream: true,
				Completion: "served by gpu-b", Arrived: clock},
			wantCached: 3,
		},
		{
			name: "negative cached tokens become 0", path: "/v1/completions",
			body: `{"prompt":"x"}`,
			cost: Cost{CachedTokens: -1},
			want: Request{Instance: "gpu-b", Endpoint: "/v1/completions", Model: DefaultModel,
				Prompt: "x", PromptTokens: 1, CompletionTokens: 3, Completion: "served by gpu-b", Arrived: clock},
			wantCached: 0,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := &recordingModel{cost: tc.cost}
			srv := newServer(t, Instance{Name: "gpu-b", LatencyModel: m, Now: func() time.Time { return clock }, ReportHeaders: true})
			resp, body := doHeaders(t, srv, "POST", tc.path, strings.NewReader(tc.body), tc.header)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, body)
			}
			if got, want := resp.Header.Get(CachedTokensHeader), strconv.Itoa(tc.wantCached); got != want {
				t.Errorf("%s = %q, want %q", CachedTokensHeader, got, want)
			}
			if got := resp.Header.Get(QueueDepthHeader); got != "0" {
				t.Errorf("%s = %q, want 0", QueueDepthHeader, got)
			}
			if got, ok := resp.Header[http.CanonicalHeaderKey(GPUUtilizationHeader)]; ok {
				t.Errorf("%s = %q from a model that reports no utilisation", GPUUtilizationHeader, got)
			}
			if diff := cmp.Diff([]Request{tc.want}, m.requests()); diff != "" {
				t.Errorf("model saw (-want +got):\n%s", diff)
			}
			var u *usage
			if tc.want.Stream {
				u = lastUsage(t, parseSSE(t, body))
			} else {
				var c struct{ Usage *usage }
				if err := json.Unmarshal(body, &c); err != nil {
					t.Fatal(err)
				}
				u = c.Usage
			}
			if u == nil || u.PromptTokensDetails.CachedTokens != tc.wantCached {
				t.Errorf("usage %+v, want cached_tokens %d", u, tc.wantCached)
			}
		})
	}
}

func TestFixedLatencyIsWaited(t *testing.T) {
	const latency = 50 * time.Millisecond
	srv := newServer(t, Instance{Name: "slow", Latency: latency})
	for _, path := range []string{"/v1/chat/completions", "/v1/completions"} {
		start := time.Now()
		resp, _ := do(t, srv, "POST", path, strings.NewReader(`{"messages":[{"role":"user","content":"hi"}],"prompt":"hi"}`))
		if took := time.Since(start); resp.StatusCode != http.StatusOK || took < latency {
			t.Errorf("POST %s: status %d after %v; want 200 after at least %v", path, resp.StatusCode, took, latency)
		}
	}
	if got := (Fixed(time.Hour)).Cost(Request{}); got != (Cost{Wait: time.Hour}) {
		t.Errorf("Fixed(1h).Cost = %+v", got)
	}
}

// startedModel reports each Cost call on a channel and makes the instance
// wait an hour: only cancellation ends the request.
type startedModel chan struct{}

func (m startedModel) Cost(Request) Cost {
	m <- struct{}{}
	return Cost{Wait: time.Hour}
}

func TestWaitHonoursCancellation(t *testing.T) {
	tests := []struct{ name, path, body string }{
		{"chat", "/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}]}`},
		{"chat stream", "/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"stream":true}`},
		{"completions", "/v1/completions", `{"prompt":"hi"}`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			started := make(startedModel, 1)
			h, err := NewHandler(Instance{Name: "a", LatencyModel: started})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			req := httptest.NewRequestWithContext(ctx, "POST", tc.path, strings.NewReader(tc.body))
			rec := httptest.NewRecorder()
			done := make(chan struct{})
			go func() {
				defer close(done)
				h.ServeHTTP(rec, req)
			}()
			select {
			case <-started:
			case <-time.After(10 * time.Second):
				t.Fatal("the latency model was never asked")
			}
			cancel()
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("handler still waiting 10s after the request was cancelled")
			}
			if rec.Body.Len() != 0 {
				t.Errorf("cancelled request got a body: %s", rec.Body)
			}
		})
	}
}

// sseEvent is the data of one Server-Sent Event.
type sseEvent string

// parseSSE splits a text/event-stream body into the data of its events. It
// fails the test on anything the OpenAI stream format does not use: every
// event is one "data: " line followed by a blank line.
func parseSSE(t *testing.T, body []byte) []sseEvent {
	t.Helper()
	var events []sseEvent
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(nil, 1<<20)
	var cur *sseEvent
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "":
			if cur == nil {
				t.Fatalf("empty event in stream:\n%s", body)
			}
			events = append(events, *cur)
			cur = nil
		case strings.HasPrefix(line, "data: "):
			if cur != nil {
				t.Fatalf("event with two data lines:\n%s", body)
			}
			e := sseEvent(strings.TrimPrefix(line, "data: "))
			cur = &e
		default:
			t.Fatalf("unexpected SSE line %q in:\n%s", line, body)
		}
	}
	if cur != nil {
		t.Fatalf("stream ends inside an event:\n%s", body)
	}
	if len(events) == 0 || events[len(events)-1] != "[DONE]" {
		t.Fatalf("stream does not end with data: [DONE]:\n%s", body)
	}
	return events
}

// lastUsage returns the usage of the last chunk before [DONE], or nil.
func lastUsage(t *testing.T, events []sseEvent) *usage {
	t.Helper()
	if len(events) < 2 {
		return nil
	}
	var c struct{ Usage *usage }
	if err := json.Unmarshal([]byte(events[len(events)-2]), &c); err != nil {
		t.Fatal(err)
	}
	return c.Usage
}

func TestStreaming(t *testing.T) {
	srv := newServer(t, Instance{Name: "gpu-s", Latency: time.Microsecond})
	type choice struct {
		Index int
		Delta *struct {
			Role    *string
			Content *string
		}
		Text         *string
		FinishReason *string `json:"finish_reason"`
	}
	type chunk struct {
		ID                string
		Object            string
		Model             string
		SystemFingerprint string `json:"system_fingerprint"`
		Choices           []choice
		Usage             *usage
	}
	tests := []struct {
		name, path, body string
		object           string
		choices          int
		wantText         string
		wantFinish       string
		wantUsage        *usage
	}{
		{
			name: "chat", path: "/v1/chat/completions",
			body:   `{"model":"m","messages":[{"role":"user","content":"hi there"}],"stream":true}`,
			object: "chat.completion.chunk", choices: 1, wantText: "served by gpu-s", wantFinish: "stop",
		},
		{
			name: "chat with usage, cut by max_tokens", path: "/v1/chat/completions",
			body:   `{"model":"m","messages":[{"role":"user","content":"hi there"}],"stream":true,"max_tokens":2,"stream_options":{"include_usage":true}}`,
			object: "chat.completion.chunk", choices: 1, wantText: "served by", wantFinish: "length",
			wantUsage: &usage{PromptTokens: 2, CompletionTokens: 2, TotalTokens: 4},
		},
		{
			name: "completions", path: "/v1/completions",
			body:   `{"model":"m","prompt":"hi","stream":true}`,
			object: "text_completion", choices: 1, wantText: "served by gpu-s", wantFinish: "stop",
		},
		{
			name: "completions, two prompts, with usage", path: "/v1/completions",
			body:   `{"model":"m","prompt":["a","b c"],"stream":true,"stream_options":{"include_usage":true}}`,
			object: "text_completion", choices: 2, wantText: "served by gpu-s", wantFinish: "stop",
			wantUsage: &usage{PromptTokens: 3, CompletionTokens: 6, TotalTokens: 9},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			resp, body := do(t, srv, "POST", tc.path, strings.NewReader(tc.body))
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, body)
			}
			if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
				t.Errorf("Content-Type = %q, want text/event-stream", ct)
			}
			if got := resp.Header.Get(InstanceHeader); got != "gpu-s" {
				t.Errorf("%s = %q", InstanceHeader, got)
			}
			events := parseSSE(t, body)
			texts := make([]string, tc.choices)
			finishes := make([]string, tc.choices)
			var id string
			var gotUsage *usage
			for i, ev := range events[:len(events)-1] {
				var c chunk
				dec := json.NewDecoder(strings.NewReader(string(ev)))
				if err := dec.Decode(&c); err != nil {
					t.Fatalf("event %d %q: %v", i, ev, err)
				}
				if c.Object != tc.object || c.Model != "m" || c.SystemFingerprint != "gpu-s" {
					t.Errorf("event %d: object %q model %q fingerprint %q", i, c.Object, c.Model, c.SystemFingerprint)
				}
				if id == "" {
					id = c.ID
				} else if c.ID != id {
					t.Errorf("event %d: id %q, first event had %q", i, c.ID, id)
				}
				if c.Usage != nil {
					if gotUsage != nil || len(c.Choices) != 0 || i != len(events)-2 {
						t.Errorf("event %d: usage must come once, last, with no choices: %s", i, ev)
					}
					gotUsage = c.Usage
				}
				for _, ch := range c.Choices {
					if ch.Index < 0 || ch.Index >= tc.choices {
						t.Fatalf("event %d: choice index %d", i, ch.Index)
					}
					if finishes[ch.Index] != "" {
						t.Errorf("event %d: choice %d continues after its finish_reason", i, ch.Index)
					}
					switch {
					case ch.Delta != nil && ch.Delta.Content != nil:
						texts[ch.Index] += *ch.Delta.Content
					case ch.Text != nil:
						texts[ch.Index] += *ch.Text
					}
					if ch.Delta != nil && ch.Delta.Role != nil && (i != 0 || *ch.Delta.Role != "assistant") {
						t.Errorf("event %d: role %q; only the first chat chunk names the role, assistant", i, *ch.Delta.Role)
					}
					if ch.FinishReason != nil {
						finishes[ch.Index] = *ch.FinishReason
					}
				}
			}
			for i := range tc.choices {
				if texts[i] != tc.wantText || finishes[i] != tc.wantFinish {
					t.Errorf("choice %d: text %q finish %q; want %q, %q", i, texts[i], finishes[i], tc.wantText, tc.wantFinish)
				}
			}
			if diff := cmp.Diff(tc.wantUsage, gotUsage); diff != "" {
				t.Errorf("usage (-want +got):\n%s", diff)
			}
		})
	}
}

func TestCountTokens(t *testing.T) {
	tests := []struct {
		in   string
		want int
	}{
		{"", 0},
		{"   \n\t", 0},
		{"hello", 1},
		{"Hello, world!", 2},
		{"  leading and trailing  ", 3},
		{"tabs\tand\nnewlines\r\nmix", 4},
		{"non\u00a0breaking space", 3},
		{"日本語 テキスト", 2},
	}
	for _, tc := range tests {
		if got := CountTokens(tc.in); got != tc.want {
			t.Errorf("CountTokens(%q) = %d, want %d", tc.in, got, tc.want)
		}
		if got, want := CountTokens(tc.in), len(strings.Fields(tc.in)); got != want {
			t.Errorf("CountTokens(%q) = %d, strings.Fields gives %d", tc.in, got, want)
		}
	}
}

// TestGPUUtilizationHeader: an instance on the GPU model that reports the
// emulator's headers sends how busy its GPU was over the last second, in
// percent: 0 when idle, above 0 right after a request it served.
func TestGPUUtilizationHeader(t *testing.T) {
	g, err := NewGPU(GPUConfig{Profile: ProfileA100(), TimeScale: 0.01})
	if err != nil {
		t.Fatal(err)
	}
	srv := newServer(t, Instance{Name: "gpu-u", LatencyModel: g, ReportHeaders: true})
	body := `{"model":"` + DefaultModel + `","messages":[{"role":"user","content":"` + strings.Repeat("word ", 2000) + `"}],"max_tokens":16}`
	for i, check := range []func(float64) bool{
		func(u float64) bool { return u == 0 },
		func(u float64) bool { return u > 0 && u <= 100 },
	} {
		resp, b := doHeaders(t, srv, "POST", "/v1/chat/completions", strings.NewReader(body), nil)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d: %s", resp.StatusCode, b)
		}
		got := resp.Header.Get(GPUUtilizationHeader)
		u, err := strconv.ParseFloat(got, 64)
		if err != nil || !check(u) {
			t.Errorf("request %d: %s = %q", i+1, GPUUtilizationHeader, got)
		}
	}
}
