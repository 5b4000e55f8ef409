//go:build e2e

package e2e

import (
	"bytes"
	"compress/gzip"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/tetherproxy/tether/internal/testenv"
)

// document is a long shared text (a system prompt or a retrieved
// document), n words.
func document(seed, n int) string {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, "d%d-w%d ", seed, i)
	}
	return b.String()
}

// chatBody is a chat request: the document as system prompt, then the
// turns (user, assistant, user, ...).
func chatBody(doc string, turns ...string) []byte {
	type message struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	msgs := []message{{"system", doc}}
	for i, t := range turns {
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		msgs = append(msgs, message{role, t})
	}
	b, err := json.Marshal(map[string]any{"model": "v1", "messages": msgs, "max_tokens": 4})
	if err != nil {
		panic(err)
	}
	return b
}

// post sends body through Envoy with headers h (k, v pairs).
func post(t *testing.T, p *proxy, body []byte, h ...string) answer {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, p.url+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(h); i += 2 {
		req.Header.Set(h[i], h[i+1])
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		t.Fatal(err)
	}
	return answer{status: resp.StatusCode, instance: resp.Header.Get("x-instance"),
		decision: resp.Header.Get("x-tether-decision"), tethered: resp.Header.Get("x-tether-instance")}
}

// TestContentPlacementThroughEnvoy: with [content] on, Envoy sends tether
// the body of a new session's or an anonymous caller's request only
// (mode_override), tether re-routes it from its reply to the body
// (clear_route_cache) to the instance holding its prompt's prefix, and a
// hit stays header-only. Bad bodies go where identity placed them,
// counted, and never fail the request.
func TestContentPlacementThroughEnvoy(t *testing.T) {
	rds := testenv.RedisServer(t)
	inst := startFleet(t, 4)
	cfg := baseConfig(rds.URL(), inst)
	cfg.Content.Enabled = true
	cfg.Content.MaxBodyBytes = 64 << 10
	tt := startTether(t, cfg)
	px := startEnvoy(t, cfg, tt.extproc)
	content := func(result string) float64 {
		return tt.metric(t, "tether_content_decisions_total", fmt.Sprintf("result=%q", result))
	}

	doc := document(1, 1500) // about 12 KB
	first := post(t, px, chatBody(doc, "what does it say?"), "x-session-id", "content-s0")
	if first.status != 200 || first.decision != "bind" || first.instance != first.tethered {
		t.Fatalf("first session: %+v", first)
	}
	home := first.instance

	// New sessions opening with the same document go where it is cached,
	// whichever instance their identity hashes to.
	for i := 1; i <= 6; i++ {
		a := post(t, px, chatBody(doc, fmt.Sprintf("question %d?", i)), "x-session-id", fmt.Sprintf("content-s%d", i))
		if a.status != 200 || a.decision != "bind" || a.instance != home || a.tethered != home {
			t.Fatalf("session %d: %+v, want bound on %s, where the document is", i, a, home)
		}
	}
	placed := content("placed")
	if placed < 6 {
		t.Errorf("tether_content_decisions_total{result=\"placed\"} = %v, want at least 6", placed)
	}
	// Their follow-ups are hits, answered from the headers: no body asked.
	before := placed + content("identity")
	for i := 1; i <= 6; i++ {
		a := post(t, px, chatBody(doc, fmt.Sprintf("question %d?", i), "an answer", "and then?"), "x-session-id", fmt.Sprintf("content-s%d", i))
		if a.status != 200 || a.decision != "hit" || a.instance != home {
			t.Fatalf("session %d follow-up: %+v", i, a)
		}
	}
	if after := content("placed") + content("identity"); after != before {
		t.Errorf("hits asked for %v bodies, want none", after-before)
	}

	// An anonymous caller's requests are placed by content each time:
	// the document's instance, then its own follow-up there too.
	other := document(2, 1500)
	anon := post(t, px, chatBody(other, "summarise"))
	if anon.status != 200 || anon.decision != "anonymous" {
		t.Fatalf("anonymous: %+v", anon)
	}
	for i := range 5 {
		a := post(t, px, chatBody(other, "summarise", "a summary", fmt.Sprintf("more on point %d", i)))
		if a.status != 200 || a.instance != anon.instance {
			t.Fatalf("anonymous follow-up %d went to %s, its first turn to %s", i, a.instance, anon.instance)
		}
	}

	// Bad bodies: placed by identity, counted by reason, the request
	// answered by the instance whatever tether thought of its body.
	for _, c := range []struct {
		result string
		body   []byte
		header []string
	}{
		{"not_json", []byte("model=v1&prompt=" + doc[:2000]), nil},
		{"not_prompt", []byte(`{"model":"v1","input":"` + doc[:2000] + `"}`), nil},
		{"bad_messages", []byte(`{"model":"v1","messages":[]}`), nil},
		{"short", chatBody("hi", "there"), nil},
		{"over_limit", chatBody(document(3, 12000), "too long"), nil},
		{"encoded", gzipped(t, chatBody(doc, "zipped")), []string{"content-encoding", "gzip"}},
	} {
		was := content(c.result)
		h := append([]string{"x-session-id", "bad-" + c.result}, c.header...)
		a := post(t, px, c.body, h...)
		if a.status == 0 || a.decision != "bind" || a.instance != a.tethered {
			t.Errorf("%s: %+v, want the identity placement's answer", c.result, a)
		}
		if got := content(c.result); got != was+1 {
			all := map[string]float64{}
			for _, r := range []string{"placed", "identity", "incomplete", "over_limit", "not_json", "short", "encoded"} {
				all[r] = content(r)
			}
			t.Errorf("%s counted %v times, want once (%v)", c.result, got-was, all)
		}
	}
	// The one that fit the limit but was long: answered, not refused.
	if a := post(t, px, chatBody(document(4, 12000), "still long"), "x-session-id", "long-2"); a.status != 200 {
		t.Errorf("a body over max_body_bytes: status %d, want the instance's 200", a.status)
	}
	// Every request moved by its body ended on the instance it went to:
	// the reply to the body's ticket replaced the headers reply's.
	waitFor(t, 10*time.Second, "no request left in flight", func() bool { return tt.metric(t, "tether_instance_in_flight") == 0 })
}

func gzipped(t *testing.T, b []byte) []byte {
	var out bytes.Buffer
	w := gzip.NewWriter(&out)
	if _, err := w.Write(b); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return out.Bytes()
}

// TestContentSharedByReplicas: two tether replicas behind one Envoy, one
// Redis, [content] on. Anonymous callers open with a long document, and
// their follow-ups land on whichever replica Envoy picks: every one goes
// to the instance the first turn went to, because the replica that placed
// it shared the prompt's blocks (replicas.ContentShare, <prefix>content)
// and the other indexed them. Sessions opening with one of the documents
// are bound there by either replica and are hits on the other.
func TestContentSharedByReplicas(t *testing.T) {
	rds := testenv.RedisServer(t)
	inst := startFleet(t, 6)
	cfg := baseConfig(rds.URL(), inst)
	cfg.Content.Enabled = true
	cfg.Content.MaxBodyBytes = 64 << 10
	// What is tested is what each replica knows of the caches, not the
	// load's cost: back-to-back follow-ups on one instance would outweigh
	// what it holds before their finishes (and the other replica's, a load
	// sync later) are counted, and be placed by identity.
	cfg.Content.QueuedTokens, cfg.Content.RunningTokens = 0, 0
	a, b := startTether(t, cfg), startTether(t, cfg)
	px := startEnvoy(t, cfg, a.extproc, b.extproc)
	applied := func() float64 {
		return a.metric(t, "tether_content_share_records_total", `result="applied"`) +
			b.metric(t, "tether_content_share_records_total", `result="applied"`)
	}
	placed := func(p *tether) float64 {
		return p.metric(t, "tether_content_decisions_total", `result="placed"`)
	}
	// waitApplied waits until the replicas together applied n records of
	// each other's: a record is shared about 20 ms after its decision.
	waitApplied := func(n float64) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for applied() < n {
			if time.Now().After(deadline) {
				t.Fatalf("the replicas applied %v of each other's records, want %v", applied(), n)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}

	const docs, follows = 8, 6
	homes := map[int]string{}
	recorded := 0.0
	for d := range docs {
		doc := document(100+d, 1500) // about 12 KB
		first := post(t, px, chatBody(doc, "summarise"))
		if first.status != 200 || first.decision != "anonymous" {
			t.Fatalf("document %d, first turn: %+v", d, first)
		}
		homes[d] = first.instance
		recorded++
		waitApplied(recorded)
		for i := range follows {
			f := post(t, px, chatBody(doc, "summarise", "a summary", fmt.Sprintf("and point %d?", i)))
			if f.status != 200 || f.instance != homes[d] {
				for n, p := range map[string]*tether{"A": a, "B": b} {
					t.Logf("replica %s: placed %v identity %v; share published %v applied %v; index blocks on %s: %v, capacity %v", n,
						placed(p), p.metric(t, "tether_content_decisions_total", `result="identity"`),
						p.metric(t, "tether_content_share_records_total", `result="published"`),
						p.metric(t, "tether_content_share_records_total", `result="applied"`), homes[d],
						p.metric(t, "tether_prefix_index_blocks", fmt.Sprintf("upstream=%q", homes[d])),
						p.metric(t, "tether_prefix_index_capacity_blocks", fmt.Sprintf("upstream=%q", homes[d])))
				}
				t.Fatalf("document %d, follow-up %d: %+v, its first turn went to %s", d, i, f, homes[d])
			}
			recorded++
			waitApplied(recorded)
		}
	}
	// Both replicas placed follow-ups by content: each used what the other
	// shared, not only its own records.
	pa, pb := placed(a), placed(b)
	if pa == 0 || pb == 0 || pa+pb < docs*follows {
		t.Errorf("placed by content: replica A %v, B %v; want both > 0, %d in all", pa, pb, docs*follows)
	}
	t.Logf("%d documents, %d follow-ups each, all on their first turn's instance; placed by content: A %v, B %v",
		docs, follows, pa, pb)

	// A session opening with a document is bound where it is, by either
	// replica, and its next turn is a hit, on either.
	for s := range 6 {
		d := s % docs
		doc := document(100+d, 1500)
		h := []string{"x-session-id", fmt.Sprintf("shared-s%d", s)}
		first := post(t, px, chatBody(doc, "hello"), h...)
		if first.status != 200 || first.decision != "bind" || first.instance != homes[d] {
			t.Fatalf("session %d: %+v, want bound on %s, where its document is", s, first, homes[d])
		}
		for i := range 3 {
			f := post(t, px, chatBody(doc, "hello", "hi", fmt.Sprintf("turn %d", i)), h...)
			if f.status != 200 || f.decision != "hit" || f.instance != homes[d] {
				t.Fatalf("session %d, turn %d: %+v", s, i, f)
			}
		}
	}
	for _, p := range []*tether{a, b} {
		if bad := p.metric(t, "tether_content_share_bad_messages_total"); bad != 0 {
			t.Errorf("bad content-share messages: %v", bad)
		}
	}
}
