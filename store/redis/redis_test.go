package redis

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
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
		New: func(t *testing.T) storetest.Store {
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

// sharedHarness runs every case on one server, each under its own prefix
// (the fleet-wide keys would otherwise be shared between cases).
func sharedHarness(c goredis.UniversalClient) storetest.Harness {
	var n atomic.Int64
	return storetest.Harness{
		New: func(t *testing.T) storetest.Store {
			opts := testOptions
			opts.Prefix = fmt.Sprintf("case%d:", n.Add(1))
			return newStoreT(t, c, opts)
		},
		// A real server expires keys on its own clock: let d pass on it.
		Advance: func(t *testing.T, d time.Duration) { waitServerClock(t, c, d) },
		Idle:    450 * time.Millisecond,
	}
}

func TestConformanceRedisServer(t *testing.T) {
	r := testenv.RedisServer(t)
	storetest.Run(t, sharedHarness(r.Client()))
}

// TestConformanceRedisCluster runs the suite on a real 3-master Redis
// Cluster: a script that touched keys of two slots would fail with
// CROSSSLOT, so this proves the key layout.
func TestConformanceRedisCluster(t *testing.T) {
	c := testenv.RedisCluster(t)
	storetest.Run(t, sharedHarness(c.Client()))
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
		name   string
		prefix string
		want   string // the prefix the keys get
	}{
		{"default prefix", "", "tether:"},
		{"prefix override", "blue:", "blue:"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := t.Context()
			m, c := miniClient(t)
			s := newStoreT(t, c, Options{Prefix: tt.prefix})
			lt := affinity.Lifetime{Idle: 30 * time.Minute}
			l := affinity.Lookup{Key: "k", Aliases: []string{"t"}, Candidate: affinity.Binding{Instance: "a", Version: "v1", Since: since}, Lifetime: lt}
			if _, err := s.GetOrBind(ctx, l); err != nil {
				t.Fatal(err)
			}
			l.Key, l.Aliases = "a{b}%", nil
			if _, err := s.GetOrBind(ctx, l); err != nil {
				t.Fatal(err)
			}
			r := affinity.LoadReport{Replica: "r1", InFlight: map[string]int{"a": 1}, Queue: map[string]int{"a": 2}}
			if _, err := s.SyncLoad(ctx, r, []string{"a"}, time.Minute, since); err != nil {
				t.Fatal(err)
			}
			if err := s.SetDrained(ctx, "a", true); err != nil {
				t.Fatal(err)
			}

			p := tt.want
			binding, link, index, report := p+"{k}:b", p+"{t}:a", p+"{fleet}:i:a", p+"{fleet}:r:r1"
			want := []string{binding, link, p + "{a%7Bb%7D%25}:b", index, report, p + "{fleet}:replicas", p + "{fleet}:drained"}
			slices.Sort(want)
			if diff := cmp.Diff(want, m.Keys()); diff != "" {
				t.Fatalf("keys (-want +got):\n%s", diff)
			}
			ms := strconv.FormatInt(since.UnixMilli(), 10)
			got := map[string]string{}
			for _, f := range []string{"i", "v", "s", "x", "mv", "mo"} {
				got[f] = m.HGet(binding, f)
			}
			if diff := cmp.Diff(map[string]string{"i": "a", "v": "v1", "s": ms, "x": ms, "mv": "", "mo": ""}, got); diff != "" {
				t.Errorf("binding fields (-want +got):\n%s", diff)
			}
			if ttl := m.TTL(binding); ttl != lt.Idle {
				t.Errorf("binding TTL = %v, want the idle timeout %v", ttl, lt.Idle)
			}
			if v, err := m.Get(link); err != nil || v != "k" {
				t.Errorf("link = %q, %v; want the session key", v, err)
			}
			if ttl := m.TTL(link); ttl != lt.Idle {
				t.Errorf("link TTL = %v, want the idle timeout %v", ttl, lt.Idle)
			}
			if sc, err := m.ZScore(index, "k"); err != nil || int64(sc) != since.Add(lt.Idle*5/4).UnixMilli() {
				t.Errorf("index score = %v, %v; want now + Idle*5/4", sc, err)
			}
			if m.HGet(report, "f:a") != "1" || m.HGet(report, "q:a") != "2" {
				t.Errorf("report fields f:a = %q, q:a = %q; want 1, 2", m.HGet(report, "f:a"), m.HGet(report, "q:a"))
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
	look := func(key string) affinity.Lookup { return affinity.Lookup{Key: key, Candidate: cand, Lifetime: lt} }

	// A hash without a usable "i" or "s" is replaced, not trusted or fatal.
	m.HSet("tether:{nos}:b", "i", "x")
	m.HSet("tether:{bads}:b", "i", "x", "s", "yesterday")
	m.HSet("tether:{floats}:b", "i", "x", "s", "1.75e12")
	m.HSet("tether:{noi}:b", "i", "", "s", "1000")
	for _, key := range []string{"nos", "bads", "floats", "noi"} {
		r, err := s.GetOrBind(ctx, look(key))
		if err != nil || r.Outcome != affinity.Created || r.Binding != cand {
			t.Errorf("GetOrBind over damaged %q = %+v, %v; want the candidate, created", key, r, err)
		}
	}
	// A damaged index refresh time is rewritten, not fatal.
	m.HSet("tether:{badx}:b", "i", "x", "s", "1000", "x", "later")
	if r, err := s.GetOrBind(ctx, look("badx")); err != nil || r.Outcome != affinity.Found || m.HGet("tether:{badx}:b", "x") == "later" {
		t.Errorf("GetOrBind over a damaged x = %+v, %v (x now %q); want found, x rewritten", r, err, m.HGet("tether:{badx}:b", "x"))
	}
	m.HSet("tether:{rep}:b", "i", "x")
	if b, err := s.Replace(ctx, "rep", "old", cand, lt); err != nil || b.Instance != "a" {
		t.Errorf("Replace over a damaged record = %+v, %v; want the new binding", b, err)
	}
	m.HSet("tether:{show}:b", "i", "x")
	if sess, ok, err := s.Show(ctx, "show", since); err != nil || ok {
		t.Errorf("Show of a damaged record = %+v, %v, %v; want none", sess, ok, err)
	}

	// A key of another type is an error, not a panic or an overwrite.
	if err := m.Set("tether:{str}:b", "v"); err != nil {
		t.Fatal(err)
	}
	m.HSet("tether:{hashlink}:a", "f", "v")
	for _, key := range []string{"str", "hashlink"} {
		if _, err := s.GetOrBind(ctx, look(key)); err == nil || !strings.HasPrefix(err.Error(), "redis get-or-bind: ") {
			t.Errorf("GetOrBind on a wrong-type %q: err = %v, want a wrapped WRONGTYPE error", key, err)
		}
	}
	if _, err := s.Replace(ctx, "str", "x", cand, lt); err == nil || !strings.HasPrefix(err.Error(), "redis replace: ") {
		t.Errorf("Replace on a string key: err = %v, want a wrapped WRONGTYPE error", err)
	}
	// A report with a non-numeric field is an error.
	m.HSet("tether:{fleet}:r:bad", "f:a", "many")
	if _, err := m.ZAdd("tether:{fleet}:replicas", float64(since.Add(time.Hour).UnixMilli()), "bad"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.SyncLoad(ctx, affinity.LoadReport{Replica: "r"}, []string{"a"}, time.Minute, since); err == nil || !strings.HasPrefix(err.Error(), "redis sync load: ") {
		t.Errorf("SyncLoad with a damaged report: err = %v, want a wrapped error", err)
	}
}

func TestParseReplies(t *testing.T) {
	ok := func(out int64) []any { return []any{out, "a", "1000", "v1", "", "", int64(0), ""} }
	with := func(res []any, i int, v any) []any { res = slices.Clone(res); res[i] = v; return res }
	bind := []struct {
		name    string
		res     []any
		wantErr bool
	}{
		{"found", ok(1), false},
		{"created", ok(2), false},
		{"alias", []any{int64(0), "s"}, false},
		{"alias to empty", []any{int64(0), ""}, true},
		{"alias not a string", []any{int64(0), int64(1)}, true},
		{"two elements not an alias", []any{int64(1), "s"}, true},
		{"short", ok(1)[:7], true},
		{"long", append(ok(1), "x"), true},
		{"instance not a string", with(ok(1), 1, int64(1)), true},
		{"empty instance", with(ok(1), 1, ""), true},
		{"since not a number", with(ok(1), 2, "soon"), true},
		{"since not a string", with(ok(1), 2, int64(1000)), true},
		{"outcome out of range", ok(7), true},
		{"outcome zero with eight elements", ok(0), true},
		{"outcome not a number", with(ok(1), 0, "found"), true},
		{"refresh out of range", with(ok(1), 6, int64(2)), true},
		{"prev not a string", with(ok(1), 7, nil), true},
		{"nil", nil, true},
	}
	for _, tt := range bind {
		if _, err := parseBindReply(tt.res); (err != nil) != tt.wantErr {
			t.Errorf("parseBindReply %s (%v): err = %v, want error: %v", tt.name, tt.res, err, tt.wantErr)
		}
	}
	rep := []any{int64(1), "a", "1000", "v1", int64(1), "b"}
	replace := []struct {
		name    string
		res     []any
		wantErr bool
	}{
		{"replaced", rep, false},
		{"short", rep[:5], true},
		{"flag out of range", with(rep, 0, int64(3)), true},
		{"refresh not a number", with(rep, 4, "1"), true},
		{"since not a number", with(rep, 2, "x"), true},
	}
	for _, tt := range replace {
		if _, err := parseReplaceReply(tt.res); (err != nil) != tt.wantErr {
			t.Errorf("parseReplaceReply %s (%v): err = %v, want error: %v", tt.name, tt.res, err, tt.wantErr)
		}
	}
	sess := []any{int64(1), "a", "1000", "v1", "v2", "", int64(500)}
	show := []struct {
		name    string
		res     []any
		wantErr bool
	}{
		{"session", sess, false},
		{"none", []any{int64(2)}, false},
		{"alias", []any{int64(0), "s"}, false},
		{"empty", nil, true},
		{"code not a number", []any{"2"}, true},
		{"pttl not a number", with(sess, 6, "500"), true},
		{"short", sess[:6], true},
		{"unknown code", []any{int64(9)}, true},
	}
	for _, tt := range show {
		if _, _, _, err := parseShowReply(tt.res); (err != nil) != tt.wantErr {
			t.Errorf("parseShowReply %s (%v): err = %v, want error: %v", tt.name, tt.res, err, tt.wantErr)
		}
	}
	good := []any{[]any{int64(3)}, []any{"r2", []any{"f:a", "2", "q:a", "4", "new:a", "x"}}, []any{"a"}}
	load := []struct {
		name    string
		res     []any
		wantErr bool
	}{
		{"good", good, false},
		{"short", good[:2], true},
		{"active count missing", with(good, 0, []any{}), true},
		{"active not a number", with(good, 0, []any{"3"}), true},
		{"report not a list", with(good, 1, []any{"r2", "f:a"}), true},
		{"odd report", with(good, 1, []any{"r2", []any{"f:a"}}), true},
		{"odd others", with(good, 1, []any{"r2"}), true},
		{"report value not a number", with(good, 1, []any{"r2", []any{"f:a", "x"}}), true},
		{"drained not strings", with(good, 2, []any{int64(1)}), true},
	}
	for _, tt := range load {
		st, err := parseLoadReply(tt.res, affinity.LoadReport{Replica: "r1", Queue: map[string]int{"a": 1}}, []string{"a"})
		if (err != nil) != tt.wantErr {
			t.Errorf("parseLoadReply %s (%v): err = %v, want error: %v", tt.name, tt.res, err, tt.wantErr)
		}
		if tt.name == "good" {
			want := affinity.LoadState{Active: map[string]int{"a": 3}, InFlight: map[string]int{"a": 2}, Queue: map[string]int{"a": 4}, Drained: map[string]bool{"a": true}}
			if diff := cmp.Diff(want, st); diff != "" {
				t.Errorf("parseLoadReply (-want +got):\n%s", diff)
			}
		}
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
		{"prefix with a brace", c, Options{Prefix: "t{1}:"}, "must not contain"},
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

// TestIndexErrorsDoNotFailTheDecision: a failed index write reaches
// OnIndexError and the decision stands.
func TestIndexErrorsDoNotFailTheDecision(t *testing.T) {
	ctx := t.Context()
	m, c := miniClient(t)
	var got []error
	opts := testOptions
	opts.OnIndexError = func(err error) { got = append(got, err) }
	s := newStoreT(t, c, opts)
	if err := m.Set("tether:{fleet}:i:a", "not a zset"); err != nil {
		t.Fatal(err)
	}
	cand := affinity.Binding{Instance: "a", Since: since}
	r, err := s.GetOrBind(ctx, affinity.Lookup{Key: "k", Candidate: cand, Lifetime: affinity.Lifetime{Idle: time.Minute}})
	if err != nil || r.Outcome != affinity.Created || r.Binding != cand {
		t.Fatalf("GetOrBind with a broken index = %+v, %v; want created", r, err)
	}
	if len(got) != 1 || !strings.Contains(got[0].Error(), "redis index") || !strings.Contains(got[0].Error(), "WRONGTYPE") {
		t.Errorf("OnIndexError got %v, want one WRONGTYPE index error", got)
	}
	// Without a hook the error is dropped, and the decision still stands.
	s2 := newStoreT(t, c, testOptions)
	if _, err := s2.GetOrBind(ctx, affinity.Lookup{Key: "k2", Candidate: cand, Lifetime: affinity.Lifetime{Idle: time.Minute}}); err != nil {
		t.Errorf("GetOrBind without a hook: %v", err)
	}
}

// TestMarkPrunesTheIndex: index members whose binding is gone or on another
// instance (an index write that failed) are neither marked nor counted,
// and are removed.
func TestMarkPrunesTheIndex(t *testing.T) {
	ctx := t.Context()
	m, c := miniClient(t)
	s := newStoreT(t, c, testOptions)
	lt := affinity.Lifetime{Idle: time.Minute}
	if _, err := s.GetOrBind(ctx, affinity.Lookup{Key: "k", Candidate: affinity.Binding{Instance: "a", Since: since}, Lifetime: lt}); err != nil {
		t.Fatal(err)
	}
	score := float64(since.Add(time.Hour).UnixMilli())
	for _, z := range []struct{ index, member string }{{"b", "k"}, {"a", "ghost"}} {
		if _, err := m.ZAdd("tether:{fleet}:i:"+z.index, score, z.member); err != nil {
			t.Fatal(err)
		}
	}
	for _, tt := range []struct {
		instance string
		marked   int
		members  []string
	}{{"b", 0, nil}, {"a", 1, []string{"k"}}} {
		n, left, err := s.Mark(ctx, affinity.MarkFilter{Instance: tt.instance}, affinity.Move{Off: tt.instance}, since)
		if err != nil || n != tt.marked || left != 0 {
			t.Errorf("Mark(%s) = %d, %d, %v; want %d, 0", tt.instance, n, left, err, tt.marked)
		}
		members, _ := m.ZMembers("tether:{fleet}:i:" + tt.instance)
		if diff := cmp.Diff(tt.members, members, cmpopts.EquateEmpty()); diff != "" {
			t.Errorf("index of %s after Mark (-want +got):\n%s", tt.instance, diff)
		}
	}
}

// TestMarkBatches: Mark over more sessions than one pipeline holds, with a
// limit that ends mid-batch.
func TestMarkBatches(t *testing.T) {
	ctx := t.Context()
	m, c := miniClient(t)
	s := newStoreT(t, c, testOptions)
	const n = 2*markBatch + 10
	// Seeded directly: n GetOrBind calls are slow under -race.
	ms := strconv.FormatInt(since.UnixMilli(), 10)
	for i := range n {
		key := fmt.Sprint(i)
		m.HSet(s.bindingKey(key), "i", "a", "s", ms, "x", ms)
		if _, err := m.ZAdd(s.indexKey("a"), float64(since.Add(time.Hour).UnixMilli()), key); err != nil {
			t.Fatal(err)
		}
	}
	f := affinity.MarkFilter{Instance: "a", Limit: markBatch + 7}
	total := 0
	for _, want := range []struct{ marked, left int }{{markBatch + 7, n - markBatch - 7}, {n - markBatch - 7, 0}, {0, 0}} {
		marked, left, err := s.Mark(ctx, f, affinity.Move{Off: "a"}, since)
		if err != nil || marked != want.marked || left != want.left {
			t.Errorf("Mark = %d, %d, %v; want %d, %d", marked, left, err, want.marked, want.left)
		}
		total += marked
	}
	if total != n {
		t.Errorf("marked %d in all, want %d", total, n)
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

// roundTrips counts what a client sends: single commands and pipelines
// (each pipeline is one round trip). What go-redis sends to set up a new
// connection (HELLO, CLIENT SETINFO) is not a round trip of the call.
type roundTrips struct{ commands, pipelines atomic.Int64 }

func connSetup(cmd goredis.Cmder) bool {
	switch cmd.Name() {
	case "hello", "client", "auth", "select":
		return true
	}
	return false
}

func (h *roundTrips) DialHook(next goredis.DialHook) goredis.DialHook { return next }

func (h *roundTrips) ProcessHook(next goredis.ProcessHook) goredis.ProcessHook {
	return func(ctx context.Context, cmd goredis.Cmder) error {
		if !connSetup(cmd) {
			h.commands.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (h *roundTrips) ProcessPipelineHook(next goredis.ProcessPipelineHook) goredis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []goredis.Cmder) error {
		if !slices.ContainsFunc(cmds, connSetup) {
			h.pipelines.Add(1)
		}
		return next(ctx, cmds)
	}
}

// take returns the counts since the last take.
func (h *roundTrips) take() (commands, pipelines int64) {
	return h.commands.Swap(0), h.pipelines.Swap(0)
}

// TestOneRoundTripPerCall checks the hot path on a real server: a hit whose
// index entry is fresh is one pipeline holding one EVALSHA and the alias
// SETs, and nothing else runs; binds and alias hops cost what the package
// comment says.
func TestOneRoundTripPerCall(t *testing.T) {
	r := testenv.RedisServer(t)
	ctx := t.Context()
	s, err := Open(ctx, r.URL(), DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	hook := &roundTrips{}
	s.client.AddHook(hook)
	for _, c := range []goredis.UniversalClient{s.client, r.Client()} { // dial both first
		if err := c.Ping(ctx).Err(); err != nil {
			t.Fatal(err)
		}
	}
	hook.take()
	lt := affinity.Lifetime{Idle: time.Minute, Max: time.Hour}
	look := func(key string, at time.Duration, aliases ...string) affinity.Lookup {
		return affinity.Lookup{Key: key, Aliases: aliases, Candidate: affinity.Binding{Instance: "a", Since: since.Add(at)}, Lifetime: lt}
	}
	call := func(l affinity.Lookup, want affinity.Outcome, wantPipelines int64) {
		t.Helper()
		res, err := s.GetOrBind(ctx, l)
		if err != nil || res.Outcome != want {
			t.Fatalf("GetOrBind(%q) = %+v, %v; want %v", l.Key, res, err, want)
		}
		if cmds, pipes := hook.take(); cmds != 0 || pipes != wantPipelines {
			t.Errorf("GetOrBind(%q, %v): %d commands and %d pipelines, want 0 and %d", l.Key, want, cmds, pipes, wantPipelines)
		}
	}

	// Binds: the script pipeline, then the index.
	for i := range 5 {
		call(look(strconv.Itoa(i), 0, "t"+strconv.Itoa(i), "u"+strconv.Itoa(i)), affinity.Created, 2)
	}

	before := commandCalls(t, r.Client())
	const n = 20
	for i := range n {
		// Within Idle/4 of the bind: the index entry is fresh.
		k := strconv.Itoa(i % 5)
		call(look(k, time.Duration(i)*100*time.Millisecond, "t"+k, "u"+k), affinity.Found, 1)
	}
	// Redis counts a script's own commands in commandstats: the script
	// reads the alias link (GET), the binding (HMGET) and refreshes it
	// (PEXPIRE); any other command shows as an excess.
	want := map[string]int64{"evalsha": n, "get": n, "hmget": n, "pexpire": n, "set": 2 * n}
	if diff := cmp.Diff(want, commandDiff(before, commandCalls(t, r.Client()))); diff != "" {
		t.Errorf("commands run by %d hits (-want +got):\n%s", n, diff)
	}

	// A hit whose index entry is due: one more round trip.
	call(look("0", lt.Idle/4), affinity.Found, 2)
	call(look("0", lt.Idle/4+time.Second), affinity.Found, 1)
	// An alias: one round trip finds the link, the second the session.
	call(look("t1", time.Second), affinity.Found, 2)

	// Replace: one round trip, plus the index when the session moves.
	if _, err := s.Replace(ctx, "2", "a", affinity.Binding{Instance: "b", Since: since.Add(time.Second)}, lt); err != nil {
		t.Fatal(err)
	}
	if cmds, pipes := hook.take(); cmds != 0 || pipes != 2 {
		t.Errorf("moving Replace: %d commands and %d pipelines, want 0 and 2", cmds, pipes)
	}
	if _, err := s.Replace(ctx, "2", "a", affinity.Binding{Instance: "c", Since: since.Add(2 * time.Second)}, lt); err != nil {
		t.Fatal(err)
	}
	if cmds, pipes := hook.take(); cmds != 0 || pipes != 1 {
		t.Errorf("losing Replace: %d commands and %d pipelines, want 0 and 1", cmds, pipes)
	}
}

// TestScriptCacheLoss: after SCRIPT FLUSH (or a restart) a call refused
// with NOSCRIPT falls back to EVAL, which caches the script again; the next
// hit is one EVALSHA.
func TestScriptCacheLoss(t *testing.T) {
	r := testenv.RedisServer(t)
	ctx := t.Context()
	s := newStoreT(t, r.Client(), testOptions)
	if err := r.Client().ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	l := affinity.Lookup{Key: "k", Candidate: affinity.Binding{Instance: "a", Since: since}, Lifetime: affinity.Lifetime{Idle: time.Minute}}
	before := commandCalls(t, r.Client())
	if res, err := s.GetOrBind(ctx, l); err != nil || res.Outcome != affinity.Created {
		t.Fatalf("GetOrBind after SCRIPT FLUSH = %+v, %v; want created", res, err)
	}
	if res, err := s.GetOrBind(ctx, l); err != nil || res.Outcome != affinity.Found {
		t.Fatalf("second GetOrBind = %+v, %v; want found", res, err)
	}
	// The bind: EVALSHA refused, EVAL; its index write: the same. The hit:
	// one EVALSHA that finds the cached script.
	got := commandDiff(before, commandCalls(t, r.Client()))
	if got["evalsha"] != 3 || got["eval"] != 2 {
		t.Errorf("evalsha = %d, eval = %d; want 3 and 2 (commands: %v)", got["evalsha"], got["eval"], got)
	}
}

// TestRedisDown: a dead or stalled Redis gives an error within the per-call
// timeout, and the store recovers by itself when Redis is back.
func TestRedisDown(t *testing.T) {
	l := affinity.Lookup{Key: "k", Aliases: []string{"t"}, Candidate: affinity.Binding{Instance: "a", Since: since}, Lifetime: affinity.Lifetime{Idle: time.Minute}}
	// Generous against a 50 ms timeout: the point is "not a hang".
	const prompt = time.Second

	call := func(t *testing.T, s *Store) (time.Duration, error) {
		t.Helper()
		start := time.Now()
		_, err := s.GetOrBind(t.Context(), l)
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
	l := affinity.Lookup{Key: "k", Candidate: affinity.Binding{Instance: "a", Since: since}, Lifetime: affinity.Lifetime{Idle: 50 * time.Millisecond}}
	if res, err := s.GetOrBind(ctx, l); err != nil || res.Outcome != affinity.Created {
		t.Fatalf("GetOrBind = %+v, %v; want created", res, err)
	}
	// The embedded server expires bindings on the wall clock, like Redis;
	// poll with EXISTS, which unlike GetOrBind does not refresh the TTL.
	deadline := time.Now().Add(5 * time.Second)
	for {
		n, err := s.client.Exists(ctx, s.bindingKey("k")).Result()
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
	if res, err := s.GetOrBind(ctx, l); err != nil || res.Outcome != affinity.Created {
		t.Fatalf("GetOrBind after expiry = %+v, %v; want created", res, err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := s.GetOrBind(ctx, l); err == nil {
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
