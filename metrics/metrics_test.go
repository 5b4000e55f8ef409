package metrics

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/tetherproxy/tether/affinity"
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
		m.Response("a", code)
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

func TestRedisBreaker(t *testing.T) {
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
		m.RedisBreaker(step.open)
		want := fmt.Sprintf(gauge, step.up, step.opens)
		if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "tether_redis_up", "tether_redis_breaker_opens_total"); err != nil {
			t.Errorf("after RedisBreaker(%v): %v", step.open, err)
		}
	}
}
