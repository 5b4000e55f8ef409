package bench

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// TestChatBody: each body is the size asked for, an OpenAI chat
// completion with the document as its system message and a question of
// its own, sent anonymously with its length declared.
func TestChatBody(t *testing.T) {
	for _, size := range []int{1 << 10, 32 << 10, 400 << 10} {
		b, err := newChatBody(size)
		if err != nil {
			t.Fatal(err)
		}
		var mu sync.Mutex
		var got [][]byte
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			body, _ := io.ReadAll(r.Body)
			if r.URL.Path != "/v1/chat/completions" || r.ContentLength != int64(size) || r.Header.Get("Content-Type") != "application/json" ||
				r.Header.Get("x-session-id") != "" || r.Header.Get("Authorization") != "" {
				t.Errorf("request %s %s, length %d, headers %v", r.Method, r.URL.Path, r.ContentLength, r.Header)
			}
			mu.Lock()
			got = append(got, body)
			mu.Unlock()
		}))
		req := b.request()
		for i := 0; i < 2; i++ {
			if err := req(context.Background(), srv.Client(), srv.URL, 3, i); err != nil {
				t.Fatal(err)
			}
		}
		srv.Close()
		if len(got) != 2 || b.size != size {
			t.Fatalf("size %d: %d bodies, size %d", size, len(got), b.size)
		}
		var first, second chatRequest
		if err := json.Unmarshal(got[0], &first); err != nil {
			t.Fatalf("size %d: %v", size, err)
		}
		if err := json.Unmarshal(got[1], &second); err != nil {
			t.Fatal(err)
		}
		if len(got[0]) != size || len(got[1]) != size {
			t.Errorf("bodies of %d and %d bytes, want %d", len(got[0]), len(got[1]), size)
		}
		if first.Model != "bench" || first.MaxTokens != 1 || len(first.Messages) != 2 || first.Messages[0].Role != "system" ||
			first.Messages[1].Role != "user" || len(first.Messages[0].Content) < size/2 || strings.ContainsAny(first.Messages[0].Content, "\x00\n") {
			t.Errorf("size %d: body %.200s", size, got[0])
		}
		// The document is shared, the question is not.
		if first.Messages[0] != second.Messages[0] || first.Messages[1] == second.Messages[1] {
			t.Errorf("size %d: questions %q and %q", size, first.Messages[1].Content, second.Messages[1].Content)
		}
	}
}

func TestBodyMarkdown(t *testing.T) {
	ms, us := time.Millisecond, time.Microsecond
	r := &Report{Started: time.Unix(0, 0), Scale: Smoke,
		Overhead: []OverheadRow{{Name: "Envoy alone", P50: ms, Throughput: 100}},
		Bodies: []BodyRow{
			{Name: "Envoy alone", BodyBytes: 1024, SerialP50: ms, P50: ms, P99: 2 * ms, Throughput: 1000, Requests: 500, EnvoyCPUPerRequest: 50 * us},
			{Name: "tether sticky, content on", BodyBytes: 1024, OnPath: true, Content: true, SerialP50: 2 * ms, Rate: 300, P50: 3 * ms, P99: 3 * ms,
				Throughput: 500, Requests: 250, EnvoyCPUPerRequest: 90 * us, TetherCPUPerRequest: 70 * us, Decisions: 250,
				ContentResults: map[string]float64{"placed": 240, "identity": 10}},
			{Name: "Envoy alone", BodyBytes: 400 << 10, SerialP50: 4 * ms, Throughput: 200},
			{Name: "tether sticky, content off", BodyBytes: 400 << 10, OnPath: true, SerialP50: 5 * ms, Throughput: 100, Decisions: 9},
		}}
	md := r.Markdown(Meta{Command: "cmd", Commit: "abc", Machine: "m"}, nil)
	for _, want := range []string{"#### With a chat body",
		"| tether sticky, content on | 1 KB (1024 B) | 2.00 ms | 0.00 ms | 1.00 ms | 0.00 ms | 300/s | 3.00 ms | 3.00 ms | 2.00 ms | 1.00 ms | 0 | 0 |",
		"| tether sticky, content on | 1 KB (1024 B) | 250 | 500/s | 0.50 | 90 µs | 70 µs | 250 of 250 (placed 240, identity 10) |",
		// Each size against Envoy alone with the same body.
		"| tether sticky, content off | 400 KB (409600 B) | 5.00 ms | 0.00 ms | 1.00 ms |",
		"| tether sticky, content off | 400 KB (409600 B) | 0 | 100/s | 0.50 | 0 µs | 0 µs | 0 of 9 |",
		"| Envoy alone | 1 KB (1024 B) | 500 | 1000/s | 1.00 | 50 µs | – | – |"} {
		if !strings.Contains(md, want) {
			t.Errorf("markdown lacks %q", want)
		}
	}
	if d := cmp.Diff(250, r.Bodies[1].BodiesRead()); d != "" {
		t.Error(d)
	}
}
