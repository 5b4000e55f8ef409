package emulator

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/goleak"
)

// waitErr waits up to 10s for errc.
func waitErr(t *testing.T, errc <-chan error, what string) error {
	t.Helper()
	select {
	case err := <-errc:
		return err
	case <-time.After(10 * time.Second):
		t.Fatalf("%s did not return within 10s", what)
		return nil
	}
}

// get sends a GET with its own client, closed afterwards so no connection
// outlives the test.
func get(t *testing.T, url string) (*http.Response, []byte) {
	t.Helper()
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	req, err := http.NewRequestWithContext(t.Context(), "GET", url, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, b
}

func listen(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return ln
}

func TestServeStopsWhenContextEnds(t *testing.T) {
	h, err := NewHandler(Instance{Name: "a"})
	if err != nil {
		t.Fatal(err)
	}
	ln := listen(t)
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- Serve(ctx, ln, h) }()

	resp, _ := get(t, "http://"+ln.Addr().String()+"/healthz")
	if resp.StatusCode != http.StatusOK || resp.Header.Get(InstanceHeader) != "a" {
		t.Fatalf("healthz: %d, %s=%q", resp.StatusCode, InstanceHeader, resp.Header.Get(InstanceHeader))
	}
	cancel()
	if err := waitErr(t, errc, "Serve"); err != nil {
		t.Fatalf("Serve after cancel = %v, want nil", err)
	}
	if _, err := ln.Accept(); !errors.Is(err, net.ErrClosed) {
		t.Errorf("listener still open after Serve returned: Accept = %v", err)
	}
}

func TestServeFinishesRunningRequests(t *testing.T) {
	started := make(chan struct{}, 1)
	h, err := NewHandler(Instance{Name: "a", LatencyModel: signalModel{started, 200 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	ln := listen(t)
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- Serve(ctx, ln, h) }()

	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	type result struct {
		status int
		body   string
		err    error
	}
	resc := make(chan result, 1)
	go func() {
		resp, err := (&http.Client{Transport: tr}).Post("http://"+ln.Addr().String()+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"hi"}`))
		if err != nil {
			resc <- result{err: err}
			return
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		resc <- result{resp.StatusCode, string(b), err}
	}()
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("request never reached the instance")
	}
	cancel() // shut down while the request is in its latency wait
	var r result
	select {
	case r = <-resc:
	case <-time.After(10 * time.Second):
		t.Fatal("in-flight request did not finish")
	}
	if r.err != nil || r.status != http.StatusOK || !strings.Contains(r.body, "served by a") {
		t.Errorf("in-flight request during shutdown: %d %q %v; want 200 served by a", r.status, r.body, r.err)
	}
	if err := waitErr(t, errc, "Serve"); err != nil {
		t.Errorf("Serve = %v, want nil", err)
	}
}

// signalModel reports each request on a channel and waits d.
type signalModel struct {
	started chan<- struct{}
	d       time.Duration
}

func (m signalModel) Cost(Request) Cost {
	m.started <- struct{}{}
	return Cost{Wait: m.d}
}

func TestServeReturnsWhenTheListenerFails(t *testing.T) {
	h, err := NewHandler(Instance{Name: "a"})
	if err != nil {
		t.Fatal(err)
	}
	ln := listen(t)
	errc := make(chan error, 1)
	go func() { errc <- Serve(t.Context(), ln, h) }()
	_ = ln.Close() // Accept fails for good
	if err := waitErr(t, errc, "Serve"); err == nil || !errors.Is(err, net.ErrClosed) {
		t.Errorf("Serve on a failed listener = %v, want an error wrapping net.ErrClosed", err)
	}
}

func TestServeAll(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())

	type bound struct{ name, addr string }
	boundc := make(chan bound, 2)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	errc := make(chan error, 1)
	specs := []Spec{{Name: "gpu-a", Addr: "127.0.0.1:0", Model: "v1"}, {Name: "gpu-b", Addr: "localhost:0"}}
	models := map[string]string{"gpu-a": "v1", "gpu-b": "fleet-model"}
	go func() {
		errc <- ServeAll(ctx, specs,
			WithLatency(time.Millisecond),
			WithEngine(EngineSGLang),
			WithServedModel("fleet-model"),
			WithReportHeaders(),
			OnListen(func(name string, addr net.Addr) { boundc <- bound{name, addr.String()} }))
	}()

	got := map[string]string{}
	for range specs {
		select {
		case b := <-boundc:
			got[b.name] = b.addr
		case err := <-errc:
			t.Fatalf("ServeAll returned early: %v", err)
		case <-time.After(10 * time.Second):
			t.Fatal("instances did not start within 10s")
		}
	}
	if got["gpu-a"] == got["gpu-b"] || len(got) != 2 {
		t.Fatalf("bound addresses %v, want two distinct", got)
	}
	for _, sp := range specs {
		resp, body := get(t, "http://"+got[sp.Name]+"/healthz")
		var hz health
		if err := json.Unmarshal(body, &hz); err != nil {
			t.Fatal(err)
		}
		if diff := cmp.Diff(health{Status: "ok", Instance: sp.Name}, hz); diff != "" || resp.Header.Get(InstanceHeader) != sp.Name {
			t.Errorf("%s at %s: %s=%q, healthz (-want +got):\n%s", sp.Name, got[sp.Name], InstanceHeader, resp.Header.Get(InstanceHeader), diff)
		}
		_, body = get(t, "http://"+got[sp.Name]+"/v1/models")
		var list modelList
		if err := json.Unmarshal(body, &list); err != nil || len(list.Data) != 1 || list.Data[0].ID != models[sp.Name] {
			t.Errorf("%s: /v1/models %s (%v), want %s", sp.Name, body, err, models[sp.Name])
		}
		if _, body = get(t, "http://"+got[sp.Name]+"/metrics"); !strings.Contains(string(body), `sglang:num_running_reqs{engine_type="unified",model_name="`+models[sp.Name]+`"`) {
			t.Errorf("%s: /metrics is not SGLang's for %s:\n%s", sp.Name, models[sp.Name], body)
		}
		resp, err := http.Post("http://"+got[sp.Name]+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"hi"}`))
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		if resp.Header.Get(QueueDepthHeader) != "0" {
			t.Errorf("%s: %s = %q with WithReportHeaders", sp.Name, QueueDepthHeader, resp.Header.Get(QueueDepthHeader))
		}
	}

	cancel()
	if err := waitErr(t, errc, "ServeAll"); err != nil {
		t.Fatalf("ServeAll after cancel = %v, want nil", err)
	}
	for name, addr := range got {
		if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
			_ = c.Close()
			t.Errorf("%s still accepts connections on %s after ServeAll returned", name, addr)
		}
	}
}

func TestServeAllWithModelFactory(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	made := map[string]*GPU{}
	var mu sync.Mutex
	boundc := make(chan string, 2)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	errc := make(chan error, 1)
	go func() {
		errc <- ServeAll(ctx, []Spec{{Name: "gpu-a", Addr: "127.0.0.1:0"}, {Name: "gpu-b", Addr: "127.0.0.1:0"}},
			WithModelFactory(func(name string) (LatencyModel, error) {
				g, err := NewGPU(GPUConfig{Profile: ProfileH200(), TimeScale: 0.001})
				mu.Lock()
				defer mu.Unlock()
				made[name] = g
				return g, err
			}),
			OnListen(func(_ string, addr net.Addr) { boundc <- addr.String() }))
	}()
	for range 2 {
		select {
		case addr := <-boundc:
			_, b := get(t, "http://"+addr+"/admin/stats")
			var s Stats
			if err := json.Unmarshal(b, &s); err != nil || s.Model == nil || s.Model.Profile != "h200" {
				t.Errorf("%s: stats %s (%v)", addr, b, err)
			}
		case err := <-errc:
			t.Fatalf("ServeAll returned early: %v", err)
		case <-time.After(10 * time.Second):
			t.Fatal("instances did not start")
		}
	}
	mu.Lock()
	if len(made) != 2 || made["gpu-a"] == made["gpu-b"] {
		t.Errorf("one model per instance: %v", made)
	}
	mu.Unlock()
	cancel()
	if err := waitErr(t, errc, "ServeAll"); err != nil {
		t.Fatal(err)
	}

	err := ServeAll(t.Context(), []Spec{{Name: "a", Addr: "127.0.0.1:0"}},
		WithModelFactory(func(string) (LatencyModel, error) { return nil, errors.New("no GPU") }))
	if err == nil || !strings.Contains(err.Error(), `instance "a": no GPU`) {
		t.Errorf("failing factory: %v", err)
	}
}

func TestServeAllRefuses(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	busy := listen(t)
	defer busy.Close()

	tests := []struct {
		name  string
		specs []Spec
		opts  []Option
		want  string
	}{
		{"no instances", nil, nil, "no instances"},
		{"every interface, IPv4", []Spec{{Name: "a", Addr: "0.0.0.0:0"}}, nil, "not a loopback address"},
		{"every interface, IPv6", []Spec{{Name: "a", Addr: "[::]:0"}}, nil, "not a loopback address"},
		{"every interface, empty host", []Spec{{Name: "a", Addr: ":0"}}, nil, "every interface"},
		{"private address", []Spec{{Name: "a", Addr: "10.1.2.3:8000"}}, nil, "not a loopback address"},
		{"host name", []Spec{{Name: "a", Addr: "example.com:80"}}, nil, "not a loopback address"},
		{"second instance non-loopback", []Spec{{Name: "a", Addr: "127.0.0.1:0"}, {Name: "b", Addr: "192.168.1.1:0"}}, nil, `instance "b"`},
		{"no port", []Spec{{Name: "a", Addr: "127.0.0.1"}}, nil, "missing port"},
		{"empty name", []Spec{{Name: "", Addr: "127.0.0.1:0"}}, nil, "name is empty"},
		{"duplicate name", []Spec{{Name: "a", Addr: "127.0.0.1:0"}, {Name: "a", Addr: "127.0.0.1:0"}}, nil, "used twice"},
		{"negative latency", []Spec{{Name: "a", Addr: "127.0.0.1:0"}}, []Option{WithLatency(-time.Second)}, "negative"},
		{"unknown engine", []Spec{{Name: "a", Addr: "127.0.0.1:0"}}, []Option{WithEngine("tgi")}, `engine "tgi"`},
		{"bad model name", []Spec{{Name: "a", Addr: "127.0.0.1:0", Model: "a\tb"}}, nil, "control character"},
		{"address in use: the others are closed", []Spec{{Name: "a", Addr: "127.0.0.1:0"}, {Name: "b", Addr: busy.Addr().String()}}, nil, "address already in use"},
		// With AllowNonLoopback the loopback check is skipped; 192.0.2.1
		// (TEST-NET-1) is on no interface, so listening itself fails.
		{"allowed non-loopback reaches listen", []Spec{{Name: "a", Addr: "192.0.2.1:0"}}, []Option{AllowNonLoopback()}, "assign requested address"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			errc := make(chan error, 1)
			go func() { errc <- ServeAll(t.Context(), tc.specs, tc.opts...) }()
			err := waitErr(t, errc, "ServeAll")
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("ServeAll(%v) = %v, want error containing %q", tc.specs, err, tc.want)
			}
		})
	}
}

func TestParseSpec(t *testing.T) {
	tests := []struct {
		in      string
		want    Spec
		wantErr string
	}{
		{in: "gpu-a=127.0.0.1:8001", want: Spec{Name: "gpu-a", Addr: "127.0.0.1:8001"}},
		{in: "b=[::1]:0", want: Spec{Name: "b", Addr: "[::1]:0"}},
		{in: "c=localhost:9000", want: Spec{Name: "c", Addr: "localhost:9000"}},
		{in: "gpu-a", wantErr: "want NAME=HOST:PORT"},
		{in: "=127.0.0.1:1", wantErr: "want NAME=HOST:PORT"},
		{in: "a=", wantErr: "want NAME=HOST:PORT"},
		{in: "a=127.0.0.1", wantErr: "missing port"},
		{in: "a=127.0.0.1:http", wantErr: "not a number"},
		{in: "a=127.0.0.1:65536", wantErr: "not a number"},
		{in: "a=127.0.0.1:-1", wantErr: "not a number"},
	}
	for _, tc := range tests {
		t.Run(tc.in, func(t *testing.T) {
			got, err := ParseSpec(tc.in)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("ParseSpec(%q) = %v, %v; want error containing %q", tc.in, got, err, tc.wantErr)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("ParseSpec(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
			}
		})
	}
}

// WithServedModel sets the served model name of the instances whose Spec
// names none (Instance.Model; default DefaultModel).
func WithServedModel(model string) Option {
	return func(c *serveConfig) { c.template.Model = model }
}

// OnListen calls fn once per instance with the address it listens on, after
// the listener is open and before it serves. With port 0 this is how a caller
// learns the port.
func OnListen(fn func(name string, addr net.Addr)) Option {
	return func(c *serveConfig) { c.onListen = fn }
}
