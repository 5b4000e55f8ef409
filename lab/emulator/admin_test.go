package emulator

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// sleepRecorder stands in for the handler's waits: it records them and
// returns at once (or with the context's error).
type sleepRecorder struct {
	mu    sync.Mutex
	waits []time.Duration
}

func (s *sleepRecorder) sleep(ctx context.Context, d time.Duration) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.waits = append(s.waits, d)
	return ctx.Err()
}

func (s *sleepRecorder) take() []time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	w := s.waits
	s.waits = nil
	return w
}

// recordedHandler returns the handler of in with its waits recorded instead
// of slept.
func recordedHandler(t *testing.T, in Instance) (*handler, *sleepRecorder) {
	t.Helper()
	hh, err := NewHandler(in)
	if err != nil {
		t.Fatal(err)
	}
	h := hh.(*handler)
	rec := &sleepRecorder{}
	h.sleep = rec.sleep
	return h, rec
}

// call serves one request in-process.
func call(t *testing.T, h http.Handler, method, path, body string) *httptest.ResponseRecorder {
	t.Helper()
	req := httptest.NewRequestWithContext(t.Context(), method, path, strings.NewReader(body))
	w := httptest.NewRecorder()
	h.ServeHTTP(w, req)
	return w
}

// apiErr decodes an error answer.
func apiErr(t *testing.T, b []byte) (msg, param, code string) {
	t.Helper()
	var e errorResponse
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&e); err != nil {
		t.Fatalf("error body %s: %v", b, err)
	}
	deref := func(s *string) string {
		if s == nil {
			return ""
		}
		return *s
	}
	return e.Error.Message, deref(e.Error.Param), deref(e.Error.Code)
}

const chatHi = `{"messages":[{"role":"user","content":"hi"}]}`

func TestFaultsAPI(t *testing.T) {
	h, _ := recordedHandler(t, Instance{Name: "gpu-f"})
	faults := func(w *httptest.ResponseRecorder) Faults {
		t.Helper()
		if w.Code != http.StatusOK || w.Header().Get("Content-Type") != "application/json" || w.Header().Get(InstanceHeader) != "gpu-f" {
			t.Fatalf("status %d, headers %v: %s", w.Code, w.Header(), w.Body)
		}
		var f Faults
		if err := json.Unmarshal(w.Body.Bytes(), &f); err != nil {
			t.Fatal(err)
		}
		return f
	}
	none := Faults{ErrorStatus: 503}
	set := Faults{ErrorRate: 0.5, ErrorStatus: 429, ExtraLatency: Duration{200 * time.Millisecond}, Down: true}

	if got := faults(call(t, h, "GET", "/admin/faults", "")); got != none {
		t.Errorf("initial faults %+v, want %+v", got, none)
	}
	if got := faults(call(t, h, "POST", "/admin/faults", `{"error_rate":0.5,"error_status":429,"extra_latency":"200ms","down":true}`)); got != set {
		t.Errorf("POST answered %+v, want %+v", got, set)
	}
	w := call(t, h, "GET", "/admin/faults", "")
	if got := faults(w); got != set {
		t.Errorf("GET after POST %+v, want %+v", got, set)
	}
	if want := `{"error_rate":0.5,"error_status":429,"extra_latency":"200ms","down":true}`; strings.TrimSpace(w.Body.String()) != want {
		t.Errorf("wire form %s, want %s", w.Body, want)
	}
	if got := faults(call(t, h, "POST", "/admin/faults", `{"error_rate":1}`)); got != (Faults{ErrorRate: 1, ErrorStatus: 503}) {
		t.Errorf("a POST replaces every field: %+v", got)
	}
	if got := faults(call(t, h, "DELETE", "/admin/faults", "")); got != none {
		t.Errorf("DELETE answered %+v", got)
	}
	if got := faults(call(t, h, "GET", "/admin/faults", "")); got != none {
		t.Errorf("after DELETE %+v", got)
	}
	if w := call(t, h, "HEAD", "/admin/faults", ""); w.Code != http.StatusOK {
		t.Errorf("HEAD %d", w.Code)
	}

	for _, tc := range []struct{ method, path, allow string }{
		{"PUT", "/admin/faults", "GET, HEAD, POST, DELETE"},
		{"POST", "/admin/stats", "GET, HEAD"},
		{"GET", "/admin/reset", "POST"},
	} {
		w := call(t, h, tc.method, tc.path, "{}")
		if w.Code != http.StatusMethodNotAllowed || w.Header().Get("Allow") != tc.allow {
			t.Errorf("%s %s: %d, Allow %q; want 405, %q", tc.method, tc.path, w.Code, w.Header().Get("Allow"), tc.allow)
		}
	}
}

func TestFaultsBadInput(t *testing.T) {
	tests := []struct {
		name, body string
		wantStatus int
		wantParam  string
		wantMsg    string
	}{
		{"empty body", ``, 400, "", "JSON object"},
		{"not JSON", `error_rate=1`, 400, "", "JSON object"},
		{"array", `[{"down":true}]`, 400, "", "JSON object"},
		{"null", `null`, 400, "", "JSON object"},
		{"broken JSON", `{"down":`, 400, "", "not valid JSON"},
		{"two objects", `{"down":true} {"down":false}`, 400, "", "nothing after it"},
		{"unknown field", `{"eror_rate":0.5}`, 400, "eror_rate", "unknown field"},
		{"rate above 1", `{"error_rate":1.5}`, 400, "error_rate", "probability"},
		{"negative rate", `{"error_rate":-0.1}`, 400, "error_rate", "probability"},
		{"rate as string", `{"error_rate":"0.5"}`, 400, "error_rate", "expected float64"},
		{"status 200", `{"error_rate":0.1,"error_status":200}`, 400, "error_status", "400 to 599"},
		{"status 600", `{"error_status":600}`, 400, "error_status", "400 to 599"},
		{"status fraction", `{"error_status":503.5}`, 400, "error_status", "expected int"},
		{"latency without unit", `{"extra_latency":"200"}`, 400, "extra_latency", "not a duration"},
		{"latency garbage", `{"extra_latency":"soon"}`, 400, "extra_latency", "not a duration"},
		{"latency a number", `{"extra_latency":200}`, 400, "extra_latency", "duration string"},
		{"negative latency", `{"extra_latency":"-1s"}`, 400, "extra_latency", "outside"},
		{"latency too long", `{"extra_latency":"11m"}`, 400, "extra_latency", "outside"},
		{"down not a bool", `{"down":"yes"}`, 400, "down", "expected bool"},
		{"body over 64 KiB", `{"down":true,"x":"` + strings.Repeat("x", 70<<10) + `"}`, 413, "", "exceeds"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h, _ := recordedHandler(t, Instance{Name: "gpu-f"})
			w := call(t, h, "POST", "/admin/faults", tc.body)
			if w.Code != tc.wantStatus {
				t.Fatalf("status %d, want %d: %s", w.Code, tc.wantStatus, w.Body)
			}
			msg, param, code := apiErr(t, w.Body.Bytes())
			if param != tc.wantParam || code != "invalid_faults" || !strings.Contains(msg, tc.wantMsg) {
				t.Errorf("error %q param %q code %q; want a message containing %q, param %q", msg, param, code, tc.wantMsg, tc.wantParam)
			}
			if f := *h.faults.Load(); f != *noFaults() {
				t.Errorf("a refused POST changed the faults: %+v", f)
			}
		})
	}
}

func TestDown(t *testing.T) {
	h, _ := recordedHandler(t, Instance{Name: "gpu-d"})
	if w := call(t, h, "POST", "/admin/faults", `{"down":true}`); w.Code != 200 {
		t.Fatalf("set down: %d %s", w.Code, w.Body)
	}
	for _, r := range []struct{ method, path, body string }{
		{"POST", "/v1/chat/completions", chatHi},
		{"POST", "/v1/completions", `{"prompt":"x"}`},
		{"GET", "/v1/models", ""},
		{"GET", "/healthz", ""},
		{"GET", "/nowhere", ""},
	} {
		w := call(t, h, r.method, r.path, r.body)
		if w.Code != http.StatusServiceUnavailable || w.Header().Get(InstanceHeader) != "gpu-d" {
			t.Errorf("%s %s while down: %d, want 503", r.method, r.path, w.Code)
			continue
		}
		if _, _, code := apiErr(t, w.Body.Bytes()); code != "instance_down" {
			t.Errorf("%s %s: code %q, want instance_down", r.method, r.path, code)
		}
	}
	for _, path := range []string{"/admin/faults", "/admin/stats"} {
		if w := call(t, h, "GET", path, ""); w.Code != http.StatusOK {
			t.Errorf("GET %s while down: %d, want 200", path, w.Code)
		}
	}
	call(t, h, "DELETE", "/admin/faults", "")
	if w := call(t, h, "POST", "/v1/chat/completions", chatHi); w.Code != http.StatusOK {
		t.Errorf("after clearing: %d", w.Code)
	}
}

func TestInjectedErrors(t *testing.T) {
	const n = 2000
	tests := []struct {
		rate   float64
		status int
	}{{0, 503}, {0.3, 429}, {0.5, 503}, {1, 500}}
	for _, tc := range tests {
		t.Run(fmt.Sprint("rate ", tc.rate), func(t *testing.T) {
			h, _ := recordedHandler(t, Instance{Name: "gpu-e", Rand: rand.NewPCG(1, 2)})
			call(t, h, "POST", "/admin/faults", fmt.Sprintf(`{"error_rate":%v,"error_status":%d}`, tc.rate, tc.status))
			failed := 0
			for range n {
				w := call(t, h, "POST", "/v1/chat/completions", chatHi)
				switch w.Code {
				case http.StatusOK:
				case tc.status:
					failed++
					if _, _, code := apiErr(t, w.Body.Bytes()); code != "injected_fault" {
						t.Fatalf("code %q", code)
					}
				default:
					t.Fatalf("status %d: %s", w.Code, w.Body)
				}
			}
			// Binomial: within 5 standard deviations of n·rate.
			mean, sd := n*tc.rate, math.Sqrt(n*tc.rate*(1-tc.rate))
			if math.Abs(float64(failed)-mean) > 5*sd {
				t.Errorf("%d of %d failed, want %.0f ± %.0f", failed, n, mean, 5*sd)
			}
			if s := h.stats(); s.Requests != n || s.InjectedErrors != int64(failed) || s.CompletionTokens != int64(3*(n-failed)) {
				t.Errorf("stats %+v after %d failures", s, failed)
			}
		})
	}
	t.Run("the draws come from the injected source", func(t *testing.T) {
		outcomes := func() string {
			h, _ := recordedHandler(t, Instance{Name: "gpu-e", Rand: rand.NewPCG(9, 9)})
			call(t, h, "POST", "/admin/faults", `{"error_rate":0.5}`)
			var b strings.Builder
			for range 64 {
				fmt.Fprint(&b, call(t, h, "POST", "/v1/completions", `{"prompt":"x"}`).Code/100)
			}
			return b.String()
		}
		if a, b := outcomes(), outcomes(); a != b {
			t.Errorf("same seed, different outcomes:\n%s\n%s", a, b)
		}
	})
}

func TestExtraLatencyIsWaited(t *testing.T) {
	h, rec := recordedHandler(t, Instance{Name: "gpu-l", Latency: 3 * time.Millisecond})
	call(t, h, "POST", "/admin/faults", `{"extra_latency":"200ms"}`)
	for _, tc := range []struct {
		path, body string
		want       []time.Duration
	}{
		{"/v1/chat/completions", chatHi, []time.Duration{203 * time.Millisecond}},
		{"/v1/completions", `{"prompt":"x","stream":true}`, []time.Duration{203 * time.Millisecond}},
	} {
		if w := call(t, h, "POST", tc.path, tc.body); w.Code != 200 {
			t.Fatalf("%s: %d", tc.path, w.Code)
		}
		if diff := cmp.Diff(tc.want, rec.take()); diff != "" {
			t.Errorf("%s: waits (-want +got):\n%s", tc.path, diff)
		}
	}
	call(t, h, "POST", "/admin/faults", `{"extra_latency":"1.5s","error_rate":1}`)
	if w := call(t, h, "POST", "/v1/chat/completions", chatHi); w.Code != 503 {
		t.Fatalf("injected error: %d", w.Code)
	}
	if diff := cmp.Diff([]time.Duration{1500 * time.Millisecond}, rec.take()); diff != "" {
		t.Errorf("an injected error waits the extra latency too (-want +got):\n%s", diff)
	}
	for _, path := range []string{"/healthz", "/v1/models", "/admin/stats"} {
		call(t, h, "GET", path, "")
	}
	if w := rec.take(); len(w) != 0 {
		t.Errorf("only completions wait: %v", w)
	}
}

// gateModel holds the first n requests in Cost until the gate closes.
type gateModel struct {
	n       int
	arrived chan Request
	gate    chan struct{}
}

func (m gateModel) Cost(r Request) Cost {
	m.arrived <- r
	if r.InFlight < m.n {
		<-m.gate
	}
	return Cost{}
}

func TestQueueDepth(t *testing.T) {
	m := gateModel{n: 3, arrived: make(chan Request, 10), gate: make(chan struct{})}
	srv := newServer(t, Instance{Name: "gpu-q", LatencyModel: m, ReportHeaders: true})
	var wg sync.WaitGroup
	for range 3 {
		wg.Go(func() {
			if resp, body := do(t, srv, "POST", "/v1/chat/completions", strings.NewReader(chatHi)); resp.StatusCode != 200 {
				t.Errorf("held request: %d %s", resp.StatusCode, body)
			}
		})
	}
	defer wg.Wait()
	defer close(m.gate)
	for range 3 {
		select {
		case <-m.arrived:
		case <-time.After(10 * time.Second):
			t.Fatal("requests did not reach the model")
		}
	}
	resp, body := do(t, srv, "POST", "/v1/chat/completions", strings.NewReader(chatHi))
	if resp.StatusCode != 200 || resp.Header.Get(QueueDepthHeader) != "3" {
		t.Errorf("fourth request: %d, %s = %q; want 200, 3: %s", resp.StatusCode, QueueDepthHeader, resp.Header.Get(QueueDepthHeader), body)
	}
	if r := <-m.arrived; r.InFlight != 3 {
		t.Errorf("the model saw InFlight %d, want 3", r.InFlight)
	}
	_, b := do(t, srv, "GET", "/admin/stats", nil)
	var s Stats
	if err := json.Unmarshal(b, &s); err != nil || s.InFlight != 3 {
		t.Errorf("stats in_flight %d (%v), want 3", s.InFlight, err)
	}
}

func TestPacedStream(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	p := ProfileH200()
	prompt := text("w", 500)
	// A fresh model's cost for that request: no queue, no cache.
	wantWait := p.Prefill(500, 0)
	wantDecode := 7 * p.Decode.Step(1, 504)

	tests := []struct {
		name, path, body string
		want             []time.Duration // the waits, in order
	}{
		{
			name: "chat stream: first token after the prefill, the others paced",
			path: "/v1/chat/completions",
			body: `{"messages":[{"role":"user","content":"` + prompt + `"}],"stream":true,"max_tokens":8,"ignore_eos":true}`,
			want: append([]time.Duration{wantWait}, split(wantDecode, 7)...),
		},
		{
			name: "completions stream",
			path: "/v1/completions",
			body: `{"prompt":"` + prompt + `","stream":true,"max_tokens":8,"ignore_eos":true}`,
			want: append([]time.Duration{wantWait}, split(wantDecode, 7)...),
		},
		{
			name: "whole answer after prefill and decode",
			path: "/v1/chat/completions",
			body: `{"messages":[{"role":"user","content":"` + prompt + `"}],"max_tokens":8,"ignore_eos":true}`,
			want: []time.Duration{wantWait + wantDecode},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h, rec := recordedHandler(t, Instance{Name: "gpu-p", LatencyModel: newGPU(t, GPUConfig{Profile: p}), Now: func() time.Time { return t0 }})
			w := call(t, h, "POST", tc.path, tc.body)
			if w.Code != 200 {
				t.Fatalf("%d %s", w.Code, w.Body)
			}
			if diff := cmp.Diff(tc.want, rec.take()); diff != "" {
				t.Errorf("waits (-want +got):\n%s", diff)
			}
			if strings.Contains(tc.name, "stream") {
				events := parseSSE(t, w.Body.Bytes())
				if !strings.Contains(string(events[len(events)-2]), `"finish_reason":"length"`) {
					t.Errorf("last chunk %s", events[len(events)-2])
				}
			}
		})
	}
}

// split divides d into n gaps the way the pacer does.
func split(d time.Duration, n int) []time.Duration {
	out := make([]time.Duration, n)
	for i := range out {
		out[i] = d*time.Duration(i+1)/time.Duration(n) - d*time.Duration(i)/time.Duration(n)
	}
	return out
}

func TestPacer(t *testing.T) {
	for _, tc := range []struct {
		d     time.Duration
		words int
	}{{0, 1}, {10, 1}, {10, 2}, {10, 3}, {1000003, 7}, {time.Hour, 4096}} {
		p := pacer{d: tc.d, words: tc.words}
		var sum time.Duration
		for i := range tc.words {
			if g := p.before(i); g < 0 || (i == 0 && g != 0) {
				t.Errorf("%+v: gap %d is %v", tc, i, g)
			}
			sum += p.before(i)
		}
		if sum += p.beforeFinish(); sum != tc.d {
			t.Errorf("%+v: the gaps add up to %v", tc, sum)
		}
	}
}

func TestStatsAndReset(t *testing.T) {
	srv := newServer(t, Instance{Name: "gpu-s", LatencyModel: newGPU(t, GPUConfig{Profile: ProfileA100(), TimeScale: 0.001})})
	sys := text("sys", 64)
	ask := func(session, user string) *http.Response {
		body := `{"messages":[{"role":"system","content":"` + sys + `"},{"role":"user","content":"` + user + `"}]}`
		resp, b := doHeaders(t, srv, "POST", "/v1/chat/completions", strings.NewReader(body), map[string]string{SessionHeader: session})
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		return resp
	}
	stats := func() Stats {
		_, b := do(t, srv, "GET", "/admin/stats", nil)
		var s Stats
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&s); err != nil {
			t.Fatalf("%v: %s", err, b)
		}
		return s
	}

	if got := ask("s1", "first question here").Header.Get(CachedTokensHeader); got != "0" {
		t.Errorf("first request cached %s", got)
	}
	if got := ask("s2", "another one").Header.Get(CachedTokensHeader); got != "64" {
		t.Errorf("second request shares the system prompt: cached %s, want 64", got)
	}
	s := stats()
	if s.Instance != "gpu-s" || s.Requests != 2 || s.PromptTokens != 64*2+3+2 || s.CachedTokens != 64 || s.CompletionTokens != 6 ||
		s.InFlight != 0 || s.Model == nil || s.Model.Profile != "a100" || s.Model.Cache.Conversations != 2 || s.Model.Cache.Blocks != 4 {
		t.Errorf("stats %+v, model %+v", s, s.Model)
	}
	_, b := do(t, srv, "POST", "/admin/reset", nil)
	var after Stats
	if err := json.Unmarshal(b, &after); err != nil || after.Requests != 0 || after.Model.Cache.Blocks != 0 || after.Model.PrefillGPUSeconds != 0 {
		t.Errorf("reset answered %s (%v)", b, err)
	}
	if got := ask("s3", "again").Header.Get(CachedTokensHeader); got != "0" {
		t.Errorf("after reset: cached %s, want 0", got)
	}

	fixed := newServer(t, Instance{Name: "gpu-x", Latency: time.Microsecond})
	_, b = do(t, fixed, "GET", "/admin/stats", nil)
	if strings.Contains(string(b), `"model"`) {
		t.Errorf("fixed latency has no model stats: %s", b)
	}
}

func TestGPUInstanceUnderConcurrency(t *testing.T) {
	g := newGPU(t, GPUConfig{Profile: ProfileA100(), TimeScale: 0.0005, Cache: CacheConfig{CapacityTokens: 50_000, MaxConversations: 5}})
	srv := newServer(t, Instance{Name: "gpu-c", LatencyModel: g, ReportHeaders: true})
	sys := text("sys", 300)
	const n = 40
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			path, body := "/v1/chat/completions", `{"messages":[{"role":"system","content":"`+sys+`"},{"role":"user","content":"`+text(fmt.Sprint("q", i), 20)+`"}],"stream":`+strconv.FormatBool(i%2 == 0)+`}`
			resp, b := doHeaders(t, srv, "POST", path, strings.NewReader(body), map[string]string{SessionHeader: fmt.Sprint("s", i%7)})
			if resp.StatusCode != 200 {
				t.Errorf("request %d: %d %s", i, resp.StatusCode, b)
			}
			if d, err := strconv.Atoi(resp.Header.Get(QueueDepthHeader)); err != nil || d < 0 || d >= n {
				t.Errorf("request %d: %s = %q", i, QueueDepthHeader, resp.Header.Get(QueueDepthHeader))
			}
		})
	}
	wg.Wait()
	if err := g.Cache().check(); err != nil {
		t.Fatal(err)
	}
	_, b := do(t, srv, "GET", "/admin/stats", nil)
	var s Stats
	if err := json.Unmarshal(b, &s); err != nil || s.Requests != n || s.InFlight != 0 || s.Model.Cache.Conversations > 5 {
		t.Errorf("stats %s (%v)", b, err)
	}
}
