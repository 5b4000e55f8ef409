package bench

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/lab/emulator"
)

// simFleet runs emulated instances in this process. An instance can be
// killed (its listener and connections closed at once, as when a GPU node
// dies) and restored on the same address with an empty KV cache, as a
// restarted model server has.
type simFleet struct {
	mu      sync.Mutex
	model   func(name string) (emulator.LatencyModel, error)
	servers map[string]*simServer
	order   []string
	// depths holds, per instance, the queue depth each of its completion
	// answers reported (x-queue-depth) since the last reset: what adaptive
	// routing reads, and how the load spread.
	depths map[string][]int
	// headers: the answers keep the emulator-only load headers.
	headers atomic.Bool
	// engine is the engine the instances imitate (emulator.EngineVLLM
	// when empty).
	engine string
}

// tap reads the queue depth an answer reports as its headers are written,
// and strips the emulator-only headers when strip is set.
type tap struct {
	http.ResponseWriter
	strip  bool
	record func(queueDepth string)
	wrote  bool
}

func (t *tap) WriteHeader(code int) {
	if !t.wrote {
		t.wrote = true
		h := t.ResponseWriter.Header()
		t.record(h.Get(emulator.QueueDepthHeader))
		if t.strip {
			h.Del(emulator.QueueDepthHeader)
			h.Del(emulator.GPUUtilizationHeader)
		}
	}
	t.ResponseWriter.WriteHeader(code)
}

func (t *tap) Write(b []byte) (int, error) {
	if !t.wrote {
		t.WriteHeader(http.StatusOK)
	}
	return t.ResponseWriter.Write(b)
}

// Unwrap lets http.ResponseController reach the connection's writer.
func (t *tap) Unwrap() http.ResponseWriter { return t.ResponseWriter }

// Flush keeps streamed answers streaming.
func (t *tap) Flush() {
	if !t.wrote {
		t.WriteHeader(http.StatusOK)
	}
	if f, ok := t.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

type simServer struct {
	cfg config.Instance
	srv *http.Server
	ln  net.Listener
}

func newSimFleet(model func(name string) (emulator.LatencyModel, error)) *simFleet {
	return &simFleet{model: model, servers: map[string]*simServer{}, depths: map[string][]int{}}
}

// fleetVersion is the version every instance of a fleet serves, and so
// the model its engine names.
const fleetVersion = "v1"

// add starts an instance on a free loopback port; zone is for the tether
// config it returns, where it serves fleetVersion.
func (f *simFleet) add(name, zone string) (config.Instance, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return config.Instance{}, err
	}
	in := config.Instance{Name: name, Address: ln.Addr().String(), Zone: zone, Version: fleetVersion, Weight: 1}
	if err := f.serve(in, ln); err != nil {
		return config.Instance{}, errors.Join(err, ln.Close())
	}
	f.mu.Lock()
	f.order = append(f.order, name)
	f.mu.Unlock()
	return in, nil
}

func (f *simFleet) serve(in config.Instance, ln net.Listener) error {
	m, err := f.model(in.Name)
	if err != nil {
		return err
	}
	// The instance serves its version as its model, as tether's config
	// names it, and its engine's paths and /metrics. It always adds the
	// emulator-only x-queue-depth header, because the spread report reads
	// it here; the tap removes it (and x-gpu-utilization) before the answer
	// leaves, unless the fleet reports headers (the header-signals row).
	h, err := emulator.NewHandler(emulator.Instance{Name: in.Name, LatencyModel: m, Model: in.Version, Engine: f.engine, ReportHeaders: true})
	if err != nil {
		return err
	}
	probe := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.ServeHTTP(&tap{ResponseWriter: w, strip: !f.headers.Load(), record: func(v string) {
			if d, err := strconv.Atoi(v); err == nil {
				f.mu.Lock()
				f.depths[in.Name] = append(f.depths[in.Name], d)
				f.mu.Unlock()
			}
		}}, r)
	})
	s := &simServer{cfg: in, ln: ln, srv: &http.Server{Handler: probe, ReadHeaderTimeout: 10 * time.Second}}
	go func() { _ = s.srv.Serve(ln) }()
	f.mu.Lock()
	f.servers[in.Name] = s
	f.mu.Unlock()
	return nil
}

// kill closes the instance's listener and every connection at once.
func (f *simFleet) kill(name string) error {
	f.mu.Lock()
	s, ok := f.servers[name]
	f.mu.Unlock()
	if !ok || s.srv == nil {
		return fmt.Errorf("kill %s: not running", name)
	}
	err := s.srv.Close()
	f.mu.Lock()
	s.srv = nil
	f.mu.Unlock()
	return err
}

// restore starts a killed instance again on its address, cache empty.
func (f *simFleet) restore(name string) error {
	f.mu.Lock()
	s, ok := f.servers[name]
	f.mu.Unlock()
	if !ok || s.srv != nil {
		return fmt.Errorf("restore %s: not killed", name)
	}
	var ln net.Listener
	var err error
	// The port was ours a moment ago; the kernel may hold it briefly.
	for i := 0; i < 50; i++ {
		if ln, err = net.Listen("tcp", s.cfg.Address); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		return fmt.Errorf("restore %s: %w", name, err)
	}
	return f.serve(s.cfg, ln)
}

// reset empties every running instance's cache and counters.
func (f *simFleet) reset(ctx context.Context) error {
	f.mu.Lock()
	f.depths = map[string][]int{}
	f.mu.Unlock()
	var errs []error
	for _, in := range f.instances() {
		errs = append(errs, postJSON(ctx, "http://"+in.Address+"/admin/reset", nil))
	}
	return errors.Join(errs...)
}

// stats sums the running instances' counters.
func (f *simFleet) stats(ctx context.Context) ([]emulator.Stats, error) {
	var out []emulator.Stats
	for _, in := range f.instances() {
		var s emulator.Stats
		if err := getJSON(ctx, "http://"+in.Address+"/admin/stats", &s); err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, nil
}

// queueDepths returns, per instance, the queue depths its answers reported
// since the last reset.
func (f *simFleet) queueDepths() map[string][]int {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make(map[string][]int, len(f.depths))
	for in, d := range f.depths {
		out[in] = append([]int(nil), d...)
	}
	return out
}

func (f *simFleet) instances() []config.Instance {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []config.Instance
	for _, n := range f.order {
		if s := f.servers[n]; s.srv != nil {
			out = append(out, s.cfg)
		}
	}
	return out
}

func (f *simFleet) close() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, s := range f.servers {
		if s.srv != nil {
			_ = s.srv.Close()
		}
	}
}
