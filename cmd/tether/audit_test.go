package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	goredis "github.com/redis/go-redis/v9"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/audit"
	"github.com/tetherproxy/tether/audit/sinks"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/internal/testenv"
	"github.com/tetherproxy/tether/server"
	redisstore "github.com/tetherproxy/tether/store/redis"
)

// runTether runs the tether command with args, stdin as its standard input.
func runTether(ctx context.Context, stdin string, args ...string) (stdout, stderr string, err error) {
	root := newRootCmd()
	var out, errOut bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&errOut)
	root.SetIn(strings.NewReader(stdin))
	root.SetArgs(args)
	err = root.ExecuteContext(ctx)
	return out.String(), errOut.String(), err
}

// setAuditKeys puts fresh audit keys in the default variables.
func setAuditKeys(t *testing.T) {
	t.Helper()
	key := func() string {
		b := make([]byte, audit.KeySize)
		_, _ = rand.Read(b)
		return hex.EncodeToString(b)
	}
	t.Setenv(config.DefaultAuditKeyringEnv, "k1="+key())
	t.Setenv(config.DefaultAuditPseudonymEnv, key())
}

// writeConfig writes a configuration file and returns its path and the
// configuration it parses to.
func writeConfig(t *testing.T, toml string) (string, config.Config) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "tether.toml")
	if err := os.WriteFile(path, []byte(toml), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	return path, cfg
}

// auditBackend is a binding store's Redis: its URL and a client.
type auditBackend struct {
	url    string
	client goredis.UniversalClient
}

func auditBackends() map[string]func(t *testing.T) auditBackend {
	return map[string]func(t *testing.T) auditBackend{
		"miniredis": func(t *testing.T) auditBackend {
			m := miniredis.RunT(t)
			c := goredis.NewClient(&goredis.Options{Addr: m.Addr(), ContextTimeoutEnabled: true})
			t.Cleanup(func() { _ = c.Close() })
			return auditBackend{"redis://" + m.Addr(), c}
		},
		"redis-server": func(t *testing.T) auditBackend {
			r := testenv.RedisServer(t)
			return auditBackend{r.URL(), r.Client()}
		},
	}
}

// TestAuditExportAndForget writes decisions as tether does (Recorder,
// Writer, the configured sink), binds their sessions in the store, then
// runs `tether audit export` and `tether audit forget` on the same
// configuration: file and Redis sinks on miniredis and redis-server, and
// the PostgreSQL sink on a real PostgreSQL.
func TestAuditExportAndForget(t *testing.T) {
	for backend, newBackend := range auditBackends() {
		for _, sink := range []string{"file", "redis", "postgres"} {
			if sink == "postgres" && backend != "redis-server" {
				continue // one run is enough: the sink is the same
			}
			t.Run(backend+"/"+sink, func(t *testing.T) {
				setAuditKeys(t)
				b := newBackend(t)
				toml := fmt.Sprintf("[server]\ndrain_delay = \"0s\"\n[redis]\nurl = %q\n[audit]\nenabled = true\nsink = %q\nsample_rate = 0.000001\n", b.url, sink)
				switch sink {
				case "file":
					toml += fmt.Sprintf("file_dir = %q\n", filepath.Join(t.TempDir(), "audit"))
				case "postgres":
					t.Setenv(config.DefaultAuditPostgresDSNEnv, testenv.Postgres(t))
				}
				path, cfg := writeConfig(t, toml)
				testExportAndForget(t, b, path, cfg)
			})
		}
	}
}

func testExportAndForget(t *testing.T, b auditBackend, path string, cfg config.Config) {
	ctx := t.Context()
	store, err := redisstore.New(b.client, redisstore.Options{Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	sealer, err := audit.LoadSealer(sinks.Keys(cfg.Audit))
	if err != nil {
		t.Fatal(err)
	}
	sink, closeSink, err := sinks.Open(ctx, cfg.Audit, store)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = closeSink() }()
	w, err := audit.NewWriter(sink, audit.WriterConfig{SampleRate: cfg.Audit.SampleRate})
	if err != nil {
		t.Fatal(err)
	}
	rec, err := audit.NewRecorder(w, sealer, audit.RecorderConfig{})
	if err != nil {
		t.Fatal(err)
	}

	// alice: a session with a token and a device alias on gpu-a, then a
	// token-only session on gpu-b; bob: one session.
	const alice, bob = "alice@example.org", "bob@example.org"
	now := time.Now()
	turns := []struct {
		user     string
		id       identity.Identity
		instance string
		kind     affinity.Kind
	}{
		{alice, identity.Identity{Key: "s:alice-1", Source: identity.SourceSession, Aliases: []string{"t:alice", "d:alice"}}, "gpu-a", affinity.KindBind},
		{bob, identity.Identity{Key: "s:bob-1", Source: identity.SourceSession}, "gpu-a", affinity.KindBind},
		{alice, identity.Identity{Key: "s:alice-1", Source: identity.SourceSession, Aliases: []string{"t:alice", "d:alice"}}, "gpu-a", affinity.KindHit},
		{alice, identity.Identity{Key: "t:alice-2", Source: identity.SourceToken}, "gpu-b", affinity.KindBind},
	}
	for i, tn := range turns {
		_, err := store.GetOrBind(ctx, bindings.Lookup{Key: tn.id.Key, Aliases: tn.id.Aliases, Lifetime: bindings.Lifetime{Idle: time.Hour},
			Candidate: bindings.Binding{Instance: tn.instance, Version: "v1", Since: now}})
		if err != nil {
			t.Fatal(err)
		}
		d := affinity.Decision{Instance: fleet.Instance{Name: tn.instance, Version: "v1"}, Mode: affinity.Sticky, Kind: tn.kind}
		rec.Audit(audit.NewRequestID(), tn.user, tn.id, d, now.Add(time.Duration(i)*time.Second))
	}
	if err := w.Close(ctx); err != nil || w.Written() != 3 || w.Skipped() != 1 {
		t.Fatalf("writer: %v; written %d, skipped %d; want 3 and the hit sampled out", err, w.Written(), w.Skipped())
	}
	bound := func(key string) bool {
		t.Helper()
		_, ok, err := store.Show(ctx, key, time.Now())
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}

	out, stderr, err := runTether(ctx, "", "audit", "export", "--user", alice, "--config", path)
	if err != nil {
		t.Fatalf("export: %v\n%s", err, stderr)
	}
	var got []map[string]any
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("export line %q: %v", sc.Text(), err)
		}
		got = append(got, m)
	}
	if len(got) != 2 || got[0]["instance"] != "gpu-a" || got[1]["instance"] != "gpu-b" {
		t.Fatalf("export: %d records, want alice's two binds, oldest first:\n%s", len(got), out)
	}
	for _, m := range got {
		if m["user_id"] != alice || m["decision"] != "bind" || m["user_ct"] != nil || m["user_pseudonym"] != nil {
			t.Fatalf("export line %v: want alice's id decrypted and no ciphertext or pseudonym", m)
		}
	}
	if keys := fmt.Sprint(got[0]["session_keys"]); keys != "[s:alice-1 t:alice d:alice]" {
		t.Errorf("session_keys = %s", keys)
	}

	out, stderr, err = runTether(ctx, "", "audit", "forget", "--user", alice, "--config", path)
	if err != nil || out != "forgot 2 audit records and 2 session bindings\n" {
		t.Fatalf("forget: %q, %v\n%s", out, err, stderr)
	}
	for _, k := range []string{"s:alice-1", "t:alice", "d:alice", "t:alice-2"} {
		if bound(k) {
			t.Errorf("%s is still bound after forget", k)
		}
	}
	if !bound("s:bob-1") {
		t.Error("bob's session went too")
	}
	out, _, err = runTether(ctx, "", "audit", "forget", "--user", alice, "--config", path, "--json")
	if err != nil || out != `{"records":0,"bindings":0}`+"\n" {
		t.Fatalf("second forget: %q, %v; want zeros", out, err)
	}
	if out, _, err := runTether(ctx, "", "audit", "export", "--user", alice, "--config", path); err != nil || out != "" {
		t.Fatalf("export after forget: %q, %v", out, err)
	}
	// bob's record is still there, and --user - reads the id from stdin.
	out, _, err = runTether(ctx, bob+"\n", "audit", "export", "--user", "-", "--config", path)
	if err != nil || strings.Count(out, "\n") != 1 || !strings.Contains(out, `"user_id":"`+bob+`"`) {
		t.Fatalf("export of bob: %q, %v", out, err)
	}
}

func TestAuditUserErrors(t *testing.T) {
	setAuditKeys(t)
	path, _ := writeConfig(t, fmt.Sprintf("[audit]\nsink = \"file\"\nfile_dir = %q\n", t.TempDir()))
	const secret = "secret-user"
	for _, tc := range []struct {
		name, user, stdin, want string
	}{
		{"empty", "", "", "empty user id"},
		{"empty stdin", "-", "", "empty user id"},
		{"too long", secret + strings.Repeat("x", 5000), "", "longer than identity.max_value_bytes (4096 bytes)"},
		{"too long on stdin", "-", secret + strings.Repeat("x", 5000) + "\n", "longer than identity.max_value_bytes"},
		{"control characters", secret + "\x1b[2J", "", "control characters"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, sub := range []string{"export", "forget"} {
				out, stderr, err := runTether(t.Context(), tc.stdin, "audit", sub, "--user", tc.user, "--config", path)
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("%s: %v, want an error saying %q", sub, err, tc.want)
				}
				if strings.Contains(err.Error()+out+stderr, secret) {
					t.Fatalf("%s: the user id is shown: %v", sub, err)
				}
			}
		})
	}
	if _, _, err := runTether(t.Context(), "", "audit", "export", "--config", path); err == nil || !strings.Contains(err.Error(), "user") {
		t.Fatalf("export without --user: %v", err)
	}
}

func TestAuditSetupErrors(t *testing.T) {
	dir := t.TempDir()
	fileCfg, _ := writeConfig(t, fmt.Sprintf("[audit]\nsink = \"file\"\nfile_dir = %q\n", dir))
	embedded, _ := writeConfig(t, "[audit]\nsink = \"redis\"\n")
	postgres, _ := writeConfig(t, "[audit]\nsink = \"postgres\"\npostgres_dsn_env = \"TETHER_TEST_AUDIT_DSN\"\n")
	for _, tc := range []struct {
		name, path string
		keys       bool
		args       []string
		want       string
	}{
		{"no keys", fileCfg, false, []string{"export"}, config.DefaultAuditKeyringEnv},
		{"embedded store", embedded, true, []string{"export"}, `redis.url = "embedded"`},
		{"embedded store, forget with files", fileCfg, true, []string{"forget"}, `redis.url = "embedded"`},
		{"postgres without its DSN", postgres, true, []string{"export"}, "TETHER_TEST_AUDIT_DSN is not set"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.keys {
				setAuditKeys(t)
			} else {
				t.Setenv(config.DefaultAuditKeyringEnv, "")
			}
			args := append([]string{"audit"}, tc.args...)
			_, _, err := runTether(t.Context(), "", append(args, "--user", "u", "--config", tc.path)...)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("%v, want an error mentioning %q", err, tc.want)
			}
		})
	}
}

// TestServeRecordsDecisions runs tether (server.Run) with the audit on, a
// file sink and the store on miniredis; a request through its ext_proc
// server is recorded once tether has stopped (the writer is flushed after
// the gRPC server), and `tether audit forget` then removes the record and
// the session's binding.
func TestServeRecordsDecisions(t *testing.T) {
	setAuditKeys(t)
	t.Setenv(config.DefaultSecretEnv, "an-identity-secret-of-32-bytes!!")
	m := miniredis.RunT(t)
	path, cfg := writeConfig(t, fmt.Sprintf(`
[server]
extproc_addr = "127.0.0.1:0"
admin_addr = "127.0.0.1:0"
drain_delay = "0s"
[xds]
addr = ""
[redis]
url = "redis://%s"
timeout = "1s"
[envoy]
message_timeout = "2s"
[audit]
enabled = true
sink = "file"
file_dir = %q
[[instances]]
name = "gpu-a"
address = "127.0.0.1:9001"
`, m.Addr(), filepath.Join(t.TempDir(), "audit")))

	lines := make(chan map[string]any, 64)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- server.Run(ctx, cfg, server.Options{Logger: zerolog.New(lineWriter(lines))}) }()
	var extproc, admin string
	deadline := time.After(10 * time.Second)
	for extproc == "" {
		select {
		case l := <-lines:
			if l["message"] == "tether ready" {
				extproc, admin = l["extproc"].(string), l["admin"].(string)
			}
		case err := <-done:
			t.Fatalf("Run: %v", err)
		case <-deadline:
			t.Fatal("tether did not start")
		}
	}

	const user, rid = "carol@example.org", "5b8f1c2e-0d3a-4f6b-9c1d-2e3f4a5b6c7d"
	decide(ctx, t, extproc, [2]string{":path", "/v1/chat/completions"}, [2]string{"x-session-id", "conv-1"},
		[2]string{"x-user-id", user}, [2]string{"x-request-id", rid})

	resp, err := http.Get("http://" + admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{`tether_audit_records_total{result="written"}`, `tether_audit_records_total{result="dropped"} 0`,
		"tether_audit_request_ids_generated_total 0", "tether_audit_user_ids_rejected_total 0"} {
		if !strings.Contains(string(metrics), want) {
			t.Errorf("metrics lack %q", want)
		}
	}

	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	out, _, err := runTether(t.Context(), "", "audit", "export", "--user", user, "--config", path)
	if err != nil || !strings.Contains(out, `"request_id":"`+rid+`"`) || !strings.Contains(out, `"decision":"bind"`) ||
		!strings.Contains(out, `"user_id":"`+user+`"`) {
		t.Fatalf("export: %q, %v", out, err)
	}
	if n := len(m.Keys()); n == 0 {
		t.Fatal("no binding in Redis")
	}
	out, _, err = runTether(t.Context(), "", "audit", "forget", "--user", user, "--config", path)
	if err != nil || out != "forgot 1 audit records and 1 session bindings\n" {
		t.Fatalf("forget: %q, %v", out, err)
	}
	for _, k := range m.Keys() {
		if strings.Contains(k, "}:b") || strings.Contains(k, "}:a") {
			t.Errorf("%s left after forget", k)
		}
		if strings.Contains(k, user) {
			t.Errorf("Redis key %q holds the user id", k)
		}
	}
}

// decide sends one request's headers to tether's ext_proc server at addr
// and waits for its decision.
func decide(ctx context.Context, t *testing.T, addr string, headers ...[2]string) {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	stream, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	h := &corev3.HeaderMap{}
	for _, kv := range headers {
		h.Headers = append(h.Headers, &corev3.HeaderValue{Key: kv[0], RawValue: []byte(kv[1])})
	}
	if err := stream.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: h}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatal(err)
	}
	_ = stream.CloseSend()
}

// TestServeWithPostgresDown: tether serve starts and decides while the
// audit's PostgreSQL cannot be reached (its records fail, counted), while
// `tether audit export` on the same configuration refuses with the
// connection error. Neither shows the DSN's password.
func TestServeWithPostgresDown(t *testing.T) {
	setAuditKeys(t)
	t.Setenv(config.DefaultSecretEnv, "an-identity-secret-of-32-bytes!!")
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	down := l.Addr().String()
	_ = l.Close() // nothing listens there now
	const password = "pg-pass-never-shown"
	t.Setenv("TETHER_TEST_AUDIT_DSN", "postgres://tether:"+password+"@"+down+"/audit?connect_timeout=1")
	path, cfg := writeConfig(t, `
[server]
extproc_addr = "127.0.0.1:0"
admin_addr = "127.0.0.1:0"
drain_delay = "0s"
[xds]
addr = ""
[audit]
enabled = true
sink = "postgres"
postgres_dsn_env = "TETHER_TEST_AUDIT_DSN"
[[instances]]
name = "gpu-a"
address = "127.0.0.1:9001"
`)
	lines := make(chan map[string]any, 64)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- server.Run(ctx, cfg, server.Options{Logger: zerolog.New(lineWriter(lines))}) }()
	var logs []map[string]any
	extproc := ""
	for deadline := time.After(15 * time.Second); extproc == ""; {
		select {
		case l := <-lines:
			logs = append(logs, l)
			if l["message"] == "tether ready" {
				extproc = l["extproc"].(string)
			}
		case err := <-done:
			t.Fatalf("Run with PostgreSQL down: %v, want it to start", err)
		case <-deadline:
			t.Fatal("tether did not start")
		}
	}
	decide(ctx, t, extproc, [2]string{"x-session-id", "conv-1"}, [2]string{"x-user-id", "dave@example.org"})
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	for more := true; more; {
		select {
		case l := <-lines:
			logs = append(logs, l)
		default:
			more = false
		}
	}
	warned, closed := false, false
	for _, l := range logs {
		if b, _ := json.Marshal(l); strings.Contains(string(b), password) {
			t.Errorf("log line shows the DSN's password: %s", b)
		}
		warned = warned || strings.Contains(fmt.Sprint(l["message"]), "PostgreSQL cannot be reached")
		if l["message"] == "routing audit closed" {
			closed = l["failed"] == 1.0 && l["written"] == 0.0
		}
	}
	if !warned || !closed {
		t.Errorf("logs: warned at start %t, closed with 1 failed and 0 written %t:\n%v", warned, closed, logs)
	}

	_, stderr, err := runTether(t.Context(), "", "audit", "export", "--user", "dave@example.org", "--config", path)
	if err == nil || !strings.Contains(err.Error(), "open routing_audit on "+down) {
		t.Errorf("export with PostgreSQL down: %v, want the sink's open error naming %s", err, down)
	}
	if strings.Contains(fmt.Sprint(err)+stderr, password) {
		t.Errorf("export's error shows the DSN's password: %v %s", err, stderr)
	}
}

// lineWriter sends each JSON log line to a channel (dropping when full).
type lineWriter chan map[string]any

func (w lineWriter) Write(p []byte) (int, error) {
	var m map[string]any
	if json.Unmarshal(p, &m) == nil {
		select {
		case w <- m:
		default:
		}
	}
	return len(p), nil
}
