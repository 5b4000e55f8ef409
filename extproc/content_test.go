package extproc_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	extprocv3filter "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/extproc"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/prefix"
	"github.com/tetherproxy/tether/store/memory"
)

func reqBody(body []byte, end bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: end}}}
}

func chatBody(doc, question string) []byte {
	b, _ := json.Marshal(map[string]any{"model": "m", "messages": []map[string]string{
		{"role": "system", "content": doc}, {"role": "user", "content": question}}})
	return b
}

// TestBodyOnlyWhenPlacementIsOpen: a new session's headers reply routes it
// by identity and asks for the body (the whole processing mode, body
// BUFFERED_PARTIAL); the reply to the body moves the route to where the
// prompt is; the session's next turn is a hit, answered from its headers
// with no body asked; a body over the limit keeps the identity route.
func TestBodyOnlyWhenPlacementIsOpen(t *testing.T) {
	ids, err := identity.New(identity.Config{Secret: []byte("0123456789abcdef")})
	if err != nil {
		t.Fatal(err)
	}
	four := []fleet.Instance{{Name: "a", Weight: 1}, {Name: "b", Weight: 1}, {Name: "c", Weight: 1}, {Name: "d", Weight: 1}}
	index := prefix.NewIndex(1 << 16)
	dec := affinity.New(memory.New(), fleet.New(four), affinity.Policy{
		Mode: affinity.Sticky, Lifetime: bindings.Lifetime{Idle: time.Hour}, Epsilon: 0.25,
		Content: affinity.Content{Enabled: true, MinBlocks: 2, BlockTokens: 16, QueuedTokens: 1024, RunningTokens: 128},
	}, affinity.WithPrefixIndex(index))
	hasher, err := prefix.NewHasher(64, 0)
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorded{}
	c := serve(t, extproc.New(ids, dec, rec, extproc.Options{
		ClusterHeader: "x-tether-cluster", Logger: zerolog.Nop(), Prompts: hasher, MaxBody: 8 << 10,
	}))
	doc := strings.Repeat("a shared document ", 100)
	chain, _ := hasher.Chain(nil, chatBody(doc, "q"))
	index.Record("c", chain, time.Now())

	got := exchange(t, c, reqHeaders(":path", "/v1/chat/completions", "x-session-id", "s1"), reqBody(chatBody(doc, "first question?"), true))
	mo := got[0].GetModeOverride()
	want := &extprocv3filter.ProcessingMode{
		RequestHeaderMode: extprocv3filter.ProcessingMode_SEND, ResponseHeaderMode: extprocv3filter.ProcessingMode_SEND,
		RequestBodyMode: extprocv3filter.ProcessingMode_BUFFERED_PARTIAL, ResponseBodyMode: extprocv3filter.ProcessingMode_NONE,
		RequestTrailerMode: extprocv3filter.ProcessingMode_SKIP, ResponseTrailerMode: extprocv3filter.ProcessingMode_SKIP,
	}
	if mo.String() != want.String() {
		t.Fatalf("mode override %v, want %v", mo, want)
	}
	if got[0].GetRequestHeaders().GetResponse().GetHeaderMutation() == nil {
		t.Fatal("the headers reply sets no route: identity must route it until the body decides")
	}
	body := got[1].GetRequestBody().GetResponse()
	if !body.GetClearRouteCache() && len(body.GetHeaderMutation().GetSetHeaders()) == 0 {
		// Identity chose c itself: nothing to move.
		if first := string(got[0].GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders()[0].GetHeader().GetRawValue()); first != "inst-c" {
			t.Fatalf("body reply keeps %s, want a move to inst-c", first)
		}
	} else if v := string(body.GetHeaderMutation().GetSetHeaders()[0].GetHeader().GetRawValue()); v != "inst-c" || !body.GetClearRouteCache() {
		t.Fatalf("body reply routes to %q (clear %v), want inst-c with clear_route_cache", v, body.GetClearRouteCache())
	}

	next := exchange(t, c, reqHeaders(":path", "/v1/chat/completions", "x-session-id", "s1"))
	if next[0].GetModeOverride() != nil {
		t.Error("a hit asks for its body")
	}
	if v := string(next[0].GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders()[0].GetHeader().GetRawValue()); v != "inst-c" {
		t.Errorf("the next turn went to %s, want inst-c where the session was bound", v)
	}

	long := chatBody(strings.Repeat("x", 10<<10), "q")
	over := exchange(t, c, reqHeaders(":path", "/v1/chat/completions", "x-session-id", "s2"), reqBody(long, true))
	if m := over[1].GetRequestBody().GetResponse(); m != nil {
		t.Errorf("a body over the limit re-routed: %v", m)
	}
	// A stream that ends before its body (a client gone mid-body, an
	// Envoy that ignores the override): the headers reply's route stood.
	cut := exchange(t, c, reqHeaders(":path", "/v1/chat/completions", "x-session-id", "s4"))
	if cut[0].GetModeOverride() == nil {
		t.Fatal("a new session's body was not asked for")
	}
	gz := exchange(t, c, reqHeaders(":path", "/v1/chat/completions", "x-session-id", "s3", "content-encoding", "gzip"))
	if gz[0].GetModeOverride() != nil {
		t.Error("a compressed body was asked for")
	}
	waitUntil(t, func() bool {
		rec.mu.Lock()
		defer rec.mu.Unlock()
		return rec.content[extproc.ContentIncomplete] == 1
	})
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if rec.content[extproc.ContentPlaced] != 1 || rec.content[extproc.ContentOverLimit] != 1 || rec.content[extproc.ContentEncoded] != 1 {
		t.Errorf("content results %v, want placed, over_limit, encoded and incomplete once each", rec.content)
	}
}

// waitUntil polls cond for up to five seconds: a stream's end reaches the
// server after the client has closed it.
func waitUntil(t *testing.T, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 5s")
		}
	}
}
