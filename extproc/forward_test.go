package extproc_test

import (
	"context"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/google/go-cmp/cmp"
	"github.com/rs/zerolog"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/extproc"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/plan"
	"github.com/tetherproxy/tether/prefix"
	"github.com/tetherproxy/tether/store/memory"
	"github.com/tetherproxy/tether/xds"
)

// TestForwardedHeadersAreRead: Envoy sends tether only the headers the
// generated filters list (forward_rules, derived by plan), so the handler
// must read no header a filter's list lacks, or it would read it empty.
// Every header the handler, its identity extractor and its decider read
// goes through one view (extproc's headers.Get), which tells the test each
// name. For each configuration the requests drive every branch that reads
// a header (each identity source, the fingerprint, each rule, a body to
// ask for, the response phase), so the list is also exactly what is read:
// a listed name nobody reads fails too.
func TestForwardedHeadersAreRead(t *testing.T) {
	cases := []struct {
		name  string
		edit  func(*config.Config)
		audit bool
	}{
		{name: "defaults"},
		{name: "outcomes inline, audit, debug headers", audit: true, edit: func(c *config.Config) {
			c.Envoy.Outcomes = xds.OutcomesInline
			c.Server.DebugHeaders = true
		}},
		{name: "outcomes observed", edit: func(c *config.Config) { c.Envoy.Outcomes = xds.OutcomesObserve }},
		{name: "identity and report headers renamed", edit: func(c *config.Config) {
			c.Envoy.Outcomes = xds.OutcomesInline
			c.Identity.SessionHeader, c.Identity.AuthHeader = "x-conversation", "x-api-key"
			c.Identity.DeviceHeader, c.Identity.UserHeader = "x-installation", "x-account"
			c.Routing.QueueDepthHeader, c.Routing.OOMHeader, c.Routing.GPUUtilizationHeader = "x-q", "x-mem", "x-gpu"
		}},
		{name: "rules, tiers and canary", audit: true, edit: func(c *config.Config) {
			c.Routing.CanaryByHeader = "x-canary"
			c.Routing.TierHeader = "x-plan"
			c.Routing.Rules = []config.Rule{
				{Name: "vip", PathPrefix: "/v1/", Header: "x-route", Value: "vip", Priority: "high"},
				{Name: "gold", Tiers: []string{"gold"}, Mode: "random"},
				{Name: "batch", Header: "x-batch", Regex: "^nightly-", Mode: "random"},
			}
			c.Versions = []config.Version{{Name: "v1", Weight: 1}, {Name: "v2", Canary: true}}
		}},
		{name: "rules without tiers, hybrid", edit: func(c *config.Config) {
			c.Routing.Mode = config.ModeHybrid
			c.Routing.Rules = []config.Rule{{Name: "core", Header: "x-core", Mode: "sticky"}}
		}},
		{name: "content placement, outcomes inline", audit: true, edit: func(c *config.Config) {
			c.Content.Enabled = true
			c.Envoy.Outcomes = xds.OutcomesInline
		}},
		{name: "content placement, random mode", edit: func(c *config.Config) {
			c.Content.Enabled = true
			c.Routing.Mode = config.ModeRandom
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := config.Default()
			cfg.Instances = []config.Instance{
				{Name: "a", Address: "127.0.0.1:8001", Version: "v1", Weight: 1},
				{Name: "b", Address: "127.0.0.1:8002", Version: "v2", Weight: 1},
			}
			if c.edit != nil {
				c.edit(&cfg)
			}
			if err := cfg.Validate(); err != nil {
				t.Fatal(err)
			}
			p, err := plan.FromConfig(cfg, plan.Options{})
			if err != nil {
				t.Fatal(err)
			}
			routing, observing := forwardRules(t, p.Envoy)
			w := newForwardWorld(t, p, c.audit)

			// The routing filter's streams: every request kind, and the
			// response phase where the filter has one.
			apart := p.Envoy.Outcomes != xds.OutcomesInline
			var tickets []string
			for _, kv := range requestKinds(cfg) {
				msgs := []*extprocv3.ProcessingRequest{reqHeaders(kv...)}
				if !apart {
					msgs = append(msgs, respHeaders(":status", "200", cfg.Routing.QueueDepthHeader, "1"))
				}
				replies := w.stream(t, apart, msgs...)
				if len(replies) > 0 {
					md := replies[0].GetDynamicMetadata().GetFields()[extproc.MetadataNamespace].GetStructValue()
					tickets = append(tickets, md.GetFields()["t"].GetStringValue())
				}
			}
			read := w.take()
			checkRead(t, "routing filter", read, routing)

			// The observing filter's streams, each with a routing stream's
			// ticket.
			if p.Envoy.Outcomes == xds.OutcomesObserve {
				for _, ticket := range tickets {
					w.observe(t, ticket)
				}
				checkRead(t, "observing filter", w.take(), observing)
			} else if observing != nil {
				t.Errorf("an observing filter's forward_rules %v without outcomes observed", observing)
			}
		})
	}
}

// checkRead fails for a header read that list lacks, and for a listed one
// never read.
func checkRead(t *testing.T, filter string, read map[string]bool, list []string) {
	t.Helper()
	if list == nil {
		t.Fatalf("%s: no forward_rules: Envoy sends every header", filter)
	}
	for name := range read {
		if name != "" && !slices.Contains(list, name) {
			t.Errorf("%s: tether reads %q, which the filter's forward_rules leave out (allowed: %v)", filter, name, list)
		}
	}
	for _, name := range list {
		if !read[name] {
			t.Errorf("%s: forward_rules list %q, which no request here made tether read", filter, name)
		}
	}
}

// requestKinds are header sets that, together, take every branch of the
// handler that reads a header, under cfg's names.
func requestKinds(cfg config.Config) [][]string {
	id := cfg.Identity
	base := []string{":path", "/v1/chat/completions", ":method", "POST", ":authority", "llm.example",
		"content-type", "application/json", "content-length", "120", "x-stainless-lang", "python"}
	with := func(kv ...string) []string { return append(slices.Clone(base), kv...) }
	return [][]string{
		with(), // anonymous: every identity header asked for, every rule evaluated
		with(id.UserHeader, "u1", "user-agent", "OpenAI/Python 1.40.0", "accept-language", "en", "x-forwarded-for", "10.0.0.1"), // the fingerprint
		with(id.SessionHeader, "s1", id.AuthHeader, "Bearer tok.abc", id.DeviceHeader, "d1", id.UserHeader, "u1"),
		with(id.AuthHeader, "Bearer tok.def", "x-request-id", "req-1"),
		with(id.DeviceHeader, "d2", id.UserHeader, "u2", "content-encoding", "gzip"),
		with(id.SessionHeader, "s2", "x-route", "vip", "x-canary", "always"),
		with(id.SessionHeader, "s3", cfg.Routing.TierHeader, "gold"),
		with(id.SessionHeader, "s4", "x-core", "1"), // a sticky rule under hybrid
	}
}

// forwardRules are the names the generated filters let through: the
// routing filter's and the observing filter's (nil without one, or
// without forward_rules).
func forwardRules(t *testing.T, s xds.Spec) (routing, observing []string) {
	t.Helper()
	r, err := xds.Build(s, xds.Static)
	if err != nil {
		t.Fatal(err)
	}
	hcm := &hcmv3.HttpConnectionManager{}
	if err := r.Listener.GetFilterChains()[0].GetFilters()[0].GetTypedConfig().UnmarshalTo(hcm); err != nil {
		t.Fatal(err)
	}
	for _, f := range hcm.GetHttpFilters() {
		ep := &extprocfilterv3.ExternalProcessor{}
		if f.GetTypedConfig().UnmarshalTo(ep) != nil {
			continue
		}
		var names []string
		for _, m := range ep.GetForwardRules().GetAllowedHeaders().GetPatterns() {
			names = append(names, m.GetExact())
		}
		if f.GetName() == xds.ObserveFilterName {
			observing = names
		} else {
			routing = names
		}
	}
	return routing, observing
}

// forwardWorld is the handler as serve builds it from a plan, telling
// which headers it reads.
type forwardWorld struct {
	client extprocv3.ExternalProcessorClient
	mu     sync.Mutex
	read   map[string]bool
}

func newForwardWorld(t *testing.T, p plan.Plan, audit bool) *forwardWorld {
	t.Helper()
	secret := []byte("0123456789abcdef")
	ids, err := p.Extractor(secret)
	if err != nil {
		t.Fatal(err)
	}
	fl := fleet.New(p.Instances)
	dec := plan.NewDecider(p, fl, plan.Deps{Store: memory.New(), Index: prefix.NewIndex(1024)})
	hasher, err := prefix.NewHasher(p.Content.BlockBytes, 0)
	if err != nil {
		t.Fatal(err)
	}
	o := p.ExtProc
	// At debug level the handler logs each request's id.
	o.Logger = zerolog.New(io.Discard).Level(zerolog.DebugLevel)
	o.Tickets, o.Instances, o.Prompts = extproc.NewTickets(secret), fl, hasher
	if audit {
		o.Auditor = nopAuditor{}
	}
	srv := extproc.New(ids, dec, &recorded{}, o)
	w := &forwardWorld{read: map[string]bool{}}
	extproc.OnRead(srv, func(name string) {
		w.mu.Lock()
		defer w.mu.Unlock()
		w.read[name] = true
	})
	w.client = serve(t, srv)
	return w
}

// take returns the names read so far, and forgets them.
func (w *forwardWorld) take() map[string]bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	read := w.read
	w.read = map[string]bool{}
	return read
}

// stream sends msgs on one stream (marked apart or not), a reply awaited
// for each, and waits for the handler to end the stream.
func (w *forwardWorld) stream(t *testing.T, apart bool, msgs ...*extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if apart {
		ctx = metadata.AppendToOutgoingContext(ctx, extproc.ApartMarker, "1")
	}
	s, err := w.client.Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out []*extprocv3.ProcessingResponse
	for _, m := range msgs {
		if err := s.Send(m); err != nil {
			t.Fatal(err)
		}
		r, err := s.Recv()
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, r)
	}
	if err := s.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if r, err := s.Recv(); err == nil {
		t.Fatalf("a reply after the last message: %v", r)
	}
	return out
}

// observe runs an observing stream for ticket: request and response
// headers, no replies; it returns once the handler has ended the stream.
func (w *forwardWorld) observe(t *testing.T, ticket string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := w.client.Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	req := reqHeaders(":path", "/v1/chat/completions", "x-session-id", "s1", "user-agent", "OpenAI/Python 1.40.0")
	req.ObservabilityMode = true
	req.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{extproc.MetadataNamespace: {
		Fields: map[string]*structpb.Value{"t": structpb.NewStringValue(ticket)},
	}}}
	resp := respHeaders(":status", "200", "x-queue-depth", "1", "content-type", "application/json")
	resp.ObservabilityMode = true
	for _, m := range []*extprocv3.ProcessingRequest{req, resp} {
		if err := s.Send(m); err != nil {
			t.Fatal(err)
		}
	}
	if r, err := s.Recv(); err == nil {
		t.Fatalf("a reply to an observing stream: %v", r)
	}
}

type nopAuditor struct{}

func (nopAuditor) Audit(string, string, identity.Identity, affinity.Decision, time.Time) {}

// TestForwardedHeadersFollowTheConfiguration: the lists plan derives
// change with the keys that name headers, and with [content].
func TestForwardedHeadersFollowTheConfiguration(t *testing.T) {
	derive := func(edit func(*config.Config)) xds.Spec {
		cfg := config.Default()
		cfg.Instances = []config.Instance{{Name: "a", Address: "127.0.0.1:8001", Version: "v1", Weight: 1}}
		edit(&cfg)
		if err := cfg.Validate(); err != nil {
			t.Fatal(err)
		}
		p, err := plan.FromConfig(cfg, plan.Options{})
		if err != nil {
			t.Fatal(err)
		}
		return p.Envoy
	}
	identityOnly := func(c *config.Config) { c.Content.Enabled = false }
	base := derive(identityOnly)
	want := []string{":path", "accept-language", "authorization", "user-agent", "x-device-id", "x-forwarded-for",
		"x-request-id", "x-session-id", "x-user-id"}
	if diff := cmp.Diff(want, base.RequestHeaders); diff != "" {
		t.Errorf("request headers without content placement (-want +got):\n%s", diff)
	}
	if got := derive(func(*config.Config) {}).RequestHeaders; !slices.Contains(got, "content-length") {
		t.Errorf("default request headers %v: no content-length, which content placement, on by default, reads", got)
	}
	if diff := cmp.Diff([]string{":status", "x-envoy-overloaded", "x-gpu-utilization", "x-oom", "x-queue-depth"}, base.ResponseHeaders); diff != "" {
		t.Errorf("default response headers (-want +got):\n%s", diff)
	}
	for _, c := range []struct {
		name  string
		edit  func(*config.Config)
		added []string
	}{
		{"a rule's header", func(c *config.Config) {
			c.Routing.Rules = []config.Rule{{Name: "r", Header: "x-route", Mode: "random"}}
		}, []string{"x-route"}},
		{"a rule on tiers", func(c *config.Config) {
			c.Routing.Rules = []config.Rule{{Name: "r", Tiers: []string{"gold"}, Mode: "random"}}
		}, []string{"x-user-tier"}},
		{"the canary header", func(c *config.Config) { c.Routing.CanaryByHeader = "x-canary" }, []string{"x-canary"}},
		{"content placement", func(c *config.Config) { c.Content.Enabled = true }, []string{"content-encoding", "content-length"}},
	} {
		got := derive(func(cfg *config.Config) { identityOnly(cfg); c.edit(cfg) }).RequestHeaders
		var added []string
		for _, n := range got {
			if !slices.Contains(base.RequestHeaders, n) {
				added = append(added, n)
			}
		}
		if diff := cmp.Diff(c.added, added); diff != "" || len(got) != len(base.RequestHeaders)+len(c.added) {
			t.Errorf("%s: added (-want +got):\n%s", c.name, diff)
		}
	}
}

// TestHeadersReadInOnePlace: TestForwardedHeadersAreRead hears the
// headers read through the handler's one view of Envoy's header list; a
// read that went around it (the list taken from a message elsewhere)
// would go unheard. So the list is taken in that view's constructor
// alone.
func TestHeadersReadInOnePlace(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	found := 0
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		pkgs := map[string]bool{} // identity.Headers is a type, not a read
		for _, im := range f.Imports {
			path := strings.Trim(im.Path.Value, `"`)
			pkgs[path[strings.LastIndex(path, "/")+1:]] = true
			if im.Name != nil {
				pkgs[im.Name.Name] = true
			}
		}
		for _, decl := range f.Decls {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok {
				continue
			}
			ast.Inspect(fn, func(n ast.Node) bool {
				sel, ok := n.(*ast.SelectorExpr)
				if !ok || sel.Sel.Name != "GetHeaders" && sel.Sel.Name != "Headers" {
					return true
				}
				if x, ok := sel.X.(*ast.Ident); ok && pkgs[x.Name] {
					return true
				}
				if fn.Name.Name == "headers" && fn.Recv != nil {
					found++
					return true
				}
				t.Errorf("%s: %s reads Envoy's header list (.%s) outside (*Server).headers, the view that tells which headers are read",
					fset.Position(sel.Pos()), fn.Name.Name, sel.Sel.Name)
				return true
			})
		}
	}
	if found == 0 {
		t.Error("(*Server).headers takes no header list: the view has moved, and this test with it")
	}
}
