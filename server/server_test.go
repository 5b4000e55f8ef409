package server

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/google/go-cmp/cmp"
	"github.com/rs/zerolog"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/testenv"
)

func TestMain(m *testing.M) {
	// miniredis's and go-redis's pool goroutines end with Close; none may
	// outlive Run.
	goleak.VerifyTestMain(m)
}

// logWatcher collects log lines and reports the ready line's addresses.
type logWatcher struct {
	lines chan map[string]any
}

func (w logWatcher) Write(p []byte) (int, error) {
	var m map[string]any
	if json.Unmarshal(p, &m) == nil {
		select {
		case w.lines <- m:
		default:
		}
	}
	return len(p), nil
}

// run starts Run in the background and returns the ext_proc and admin
// addresses, and a stop function that cancels and waits for Run's result.
func run(t *testing.T, cfg config.Config) (extproc, admin string, stop func() error) {
	t.Helper()
	addrs, _, stop := runLogged(t, cfg)
	return addrs["extproc"], addrs["admin"], stop
}

func testConfig() config.Config {
	c := config.Default()
	c.Server.ExtProcAddr = "127.0.0.1:0"
	c.Server.AdminAddr = "127.0.0.1:0"
	c.XDS.Addr = "127.0.0.1:0"
	c.Server.DrainTimeout = config.Dur(5 * time.Second)
	c.Server.DrainDelay = config.Dur(0) // TestLameDuck covers it
	// A loaded test machine can hold a store call past the 10ms default;
	// these tests are about the server, not store timeouts.
	c.Envoy.MessageTimeout = config.Dur(2 * time.Second)
	c.Redis.Timeout = config.Dur(time.Second)
	c.Instances = []config.Instance{{Name: "a", Address: "127.0.0.1:1", Weight: 1, Version: "v1"}}
	return c
}

// waitDraining waits, at most 5 s, for the admin server at admin to
// answer /readyz with 503 "draining".
func waitDraining(t *testing.T, admin string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		code, body := get(t, "http://"+admin+"/readyz")
		if code == http.StatusServiceUnavailable && strings.Contains(body, "draining") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/readyz never said draining: %d %s", code, body)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func TestAdminEndpoints(t *testing.T) {
	_, admin, stop := run(t, testConfig())
	if code, body := get(t, "http://"+admin+"/healthz"); code != 200 || body != "ok\n" {
		t.Errorf("/healthz: %d %q", code, body)
	}
	if code, body := get(t, "http://"+admin+"/readyz"); code != 200 || !strings.Contains(body, `"status":"ready"`) || !strings.Contains(body, `"store":"ok"`) {
		t.Errorf("/readyz: %d %q", code, body)
	}
	if code, body := get(t, "http://"+admin+"/metrics"); code != 200 || !strings.Contains(body, "tether_decision_duration_seconds") || !strings.Contains(body, "go_goroutines") {
		t.Errorf("/metrics: %d, missing tether or runtime metrics", code)
	}
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
}

// TestDrainLetsOpenStreamsFinish: after the context ends (SIGTERM), a
// stream that is mid-request still gets its response-phase answer.
func TestDrainLetsOpenStreamsFinish(t *testing.T) {
	cfg := testConfig()
	cfg.Server.DebugHeaders = true
	extproc, admin, stop := run(t, cfg)
	conn, err := grpc.NewClient(extproc, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	send := func(r *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
		t.Helper()
		if err := s.Send(r); err != nil {
			t.Fatal(err)
		}
		resp, err := s.Recv()
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	hm := func(kv ...string) *extprocv3.HttpHeaders {
		m := &corev3.HeaderMap{}
		for i := 0; i < len(kv); i += 2 {
			m.Headers = append(m.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
		}
		return &extprocv3.HttpHeaders{Headers: m}
	}
	r := send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: hm("x-session-id", "s")}})
	if got := string(r.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders()[0].GetHeader().GetRawValue()); got != "inst-a" {
		t.Fatalf("routed to %q", got)
	}

	stopped := make(chan error, 1)
	go func() { stopped <- stop() }()
	// Readiness turns to draining while the stream is open.
	waitDraining(t, admin)
	r = send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: hm(":status", "200")}})
	if hs := r.GetResponseHeaders().GetResponse().GetHeaderMutation().GetSetHeaders(); len(hs) != 2 || !bytes.Equal(hs[1].GetHeader().GetRawValue(), []byte("bind")) {
		t.Fatalf("response phase during drain: %v", r)
	}
	if err := s.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("stream end: %v", err)
	}
	select {
	case err := <-stopped:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after the last stream closed")
	}
}

// TestLameDuck: for server.drain_delay after the context ends (SIGTERM),
// /readyz and the gRPC health service report the replica down while new
// connections and streams still get decisions; then Run drains and
// returns, and the port is closed.
func TestLameDuck(t *testing.T) {
	cfg := testConfig()
	const delay = 1500 * time.Millisecond
	cfg.Server.DrainDelay = config.Dur(delay)
	extproc, admin, stop := run(t, cfg)

	began := time.Now()
	stopped := make(chan error, 1)
	go func() { stopped <- stop() }()
	waitDraining(t, admin)
	// A client that connects now, as Envoy does until its health checks
	// fail, is served and told the replica is going.
	conn, err := grpc.NewClient(extproc, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	// The endpoint picker protocol's services too: all down but liveness.
	for service, want := range map[string]healthpb.HealthCheckResponse_ServingStatus{
		"":          healthpb.HealthCheckResponse_NOT_SERVING,
		"readiness": healthpb.HealthCheckResponse_NOT_SERVING,
		"envoy.service.ext_proc.v3.ExternalProcessor": healthpb.HealthCheckResponse_NOT_SERVING,
		"liveness": healthpb.HealthCheckResponse_SERVING,
	} {
		h, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: service})
		if err != nil || h.GetStatus() != want {
			t.Fatalf("health of %q during the drain delay: %v, %v; want %v", service, h, err, want)
		}
	}
	s, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		t.Fatalf("new stream during the drain delay: %v", err)
	}
	hm := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: "x-session-id", RawValue: []byte("late")}}}
	if err := s.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: hm}}}); err != nil {
		t.Fatal(err)
	}
	r, err := s.Recv()
	if err != nil {
		t.Fatalf("decision during the drain delay: %v", err)
	}
	if got := string(r.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders()[0].GetHeader().GetRawValue()); got != "inst-a" {
		t.Fatalf("routed to %q during the drain delay", got)
	}
	if err := s.CloseSend(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-stopped:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after the drain delay")
	}
	if took := time.Since(began); took < delay {
		t.Errorf("Run returned %v after the context ended, before the %v drain delay", took, delay)
	}
	if c, err := net.DialTimeout("tcp", extproc, time.Second); err == nil {
		_ = c.Close()
		t.Error("the ext_proc port still accepts connections after Run returned")
	}
}

func TestStartupErrors(t *testing.T) {
	t.Setenv("TETHER_IDENTITY_SECRET", "")
	tests := []struct {
		name string
		edit func(*config.Config)
		want string
	}{
		{"real redis without a secret", func(c *config.Config) { c.Redis.URL = "redis://127.0.0.1:1/0" }, "identity secret missing"},
		{"short secret", func(c *config.Config) { c.Identity.Secret = "short" }, "at least 16 bytes"},
		{"malformed redis URL", func(c *config.Config) {
			c.Redis.URL = "redis://:hunter2@127.0.0.1:port/0"
			c.Identity.Secret = "0123456789abcdef0123"
		}, "binding store"},
		{"address in use", nil, "listener"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig()
			if tc.edit != nil {
				tc.edit(&cfg)
			} else {
				ext, _, _ := run(t, testConfig())
				cfg.Server.ExtProcAddr = ext
			}
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			defer cancel()
			err := Run(ctx, cfg, Options{Logger: zerolog.Nop()})
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want it to mention %q", err, tc.want)
			}
			if strings.Contains(err.Error(), "hunter2") {
				t.Fatalf("error shows the Redis password: %v", err)
			}
		})
	}
}

func TestEmbeddedWithoutSecretWarns(t *testing.T) {
	t.Setenv("TETHER_IDENTITY_SECRET", "")
	var logs bytes.Buffer
	c := testConfig()
	s, err := identitySecret(c.Identity, c.Redis.URL, zerolog.New(&logs))
	if err != nil || len(s) != 32 {
		t.Fatalf("secret %d bytes, err %v", len(s), err)
	}
	if !strings.Contains(logs.String(), "no identity secret set") {
		t.Fatalf("no warning logged: %s", logs.String())
	}
}

// readyz reads /readyz, and how long it took.
func readyz(t *testing.T, admin string) (int, map[string]string, time.Duration) {
	t.Helper()
	start := time.Now()
	code, body := get(t, "http://"+admin+"/readyz")
	took := time.Since(start)
	var m map[string]string
	if err := json.Unmarshal([]byte(body), &m); err != nil {
		t.Fatalf("/readyz body %q: %v", body, err)
	}
	return code, m, took
}

// TestStartsWithoutRedis: tether starts while its Redis is down, reports
// itself ready but degraded without waiting on Redis, routes requests
// without it, and uses Redis once it is up.
func TestStartsWithoutRedis(t *testing.T) {
	r := testenv.RedisServer(t)
	r.Stop()
	cfg := testConfig()
	cfg.Redis.URL = r.URL()
	cfg.Identity.Secret = "0123456789abcdef0123"
	cfg.Server.DebugHeaders = true
	// Short enough that a call which is the breaker's probe cannot make
	// /readyz slow, long enough for a loaded machine once Redis is up.
	cfg.Redis.Timeout = config.Dur(100 * time.Millisecond)
	extproc, admin, stop := run(t, cfg)

	code, body, took := readyz(t, admin)
	t.Logf("/readyz without Redis: %d %v in %v", code, body, took)
	want := map[string]string{"status": "degraded", "store": "unreachable", "breaker": "open", "hits": "cached"}
	if code != http.StatusOK || !cmp.Equal(body, want) {
		t.Errorf("/readyz without Redis: %d %v, want 200 %v", code, body, want)
	}
	// Not the second readiness allows a ping: the breaker refuses it at
	// once (or, as its probe, the store's timeout bounds it).
	if took > 500*time.Millisecond {
		t.Errorf("/readyz without Redis took %v", took)
	}
	if _, m := get(t, "http://"+admin+"/metrics"); !strings.Contains(m, "tether_redis_up 0") || !strings.Contains(m, "tether_redis_breaker_opens_total 1") {
		t.Errorf("/metrics without Redis: want tether_redis_up 0 and one breaker opening:\n%s", grepLines(m, "tether_redis"))
	}

	// A request is placed without Redis.
	conn, err := grpc.NewClient(extproc, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	hm := func(k, v string) *extprocv3.HttpHeaders {
		return &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: k, RawValue: []byte(v)}}}}
	}
	start := time.Now()
	if err := st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: hm("x-session-id", "s")}}); err != nil {
		t.Fatal(err)
	}
	resp, err := st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if got := string(resp.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders()[0].GetHeader().GetRawValue()); got != "inst-a" {
		t.Errorf("routed to %q without Redis, want inst-a", got)
	}
	t.Logf("request placed in %v without Redis", time.Since(start))
	if err := st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: hm(":status", "200")}}); err != nil {
		t.Fatal(err)
	}
	if resp, err = st.Recv(); err != nil {
		t.Fatal(err)
	}
	if hs := resp.GetResponseHeaders().GetResponse().GetHeaderMutation().GetSetHeaders(); len(hs) != 2 || string(hs[1].GetHeader().GetRawValue()) != "degraded" {
		t.Errorf("decision without Redis: %v, want degraded", hs)
	}
	_ = st.CloseSend()

	// Redis comes up: tether uses it without a restart.
	r.Start()
	deadline := time.Now().Add(20 * time.Second)
	for {
		code, body, _ := readyz(t, admin)
		if code == http.StatusOK && cmp.Equal(body, map[string]string{"status": "ready", "store": "ok", "breaker": "closed", "hits": "cached"}) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/readyz after Redis started: %d %v", code, body)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if _, m := get(t, "http://"+admin+"/metrics"); !strings.Contains(m, "tether_redis_up 1") || !strings.Contains(m, "tether_redis_breaker_opens_total 1") {
		t.Errorf("/metrics after Redis started:\n%s", grepLines(m, "tether_redis"))
	}
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
}

// grepLines returns the lines of s that contain sub.
func grepLines(s, sub string) string {
	var out []string
	for line := range strings.Lines(s) {
		if strings.Contains(line, sub) {
			out = append(out, strings.TrimRight(line, "\n"))
		}
	}
	return strings.Join(out, "\n")
}
