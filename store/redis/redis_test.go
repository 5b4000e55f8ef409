package redis

import (
	"context"
	"errors"
	"maps"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/google/go-cmp/cmp"
	goredis "github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/internal/testenv"
	"github.com/tetherproxy/tether/store/storetest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// testOptions has a generous timeout: the conformance cases run 32 racing
// goroutines under -race, and the per-call timeout is not what they test.
var testOptions = Options{Timeout: 5 * time.Second}

// miniClient starts a miniredis and a client for it, both closed with t.
func miniClient(t testing.TB) (*miniredis.Miniredis, goredis.UniversalClient) {
	t.Helper()
	m := miniredis.RunT(t)
	c := goredis.NewClient(&goredis.Options{Addr: m.Addr(), ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = c.Close() })
	return m, c
}

func newStoreT(t testing.TB, c goredis.UniversalClient, opts Options) *Store {
	t.Helper()
	s, err := New(c, opts)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return s
}

func TestConformanceMiniredis(t *testing.T) {
	// Each case gets its own miniredis, so one case's FastForward cannot
	// expire another's keys.
	var servers sync.Map // *testing.T → *miniredis.Miniredis
	storetest.Run(t, storetest.Harness{
		New: func(t *testing.T) affinity.Store {
			m, c := miniClient(t)
			servers.Store(t, m)
			return newStoreT(t, c, testOptions)
		},
		Advance: func(t *testing.T, d time.Duration) {
			m, _ := servers.Load(t)
			m.(*miniredis.Miniredis).FastForward(d)
		},
	})
}

func TestConformanceRedisServer(t *testing.T) {
	r := testenv.RedisServer(t)
	storetest.Run(t, storetest.Harness{
		New: func(t *testing.T) affinity.Store { return newStoreT(t, r.Client(), testOptions) },
		// A real server expires keys on its own clock: let d pass on it.
		Advance: func(t *testing.T, d time.Duration) { waitServerClock(t, r.Client(), d) },
		Idle:    450 * time.Millisecond,
	})
}

// waitServerClock returns once the server's clock (which decides expiry) has
// moved d from when it was called.
func waitServerClock(t *testing.T, c goredis.UniversalClient, d time.Duration) {
	t.Helper()
	start := serverTime(t, c)
	deadline := time.Now().Add(d + 10*time.Second)
	for {
		left := d - serverTime(t, c).Sub(start)
		if left <= 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("server clock did not advance %v", d)
		}
		time.Sleep(left)
	}
}

func serverTime(t *testing.T, c goredis.UniversalClient) time.Time {
	t.Helper()
	now, err := c.Time(t.Context()).Result()
	if err != nil {
		t.Fatalf("TIME: %v", err)
	}
	return now
}

var since = time.UnixMilli(1_750_000_000_000)

func TestKeyLayout(t *testing.T) {
	tests := []struct {
		name    string
		prefix  string
		wantKey string
	}{
		{"default prefix", "", "tether:b:k"},
		{"prefix override", "blue:", "blue:k"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, c := miniClient(t)
			s := newStoreT(t, c, Options{Prefix: tt.prefix})
			lt := affinity.Lifetime{Idle: 30 * time.Minute}
			if _, _, err := s.GetOrBind(t.Context(), "k", affinity.Binding{Instance: "a", Since: since}, lt); err != nil {
				t.Fatal(err)
			}
			if keys := m.Keys(); !cmp.Equal(keys, []string{tt.wantKey}) {
				t.Fatalf("keys = %q, want [%q]", keys, tt.wantKey)
			}
			got := map[string]string{"i": m.HGet(tt.wantKey, "i"), "s": m.HGet(tt.wantKey, "s")}
			want := map[string]string{"i": "a", "s": strconv.FormatInt(since.UnixMilli(), 10)}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("hash fields (-want +got):\n%s", diff)
			}
			if ttl := m.TTL(tt.wantKey); ttl != lt.Idle {
				t.Errorf("TTL = %v, want the idle timeout %v", ttl, lt.Idle)
			}
		})
	}
}

func TestDamagedRecords(t *testing.T) {
	ctx := t.Context()
	lt := affinity.Lifetime{Idle: time.Minute}
	cand := affinity.Binding{Instance: "a", Since: since}
	m, c := miniClient(t)
	s := newStoreT(t, c, testOptions)

	// A hash without a usable "s" is replaced, not trusted or fatal.
	m.HSet("tether:b:nos", "i", "x")
	m.HSet("tether:b:bads", "i", "x", "s", "yesterday")
	for _, key := range []string{"nos", "bads"} {
		b, out, err := s.GetOrBind(ctx, key, cand, lt)
		if err != nil || out != affinity.Created || !b.Since.Equal(since) || b.Instance != "a" {
			t.Errorf("GetOrBind over damaged %q = %+v, %v, %v; want the candidate, created", key, b, out, err)
		}
	}
	m.HSet("tether:b:rep", "i", "x")
	if b, err := s.Replace(ctx, "rep", "old", cand, lt); err != nil || b.Instance != "a" {
		t.Errorf("Replace over a damaged record = %+v, %v; want the new binding", b, err)
	}

	// A key of another type is an error, not a panic or an overwrite.
	if err := m.Set("tether:b:str", "v"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.GetOrBind(ctx, "str", cand, lt); err == nil || !strings.HasPrefix(err.Error(), "redis get-or-bind: ") {
		t.Errorf("GetOrBind on a string key: err = %v, want a wrapped WRONGTYPE error", err)
	}
	if _, err := s.Replace(ctx, "str", "x", cand, lt); err == nil || !strings.HasPrefix(err.Error(), "redis replace: ") {
		t.Errorf("Replace on a string key: err = %v, want a wrapped WRONGTYPE error", err)
	}
}

func TestParseReply(t *testing.T) {
	tests := []struct {
		name        string
		res         []any
		withOutcome bool
		wantErr     bool
	}{
		{"found", []any{"a", "1000", int64(1)}, true, false},
		{"replace", []any{"a", "1000"}, false, false},
		{"short", []any{"a"}, true, true},
		{"long", []any{"a", "1", int64(1), "x"}, true, true},
		{"instance not a string", []any{int64(1), "1000", int64(1)}, true, true},
		{"since not a number", []any{"a", "soon", int64(1)}, true, true},
		{"since not a string", []any{"a", int64(1000), int64(1)}, true, true},
		{"outcome out of range", []any{"a", "1000", int64(7)}, true, true},
		{"outcome not a number", []any{"a", "1000", "found"}, true, true},
		{"nil", nil, false, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, _, err := parseReply(tt.res, tt.withOutcome)
			if (err != nil) != tt.wantErr {
				t.Errorf("parseReply(%v) err = %v, want error: %v", tt.res, err, tt.wantErr)
			}
		})
	}
}

func TestNewRejectsBadSetups(t *testing.T) {
	_, c := miniClient(t)
	m := miniredis.RunT(t)
	noCtx := goredis.NewClient(&goredis.Options{Addr: m.Addr()})
	t.Cleanup(func() { _ = noCtx.Close() })
	tests := []struct {
		name    string
		client  goredis.UniversalClient
		opts    Options
		wantErr string
	}{
		{"nil client", nil, DefaultOptions(), "nil client"},
		{"negative timeout", c, Options{Timeout: -time.Second}, "timeout must not be negative"},
		{"timeout without ContextTimeoutEnabled", noCtx, DefaultOptions(), "ContextTimeoutEnabled"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := New(tt.client, tt.opts); err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("New: err = %v, want one containing %q", err, tt.wantErr)
			}
		})
	}
	// Without a per-call timeout such a client is acceptable.
	if _, err := New(noCtx, Options{}); err != nil {
		t.Errorf("New without a timeout: %v", err)
	}
}

// commandCalls returns INFO commandstats as command → calls.
func commandCalls(t *testing.T, c goredis.UniversalClient) map[string]int64 {
	t.Helper()
	info, err := c.Info(t.Context(), "commandstats").Result()
	if err != nil {
		t.Fatalf("INFO commandstats: %v", err)
	}
	calls := map[string]int64{}
	for line := range strings.Lines(info) {
		name, rest, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok || !strings.HasPrefix(name, "cmdstat_") {
			continue
		}
		for field := range strings.SplitSeq(rest, ",") {
			if v, ok := strings.CutPrefix(field, "calls="); ok {
				n, err := strconv.ParseInt(v, 10, 64)
				if err != nil {
					t.Fatalf("INFO commandstats line %q: %v", line, err)
				}
				calls[strings.TrimPrefix(name, "cmdstat_")] = n
			}
		}
	}
	return calls
}

// commandDiff is what ran between two commandCalls snapshots, without the
// INFO that took the first snapshot.
func commandDiff(before, after map[string]int64) map[string]int64 {
	d := map[string]int64{}
	for k, v := range after {
		if n := v - before[k]; n != 0 && k != "info" {
			d[k] = n
		}
	}
	return d
}

// checkScriptCalls checks that diff holds exactly evalsha EVALSHA and eval
// EVAL calls and what runs inside them. Redis counts a script's own commands
// in commandstats; each of ours runs one HMGET, one PEXPIRE and at most one
// HSET, so a command a client sent besides the scripts shows as an excess.
// Every EVAL follows an EVALSHA refused with NOSCRIPT, so evalsha scripts ran.
func checkScriptCalls(t *testing.T, diff map[string]int64, evalsha, eval int64) {
	t.Helper()
	ran := evalsha
	got := maps.Clone(diff)
	if got["hset"] <= ran {
		delete(got, "hset")
	}
	want := map[string]int64{"evalsha": evalsha, "hmget": ran, "pexpire": ran}
	if eval > 0 {
		want["eval"] = eval
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("commands run (-want +got; up to %d hset allowed):\n%s", ran, d)
	}
}

// TestOneRoundTripPerCall checks the hot path on a real server: after the
// constructor, each GetOrBind or Replace is exactly one EVALSHA.
func TestOneRoundTripPerCall(t *testing.T) {
	r := testenv.RedisServer(t)
	ctx := t.Context()
	s, err := Open(ctx, r.URL(), DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	if err := r.Client().Ping(ctx).Err(); err != nil { // dial the probe client first
		t.Fatal(err)
	}
	before := commandCalls(t, r.Client())

	lt := affinity.Lifetime{Idle: time.Minute, Max: time.Hour}
	const n = 20
	for i := range n {
		cand := affinity.Binding{Instance: "a", Since: since.Add(time.Duration(i) * time.Second)}
		if _, _, err := s.GetOrBind(ctx, strconv.Itoa(i%5), cand, lt); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Replace(ctx, strconv.Itoa(i%7), "a", cand, lt); err != nil {
			t.Fatal(err)
		}
	}

	checkScriptCalls(t, commandDiff(before, commandCalls(t, r.Client())), 2*n, 0)
}

// TestScriptCacheLoss: after SCRIPT FLUSH (or a restart) the first call
// falls back to EVAL, which caches the script again; the next is one EVALSHA.
func TestScriptCacheLoss(t *testing.T) {
	r := testenv.RedisServer(t)
	ctx := t.Context()
	s := newStoreT(t, r.Client(), testOptions)
	if err := r.Client().ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	lt := affinity.Lifetime{Idle: time.Minute}
	cand := affinity.Binding{Instance: "a", Since: since}
	before := commandCalls(t, r.Client())
	if _, out, err := s.GetOrBind(ctx, "k", cand, lt); err != nil || out != affinity.Created {
		t.Fatalf("GetOrBind after SCRIPT FLUSH = %v, %v; want created", out, err)
	}
	if _, out, err := s.GetOrBind(ctx, "k", cand, lt); err != nil || out != affinity.Found {
		t.Fatalf("second GetOrBind = %v, %v; want found", out, err)
	}
	// EVALSHA refused, EVAL, then one EVALSHA that finds the cached script.
	checkScriptCalls(t, commandDiff(before, commandCalls(t, r.Client())), 2, 1)
}

// TestRedisDown: a dead or stalled Redis gives an error within the per-call
// timeout, and the store recovers by itself when Redis is back.
func TestRedisDown(t *testing.T) {
	lt := affinity.Lifetime{Idle: time.Minute}
	cand := affinity.Binding{Instance: "a", Since: since}
	// Generous against a 50 ms timeout: the point is "not a hang".
	const prompt = time.Second

	call := func(t *testing.T, s *Store) (time.Duration, error) {
		t.Helper()
		start := time.Now()
		_, _, err := s.GetOrBind(t.Context(), "k", cand, lt)
		took := time.Since(start)
		t.Logf("GetOrBind took %v: err %v", took, err)
		return took, err
	}

	t.Run("server stopped then restarted", func(t *testing.T) {
		r := testenv.RedisServer(t)
		s, err := Open(t.Context(), r.URL(), DefaultOptions())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Close() })
		r.Stop()
		if took, err := call(t, s); err == nil || took > prompt {
			t.Fatalf("GetOrBind with Redis stopped: took %v, err %v; want an error within %v", took, err, prompt)
		}
		if err := s.Ping(t.Context()); err == nil {
			t.Error("Ping with Redis stopped succeeded")
		}
		r.Start() // empty, and without our scripts
		deadline := time.Now().Add(10 * time.Second)
		for {
			_, err := call(t, s)
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("store did not recover after Redis restarted: %v", err)
			}
			time.Sleep(20 * time.Millisecond)
		}
		if err := s.Ping(t.Context()); err != nil {
			t.Errorf("Ping after restart: %v", err)
		}
	})

	t.Run("server stalled", func(t *testing.T) {
		r := testenv.RedisServer(t)
		s, err := Open(t.Context(), r.URL(), DefaultOptions())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Close() })
		if err := r.Client().Do(t.Context(), "CLIENT", "PAUSE", "2000", "ALL").Err(); err != nil {
			t.Fatal(err)
		}
		took, err := call(t, s)
		if !errors.Is(err, context.DeadlineExceeded) || took > prompt {
			t.Fatalf("GetOrBind with Redis paused: took %v, err %v; want a deadline error within %v", took, err, prompt)
		}
		if !strings.HasPrefix(err.Error(), "redis get-or-bind: ") {
			t.Errorf("error %q is not wrapped with the operation", err)
		}
	})

	t.Run("timeout 0 waits for a slow server", func(t *testing.T) {
		r := testenv.RedisServer(t)
		s, err := Open(t.Context(), r.URL(), Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Close() })
		if err := r.Client().Do(t.Context(), "CLIENT", "PAUSE", "300", "ALL").Err(); err != nil {
			t.Fatal(err)
		}
		if _, err := call(t, s); err != nil {
			t.Fatalf("GetOrBind without a timeout through a 300 ms pause: %v", err)
		}
	})

	t.Run("miniredis closed", func(t *testing.T) {
		m, c := miniClient(t)
		s := newStoreT(t, c, DefaultOptions())
		m.Close()
		if took, err := call(t, s); err == nil || took > prompt {
			t.Fatalf("GetOrBind with miniredis closed: took %v, err %v; want an error within %v", took, err, prompt)
		}
	})
}

func TestOpenEmbedded(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	ctx := t.Context()
	s, err := Open(ctx, Embedded, DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Ping(ctx); err != nil {
		t.Fatalf("Ping: %v", err)
	}
	lt := affinity.Lifetime{Idle: 50 * time.Millisecond}
	cand := affinity.Binding{Instance: "a", Since: since}
	if _, out, err := s.GetOrBind(ctx, "k", cand, lt); err != nil || out != affinity.Created {
		t.Fatalf("GetOrBind = %v, %v; want created", out, err)
	}
	// The embedded server expires bindings on the wall clock, like Redis;
	// poll with EXISTS, which unlike GetOrBind does not refresh the TTL.
	deadline := time.Now().Add(5 * time.Second)
	for {
		n, err := s.client.Exists(ctx, DefaultPrefix+"k").Result()
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("embedded binding did not expire after its idle timeout")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, out, err := s.GetOrBind(ctx, "k", cand, lt); err != nil || out != affinity.Created {
		t.Fatalf("GetOrBind after expiry = %v, %v; want created", out, err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, _, err := s.GetOrBind(ctx, "k", cand, lt); err == nil {
		t.Error("GetOrBind after Close succeeded")
	}
}

func TestNewLeavesCallerClientOpen(t *testing.T) {
	_, c := miniClient(t)
	s := newStoreT(t, c, DefaultOptions())
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Ping(t.Context()).Err(); err != nil {
		t.Errorf("caller's client closed by Store.Close: %v", err)
	}
}

func TestMillis(t *testing.T) {
	tests := []struct {
		d    time.Duration
		want int64
	}{
		{0, 0},
		{time.Nanosecond, 1},
		{time.Millisecond, 1},
		{1500 * time.Microsecond, 2},
		{30 * time.Minute, 1_800_000},
	}
	for _, tt := range tests {
		if got := millis(tt.d); got != tt.want {
			t.Errorf("millis(%v) = %d, want %d", tt.d, got, tt.want)
		}
	}
}
