package simulator

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tetherproxy/tether/lab/emulator"
	"github.com/tetherproxy/tether/lab/workload"
)

// regime is a regime on a small fleet: 16 instances, multi-turn chats with
// session ids at 8 requests/s, think times ×0.2, over the regime's own
// duration.
func regime(t *testing.T, name string, p Policy) *Result {
	t.Helper()
	rg, err := LookupRegime(name)
	if err != nil {
		t.Fatal(err)
	}
	o, err := rg.Apply(Options{
		Policy: p, Instances: 16, Rate: 8, ThinkScale: 0.2, Seed: 2,
		Workload: workload.Config{Seed: 2, Mix: workload.Mix{MultiTurn: 1}, Identities: workload.IdentityMix{Session: 1}},
	})
	if err != nil {
		t.Fatal(err)
	}
	return run(t, o)
}

// accounted checks every request of a run ended one way: OK or lost.
func accounted(t *testing.T, r *Result) {
	t.Helper()
	s := r.Summary
	if s.Requests != s.OK+r.Regime.Lost {
		t.Errorf("%s: %d requests, %d OK + %d lost", r.Settings.Label, s.Requests, s.OK, r.Regime.Lost)
	}
}

func TestAutoscaleMovesNoSessionOfTether(t *testing.T) {
	sticky, ring := regime(t, "autoscale", Sticky), regime(t, "autoscale", RingHash)
	for _, r := range []*Result{sticky, ring} {
		accounted(t, r)
		served := 0
		for _, in := range r.Instances {
			if in.Served > 0 {
				served++
			}
		}
		if served != 20 || r.Regime.Displaced == 0 {
			t.Errorf("%s: %d instances served, %d sessions displaced: want the fleet to have scaled out to 20 and in",
				r.Settings.Label, served, r.Regime.Displaced)
		}
	}
	if sticky.Regime.Moved != 0 {
		t.Errorf("tether sticky moved %d sessions off instances still up: want 0", sticky.Regime.Moved)
	}
	// Scale-out adds 4 instances to 16: Envoy's ring gives them about a
	// fifth of the keys, and sessions in progress then move.
	if ring.Regime.Moved == 0 {
		t.Error("Envoy ring hash moved no session on scale-out: the ring is not rebuilt over the instances up")
	}
}

func TestUpgradeKeepsTetherSessionsOnTheirModel(t *testing.T) {
	sticky, ring := regime(t, "upgrade", Sticky), regime(t, "upgrade", RingHash)
	if sticky.Regime.ModelSwitches != 0 {
		t.Errorf("tether sticky (strict version affinity): %d mid-conversation model switches, want 0", sticky.Regime.ModelSwitches)
	}
	if ring.Regime.ModelSwitches == 0 {
		t.Error("Envoy ring hash: no mid-conversation model switch during a rolling upgrade")
	}
	for _, r := range []*Result{sticky, ring} {
		accounted(t, r)
		var v2 int
		for _, in := range r.Instances {
			if in.Model.Cache.Conversations > 0 {
				v2++
			}
		}
		if v2 == 0 {
			t.Errorf("%s: no instance holds a conversation after the upgrade", r.Settings.Label)
		}
	}
}

func TestFailuresFailWhatTheInstanceHeld(t *testing.T) {
	for _, p := range []Policy{Sticky, RingHash, LeastRequest} {
		r := regime(t, "failures", p)
		accounted(t, r)
		if r.Regime.Failed == 0 || r.Regime.MeanInstances >= 16 {
			t.Errorf("%s: %d requests failed, mean %.2f instances: want failures", r.Settings.Label, r.Regime.Failed, r.Regime.MeanInstances)
		}
		if p == Sticky && r.Regime.Moved != 0 {
			t.Errorf("tether sticky moved %d sessions off instances still up (a returning instance takes its sessions back?)", r.Regime.Moved)
		}
	}
}

func TestAgentsFanOutStaysTogether(t *testing.T) {
	for _, p := range []Policy{Sticky, RingHash, RoundRobin} {
		r := regime(t, "agents", p)
		accounted(t, r)
		together := r.Regime.FanOutTogetherShare
		switch {
		case r.Regime.FanOut == 0:
			t.Fatalf("%s: no fan-out request", r.Settings.Label)
		case p != RoundRobin && together != 1:
			t.Errorf("%s: %.1f%% of the fan-out on its turn's instance, want all (sessions only)", r.Settings.Label, 100*together)
		case p == RoundRobin && together > 0.2:
			t.Errorf("round robin kept %.1f%% of the fan-out together", 100*together)
		}
		if r.Summary.KVHitRate > r.InfiniteCacheBound+1e-9 {
			t.Errorf("%s: hit rate %.3f above the bound %.3f", r.Settings.Label, r.Summary.KVHitRate, r.InfiniteCacheBound)
		}
	}
}

func TestOutageCarriedByFailOpenKeepsSessions(t *testing.T) {
	r := regime(t, "outage", Sticky)
	accounted(t, r)
	if r.Regime.FailOpen == 0 {
		t.Fatal("no request went by the fail-open route during the outage")
	}
	// New sessions are placed where the pool's ring sends them, so the
	// outage (and its end) moves almost none; bounded load may override a
	// few placements.
	if limit := r.Summary.Conversations / 50; r.Regime.Moved > limit {
		t.Errorf("the outage moved %d sessions of %d: want at most %d", r.Regime.Moved, r.Summary.Conversations, limit)
	}
}

func TestBurstHitsOneInstanceUnlessAdaptive(t *testing.T) {
	sticky, adaptive := regime(t, "burst", Sticky), regime(t, "burst", Adaptive)
	for _, r := range []*Result{sticky, adaptive} {
		accounted(t, r)
		if r.Regime.BurstTTFT.P99 == 0 || r.Regime.OthersTTFT.P99 == 0 {
			t.Fatalf("%s: no burst figures", r.Settings.Label)
		}
	}
	if adaptive.Regime.BurstTTFT.P99 >= sticky.Regime.BurstTTFT.P99 {
		t.Errorf("burst tenant's TTFT p99: adaptive %v, sticky %v: want adaptive to spill the hot instance",
			adaptive.Regime.BurstTTFT.P99, sticky.Regime.BurstTTFT.P99)
	}
}

func TestWarmupCountsFromItsEnd(t *testing.T) {
	o := small(Sticky)
	whole := run(t, o)
	o.Scenario.Warmup = 25 * time.Second
	warm := run(t, o)
	if warm.Summary.Requests >= whole.Summary.Requests || warm.Summary.Requests == 0 {
		t.Errorf("requests: %d with a warmup, %d without: want fewer, not none", warm.Summary.Requests, whole.Summary.Requests)
	}
	if warm.Summary.KVHitRate <= whole.Summary.KVHitRate {
		t.Errorf("KV hit rate %.3f after the warmup, %.3f from cold: want warm caches to hit more", warm.Summary.KVHitRate, whole.Summary.KVHitRate)
	}
}

func TestKVPressureSizesTheCaches(t *testing.T) {
	r := regime(t, "kv-pressure", Sticky)
	if p := r.Regime.KVPressure; p < 1.4 || p > 3 {
		t.Errorf("kv-pressure: %.2f× as many conversations in progress as the caches keep, want about %.1f×", p, KVPressureTarget)
	}
}

func TestScenarioRefusesBadOptions(t *testing.T) {
	base := Options{Policy: Sticky, Instances: 8, Rate: 10, Duration: time.Hour}
	for _, c := range []struct {
		name string
		edit func(*Options)
		want string
	}{
		{"negative rate", func(o *Options) { o.Rate = -1 }, "rate -1"},
		{"zero KV capacity", func(o *Options) { o.Cache.CapacityTokens = -16 }, "kv capacity"},
		{"scale step below one instance", func(o *Options) { o.Scenario.Scale = Scale{Every: time.Minute, Step: 0.05} }, "scale step 0.05 of 8 instances"},
		{"scale step of the whole fleet", func(o *Options) { o.Scenario.Scale = Scale{Every: time.Minute, Step: 1} }, "scale step 1"},
		{"scale lag past its period", func(o *Options) { o.Scenario.Scale = Scale{Every: time.Minute, Step: 0.5, Lag: time.Minute} }, "scale every"},
		{"upgrade of a version nobody serves", func(o *Options) { o.Scenario.Upgrade = Upgrade{From: "v9", To: "v10"} }, `upgrade from "v9": no instance serves it`},
		{"upgrade to the same version", func(o *Options) { o.Scenario.Upgrade = Upgrade{From: "v1", To: "v1"} }, "want a new version"},
		{"upgrade past the end", func(o *Options) {
			o.Scenario.Upgrade = Upgrade{From: "v1", To: "v2", At: 50 * time.Minute, Over: 20 * time.Minute}
		}, "upgrade at 50m0s"},
		{"warmup past the duration", func(o *Options) { o.Scenario.Warmup = 2 * time.Hour }, "warmup 2h0m0s"},
		{"fan-out of zero requests", func(o *Options) { o.Scenario.FanOut = -1 }, "fan-out -1"},
		{"burst of a negative share", func(o *Options) { o.Scenario.Burst = Burst{For: time.Minute, Share: -0.1} }, "burst share -0.1"},
		{"failures that never return", func(o *Options) { o.Scenario.Failures = Failures{Every: time.Minute} }, "failures every 1m0s, down 0s"},
		{"outage of no time", func(o *Options) { o.Scenario.Outage = Outage{At: time.Minute} }, "outage for 0s"},
		{"a scenario on the exact path", func(o *Options) { o.Exact, o.Scenario.FanOut = true, 2 }, "exact prices a fixed fleet"},
	} {
		o := base
		c.edit(&o)
		err := o.Validate()
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: Validate() = %v, want an error naming %q", c.name, err, c.want)
		}
	}
	if err := base.Validate(); err != nil {
		t.Errorf("base options: %v", err)
	}
	// A KV capacity of zero tokens is the profile's (the CLI refuses an
	// explicit 0); below a block it is refused.
	o := base
	o.Cache.CapacityTokens = emulator.BlockSize - 1
	if err := o.Validate(); err == nil {
		t.Errorf("a KV cache below one block (%d tokens) was accepted", o.Cache.CapacityTokens)
	}
}

func TestScaledInWhileDownStaysOut(t *testing.T) {
	o := small(Sticky)
	o.Duration = time.Hour
	o.Scenario = Scenario{Scale: Scale{Every: 10 * time.Minute, Step: 0.25}, Failures: Failures{Every: 10 * time.Minute, Down: 2 * time.Minute}}
	r, err := newRunner(o)
	if err != nil {
		t.Fatal(err)
	}
	r.changes = nil
	r.apply(change{at: 0, kind: changeDie})
	dead := r.fleet.died
	if dead < 0 || len(r.changes) != 1 || r.changes[0].kind != changeReturn {
		t.Fatalf("after a failure: died %d, changes %+v", dead, r.changes)
	}
	r.apply(change{at: 1, kind: changeDown, inst: dead})
	r.apply(r.changes[0])
	in := r.instances[dead]
	if in.up || in.member || slices.Contains(r.fleet.live, dead) || slices.Contains(r.fleet.members, dead) {
		t.Errorf("instance %d scaled in while down came back with its return: up %v, member %v", dead, in.up, in.member)
	}
	r.apply(change{at: 2, kind: changeUp, inst: dead})
	if !in.up || !slices.Contains(r.fleet.live, dead) {
		t.Errorf("instance %d scaled out again is not up", dead)
	}
}
