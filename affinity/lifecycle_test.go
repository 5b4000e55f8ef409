package affinity_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"regexp"
	"sync"
	"testing"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/store/memory"
)

// versioned returns n instances of v1 then n of v2.
func versioned(n int) []fleet.Instance {
	var out []fleet.Instance
	for _, v := range []string{"v1", "v2"} {
		for i := range n {
			out = append(out, fleet.Instance{Name: fmt.Sprintf("%s-%d", v, i), Zone: "z", Version: v, Weight: 1, KVSessions: 20})
		}
	}
	return out
}

func user(sess, user string, hs ...string) affinity.Request {
	h := identity.Map{}
	for i := 0; i+1 < len(hs); i += 2 {
		h[hs[i]] = hs[i+1]
	}
	id := identity.Identity{Key: "s:" + sess, Source: identity.SourceSession}
	if user != "" {
		id.Cohort = "u:" + user
	}
	return affinity.Request{ID: id, Path: "/v1/chat/completions", Headers: h}
}

func decide(t *testing.T, d *affinity.Decider, req affinity.Request) affinity.Decision {
	t.Helper()
	got, err := d.Decide(context.Background(), req)
	if err != nil {
		t.Fatalf("Decide(%s): %v", req.ID.Key, err)
	}
	d.Finish(got, fleet.Outcome{Answered: true})
	return got
}

var canaryPolicy = affinity.Policy{
	Mode: affinity.Sticky, Lifetime: lifetime, VersionAffinity: affinity.Strict, CanaryHeader: "x-canary",
	Versions: []affinity.VersionWeight{{Name: "v1", Weight: 90}, {Name: "v2", Weight: 10, Canary: true}},
}

func TestCanaryCohortsAreStablePerUser(t *testing.T) {
	d := affinity.New(memory.New(), fleet.New(versioned(4)), canaryPolicy)
	const users = 2000
	canary := 0
	for u := range users {
		var first string
		for s := range 3 {
			got := decide(t, d, user(fmt.Sprintf("%d-%d", u, s), fmt.Sprint(u)))
			if s == 0 {
				first = got.Instance.Version
			} else if got.Instance.Version != first {
				t.Fatalf("user %d: session %d on %s, session 0 on %s", u, s, got.Instance.Version, first)
			}
		}
		if first == "v2" {
			canary++
		}
	}
	if share := float64(canary) / users; math.Abs(share-0.10) > 0.02 {
		t.Fatalf("canary share %.3f, want 0.10 ± 0.02", share)
	}
	for _, tc := range []struct{ header, want string }{{"always", "v2"}, {"never", "v1"}} {
		for u := range 50 {
			if got := decide(t, d, user(fmt.Sprintf("%s-%d", tc.header, u), fmt.Sprint(u), "x-canary", tc.header)); got.Instance.Version != tc.want {
				t.Fatalf("x-canary: %s, user %d: version %s, want %s", tc.header, u, got.Instance.Version, tc.want)
			}
		}
	}
	// Raising the canary's weight only adds users to it.
	more := canaryPolicy
	more.Versions = []affinity.VersionWeight{{Name: "v1", Weight: 80}, {Name: "v2", Weight: 20, Canary: true}}
	p10, p20 := affinity.New(memory.New(), fleet.New(versioned(4)), canaryPolicy), affinity.New(memory.New(), fleet.New(versioned(4)), more)
	for u := range 500 {
		a, b := decide(t, p10, user("x", fmt.Sprint(u))), decide(t, p20, user("x", fmt.Sprint(u)))
		if a.Instance.Version == "v2" && b.Instance.Version != "v2" {
			t.Fatalf("user %d left the canary when its weight went from 10 to 20", u)
		}
	}
}

func TestVersionAffinity(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		aff      affinity.VersionAffinity
		wantKind affinity.Kind
		wantErr  error
	}{
		{affinity.Strict, "", affinity.ErrNoVersion},
		{affinity.Prefer, affinity.KindMoved, nil},
		{affinity.AnyVersion, affinity.KindMoved, nil},
	} {
		t.Run(string(tc.aff), func(t *testing.T) {
			p := canaryPolicy
			p.VersionAffinity = tc.aff
			p.Versions = []affinity.VersionWeight{{Name: "v1", Weight: 1}, {Name: "v2", Weight: 0}}
			fl := fleet.New(versioned(3))
			d := affinity.New(memory.New(), fl, p)
			for i := range 30 {
				if got := decide(t, d, session(fmt.Sprint(i))); got.Instance.Version != "v1" {
					t.Fatalf("v1 100%%: session %d on %s", i, got.Instance.Version)
				}
			}
			// The weights move to v2: sessions begun on v1 stay on v1.
			p.Versions = []affinity.VersionWeight{{Name: "v1", Weight: 0}, {Name: "v2", Weight: 1}}
			d.SetPolicy(p)
			for i := range 30 {
				if got := decide(t, d, session(fmt.Sprint(i))); got.Instance.Version != "v1" || got.Kind != affinity.KindHit {
					t.Fatalf("after the weights moved: session %d %+v, want a hit on v1", i, got)
				}
			}
			if got := decide(t, d, session("new")); got.Instance.Version != "v2" {
				t.Fatalf("new session on %s, want v2", got.Instance.Version)
			}
			// Every v1 instance goes away.
			fl.Replace(versioned(3)[3:])
			got, err := d.Decide(ctx, session("1"))
			if !errors.Is(err, tc.wantErr) || got.Kind != tc.wantKind {
				t.Fatalf("v1 gone: %+v, %v; want %q, %v", got, err, tc.wantKind, tc.wantErr)
			}
			if err == nil && got.Instance.Version != "v2" {
				t.Fatalf("v1 gone: moved to %s", got.Instance.Name)
			}
		})
	}
}

func TestMigrateAndDrainMarks(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	clk := &clock{t: time.Unix(1_700_000_000, 0)}
	drained := map[string]bool{}
	load := affinity.NewLoad()
	d := affinity.New(st, fleet.New(versioned(2)), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime, VersionAffinity: affinity.Strict,
		Versions: []affinity.VersionWeight{{Name: "v1", Weight: 1}, {Name: "v2", Weight: 0}}}, affinity.WithClock(clk.now), affinity.WithLoad(load))
	on := map[string]string{}
	for i := range 40 {
		on[fmt.Sprint(i)] = decide(t, d, session(fmt.Sprint(i))).Instance.Name
	}
	// Migrate v1-0's sessions, ten at a time.
	total := 0
	for {
		n, left, err := st.Mark(ctx, bindings.MarkFilter{Instance: "v1-0", Version: "v1", Limit: 10}, bindings.Move{Version: "v2"}, clk.now())
		if err != nil {
			t.Fatal(err)
		}
		total += n
		if left == 0 {
			break
		}
	}
	if total == 0 {
		t.Fatal("no session on v1-0; the test proves nothing")
	}
	for k, was := range on {
		got := decide(t, d, session(k))
		switch {
		case was == "v1-0" && (got.Kind != affinity.KindMigrated || got.Instance.Version != "v2"):
			t.Fatalf("session %s on v1-0: %+v, want migrated to v2", k, got)
		case was != "v1-0" && (got.Kind != affinity.KindHit || got.Instance.Name != was):
			t.Fatalf("session %s on %s: %+v, want an unmoved hit", k, was, got)
		}
		if again := decide(t, d, session(k)); again.Kind != affinity.KindHit || again.Instance != got.Instance {
			t.Fatalf("session %s after its move: %+v, want a hit on %s", k, again, got.Instance.Name)
		}
		on[k] = got.Instance.Name
	}
	// Drain v1-1: its sessions leave for another v1 instance.
	if _, _, err := st.Mark(ctx, bindings.MarkFilter{Instance: "v1-1"}, bindings.Move{Off: "v1-1"}, clk.now()); err != nil {
		t.Fatal(err)
	}
	drained["v1-1"] = true
	if err := syncLoad(ctx, load, drainSyncer{drained}, "r1", nil, clk.now()); err != nil {
		t.Fatal(err)
	}
	for k, was := range on {
		got := decide(t, d, session(k))
		if was == "v1-1" && (got.Kind != affinity.KindDrained || got.Instance.Name == "v1-1" || got.Instance.Version != "v1") {
			t.Fatalf("session %s on drained v1-1: %+v, want drained to another v1 instance", k, got)
		}
	}
}

// drainSyncer reports a fixed drained set.
type drainSyncer struct{ drained map[string]bool }

func (s drainSyncer) SyncLoad(context.Context, fleet.LoadReport, []string, time.Duration, time.Time) (fleet.LoadState, error) {
	return fleet.LoadState{Active: map[string]int{}, InFlight: map[string]int{}, Queue: map[string]int{}, Drained: s.drained}, nil
}
func (drainSyncer) SetDrained(context.Context, string, bool) error { return nil }

func TestDrainedInstanceTakesNoNewSessions(t *testing.T) {
	load := affinity.NewLoad()
	if err := syncLoad(context.Background(), load, drainSyncer{map[string]bool{"gpu-2": true}}, "r1", nil, time.Now()); err != nil {
		t.Fatal(err)
	}
	d := affinity.New(memory.New(), fleet.New(instances(4)), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime}, affinity.WithLoad(load))
	for i := range 200 {
		if got := decide(t, d, session(fmt.Sprint(i))); got.Instance.Name == "gpu-2" {
			t.Fatalf("session %d placed on drained gpu-2", i)
		}
	}
}

func TestBoundedLoad(t *testing.T) {
	ins := instances(8)
	ins[3].Weight = 2
	for i := range ins {
		ins[i].KVSessions = 20
	}
	share := func(i, n int) float64 { return float64(n) * ins[i].Weight / 9 }
	t.Run("1000 new sessions", func(t *testing.T) {
		d := affinity.New(memory.New(), fleet.New(ins), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime, Epsilon: 0.25})
		counts := map[string]int{}
		for i := range 1000 {
			counts[decide(t, d, session(fmt.Sprint(i))).Instance.Name]++
		}
		for i, in := range ins {
			if c := float64(counts[in.Name]); c > 1.25*share(i, 1000)+1 {
				t.Errorf("%s (weight %g) has %v sessions, above 1.25 × its share %.1f", in.Name, in.Weight, c, share(i, 1000))
			}
		}
	})
	t.Run("burst on one hash position", func(t *testing.T) {
		var keys []string
		for i := 0; len(keys) < 400; i++ {
			if k := fmt.Sprint("burst-", i); affinity.Rendezvous("s:"+k, ins).Name == "gpu-0" {
				keys = append(keys, k)
			}
		}
		d := affinity.New(memory.New(), fleet.New(ins), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime, Epsilon: 0.25})
		counts := map[string]int{}
		for _, k := range keys {
			counts[decide(t, d, session(k)).Instance.Name]++
		}
		if c := counts["gpu-0"]; float64(c) > 1.25*share(0, len(keys))+1 {
			t.Fatalf("%d sessions whose first choice is gpu-0: %d landed on it (bound %.1f): %v", len(keys), c, 1.25*share(0, len(keys)), counts)
		}
		if len(counts) < 8 {
			t.Fatalf("the burst reached only %d instances: %v", len(counts), counts)
		}
	})
	t.Run("below kv_sessions an instance takes the sessions its hash gives it", func(t *testing.T) {
		small := instances(4)
		for i := range small {
			small[i].KVSessions = 5
		}
		// A tight bound (ε = 0.01): only kv_sessions lets gpu-0 take more
		// than its share.
		d := affinity.New(memory.New(), fleet.New(small), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime, Epsilon: 0.01})
		n := 0
		for i := 0; n < 7; i++ {
			k := fmt.Sprint("kv-", i)
			if affinity.Rendezvous("s:"+k, small).Name != "gpu-0" {
				continue
			}
			n++
			got := decide(t, d, session(k))
			if wantGPU0 := n <= 5; (got.Instance.Name == "gpu-0") != wantGPU0 {
				t.Fatalf("session %d whose hash is gpu-0 (kv_sessions 5) went to %s", n, got.Instance.Name)
			}
		}
	})
	t.Run("light load stays within the bound", func(t *testing.T) {
		d := affinity.New(memory.New(), fleet.New(ins), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime, Epsilon: 0.25})
		counts := map[string]int{}
		for i := range 40 {
			counts[decide(t, d, session(fmt.Sprint("light-", i))).Instance.Name]++
		}
		for i, in := range ins {
			if c := float64(counts[in.Name]); c > max(math.Ceil(1.25*share(i, 40)), float64(in.KVSessions)) {
				t.Errorf("40 sessions: %s has %v, above max(⌈1.25 × %.1f⌉, kv_sessions %d)", in.Name, c, share(i, 40), in.KVSessions)
			}
		}
	})
}

func TestAdaptive(t *testing.T) {
	ins := instances(4)
	tier := regexp.MustCompile(`^gold$`)
	p := affinity.Policy{Mode: affinity.Adaptive, Lifetime: lifetime, Saturation: affinity.Saturation{QueueDepth: 4},
		Rules: []affinity.Rule{{Name: "vip", Header: "x-user-tier", Regex: tier, Priority: affinity.High}}}
	t.Run("no saturation is sticky", func(t *testing.T) {
		sticky := affinity.New(memory.New(), fleet.New(ins), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime})
		adaptive := affinity.New(memory.New(), fleet.New(ins), p)
		for i := range 300 {
			for turn := range 2 {
				a, b := decide(t, sticky, session(fmt.Sprint(i))), decide(t, adaptive, session(fmt.Sprint(i)))
				if a.Instance != b.Instance || a.Kind != b.Kind {
					t.Fatalf("session %d turn %d: sticky %s/%s, adaptive %s/%s", i, turn, a.Instance.Name, a.Kind, b.Instance.Name, b.Kind)
				}
			}
		}
	})
	t.Run("saturated instance", func(t *testing.T) {
		load := affinity.NewLoad()
		d := affinity.New(memory.New(), fleet.New(ins), p, affinity.WithLoad(load))
		var low, high []affinity.Request
		for i := 0; len(low) < 10 || len(high) < 10; i++ {
			r := session(fmt.Sprint(i))
			if decide(t, d, r).Instance.Name != "gpu-1" {
				continue
			}
			if len(low) < 10 {
				low = append(low, r)
			} else {
				r.Headers = identity.Map{"x-user-tier": "gold"}
				high = append(high, r)
			}
		}
		load.End("gpu-1", time.Now(), 6, true) // gpu-1 reports a queue of 6
		for _, r := range high {
			if got := decide(t, d, r); got.Instance.Name != "gpu-1" || got.Kind != affinity.KindHit || got.Rule != "vip" {
				t.Fatalf("high-priority %s: %+v, want to stay on gpu-1", r.ID.Key, got)
			}
		}
		for _, r := range low {
			got := decide(t, d, r)
			want := affinity.Rendezvous(r.ID.Key, []fleet.Instance{ins[0], ins[2], ins[3]})
			if got.Kind != affinity.KindSpilled || got.Instance != want {
				t.Fatalf("low-priority %s: %+v, want spilled to its next choice %s", r.ID.Key, got, want.Name)
			}
			if again := decide(t, d, r); again.Kind != affinity.KindHit || again.Instance != want {
				t.Fatalf("low-priority %s next turn: %+v, want a hit on %s", r.ID.Key, again, want.Name)
			}
		}
	})
}

func TestRules(t *testing.T) {
	paris, _ := time.LoadLocation("UTC")
	p := affinity.Policy{Mode: affinity.Hybrid, Lifetime: lifetime, TierHeader: "x-user-tier", Rules: []affinity.Rule{
		{Name: "finance", Header: "x-tenant", Value: "finance", Mode: affinity.Sticky, Idle: 5 * time.Minute},
		{Name: "peak-vip", Tiers: []string{"gold"}, Window: &affinity.Window{From: 9 * time.Hour, To: 17 * time.Hour, Location: paris}, Mode: affinity.Sticky},
		{Name: "chat", PathPrefix: "/v1/chat/", Mode: affinity.Random},
	}}
	noon := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	night := noon.Add(10 * time.Hour)
	for _, tc := range []struct {
		name     string
		req      affinity.Request
		at       time.Time
		rule     string
		wantMode affinity.Mode
	}{
		{"tenant header", user("a", "", "x-tenant", "finance"), noon, "finance", affinity.Sticky},
		{"other tenant falls to path rule", user("a", "", "x-tenant", "retail"), noon, "chat", affinity.Random},
		{"gold at peak", affinity.Request{ID: session("b").ID, Path: "/other", Headers: identity.Map{"x-user-tier": "gold"}}, noon, "peak-vip", affinity.Sticky},
		{"gold off peak", affinity.Request{ID: session("b").ID, Path: "/other", Headers: identity.Map{"x-user-tier": "gold"}}, night, "", affinity.Random},
		{"unmatched hybrid is random", affinity.Request{ID: session("c").ID, Path: "/other"}, noon, "", affinity.Random},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := affinity.New(memory.New(), fleet.New(instances(4)), p, affinity.WithClock(func() time.Time { return tc.at }))
			got := decide(t, d, tc.req)
			if got.Rule != tc.rule || got.Mode != tc.wantMode {
				t.Fatalf("got rule %q mode %s, want %q %s", got.Rule, got.Mode, tc.rule, tc.wantMode)
			}
		})
	}
	// The finance rule's 5-minute idle timeout: gone after 6 idle minutes.
	clk := &clock{t: noon}
	d := affinity.New(memory.New(), fleet.New(instances(4)), p, affinity.WithClock(clk.now))
	fin := user("f", "", "x-tenant", "finance")
	decide(t, d, fin)
	clk.add(4 * time.Minute)
	if got := decide(t, d, fin); got.Kind != affinity.KindHit {
		t.Fatalf("after 4 idle minutes: %s, want hit", got.Kind)
	}
	clk.add(6 * time.Minute)
	if got := decide(t, d, fin); got.Kind != affinity.KindBind {
		t.Fatalf("after 6 idle minutes under a 5-minute rule: %s, want a new bind", got.Kind)
	}
}

func TestWindow(t *testing.T) {
	at := func(wd time.Weekday, h int) time.Time {
		// 2026-11-29 is a Sunday.
		return time.Date(2026, 11, 29+int(wd), h, 30, 0, 0, time.UTC)
	}
	day := &affinity.Window{From: 9 * time.Hour, To: 17 * time.Hour, Days: []time.Weekday{time.Monday, time.Friday}}
	night := &affinity.Window{From: 22 * time.Hour, To: 6 * time.Hour, Days: []time.Weekday{time.Friday}}
	for _, tc := range []struct {
		w    *affinity.Window
		t    time.Time
		want bool
	}{
		{day, at(time.Monday, 10), true}, {day, at(time.Monday, 17), false}, {day, at(time.Monday, 8), false},
		{day, at(time.Tuesday, 10), false}, {night, at(time.Friday, 23), true}, {night, at(time.Saturday, 3), true},
		{night, at(time.Friday, 3), false}, {night, at(time.Saturday, 23), false},
	} {
		if got := tc.w.Contains(tc.t); got != tc.want {
			t.Errorf("%+v contains %v = %v, want %v", *tc.w, tc.t, got, tc.want)
		}
	}
}

func TestSpotPool(t *testing.T) {
	ins := instances(4)
	ins[0].Capacity, ins[1].Capacity = fleet.Spot, fleet.Spot
	fl := fleet.New(ins)
	random := affinity.New(memory.New(), fl, affinity.Policy{Mode: affinity.Random}, affinity.WithRand(rand.New(rand.NewPCG(1, 2)).Uint64))
	sticky := affinity.New(memory.New(), fl, affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime})
	for i := range 200 {
		if got := decide(t, random, session(fmt.Sprint(i))); !got.Instance.Spot() {
			t.Fatalf("random request on on-demand %s while spot is up", got.Instance.Name)
		}
		if got := decide(t, sticky, session(fmt.Sprint(i))); got.Instance.Spot() {
			t.Fatalf("sticky session on spot %s while on-demand is up", got.Instance.Name)
		}
	}
	fl.Replace(ins[:2]) // only spot left
	if got := decide(t, sticky, session("late")); !got.Instance.Spot() {
		t.Fatalf("only spot left: %+v", got)
	}
}

func TestLinkedIdentity(t *testing.T) {
	d := affinity.New(memory.New(), fleet.New(instances(8)), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime})
	for i := range 50 {
		both := affinity.Request{ID: identity.Identity{Key: fmt.Sprint("s:", i), Source: identity.SourceSession, Aliases: []string{fmt.Sprint("t:", i)}}}
		first := decide(t, d, both)
		tokenOnly := affinity.Request{ID: identity.Identity{Key: fmt.Sprint("t:", i), Source: identity.SourceToken}}
		if got := decide(t, d, tokenOnly); got.Kind != affinity.KindHit || got.Instance != first.Instance {
			t.Fatalf("token of session %d alone: %+v, want a hit on %s", i, got, first.Instance.Name)
		}
	}
}

func TestMigrationWithTargetDownMovesWithinItsVersion(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	fl := fleet.New(versioned(2))
	d := affinity.New(st, fl, affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime, VersionAffinity: affinity.Strict,
		Versions: []affinity.VersionWeight{{Name: "v1", Weight: 1}}})
	first := decide(t, d, session("m"))
	if _, _, err := st.Mark(ctx, bindings.MarkFilter{Instance: first.Instance.Name}, bindings.Move{Version: "v2"}, time.Now()); err != nil {
		t.Fatal(err)
	}
	// Every v2 instance and the session's own instance go away.
	var left []fleet.Instance
	for _, in := range versioned(2) {
		if in.Version == "v1" && in.Name != first.Instance.Name {
			left = append(left, in)
		}
	}
	fl.Replace(left)
	got := decide(t, d, session("m"))
	if got.Kind != affinity.KindMoved || got.Instance.Version != "v1" {
		t.Fatalf("migration to a down version from a gone instance: %+v, want moved within v1", got)
	}
}

// slowStore delays every call, so concurrent decisions overlap.
type slowStore struct{ *memory.Store }

func (s slowStore) GetOrBind(ctx context.Context, l bindings.Lookup) (bindings.Result, error) {
	time.Sleep(time.Millisecond)
	return s.Store.GetOrBind(ctx, l)
}

func TestBoundedLoadUnderConcurrentPlacements(t *testing.T) {
	ins := instances(8)
	for i := range ins {
		ins[i].KVSessions = 5
	}
	d := affinity.New(slowStore{memory.New()}, fleet.New(ins), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime, Epsilon: 0.25})
	counts := map[string]int{}
	// 800 sessions one at a time bring every instance near its bound ...
	for i := range 800 {
		counts[decide(t, d, session(fmt.Sprint("base-", i))).Instance.Name]++
	}
	// ... then 200 that all prefer gpu-0 arrive 32 at a time: each must
	// see the others' reservations, or a wave lands on gpu-0 together.
	var keys []string
	for i := 0; len(keys) < 200; i++ {
		if k := fmt.Sprint("conc-", i); affinity.Rendezvous("s:"+k, ins).Name == "gpu-0" {
			keys = append(keys, k)
		}
	}
	var mu sync.Mutex
	sem := make(chan struct{}, 32)
	var wg sync.WaitGroup
	for _, k := range keys {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			got, err := d.Decide(context.Background(), session(k))
			if err != nil {
				t.Error(err)
				return
			}
			d.Finish(got, fleet.Outcome{Answered: true})
			mu.Lock()
			counts[got.Instance.Name]++
			mu.Unlock()
		}()
	}
	wg.Wait()
	if bound := 1.25 * 1000 / 8; float64(counts["gpu-0"]) > bound+1 {
		t.Fatalf("a concurrent burst preferring gpu-0 left it %d sessions, bound %.1f: %v", counts["gpu-0"], bound, counts)
	}
}

// countingSyncer reports a fixed index count, as if read from Redis.
type countingSyncer struct {
	mu     sync.Mutex
	active map[string]int
	during func() // runs while SyncLoad "reads" the index
}

func (s *countingSyncer) SyncLoad(context.Context, fleet.LoadReport, []string, time.Duration, time.Time) (fleet.LoadState, error) {
	if s.during != nil {
		s.during()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return fleet.LoadState{Active: maps.Clone(s.active)}, nil
}
func (*countingSyncer) SetDrained(context.Context, string, bool) error { return nil }

func TestLoadSyncCountsEachPlacementOnce(t *testing.T) {
	syncer := &countingSyncer{active: map[string]int{}}
	load := affinity.NewLoad()
	ins := instances(2)
	ins[0].KVSessions, ins[1].KVSessions = 100, 100
	st := memory.New()
	d := affinity.New(st, fleet.New(ins[:1]), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime}, affinity.WithLoad(load))
	bind := func(k string) {
		decide(t, d, session(k))
		syncer.mu.Lock()
		syncer.active["gpu-0"]++ // the store's index now holds it
		syncer.mu.Unlock()
	}
	bind("a")
	bind("b")
	if got := load.Active("gpu-0"); got != 2 {
		t.Fatalf("before a sync: %d active, want 2", got)
	}
	if err := syncLoad(context.Background(), load, syncer, "r1", nil, time.Now()); err != nil {
		t.Fatal(err)
	}
	if got := load.Active("gpu-0"); got != 2 {
		t.Fatalf("after a sync: %d active, want 2", got)
	}
	bind("c")
	if got := load.Active("gpu-0"); got != 3 {
		t.Fatalf("after a sync and a placement: %d active, want 3", got)
	}
	if err := syncLoad(context.Background(), load, syncer, "r1", nil, time.Now()); err != nil {
		t.Fatal(err)
	}
	if got := load.Active("gpu-0"); got != 3 {
		t.Fatalf("after the second sync: %d active, want 3", got)
	}
}

func TestUndrainedMarksAreIgnored(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	d := affinity.New(st, fleet.New(instances(4)), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime}, affinity.WithLoad(affinity.NewLoad()))
	first := decide(t, d, session("u"))
	// An operator drained the instance, then undid it: the marks stay in
	// the store, but the instance is no longer drained.
	if _, _, err := st.Mark(ctx, bindings.MarkFilter{Instance: first.Instance.Name}, bindings.Move{Off: first.Instance.Name}, time.Now()); err != nil {
		t.Fatal(err)
	}
	if got := decide(t, d, session("u")); got.Kind != affinity.KindHit || got.Instance != first.Instance {
		t.Fatalf("after an undone drain: %+v, want a hit on %s", got, first.Instance.Name)
	}
}

func TestQueueReadingsExpire(t *testing.T) {
	clk := &clock{t: time.Unix(1_700_000_000, 0)}
	ins := instances(2)
	p := affinity.Policy{Mode: affinity.Adaptive, Lifetime: bindings.Lifetime{Idle: time.Hour}, Saturation: affinity.Saturation{QueueDepth: 4}}
	d := affinity.New(memory.New(), fleet.New(ins), p, affinity.WithClock(clk.now))
	d.Load().End("gpu-0", time.Now(), 9, true)
	if !d.Load().Saturated("gpu-0", p.Saturation) {
		t.Fatal("a fresh queue depth of 9 does not saturate at 4")
	}
	clk.add(10 * time.Second)
	if d.Load().Saturated("gpu-0", p.Saturation) || d.Load().Queue("gpu-0") != 0 {
		t.Fatalf("a 10 s old reading still counts: queue %d", d.Load().Queue("gpu-0"))
	}
}

// TestAdaptiveRule: under hybrid routing an adaptive rule's sessions
// spill (plan gives sticky rules this mode under adaptive_sticky = 1).
func TestAdaptiveRule(t *testing.T) {
	ins := instances(3)
	p := affinity.Policy{Mode: affinity.Hybrid, Lifetime: lifetime, Saturation: affinity.Saturation{QueueDepth: 4},
		Rules: []affinity.Rule{{Name: "core", PathPrefix: "/v1/", Mode: affinity.Adaptive}}}
	d := affinity.New(memory.New(), fleet.New(ins), p)
	req := user("core-1", "")
	first := decide(t, d, req)
	if first.Mode != affinity.Adaptive {
		t.Fatalf("an adaptive rule: mode %s, want adaptive", first.Mode)
	}
	d.Load().End(first.Instance.Name, first.At, 9, true)
	if got := decide(t, d, req); got.Kind != affinity.KindSpilled {
		t.Fatalf("its instance saturated: %+v, want spilled", got)
	}
}

func TestRebindKeepsTheSessionsVersion(t *testing.T) {
	clk := &clock{t: time.Unix(1_700_000_000, 0)}
	p := affinity.Policy{Mode: affinity.Sticky, Lifetime: bindings.Lifetime{Idle: time.Hour, Max: 10 * time.Minute}, VersionAffinity: affinity.Strict,
		Versions: []affinity.VersionWeight{{Name: "v1", Weight: 1}, {Name: "v2", Weight: 0}}}
	d := affinity.New(memory.New(), fleet.New(versioned(2)), p, affinity.WithClock(clk.now))
	if got := decide(t, d, session("r")); got.Instance.Version != "v1" {
		t.Fatalf("first turn on %s", got.Instance.Version)
	}
	p.Versions = []affinity.VersionWeight{{Name: "v1", Weight: 0}, {Name: "v2", Weight: 1}}
	d.SetPolicy(p)
	clk.add(11 * time.Minute)
	if got := decide(t, d, session("r")); got.Kind != affinity.KindRebind || got.Instance.Version != "v1" {
		t.Fatalf("past max_sticky_duration under strict: %+v, want a rebind within v1", got)
	}
	if got := decide(t, d, session("r")); got.Kind != affinity.KindHit || got.Instance.Version != "v1" {
		t.Fatalf("the turn after: %+v, want a hit on v1", got)
	}
}

// TestRebindWhenTheSessionsVersionIsDown: past max_sticky_duration the
// store renews a session onto an instance of today's version; when none of
// the session's own version is up, strict keeps the session on its version
// (the request fails, and so does the next, rather than continuing on the
// other version) and prefer lets it stay on the instance just bound.
func TestRebindWhenTheSessionsVersionIsDown(t *testing.T) {
	for _, va := range []affinity.VersionAffinity{affinity.Strict, affinity.Prefer} {
		t.Run(string(va), func(t *testing.T) {
			clk := &clock{t: time.Unix(1_700_000_000, 0)}
			p := affinity.Policy{Mode: affinity.Sticky, Lifetime: bindings.Lifetime{Idle: time.Hour, Max: 10 * time.Minute}, VersionAffinity: va,
				Versions: []affinity.VersionWeight{{Name: "v1", Weight: 1}, {Name: "v2", Weight: 0}}}
			all := versioned(1)
			f := fleet.New(all)
			d := affinity.New(memory.New(), f, p, affinity.WithClock(clk.now))
			if got := decide(t, d, session("r")); got.Instance.Name != "v1-0" {
				t.Fatalf("first turn on %s", got.Instance.Name)
			}
			f.Replace(all[1:]) // v1-0 leaves: only v2-0 is up
			clk.add(11 * time.Minute)
			for turn := 2; turn <= 3; turn++ {
				got, err := d.Decide(context.Background(), session("r"))
				d.Finish(got, fleet.Outcome{Answered: true})
				switch {
				case va == affinity.Strict && !errors.Is(err, affinity.ErrNoVersion):
					t.Fatalf("turn %d under strict with v1 down: %+v, %v; want ErrNoVersion, not the session moved to v2", turn, got, err)
				case va == affinity.Prefer && (err != nil || got.Instance.Name != "v2-0"):
					t.Fatalf("turn %d under prefer with v1 down: %+v, %v; want v2-0", turn, got, err)
				}
			}
			f.Replace(all)
			got := decide(t, d, session("r"))
			if want := map[affinity.VersionAffinity]string{affinity.Strict: "v1", affinity.Prefer: "v2"}[va]; got.Instance.Version != want {
				t.Errorf("once v1 is back: %+v, want the session on %s", got, want)
			}
		})
	}
}

// TestSaturatedFleetStillBinds: with every instance saturated a new
// session is bound where it is placed, and says bind (the audit always
// records binds; a hit there would hide the binding from forget).
func TestSaturatedFleetStillBinds(t *testing.T) {
	ins := instances(2)
	p := affinity.Policy{Mode: affinity.Adaptive, Lifetime: lifetime, Saturation: affinity.Saturation{QueueDepth: 4}}
	d := affinity.New(memory.New(), fleet.New(ins), p)
	for _, in := range ins {
		d.Load().End(in.Name, time.Now(), 9, true)
	}
	got, err := d.Decide(context.Background(), session("new"))
	if err != nil {
		t.Fatal(err)
	}
	if got.Kind != affinity.KindBind || got.Previous != "" {
		t.Fatalf("new session on a saturated fleet: %s (previous %q), want bind", got.Kind, got.Previous)
	}
}
