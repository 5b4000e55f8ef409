package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tetherproxy/tether/admin"
	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/extproc"
)

// TestEmbeddedStoreBacksEveryFeature: with redis.url = "embedded" (the
// memory store) a replica keeps what it had on the embedded Redis: the
// session index behind the admin API (lookup, show, stats through the
// load sync), drains and migrations, and the instance breaker's shared
// circuits with the evacuation they trigger.
func TestEmbeddedStoreBacksEveryFeature(t *testing.T) {
	cfg := testConfig()
	cfg.Redis.URL = "embedded"
	cfg.Routing.Mode = config.ModeSticky
	cfg.Server.DebugHeaders = true
	cfg.Instances = []config.Instance{
		{Name: "a", Address: "127.0.0.1:1", Weight: 1, Version: "v1"},
		{Name: "b", Address: "127.0.0.1:2", Weight: 1, Version: "v1"},
		{Name: "c", Address: "127.0.0.1:3", Weight: 1, Version: "v2"},
	}
	addrs, logs, stop := runLogged(t, cfg)
	defer func() {
		if err := stop(); err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	adminURL := "http://" + addrs["admin"]
	api, err := admin.NewClient(adminURL, "")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	conn, err := grpc.NewClient(addrs["extproc"], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := extprocv3.NewExternalProcessorClient(conn)

	// A session on a v1 instance, so that it can be drained and migrated.
	var sid, first string
	for i := range 20 {
		id := fmt.Sprint("session-", i)
		in, kind := decide(t, client, id, 200)
		if kind != "bind" {
			t.Fatalf("first request of %s: decision %q, want bind", id, kind)
		}
		if in != "c" {
			sid, first = id, in
			break
		}
	}
	if sid == "" {
		t.Fatal("20 sessions, all on c")
	}
	if in, kind := decide(t, client, sid, 200); in != first || kind != "hit" {
		t.Fatalf("second request: %s %q, want %s hit", in, kind, first)
	}

	// The session index, through the admin API.
	info, err := api.Lookup(ctx, admin.LookupRequest{SessionID: sid})
	if err != nil {
		t.Fatalf("lookup: %v", err)
	}
	if info.Instance != first || info.Key == "" || info.TTLMs <= 0 {
		t.Fatalf("lookup: %+v, want the session on %s", info, first)
	}
	shown, err := api.Session(ctx, info.Key)
	if err != nil {
		t.Fatalf("show %s: %v", info.Key, err)
	}
	if shown.Key != info.Key || shown.Instance != first {
		t.Fatalf("show %s: %+v", info.Key, shown)
	}
	// Stats come from the load sync (once a second), which reads the index.
	waitStats(t, api, "active sessions on "+first, func(in admin.InstanceStats) bool { return in.Name != first || in.Active == 1 })

	// A drain marks the session: its next request moves, and no new
	// session lands on the drained instance.
	dr, err := api.Drain(ctx, first)
	if err != nil {
		t.Fatalf("drain %s: %v", first, err)
	}
	if !dr.Drained || dr.Marked != 1 {
		t.Fatalf("drain %s: %+v, want drained with 1 session marked", first, dr)
	}
	waitStats(t, api, first+" drained", func(in admin.InstanceStats) bool { return in.Name != first || in.Drained })
	second, kind := decide(t, client, sid, 200)
	if second == first || kind != "drained" {
		t.Fatalf("after the drain: %s %q, want another instance than %s, drained", second, kind, first)
	}
	for i := range 10 {
		if in, _ := decide(t, client, fmt.Sprint("new-", i), 200); in == first {
			t.Fatalf("a new session landed on drained %s", first)
		}
	}
	if _, err := api.Undrain(ctx, first); err != nil {
		t.Fatalf("undrain: %v", err)
	}

	// A migration marks the v1 session; its next request goes to v2.
	mr, err := api.Migrate(ctx, admin.MigrateRequest{FromVersion: "v1", ToVersion: "v2", Batch: 1000})
	if err != nil {
		t.Fatalf("migrate: %v", err)
	}
	if mr.Marked < 1 {
		t.Fatalf("migrate: %+v, want the session marked", mr)
	}
	if in, kind := decide(t, client, sid, 200); in != "c" || kind != "migrated" {
		t.Fatalf("after the migration: %s %q, want c migrated", in, kind)
	}

	// The instance breaker: more than failure_threshold failures open c's
	// circuit in the shared store, and the replica whose report opened it
	// moves c's sessions away.
	for range 4 {
		if in, _ := decide(t, client, sid, 503); in != "c" {
			t.Fatalf("a failing request went to %s before the breaker opened", in)
		}
	}
	// The evacuation of c, logged with how many sessions it moved.
	moved := func() float64 {
		for _, line := range strings.Split(logs.String(), "\n") {
			var m map[string]any
			if json.Unmarshal([]byte(line), &m) == nil && m["message"] == "sessions moved off an unavailable instance" && m["instance"] == "c" {
				n, _ := m["moved"].(float64)
				return n
			}
		}
		return -1
	}
	deadline := time.Now().Add(10 * time.Second)
	for moved() < 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no evacuation of c after its circuit opened:\n%s", logs)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if n := moved(); n < 1 {
		t.Errorf("the evacuation of c moved %v sessions, want the test's session at least:\n%s", n, logs)
	}
	if !strings.Contains(logs.String(), "instance breaker opened; moving its sessions") {
		t.Errorf("log lacks the opening of c's circuit:\n%s", logs)
	}
	if code, body := get(t, adminURL+"/readyz"); code != http.StatusOK || !strings.Contains(body, `"store":"ok"`) || !strings.Contains(body, `"breaker":"closed"`) {
		t.Errorf("/readyz: %d %s", code, body)
	}
}

// decide sends one request of session id through the ext_proc stream,
// answered with status, and returns the instance and the decision the
// debug headers name.
func decide(t *testing.T, c extprocv3.ExternalProcessorClient, id string, status int) (instance, decision string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := c.Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	hm := func(kv ...string) *extprocv3.HttpHeaders {
		m := &corev3.HeaderMap{}
		for i := 0; i < len(kv); i += 2 {
			m.Headers = append(m.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
		}
		return &extprocv3.HttpHeaders{Headers: m}
	}
	for _, r := range []*extprocv3.ProcessingRequest{
		{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: hm("x-session-id", id)}},
		{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: hm(":status", fmt.Sprint(status))}},
	} {
		if err := s.Send(r); err != nil {
			t.Fatal(err)
		}
		resp, err := s.Recv()
		if err != nil {
			t.Fatal(err)
		}
		for _, h := range resp.GetResponseHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
			switch h.GetHeader().GetKey() {
			case extproc.HeaderInstance:
				instance = string(h.GetHeader().GetRawValue())
			case extproc.HeaderDecision:
				decision = string(h.GetHeader().GetRawValue())
			}
		}
	}
	if err := s.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("stream end: %v", err)
	}
	return instance, decision
}

// waitStats polls the session stats, at most 10 s, until ok holds for
// every instance.
func waitStats(t *testing.T, api *admin.Client, what string, ok func(admin.InstanceStats) bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		st, err := api.Stats(context.Background())
		if err != nil {
			t.Fatalf("stats: %v", err)
		}
		all := true
		for _, in := range st.Instances {
			all = all && ok(in)
		}
		if all {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("stats never showed %s: %+v", what, st.Instances)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
