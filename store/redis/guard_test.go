package redis

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/internal/testenv"
)

// fakeClock is the guard's injected clock.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }

func (c *fakeClock) advance(d time.Duration) { c.mu.Lock(); c.t = c.t.Add(d); c.mu.Unlock() }

// changes records what OnGuard hears.
type changes struct {
	mu  sync.Mutex
	got []bool
}

func (c *changes) record(open bool) { c.mu.Lock(); c.got = append(c.got, open); c.mu.Unlock() }

func (c *changes) list() []bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]bool(nil), c.got...)
}

var errDial = &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}

// TestGuardStateMachine drives the guard with an injected clock:
// threshold, cooldown, probe, doubling, cap, recovery, and outcomes that
// arrive after the state changed.
func TestGuardStateMachine(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1_000_000, 0)}
	g := newGuard(guardConfig{now: clock.now, redact: func(s string) string { return strings.ReplaceAll(s, "hunter2", "xxxxx") }})
	var ch changes
	g.watch(ch.record)

	call := func(err error) error {
		t.Helper()
		tok, aerr := g.admit()
		if aerr != nil {
			return aerr
		}
		g.done(tok, err)
		return err
	}
	state := func(want bindings.GuardState) {
		t.Helper()
		if got := g.health().State; got != want {
			t.Fatalf("state %v, want %v (health %+v)", got, want, g.health())
		}
	}

	// Fewer failures than the threshold, then a success: still closed,
	// and the count starts again.
	for range guardThreshold - 1 {
		_ = call(errDial)
	}
	state(bindings.GuardClosed)
	if h := g.health(); h.Failures != guardThreshold-1 || !strings.Contains(h.LastError, "connection refused") {
		t.Fatalf("health after %d failures: %+v", guardThreshold-1, h)
	}
	_ = call(nil)
	if h := g.health(); h.Failures != 0 || h.State != bindings.GuardClosed {
		t.Fatalf("health after a success: %+v", h)
	}

	// A call sent while closed, whose answer comes after the guard
	// opened, must not close it.
	late, err := g.admit()
	if err != nil {
		t.Fatal(err)
	}
	for range guardThreshold {
		_ = call(fmt.Errorf("read: %w (password hunter2)", context.DeadlineExceeded))
	}
	state(bindings.GuardOpen)
	opened := clock.now()
	g.done(late, nil)
	state(bindings.GuardOpen)
	h := g.health()
	if h.Failures != guardThreshold || h.Opens != 1 || !h.Since.Equal(opened) || strings.Contains(h.LastError, "hunter2") {
		t.Fatalf("health when opened: %+v", h)
	}

	// Open: refused at once, with ErrGuardOpen, until the cooldown ends.
	probes := g.probes.Load()
	clock.advance(guardCooldown - time.Millisecond)
	err = call(nil)
	if !errors.Is(err, ErrGuardOpen) || !strings.Contains(err.Error(), "5 failed calls in a row") || strings.Contains(err.Error(), "hunter2") {
		t.Fatalf("call while open: %v", err)
	}
	if g.probes.Load() != probes {
		t.Fatal("a call was let through before the cooldown ended")
	}

	// Each failed probe doubles the cooldown, up to the cap.
	for i, cooldown := range []time.Duration{guardCooldown, 2 * guardCooldown, guardMaxCooldown, guardMaxCooldown, guardMaxCooldown} {
		if i == 0 {
			clock.advance(time.Millisecond)
		} else {
			clock.advance(cooldown - time.Millisecond)
			if err := call(nil); !errors.Is(err, ErrGuardOpen) {
				t.Fatalf("probe %d: call before the %v cooldown ended: %v", i, cooldown, err)
			}
			clock.advance(time.Millisecond)
		}
		probe, err := g.admit()
		if err != nil {
			t.Fatalf("probe %d after %v: %v", i, cooldown, err)
		}
		state(bindings.GuardHalfOpen)
		if _, err := g.admit(); !errors.Is(err, ErrGuardOpen) {
			t.Fatalf("second call while the probe is out: %v", err)
		}
		g.done(probe, io.EOF)
		state(bindings.GuardOpen)
	}
	if h := g.health(); h.Opens != 1 || !h.Since.Equal(opened) || h.Failures != guardThreshold+5 {
		t.Fatalf("reopenings changed Opens or Since, or failures miscounted: %+v", h)
	}

	// A probe the caller cancelled says nothing: the next call probes.
	clock.advance(guardMaxCooldown)
	probe, err := g.admit()
	if err != nil {
		t.Fatal(err)
	}
	g.done(probe, context.Canceled)
	state(bindings.GuardOpen)
	probe, err = g.admit()
	if err != nil {
		t.Fatalf("no probe after an inconclusive one: %v", err)
	}

	// A probe that succeeds closes the guard and resets the cooldown.
	g.done(probe, goredis.Nil)
	state(bindings.GuardClosed)
	if h := g.health(); h.Failures != 0 || !h.Since.Equal(clock.now()) || h.LastError == "" {
		t.Fatalf("health after recovery: %+v", h)
	}
	for range guardThreshold {
		_ = call(errDial)
	}
	state(bindings.GuardOpen)
	clock.advance(guardCooldown)
	if _, err := g.admit(); err != nil {
		t.Fatalf("cooldown not reset after recovery: %v", err)
	}
	if diff := cmp.Diff([]bool{false, true, false, true}, ch.list()); diff != "" {
		t.Errorf("OnGuard calls (-want +got):\n%s", diff)
	}
}

// TestGuardConcurrent: many callers failing at once open the guard
// once, and one probe among many callers closes it.
func TestGuardConcurrent(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1_000_000, 0)}
	g := newGuard(guardConfig{now: clock.now})
	var ch changes
	g.watch(ch.record)
	run := func(err error) {
		var wg sync.WaitGroup
		for range 16 {
			wg.Go(func() {
				for range 200 {
					if tok, aerr := g.admit(); aerr == nil {
						g.done(tok, err)
					}
					_ = g.health()
				}
			})
		}
		wg.Wait()
	}
	run(errDial)
	if h := g.health(); h.State != bindings.GuardOpen || h.Opens != 1 {
		t.Fatalf("after concurrent failures: %+v", h)
	}
	clock.advance(guardCooldown)
	run(nil)
	if h := g.health(); h.State != bindings.GuardClosed || h.Opens != 1 {
		t.Fatalf("after concurrent successes: %+v", h)
	}
	if n := g.probes.Load(); n != 1 {
		t.Fatalf("%d probes, want 1: the first closed the guard", n)
	}
	if diff := cmp.Diff([]bool{false, true, false}, ch.list()); diff != "" {
		t.Errorf("OnGuard calls (-want +got):\n%s", diff)
	}
}

// TestGuardClassifiesReplies sends real replies through the hook (a
// miniredis): script errors and NOSCRIPT are answers, LOADING and
// CLUSTERDOWN say Redis cannot serve.
func TestGuardClassifiesReplies(t *testing.T) {
	ctx := t.Context()
	_, c := miniClient(t)
	s := newStoreT(t, c, testOptions)
	reply := func(msg string) error {
		return s.client.Eval(ctx, "return redis.error_reply(ARGV[1])", nil, msg).Err()
	}
	for range 3 * guardThreshold {
		for _, msg := range []string{"ERR boom", "WRONGTYPE no", "NOSCRIPT No matching script"} {
			if err := reply(msg); err == nil {
				t.Fatalf("%s: no error", msg)
			}
		}
		if err := s.client.Get(ctx, "missing").Err(); !errors.Is(err, goredis.Nil) {
			t.Fatalf("GET missing: %v", err)
		}
	}
	if h := s.Health(); h.State != bindings.GuardClosed || h.Failures != 0 {
		t.Fatalf("answers opened the guard: %+v", h)
	}
	for i, msg := range []string{"LOADING Redis is loading", "CLUSTERDOWN The cluster is down", "TRYAGAIN Multiple keys request during rehashing of slot", "BUSY Redis is busy", "MASTERDOWN Link down"} {
		err := reply(msg)
		if h := s.Health(); h.Failures != i+1 {
			t.Fatalf("%s (%v): failures %d, want %d", msg, err, h.Failures, i+1)
		}
	}
	if h := s.Health(); h.State != bindings.GuardOpen || !strings.Contains(h.LastError, "MASTERDOWN") {
		t.Fatalf("after %d unavailable replies: %+v", guardThreshold, h)
	}
}

// callResult is one timed store call.
type callResult struct {
	took time.Duration
	err  error
}

// getOrBind binds session "k" to instance, or finds it.
func getOrBind(t *testing.T, s *Store, instance string) (bindings.Result, callResult) {
	t.Helper()
	l := bindings.Lookup{Key: "k", Candidate: bindings.Binding{Instance: instance, Since: time.Now()}, Lifetime: bindings.Lifetime{Idle: time.Minute}}
	start := time.Now()
	r, err := s.GetOrBind(t.Context(), l)
	return r, callResult{took: time.Since(start), err: err}
}

// eventually calls GetOrBind of session "k" until it succeeds (a 10 ms timeout can miss
// on a loaded machine) and returns the result and how long it took.
func eventually(t *testing.T, s *Store, instance string, within time.Duration) (bindings.Result, time.Duration) {
	t.Helper()
	start := time.Now()
	for {
		r, c := getOrBind(t, s, instance)
		if c.err == nil {
			return r, time.Since(start)
		}
		if time.Since(start) > within {
			t.Fatalf("GetOrBind did not succeed within %v: %v (health %+v)", within, c.err, s.Health())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// failUntilOpen calls GetOrBind until the guard opens and returns the
// calls it took: guardThreshold at most, fewer when another call (an
// index write that missed its timeout on a loaded machine) failed just
// before.
func failUntilOpen(t *testing.T, s *Store) []callResult {
	t.Helper()
	var calls []callResult
	defer func() {
		if h := s.Health(); len(calls) > guardThreshold || h.Failures != guardThreshold {
			t.Errorf("guard opened after %d failed GetOrBinds, health %+v; want it open after %d failures", len(calls), h, guardThreshold)
		}
	}()
	for s.Health().State == bindings.GuardClosed {
		if len(calls) == 100 {
			t.Fatalf("guard still closed after %d calls: %+v", len(calls), s.Health())
		}
		_, c := getOrBind(t, s, "b")
		if c.err == nil {
			t.Fatalf("GetOrBind succeeded with Redis down (call %d)", len(calls)+1)
		}
		calls = append(calls, c)
	}
	return calls
}

// TestGuardRedisKilled: with redis-server stopped, the guard opens
// after guardThreshold failed calls; the calls after it fail at once
// without dialling or sending anything; a restarted server is used again
// without help.
func TestGuardRedisKilled(t *testing.T) {
	r := testenv.RedisServer(t)
	var ch changes
	opts := defaultOptions()
	opts.OnGuard = ch.record
	s, err := Open(t.Context(), r.URL(), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	eventually(t, s, "a", 5*time.Second)

	r.Stop()
	failing := failUntilOpen(t, s)
	var spent time.Duration
	for _, c := range failing {
		spent += c.took
	}
	t.Logf("guard open after %d calls, %v in all; health %+v", len(failing), spent, s.Health())

	const n = 1000
	probes0, dials0 := s.guard.probes.Load(), s.guard.dials.Load()
	start := time.Now()
	refused := 0
	for i := range n {
		_, c := getOrBind(t, s, "b")
		switch {
		case errors.Is(c.err, ErrGuardOpen):
			refused++
		case errors.Is(c.err, context.DeadlineExceeded):
			// A probe, or a starved goroutine whose 10 ms passed before
			// the store sent anything (the probes count below tells).
		default:
			t.Fatalf("call %d with the guard open: %v, want ErrGuardOpen", i, c.err)
		}
	}
	took := time.Since(start)
	probes := uint64(took/guardCooldown) + 1
	gotProbes, gotDials := s.guard.probes.Load()-probes0, s.guard.dials.Load()-dials0
	t.Logf("%d calls with the guard open: %v (%v a call; %d refused, %d probes, %d dials); with the guard closed they took %v a call",
		n, took, took/n, refused, gotProbes, gotDials, spent/time.Duration(len(failing)))
	// go-redis dials in the background, on behalf of a call, and retries a
	// failed dial up to 5 times 100 ms apart after the call gave up: the
	// last calls before the guard opened may still be dialling.
	const dialAttempts = 5
	if gotProbes > probes || gotDials > dialAttempts*(probes+1) {
		t.Errorf("%d probes and %d dials with the guard open, want at most %d probes and their dials", gotProbes, gotDials, probes)
	}
	if budget := n * DefaultTimeout / 10; took > budget {
		t.Errorf("%d calls with the guard open took %v, want under %v", n, took, budget)
	}
	if err := s.Ping(t.Context()); err == nil || (time.Since(start) < guardCooldown && !errors.Is(err, ErrGuardOpen)) {
		t.Errorf("Ping with the guard open: %v, want ErrGuardOpen", err)
	}

	r.Start() // empty, and without our scripts
	res, after := eventually(t, s, "b", 20*time.Second)
	t.Logf("recovered %v after the restart", after)
	if res.Origin != bindings.Created {
		t.Errorf("first call after the restart: %+v, want created (the restarted server is empty)", res)
	}
	// Not Failures: the bind's index write, a call of its own, can miss
	// the 10 ms on a loaded machine just after the restart.
	if h := s.Health(); h.State != bindings.GuardClosed || h.Opens != 1 {
		t.Errorf("health after recovery: %+v", h)
	}
	if diff := cmp.Diff([]bool{false, true, false}, ch.list()); diff != "" {
		t.Errorf("OnGuard calls (-want +got):\n%s", diff)
	}
}

// redisPid is the process id of the server c talks to.
func redisPid(t *testing.T, c goredis.UniversalClient) int {
	t.Helper()
	info, err := c.Info(t.Context(), "server").Result()
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "process_id:"); ok {
			pid, err := strconv.Atoi(v)
			if err != nil {
				t.Fatal(err)
			}
			return pid
		}
	}
	t.Fatalf("no process_id in INFO server:\n%s", info)
	return 0
}

// TestGuardRedisStalled: a redis-server that stops answering (SIGSTOP)
// holds each call for the per-call timeout only, opens the guard, and
// when it answers again (SIGCONT) the store uses it again without help and
// finds the bindings it held.
func TestGuardRedisStalled(t *testing.T) {
	r := testenv.RedisServer(t)
	pid := redisPid(t, r.Client())
	s, err := Open(t.Context(), r.URL(), defaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	eventually(t, s, "a", 5*time.Second)

	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	// Registered after testenv's cleanup, so it runs before it stops the
	// server.
	cont := func() {
		if err := syscall.Kill(pid, syscall.SIGCONT); err != nil {
			t.Error(err)
		}
	}
	var once sync.Once
	t.Cleanup(func() { once.Do(cont) })
	// The subscription survives a stalled server for a ping interval. When
	// it was ready before the bind above, the cache holds the session, and
	// a hit on it would never reach the server.
	s.cache.dropAll()

	// A loaded two-core machine fires timers late: slack, not a hang.
	const slack = 250 * time.Millisecond
	failing := failUntilOpen(t, s)
	for i, c := range failing {
		t.Logf("call %d: %v: %v", i+1, c.took, c.err)
		if !errors.Is(c.err, context.DeadlineExceeded) {
			t.Errorf("call %d to a stalled server: %v, want a deadline error", i+1, c.err)
		}
		if c.took > DefaultTimeout+slack {
			t.Errorf("call %d to a stalled server took %v, want about %v", i+1, c.took, DefaultTimeout)
		}
	}
	probes0 := s.guard.probes.Load()
	start := time.Now()
	for range 100 {
		if _, c := getOrBind(t, s, "b"); c.err == nil {
			t.Fatal("GetOrBind succeeded against a stalled server")
		}
	}
	took := time.Since(start)
	t.Logf("100 calls with the guard open: %v, %d probes", took, s.guard.probes.Load()-probes0)
	if n := s.guard.probes.Load() - probes0; n > uint64(took/guardCooldown)+1 {
		t.Errorf("%d probes in %v with the guard open", n, took)
	}

	once.Do(cont)
	res, after := eventually(t, s, "b", 20*time.Second)
	t.Logf("recovered %v after SIGCONT", after)
	if res.Origin != bindings.Found || res.Binding.Instance != "a" {
		t.Errorf("after the stall: %+v, want the binding to a made before it", res)
	}
	if h := s.Health(); h.State != bindings.GuardClosed || h.Opens != 1 {
		t.Errorf("health after recovery: %+v", h)
	}
}

// TestOpenWithoutRedis: Open against a socket nobody listens on succeeds
// at once with the guard open, and the store works once a server starts
// there.
func TestOpenWithoutRedis(t *testing.T) {
	r := testenv.RedisServer(t)
	r.Stop()
	var ch changes
	opts := defaultOptions()
	opts.OnGuard = ch.record
	start := time.Now()
	s, err := Open(t.Context(), r.URL(), opts)
	took := time.Since(start)
	if err != nil {
		t.Fatalf("Open without Redis: %v", err)
	}
	t.Cleanup(func() { _ = s.Close() })
	h := s.Health()
	t.Logf("Open took %v; health %+v", took, h)
	if took > startTimeout+time.Second {
		t.Errorf("Open took %v, want at most about %v", took, startTimeout)
	}
	if h.State != bindings.GuardOpen || h.Opens != 1 || h.LastError == "" {
		t.Errorf("health after Open without Redis: %+v", h)
	}
	if _, c := getOrBind(t, s, "a"); !errors.Is(c.err, ErrGuardOpen) {
		t.Errorf("GetOrBind right after a degraded Open: %v, want ErrGuardOpen", c.err)
	}

	r.Start()
	res, after := eventually(t, s, "a", 20*time.Second)
	t.Logf("store usable %v after the server started", after)
	if res.Origin != bindings.Created {
		t.Errorf("first GetOrBind: %+v, want created", res)
	}
	if res, c := getOrBind(t, s, "b"); c.err != nil || res.Origin != bindings.Found || res.Binding.Instance != "a" {
		t.Errorf("second GetOrBind: %+v, %v; want found on a", res, c.err)
	}
	if diff := cmp.Diff([]bool{true, false}, ch.list()); diff != "" {
		t.Errorf("OnGuard calls (-want +got):\n%s", diff)
	}
}

// TestOpenUnreachable: every kind of URL opens in bounded time against
// addresses nobody listens on, with the guard open and no password in
// what Health reports; a malformed URL still fails.
func TestOpenUnreachable(t *testing.T) {
	t.Parallel()
	tests := []struct{ name, url string }{
		{"standalone", "redis://:" + secret + "@127.0.0.1:1/0"},
		{"cluster", "redis+cluster://:" + secret + "@127.0.0.1:1?addr=127.0.0.1:2"},
		{"sentinel", "redis+sentinel://:" + secret + "@127.0.0.1:1?master_name=m&addr=127.0.0.1:2&password=" + secret},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			start := time.Now()
			s, err := Open(t.Context(), tt.url, defaultOptions())
			took := time.Since(start)
			if err != nil {
				t.Fatalf("Open(%q): %v", tt.url, err)
			}
			defer s.Close()
			h := s.Health()
			t.Logf("Open took %v; health %+v", took, h)
			if took > startTimeout+2*time.Second {
				t.Errorf("Open took %v, want about %v at most", took, startTimeout)
			}
			if h.State != bindings.GuardOpen || h.LastError == "" || strings.Contains(h.LastError, secret) {
				t.Errorf("health %+v: want open, with an error that does not show the password", h)
			}
			if err := s.Ping(t.Context()); !errors.Is(err, ErrGuardOpen) || strings.Contains(err.Error(), secret) {
				t.Errorf("Ping: %v, want ErrGuardOpen without the password", err)
			}
		})
	}
	t.Run("malformed", func(t *testing.T) {
		t.Parallel()
		_, err := Open(t.Context(), "redis://:"+secret+"@127.0.0.1:port/0", defaultOptions())
		var uerr *URLError
		if !errors.As(err, &uerr) || strings.Contains(err.Error(), secret) {
			t.Fatalf("Open with a malformed URL: %v, want a *URLError without the password", err)
		}
	})
}

// TestCloseLeavesTheCallersClientUnguarded: go-redis cannot remove a hook,
// so after Close a store built with New on the caller's client must stop
// refusing that client's calls.
func TestCloseLeavesTheCallersClientUnguarded(t *testing.T) {
	_, c := miniClient(t)
	s := newStoreT(t, c, testOptions)
	s.guard.mu.Lock()
	s.guard.open(time.Hour) // as after an outage
	s.guard.mu.Unlock()
	if err := c.Ping(context.Background()).Err(); !errors.Is(err, ErrGuardOpen) {
		t.Fatalf("before Close the client's own call is guarded too: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Ping(context.Background()).Err(); err != nil {
		t.Errorf("after Close the caller's client is still refused by the store's guard: %v", err)
	}
}
