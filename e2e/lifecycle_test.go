//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/internal/testenv"
	"github.com/tetherproxy/tether/plan"
)

// The session lifecycle through real Envoy, redis-server and the tether
// binary: canary cohorts, strict version affinity and operator migration,
// bounded-load placement, adaptive spilling, linked identities, and
// configurations tether must refuse.

// versionedFleet starts n instances of each version, named <version>-<i>.
func versionedFleet(t *testing.T, n int, versions ...string) []config.Instance {
	t.Helper()
	var specs []config.Instance
	for _, v := range versions {
		for i := range n {
			specs = append(specs, config.Instance{Name: fmt.Sprintf("%s-%d", v, i), Version: v})
		}
	}
	return startInstances(t, specs...)
}

// gpus starts n instances of version v1, named gpu-<i>.
func gpus(t *testing.T, n int, kvSessions int) []config.Instance {
	t.Helper()
	specs := make([]config.Instance, n)
	for i := range specs {
		specs[i] = config.Instance{Name: fmt.Sprintf("gpu-%d", i), KVSessions: kvSessions}
	}
	return startInstances(t, specs...)
}

// versionsOf maps instance names to model versions.
func versionsOf(inst []config.Instance) map[string]string {
	out := map[string]string{}
	for _, in := range inst {
		out[in.Name] = in.Version
	}
	return out
}

// turn sends one request of a conversation. It is an error unless the
// instance answered 200 and is the one tether chose.
func turn(px *proxy, h map[string]string) (answer, error) {
	a, err := tryChat(px, h)
	if err != nil {
		return a, err
	}
	if a.status != http.StatusOK || a.instance == "" || a.instance != a.tethered {
		return a, fmt.Errorf("status %d from %q, tether chose %q (%s)", a.status, a.instance, a.tethered, a.decision)
	}
	return a, nil
}

// problems collects failures from many goroutines and reports the first
// few, so that one broken assumption does not print twenty thousand lines.
type problems struct {
	mu    sync.Mutex
	n     int
	first []string
}

func (p *problems) add(format string, args ...any) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.n++
	if len(p.first) < 5 {
		p.first = append(p.first, fmt.Sprintf(format, args...))
	}
}

// check fails t if anything was added.
func (p *problems) check(t *testing.T, what string) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.n > 0 {
		t.Errorf("%s: %d problems, the first:\n  %s", what, p.n, strings.Join(p.first, "\n  "))
	}
}

// background runs fn(worker) on workers goroutines until stop is called;
// stop waits for them. fn must return after each short unit of work.
func background(workers int, fn func(worker int)) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-done:
					return
				default:
				}
				fn(w)
			}
		}()
	}
	return sync.OnceFunc(func() { close(done); wg.Wait() })
}

// instanceAdmin calls an emulated instance's admin API.
func instanceAdmin(t *testing.T, method, url, body string) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s %s: %s", method, url, resp.Status)
	}
}

func TestCanaryCohortsThroughEnvoy(t *testing.T) {
	rds := testenv.RedisServer(t)
	inst := versionedFleet(t, 4, "v1", "v2")
	cfg := baseConfig(rds.URL(), inst)
	cfg.Versions = []config.Version{{Name: "v1", Weight: 90}, {Name: "v2", Weight: 10, Canary: true}}
	cfg.Routing.CanaryByHeader = "x-canary"
	tt := startTether(t, cfg)
	px := startEnvoy(t, cfg, tt.extproc)
	version := versionsOf(inst)

	// Each user alternates between three conversations, 20 requests in
	// all: each conversation binds once and then hits, and all three run on
	// the version of the user's cohort.
	const users, sessions, requests = 1000, 3, 20
	userVersion := make([]string, users)
	var mu sync.Mutex
	perInstance := map[string]int{}
	var bad problems
	start := time.Now()
	parallel(users, 32, func(u int) {
		on := map[int]string{}
		for r := range requests {
			s := r % sessions
			h := map[string]string{"x-user-id": fmt.Sprintf("user-%d", u), "x-session-id": fmt.Sprintf("user-%d-conv-%d", u, s)}
			a, err := turn(px, h)
			if err != nil {
				bad.add("user %d request %d: %v", u, r, err)
				return
			}
			want := "hit"
			if r < sessions {
				want, on[s] = "bind", a.instance
				mu.Lock()
				perInstance[a.instance]++
				mu.Unlock()
			}
			if a.decision != want || a.instance != on[s] {
				bad.add("user %d session %d request %d: %s on %s, want %s on %s", u, s, r, a.decision, a.instance, want, on[s])
				return
			}
			if r == 0 {
				userVersion[u] = version[a.instance]
			} else if v := version[a.instance]; v != userVersion[u] {
				bad.add("user %d: session %d on %s, the user's first on %s", u, s, v, userVersion[u])
				return
			}
		}
	})
	took := time.Since(start)
	bad.check(t, "canary traffic")
	canary := 0
	for _, v := range userVersion {
		if v == "v2" {
			canary++
		}
	}
	share := float64(canary) / users
	t.Logf("%d users × %d sessions, %d requests in %v (%.0f req/s): %d users (%.1f%%) on canary v2; sessions per instance %v",
		users, sessions, users*requests, took.Round(time.Millisecond), float64(users*requests)/took.Seconds(), canary, 100*share, perInstance)
	if share < 0.08 || share > 0.12 {
		t.Errorf("canary share %.3f, want 0.10 ± 0.02", share)
	}

	// x-canary overrides the cohort, for users of either cohort.
	var sample []int
	in, out := 0, 0
	for u, v := range userVersion {
		if v == "v2" && in < 25 {
			sample, in = append(sample, u), in+1
		}
		if v == "v1" && out < 25 {
			sample, out = append(sample, u), out+1
		}
	}
	for _, tc := range []struct{ value, want string }{{"always", "v2"}, {"never", "v1"}} {
		moved := 0
		for _, u := range sample {
			h := map[string]string{"x-user-id": fmt.Sprintf("user-%d", u), "x-session-id": fmt.Sprintf("user-%d-%s", u, tc.value), "x-canary": tc.value}
			a, err := turn(px, h)
			if err != nil || a.decision != "bind" || version[a.instance] != tc.want {
				t.Errorf("x-canary: %s, user %d (cohort %s): %+v, %v; want a new session on %s", tc.value, u, userVersion[u], a, err, tc.want)
				continue
			}
			if userVersion[u] != tc.want {
				moved++
			}
		}
		t.Logf("x-canary: %s: %d users (%d of them from the other cohort) all started on %s", tc.value, len(sample), moved, tc.want)
	}
}

func TestStrictVersionsAndMigration(t *testing.T) {
	rds := testenv.RedisServer(t)
	inst := versionedFleet(t, 4, "v1", "v2")
	cfg := baseConfig(rds.URL(), inst)
	cfg.Routing.VersionAffinity = config.VersionStrict
	cfg.Versions = []config.Version{{Name: "v1", Weight: 100}, {Name: "v2", Weight: 0}}
	tt := startTether(t, cfg)
	px := startEnvoy(t, cfg, tt.extproc)
	version := versionsOf(inst)

	// Sessions 0…blue-1 begin under v1 100%, blue… under v2 100%.
	const blue, green = 120, 40
	headers := func(s int) map[string]string {
		if s < blue {
			return map[string]string{"x-session-id": fmt.Sprintf("blue-%d", s)}
		}
		return map[string]string{"x-session-id": fmt.Sprintf("green-%d", s-blue)}
	}
	home := make([]string, blue+green)
	var bad problems
	expect := func(s int, decision, ver, instance string) {
		a, err := turn(px, headers(s))
		switch {
		case err != nil:
			bad.add("session %d: %v", s, err)
		case a.decision != decision || version[a.instance] != ver || (instance != "" && a.instance != instance):
			bad.add("session %d: %s on %s, want %s on %s %s", s, a.decision, a.instance, decision, ver, instance)
		case home[s] == "":
			home[s] = a.instance
		}
	}
	parallel(blue, 16, func(s int) { expect(s, "bind", "v1", "") })
	bad.check(t, "sessions begun on v1")

	cfg.Versions = []config.Version{{Name: "v1", Weight: 0}, {Name: "v2", Weight: 100}}
	start := time.Now()
	writeConfig(t, tt.path, cfg)
	waitFor(t, 10*time.Second, "the weights moved to v2 to apply", func() bool {
		return tt.metric(t, "tether_config_reloads_total", `source="file"`, `result="applied"`) >= 1
	})
	t.Logf("weights v1 100 → v2 100 applied %v after the file changed", time.Since(start).Round(time.Millisecond))
	parallel(blue, 16, func(s int) { expect(s, "hit", "v1", home[s]) })
	parallel(green, 16, func(i int) { expect(blue+i, "bind", "v2", "") })
	bad.check(t, "after the weights moved")
	if t.Failed() {
		return
	}

	// Migrate v1 → v2 while every session keeps taking turns. A worker owns
	// the sessions s ≡ w (mod workers) and runs their turns in order, as a
	// conversation does.
	type step struct {
		decision, instance string
		began              time.Time
	}
	steps := make([][]step, blue+green)
	var migrations atomic.Int64
	const workers = 8
	stop := background(workers, func(w int) {
		for s := w; s < blue+green; s += workers {
			began := time.Now()
			a, err := turn(px, headers(s))
			if err != nil {
				bad.add("session %d during the migration: %v", s, err)
				continue
			}
			steps[s] = append(steps[s], step{a.decision, a.instance, began})
			if a.decision == "migrated" {
				migrations.Add(1)
			}
		}
	})
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	start = time.Now()
	out, err := exec.CommandContext(ctx, tetherBin, "sessions", "migrate", "--admin", "http://"+tt.admin,
		"--from-version", "v1", "--to-version", "v2", "--batch", "20", "--interval", "100ms").CombinedOutput()
	cliDone := time.Now()
	cliTook := cliDone.Sub(start)
	if err != nil {
		stop()
		t.Fatalf("tether sessions migrate: %v\n%s", err, out)
	}
	waitFor(t, 30*time.Second, "every v1 session to take its turn after the migration", func() bool { return migrations.Load() >= blue })
	allMoved := time.Since(start)
	stop()
	// One more turn each, with the load stopped: every session is on v2.
	for s := range blue + green {
		began := time.Now()
		a, err := turn(px, headers(s))
		if err != nil {
			bad.add("session %d after the migration: %v", s, err)
			continue
		}
		steps[s] = append(steps[s], step{a.decision, a.instance, began})
	}
	bad.check(t, "turns during and after the migration")

	// Blue sessions: hits on their v1 instance, one "migrated" to a v2
	// instance, then hits there; a turn begun after the CLI returned (every
	// session marked) is on v2. Green sessions: hits throughout.
	turns, lateMoves := 0, 0
	for s, ss := range steps {
		turns += len(ss)
		moved := ""
	check:
		for i, st := range ss {
			switch {
			case moved == "" && st.decision == "hit" && st.instance == home[s] && (s >= blue || st.began.Before(cliDone)):
			case moved == "" && s < blue && st.decision == "migrated" && version[st.instance] == "v2":
				moved = st.instance
				if st.began.After(cliDone) {
					lateMoves++
				}
			case moved != "" && st.decision == "hit" && st.instance == moved:
			default:
				t.Errorf("session %d (began on %s) turn %d: %s on %s; its turns: %v", s, home[s], i, st.decision, st.instance, ss)
				break check
			}
		}
		if s < blue && moved == "" {
			t.Errorf("blue session %d was never migrated: %v", s, ss)
		}
	}
	t.Logf("migration: CLI ran %v (%q); every v1 session on v2 %v after it began, %d of them at their first turn after the CLI returned; %d turns during and after, %d \"migrated\", 0 failed",
		cliTook.Round(time.Millisecond), strings.TrimSpace(string(out)), allMoved.Round(time.Millisecond), lateMoves, turns, migrations.Load())
}

func TestBoundedLoadThroughEnvoy(t *testing.T) {
	rds := testenv.RedisServer(t)
	// kv_sessions 5: far below each instance's share, so the load bound,
	// not the KV capacity floor, is what limits placement.
	inst := gpus(t, 8, 5)
	inst[3].Weight = 2
	cfg := baseConfig(rds.URL(), inst)
	cfg.Routing.BoundedLoadEpsilon = 0.25
	tt := startTether(t, cfg)
	px := startEnvoy(t, cfg, tt.extproc)
	totalWeight := 0.0
	for _, in := range inst {
		totalWeight += in.Weight
	}
	weight := map[string]float64{}
	for _, in := range inst {
		weight[in.Name] = in.Weight
	}

	var bad problems
	placed := map[string]int{}
	place := func(keys []string, workers int) map[string]int {
		got := map[string]int{}
		var mu sync.Mutex
		parallel(len(keys), workers, func(i int) {
			a, err := turn(px, map[string]string{"x-session-id": keys[i]})
			if err != nil || a.decision != "bind" {
				bad.add("%s: %+v, %v; want a bind", keys[i], a, err)
				return
			}
			mu.Lock()
			got[a.instance]++
			placed[a.instance]++
			mu.Unlock()
		})
		return got
	}
	// (1+ε) × the weighted share, +1 because the bound is rounded up to a
	// whole session.
	limit := func(name string, sessions int) float64 {
		return (1+cfg.Routing.BoundedLoadEpsilon)*float64(sessions)*weight[name]/totalWeight + 1
	}

	keys := make([]string, 1000)
	for i := range keys {
		keys[i] = fmt.Sprintf("spread-%d", i)
	}
	first := place(keys, 16)
	bad.check(t, "1000 new sessions")
	var report []string
	for _, in := range inst {
		n := first[in.Name]
		report = append(report, fmt.Sprintf("%s(w%g) %d/%.1f", in.Name, in.Weight, n, limit(in.Name, len(keys))))
		if float64(n) > limit(in.Name, len(keys)) {
			t.Errorf("%s (weight %g) took %d of %d sessions, above 1.25 × its share + 1 = %.1f", in.Name, in.Weight, n, len(keys), limit(in.Name, len(keys)))
		}
	}
	t.Logf("1000 new sessions, count/limit (limit = 1.25 × weighted share + 1 for rounding): %s", strings.Join(report, " "))

	// Bursts of new sessions that all rank one instance first, as tether
	// ranks them: the session key from the identity extractor with the
	// test's secret, rendezvous over the fleet from the same config. One
	// burst arrives a session at a time, the other 16 at a time.
	fl := plan.Instances(cfg)
	ids := extractor(t)
	sessions := len(keys)
	for _, b := range []struct {
		target  string
		workers int
	}{{inst[1].Name, 1}, {inst[0].Name, 16}} {
		var burst []string
		for i := 0; len(burst) < 200; i++ {
			k := fmt.Sprintf("burst-%s-%d", b.target, i)
			if affinity.Rendezvous(ids.Extract(identity.Map{"x-session-id": k}).Key, fl).Name == b.target {
				burst = append(burst, k)
			}
		}
		held := placed[b.target]
		got := place(burst, b.workers)
		bad.check(t, "the burst")
		sessions += len(burst)
		lim := limit(b.target, sessions)
		t.Logf("burst of %d new sessions whose first choice is %s, %d at a time: %d landed on it (rendezvous alone: all %d); it held %d, now %d, limit %.1f at %d sessions; the burst went to %v",
			len(burst), b.target, b.workers, got[b.target], len(burst), held, placed[b.target], lim, sessions, got)
		if float64(placed[b.target]) > lim {
			t.Errorf("the burst %d at a time piled onto %s: it holds %d sessions, %.1f above 1.25 × its share + 1 = %.1f",
				b.workers, b.target, placed[b.target], float64(placed[b.target])-lim, lim)
		}
		if len(got) < 4 {
			t.Errorf("the burst went to %d instances only: %v", len(got), got)
		}
	}
}

// adaptiveConfig is the config of the adaptive tests: the instances are
// vLLM engines whose /metrics tether scrapes, saturated at 5 waiting
// requests (the default), and gold-tier users (x-user-tier) of high
// priority. adaptive 0 gives the same config, sticky.
func adaptiveConfig(redisURL string, inst []config.Instance, adaptive int) config.Config {
	c := baseConfig(redisURL, inst)
	c.Engines.Default = config.EngineVLLM
	c.Routing.AdaptiveSticky = adaptive
	c.Routing.Rules = []config.Rule{{Name: "gold", Tiers: []string{"gold"}, Priority: config.PriorityHigh}}
	return c
}

func TestAdaptiveWithoutSaturationIsSticky(t *testing.T) {
	// A loose load bound (ε = 10) keeps bounded-load placement out of the
	// comparison: near the bound, placement depends on each process's
	// active-session count, which follows the load sync's timing, so two
	// tethers of either mode may place a new session differently.
	inst := gpus(t, 4, 1000)
	adaptive := adaptiveConfig(testenv.RedisServer(t).URL(), inst, 1)
	sticky := adaptiveConfig(testenv.RedisServer(t).URL(), inst, 0)
	adaptive.Routing.BoundedLoadEpsilon, sticky.Routing.BoundedLoadEpsilon = 10, 10
	ta, ts := startTether(t, adaptive), startTether(t, sticky)
	pa, ps := startEnvoy(t, adaptive, ta.extproc), startEnvoy(t, sticky, ts.extproc)

	// The same requests, in the same order, through both.
	const sessions, turns = 150, 3
	kinds := map[string]int{}
	for r := range turns {
		for s := range sessions {
			h := map[string]string{"x-session-id": fmt.Sprintf("same-%d", s)}
			if s%3 == 0 {
				h["x-user-tier"] = "gold"
			}
			a, err := turn(pa, h)
			if err != nil {
				t.Fatalf("adaptive, session %d turn %d: %v", s, r, err)
			}
			b, err := turn(ps, h)
			if err != nil {
				t.Fatalf("sticky, session %d turn %d: %v", s, r, err)
			}
			if a.instance != b.instance || a.decision != b.decision {
				t.Fatalf("session %d turn %d: adaptive %s on %s, sticky %s on %s", s, r, a.decision, a.instance, b.decision, b.instance)
			}
			kinds[a.decision]++
		}
	}
	t.Logf("%d sessions × %d turns through an adaptive and a sticky tether: identical instances and decisions %v", sessions, turns, kinds)
}

func TestAdaptiveSpillsLowPriorityOffASaturatedInstance(t *testing.T) {
	rds := testenv.RedisServer(t)
	inst := gpus(t, 4, 0)
	cfg := adaptiveConfig(rds.URL(), inst, 1)
	tt := startTether(t, cfg)
	px := startEnvoy(t, cfg, tt.extproc)
	hot := inst[1]

	// Ten normal and ten gold sessions on the instance about to saturate.
	var low, high []map[string]string
	for i := 0; len(low) < 10 || len(high) < 10; i++ {
		h := map[string]string{"x-session-id": fmt.Sprintf("adaptive-%d", i)}
		gold := i%2 == 1
		if gold {
			h["x-user-tier"] = "gold"
		}
		a, err := turn(px, h)
		if err != nil || a.decision != "bind" {
			t.Fatalf("session %d: %+v, %v", i, a, err)
		}
		switch {
		case a.instance != hot.Name:
		case gold && len(high) < 10:
			high = append(high, h)
		case !gold && len(low) < 10:
			low = append(low, h)
		}
	}

	// Saturate it: 300ms more per request, and the gold sessions keep a
	// request each in flight, so its /metrics report 4 running and about 6
	// waiting (its batch holds 4).
	instanceAdmin(t, http.MethodPost, "http://"+hot.Address+"/admin/faults", `{"extra_latency":"300ms"}`)
	t.Cleanup(func() { instanceAdmin(t, http.MethodDelete, "http://"+hot.Address+"/admin/faults", "") })
	var bad problems
	var highTurns atomic.Int64
	stop := background(len(high), func(w int) {
		a, err := turn(px, high[w])
		highTurns.Add(1)
		if err != nil || a.decision != "hit" || a.instance != hot.Name {
			bad.add("gold session %s on the saturated instance: %+v, %v; want a hit on %s", high[w]["x-session-id"], a, err, hot.Name)
		}
	})
	defer stop()

	// The first normal session hits until tether sees the queue, then spills.
	ids := extractor(t)
	next := func(h map[string]string) string {
		return affinity.Rendezvous(ids.Extract(identity.Map(h)).Key, without(plan.Instances(cfg), hot.Name)).Name
	}
	start := time.Now()
	var first answer
	waitFor(t, 20*time.Second, "the first normal session to leave the saturated instance", func() bool {
		a, err := turn(px, low[0])
		if err != nil {
			t.Fatalf("normal session on the saturating instance: %v", err)
		}
		first = a
		return a.decision != "hit" || a.instance != hot.Name
	})
	noticed := time.Since(start)
	spilled := map[string]int{}
	for i, h := range low {
		a := first
		if i > 0 {
			var err error
			if a, err = turn(px, h); err != nil {
				t.Fatal(err)
			}
		}
		if want := next(h); a.decision != "spilled" || a.instance != want {
			t.Errorf("normal session %s: %s on %s, want spilled to its next choice %s", h["x-session-id"], a.decision, a.instance, want)
			continue
		}
		spilled[a.instance]++
		if b, err := turn(px, h); err != nil || b.decision != "hit" || b.instance != a.instance {
			t.Errorf("normal session %s after spilling: %+v, %v; want a hit on %s", h["x-session-id"], b, err, a.instance)
		}
	}
	stop()
	bad.check(t, "gold sessions")
	t.Logf("%s saturated (extra 300ms, %d gold sessions in flight): tether saw it after %v; %d normal sessions spilled to their next choices %v and hit there next turn; %d gold turns all hit %s",
		hot.Name, len(high), noticed.Round(time.Millisecond), len(low), spilled, highTurns.Load(), hot.Name)
}

func without(in []fleet.Instance, name string) []fleet.Instance {
	var out []fleet.Instance
	for _, i := range in {
		if i.Name != name {
			out = append(out, i)
		}
	}
	return out
}

func TestLinkedIdentitiesThroughEnvoy(t *testing.T) {
	rds := testenv.RedisServer(t)
	inst := startFleet(t, 8)
	cfg := baseConfig(rds.URL(), inst)
	tt := startTether(t, cfg)
	px := startEnvoy(t, cfg, tt.extproc)

	for _, tc := range []struct {
		name         string
		start, alone func(i int) map[string]string
	}{
		{"bearer token",
			func(i int) map[string]string {
				return map[string]string{"x-session-id": fmt.Sprintf("linked-%d", i), "authorization": fmt.Sprintf("Bearer tok.linked.%d", i)}
			},
			func(i int) map[string]string {
				return map[string]string{"authorization": fmt.Sprintf("Bearer tok.linked.%d", i)}
			}},
		{"device and user",
			func(i int) map[string]string {
				return map[string]string{"x-session-id": fmt.Sprintf("on-device-%d", i), "x-device-id": fmt.Sprintf("dev-%d", i), "x-user-id": fmt.Sprintf("user-%d", i)}
			},
			func(i int) map[string]string {
				return map[string]string{"x-device-id": fmt.Sprintf("dev-%d", i), "x-user-id": fmt.Sprintf("user-%d", i)}
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const n = 50
			spread := map[string]int{}
			for i := range n {
				a, err := turn(px, tc.start(i))
				if err != nil || a.decision != "bind" {
					t.Fatalf("session %d: %+v, %v; want a bind", i, a, err)
				}
				spread[a.instance]++
				for r := range 2 {
					b, err := turn(px, tc.alone(i))
					if err != nil || b.decision != "hit" || b.instance != a.instance {
						t.Fatalf("%s alone, session %d request %d: %+v, %v; want a hit on %s", tc.name, i, r, b, err, a.instance)
					}
				}
			}
			// The control: the same identifier never sent with a session binds anew.
			if a, err := turn(px, tc.alone(1_000_000)); err != nil || a.decision != "bind" {
				t.Fatalf("unlinked %s: %+v, %v; want a bind", tc.name, a, err)
			}
			t.Logf("%d sessions started with a %s: each later request with the %s alone hit the session's instance; sessions per instance %v", n, tc.name, tc.name, spread)
		})
	}
}

func TestBadInputConfigIsRefused(t *testing.T) {
	rds := testenv.RedisServer(t)
	inst := versionedFleet(t, 2, "v1", "v2")
	good := baseConfig(rds.URL(), inst)
	good.Versions = []config.Version{{Name: "v1", Weight: 100}, {Name: "v2", Weight: 0}}
	// Every broken file also moves the weights to v2: applied, it would
	// send new sessions there.
	toV2 := good
	toV2.Versions = []config.Version{{Name: "v1", Weight: 0}, {Name: "v2", Weight: 100}}
	withRule := func(r config.Rule) config.Config {
		c := toV2
		c.Routing.Rules = []config.Rule{r}
		return c
	}
	zero := good
	zero.Versions = []config.Version{{Name: "v1", Weight: 0}, {Name: "v2", Weight: 0}}
	broken := []struct {
		name string
		toml []byte
		want string
	}{
		{"rule names an unknown version", encodeConfig(t, withRule(config.Rule{Name: "pin", Header: "x-tenant", Version: "v9"})), `routing.rules[0].version = "v9"`},
		{"version weights sum to zero", encodeConfig(t, zero), "versions = [0 0]: weights sum to zero"},
		{"rule with an invalid regex", encodeConfig(t, withRule(config.Rule{Name: "re", Header: "x-tenant", Regex: "([a-z"})), `routing.rules[0].regex = "([a-z"`},
		{"rule with an invalid duration", append(encodeConfig(t, toV2), "\n[[routing.rules]]\nname = \"slow\"\nheader = \"x-tenant\"\nidle_timeout = \"5 parsecs\"\n"...),
			`routing.rules.idle_timeout: "5 parsecs" is not a duration`},
	}

	dir := t.TempDir()
	for _, tc := range broken {
		t.Run("validate/"+tc.name, func(t *testing.T) {
			p := filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "-")+".toml")
			if err := os.WriteFile(p, tc.toml, 0o600); err != nil {
				t.Fatal(err)
			}
			out, err := exec.Command(tetherBin, "config", "validate", p).CombinedOutput()
			if code := exitCode(err); code == 0 {
				t.Fatalf("exit 0 for a broken file:\n%s", out)
			}
			if !strings.Contains(string(out), tc.want) {
				t.Fatalf("output does not name %q:\n%s", tc.want, out)
			}
			t.Logf("%s", strings.TrimSpace(string(out)))
		})
	}

	// Live: each broken file is refused while traffic flows, and the
	// configuration in force stays.
	tt := startTether(t, good)
	px := startEnvoy(t, good, tt.extproc)
	version := versionsOf(inst)
	var bad problems
	var sent atomic.Int64
	stop := background(4, func(w int) {
		n := sent.Add(1)
		a, err := turn(px, map[string]string{"x-session-id": fmt.Sprintf("live-%d", n)})
		if err != nil || a.decision != "bind" || version[a.instance] != "v1" {
			bad.add("new session %d: %+v, %v; want a bind on v1", n, a, err)
		}
	})
	defer stop()
	xdsVersion := tt.xdsState(t).Version
	for i, tc := range broken {
		before := tt.metric(t, "tether_config_reloads_total", `result="invalid"`)
		testenv.WriteFile(t, tt.path, tc.toml)
		waitFor(t, 10*time.Second, "tether to refuse "+tc.name, func() bool {
			return tt.metric(t, "tether_config_reloads_total", `result="invalid"`) >= before+1
		})
		if v := tt.xdsState(t).Version; v != xdsVersion {
			t.Errorf("%s: the Envoy resources changed from %s to %s", tc.name, xdsVersion, v)
		}
		if a, err := turn(px, map[string]string{"x-session-id": fmt.Sprintf("after-refusal-%d", i)}); err != nil || version[a.instance] != "v1" {
			t.Errorf("after refusing %s: new session %+v, %v; want v1 (the configuration in force)", tc.name, a, err)
		}
	}
	stop()
	bad.check(t, "traffic while broken files were refused")
	invalid := tt.metric(t, "tether_config_reloads_total", `source="file"`, `result="invalid"`)
	applied := tt.metric(t, "tether_config_reloads_total", `source="file"`, `result="applied"`)
	t.Logf("%d broken files refused live (reloads invalid %v, applied %v), Envoy resources still %s, %d new sessions meanwhile all on v1",
		len(broken), invalid, applied, xdsVersion, sent.Load())
	if applied != 0 {
		t.Errorf("%v broken files were applied", applied)
	}

	// The watcher still works: a good file applies.
	writeConfig(t, tt.path, toV2)
	waitFor(t, 10*time.Second, "the good file to apply", func() bool {
		return tt.metric(t, "tether_config_reloads_total", `source="file"`, `result="applied"`) >= 1
	})
	if a, err := turn(px, map[string]string{"x-session-id": "after-good-file"}); err != nil || version[a.instance] != "v2" {
		t.Errorf("after the good file: new session %+v, %v; want v2", a, err)
	}
}
