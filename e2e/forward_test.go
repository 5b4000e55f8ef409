//go:build e2e

package e2e

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/testenv"
	"github.com/tetherproxy/tether/plan"
	"github.com/tetherproxy/tether/xds"
)

// openAIHeaders are the headers the official OpenAI Python client (1.x,
// on httpx) sends with a chat completion, but the bearer token: with
// the content length and Envoy's own (:method, :scheme, :authority,
// x-forwarded-proto, x-request-id), about twenty reach the ext_proc
// filter.
var openAIHeaders = map[string]string{
	"accept":                      "application/json",
	"accept-encoding":             "gzip, deflate",
	"content-type":                "application/json",
	"user-agent":                  "OpenAI/Python 1.54.3",
	"x-stainless-arch":            "x64",
	"x-stainless-async":           "false",
	"x-stainless-lang":            "python",
	"x-stainless-os":              "Linux",
	"x-stainless-package-version": "1.54.3",
	"x-stainless-retry-count":     "0",
	"x-stainless-read-timeout":    "600",
	"x-stainless-runtime":         "CPython",
	"x-stainless-runtime-version": "3.12.3",
}

// TestForwardRulesThroughEnvoy: with the configuration's forward_rules,
// Envoy sends tether only the headers it reads, and routing is as
// before. A tap between Envoy and tether passes every stream through
// and notes the header names of each ext_proc message: identity by each
// kind of header, a rule's header and, inline, the response's status and
// reports arrive; the OpenAI client's other headers, the instances' other
// response headers and the pseudo-headers tether does not read do not.
// A rule's header added by a live edit arrives once Envoy has the new
// listener, and the one it replaced stops arriving.
func TestForwardRulesThroughEnvoy(t *testing.T) {
	rds := testenv.RedisServer(t)
	inst := startFleet(t, 4)
	for _, outcomes := range []string{xds.OutcomesAccessLog, xds.OutcomesInline, xds.OutcomesObserve} {
		t.Run("outcomes "+outcomes, func(t *testing.T) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			cfg := baseConfig(rds.URL(), inst)
			cfg.Envoy.Outcomes = outcomes
			cfg.Envoy.ExtProcEndpoints = []string{ln.Addr().String()}
			cfg.Routing.Rules = []config.Rule{{Name: "edge", Header: "x-route", Value: "edge", Mode: "random"}}
			tt := startTether(t, cfg)
			tap := startTap(t, ln, tt.extproc)
			px := startEnvoyADS(t, tt.xds)
			waitFor(t, 10*time.Second, "Envoy to route through tether", func() bool {
				a, err := tryChat(px, map[string]string{"x-session-id": "warm-up"})
				return err == nil && a.decision != ""
			})
			tap.reset()

			allowed := forwarded(t, cfg)
			callers := []struct {
				name string
				h    map[string]string
			}{
				// Each subtest's callers are its own: the store is shared.
				{"session id", map[string]string{"x-session-id": "conv-" + outcomes}},
				{"bearer token", map[string]string{"authorization": "Bearer sk-proj-" + outcomes}},
				{"device and user", map[string]string{"x-device-id": "dev-" + outcomes, "x-user-id": "user-" + outcomes}},
				{"fingerprint and user", map[string]string{"x-user-id": "fp-" + outcomes, "accept-language": "en-GB", "x-forwarded-for": "10.9.8.7"}},
			}
			for _, c := range callers {
				h := withClient(c.h)
				first := chat(t, px, h)
				again := chat(t, px, h)
				if first.status != 200 || first.decision != "bind" || again.decision != "hit" ||
					again.instance != first.instance || first.instance != first.tethered {
					t.Errorf("%s: first %+v, again %+v: want a bind, then a hit on the same instance", c.name, first, again)
				}
			}
			if a := chat(t, px, withClient(map[string]string{"x-session-id": "conv-edge", "x-route": "edge"})); a.status != 200 || a.decision != "random" {
				t.Errorf("the rule's header: %+v, want decision random", a)
			}
			got := tap.reset()
			wantSeen := []string{":path", "x-request-id", "x-session-id", "authorization", "x-device-id", "x-user-id",
				"user-agent", "accept-language", "x-forwarded-for", "x-route"}
			for _, n := range wantSeen {
				if got.request[n] == 0 {
					t.Errorf("request header %q never reached tether (it got %v)", n, keys(got.request))
				}
			}
			for n := range got.request {
				if !slices.Contains(allowed.RequestHeaders, n) {
					t.Errorf("request header %q reached tether; forward_rules allow %v", n, allowed.RequestHeaders)
				}
			}
			for _, n := range []string{":method", ":authority", ":scheme", "content-type", "accept", "x-stainless-lang", "x-forwarded-proto"} {
				if got.request[n] > 0 {
					t.Errorf("request header %q reached tether", n)
				}
			}
			if outcomes == xds.OutcomesAccessLog {
				if len(got.response) > 0 {
					t.Errorf("response headers reached tether without a response phase: %v", keys(got.response))
				}
			} else {
				// The emulated instances answer with content-type,
				// content-length, x-instance and date, none of which is read.
				// Envoy's forward_rules are one list for both directions, so
				// a name tether reads in requests (content-length, for
				// cache-aware placement) comes in responses too.
				if got.response[":status"] == 0 {
					t.Errorf("no response reached tether with its status (response headers: %v)", keys(got.response))
				}
				for n := range got.response {
					if !slices.Contains(allowed.ResponseHeaders, n) && !slices.Contains(allowed.RequestHeaders, n) {
						t.Errorf("response header %q reached tether; it reads %v", n, allowed.ResponseHeaders)
					}
				}
			}
			if t.Failed() {
				return
			}

			// A live edit: the rule matches on x-lane now.
			cfg.Routing.Rules[0].Header = "x-lane"
			writeConfig(t, tt.path, cfg)
			fresh := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
			lane := withClient(map[string]string{"x-session-id": "conv-lane", "x-lane": "edge"})
			waitFor(t, 15*time.Second, "the edited rule to route through Envoy", func() bool {
				a, err := tryChatWith(fresh, px, lane)
				return err == nil && a.decision == "random"
			})
			tap.reset()
			if a, err := tryChatWith(fresh, px, withClient(map[string]string{"x-session-id": "conv-route-" + outcomes, "x-route": "edge"})); err != nil || a.decision != "hit" && a.decision != "bind" {
				t.Errorf("x-route after the edit: %+v, %v: want sticky, the rule no longer on it", a, err)
			}
			if got := tap.reset(); got.request["x-route"] > 0 || got.request["x-session-id"] == 0 {
				t.Errorf("after the edit tether got request headers %v: want x-session-id, not x-route", keys(got.request))
			}
		})
	}
}

// forwarded is the spec plan derives from cfg: the headers Envoy sends.
func forwarded(t *testing.T, cfg config.Config) xds.Spec {
	t.Helper()
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	p, err := plan.FromConfig(cfg, plan.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return p.Envoy
}

// withClient is h with the OpenAI client's headers.
func withClient(h map[string]string) map[string]string {
	out := map[string]string{}
	for k, v := range openAIHeaders {
		out[k] = v
	}
	for k, v := range h {
		out[k] = v
	}
	return out
}

func keys(m map[string]int) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// tap is a gRPC relay between Envoy and tether's gRPC port: every stream
// (ext_proc, the access log, health checks) goes through unchanged, and
// it counts the header names of each ext_proc message it passes.
type tap struct {
	conn *grpc.ClientConn
	mu   sync.Mutex
	seen tapped
}

// tapped counts, per header name, the ext_proc messages that carried it:
// request headers and response headers, of the routing and the
// observing filters alike.
type tapped struct{ request, response map[string]int }

// startTap serves the relay on ln, passing streams to target.
func startTap(t *testing.T, ln net.Listener, target string) *tap {
	t.Helper()
	conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	tp := &tap{conn: conn}
	tp.reset()
	gs := grpc.NewServer(grpc.UnknownServiceHandler(tp.relay), grpc.ForceServerCodec(rawCodec{}))
	go func() { _ = gs.Serve(ln) }() // returns when Stop closes ln
	t.Cleanup(func() { gs.Stop(); _ = conn.Close() })
	return tp
}

// reset returns what was counted, and starts again.
func (tp *tap) reset() tapped {
	tp.mu.Lock()
	defer tp.mu.Unlock()
	got := tp.seen
	tp.seen = tapped{request: map[string]int{}, response: map[string]int{}}
	return got
}

const processMethod = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"

// relay passes one stream to tether and back.
func (tp *tap) relay(_ any, down grpc.ServerStream) error {
	method, _ := grpc.MethodFromServerStream(down)
	ctx, cancel := context.WithCancel(down.Context())
	defer cancel()
	md, _ := metadata.FromIncomingContext(ctx)
	out := metadata.MD{}
	for k, v := range md {
		if !strings.HasPrefix(k, ":") && !strings.HasPrefix(k, "grpc-") && k != "content-type" && k != "user-agent" && k != "te" {
			out[k] = v
		}
	}
	up, err := tp.conn.NewStream(metadata.NewOutgoingContext(ctx, out),
		&grpc.StreamDesc{ServerStreams: true, ClientStreams: true}, method, grpc.ForceCodec(rawCodec{}))
	if err != nil {
		return err
	}
	go func() {
		for {
			var b []byte
			if err := down.RecvMsg(&b); err != nil {
				_ = up.CloseSend()
				return
			}
			if method == processMethod {
				tp.note(b)
			}
			if up.SendMsg(&b) != nil {
				return
			}
		}
	}()
	for {
		var b []byte
		if err := up.RecvMsg(&b); err != nil {
			down.SetTrailer(up.Trailer())
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		if err := down.SendMsg(&b); err != nil {
			return err
		}
	}
}

// note counts the header names of one ext_proc message.
func (tp *tap) note(b []byte) {
	var req extprocv3.ProcessingRequest
	if proto.Unmarshal(b, &req) != nil {
		return
	}
	tp.mu.Lock()
	defer tp.mu.Unlock()
	count := func(m map[string]int, h *extprocv3.HttpHeaders) {
		for _, hv := range h.GetHeaders().GetHeaders() {
			m[hv.GetKey()]++
		}
	}
	count(tp.seen.request, req.GetRequestHeaders())
	count(tp.seen.response, req.GetResponseHeaders())
}

// rawCodec passes messages as the bytes they came in.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) { return *v.(*[]byte), nil }

func (rawCodec) Unmarshal(data []byte, v any) error {
	*v.(*[]byte) = append([]byte(nil), data...)
	return nil
}

func (rawCodec) Name() string { return "proto" }
