package affinity_test

import (
	"context"
	"testing"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/store/memory"
)

// TestDecisionCountsRequests: a decision that read the binding names the
// session key the binding is stored under and the session's request count
// with this request, whatever route it then took; one that did not read
// it names neither.
func TestDecisionCountsRequests(t *testing.T) {
	ctx := context.Background()
	clk := &clock{t: time.Unix(1_700_000_000, 0)}
	lt := bindings.Lifetime{Idle: time.Hour, Max: 10 * time.Minute}
	d := affinity.New(memory.New(), fleet.New(instances(4)), affinity.Policy{Mode: affinity.Sticky, Lifetime: lt}, affinity.WithClock(clk.now))
	check := func(what string, req affinity.Request, wantKind affinity.Kind, wantKey string, wantRequests int) {
		t.Helper()
		got, err := d.Decide(ctx, req)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if got.Kind != wantKind || got.Key != wantKey || got.Requests != wantRequests {
			t.Errorf("%s: %s, key %q, %d requests; want %s, key %q, %d requests",
				what, got.Kind, got.Key, got.Requests, wantKind, wantKey, wantRequests)
		}
	}
	withToken := session("a")
	withToken.ID.Aliases = []string{"t:token"}
	tokenOnly := affinity.Request{ID: identity.Identity{Key: "t:token", Source: identity.SourceToken}}
	check("first request", withToken, affinity.KindBind, "s:a", 1)
	check("follow-up", session("a"), affinity.KindHit, "s:a", 2)
	check("follow-up by the alias", tokenOnly, affinity.KindHit, "s:a", 3)
	check("anonymous", affinity.Request{}, affinity.KindAnonymous, "", 0)
	clk.add(lt.Max) // past max_sticky_duration: placed again, the same conversation
	check("renewed", session("a"), affinity.KindRebind, "s:a", 4)

	down := affinity.New(failingStore{}, fleet.New(instances(4)), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime})
	if got, err := down.Decide(ctx, session("a")); err != nil || got.Kind != affinity.KindDegraded || got.Key != "" || got.Requests != 0 {
		t.Errorf("store down: %+v, %v; want degraded without a key or count", got, err)
	}
}

// TestRebindKeepsCount: a failover rebinds the session; the decision
// reports the count this request got, and the next request counts on.
func TestRebindKeepsCount(t *testing.T) {
	e := newFailoverEnv(t, affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime}, zoned())
	req := e.sessionOn("z1-0") // its first request
	e.kill("z1-0")
	if got := e.must(req); got.Kind != affinity.KindFailover || got.Key != req.ID.Key || got.Requests != 2 {
		t.Errorf("failover: %s, key %q, %d requests; want failover, %q, 2", got.Kind, got.Key, got.Requests, req.ID.Key)
	}
	if got := e.must(req); got.Kind != affinity.KindHit || got.Requests != 3 {
		t.Errorf("after the failover: %s, %d requests; want hit, 3", got.Kind, got.Requests)
	}

	r := newFailoverEnv(t, affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime, Fallback: affinity.FallbackRandom}, zoned())
	req = r.sessionOn("z1-0")
	r.kill("z1-0")
	if got := r.must(req); got.Kind != affinity.KindFallback || got.Requests != 2 {
		t.Errorf("random fallback: %s, %d requests; want fallback, 2 (the binding counted it)", got.Kind, got.Requests)
	}
}
