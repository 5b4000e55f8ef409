package extproc_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/rs/zerolog"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/extproc"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
)

// answers is a Decider that routes everything to one instance and keeps
// the answers it hears.
type answers struct {
	mu  sync.Mutex
	got []fleet.Outcome
}

var chosen = fleet.Instance{Name: "a", Address: "127.0.0.1:8001", Weight: 1}

func (a *answers) Decide(context.Context, affinity.Request) (affinity.Decision, error) {
	return affinity.Decision{Instance: chosen, Mode: affinity.Sticky, Kind: affinity.KindHit}, nil
}

func (a *answers) Refine(_ context.Context, d affinity.Decision, _ []uint64) affinity.Decision {
	return d
}

func (a *answers) Finish(_ affinity.Decision, ans fleet.Outcome) {
	a.mu.Lock()
	a.got = append(a.got, ans)
	a.mu.Unlock()
}

func withUpstream(m *extprocv3.ProcessingRequest, addr string) *extprocv3.ProcessingRequest {
	attrs := map[string]any{extproc.AttrResponseCode: 503.0}
	if addr != "" {
		attrs[extproc.AttrUpstreamAddress] = addr
	}
	st, _ := structpb.NewStruct(attrs)
	m.Attributes = map[string]*structpb.Struct{"envoy.filters.http.ext_proc": st}
	return m
}

// TestAnswersCountedAgainstTheInstance: which answers the breaker hears as
// the chosen instance's failures (docs/envoy-replies.md).
func TestAnswersCountedAgainstTheInstance(t *testing.T) {
	ids, err := identity.New(identity.Config{Secret: []byte("0123456789abcdef")})
	if err != nil {
		t.Fatal(err)
	}
	dec := &answers{}
	c := serve(t, extproc.New(ids, dec, &recorded{}, extproc.Options{ClusterHeader: "x-tether-cluster", QueueHeader: "x-queue-depth", Logger: zerolog.Nop()}))
	req := reqHeaders(":path", "/v1/chat/completions", "x-session-id", "s1")
	for _, tc := range []struct {
		name             string
		resp             *extprocv3.ProcessingRequest
		answered, failed bool
	}{
		{"200 from the instance", withUpstream(respHeaders(":status", "200", "x-queue-depth", "3"), "127.0.0.1:8001"), true, false},
		{"500 from the instance", withUpstream(respHeaders(":status", "500"), "127.0.0.1:8001"), true, true},
		{"507 out of memory", respHeaders(":status", "507"), true, true},
		{"Envoy's 503 connect failure (no upstream attribute known)", respHeaders(":status", "503"), true, true},
		{"Envoy's 504 timeout", withUpstream(respHeaders(":status", "504"), "127.0.0.1:8001"), true, true},
		{"Envoy's overflow 503", respHeaders(":status", "503", "x-envoy-overloaded", "true"), false, false},
		{"Envoy's 503 with no host picked (NC, UH)", withUpstream(respHeaders(":status", "503"), ""), false, false},
		{"200 from a peer after a retry", withUpstream(respHeaders(":status", "200"), "127.0.0.1:8002"), true, true},
		{"200 from the instance over IPv4-mapped IPv6", withUpstream(respHeaders(":status", "200"), "[::ffff:127.0.0.1]:8001"), true, false},
		{"garbage attribute", withUpstream(respHeaders(":status", "200"), "not an address"), true, true},
		{"4xx is the client's", withUpstream(respHeaders(":status", "429"), "127.0.0.1:8001"), true, false},
		{"status missing", respHeaders("x-other", "1"), true, false},
	} {
		dec.mu.Lock()
		dec.got = nil
		dec.mu.Unlock()
		exchange(t, c, req, tc.resp)
		dec.mu.Lock()
		got := dec.got
		dec.mu.Unlock()
		if len(got) != 1 || got[0].Answered != tc.answered || got[0].Failed != tc.failed {
			t.Errorf("%s: answers %+v, want one with answered=%v failed=%v", tc.name, got, tc.answered, tc.failed)
		}
	}
	// A stream that ends without response headers is not an answer.
	dec.mu.Lock()
	dec.got = nil
	dec.mu.Unlock()
	exchange(t, c, req)
	// The server finishes it when it sees the stream end, after the reply.
	deadline := time.Now().Add(5 * time.Second)
	for {
		dec.mu.Lock()
		n := len(dec.got)
		dec.mu.Unlock()
		if n > 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Millisecond)
	}
	dec.mu.Lock()
	defer dec.mu.Unlock()
	if len(dec.got) != 1 || dec.got[0].Answered || dec.got[0].Failed {
		t.Errorf("unanswered stream: %+v", dec.got)
	}
}

// refusing is a Decider whose decisions fail with err.
type refusing struct{ err error }

func (r refusing) Decide(context.Context, affinity.Request) (affinity.Decision, error) {
	return affinity.Decision{}, r.err
}
func (refusing) Finish(affinity.Decision, fleet.Outcome) {}

func (refusing) Refine(_ context.Context, d affinity.Decision, _ []uint64) affinity.Decision {
	return d
}

// TestRefusals: the two errors that must not fall to Envoy's default route
// (it would change the session's model, or its instance against the
// operator's fallback_policy) become a 503 with a body that says why.
func TestRefusals(t *testing.T) {
	ids, err := identity.New(identity.Config{Secret: []byte("0123456789abcdef")})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		err  error
		body []string
	}{
		{fmt.Errorf("%w: gpu-3 (fallback_policy = \"none\")", affinity.ErrInstanceUnavailable), []string{"unavailable", "gpu-3", `fallback_policy = "none"`}},
		{fmt.Errorf("%w %q", affinity.ErrNoVersion, "v1"), []string{"model version", `"v1"`, `version_affinity = "strict"`}},
	} {
		rec := &recorded{}
		c := serve(t, extproc.New(ids, refusing{tc.err}, rec, extproc.Options{ClusterHeader: "x-tether-cluster", Logger: zerolog.Nop()}))
		got := exchange(t, c, reqHeaders(":path", "/v1/chat/completions", "x-session-id", "s1"))
		im := got[0].GetImmediateResponse()
		if im == nil || im.GetStatus().GetCode() != 503 {
			t.Fatalf("%v: reply %v, want an immediate 503", tc.err, got[0])
		}
		for _, want := range tc.body {
			if !strings.Contains(string(im.GetBody()), want) {
				t.Errorf("%v: body %q lacks %q", tc.err, im.GetBody(), want)
			}
		}
		if len(rec.failures) != 1 {
			t.Errorf("%v: failures recorded %v", tc.err, rec.failures)
		}
	}
}
