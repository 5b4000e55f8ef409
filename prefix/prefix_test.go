package prefix

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"
)

// chat returns a chat request body with the given messages (role, content
// pairs), as an OpenAI client sends it.
func chat(model string, msgs ...string) []byte {
	type message struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	req := struct {
		Model    string    `json:"model"`
		Messages []message `json:"messages"`
		Stream   bool      `json:"stream"`
	}{Model: model, Stream: true}
	for i := 0; i+1 < len(msgs); i += 2 {
		req.Messages = append(req.Messages, message{msgs[i], msgs[i+1]})
	}
	b, err := json.Marshal(req)
	if err != nil {
		panic(err)
	}
	return b
}

func words(seed, n int) string {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, "w%d-%d ", seed, i)
	}
	return b.String()
}

func hasher(t testing.TB, size int) *Hasher {
	t.Helper()
	h, err := NewHasher(size, 0)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

func TestChainSharesExactlyTheSharedBlocks(t *testing.T) {
	h := hasher(t, 64)
	system := words(1, 200) // ~1.7 KB
	a, r := h.Chain(nil, chat("m", "system", system, "user", words(2, 50)))
	if r != "" {
		t.Fatal(r)
	}
	b, _ := h.Chain(nil, chat("m", "system", system, "user", words(3, 50)))
	// A follow-up: the same conversation, two more messages.
	c, _ := h.Chain(nil, chat("m", "system", system, "user", words(2, 50), "assistant", words(4, 30), "user", "and then?"))
	shared := func(x, y []uint64) int {
		n := 0
		for n < min(len(x), len(y)) && x[n] == y[n] {
			n++
		}
		return n
	}
	// "m\0system\0" + the system prompt fill about len(system)/64 blocks.
	if n, want := shared(a, b), (len("m")+1+len("system")+1+len(system))/64; n != want {
		t.Errorf("two conversations of one system prompt share %d blocks, want %d", n, want)
	}
	if n := shared(a, c); n != len(a) {
		t.Errorf("a follow-up shares %d of its first turn's %d blocks, want all", n, len(a))
	}
	other, _ := h.Chain(nil, chat("other-model", "system", system, "user", words(2, 50)))
	if shared(a, other) != 0 {
		t.Error("another model's prompt shares blocks")
	}
	// The engine sees the text, not its escaping.
	esc := []byte(`{"model":"m","messages":[{"role":"system","content":"\u0041` + system[1:] + `"},{"role":"user","content":"` + words(2, 50) + `"}]}`)
	plain := []byte(`{"model":"m","messages":[{"role":"system","content":"A` + system[1:] + `"},{"role":"user","content":"` + words(2, 50) + `"}]}`)
	e, _ := h.Chain(nil, esc)
	p, _ := h.Chain(nil, plain)
	if !slices.Equal(e, p) {
		t.Error("an escaped character changes the chain")
	}
}

func TestChainSaltAndPartsAndCompletions(t *testing.T) {
	h := hasher(t, 64)
	text := words(7, 100)
	base := `{"model":"m","messages":[{"role":"user","content":"` + text + `"}]}`
	salted := `{"model":"m","cache_salt":"tenant-a","messages":[{"role":"user","content":"` + text + `"}]}`
	parts := `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"` + text + `"}]}]}`
	image := `{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x/cat.png"}},{"type":"text","text":"` + text + `"}]}]}`
	a, _ := h.Chain(nil, []byte(base))
	s, _ := h.Chain(nil, []byte(salted))
	p, _ := h.Chain(nil, []byte(parts))
	i, _ := h.Chain(nil, []byte(image))
	if len(a) == 0 || a[0] == s[0] {
		t.Error("a cache_salt does not set a prompt apart")
	}
	if !slices.Equal(a, p) {
		t.Error("a text given as one part hashes unlike the same text as a string")
	}
	if len(i) == 0 || i[0] == a[0] {
		t.Error("an image before the text changes nothing")
	}
	comp, r := h.Chain(nil, []byte(`{"model":"m","prompt":"`+text+`"}`))
	if r != "" || len(comp) == 0 {
		t.Errorf("completions prompt: %d blocks, reason %q", len(comp), r)
	}
}

func TestChainReasons(t *testing.T) {
	h := hasher(t, 64)
	long := words(1, 100)
	for _, c := range []struct {
		name, body string
		want       Reason
	}{
		{"empty body", ``, ReasonNotJSON},
		{"not json", `model=m&prompt=hi`, ReasonNotJSON},
		{"truncated", `{"model":"m","messages":[{"role":"user","content":"` + long[:90], ReasonNotJSON},
		{"gzip magic", "\x1f\x8b\x08\x00\x00\x00\x00\x00", ReasonNotJSON},
		{"array", `[1,2,3]`, ReasonNotPrompt},
		{"string", `"hello"`, ReasonNotPrompt},
		{"embeddings", `{"model":"m","input":"` + long + `"}`, ReasonNotPrompt},
		{"token prompt", `{"model":"m","prompt":[1,2,3]}`, ReasonNotPrompt},
		{"empty messages", `{"model":"m","messages":[]}`, ReasonBadMessages},
		{"messages object", `{"model":"m","messages":{"role":"user"}}`, ReasonBadMessages},
		{"messages string", `{"model":"m","messages":"hi"}`, ReasonBadMessages},
		{"message not object", `{"model":"m","messages":["hi"]}`, ReasonBadMessages},
		{"no role", `{"model":"m","messages":[{"content":"` + long + `"}]}`, ReasonBadMessages},
		{"numeric content", `{"model":"m","messages":[{"role":"user","content":5}]}`, ReasonBadMessages},
		{"part not object", `{"model":"m","messages":[{"role":"user","content":["x"]}]}`, ReasonBadMessages},
		{"short", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, ReasonShort},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, r := h.Chain(nil, []byte(c.body))
			if r != c.want || (r != "" && len(got) != 0) {
				t.Errorf("reason %q with %d blocks, want %q", r, len(got), c.want)
			}
		})
	}
}

func TestChainIsBounded(t *testing.T) {
	h, err := NewHasher(64, 10)
	if err != nil {
		t.Fatal(err)
	}
	c, _ := h.Chain(nil, chat("m", "user", words(1, 5000)))
	if len(c) != 10 {
		t.Errorf("%d blocks, want the bound, 10", len(c))
	}
	// Appending to a chain already holding blocks bounds the new ones.
	c2, _ := h.Chain(make([]uint64, 3), chat("m", "user", words(1, 5000)))
	if len(c2) != 13 {
		t.Errorf("%d blocks after 3, want 13", len(c2))
	}
	for _, bad := range [][2]int{{8, 1}, {1 << 17, 1}, {64, -1}} {
		if _, err := NewHasher(bad[0], bad[1]); err == nil {
			t.Errorf("NewHasher(%d, %d): no error", bad[0], bad[1])
		}
	}
}

func TestIndexMatchesTheLongestHeldPrefix(t *testing.T) {
	x := NewIndex(1000)
	now := time.Unix(0, 0)
	x.Record("a", []uint64{1, 2, 3, 4}, now)
	x.Record("b", []uint64{1, 2, 9}, now)
	x.Record("c", []uint64{7, 8}, now)
	depth := make([]int, 4)
	best := x.Match([]uint64{1, 2, 3, 5}, []string{"a", "b", "c", "unknown"}, depth)
	if best != 3 || !slices.Equal(depth, []int{3, 2, 0, 0}) {
		t.Errorf("best %d, depths %v; want 3, [3 2 0 0]", best, depth)
	}
	// Only candidates count.
	if best := x.Match([]uint64{1, 2, 3}, []string{"b"}, depth[:1]); best != 2 || depth[0] != 2 {
		t.Errorf("b alone: best %d depth %d, want 2", best, depth[0])
	}
	// A later block held without the earlier ones is no prefix.
	if best := x.Match([]uint64{5, 2, 3}, []string{"a"}, depth[:1]); best != 0 {
		t.Errorf("best %d for a chain whose first block nobody holds", best)
	}
	x.Forget("a")
	if best := x.Match([]uint64{1, 2, 3}, []string{"a", "b"}, depth[:2]); best != 2 || depth[0] != 0 {
		t.Errorf("after Forget(a): best %d, depths %v", best, depth[:2])
	}
}

func TestIndexEvictsLeastRecentAndMeasuresTheHorizon(t *testing.T) {
	x := NewIndex(4)
	t0 := time.Unix(100, 0)
	x.Record("a", []uint64{1, 2}, t0)
	x.Record("a", []uint64{3, 4}, t0.Add(10*time.Second))
	if _, ok := x.Horizon("a"); ok {
		t.Error("a horizon before any eviction")
	}
	// Two new blocks push out 2 then 1 (the prompt's tail goes first).
	x.Record("a", []uint64{5, 6}, t0.Add(30*time.Second))
	depth := make([]int, 1)
	if x.Match([]uint64{1}, []string{"a"}, depth) != 0 || x.Match([]uint64{3, 4}, []string{"a"}, depth) != 2 {
		t.Error("the least recent blocks were not the ones evicted")
	}
	h, ok := x.Horizon("a")
	if !ok || h != 30*time.Second {
		t.Errorf("horizon %v (%v), want 30s: the evicted blocks went unsent for 30 s", h, ok)
	}
	st := x.Stats()
	if len(st) != 1 || st[0].Blocks != 4 || st[0].Evictions != 2 || st[0].Capacity != 4 {
		t.Errorf("stats %+v", st)
	}
	// Re-sending a block makes it recent: it outlives newer ones.
	x.Record("a", []uint64{3}, t0.Add(40*time.Second))
	x.Record("a", []uint64{7, 8}, t0.Add(50*time.Second))
	if x.Match([]uint64{3}, []string{"a"}, depth) != 1 {
		t.Error("a block sent again was evicted before older ones")
	}
	x.SetCapacity("a", 1, t0.Add(60*time.Second))
	if st := x.Stats(); st[0].Blocks != 1 {
		t.Errorf("%d blocks after SetCapacity(1)", st[0].Blocks)
	}
}

// TestIndexKeepsItsLinksWhole churns many instances over shared blocks and
// checks the index against a plain model of it.
func TestIndexKeepsItsLinksWhole(t *testing.T) {
	x := NewIndex(50)
	model := map[string][]uint64{} // instance → blocks, most recent first
	names := []string{"a", "b", "c", "d"}
	now := time.Unix(0, 0)
	for i := range 5000 {
		name := names[i%len(names)]
		chain := []uint64{uint64(i % 7), uint64(100 + i%13), uint64(1000 + i%97)}
		x.Record(name, chain, now)
		for k := len(chain) - 1; k >= 0; k-- {
			l := slices.DeleteFunc(model[name], func(h uint64) bool { return h == chain[k] })
			model[name] = append([]uint64{chain[k]}, l...)
		}
		if len(model[name]) > 50 {
			model[name] = model[name][:50]
		}
		if i%250 == 0 {
			x.Forget(names[(i/250)%len(names)])
			model[names[(i/250)%len(names)]] = nil
		}
	}
	depth := make([]int, 1)
	for _, name := range names {
		for h := range uint64(1100) {
			got := x.Match([]uint64{h}, []string{name}, depth) == 1
			if got != slices.Contains(model[name], h) {
				t.Fatalf("instance %s block %d: index says %v", name, h, got)
			}
		}
	}
}

func FuzzChain(f *testing.F) {
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":"` + words(1, 40) + `"}]}`))
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"héllo \ud83d\ude00 wörld ` + words(2, 30) + `"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}]}`))
	f.Add([]byte(`{"model":"m","prompt":"\u0000\uffff\ud800 ` + words(3, 30) + `"}`))
	f.Add([]byte(`{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]}]}`))
	f.Add([]byte(`{"messages":[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]}`))
	f.Add([]byte("\xff\xfe{\"model\":1}"))
	h := hasher(f, 16)
	f.Fuzz(func(t *testing.T, body []byte) {
		keep := slices.Clone(body)
		a, r := h.Chain(nil, body)
		if !slices.Equal(body, keep) {
			t.Fatal("Chain changed the body")
		}
		if r != "" && len(a) != 0 {
			t.Fatalf("reason %q with %d blocks", r, len(a))
		}
		if r == "" && len(a) == 0 {
			t.Fatal("no reason and no blocks")
		}
		b, r2 := h.Chain(nil, body)
		if r != r2 || !slices.Equal(a, b) {
			t.Fatal("two chains of one body differ")
		}
		if len(a) > DefaultMaxBlocks {
			t.Fatalf("%d blocks, over the bound", len(a))
		}
	})
}
