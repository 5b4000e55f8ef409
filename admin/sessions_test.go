package admin

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	goredis "github.com/redis/go-redis/v9"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/replicas"
	redisstore "github.com/tetherproxy/tether/store/redis"
)

// sessionsEnv is the session API over the real Redis store (on miniredis),
// a real decider and load view, and a fleet of two model versions.
type sessionsEnv struct {
	mini     *miniredis.Miniredis
	mux      *http.ServeMux
	decider  *affinity.Decider
	load     *affinity.Load
	fleet    *fleet.Fleet
	ids      *identity.Extractor
	headers  identity.Config
	loadSync *replicas.LoadSync
}

var sessionsFleet = []fleet.Instance{
	{Name: "a", Zone: "z1", Version: "v1", Weight: 1},
	{Name: "b", Zone: "z2", Version: "v1", Weight: 1},
	{Name: "c", Zone: "z1", Version: "v2", Weight: 1},
	{Name: "d", Zone: "z2", Version: "v2", Weight: 1, Capacity: fleet.Spot},
}

func newSessionsEnv(t *testing.T) *sessionsEnv {
	t.Helper()
	m := miniredis.RunT(t)
	c := goredis.NewClient(&goredis.Options{Addr: m.Addr(), ContextTimeoutEnabled: true, MaxRetries: -1, DialerRetries: 1})
	t.Cleanup(func() { _ = c.Close() })
	store, err := redisstore.New(c, redisstore.Options{Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	// Header names as an operator may write them: the API must hash with
	// the same ones as the request path.
	headers := identity.Config{SessionHeader: "X-Conversation-Id", AuthHeader: config.DefaultAuthHeader,
		DeviceHeader: config.DefaultDeviceHeader, UserHeader: config.DefaultUserHeader}
	keyed := headers
	keyed.Secret = []byte("a-test-secret-of-32-bytes-long!!")
	ids, err := identity.New(keyed)
	if err != nil {
		t.Fatal(err)
	}
	fl := fleet.New(sessionsFleet)
	load := affinity.NewLoad()
	pol := affinity.Policy{
		Mode: affinity.Sticky, Lifetime: bindings.Lifetime{Idle: 30 * time.Minute},
		VersionAffinity: affinity.Strict,
		Versions:        []affinity.VersionWeight{{Name: "v1", Weight: 1}}, // new sessions start on v1
	}
	e := &sessionsEnv{
		mini: m, mux: http.NewServeMux(), load: load, fleet: fl, ids: ids, headers: headers,
		decider:  affinity.New(store, fl, pol, affinity.WithLoad(load)),
		loadSync: &replicas.LoadSync{Replica: "replica-1", View: load, Store: store, Instances: fl.All},
	}
	NewSessionOps(SessionOpsConfig{
		Index: store, Drains: store, Load: load, Fleet: fl, Identity: ids, Headers: headers, Logger: zerolog.Nop(),
	}).Routes(e.mux)
	return e
}

// turn sends one request of the session h identifies through the decider.
func (e *sessionsEnv) turn(t *testing.T, h identity.Map) affinity.Decision {
	t.Helper()
	d, err := e.decider.Decide(t.Context(), affinity.Request{ID: e.ids.Extract(h)})
	if err != nil {
		t.Fatalf("Decide: %v", err)
	}
	e.decider.Finish(d, fleet.Outcome{Answered: true})
	return d
}

func (e *sessionsEnv) conversation(i int) identity.Map {
	return identity.Map{"x-conversation-id": fmt.Sprintf("conv-%d", i)}
}

func (e *sessionsEnv) key(h identity.Map) string { return e.ids.Extract(h).Key }

// sync is the server's once-a-second load sync.
func (e *sessionsEnv) sync(t *testing.T) {
	t.Helper()
	if err := e.loadSync.Sync(t.Context(), time.Now()); err != nil {
		t.Fatalf("Sync: %v", err)
	}
}

// call serves one request and returns its status and body.
func (e *sessionsEnv) call(t *testing.T, method, path, body string) (int, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	e.mux.ServeHTTP(rec, httptest.NewRequest(method, path, strings.NewReader(body)))
	if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
		t.Errorf("%s %s: Content-Type %q", method, path, ct)
	}
	return rec.Code, rec.Body.String()
}

// callJSON serves one request, wants code, and decodes the body into out.
func (e *sessionsEnv) callJSON(t *testing.T, method, path, body string, code int, out any) {
	t.Helper()
	got, resp := e.call(t, method, path, body)
	if got != code {
		t.Fatalf("%s %s %s: %d %s, want %d", method, path, body, got, resp, code)
	}
	if err := json.Unmarshal([]byte(resp), out); err != nil {
		t.Fatalf("%s %s: decode %q: %v", method, path, resp, err)
	}
}

// wantError checks a refusal: its code, and an {"error": …} body.
func (e *sessionsEnv) wantError(t *testing.T, method, path, body string, code int, contains string) {
	t.Helper()
	var res apiError
	e.callJSON(t, method, path, body, code, &res)
	if !strings.Contains(res.Error, contains) {
		t.Errorf("%s %s %s: error %q, want it to contain %q", method, path, body, res.Error, contains)
	}
}

func TestSessionStats(t *testing.T) {
	e := newSessionsEnv(t)
	placed := map[string]int{}
	const n = 12
	for i := range n {
		placed[e.turn(t, e.conversation(i)).Instance.Name]++
	}
	e.load.Begin("a", time.Now())        // a request in flight
	e.load.End("b", time.Now(), 7, true) // b's last queue depth
	e.sync(t)

	var st SessionStats
	e.callJSON(t, "GET", "/v1/sessions/stats", "", http.StatusOK, &st)
	seven := 7
	want := SessionStats{
		Instances: []InstanceStats{
			{Name: "a", Zone: "z1", Version: "v1", Active: placed["a"], InFlight: 1},
			{Name: "b", Zone: "z2", Version: "v1", Active: placed["b"], Queue: &seven},
			{Name: "c", Zone: "z1", Version: "v2"},
			{Name: "d", Zone: "z2", Version: "v2", Capacity: "spot"},
		},
		Zones: []GroupStats{
			{"z1", GroupTotals{Instances: 2, Active: placed["a"], InFlight: 1}},
			{"z2", GroupTotals{Instances: 2, Active: placed["b"], Queue: 7}},
		},
		Versions: []GroupStats{
			{"v1", GroupTotals{Instances: 2, Active: n, InFlight: 1, Queue: 7}},
			{"v2", GroupTotals{Instances: 2}},
		},
		Total: GroupTotals{Instances: 4, Active: n, InFlight: 1, Queue: 7},
	}
	if diff := cmp.Diff(want, st, cmpopts.IgnoreFields(SessionStats{}, "Time")); diff != "" {
		t.Errorf("stats (-want +got):\n%s", diff)
	}
	if placed["a"] == 0 || placed["b"] == 0 {
		t.Errorf("sessions placed %v: want both v1 instances used", placed)
	}
	if st.Time.IsZero() {
		t.Error("stats without a time")
	}
}

func TestSessionShow(t *testing.T) {
	e := newSessionsEnv(t)
	h := e.conversation(1)
	dec := e.turn(t, h)
	// A session that also carried a bearer token: the token's key is an
	// alias of the session's.
	withToken := identity.Map{"x-conversation-id": "conv-2", "authorization": "Bearer tok-2"}
	e.turn(t, withToken)
	tokenKey := e.key(identity.Map{"authorization": "Bearer tok-2"})

	var got SessionInfo
	e.callJSON(t, "GET", "/v1/sessions/"+e.key(h), "", http.StatusOK, &got)
	if got.Key != e.key(h) || got.Alias != "" || got.Instance != dec.Instance.Name || got.Version != "v1" ||
		got.Move != nil || got.TTLMs <= 0 || got.TTLMs > (30*time.Minute).Milliseconds() || time.Since(got.Since) > time.Minute {
		t.Errorf("show = %+v; want %s on %s, v1, no move, a TTL up to 30m", got, e.key(h), dec.Instance.Name)
	}

	got = SessionInfo{}
	e.callJSON(t, "GET", "/v1/sessions/"+tokenKey, "", http.StatusOK, &got)
	if got.Key != e.key(withToken) || got.Alias != tokenKey {
		t.Errorf("show alias = key %q alias %q; want %q through %q", got.Key, got.Alias, e.key(withToken), tokenKey)
	}

	for _, tt := range []struct {
		name, key string
		code      int
		contains  string
	}{
		{"unknown", "s:nobodyHasThisKey", http.StatusNotFound, "no session s:nobodyHasThisKey"},
		{"too long", "s:" + strings.Repeat("x", 63), http.StatusBadRequest, "1 to 64 bytes"},
		{"dot", "s:a.b", http.StatusBadRequest, "letters, digits"},
		{"space", "s:a%20b", http.StatusBadRequest, "letters, digits"},
		{"brace", "s:%7Bfleet%7D", http.StatusBadRequest, "letters, digits"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e.wantError(t, "GET", "/v1/sessions/"+tt.key, "", tt.code, tt.contains)
		})
	}
	// 64 bytes is allowed (and absent).
	e.wantError(t, "GET", "/v1/sessions/s:"+strings.Repeat("x", 62), "", http.StatusNotFound, "no session")
}

func TestSessionLookup(t *testing.T) {
	e := newSessionsEnv(t)
	conv := identity.Map{"x-conversation-id": "conv-secret-7", "authorization": "Bearer tok-secret-7"}
	dec := e.turn(t, conv)
	device := identity.Map{"x-device-id": "dev-secret-1", "x-user-id": "user-secret-1"}
	devDec := e.turn(t, device)

	for _, tt := range []struct {
		name, body string
		key, alias string
		source     identity.Source
		instance   string
	}{
		{"session id", `{"session_id": "conv-secret-7"}`, e.key(conv), "", identity.SourceSession, dec.Instance.Name},
		{"token", `{"token": "tok-secret-7"}`, e.key(conv), e.key(identity.Map{"authorization": "Bearer tok-secret-7"}), identity.SourceToken, dec.Instance.Name},
		{"bearer token", `{"token": "bearer tok-secret-7"}`, e.key(conv), e.key(identity.Map{"authorization": "Bearer tok-secret-7"}), identity.SourceToken, dec.Instance.Name},
		{"device and user", `{"device_id": "dev-secret-1", "user_id": "user-secret-1"}`, e.key(device), "", identity.SourceDevice, devDec.Instance.Name},
	} {
		t.Run(tt.name, func(t *testing.T) {
			code, body := e.call(t, "POST", "/v1/sessions/lookup", tt.body)
			var got SessionInfo
			if err := json.Unmarshal([]byte(body), &got); code != http.StatusOK || err != nil {
				t.Fatalf("lookup: %d %s (%v)", code, body, err)
			}
			want := SessionInfo{Key: tt.key, Alias: tt.alias, Source: string(tt.source), Instance: tt.instance, Version: "v1"}
			if diff := cmp.Diff(want, got, cmpopts.IgnoreFields(SessionInfo{}, "Since", "TTLMs")); diff != "" {
				t.Errorf("lookup (-want +got):\n%s", diff)
			}
			if strings.Contains(body, "secret") {
				t.Errorf("lookup echoes the raw identifier: %s", body)
			}
		})
	}

	for _, tt := range []struct {
		name, body string
		code       int
		contains   string
	}{
		{"bad json", `{"session_id": `, http.StatusBadRequest, "lookup:"},
		{"empty body", ``, http.StatusBadRequest, "empty body"},
		{"unknown field", `{"sessionid": "x"}`, http.StatusBadRequest, `unknown field "sessionid"`},
		{"trailing data", `{"session_id": "x"} {}`, http.StatusBadRequest, "after the JSON object"},
		{"wrong type", `{"session_id": 7}`, http.StatusBadRequest, "cannot unmarshal"},
		{"nothing", `{}`, http.StatusBadRequest, "exactly one"},
		{"two identifiers", `{"session_id": "conv-secret-7", "token": "tok-secret-7"}`, http.StatusBadRequest, "exactly one"},
		{"user alone", `{"user_id": "user-secret-1"}`, http.StatusBadRequest, "needs device_id"},
		{"user with session", `{"session_id": "conv-secret-7", "user_id": "user-secret-1"}`, http.StatusBadRequest, "device_id only"},
		{"control char", `{"session_id": "secret\u0001"}`, http.StatusBadRequest, "control_chars"},
		{"too long", `{"session_id": "secret` + strings.Repeat("x", 5000) + `"}`, http.StatusBadRequest, "too_long"},
		{"malformed token", `{"token": "not a secret token"}`, http.StatusBadRequest, "malformed_auth"},
		{"no session", `{"session_id": "never-seen-secret"}`, http.StatusNotFound, "no session s:"},
		{"device without its user", `{"device_id": "dev-secret-1"}`, http.StatusNotFound, "no session d:"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			code, body := e.call(t, "POST", "/v1/sessions/lookup", tt.body)
			var res apiError
			if err := json.Unmarshal([]byte(body), &res); code != tt.code || err != nil || !strings.Contains(res.Error, tt.contains) {
				t.Errorf("lookup %s: %d %s; want %d and an error with %q", tt.body, code, body, tt.code, tt.contains)
			}
			if strings.Contains(res.Error, "secret") {
				t.Errorf("lookup echoes the raw identifier: %s", body)
			}
		})
	}
}

func TestSessionMigrate(t *testing.T) {
	e := newSessionsEnv(t)
	const n = 30
	for i := range n {
		e.turn(t, e.conversation(i))
	}
	e.sync(t)

	t.Run("refused", func(t *testing.T) {
		for _, tt := range []struct {
			name, body string
			code       int
			contains   string
		}{
			{"bad json", `{"from_version": "v1",`, http.StatusBadRequest, "migrate:"},
			{"unknown field", `{"from_version": "v1", "to_version": "v2", "force": true}`, http.StatusBadRequest, `unknown field "force"`},
			{"wrong type", `{"from_version": "v1", "to_version": "v2", "batch": "all"}`, http.StatusBadRequest, "cannot unmarshal"},
			{"no target", `{"from_version": "v1"}`, http.StatusBadRequest, "required"},
			{"same version", `{"from_version": "v1", "to_version": "v1"}`, http.StatusBadRequest, `both "v1"`},
			{"negative batch", `{"from_version": "v1", "to_version": "v2", "batch": -1}`, http.StatusBadRequest, "batch -1"},
			{"batch too large", `{"from_version": "v1", "to_version": "v2", "batch": 10001}`, http.StatusBadRequest, "batch 10001"},
			{"unknown source", `{"from_version": "v9", "to_version": "v2"}`, http.StatusNotFound, `version "v9"`},
			{"unknown target", `{"from_version": "v1", "to_version": "v9"}`, http.StatusNotFound, `version "v9"`},
		} {
			t.Run(tt.name, func(t *testing.T) {
				e.wantError(t, "POST", "/v1/sessions/migrate", tt.body, tt.code, tt.contains)
			})
		}
	})

	t.Run("target drained", func(t *testing.T) {
		for _, in := range []string{"c", "d"} {
			var res DrainResult
			e.callJSON(t, "POST", "/v1/sessions/drain", `{"instance": "`+in+`"}`, http.StatusOK, &res)
		}
		e.sync(t)
		e.wantError(t, "POST", "/v1/sessions/migrate", `{"from_version": "v1", "to_version": "v2"}`, http.StatusConflict, "no healthy, undrained instance")
		for _, in := range []string{"c", "d"} {
			var res DrainResult
			e.callJSON(t, "DELETE", "/v1/sessions/drain/"+in, "", http.StatusOK, &res)
		}
		e.sync(t)
	})

	// A first batch: 4 marked, the rest remaining.
	var res MarkResult
	e.callJSON(t, "POST", "/v1/sessions/migrate", `{"from_version": "v1", "to_version": "v2", "batch": 4}`, http.StatusOK, &res)
	if res.Marked != 4 || res.Remaining != n-4 {
		t.Fatalf("first batch = %+v, want 4 marked, %d remaining", res, n-4)
	}
	// Exactly those 4 show the move; at their next turn they move to v2.
	moved := 0
	for i := range n {
		h := e.conversation(i)
		var s SessionInfo
		e.callJSON(t, "GET", "/v1/sessions/"+e.key(h), "", http.StatusOK, &s)
		if s.Move == nil {
			if d := e.turn(t, h); d.Kind != affinity.KindHit {
				t.Errorf("unmarked session %d: decision %s, want hit", i, d.Kind)
			}
			continue
		}
		moved++
		if *s.Move != (MoveInfo{Version: "v2"}) || s.Version != "v1" {
			t.Errorf("marked session %d: %+v, want v1 with a move to v2", i, s)
		}
		d := e.turn(t, h)
		if d.Kind != affinity.KindMigrated || d.Instance.Version != "v2" {
			t.Errorf("marked session %d: decision %s on %s (%s), want migrated to v2", i, d.Kind, d.Instance.Name, d.Instance.Version)
		}
		if d2 := e.turn(t, h); d2.Kind != affinity.KindHit || d2.Instance != d.Instance {
			t.Errorf("session %d after migrating: %s on %s, want a hit on %s", i, d2.Kind, d2.Instance.Name, d.Instance.Name)
		}
	}
	if moved != 4 {
		t.Errorf("%d sessions show a move, want 4", moved)
	}

	// The rest, in batches of the default size.
	res = MarkResult{}
	e.callJSON(t, "POST", "/v1/sessions/migrate", `{"from_version": "v1", "to_version": "v2"}`, http.StatusOK, &res)
	if res != (MarkResult{Marked: n - 4}) {
		t.Errorf("second batch = %+v, want %d marked, none remaining", res, n-4)
	}
	e.callJSON(t, "POST", "/v1/sessions/migrate", `{"from_version": "v1", "to_version": "v2"}`, http.StatusOK, &res)
	if res != (MarkResult{}) {
		t.Errorf("third batch = %+v, want nothing left", res)
	}
	for i := range n {
		if d := e.turn(t, e.conversation(i)); d.Instance.Version != "v2" {
			t.Errorf("session %d: %s on %s (%s), want v2", i, d.Kind, d.Instance.Name, d.Instance.Version)
		}
	}
	e.sync(t)
	var st SessionStats
	e.callJSON(t, "GET", "/v1/sessions/stats", "", http.StatusOK, &st)
	for _, v := range st.Versions {
		if want := map[string]int{"v1": 0, "v2": n}[v.Name]; v.Active != want {
			t.Errorf("version %s: %d active after the migration, want %d", v.Name, v.Active, want)
		}
	}
}

// TestSessionMigrateEstimate: a batch that ends on the first instance
// estimates the others from their active sessions, and says so.
func TestSessionMigrateEstimate(t *testing.T) {
	e := newSessionsEnv(t)
	const n = 20
	for i := range n {
		e.turn(t, e.conversation(i))
	}
	e.sync(t)
	var res MarkResult
	e.callJSON(t, "POST", "/v1/sessions/migrate", `{"from_version": "v1", "to_version": "v2", "batch": 1}`, http.StatusOK, &res)
	if res != (MarkResult{Marked: 1, Remaining: n - 1, Estimated: true}) {
		t.Errorf("batch of 1 = %+v, want 1 marked, %d remaining, estimated", res, n-1)
	}
}

func TestSessionDrain(t *testing.T) {
	e := newSessionsEnv(t)
	const n = 20
	on := map[string][]int{}
	for i := range n {
		d := e.turn(t, e.conversation(i))
		on[d.Instance.Name] = append(on[d.Instance.Name], i)
	}
	e.sync(t)

	for _, tt := range []struct {
		name, body string
		code       int
		contains   string
	}{
		{"bad json", `{"instance": a}`, http.StatusBadRequest, "drain:"},
		{"unknown field", `{"instance": "a", "force": true}`, http.StatusBadRequest, `unknown field "force"`},
		{"no instance", `{}`, http.StatusBadRequest, "instance is required"},
		{"unknown instance", `{"instance": "zz"}`, http.StatusNotFound, `no instance "zz"`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e.wantError(t, "POST", "/v1/sessions/drain", tt.body, tt.code, tt.contains)
		})
	}
	e.wantError(t, "DELETE", "/v1/sessions/drain/zz", "", http.StatusNotFound, `no instance "zz"`)

	var res DrainResult
	e.callJSON(t, "POST", "/v1/sessions/drain", `{"instance": "a"}`, http.StatusOK, &res)
	if want := (DrainResult{Instance: "a", Drained: true, MarkResult: MarkResult{Marked: len(on["a"])}}); res != want {
		t.Fatalf("drain = %+v, want %+v", res, want)
	}
	if len(on["a"]) == 0 {
		t.Fatal("no session on a to drain")
	}
	var s SessionInfo
	e.callJSON(t, "GET", "/v1/sessions/"+e.key(e.conversation(on["a"][0])), "", http.StatusOK, &s)
	if s.Move == nil || *s.Move != (MoveInfo{Off: "a"}) {
		t.Errorf("drained session shows move %+v, want off a", s.Move)
	}

	e.sync(t) // what every replica does within a second
	var st SessionStats
	e.callJSON(t, "GET", "/v1/sessions/stats", "", http.StatusOK, &st)
	if !st.Instances[0].Drained || st.Total.Drained != 1 {
		t.Errorf("stats after drain: %+v, total %+v; want a drained", st.Instances[0], st.Total)
	}
	for _, i := range on["a"] {
		if d := e.turn(t, e.conversation(i)); d.Kind != affinity.KindDrained || d.Instance.Name == "a" {
			t.Errorf("session %d on a: %s on %s, want drained elsewhere", i, d.Kind, d.Instance.Name)
		}
	}
	for i := n; i < n+10; i++ {
		if d := e.turn(t, e.conversation(i)); d.Instance.Name == "a" {
			t.Errorf("new session %d placed on drained a", i)
		}
	}

	res = DrainResult{}
	e.callJSON(t, "DELETE", "/v1/sessions/drain/a", "", http.StatusOK, &res)
	if res != (DrainResult{Instance: "a"}) {
		t.Errorf("undrain = %+v", res)
	}
	e.sync(t)
	e.callJSON(t, "GET", "/v1/sessions/stats", "", http.StatusOK, &st)
	if st.Instances[0].Drained {
		t.Error("a still drained after undrain")
	}

	// An instance removed from the fleet while drained can still be undrained.
	e.callJSON(t, "POST", "/v1/sessions/drain", `{"instance": "b"}`, http.StatusOK, &res)
	e.sync(t)
	e.fleet.Replace(sessionsFleet[2:])
	e.callJSON(t, "DELETE", "/v1/sessions/drain/b", "", http.StatusOK, &res)
	e.sync(t)
	e.fleet.Replace(sessionsFleet)
	if e.load.Drained("b") {
		t.Error("b still drained")
	}
}

func TestSessionStoreDown(t *testing.T) {
	e := newSessionsEnv(t)
	e.turn(t, e.conversation(1))
	e.mini.Close()
	for _, tt := range []struct{ method, path, body string }{
		{"GET", "/v1/sessions/" + e.key(e.conversation(1)), ""},
		{"POST", "/v1/sessions/lookup", `{"session_id": "conv-1"}`},
		{"POST", "/v1/sessions/migrate", `{"from_version": "v1", "to_version": "v2"}`},
		{"POST", "/v1/sessions/drain", `{"instance": "a"}`},
		{"DELETE", "/v1/sessions/drain/a", ""},
	} {
		e.wantError(t, tt.method, tt.path, tt.body, http.StatusServiceUnavailable, "session store:")
	}
	// Stats come from the last sync and still answer.
	var st SessionStats
	e.callJSON(t, "GET", "/v1/sessions/stats", "", http.StatusOK, &st)
}
