package redis

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"runtime"
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

	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/internal/testenv"
	"github.com/tetherproxy/tether/store/storetest"
)

func TestMain(m *testing.M) {
	flag.Parse()
	// The conformance cases on real servers spend their time waiting for
	// the server's clock to pass an idle timeout, not on a CPU; the default
	// -test.parallel (GOMAXPROCS) would run them two at a time on a
	// two-core machine and multiply the suite's time. An explicit
	// -test.parallel is kept, and so is the default when fuzzing, where it
	// is the number of fuzz workers: 16 of them on two cores starve at the
	// -fuzztime deadline (see scripts/fuzz.sh).
	explicit := false
	flag.Visit(func(f *flag.Flag) { explicit = explicit || f.Name == "test.parallel" || f.Name == "test.fuzz" })
	if !explicit {
		if err := flag.Set("test.parallel", strconv.Itoa(max(runtime.GOMAXPROCS(0), minParallel))); err != nil {
			panic(err)
		}
	}
	goleak.VerifyTestMain(m)
}

// minParallel is the least -test.parallel the package runs with.
const minParallel = 16

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
	t.Cleanup(func() { _ = s.Close() }) // its cache's goroutines; the client is the test's
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
		// The cases' margins are Idle/4 or more of real time, which must
		// hold under -race on a busy machine (realIdle says how much).
		Idle: realIdle,
	}
}

// realIdle is the idle timeout of the conformance runs on real servers.
// A case's store calls between a key's write and a check that the key is
// still alive add their latency to the key's real age, and under -race,
// beside another package's servers on two cores, a call can take 200 ms:
// the margins (Idle/4 and more) must hold several of them.
const realIdle = 3 * time.Second

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
			lt := bindings.Lifetime{Idle: 30 * time.Minute}
			l := bindings.Lookup{Key: "k", Aliases: []string{"t"}, Candidate: bindings.Binding{Instance: "a", Version: "v1", Since: since}, Lifetime: lt}
			if _, err := s.GetOrBind(ctx, l); err != nil {
				t.Fatal(err)
			}
			l.Key, l.Aliases = "a{b}%", nil
			if _, err := s.GetOrBind(ctx, l); err != nil {
				t.Fatal(err)
			}
			r := fleet.LoadReport{Replica: "r1", InFlight: map[string]int{"a": 1}, Queue: map[string]int{"a": 2}}
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
			until := strconv.FormatInt(since.Add(lt.Idle*5/4).UnixMilli(), 10)
			got := map[string]string{}
			for _, f := range []string{"i", "v", "s", "x", "e", "l", "mv", "mo"} {
				got[f] = m.HGet(binding, f)
			}
			fields := map[string]string{"i": "a", "v": "v1", "s": ms, "x": ms, "e": until, "l": until, "mv": "", "mo": ""}
			if diff := cmp.Diff(fields, got); diff != "" {
				t.Errorf("binding fields (-want +got):\n%s", diff)
			}
			if ttl := m.TTL(binding); ttl != lt.Idle {
				t.Errorf("binding TTL = %v, want the idle timeout %v", ttl, lt.Idle)
			}
			if v, err := m.Get(link); err != nil || v != "k" {
				t.Errorf("link = %q, %v; want the session key", v, err)
			}
			if ttl := m.TTL(link); ttl != lt.Idle*5/4 {
				t.Errorf("link TTL = %v, want Idle*5/4 = %v", ttl, lt.Idle*5/4)
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
	lt := bindings.Lifetime{Idle: time.Minute}
	cand := bindings.Binding{Instance: "a", Since: since}
	m, c := miniClient(t)
	s := newStoreT(t, c, testOptions)
	look := func(key string) bindings.Lookup { return bindings.Lookup{Key: key, Candidate: cand, Lifetime: lt} }

	// A hash without a usable "i" or "s" is replaced, not trusted or fatal.
	m.HSet("tether:{nos}:b", "i", "x")
	m.HSet("tether:{bads}:b", "i", "x", "s", "yesterday")
	m.HSet("tether:{floats}:b", "i", "x", "s", "1.75e12")
	m.HSet("tether:{noi}:b", "i", "", "s", "1000")
	for _, key := range []string{"nos", "bads", "floats", "noi"} {
		r, err := s.GetOrBind(ctx, look(key))
		if err != nil || r.Origin != bindings.Created || r.Binding != cand {
			t.Errorf("GetOrBind over damaged %q = %+v, %v; want the candidate, created", key, r, err)
		}
	}
	// Damaged refresh fields are rewritten, not fatal.
	for _, f := range []string{"x", "e", "l"} {
		key := "bad" + f
		m.HSet("tether:{"+key+"}:b", "i", "x", "s", "1000", "x", "1000", "e", "9000000000000", "l", "9000000000000")
		m.HSet("tether:{"+key+"}:b", f, "later")
		l := look(key)
		l.Aliases = []string{"alias-" + key}
		if r, err := s.GetOrBind(ctx, l); err != nil || r.Origin != bindings.Found || m.HGet("tether:{"+key+"}:b", f) == "later" {
			t.Errorf("GetOrBind over a damaged %s = %+v, %v (%s now %q); want found, %s rewritten", f, r, err, f, m.HGet("tether:{"+key+"}:b", f), f)
		}
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
}

// TestSyncLoadSkipsBadValues: a report value that is not an integer (a
// damaged key, another replica's bug) is skipped and reported; the rest of
// the load, the drained set included, still reaches every replica.
func TestSyncLoadSkipsBadValues(t *testing.T) {
	ctx := t.Context()
	m, c := miniClient(t)
	var got []error
	opts := testOptions
	opts.OnIndexError = func(err error) { got = append(got, err) }
	s := newStoreT(t, c, opts)
	if err := s.SetDrained(ctx, "b", true); err != nil {
		t.Fatal(err)
	}
	m.HSet("tether:{fleet}:r:bad", "f:a", "many", "f:b", "2", "q:a", "1.5", "q:b", "3")
	if _, err := m.ZAdd("tether:{fleet}:replicas", float64(since.Add(time.Hour).UnixMilli()), "bad"); err != nil {
		t.Fatal(err)
	}
	st, err := s.SyncLoad(ctx, fleet.LoadReport{Replica: "r", InFlight: map[string]int{"a": 1}}, []string{"a", "b"}, time.Minute, since)
	if err != nil {
		t.Fatalf("SyncLoad with a damaged report: %v", err)
	}
	want := fleet.LoadState{
		Active:   map[string]int{"a": 0, "b": 0},
		InFlight: map[string]int{"b": 2},
		Queue:    map[string]int{"b": 3},
		Drained:  map[string]bool{"b": true},
		Engine:   map[string]fleet.EngineReading{},
		Replicas: 1,
	}
	if diff := cmp.Diff(want, st); diff != "" {
		t.Errorf("SyncLoad (-want +got):\n%s", diff)
	}
	if len(got) != 1 || !strings.Contains(got[0].Error(), "skipped 2 report value") || !strings.Contains(got[0].Error(), `"many"`) {
		t.Errorf("OnIndexError got %v, want one error counting the 2 bad values", got)
	}
}

func TestParseReplies(t *testing.T) {
	ok := func(out int64) []any {
		return []any{out, "a", "1000", "v1", "", "", "", "", "", "", "", "", "", int64(2), "900", "2000", "", int64(40)}
	}
	bound := func(out int64) []any {
		return []any{out, "a", "1000", "v1", "", "", "b", "900", "v0", "2000", "2000", "", "1", int64(1), "1000", "2000", "2000", int64(-1)}
	}
	with := func(res []any, i int, v any) []any { res = slices.Clone(res); res[i] = v; return res }
	bind := []struct {
		name    string
		res     []any
		wantErr bool
	}{
		{"found", ok(1), false},
		{"found due", bound(1), false},
		{"created", bound(2), false},
		{"renewed", bound(3), false},
		{"created without an index write", ok(2), true},
		{"renewed without a previous binding", with(bound(3), 6, ""), true},
		{"previous since not a number", with(bound(3), 7, "x"), true},
		{"index expiry not a number", with(bound(1), 9, "soon"), true},
		{"link expiry zero", with(bound(1), 10, "0"), true},
		{"link expiry not a string", with(bound(1), 10, int64(2000)), true},
		{"alias", []any{int64(0), "s"}, false},
		{"alias to empty", []any{int64(0), ""}, true},
		{"alias not a string", []any{int64(0), int64(1)}, true},
		{"two elements not an alias", []any{int64(1), "s"}, true},
		{"short", ok(1)[:12], true},
		{"failovers not a string", with(ok(1), 11, int64(1)), true},
		{"damaged failovers count as 0", with(ok(1), 11, "lots"), false},
		{"requests zero", with(ok(1), 13, int64(0)), true},
		{"requests not an integer", with(ok(1), 13, "2"), true},
		{"long", append(ok(1), "x"), true},
		{"damaged refresh fields count as due", with(ok(1), 14, "soon"), false},
		{"refresh field not a string", with(ok(1), 15, int64(1)), true},
		{"idle not an integer", with(ok(1), 17, "40"), true},
		{"instance not a string", with(ok(1), 1, int64(1)), true},
		{"empty instance", with(ok(1), 1, ""), true},
		{"since not a number", with(ok(1), 2, "soon"), true},
		{"since not a string", with(ok(1), 2, int64(1000)), true},
		{"outcome out of range", ok(7), true},
		{"outcome zero with eight elements", ok(0), true},
		{"outcome not a number", with(ok(1), 0, "found"), true},
		{"prev not a string", with(ok(1), 6, nil), true},
		{"nil", nil, true},
	}
	for _, tt := range bind {
		if _, err := parseBindReply(tt.res); (err != nil) != tt.wantErr {
			t.Errorf("parseBindReply %s (%v): err = %v, want error: %v", tt.name, tt.res, err, tt.wantErr)
		}
	}
	touched := []any{int64(1), "", "", int64(7), int64(900), int64(0), "", "", int64(0), int64(-1), int64(2), "2000", "2100", int64(3), int64(-1)}
	touch := []struct {
		name string
		res  []any
		n    int
		want []touchReply // nil: an error
	}{
		{"three sessions", touched, 3, []touchReply{
			{same: true, requests: 7, lastUse: 900}, {}, {same: true, moving: true, index: 2000, links: 2100, requests: 3, lastUse: -1}}},
		{"fewer than said", touched, 4, nil},
		{"short", touched[:14], 3, nil},
		{"status out of range", with(touched, 0, int64(3)), 3, nil},
		{"status not an integer", with(touched, 0, "1"), 3, nil},
		{"index expiry not a number", with(touched, 11, "soon"), 3, nil},
		{"link expiry zero", with(touched, 12, "0"), 3, nil},
		{"count not an integer", with(touched, 3, "7"), 3, nil},
		{"last use not an integer", with(touched, 4, nil), 3, nil},
		{"nil", nil, 1, nil},
	}
	for _, tt := range touch {
		got, err := parseTouchReply(tt.res, tt.n)
		if (err != nil) != (tt.want == nil) || !slices.Equal(got, tt.want) {
			t.Errorf("parseTouchReply %s (%v): %+v, %v; want %+v", tt.name, tt.res, got, err, tt.want)
		}
	}
	rep := []any{int64(1), "a", "1000", "v1", "2000", "b", "2"}
	replace := []struct {
		name    string
		res     []any
		wantErr bool
	}{
		{"replaced", rep, false},
		{"short", rep[:6], true},
		{"failovers not a string", with(rep, 6, int64(2)), true},
		{"flag out of range", with(rep, 0, int64(3)), true},
		{"index expiry not a string", with(rep, 4, int64(1)), true},
		{"index expiry not a number", with(rep, 4, "x"), true},
		{"replaced without an index write", with(rep, 4, ""), true},
		{"kept, index not due", with(with(rep, 0, int64(0)), 4, ""), false},
		{"since not a number", with(rep, 2, "x"), true},
	}
	for _, tt := range replace {
		if _, err := parseReplaceReply(tt.res); (err != nil) != tt.wantErr {
			t.Errorf("parseReplaceReply %s (%v): err = %v, want error: %v", tt.name, tt.res, err, tt.wantErr)
		}
	}
	sess := []any{int64(1), "a", "1000", "v1", "v2", "", int64(500), "1"}
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
		{"short", sess[:7], true},
		{"failovers not a string", with(sess, 7, nil), true},
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
		skipped int
	}{
		{"good", good, false, 0},
		{"short", good[:2], true, 0},
		{"active count missing", with(good, 0, []any{}), true, 0},
		{"active not a number", with(good, 0, []any{"3"}), true, 0},
		{"report not a list", with(good, 1, []any{"r2", "f:a"}), true, 0},
		{"odd report", with(good, 1, []any{"r2", []any{"f:a"}}), true, 0},
		{"odd others", with(good, 1, []any{"r2"}), true, 0},
		{"report value not a string", with(good, 1, []any{"r2", []any{"f:a", int64(1)}}), true, 0},
		{"report values not numbers", with(good, 1, []any{"r2", []any{"f:a", "x", "q:a", "", "f:b", "1"}}), false, 2},
		{"drained not strings", with(good, 2, []any{int64(1)}), true, 0},
		{"engine readings damaged", with(good, 1, []any{"r2", []any{"e:a", "{", "e:b", `{"W":-1,"At":5}`, "e:a", `{"W":1,"KV":1.5,"At":5}`, "e:a", `{"W":1,"At":0}`}}), false, 4},
	}
	for _, tt := range load {
		st, skipped, err := parseLoadReply(tt.res, fleet.LoadReport{Replica: "r1", Queue: map[string]int{"a": 1}}, []string{"a"})
		if (err != nil) != tt.wantErr || len(skipped) != tt.skipped {
			t.Errorf("parseLoadReply %s (%v): err = %v, skipped %q; want error: %v, %d skipped", tt.name, tt.res, err, skipped, tt.wantErr, tt.skipped)
		}
		if tt.name == "good" {
			want := fleet.LoadState{Active: map[string]int{"a": 3}, InFlight: map[string]int{"a": 2}, Queue: map[string]int{"a": 4}, Drained: map[string]bool{"a": true}, Engine: map[string]fleet.EngineReading{}, Replicas: 1}
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
		{"nil client", nil, defaultOptions(), "nil client"},
		{"negative timeout", c, Options{Timeout: -time.Second}, "timeout must not be negative"},
		{"timeout without ContextTimeoutEnabled", noCtx, defaultOptions(), "ContextTimeoutEnabled"},
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
	cand := bindings.Binding{Instance: "a", Since: since}
	r, err := s.GetOrBind(ctx, bindings.Lookup{Key: "k", Candidate: cand, Lifetime: bindings.Lifetime{Idle: time.Minute}})
	if err != nil || r.Origin != bindings.Created || r.Binding != cand {
		t.Fatalf("GetOrBind with a broken index = %+v, %v; want created", r, err)
	}
	if len(got) != 1 || !strings.Contains(got[0].Error(), "redis index") || !strings.Contains(got[0].Error(), "WRONGTYPE") {
		t.Errorf("OnIndexError got %v, want one WRONGTYPE index error", got)
	}
	// Without a hook the error is dropped, and the decision still stands.
	s2 := newStoreT(t, c, testOptions)
	if _, err := s2.GetOrBind(ctx, bindings.Lookup{Key: "k2", Candidate: cand, Lifetime: bindings.Lifetime{Idle: time.Minute}}); err != nil {
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
	lt := bindings.Lifetime{Idle: time.Minute}
	if _, err := s.GetOrBind(ctx, bindings.Lookup{Key: "k", Candidate: bindings.Binding{Instance: "a", Since: since}, Lifetime: lt}); err != nil {
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
		n, left, err := s.Mark(ctx, bindings.MarkFilter{Instance: tt.instance}, bindings.Move{Off: tt.instance}, since)
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
	f := bindings.MarkFilter{Instance: "a", Limit: markBatch + 7}
	total := 0
	for _, want := range []struct{ marked, left int }{{markBatch + 7, n - markBatch - 7}, {n - markBatch - 7, 0}, {0, 0}} {
		marked, left, err := s.Mark(ctx, f, bindings.Move{Off: "a"}, since)
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

// TestOneRoundTripPerCall checks the hot path on a real server: a hit
// whose refresh is not due is one EVALSHA and nothing else runs, neither
// in that round trip nor after it; binds, due refreshes and alias hops
// cost what the package comment says.
func TestOneRoundTripPerCall(t *testing.T) {
	r := testenv.RedisServer(t)
	ctx := t.Context()
	opts := testOptions
	var indexErrs atomic.Int64
	opts.OnIndexError = func(error) { indexErrs.Add(1) }
	s, err := Open(ctx, r.URL(), opts)
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
	lt := bindings.Lifetime{Idle: time.Minute, Max: time.Hour}
	look := func(key string, at time.Duration, aliases ...string) bindings.Lookup {
		return bindings.Lookup{Key: key, Aliases: aliases, Candidate: bindings.Binding{Instance: "a", Since: since.Add(at)}, Lifetime: lt}
	}
	call := func(l bindings.Lookup, want bindings.Origin, wantPipelines int64) {
		t.Helper()
		res, err := s.GetOrBind(ctx, l)
		if err != nil || res.Origin != want {
			t.Fatalf("GetOrBind(%q) = %+v, %v; want %v", l.Key, res, err, want)
		}
		if cmds, pipes := hook.take(); cmds+pipes != wantPipelines {
			t.Errorf("GetOrBind(%q, %v): %d commands and %d pipelines, want %d round trips", l.Key, want, cmds, pipes, wantPipelines)
		}
	}
	// commands checks what the server ran for f (scripts' own commands
	// included: Redis counts them in commandstats).
	commands := func(what string, want map[string]int64, f func()) {
		t.Helper()
		before := commandCalls(t, r.Client())
		f()
		if diff := cmp.Diff(want, commandDiff(before, commandCalls(t, r.Client()))); diff != "" {
			t.Errorf("commands run by %s (-want +got):\n%s", what, diff)
		}
	}

	// Binds: the script, then one pipeline with the index entry and the
	// alias links.
	for i := range 5 {
		call(look(strconv.Itoa(i), 0, "t"+strconv.Itoa(i), "u"+strconv.Itoa(i)), bindings.Created, 2)
	}

	// Hits within Idle/4 of the bind: index entry and links are fresh. The
	// script reads the alias link (GET) and the binding (HMGET),
	// refreshes the binding's TTL (PEXPIRE), counts the request
	// (HINCRBY) and notes its use (HSET u, for how long a session idled);
	// nothing is written to the aliases' keys, however many requests carry
	// them.
	const n = 20
	commands(fmt.Sprint(n, " hits"), map[string]int64{"evalsha": n, "get": n, "hmget": n, "pexpire": n, "hincrby": n, "hset": n}, func() {
		for i := range n {
			k := strconv.Itoa(i % 5)
			call(look(k, time.Duration(i)*100*time.Millisecond, "t"+k, "u"+k), bindings.Found, 1)
		}
	})
	// An alias that first appears mid-session waits for the next due
	// refresh: the hit is still one round trip.
	call(look("0", 2*time.Second, "t0", "u0", "new0"), bindings.Found, 1)

	// A hit whose refresh is due: the script, then the index entry and the
	// links, new ones included, in one pipeline. The index key's TTL is
	// shortened first, so its extension does not hang on how many
	// milliseconds the hits above took.
	if err := r.Client().PExpire(ctx, s.indexKey("a"), time.Second).Err(); err != nil {
		t.Fatal(err)
	}
	commands("a due hit", map[string]int64{
		"evalsha": 2, "get": 1, "hmget": 1, "hset": 3, "pexpire": 2, "hincrby": 1, // get-or-bind
		"zscore": 1, "zadd": 1, "pttl": 1, // index; the key's TTL is extended
		"set": 3, // links
		// Each link written is published on the invalidation channel: a
		// replica that cached the alias's own binding must ask again.
		"publish": 3,
	}, func() {
		call(look("0", lt.Idle/4, "t0", "u0", "new0"), bindings.Found, 2)
	})
	call(look("0", lt.Idle/4+time.Second, "t0", "u0", "new0"), bindings.Found, 1)
	call(look("new0", lt.Idle/4+time.Second), bindings.Found, 2)

	// A key that is an alias: one round trip finds the link (GET), the
	// second the session; nothing but the count and the use is written
	// while the session's refresh is not due.
	commands("an alias hit", map[string]int64{"evalsha": 2, "get": 1, "hmget": 1, "pexpire": 1, "hincrby": 1, "hset": 1}, func() {
		call(look("t1", time.Second, "u1"), bindings.Found, 2)
	})

	// Replace: one round trip, plus the index when the session moves.
	if _, err := s.Replace(ctx, "2", "a", bindings.Binding{Instance: "b", Since: since.Add(time.Second)}, lt); err != nil {
		t.Fatal(err)
	}
	if cmds, pipes := hook.take(); cmds+pipes != 2 {
		t.Errorf("moving Replace: %d commands and %d pipelines, want 2 round trips", cmds, pipes)
	}
	if _, err := s.Replace(ctx, "2", "a", bindings.Binding{Instance: "c", Since: since.Add(2 * time.Second)}, lt); err != nil {
		t.Fatal(err)
	}
	if cmds, pipes := hook.take(); cmds+pipes != 1 {
		t.Errorf("losing Replace: %d commands and %d pipelines, want 1 round trip", cmds, pipes)
	}
	// The moved session keeps its links: no extra round trip for them.
	call(look("2", 3*time.Second, "t2", "u2"), bindings.Found, 1)
	if n := indexErrs.Load(); n != 0 {
		t.Errorf("%d index or link writes failed", n)
	}
}

// failPipelines fails the round trips (single commands and pipelines)
// whose numbers (from 1) are in fail.
type failPipelines struct {
	n    atomic.Int64
	fail []int64
}

func (h *failPipelines) DialHook(next goredis.DialHook) goredis.DialHook { return next }

func (h *failPipelines) ProcessHook(next goredis.ProcessHook) goredis.ProcessHook {
	return func(ctx context.Context, cmd goredis.Cmder) error {
		if connSetup(cmd) || !slices.Contains(h.fail, h.n.Add(1)) {
			return next(ctx, cmd)
		}
		err := errors.New("injected failure")
		cmd.SetErr(err)
		return err
	}
}

func (h *failPipelines) ProcessPipelineHook(next goredis.ProcessPipelineHook) goredis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []goredis.Cmder) error {
		if slices.ContainsFunc(cmds, connSetup) || !slices.Contains(h.fail, h.n.Add(1)) {
			return next(ctx, cmds)
		}
		err := errors.New("injected failure")
		for _, c := range cmds {
			c.SetErr(err)
		}
		return err
	}
}

// TestNoLinkBeforeResolved: aliases are linked only to the key a request
// resolved, so a call that fails between its round trips leaves no link
// to an alias key (a chain D → T → S).
func TestNoLinkBeforeResolved(t *testing.T) {
	ctx := t.Context()
	m, c := miniClient(t)
	s := newStoreT(t, c, testOptions)
	lt := bindings.Lifetime{Idle: time.Minute}
	look := func(key string, at time.Duration, aliases ...string) bindings.Lookup {
		return bindings.Lookup{Key: key, Aliases: aliases, Candidate: bindings.Binding{Instance: "a", Since: since.Add(at)}, Lifetime: lt}
	}
	if _, err := s.GetOrBind(ctx, look("S", 0, "T")); err != nil {
		t.Fatal(err)
	}
	// T is an alias of S: the first round trip finds the link, the second
	// (failed here) would get the session.
	c.AddHook(&failPipelines{fail: []int64{2}})
	if r, err := s.GetOrBind(ctx, look("T", lt.Idle/2, "D")); err == nil {
		t.Fatalf("GetOrBind with its second round trip failing = %+v, want an error", r)
	}
	if m.Exists(s.linkKey("D")) {
		to, _ := m.Get(s.linkKey("D"))
		t.Errorf("a failed call linked D to %q", to)
	}
	// The next call, due for a refresh, links D (and T again) to S.
	r, err := s.GetOrBind(ctx, look("T", lt.Idle/2, "D"))
	if err != nil || r.Key != "S" || r.Origin != bindings.Found {
		t.Fatalf("GetOrBind(T) = %+v, %v; want S found", r, err)
	}
	for _, a := range []string{"D", "T"} {
		if to, err := m.Get(s.linkKey(a)); err != nil || to != "S" {
			t.Errorf("link of %s = %q, %v; want S", a, to, err)
		}
		if ttl := m.TTL(s.linkKey(a)); ttl != lt.Idle*5/4 {
			t.Errorf("link TTL of %s = %v, want Idle*5/4 = %v", a, ttl, lt.Idle*5/4)
		}
	}
}

// TestIndexEntryNeverShortened: index writes of one session may arrive out
// of order; a late one with an earlier expiry leaves the later one.
func TestIndexEntryNeverShortened(t *testing.T) {
	ctx := t.Context()
	m, c := miniClient(t)
	s := newStoreT(t, c, testOptions)
	now := since.UnixMilli()
	for _, score := range []int64{now + 3000, now + 1000, now + 2000} {
		s.refresh(ctx, "k", "a", "", now, score, nil, 0)
	}
	if sc, err := m.ZScore(s.indexKey("a"), "k"); err != nil || int64(sc) != now+3000 {
		t.Errorf("index score = %v, %v; want the latest expiry written, %d", sc, err, now+3000)
	}
	// Moving to another instance takes the entry out of the old index.
	s.refresh(ctx, "k", "b", "a", now, now+1000, nil, 0)
	if members, _ := m.ZMembers(s.indexKey("a")); len(members) != 0 {
		t.Errorf("index of a = %v after the move, want empty", members)
	}
	if sc, err := m.ZScore(s.indexKey("b"), "k"); err != nil || int64(sc) != now+1000 {
		t.Errorf("index score on b = %v, %v; want %d", sc, err, now+1000)
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
	l := bindings.Lookup{Key: "k", Candidate: bindings.Binding{Instance: "a", Since: since}, Lifetime: bindings.Lifetime{Idle: time.Minute}}
	before := commandCalls(t, r.Client())
	if res, err := s.GetOrBind(ctx, l); err != nil || res.Origin != bindings.Created {
		t.Fatalf("GetOrBind after SCRIPT FLUSH = %+v, %v; want created", res, err)
	}
	if res, err := s.GetOrBind(ctx, l); err != nil || res.Origin != bindings.Found {
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
	l := bindings.Lookup{Key: "k", Aliases: []string{"t"}, Candidate: bindings.Binding{Instance: "a", Since: since}, Lifetime: bindings.Lifetime{Idle: time.Minute}}
	// Generous against the 10 ms default timeout: the point is "not a hang".
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
		s, err := Open(t.Context(), r.URL(), defaultOptions())
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
		s, err := Open(t.Context(), r.URL(), defaultOptions())
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
		s := newStoreT(t, c, defaultOptions())
		m.Close()
		if took, err := call(t, s); err == nil || took > prompt {
			t.Fatalf("GetOrBind with miniredis closed: took %v, err %v; want an error within %v", took, err, prompt)
		}
	})
}

func TestNewLeavesCallerClientOpen(t *testing.T) {
	_, c := miniClient(t)
	s := newStoreT(t, c, defaultOptions())
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

// defaultOptions are the options tests start from: tether's timeout,
// prefix and hit cache.
func defaultOptions() Options {
	return Options{Timeout: DefaultTimeout, Prefix: DefaultPrefix, Cache: CacheOptions{Enabled: true}}
}
