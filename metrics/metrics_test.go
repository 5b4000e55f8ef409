package metrics

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
)

func TestRecords(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg)
	m.Decision(identity.Identity{Source: identity.SourceAnonymous, Rejected: identity.ReasonTooLong, Header: "x-session-id"},
		affinity.Decision{Mode: affinity.Sticky, Kind: affinity.KindAnonymous}, time.Millisecond)
	m.Decision(identity.Identity{Key: "s:x", Source: identity.SourceSession},
		affinity.Decision{Mode: affinity.Sticky, Kind: affinity.KindDegraded, Err: affinity.ErrNoInstance}, time.Millisecond)
	m.DecisionFailed(identity.Identity{}, "no_instance")
	m.Decision(identity.Identity{Key: "s:y", Source: identity.SourceSession},
		affinity.Decision{Mode: affinity.Sticky, Kind: affinity.KindFailover, Stage: affinity.StageSameZone}, time.Millisecond)
	m.Decision(identity.Identity{Key: "s:y", Source: identity.SourceSession},
		affinity.Decision{Mode: affinity.Random, Kind: affinity.KindFallback, Stage: affinity.StageRandom}, time.Millisecond)
	for _, code := range []int{200, 201, 503, 0, 999} {
		m.Response(affinity.Decision{Instance: fleet.Instance{Name: "a"}}, fleet.Outcome{Status: code})
	}
	want := `
# HELP tether_identity_rejected_total Requests whose identifier was present but unusable (too long, control characters, malformed bearer token); they are routed as anonymous.
# TYPE tether_identity_rejected_total counter
tether_identity_rejected_total{header="x-session-id",reason="too_long"} 1
# HELP tether_store_errors_total Binding store calls that failed; the request was placed by rendezvous hashing instead.
# TYPE tether_store_errors_total counter
tether_store_errors_total 1
# HELP tether_upstream_responses_total Response statuses seen per instance, by status class (2xx…5xx).
# TYPE tether_upstream_responses_total counter
tether_upstream_responses_total{code="2xx",upstream="a"} 2
tether_upstream_responses_total{code="5xx",upstream="a"} 1
tether_upstream_responses_total{code="invalid",upstream="a"} 2
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "tether_identity_rejected_total", "tether_store_errors_total", "tether_upstream_responses_total"); err != nil {
		t.Error(err)
	}
	if n := testutil.ToFloat64(m.requests.WithLabelValues("sticky", "anonymous", "anonymous")); n != 1 {
		t.Errorf("anonymous decisions: %v", n)
	}
	for _, stage := range []string{"same_zone", "random"} {
		if n := testutil.ToFloat64(m.failovers.WithLabelValues(stage)); n != 1 {
			t.Errorf("failovers at %s: %v", stage, n)
		}
	}
	if n := testutil.ToFloat64(m.decisionErrors.WithLabelValues("no_instance")); n != 1 {
		t.Errorf("decision errors: %v", n)
	}
}

func TestRedisGuard(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg)
	gauge := `
# HELP tether_redis_up 1 while the binding store's breaker on Redis is closed, 0 while it is open (Redis unreachable: requests are placed by rendezvous hashing without calling it).
# TYPE tether_redis_up gauge
tether_redis_up %d
# HELP tether_redis_breaker_opens_total Times the binding store's breaker on Redis opened after consecutive failed calls (a start without Redis included; reopenings after a failed probe are not counted).
# TYPE tether_redis_breaker_opens_total counter
tether_redis_breaker_opens_total %d
`
	for _, step := range []struct {
		open      bool
		up, opens int
	}{
		{false, 1, 0}, // the state at start
		{true, 0, 1},
		{false, 1, 1},
		{true, 0, 2},
	} {
		m.RedisGuard(step.open)
		want := fmt.Sprintf(gauge, step.up, step.opens)
		if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "tether_redis_up", "tether_redis_breaker_opens_total"); err != nil {
			t.Errorf("after RedisGuard(%v): %v", step.open, err)
		}
	}
}

// TestContinuity: follow-ups count as kept only when the session's own
// instance answered them without error; new sessions and random requests
// are not follow-ups; moves count as migrations from the instance left.
func TestContinuity(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg)
	a, b := fleet.Instance{Name: "a"}, fleet.Instance{Name: "b"}
	sess := identity.Identity{Key: "s:x", Source: identity.SourceSession}
	ok := fleet.Outcome{Status: 200, Answered: true, Elapsed: 20 * time.Millisecond}
	steps := []struct {
		d affinity.Decision
		r fleet.Outcome
	}{
		{affinity.Decision{Instance: a, Mode: affinity.Sticky, Kind: affinity.KindBind}, ok},                                                                   // new: not a follow-up
		{affinity.Decision{Instance: a, Mode: affinity.Sticky, Kind: affinity.KindHit, Previous: "a"}, ok},                                                     // kept
		{affinity.Decision{Instance: a, Mode: affinity.Sticky, Kind: affinity.KindHit, Previous: "a"}, fleet.Outcome{Status: 503, Answered: true}},             // broken: failed
		{affinity.Decision{Instance: a, Mode: affinity.Sticky, Kind: affinity.KindHit, Previous: "a"}, fleet.Outcome{Status: 200, Answered: true, Peer: true}}, // broken: a peer answered
		{affinity.Decision{Instance: b, Mode: affinity.Sticky, Kind: affinity.KindMoved, Previous: "a"}, ok},                                                   // broken: moved
		{affinity.Decision{Instance: b, Mode: affinity.Random, Kind: affinity.KindFallback, Previous: "a"}, ok},                                                // broken, binding kept
		{affinity.Decision{Instance: a, Mode: affinity.Sticky, Kind: affinity.KindHit, Previous: "a"}, fleet.Outcome{Status: 503}},                             // Envoy's own reply: not served, not counted
		{affinity.Decision{Instance: b, Mode: affinity.Random, Kind: affinity.KindRandom}, ok},                                                                 // random: not a follow-up
	}
	for _, st := range steps {
		m.Decision(sess, st.d, time.Millisecond)
		m.Response(st.d, st.r)
	}
	if kept, broken := testutil.ToFloat64(m.followups.WithLabelValues("kept")), testutil.ToFloat64(m.followups.WithLabelValues("broken")); kept != 1 || broken != 4 {
		t.Errorf("follow-ups kept %v, broken %v; want 1 and 4", kept, broken)
	}
	if n := testutil.ToFloat64(m.migrations.WithLabelValues("a", "moved")); n != 1 {
		t.Errorf("migrations off a: %v, want 1 (the fallback keeps its binding)", n)
	}
	if n := testutil.CollectAndCount(m.migrations); n != 1 {
		t.Errorf("%d migration series, want 1", n)
	}
	if n := testutil.CollectAndCount(m.inference); n != 2 {
		t.Errorf("inference series %d, want sticky and random", n)
	}
}

// TestInstanceReports: OOM and GPU reports count for the instance, not
// when a peer answered; unreadable reports are counted by header.
func TestInstanceReports(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg)
	d := affinity.Decision{Instance: fleet.Instance{Name: "a"}, Mode: affinity.Sticky, Kind: affinity.KindHit}
	m.Response(d, fleet.Outcome{Status: 507, Answered: true, OOM: true})
	m.Response(d, fleet.Outcome{Status: 200, Answered: true, GPU: 0.5, GPUKnown: true})
	m.Response(d, fleet.Outcome{Status: 507, Answered: true, Peer: true, OOM: true, GPU: 0.9, GPUKnown: true})
	m.Response(d, fleet.Outcome{Status: 200, Answered: true, BadReports: []string{"gpu_utilization"}})
	if n := testutil.ToFloat64(m.oom.WithLabelValues("a")); n != 1 {
		t.Errorf("OOM events %v, want 1", n)
	}
	if g := testutil.ToFloat64(m.gpu.WithLabelValues("a")); g != 0.5 {
		t.Errorf("GPU utilisation %v, want 0.5 (a peer's report is not the instance's)", g)
	}
	if n := testutil.ToFloat64(m.reportErrors.WithLabelValues("gpu_utilization")); n != 1 {
		t.Errorf("report errors %v", n)
	}
}

type fakeView map[string][4]int

func (v fakeView) Instances() []string {
	out := make([]string, 0, len(v))
	for k := range v {
		out = append(out, k)
	}
	return out
}
func (v fakeView) InFlight(i string) int   { return v[i][0] }
func (v fakeView) Queue(i string) int      { return v[i][1] }
func (v fakeView) Active(i string) int     { return v[i][2] }
func (v fakeView) Available(i string) bool { return v[i][3] == 1 }

func TestInstanceGauges(t *testing.T) {
	reg := prometheus.NewRegistry()
	NewInstances(reg, fakeView{"a": {2, 5, 40, 1}, "b": {0, 0, 7, 0}})
	want := `
# HELP tether_instance_available 1 when the instance takes requests (healthy, not drained, its breaker not open), else 0.
# TYPE tether_instance_available gauge
tether_instance_available{upstream="a"} 1
tether_instance_available{upstream="b"} 0
# HELP tether_instance_sessions Sessions bound to the instance (the heat map), from the fleet's session index as this replica last read it (aggregate with max).
# TYPE tether_instance_sessions gauge
tether_instance_sessions{upstream="a"} 40
tether_instance_sessions{upstream="b"} 7
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "tether_instance_available", "tether_instance_sessions"); err != nil {
		t.Error(err)
	}
	if err := testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP tether_instance_in_flight Requests in flight to the instance across the fleet's replicas, as this replica last heard (aggregate with max).
# TYPE tether_instance_in_flight gauge
tether_instance_in_flight{upstream="a"} 2
tether_instance_in_flight{upstream="b"} 0
`), "tether_instance_in_flight"); err != nil {
		t.Error(err)
	}
}

type stubStore struct{ err error }

func (s stubStore) GetOrBind(context.Context, bindings.Lookup) (bindings.Result, error) {
	return bindings.Result{}, s.err
}
func (s stubStore) Replace(context.Context, string, string, bindings.Binding, bindings.Lifetime) (bindings.Binding, error) {
	return bindings.Binding{}, s.err
}

func TestStoreTiming(t *testing.T) {
	reg := prometheus.NewRegistry()
	ctx := context.Background()
	_, _ = NewStore(reg, stubStore{}).GetOrBind(ctx, bindings.Lookup{})
	_, _ = NewStore(prometheus.NewRegistry(), stubStore{}).GetOrBind(ctx, bindings.Lookup{}) // another registry: no clash
	s := NewStore(prometheus.NewPedanticRegistry(), stubStore{err: fmt.Errorf("get: %w", context.DeadlineExceeded)})
	_, _ = s.GetOrBind(ctx, bindings.Lookup{})
	_, _ = s.Replace(ctx, "k", "a", bindings.Binding{}, bindings.Lifetime{})
	if n := testutil.ToFloat64(s.errors.WithLabelValues("get_or_bind", "timeout")); n != 1 {
		t.Errorf("timeouts %v", n)
	}
	if n := testutil.CollectAndCount(s.seconds); n != 2 {
		t.Errorf("%d duration series, want get_or_bind and replace", n)
	}
	if n := testutil.CollectAndCount(reg, "tether_redis_errors_total"); n != 0 {
		t.Errorf("a successful call counted as an error")
	}
}
