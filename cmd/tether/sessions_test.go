package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	goredis "github.com/redis/go-redis/v9"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/admin"
	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/replicas"
	redisstore "github.com/tetherproxy/tether/store/redis"
)

// runCLI runs tether with args against the admin API at admin.
func runCLI(ctx context.Context, admin string, args ...string) (stdout string, err error) {
	root := newRootCmd()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetErr(io.Discard)
	root.SetArgs(append(args, "--admin", admin))
	err = root.ExecuteContext(ctx)
	return out.String(), err
}

// sessionsServer is the real session API over the Redis store on
// miniredis, with a decider to make sessions.
type sessionsServer struct {
	url      string
	decider  *affinity.Decider
	loadSync *replicas.LoadSync
	ids      *identity.Extractor
}

func newSessionsServer(t *testing.T) *sessionsServer {
	t.Helper()
	m := miniredis.RunT(t)
	c := goredis.NewClient(&goredis.Options{Addr: m.Addr(), ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = c.Close() })
	store, err := redisstore.New(c, redisstore.Options{Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	headers := identity.Config{SessionHeader: config.DefaultSessionHeader}
	ids, err := identity.New(identity.Config{SessionHeader: headers.SessionHeader, Secret: []byte("a-test-secret-of-32-bytes-long!!")})
	if err != nil {
		t.Fatal(err)
	}
	fl := fleet.New([]fleet.Instance{
		{Name: "a", Zone: "z1", Version: "v1", Weight: 1},
		{Name: "b", Zone: "z2", Version: "v1", Weight: 1},
		{Name: "c", Zone: "z1", Version: "v2", Weight: 1},
	})
	load := affinity.NewLoad()
	pol := affinity.Policy{Mode: affinity.Sticky, Lifetime: bindings.Lifetime{Idle: 30 * time.Minute},
		VersionAffinity: affinity.Strict, Versions: []affinity.VersionWeight{{Name: "v1", Weight: 1}}}
	mux := http.NewServeMux()
	admin.NewSessionOps(admin.SessionOpsConfig{
		Index: store, Drains: store, Load: load, Fleet: fl, Identity: ids, Headers: headers, Logger: zerolog.Nop(),
	}).Routes(mux)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return &sessionsServer{url: srv.URL, decider: affinity.New(store, fl, pol, affinity.WithLoad(load)), ids: ids,
		loadSync: &replicas.LoadSync{Replica: "replica-1", View: load, Store: store, Instances: fl.All}}
}

func (s *sessionsServer) turn(t *testing.T, sessionID string) affinity.Decision {
	t.Helper()
	d, err := s.decider.Decide(t.Context(), affinity.Request{ID: s.ids.Extract(identity.Map{"x-session-id": sessionID})})
	if err != nil {
		t.Fatal(err)
	}
	s.decider.Finish(d, fleet.Outcome{Answered: true})
	return d
}

func (s *sessionsServer) sync(t *testing.T) {
	t.Helper()
	if err := s.loadSync.Sync(t.Context(), time.Now()); err != nil {
		t.Fatal(err)
	}
}

func TestSessionsCommands(t *testing.T) {
	s := newSessionsServer(t)
	const n = 30
	placed := map[string]int{}
	for i := range n {
		placed[s.turn(t, fmt.Sprint("conv-", i)).Instance.Name]++
	}
	s.sync(t)
	ctx := t.Context()

	out, err := runCLI(ctx, s.url, "sessions", "stats")
	if err != nil {
		t.Fatalf("stats: %v", err)
	}
	for _, want := range []string{
		"INSTANCE  ZONE  VERSION  CAPACITY  ACTIVE  IN FLIGHT  QUEUE  DRAINED",
		fmt.Sprintf("a         z1    v1       -         %-6d  0          -      no", placed["a"]),
		"c         z1    v2       -         0       0          -      no",
		fmt.Sprintf("v1       2          0        %-6d  0          0", n),
		fmt.Sprintf("total: 3 instances (0 drained), %d active sessions, 0 requests in flight, queue depth 0", n),
	} {
		if !strings.Contains(out, want) {
			t.Errorf("stats output lacks %q:\n%s", want, out)
		}
	}
	out, err = runCLI(ctx, s.url, "sessions", "stats", "--json")
	var st admin.SessionStats
	if err != nil || json.Unmarshal([]byte(out), &st) != nil || st.Total.Active != n || len(st.Instances) != 3 {
		t.Errorf("stats --json: %v, %+v", err, st)
	}

	key := s.ids.Extract(identity.Map{"x-session-id": "conv-3"}).Key
	for _, args := range [][]string{{"show", key}, {"show", "--session-id", "conv-3"}} {
		out, err := runCLI(ctx, s.url, append([]string{"sessions"}, args...)...)
		if err != nil || !strings.Contains(out, "key       "+key) || !strings.Contains(out, "version   v1") || !strings.Contains(out, "move      none") {
			t.Errorf("%v: %v\n%s", args, err, out)
		}
		if strings.Contains(out, "conv-3") {
			t.Errorf("%v echoes the session id:\n%s", args, out)
		}
	}

	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"show"}, "give a session key or --session-id"},
		{[]string{"show", key, "--session-id", "conv-3"}, "not both"},
		{[]string{"show", "s:nobody"}, "no session s:nobody (404 Not Found)"},
		{[]string{"show", "s:a/b"}, "(400 Bad Request)"},
		{[]string{"migrate", "--from-version", "v1", "--to-version", "v1"}, `both "v1" (400 Bad Request)`},
		{[]string{"migrate", "--from-version", "v1", "--to-version", "v9"}, `version "v9" in the fleet (404 Not Found)`},
		{[]string{"migrate", "--from-version", "v1", "--to-version", "v2", "--batch", "0"}, "--batch 0"},
		{[]string{"migrate", "--from-version", "v1"}, `"to-version" not set`},
		{[]string{"drain", "--instance", "zz"}, `no instance "zz" (404 Not Found)`},
		{[]string{"drain", "--instance", "zz", "--undo"}, `no instance "zz" (404 Not Found)`},
	} {
		if _, err := runCLI(ctx, s.url, append([]string{"sessions"}, tt.args...)...); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%v: error %v, want one with %q", tt.args, err, tt.want)
		}
	}

	out, err = runCLI(ctx, s.url, "sessions", "migrate", "--from-version", "v1", "--to-version", "v2", "--batch", "7", "--interval", "0", "--json")
	var sum migrateSummary
	if err != nil || json.Unmarshal([]byte(out), &sum) != nil {
		t.Fatalf("migrate: %v\n%s", err, out)
	}
	if sum.Marked != n || sum.Remaining != 0 || sum.Batches != 5 || sum.Interrupted {
		t.Errorf("migrate summary %+v, want %d marked in 5 batches", sum, n)
	}
	for i := range n {
		if d := s.turn(t, fmt.Sprint("conv-", i)); d.Kind != affinity.KindMigrated || d.Instance.Name != "c" {
			t.Errorf("session %d after migrate: %s on %s, want migrated to c", i, d.Kind, d.Instance.Name)
		}
	}

	out, err = runCLI(ctx, s.url, "sessions", "drain", "--instance", "c")
	if want := fmt.Sprintf("c drained: no new sessions; %d sessions marked", n); err != nil || !strings.Contains(out, want) {
		t.Errorf("drain: %v %q, want %q", err, out, want)
	}
	out, err = runCLI(ctx, s.url, "sessions", "show", "--session-id", "conv-0")
	if err != nil || !strings.Contains(out, "move      off c at its next turn (drain)") {
		t.Errorf("show after drain: %v\n%s", err, out)
	}
	out, err = runCLI(ctx, s.url, "sessions", "drain", "--instance", "c", "--undo", "--json")
	var dr admin.DrainResult
	if err != nil || json.Unmarshal([]byte(out), &dr) != nil || dr != (admin.DrainResult{Instance: "c"}) {
		t.Errorf("undrain: %v %q", err, out)
	}
}

// scripted is an admin API whose migrate answers come from a script; the
// last answer repeats. onCall runs before each answer with its number.
func scripted(t *testing.T, answers []string, onCall func(n int)) string {
	t.Helper()
	var calls atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || r.URL.Path != "/v1/sessions/migrate" {
			http.NotFound(w, r)
			return
		}
		var req admin.MigrateRequest
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil || req != (admin.MigrateRequest{FromVersion: "v1", ToVersion: "v2", Batch: 10}) {
			t.Errorf("migrate request %+v, %v", req, err)
		}
		n := int(calls.Add(1))
		if onCall != nil {
			onCall(n)
		}
		a := answers[min(n, len(answers))-1]
		code := http.StatusOK
		if strings.Contains(a, `"error"`) {
			code = http.StatusServiceUnavailable
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		_, _ = w.Write([]byte(a))
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

func TestSessionsMigrateLoop(t *testing.T) {
	migrate := []string{"sessions", "migrate", "--from-version", "v1", "--to-version", "v2", "--batch", "10", "--interval", "1ms"}

	t.Run("interrupted", func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		url := scripted(t, []string{`{"marked": 10, "remaining": 100}`}, func(int) {
			time.AfterFunc(50*time.Millisecond, cancel) // Ctrl-C in the pause after the first batch
		})
		out, err := runCLI(ctx, url, "sessions", "migrate", "--from-version", "v1", "--to-version", "v2", "--batch", "10", "--interval", "1h")
		if err == nil || !strings.Contains(err.Error(), "interrupted with 100 sessions of v1 left unmarked") {
			t.Errorf("error %v, want interrupted", err)
		}
		if !strings.HasPrefix(out, "interrupted: marked 10 sessions of v1 to move to v2 at their next turn (1 batch,") {
			t.Errorf("summary %q", out)
		}
	})

	t.Run("stalled", func(t *testing.T) {
		url := scripted(t, []string{`{"marked": 10, "remaining": 5}`, `{"marked": 0, "remaining": 5}`}, nil)
		out, err := runCLI(t.Context(), url, migrate...)
		if err == nil || !strings.Contains(err.Error(), "3 batches in a row marked nothing while 5 sessions remain") {
			t.Errorf("error %v, want a stall", err)
		}
		if !strings.Contains(out, "marked 10 sessions") || !strings.Contains(out, "(4 batches") {
			t.Errorf("summary %q", out)
		}
	})

	t.Run("store error", func(t *testing.T) {
		url := scripted(t, []string{`{"marked": 10, "remaining": 5}`, `{"error": "session store: boom"}`}, nil)
		out, err := runCLI(t.Context(), url, migrate...)
		if err == nil || err.Error() != "session store: boom (503 Service Unavailable)" {
			t.Errorf("error %v, want the server's", err)
		}
		if !strings.Contains(out, "marked 10 sessions") {
			t.Errorf("summary %q", out)
		}
	})

	t.Run("progress", func(t *testing.T) {
		// The first total is an estimate that turns out high; new sessions
		// then raise it; the bar ends full.
		url := scripted(t, []string{
			`{"marked": 10, "remaining": 30, "estimated": true}`,
			`{"marked": 10, "remaining": 25}`,
			`{"marked": 10, "remaining": 0}`,
		}, nil)
		c, err := admin.NewClient(url, "")
		if err != nil {
			t.Fatal(err)
		}
		var bar bytes.Buffer
		sum, err := runMigrate(t.Context(), c, admin.MigrateRequest{FromVersion: "v1", ToVersion: "v2", Batch: 10}, 0, &bar)
		if err != nil || sum.Marked != 30 || sum.Batches != 3 || sum.Remaining != 0 {
			t.Errorf("runMigrate = %+v, %v", sum, err)
		}
		if !strings.Contains(bar.String(), "30/30") || !strings.Contains(bar.String(), "sessions marked") {
			t.Errorf("progress bar output %q, want it to end at 30/30", bar.String())
		}
	})
}

// TestSessionsSendAdminToken: with the admin API behind a token, the CLI
// sends the one in $TETHER_ADMIN_TOKEN (or the variable it is told).
func TestSessionsSendAdminToken(t *testing.T) {
	const token = "a-long-enough-admin-token"
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer "+token {
			w.Header().Set("WWW-Authenticate", "Bearer")
			http.Error(w, `{"error":"unauthorized"}`, http.StatusUnauthorized)
			return
		}
		_, _ = w.Write([]byte(`{"instances":[]}`))
	}))
	defer srv.Close()
	if _, err := runCLI(t.Context(), srv.URL, "sessions", "stats", "--json"); err == nil {
		t.Fatal("stats without a token succeeded against a server that wants one")
	}
	t.Setenv(config.DefaultAdminTokenEnv, token)
	if _, err := runCLI(t.Context(), srv.URL, "sessions", "stats", "--json"); err != nil {
		t.Fatalf("stats with $%s: %v", config.DefaultAdminTokenEnv, err)
	}
	t.Setenv("OPS_TOKEN", token)
	t.Setenv(config.DefaultAdminTokenEnv, "")
	if _, err := runCLI(t.Context(), srv.URL, "sessions", "stats", "--json", "--admin-token-env", "OPS_TOKEN"); err != nil {
		t.Fatalf("stats with --admin-token-env: %v", err)
	}
}
