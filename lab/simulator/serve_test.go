package simulator

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/lab/workload"
	"github.com/tetherproxy/tether/plan"
	"github.com/tetherproxy/tether/prefix"
	"github.com/tetherproxy/tether/reload"
	"github.com/tetherproxy/tether/replicas"
	"github.com/tetherproxy/tether/store/memory"
)

// serveConfig has rules (one random, one with its own lifetime and
// priority, one starting sessions on the canary version), two versions
// with a canary, bounded load that bites (a tight epsilon, few
// kv_sessions), adaptive saturation thresholds the simulated load reaches
// on some instances at a time, and short lifetimes.
const serveConfig = `
[routing]
mode = "sticky"
adaptive_sticky = 1
saturation_inflight = 2
saturation_queue_depth = 2
bounded_load_epsilon = 0.1
idle_timeout = "3m"
max_sticky_duration = 8
version_affinity = "strict"
canary_by_header = "x-canary"

[content]
block_bytes = 64 # the simulator's: one emulator block

[[routing.rules]]
name = "tokens-random"
header = "authorization"
mode = "random"

[[routing.rules]]
name = "devices"
header = "x-device-id"
idle_timeout = "45s"
priority = "high"

[[routing.rules]]
name = "some-sessions-on-v2"
header = "x-session-id"
regex = "^sess-[0-3]"
version = "v2"

[[versions]]
name = "v1"
weight = 9

[[versions]]
name = "v2"
weight = 1
canary = true

[[instances]]
name = "a1"
address = "10.0.1.1:8000"
zone = "a"
version = "v1"
weight = 2
kv_sessions = 6

[[instances]]
name = "a2"
address = "10.0.1.2:8000"
zone = "a"
version = "v1"
kv_sessions = 6

[[instances]]
name = "b1"
address = "10.0.2.1:8000"
zone = "b"
version = "v1"
kv_sessions = 6

[[instances]]
name = "b2"
address = "10.0.2.2:8000"
zone = "b"
version = "v1"
kv_sessions = 4
capacity = "spot"

[[instances]]
name = "c1"
address = "10.0.1.3:8000"
zone = "a"
version = "v2"
kv_sessions = 6

[[instances]]
name = "c2"
address = "10.0.2.3:8000"
zone = "b"
version = "v2"
kv_sessions = 6
`

// serveSeed seeds the simulation's random draws, and serve's.
const serveSeed = 11

// simulatedCalls runs tether-lab simulate --config on cfg and returns
// every call its tether router made on its decider, in order.
func simulatedCalls(t *testing.T, cfg config.Config) []deciderCall {
	t.Helper()
	// About 15,000 requests on a fleet loaded enough for some instances
	// to be saturated at a time (durations scaled to 5%).
	r, err := newRunner(Options{
		Config: &cfg, Policy: Tether, Rate: 30, Duration: 500 * time.Second, ThinkScale: 0.3, TimeScale: 0.05, Seed: serveSeed,
		Workload: workload.Config{Seed: serveSeed, Identities: workload.IdentityMix{Session: 0.5, Token: 0.2, Device: 0.25, Anonymous: 0.05}},
	})
	if err != nil {
		t.Fatal(err)
	}
	var calls []deciderCall
	r.router.(*tetherRouter).trace = func(c deciderCall) { calls = append(calls, c) }
	if _, err := r.run(t.Context()); err != nil {
		t.Fatal(err)
	}
	return calls
}

// serveDecisions makes the decisions of calls as tether serve makes them
// for cfg: its live runtime translates cfg at start (reload.Runtime, as
// server.Run does), and its decider is plan.NewDecider's, on the memory
// store, with the same clock and random seed as the simulation; each
// decision's request carries only the headers and path, from which
// serve's extractor reads the identity, as extproc does. Load syncs and
// answers come at the simulation's times, as serve's load loop and
// response phase would bring them.
func serveDecisions(t *testing.T, cfg config.Config, calls []deciderCall) []affinity.Decision {
	t.Helper()
	ctx := t.Context()
	rt := reload.New("127.0.0.1:50051", nil, zerolog.Nop(), prometheus.NewRegistry())
	if _, err := rt.Apply(ctx, cfg, "start"); err != nil {
		t.Fatal(err)
	}
	start := rt.Plan()
	ids, err := start.Extractor([]byte(identitySecret))
	if err != nil {
		t.Fatal(err)
	}
	var now time.Time
	clock := func() time.Time { return now }
	store := memory.New()
	load := affinity.NewLoad()
	var contents affinity.PrefixIndex
	if start.Content.Enabled {
		contents = prefix.NewIndex(start.Content.IndexBlocks(start.Content.CacheTokens))
	}
	decider := plan.NewDecider(start, rt.Fleet(), plan.Deps{
		Store: store, Load: load, Breaker: fleet.NewBreaker(start.Breaker, clock, nil), Index: contents,
		Now: clock, Rand: rand.New(rand.NewPCG(serveSeed, 0x726f75746572)).Uint64, // the simulation's router seed
	})
	rt.OnApply(func(p plan.Plan) { decider.SetPolicy(p.Policy) })
	loadSync := replicas.LoadSync{Replica: "serve", View: load, Store: store, Instances: rt.Fleet().All}
	var out []affinity.Decision
	for _, c := range calls {
		now = c.at
		switch {
		case c.sync:
			if err := loadSync.Sync(ctx, now); err != nil {
				t.Fatal(err)
			}
		case c.answer != nil:
			decider.Finish(out[c.n], *c.answer)
		default:
			h := identity.Map{}
			if m, ok := c.request.Headers.(identity.Map); ok {
				maps.Copy(h, m)
			}
			d, err := decider.Decide(ctx, affinity.Request{ID: ids.Extract(h), Path: c.request.Path, Headers: h})
			if err != nil {
				t.Fatalf("serve's decision %d: %v", c.n, err)
			}
			if d.Open && c.chain != nil {
				// The body Envoy sends for an open placement.
				d = decider.Refine(ctx, d, c.chain)
			}
			out = append(out, d)
		}
	}
	return out
}

// differences lists the decisions of serve that are not the simulation's:
// another instance, kind or rule.
func differences(calls []deciderCall, serve []affinity.Decision) []string {
	var out []string
	for _, c := range calls {
		if c.sync || c.answer != nil {
			continue
		}
		s, d := c.decision, serve[c.n]
		if s.Instance.Name != d.Instance.Name || s.Kind != d.Kind || s.Rule != d.Rule {
			out = append(out, fmt.Sprintf("decision %d at %s: simulate %s %s (rule %q), serve %s %s (rule %q)",
				c.n, c.at.Format(time.TimeOnly), s.Instance.Name, s.Kind, s.Rule, d.Instance.Name, d.Kind, d.Rule))
		}
	}
	return out
}

// TestSimulateDecidesAsServe: tether-lab simulate --config FILE and tether
// serve --config FILE make the same decisions, request by request (the
// same instance, kind and rule), on a configuration with rules, two
// versions, a canary and bounded load; and the comparison sees a
// difference when serve runs another epsilon.
func TestSimulateDecidesAsServe(t *testing.T) {
	cfg, err := config.Parse([]byte(serveConfig))
	if err != nil {
		t.Fatal(err)
	}
	calls := simulatedCalls(t, cfg)
	serve := serveDecisions(t, cfg, calls)
	if len(serve) < 10000 {
		t.Fatalf("%d decisions, want at least 10,000", len(serve))
	}
	if diff := differences(calls, serve); len(diff) > 0 {
		t.Fatalf("%d of %d decisions differ; the first:\n%s", len(diff), len(serve), diff[0])
	}

	// What the decisions cover: the features of the configuration.
	kinds, rules, versions := map[affinity.Kind]int{}, map[string]int{}, map[string]int{}
	byContent := 0
	for _, d := range serve {
		kinds[d.Kind]++
		rules[d.Rule]++
		versions[d.Instance.Version]++
		if d.ByContent {
			byContent++
		}
	}
	t.Logf("%d decisions: kinds %v, rules %v, versions %v, %d placed by content", len(serve), kinds, rules, versions, byContent)
	if byContent == 0 {
		t.Error("no decision placed by content ([content] is on by default): the case is not exercised")
	}
	for _, k := range []affinity.Kind{affinity.KindBind, affinity.KindHit, affinity.KindRandom, affinity.KindRebind, affinity.KindSpilled, affinity.KindAnonymous} {
		if kinds[k] == 0 {
			t.Errorf("no %s decision: the case is not exercised", k)
		}
	}
	for _, r := range []string{"tokens-random", "devices", "some-sessions-on-v2"} {
		if rules[r] == 0 {
			t.Errorf("rule %s never matched", r)
		}
	}
	if versions["v1"] == 0 || versions["v2"] == 0 {
		t.Errorf("versions %v: want both", versions)
	}

	// The comparison can fail: serve with another bounded-load epsilon.
	loose := cfg
	loose.Routing.BoundedLoadEpsilon = 2
	diff := differences(calls, serveDecisions(t, loose, calls))
	if len(diff) == 0 {
		t.Fatal("serve with epsilon 2 made the simulation's decisions (epsilon 0.1): the comparison cannot see a difference")
	}
	t.Logf("with epsilon 2 on serve's side, %d of %d decisions differ, the first: %s", len(diff), len(serve), diff[0])
}
