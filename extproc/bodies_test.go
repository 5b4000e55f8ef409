package extproc_test

import (
	"context"
	"fmt"
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

// describe names a reply for the tests: its phase, and for a body what it
// carries.
func describe(r *extprocv3.ProcessingResponse) string {
	switch v := r.GetResponse().(type) {
	case *extprocv3.ProcessingResponse_RequestHeaders:
		if v.RequestHeaders.GetResponse().GetClearRouteCache() {
			return "route"
		}
		return "headers"
	case *extprocv3.ProcessingResponse_RequestBody:
		if s := v.RequestBody.GetResponse().GetBodyMutation().GetStreamedResponse(); s != nil {
			return fmt.Sprintf("echo %d %v", len(s.GetBody()), s.GetEndOfStream())
		}
		return "body"
	case *extprocv3.ProcessingResponse_ResponseHeaders:
		return "response"
	case *extprocv3.ProcessingResponse_ResponseBody:
		if s := v.ResponseBody.GetResponse().GetBodyMutation().GetStreamedResponse(); s != nil {
			return fmt.Sprintf("response echo %d %v", len(s.GetBody()), s.GetEndOfStream())
		}
		return "response body"
	case *extprocv3.ProcessingResponse_RequestTrailers:
		return "trailers"
	case *extprocv3.ProcessingResponse_ImmediateResponse:
		return fmt.Sprintf("immediate %d", v.ImmediateResponse.GetStatus().GetCode())
	}
	return "?"
}

// TestBodyModes drives one stream per case in each body mode a gateway
// configures, and checks the replies in order. A hit never waits for its
// body; a request its body places gets its headers reply when the body
// has come; every chunk of a streamed body comes back unchanged, in
// order; nothing is left pending.
func TestBodyModes(t *testing.T) {
	ids, err := identity.New(identity.Config{Secret: []byte("0123456789abcdef")})
	if err != nil {
		t.Fatal(err)
	}
	hasher, err := prefix.NewHasher(64, 0)
	if err != nil {
		t.Fatal(err)
	}
	duplex := &extprocv3.ProtocolConfiguration{
		RequestBodyMode:  extprocv3filter.ProcessingMode_FULL_DUPLEX_STREAMED,
		ResponseBodyMode: extprocv3filter.ProcessingMode_FULL_DUPLEX_STREAMED,
	}
	buffered := &extprocv3.ProtocolConfiguration{RequestBodyMode: extprocv3filter.ProcessingMode_BUFFERED}
	streamed := &extprocv3.ProtocolConfiguration{RequestBodyMode: extprocv3filter.ProcessingMode_STREAMED}
	full := chatBody(strings.Repeat("a shared document ", 100), "q")
	half := len(full) / 2
	first, rest := reqBody(full[:half], false), reqBody(full[half:], true)
	chunk := func(n int, end bool) *extprocv3.ProcessingRequest { return reqBody(make([]byte, n), end) }
	chat := func(session string, pc *extprocv3.ProtocolConfiguration) *extprocv3.ProcessingRequest {
		m := reqHeaders(":path", "/v1/chat/completions", "x-session-id", session, "content-length", fmt.Sprint(len(full)))
		m.ProtocolConfig = pc
		return m
	}
	ok := withUpstream(respHeaders(":status", "200"), "127.0.0.1:9001")
	respChunk := func(n int, end bool) *extprocv3.ProcessingRequest {
		return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: make([]byte, n), EndOfStream: end}}}
	}
	trailers := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}}
	wholeEcho := fmt.Sprintf("echo %d true", len(full))

	fl := fleet.New([]fleet.Instance{{Name: "a", Address: "127.0.0.1:9001", Weight: 1}, {Name: "b", Address: "127.0.0.1:9002", Weight: 1}})
	dec := affinity.New(memory.New(), fl, affinity.Policy{
		Mode: affinity.Sticky, Lifetime: bindings.Lifetime{Idle: time.Hour},
		Content: affinity.Content{Enabled: true, MinBlocks: 2, BlockTokens: 16, QueuedTokens: 1024, RunningTokens: 128},
	}, affinity.WithPrefixIndex(prefix.NewIndex(1<<10)))
	l := &ledger{Decider: dec}
	srv := extproc.New(ids, l, &recorded{}, extproc.Options{
		ClusterHeader: "x-tether-cluster", Logger: zerolog.Nop(), Auditor: l,
		Instances: fl, Prompts: hasher, MaxBody: 4 << 10,
	})
	// A session seen once is a hit from then on: its placement is not open.
	warm := func(session string) {
		t.Helper()
		if err := srv.Process(&scriptStream{ctx: context.Background(), in: []*extprocv3.ProcessingRequest{chat(session, nil), reqBody(full, true), ok}}); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []struct {
		name string
		warm bool
		in   []*extprocv3.ProcessingRequest
		want []string
	}{
		{"duplex: a hit routes at once, each chunk echoed", true,
			[]*extprocv3.ProcessingRequest{chat("d1", duplex), chunk(10, false), chunk(20, true), ok, respChunk(5, false), respChunk(0, true)},
			[]string{"route", "echo 10 false", "echo 20 true", "response", "response echo 5 false", "response echo 0 true"}},
		{"duplex: a new session waits for its body, then routes", false,
			[]*extprocv3.ProcessingRequest{chat("d2", duplex), first, rest, ok},
			[]string{"route", wholeEcho, "response"}},
		{"duplex: a body past max_body_bytes routes by identity", false,
			[]*extprocv3.ProcessingRequest{chat("d3", duplex), chunk(3<<10, false), chunk(2<<10, false), chunk(7, true)},
			[]string{"route", fmt.Sprintf("echo %d false", 5<<10), "echo 7 true"}},
		{"duplex: trailers end the body", false,
			[]*extprocv3.ProcessingRequest{chat("d4", duplex), first, trailers},
			[]string{"route", fmt.Sprintf("echo %d false", half), "trailers"}},
		{"duplex: trailers without a body", false,
			[]*extprocv3.ProcessingRequest{chat("d5", duplex), trailers},
			[]string{"route", "echo 0 false", "trailers"}},
		{"duplex: the stream ends mid-body", false,
			[]*extprocv3.ProcessingRequest{chat("d6", duplex), first},
			nil},
		{"duplex: a response that never ends", true,
			[]*extprocv3.ProcessingRequest{chat("d7", duplex), chunk(4, true), ok, respChunk(9, false)},
			[]string{"route", "echo 4 true", "response", "response echo 9 false"}},
		{"buffered: routed at once, the body may move it", false,
			[]*extprocv3.ProcessingRequest{chat("b1", buffered), reqBody(full, true), ok},
			[]string{"route", "body", "response"}},
		{"buffered: a hit's body passes", true,
			[]*extprocv3.ProcessingRequest{chat("b2", buffered), reqBody(full, true), ok},
			[]string{"route", "body", "response"}},
		{"streamed chunks: routed by identity, chunks pass", false,
			[]*extprocv3.ProcessingRequest{chat("s1", streamed), first, rest, ok},
			[]string{"route", "body", "body", "response"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			if c.warm {
				warm(string(c.in[0].GetRequestHeaders().GetHeaders().GetHeaders()[1].GetRawValue()))
			}
			st := &scriptStream{ctx: context.Background(), in: c.in}
			if err := srv.Process(st); err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, r := range st.out {
				got = append(got, describe(r))
				if r.GetModeOverride() != nil {
					t.Errorf("a reply overrides the gateway's processing mode: %v", r)
				}
			}
			if strings.Join(got, "; ") != strings.Join(c.want, "; ") {
				t.Errorf("replies\n  %v\nwant\n  %v", got, c.want)
			}
			if a, s := srv.Pending(); a != 0 || s != 0 {
				t.Errorf("pending %d apart, %d on their stream; want none", a, s)
			}
			l.mu.Lock()
			defer l.mu.Unlock()
			if l.finished != l.decided || l.audits != l.decided {
				t.Errorf("%d decisions: %d finished, %d audited; want each once", l.decided, l.finished, l.audits)
			}
		})
	}
}
