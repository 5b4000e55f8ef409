package extproc_test

import (
	"strings"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/rs/zerolog"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/extproc"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/store/memory"
)

// gatewayFleet: four instances at IP addresses, one of them IPv6.
var gatewayFleet = []fleet.Instance{
	{Name: "a", Address: "10.0.0.1:8000", Weight: 1},
	{Name: "b", Address: "10.0.0.2:8000", Weight: 1},
	{Name: "c", Address: "10.0.0.3:8000", Weight: 1},
	{Name: "d", Address: "[2001:db8::4]:8000", Weight: 1},
}

// audited keeps the decision kinds the routing audit was given.
type audited struct {
	mu    sync.Mutex
	kinds []affinity.Kind
}

func (a *audited) Audit(_, _ string, _ identity.Identity, d affinity.Decision, _ time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.kinds = append(a.kinds, d.Kind)
}

func (a *audited) all() []affinity.Kind {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]affinity.Kind(nil), a.kinds...)
}

func startGateway(t *testing.T) extprocv3.ExternalProcessorClient {
	t.Helper()
	c, _ := startAuditedGateway(t)
	return c
}

func startAuditedGateway(t *testing.T) (extprocv3.ExternalProcessorClient, *audited) {
	t.Helper()
	ids, err := identity.New(identity.Config{Secret: []byte("0123456789abcdef")})
	if err != nil {
		t.Fatal(err)
	}
	fl := fleet.New(gatewayFleet)
	dec := affinity.New(memory.New(), fl, affinity.Policy{
		Mode: affinity.Sticky, Lifetime: bindings.Lifetime{Idle: time.Minute, Max: time.Hour},
	})
	a := &audited{}
	return serve(t, extproc.New(ids, dec, &recorded{}, extproc.Options{
		ClusterHeader: "x-tether-cluster", Logger: zerolog.Nop(), Instances: fl, Fallbacks: extproc.DefaultFallbacks, Auditor: a,
	})), a
}

// withSubset is req with a gateway's subset hint of value.
func withSubset(req *extprocv3.ProcessingRequest, value *structpb.Value) *extprocv3.ProcessingRequest {
	req.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
		extproc.MetadataSubsetHint: {Fields: map[string]*structpb.Value{extproc.SubsetKey: value}},
	}}
	return req
}

func list(addrs ...string) *structpb.Value {
	vs := make([]*structpb.Value, len(addrs))
	for i, a := range addrs {
		vs[i] = structpb.NewStringValue(a)
	}
	return structpb.NewListValue(&structpb.ListValue{Values: vs})
}

// routed reads a routing reply: the cluster, the destination header and
// the destination in the dynamic metadata.
func routed(t *testing.T, r *extprocv3.ProcessingResponse) (cluster, header, meta string) {
	t.Helper()
	for _, h := range r.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		switch h.GetHeader().GetKey() {
		case "x-tether-cluster":
			cluster = string(h.GetHeader().GetRawValue())
		case extproc.HeaderDestination:
			header = string(h.GetHeader().GetRawValue())
		}
	}
	meta = r.GetDynamicMetadata().GetFields()[extproc.MetadataLB].GetStructValue().GetFields()[extproc.HeaderDestination].GetStringValue()
	return cluster, header, meta
}

// TestGatewayDestination: every routing reply names the destination in
// both places, alike, with the session's next choices after it; the
// session's first choice is its instance, and the cluster header agrees.
func TestGatewayDestination(t *testing.T) {
	c := startGateway(t)
	for _, session := range []string{"s1", "s2", "s3", "s4", "s5"} {
		// A client's own destination is overwritten, never appended to.
		got := exchange(t, c, reqHeaders("x-session-id", session, extproc.HeaderDestination, "203.0.113.9:22"))
		cluster, header, meta := routed(t, got[0])
		if header == "" || header != meta {
			t.Fatalf("session %s: header %q, metadata %q", session, header, meta)
		}
		eps := strings.Split(header, ",")
		if len(eps) != 1+extproc.DefaultFallbacks {
			t.Fatalf("session %s: destination %q, want %d endpoints", session, header, 1+extproc.DefaultFallbacks)
		}
		in, ok := fleet.New(gatewayFleet).AtAddress(eps[0])
		if !ok || cluster != in.Cluster() {
			t.Errorf("session %s: routed to %s, destination %s", session, cluster, eps[0])
		}
		seen := map[string]bool{}
		for _, ep := range eps {
			if seen[ep] || strings.Contains(header, "203.0.113.9") {
				t.Errorf("session %s: destination %q repeats an endpoint or keeps the client's", session, header)
			}
			seen[ep] = true
		}
		again := exchange(t, c, reqHeaders("x-session-id", session))
		if _, h2, _ := routed(t, again[0]); h2 != header {
			t.Errorf("session %s: destination %q, then %q", session, header, h2)
		}
	}
}

// TestGatewaySubsetHint: the pick comes from the hint, in any spelling of
// its addresses; a hint tether cannot use is a 503, counted, with nothing
// routed.
func TestGatewaySubsetHint(t *testing.T) {
	c, audit := startAuditedGateway(t)
	for _, tc := range []struct {
		name  string
		value *structpb.Value
		want  []string // the instances the pick may be; nil: a 503
	}{
		{"two of four", list("10.0.0.2:8000", "10.0.0.3:8000"), []string{"b", "c"}},
		{"IPv6 in brackets, another spelling", list("[2001:db8:0::4]:8000"), []string{"d"}},
		{"spaces around", list(" 10.0.0.1:8000 "), []string{"a"}},
		{"unknown endpoints ignored", list("10.9.9.9:8000", "10.0.0.3:8000"), []string{"c"}},
		{"no known endpoint", list("10.9.9.9:8000"), nil},
		{"empty list", list(), nil},
		{"a port tether does not serve", list("10.0.0.1:9000"), nil},
		{"one string", structpb.NewStringValue("10.0.0.1:8000"), []string{"a"}},
		{"a comma-separated string", structpb.NewStringValue("10.0.0.2:8000, 10.0.0.3:8000"), []string{"b", "c"}},
		{"a list of comma-separated strings", list("10.9.9.9:1,10.0.0.3:8000", "10.0.0.2:8000"), []string{"b", "c"}},
		{"an empty string", structpb.NewStringValue(""), nil},
		{"a null", structpb.NewNullValue(), nil},
		{"too long", structpb.NewStringValue(strings.Repeat("10.9.9.9:1,", 5000)), nil},
		{"a number in the list", structpb.NewListValue(&structpb.ListValue{Values: []*structpb.Value{structpb.NewNumberValue(1)}}), nil},
		{"a struct", structpb.NewStructValue(&structpb.Struct{}), nil},
		{"malformed address", list("10.0.0.1"), nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := len(audit.all())
			got := exchange(t, c, withSubset(reqHeaders("x-session-id", "hint-"+tc.name), tc.value))
			if tc.want == nil {
				ir := got[0].GetImmediateResponse()
				if ir.GetStatus().GetCode() != 503 {
					t.Fatalf("want a 503, got %v", got[0])
				}
				// The audit says why, once.
				if kinds := audit.all()[before:]; len(kinds) != 1 || kinds[0] != "refused:no_eligible" && kinds[0] != "refused:bad_subset" {
					t.Errorf("audited as %q", kinds)
				}
				return
			}
			cluster, header, _ := routed(t, got[0])
			ok := false
			for _, name := range tc.want {
				ok = ok || cluster == fleet.ClusterPrefix+name
			}
			if !ok {
				t.Fatalf("routed to %s, outside %v", cluster, tc.want)
			}
			for _, ep := range strings.Split(header, ",") {
				in, _ := fleet.New(gatewayFleet).AtAddress(ep)
				inside := false
				for _, name := range tc.want {
					inside = inside || in.Name == name
				}
				if !inside {
					t.Errorf("destination %q names %s, outside the hint", header, ep)
				}
			}
		})
	}
}
