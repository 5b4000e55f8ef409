package extproc

import (
	"strings"
	"testing"
)

func TestUsageOf(t *testing.T) {
	sse := func(events ...string) string {
		var b strings.Builder
		for _, e := range events {
			b.WriteString("data: " + e + "\n\n")
		}
		return b.String() + "data: [DONE]\n\n"
	}
	for _, tc := range []struct {
		name string
		body string
		want Usage
		ok   bool
	}{
		{"a JSON answer", `{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":120,"completion_tokens":8,"total_tokens":128,"prompt_tokens_details":{"cached_tokens":96}}}`, Usage{120, 96}, true},
		{"no cached details", `{"usage":{"prompt_tokens":7,"completion_tokens":1}}`, Usage{7, 0}, true},
		{"cached details null", `{"usage":{"prompt_tokens":7,"prompt_tokens_details":null}}`, Usage{7, 0}, true},
		{"a stream's last event", sse(`{"choices":[{"delta":{"content":"a"}}],"usage":null}`, `{"choices":[],"usage":{"prompt_tokens":50,"prompt_tokens_details":{"cached_tokens":48}}}`), Usage{50, 48}, true},
		{"a stream without usage", sse(`{"choices":[{"delta":{"content":"a"}}]}`), Usage{}, false},
		{"usage null only", sse(`{"choices":[],"usage":null}`), Usage{}, false},
		{"usage quoted in the content", `{"choices":[{"message":{"content":"the \"usage\":{\"prompt_tokens\":9} field"}}]}`, Usage{}, false},
		{"cut mid-object", `{"usage":{"prompt_tokens":12,"prompt_tok`, Usage{}, false},
		{"not a number", `{"usage":{"prompt_tokens":"many"}}`, Usage{}, false},
		{"braces in a string inside", `{"usage":{"note":"}{","prompt_tokens":3}}`, Usage{3, 0}, true},
		{"empty", ``, Usage{}, false},
	} {
		u, ok := usageOf([]byte(tc.body))
		if u != tc.want || ok != tc.ok {
			t.Errorf("%s: %+v, %v; want %+v, %v", tc.name, u, ok, tc.want, tc.ok)
		}
	}
}

// TestTailKeepsTheEnd: chunks of any size leave the last usageTail bytes,
// so a usage object split across chunks is found whole.
func TestTailKeepsTheEnd(t *testing.T) {
	body := strings.Repeat("x", 3*usageTail) + `{"usage":{"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":4}}}`
	for _, size := range []int{1, 7, 100, usageTail - 1, usageTail, 2*usageTail + 3} {
		var tl tail
		for i := 0; i < len(body); i += size {
			tl.add([]byte(body[i:min(i+size, len(body))]))
		}
		if len(tl.b) > usageTail || !strings.HasSuffix(body, string(tl.b)) || len(tl.b) != usageTail {
			t.Fatalf("chunks of %d: kept %d bytes, not the body's end", size, len(tl.b))
		}
		if u, ok := usageOf(tl.b); !ok || u != (Usage{5, 4}) {
			t.Errorf("chunks of %d: %+v, %v", size, u, ok)
		}
	}
}
