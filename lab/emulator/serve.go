package emulator

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/rs/zerolog"
)

// ShutdownTimeout bounds the graceful shutdown of Serve: requests still
// running after it are cut off.
const ShutdownTimeout = 5 * time.Second

// Serve serves h on ln until ctx ends, then shuts down gracefully: it stops
// accepting, lets running requests finish for up to ShutdownTimeout, then
// closes what is left. It returns nil after a shutdown caused by ctx, and an
// error when serving fails or the graceful shutdown timed out. ln is closed
// in every case.
func Serve(ctx context.Context, ln net.Listener, h http.Handler) error {
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()

	select {
	case err := <-served:
		return fmt.Errorf("emulator: serve %s: %w", ln.Addr(), err)
	case <-ctx.Done():
	}

	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ShutdownTimeout)
	defer cancel()
	err := srv.Shutdown(sctx)
	if err != nil {
		// Closing the connections also cancels the contexts of the requests
		// still running, which ends their latency wait.
		_ = srv.Close()
	}
	_ = <-served // http.ErrServerClosed once Shutdown or Close has run
	if err != nil {
		return fmt.Errorf("emulator: graceful shutdown of %s: %w", ln.Addr(), err)
	}
	return nil
}

// Spec names one instance and the address it listens on.
type Spec struct {
	Name string
	Addr string // host:port; port 0 picks a free port
	// Model is the instance's served model name (Instance.Model); empty
	// means the one WithServedModel gives, or DefaultModel.
	Model string
}

// ParseSpec parses NAME=HOST:PORT, the form of the --instance flag.
func ParseSpec(s string) (Spec, error) {
	name, addr, ok := strings.Cut(s, "=")
	if !ok || name == "" || addr == "" {
		return Spec{}, fmt.Errorf("emulator: instance %q: want NAME=HOST:PORT", s)
	}
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return Spec{}, fmt.Errorf("emulator: instance %q: address %q: %w", s, addr, err)
	}
	if _, err := strconv.ParseUint(port, 10, 16); err != nil {
		return Spec{}, fmt.Errorf("emulator: instance %q: port %q is not a number from 0 to 65535", s, port)
	}
	return Spec{Name: name, Addr: addr}, nil
}

// Option tunes ServeAll.
type Option func(*serveConfig)

type serveConfig struct {
	template         Instance // Name is taken from each Spec
	newModel         func(name string) (LatencyModel, error)
	allowNonLoopback bool
	onListen         func(name string, addr net.Addr)
}

// WithLatency sets the fixed latency of every instance (default
// DefaultLatency).
func WithLatency(d time.Duration) Option {
	return func(c *serveConfig) { c.template.Latency = d }
}

// WithModelFactory gives each instance its own latency model, made by
// newModel with the instance's name: the way to serve a fleet of GPU models,
// each with its own KV cache. It replaces WithLatency.
func WithModelFactory(newModel func(name string) (LatencyModel, error)) Option {
	return func(c *serveConfig) { c.newModel = newModel }
}

// WithEngine sets the engine whose metrics every instance serves on
// GET /metrics (Instance.Engine): EngineVLLM (the default) or
// EngineSGLang.
func WithEngine(engine string) Option {
	return func(c *serveConfig) { c.template.Engine = engine }
}

// WithReportHeaders makes every instance send the emulator-only load
// headers (Instance.ReportHeaders: x-queue-depth, x-gpu-utilization).
func WithReportHeaders() Option {
	return func(c *serveConfig) { c.template.ReportHeaders = true }
}

// WithLogger sets the logger: one info line per instance at start, one
// debug line per request, each with an "instance" field.
func WithLogger(l zerolog.Logger) Option {
	return func(c *serveConfig) { c.template.Logger = l }
}

// AllowNonLoopback lets ServeAll listen on addresses other than loopback
// ones, for example 0.0.0.0 inside a container.
func AllowNonLoopback() Option {
	return func(c *serveConfig) { c.allowNonLoopback = true }
}

// ServeAll serves one emulated instance per spec, each on its own address,
// from one process. It opens every listener first (and opens none when one
// fails), then serves until ctx ends or one instance fails; then it shuts
// every instance down (see Serve) and returns. It returns nil when ctx
// ended, otherwise the failures.
//
// Addresses must be loopback (127.0.0.0/8, ::1 or localhost) unless
// AllowNonLoopback is given: the emulator is a test tool that answers anyone
// with made-up completions, so listening on a reachable interface must be a
// deliberate choice, never the result of a typo such as ":8000".
func ServeAll(ctx context.Context, specs []Spec, opts ...Option) error {
	var cfg serveConfig
	for _, o := range opts {
		o(&cfg)
	}
	if len(specs) == 0 {
		return errors.New("emulator: no instances to serve")
	}

	handlers := make([]http.Handler, len(specs))
	seen := make(map[string]bool, len(specs))
	for i, sp := range specs {
		in := cfg.template
		in.Name = sp.Name
		if sp.Model != "" {
			in.Model = sp.Model
		}
		if seen[sp.Name] {
			return fmt.Errorf("emulator: instance name %q is used twice", sp.Name)
		}
		seen[sp.Name] = true
		if cfg.newModel != nil {
			m, err := cfg.newModel(sp.Name)
			if err != nil {
				return fmt.Errorf("emulator: instance %q: %w", sp.Name, err)
			}
			in.LatencyModel, in.Latency = m, 0
		}
		h, err := NewHandler(in)
		if err != nil {
			return err
		}
		handlers[i] = h
		if !cfg.allowNonLoopback {
			if err := checkLoopback(sp.Addr); err != nil {
				return fmt.Errorf("emulator: instance %q: %w", sp.Name, err)
			}
		}
	}

	listeners, err := listenAll(ctx, specs, cfg.allowNonLoopback)
	if err != nil {
		return err
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
	)
	for i, ln := range listeners {
		model := specs[i].Model
		if model == "" {
			model = cmp.Or(cfg.template.Model, DefaultModel)
		}
		cfg.template.Logger.Info().
			Str("instance", specs[i].Name).
			Str("addr", ln.Addr().String()).
			Str("model", model).
			Msg("emulated instance listening")
		if cfg.onListen != nil {
			cfg.onListen(specs[i].Name, ln.Addr())
		}
		wg.Go(func() {
			if err := Serve(ctx, ln, handlers[i]); err != nil {
				mu.Lock()
				errs = append(errs, fmt.Errorf("instance %q: %w", specs[i].Name, err))
				mu.Unlock()
				cancel()
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// listenAll opens one TCP listener per spec, or none.
func listenAll(ctx context.Context, specs []Spec, allowNonLoopback bool) ([]net.Listener, error) {
	var lc net.ListenConfig
	listeners := make([]net.Listener, 0, len(specs))
	closeAll := func() {
		for _, ln := range listeners {
			_ = ln.Close()
		}
	}
	for _, sp := range specs {
		ln, err := lc.Listen(ctx, "tcp", sp.Addr)
		if err != nil {
			closeAll()
			return nil, fmt.Errorf("emulator: instance %q: %w", sp.Name, err)
		}
		listeners = append(listeners, ln)
		// "localhost" is resolved by the system; check what it became.
		if tcp, ok := ln.Addr().(*net.TCPAddr); ok && !allowNonLoopback && !tcp.IP.IsLoopback() {
			closeAll()
			return nil, fmt.Errorf("emulator: instance %q: %s resolved to non-loopback %s", sp.Name, sp.Addr, tcp.IP)
		}
	}
	return listeners, nil
}

// checkLoopback accepts host:port addresses whose host is a loopback IP or
// "localhost".
func checkLoopback(addr string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("address %q: %w", addr, err)
	}
	if strings.EqualFold(host, "localhost") {
		return nil
	}
	if host == "" {
		return fmt.Errorf("address %q listens on every interface; give a loopback host such as 127.0.0.1, or allow non-loopback addresses", addr)
	}
	ip, err := netip.ParseAddr(host)
	if err != nil || !ip.Unmap().IsLoopback() {
		return fmt.Errorf("address %q is not a loopback address; use 127.0.0.1 or ::1, or allow non-loopback addresses", addr)
	}
	return nil
}
