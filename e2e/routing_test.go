//go:build e2e

package e2e

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/testenv"
)

// identities builds request headers for caller i of each identity source.
var identities = []struct {
	name    string
	headers func(i int) map[string]string
}{
	{"session id", func(i int) map[string]string { return map[string]string{"x-session-id": fmt.Sprintf("conv-%d", i)} }},
	{"bearer token", func(i int) map[string]string {
		return map[string]string{"authorization": fmt.Sprintf("Bearer tok.%d.secret", i)}
	}},
	{"device and user", func(i int) map[string]string {
		return map[string]string{"x-device-id": fmt.Sprintf("dev-%d", i), "x-user-id": fmt.Sprintf("user-%d", i)}
	}},
}

func TestStickinessThroughEnvoy(t *testing.T) {
	rds := testenv.RedisServer(t)
	inst := startFleet(t, 8)
	cfg := baseConfig(rds.URL(), inst)
	tt := startTether(t, cfg)
	px := startEnvoy(t, cfg, tt.extproc)

	for _, id := range identities {
		t.Run(id.name, func(t *testing.T) {
			// 50 requests of one caller: one instance; the first binds, the
			// rest hit, and the instance tether chose is the one that answered.
			caller := id.headers(1_000_000)
			var first answer
			for i := 0; i < 50; i++ {
				a := chat(t, px, caller)
				if a.status != 200 || a.instance == "" || a.instance != a.tethered {
					t.Fatalf("request %d: %+v", i, a)
				}
				want := "hit"
				if i == 0 {
					first, want = a, "bind"
				}
				if a.instance != first.instance || a.decision != want {
					t.Fatalf("request %d went to %s (%s), first went to %s", i, a.instance, a.decision, first.instance)
				}
			}
			// 200 callers: every instance used, none above twice the mean.
			var mu sync.Mutex
			perInstance := map[string]int{}
			parallel(200, 16, func(i int) {
				a := chat(t, px, id.headers(i))
				if a.status != 200 || a.decision != "bind" {
					t.Errorf("caller %d: %+v", i, a)
				}
				mu.Lock()
				perInstance[a.instance]++
				mu.Unlock()
			})
			mean := 200.0 / 8
			for name, n := range perInstance {
				if float64(n) > 2*mean {
					t.Errorf("%s took %d of 200 sessions (mean %.0f)", name, n, mean)
				}
			}
			if len(perInstance) != 8 {
				t.Errorf("sessions reached %d of 8 instances: %v", len(perInstance), perInstance)
			}
			t.Logf("200 %s callers over 8 instances: %v", id.name, perInstance)
		})
	}

	// Redis holds hashed keys only: no raw session id, token or user id.
	keys, err := rds.Client().Keys(context.Background(), "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	bindings := 0
	for _, k := range keys {
		if strings.HasSuffix(k, "}:b") {
			bindings++
		}
	}
	if bindings != 3*201 {
		t.Errorf("redis holds %d bindings, want %d (of %d keys)", bindings, 3*201, len(keys))
	}
	for _, k := range keys {
		for _, raw := range []string{"conv-", "tok.", "secret", "dev-", "user-"} {
			if strings.Contains(k, raw) {
				t.Fatalf("redis key %q holds a raw identifier", k)
			}
		}
	}
}

// TestTwoReplicasAgree: two replicas of tether behind one Envoy, on a
// standalone Redis, a 3-master Cluster and behind a Sentinel, keep each
// session on one instance, the one its binding names, and both serve
// their sessions' hits from their caches (/readyz: "hits": "cached").
func TestTwoReplicasAgree(t *testing.T) {
	deployments := []struct {
		name  string
		start func(t *testing.T) (url string, rdb goredis.Cmdable)
	}{
		{"standalone", func(t *testing.T) (string, goredis.Cmdable) {
			rds := testenv.RedisServer(t)
			return rds.URL(), rds.Client()
		}},
		{"cluster", func(t *testing.T) (string, goredis.Cmdable) {
			c := testenv.RedisCluster(t)
			a := c.Addrs()
			return "redis+cluster://" + a[0] + "?addr=" + a[1] + "&addr=" + a[2], c.Client()
		}},
		{"sentinel", func(t *testing.T) (string, goredis.Cmdable) {
			s := testenv.RedisSentinel(t, "")
			c := goredis.NewClient(&goredis.Options{Addr: s.MasterAddr()})
			t.Cleanup(func() { _ = c.Close() })
			return s.URL(), c
		}},
	}
	for _, d := range deployments {
		t.Run(d.name, func(t *testing.T) {
			url, rdb := d.start(t)
			twoReplicasAgree(t, url, rdb)
		})
	}
}

func twoReplicasAgree(t *testing.T, url string, rdb goredis.Cmdable) {
	inst := startFleet(t, 8)
	cfgA := baseConfig(url, inst)
	// Replica B weighs the instances differently (as during a config
	// rollout), so without the shared store the two would place most new
	// sessions on different instances.
	cfgB := baseConfig(url, inst)
	for i := range cfgB.Instances {
		cfgB.Instances[i].Weight = float64(1 + 3*i)
	}
	a, b := startTether(t, cfgA), startTether(t, cfgB)
	for _, p := range []*tether{a, b} {
		var ready struct{ Hits string }
		getJSON(t, "http://"+p.admin+"/readyz", &ready)
		if ready.Hits != "cached" {
			t.Fatalf("/readyz hits %q; want cached", ready.Hits)
		}
	}
	px := startEnvoy(t, cfgA, a.extproc, b.extproc)

	const sessions, turns = 150, 6
	var mu sync.Mutex
	seen := map[int]map[string]bool{}
	parallel(sessions*turns, 24, func(i int) {
		s := i / turns // a session's turns are consecutive, so they are in flight together
		ans := chat(t, px, map[string]string{"x-session-id": fmt.Sprintf("race-%d", s)})
		if ans.status != 200 || ans.decision == "" {
			t.Errorf("session %d: %+v", s, ans)
		}
		mu.Lock()
		if seen[s] == nil {
			seen[s] = map[string]bool{}
		}
		seen[s][ans.instance] = true
		mu.Unlock()
	})
	ids := extractor(t)
	for s, set := range seen {
		if len(set) != 1 {
			t.Errorf("session %d was served by %d instances: %v", s, len(set), set)
			continue
		}
		key := ids.Extract(mapHeaders{"x-session-id": fmt.Sprintf("race-%d", s)}).Key
		bound, err := rdb.HGet(context.Background(), "tether:{"+key+"}:b", "i").Result()
		if err != nil {
			t.Fatalf("session %d: binding: %v", s, err)
		}
		for inst := range set {
			if inst != bound {
				t.Errorf("session %d served by %s but bound to %s", s, inst, bound)
			}
		}
	}
	ra, rb := a.metric(t, "tether_requests_total"), b.metric(t, "tether_requests_total")
	if ra == 0 || rb == 0 || ra+rb != sessions*turns {
		t.Fatalf("replica A decided %v and B %v requests, want both > 0 summing to %d", ra, rb, sessions*turns)
	}
	ca, cb := a.metric(t, "tether_redis_cache_hits_total"), b.metric(t, "tether_redis_cache_hits_total")
	if ca == 0 || cb == 0 {
		t.Errorf("hits from the cache: replica A %v, B %v; want both > 0", ca, cb)
	}
	t.Logf("replica A decided %v requests (%v hits from its cache), replica B %v (%v); %d sessions, each on one instance", ra, ca, rb, cb, sessions)
}

type mapHeaders map[string]string

func (m mapHeaders) Get(k string) string { return m[k] }

func TestRandomModeIsUnbiased(t *testing.T) {
	inst := startFleet(t, 8)
	cfg := baseConfig("embedded", inst)
	cfg.Routing.Mode = config.ModeRandom
	cfg.Routing.RandomSeed = 20261130 // reproducible: the same draws whatever the request order
	tt := startTether(t, cfg)
	px := startEnvoy(t, cfg, tt.extproc)

	const n = 4000
	var mu sync.Mutex
	counts := map[string]int{}
	parallel(n, 16, func(i int) {
		a := chat(t, px, map[string]string{"x-session-id": "same-session-every-time"})
		if a.status != 200 || a.decision != "random" {
			t.Errorf("request %d: %+v", i, a)
		}
		mu.Lock()
		counts[a.instance]++
		mu.Unlock()
	})
	chi2 := 0.0
	for _, in := range inst {
		d := float64(counts[in.Name]) - n/8.0
		chi2 += d * d / (n / 8.0)
	}
	const crit = 18.475 // chi-square, 7 degrees of freedom, 1% level
	t.Logf("random mode: %v, chi-square %.2f (1%% critical value %.3f)", counts, chi2, crit)
	if chi2 > crit || math.IsNaN(chi2) {
		t.Fatalf("split %v fails the chi-square test: %.2f > %.3f", counts, chi2, crit)
	}
}

func TestStickyDisabledRoutesAtRandom(t *testing.T) {
	inst := startFleet(t, 8)
	cfg := baseConfig("embedded", inst)
	cfg.Routing.StickyEnabled = 0
	tt := startTether(t, cfg)
	px := startEnvoy(t, cfg, tt.extproc)
	seen := map[string]bool{}
	for i := 0; i < 80; i++ {
		a := chat(t, px, map[string]string{"x-session-id": "one"})
		if a.decision != "random" {
			t.Fatalf("sticky_enabled = 0: decision %q", a.decision)
		}
		seen[a.instance] = true
	}
	if len(seen) < 4 {
		t.Fatalf("80 requests of one session reached %d instances with sticky_enabled = 0", len(seen))
	}
}

func TestRestartKeepsBindings(t *testing.T) {
	rds := testenv.RedisServer(t)
	inst := startFleet(t, 8)
	cfg := baseConfig(rds.URL(), inst)
	first := startTether(t, cfg)
	px := startEnvoy(t, cfg, first.extproc)

	bound := map[int]string{}
	for s := 0; s < 100; s++ {
		a := chat(t, px, map[string]string{"x-session-id": fmt.Sprintf("keep-%d", s)})
		if a.decision != "bind" {
			t.Fatalf("session %d: %+v", s, a)
		}
		bound[s] = a.instance
	}
	first.Stop()

	// Restart on the same address with new weights: rendezvous hashing alone
	// would now place many sessions elsewhere; only Redis keeps them.
	cfg.Server.ExtProcAddr = first.extproc
	for i := range cfg.Instances {
		cfg.Instances[i].Weight = float64(1 + 5*(i%3))
	}
	startTether(t, cfg)
	waitFor(t, 10*time.Second, "envoy to reach the restarted tether", func() bool {
		a, err := tryChat(px, map[string]string{"x-session-id": "probe"})
		return err == nil && a.decision != ""
	})
	for s, want := range bound {
		a := chat(t, px, map[string]string{"x-session-id": fmt.Sprintf("keep-%d", s)})
		if a.instance != want || a.decision != "hit" {
			t.Fatalf("session %d after restart: %+v, want a hit on %s", s, a, want)
		}
	}
}

func TestTetherStoppedRequestsStillFlow(t *testing.T) {
	inst := startFleet(t, 8)
	cfg := baseConfig("embedded", inst)
	tt := startTether(t, cfg)
	px := startEnvoy(t, cfg, tt.extproc)
	if a := chat(t, px, map[string]string{"x-session-id": "s"}); a.decision == "" {
		t.Fatalf("tether not in the path: %+v", a)
	}
	tt.Stop()

	for _, id := range identities {
		t.Run(id.name, func(t *testing.T) {
			// Each caller stays on one instance, and callers spread over the
			// pool (the ring hashes on their headers, not on nothing).
			spread := map[string]bool{}
			for c := 0; c < 40; c++ {
				caller := id.headers(c)
				// A client may not pick its own cluster while tether is away:
				// Envoy drops the routing header before routing.
				caller["x-tether-cluster"] = "tether-extproc"
				var first string
				for i := 0; i < 5; i++ {
					a := chat(t, px, caller)
					if a.status != 200 || a.decision != "" {
						t.Fatalf("caller %d request %d without tether: %+v", c, i, a)
					}
					if i == 0 {
						first = a.instance
					}
					if a.instance != first {
						t.Fatalf("without tether caller %d moved from %s to %s", c, first, a.instance)
					}
				}
				spread[first] = true
			}
			if len(spread) < 5 {
				t.Fatalf("40 callers reached only %d of 8 instances without tether", len(spread))
			}
		})
	}
}

func TestBadInputIsAnonymousAndCounted(t *testing.T) {
	inst := startFleet(t, 8)
	cfg := baseConfig("embedded", inst)
	cfg.Server.LogLevel = "debug" // every per-request line, to check none holds a raw identifier
	tt := startTether(t, cfg)
	px := startEnvoy(t, cfg, tt.extproc)

	tests := []struct {
		name, header, value, reason string
	}{
		{"10 KB session id", "x-session-id", strings.Repeat("s", 10<<10), "too_long"},
		// Envoy refuses most control bytes itself; a tab is legal in HTTP
		// and reaches tether, which will not key a session on it.
		{"control byte in session id", "x-session-id", "abc\tdef", "control_chars"},
		{"bearer without a token", "authorization", "Bearer ", "malformed_auth"},
		{"bearer with a quote", "authorization", `Bearer ab"cd`, "malformed_auth"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			labels := []string{`header="` + tc.header + `"`, `reason="` + tc.reason + `"`}
			before := tt.metric(t, "tether_identity_rejected_total", labels...)
			a := chat(t, px, map[string]string{tc.header: tc.value})
			if a.status != 200 || a.decision != "anonymous" {
				t.Fatalf("got %+v, want 200 routed as anonymous", a)
			}
			after := tt.metric(t, "tether_identity_rejected_total", labels...)
			if after != before+1 {
				t.Fatalf("rejection counter went from %v to %v", before, after)
			}
		})
	}
	// A good request too, so the debug log has a routed line to check.
	chat(t, px, map[string]string{"x-session-id": "conv-secret-4711", "authorization": "Bearer tok-secret-4711"})
	logs := tt.logs.String()
	if !strings.Contains(logs, `"message":"routed"`) {
		t.Fatal("no per-request debug line: the check below would prove nothing")
	}
	for _, raw := range []string{"secret-4711", `ab\"cd`, strings.Repeat("s", 64)} {
		if strings.Contains(logs, raw) {
			t.Fatalf("tether logged a raw identifier (%q)", raw)
		}
	}
}

func TestConfigValidateNamesTheKey(t *testing.T) {
	dir := t.TempDir()
	tests := []struct{ name, toml, want string }{
		{"bad mode", "[routing]\nmode = \"roundrobin\"\n", `routing.mode = "roundrobin"`},
		{"misspelt key", "[routing]\nstiky_enabled = 1\n", "routing.stiky_enabled"},
		{"negative duration", "[routing]\nmax_sticky_duration = -1\n", "routing.max_sticky_duration"},
		{"syntax", "[routing\n", "line"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "-")+".toml")
			if err := os.WriteFile(p, []byte(tc.toml), 0o600); err != nil {
				t.Fatal(err)
			}
			out, err := exec.Command(tetherBin, "config", "validate", p).CombinedOutput()
			if code := exitCode(err); code == 0 {
				t.Fatalf("exit 0 for a broken file:\n%s", out)
			}
			if !strings.Contains(string(out), tc.want) {
				t.Fatalf("output does not name %q:\n%s", tc.want, out)
			}
		})
	}
	out, err := exec.Command(tetherBin, "config", "validate", "../deploy/local/tether.toml").CombinedOutput()
	if err != nil {
		t.Fatalf("the local stack's config does not validate: %v\n%s", err, out)
	}
}

func exitCode(err error) int {
	if err == nil {
		return 0
	}
	if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
		return ee.ExitCode()
	}
	return -1
}

// TestOneRedisRoundTripPerRequest: with the hit cache on (the default on
// a standalone Redis), a follow-up turn of a known session sends no
// command on the request path: its refresh is written back later, in a
// batch (the touch script on the binding alone, told apart from the
// get-or-bind script, which also names the session's alias link key).
// With the cache off it is one script call on its binding. Either way a
// new session is one get-or-bind call and one call that indexes it under
// its instance. The load sync's and the breaker sync's own calls (once a
// second each, on the {fleet} slot) are told apart by their keys, and the
// subscriber's PINGs by their name.
func TestOneRedisRoundTripPerRequest(t *testing.T) {
	for _, cached := range []bool{true, false} {
		t.Run(map[bool]string{true: "cache on", false: "cache off"}[cached], func(t *testing.T) {
			oneRoundTripPerRequest(t, cached)
		})
	}
}

func oneRoundTripPerRequest(t *testing.T, cached bool) {
	rds := testenv.RedisServer(t)
	inst := startFleet(t, 8)
	cfg := baseConfig(rds.URL(), inst)
	cfg.Redis.Cache = cached
	tt := startTether(t, cfg)
	px := startEnvoy(t, cfg, tt.extproc)
	// Warm up the connection pool, then count from zero.
	for i := 0; i < 5; i++ {
		chat(t, px, map[string]string{"x-session-id": "warm"})
	}
	const sessions, turns = 20, 5
	round := func() []monitored {
		mon := monitor(t, rds.URL())
		for s := 0; s < sessions; s++ {
			if a := chat(t, px, map[string]string{"x-session-id": fmt.Sprintf("rt-%d", s)}); a.decision == "" {
				t.Fatalf("tether not in the path: %+v", a)
			}
		}
		var calls []monitored
		for _, c := range mon.commandsUntilSentinel(t, rds) {
			// The load sync's and the breaker sync's own calls.
			if !strings.Contains(c.args, "{fleet}:replicas") && !strings.Contains(c.args, "{fleet}:circuits") {
				calls = append(calls, c)
			}
		}
		return calls
	}
	count := func(calls []monitored) (binding, index, writeBack int, other []string) {
		for _, c := range calls {
			switch {
			case c.name == "hello" || c.name == "client" || c.name == "ping":
				// A new pooled connection's handshake, the subscriber's
				// PING: not a request's.
			case c.name != "evalsha":
				other = append(other, c.name)
			case strings.Contains(c.args, "}:a\""):
				binding++ // get-or-bind: the binding and its alias link
			case strings.Contains(c.args, "}:b\""):
				writeBack++ // the cache's touch: the binding alone
			case strings.Contains(c.args, "{fleet}:i:"):
				index++
			default:
				other = append(other, c.args)
			}
		}
		return binding, index, writeBack, other
	}
	b, i, w, other := count(round())
	t.Logf("%d new sessions: %d binding script calls, %d index calls, %d write backs, other %v", sessions, b, i, w, other)
	if b != sessions || i != sessions || len(other) > 0 || (!cached && w > 0) {
		t.Fatalf("%d new sessions: %d binding and %d index script calls, %d write backs, other %v; want %d and %d, nothing else",
			sessions, b, i, w, other, sessions, sessions)
	}
	wantBinding := sessions
	if cached {
		wantBinding = 0
	}
	writeBacks := 0
	for turn := 1; turn < turns; turn++ {
		b, i, w, other := count(round())
		writeBacks += w
		if b != wantBinding || i != 0 || len(other) > 0 || (!cached && w > 0) || w > sessions+1 {
			t.Fatalf("follow-up turn %d of %d sessions: %d binding and %d index script calls, %d write backs, other %v; want %d binding calls, at most %d write backs",
				turn, sessions, b, i, w, other, wantBinding, sessions+1)
		}
	}
	if cached {
		t.Logf("%d follow-up turns: no command on the request path; %d write backs in batches", sessions*(turns-1), writeBacks)
	} else {
		t.Logf("%d follow-up turns: one EVALSHA on the session's binding each, nothing else", sessions*(turns-1))
	}
}

// redisMonitor reads MONITOR output on a connection of its own.
type redisMonitor struct {
	conn net.Conn
	r    *bufio.Reader
}

func monitor(t *testing.T, url string) *redisMonitor {
	t.Helper()
	conn, err := net.Dial("unix", strings.TrimPrefix(url, "unix://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	m := &redisMonitor{conn: conn, r: bufio.NewReader(conn)}
	if _, err := conn.Write([]byte("MONITOR\r\n")); err != nil {
		t.Fatal(err)
	}
	if line, err := m.r.ReadString('\n'); err != nil || strings.TrimSpace(line) != "+OK" {
		t.Fatalf("MONITOR: %q, %v", line, err)
	}
	return m
}

// monitored is one command a client sent: its lower-case name and its
// arguments as MONITOR prints them (quoted).
type monitored struct{ name, args string }

// commandsUntilSentinel sends a marker command and returns the commands
// clients sent before it; commands run by scripts are left out.
func (m *redisMonitor) commandsUntilSentinel(t *testing.T, rds *testenv.Redis) []monitored {
	t.Helper()
	const sentinel = "tether-monitor-sentinel"
	if err := rds.Client().Echo(context.Background(), sentinel).Err(); err != nil {
		t.Fatal(err)
	}
	_ = m.conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	var cmds []monitored
	for {
		line, err := m.r.ReadString('\n')
		if err != nil {
			t.Fatalf("MONITOR: %v", err)
		}
		// +1700000000.123456 [0 unix:/tmp/r.sock] "evalsha" "…" …
		_, rest, ok := strings.Cut(line, " [")
		if !ok {
			continue
		}
		src, args, _ := strings.Cut(rest, "] ")
		if strings.Contains(args, sentinel) {
			return cmds
		}
		if strings.HasSuffix(src, " lua") {
			continue
		}
		name, _, _ := strings.Cut(strings.TrimPrefix(args, `"`), `"`)
		cmds = append(cmds, monitored{strings.ToLower(name), args})
	}
}
