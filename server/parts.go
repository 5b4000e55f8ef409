package server

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	accesslogv3 "github.com/envoyproxy/go-control-plane/envoy/service/accesslog/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/tetherproxy/tether/admin"
	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/discovery"
	"github.com/tetherproxy/tether/extproc"
	"github.com/tetherproxy/tether/metrics"
	"github.com/tetherproxy/tether/plan"
	"github.com/tetherproxy/tether/reload"
	"github.com/tetherproxy/tether/store"
	redisstore "github.com/tetherproxy/tether/store/redis"
	"github.com/tetherproxy/tether/xds"
)

// The components, each checked against the interface Run uses.
var (
	_ component = (*storePart)(nil)
	_ component = (*auditPart)(nil)
	_ component = (*reloadPart)(nil)
	_ component = (*loops)(nil)
	_ component = (*extprocServer)(nil)
	_ component = (*xdsServer)(nil)
	_ component = (*adminServer)(nil)
)

// storePart is the binding store, opened by openStore.
type storePart struct {
	st    store.Store
	redis *redisstore.Store // nil for the embedded store
}

// openStore opens the store. "embedded" is the memory store. A Redis
// store starts without Redis, its guard open, rather than fail: tether
// places requests without it and uses it once it answers.
func openStore(ctx context.Context, p plan.Store, rec *metrics.Metrics, reg prometheus.Registerer, log zerolog.Logger) (*storePart, error) {
	st, err := store.Open(ctx, p.URL, store.Options{
		Timeout: p.Timeout, OnIndexError: rec.IndexError, OnGuard: rec.RedisGuard,
		Cache: redisstore.CacheOptions{Enabled: p.Cache, Size: p.CacheSize,
			TTL: p.CacheTTL, FlushInterval: p.CacheFlushInterval, WriteBack: p.CacheWriteBack},
	})
	if err != nil {
		return nil, fmt.Errorf("binding store: %w", err)
	}
	s := &storePart{st: st}
	s.redis, _ = st.(*redisstore.Store)
	if s.redis != nil {
		// Said once at start, and in /readyz ("hits"): where a hit cannot
		// be cached, every sticky request costs a Redis round trip.
		if mode, why := s.redis.Hits(); why != "" {
			log.Info().Str("hits", mode).Str("why", why).Msg("sticky hits: one Redis round trip each")
		} else {
			log.Info().Str("hits", mode).Msg("sticky hits: served from the replica's cache, invalidated by Redis messages")
		}
		registerHitCache(reg, s.redis)
	}
	return s, nil
}

func (*storePart) Name() string                 { return "binding store" }
func (*storePart) Start(context.Context)        {}
func (s *storePart) Stop(context.Context) error { return s.st.Close() }

// loops run functions in the background from Start until Stop, which
// waits for them. They ignore the end of Start's context: a stopping
// replica keeps them through the lame duck and the settle.
type loops struct {
	name   string
	runs   []func(context.Context)
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

func (l *loops) add(run func(context.Context)) { l.runs = append(l.runs, run) }

func (l *loops) Name() string { return l.name }

func (l *loops) Start(ctx context.Context) {
	ctx, l.cancel = context.WithCancel(context.WithoutCancel(ctx))
	for _, run := range l.runs {
		l.wg.Go(func() { run(ctx) })
	}
}

func (l *loops) Stop(context.Context) error {
	if l.cancel != nil {
		l.cancel()
	}
	l.wg.Wait()
	return nil
}

// reloadPart is live reload: the runtime, which applied the start's
// configuration, and the watch of the configuration file.
type reloadPart struct {
	rt *reload.Runtime
	loops
}

// newReload applies cfg and publishes it to Envoy. self is this replica's
// ext_proc address; ads is nil when the ADS server is off. With
// [[discovery.dns]] groups (the plan's), it resolves them first, so the start has what
// they find, and returns the discovery that follows them (nil without).
func newReload(ctx context.Context, cfg config.Config, groups []config.DNSGroup, self string, ads *xds.Server, opts Options, reg prometheus.Registerer) (*reloadPart, *loops, error) {
	rt := reload.New(self, ads, opts.Logger, reg)
	found := &loops{name: "dns discovery"}
	if len(groups) > 0 {
		d := discovery.NewDNS(groups, discovery.Options{Sink: rt, Log: opts.Logger}, reg)
		d.Prime(ctx)
		found.add(d.Run)
	}
	if _, err := rt.Apply(ctx, cfg, "start"); err != nil {
		return nil, nil, err
	}
	r := &reloadPart{rt: rt, loops: loops{name: "reload"}}
	if path := opts.ConfigPath; path != "" {
		r.add(func(ctx context.Context) {
			if err := rt.WatchFile(ctx, path, opts.Overrides); err != nil {
				opts.Logger.Error().Err(err).Msg("config file not watched; changes need a restart or the admin API")
			}
		})
	}
	return r, found, nil
}

// extprocServer serves ext_proc, Envoy's access log and gRPC health.
type extprocServer struct {
	gs     *grpc.Server
	health *health.Server
	l      net.Listener
	proc   *extproc.Server
	others interface{ Replicas() int }
	idle   func() bool
	errc   chan<- error
	log    zerolog.Logger
}

func newExtprocServer(l net.Listener, creds []grpc.ServerOption, proc *extproc.Server, c *core, errc chan<- error, log zerolog.Logger) *extprocServer {
	s := &extprocServer{
		gs: grpc.NewServer(append(extprocServerOptions(), creds...)...), health: health.NewServer(),
		l: l, proc: proc, others: c.load, errc: errc, log: log,
	}
	extprocv3.RegisterExternalProcessorServer(s.gs, proc)
	accesslogv3.RegisterAccessLogServiceServer(s.gs, proc.AccessLog())
	healthpb.RegisterHealthServer(s.gs, s.health)
	for _, name := range healthServices {
		s.health.SetServingStatus(name, healthpb.HealthCheckResponse_SERVING)
	}
	// No request this replica routed is still running when every engine,
	// read a second or more after its last decision, serves and queues
	// nothing: the ends still pending then will not come (a request its
	// client cancelled while tether decided is logged without its ticket).
	s.idle = func() bool {
		return c.load.EnginesIdle(c.fleet.All(), proc.LastDecision().Add(time.Second))
	}
	return s
}

// healthServices are the gRPC health services tether answers for besides
// the server as a whole (""): those a gateway's endpoint picker answers
// for (the Inference Extension's endpoint picker protocol).
var healthServices = []string{"liveness", "readiness", extprocv3.ExternalProcessor_ServiceDesc.ServiceName}

// drain reports the replica down to gRPC health checks: every service but
// liveness. The process is alive while it drains.
func (s *extprocServer) drain() {
	for _, name := range append([]string{""}, healthServices...) {
		if name != "liveness" {
			s.health.SetServingStatus(name, healthpb.HealthCheckResponse_NOT_SERVING)
		}
	}
}

func (s *extprocServer) Name() string { return "ext_proc server" }

func (s *extprocServer) Start(context.Context) {
	go func() { s.errc <- serveErr(s.Name(), s.gs.Serve(s.l)) }()
}

// Stop settles (settle), then stops the server, cutting what is open.
func (s *extprocServer) Stop(ctx context.Context) error {
	settle(ctx, s.proc, s.others, s.idle, s.log)
	s.gs.Stop()
	_ = s.l.Close() // closed already, unless Serve never ran
	return nil
}

// xdsServer is the ADS server Envoy takes its resources from. With no
// listener it is off: its fields are nil and it does nothing.
type xdsServer struct {
	ads   *xds.Server
	gs    *grpc.Server
	l     net.Listener
	close context.CancelFunc // ends the ADS streams, which never end by themselves
	errc  chan<- error
}

func newXDS(l net.Listener, creds []grpc.ServerOption, errc chan<- error, reg prometheus.Registerer, log zerolog.Logger) *xdsServer {
	if l == nil {
		return &xdsServer{}
	}
	ctx, cancel := context.WithCancel(context.Background())
	x := &xdsServer{ads: xds.NewServer(ctx, log, reg), gs: grpc.NewServer(creds...), l: l, close: cancel, errc: errc}
	x.ads.Register(x.gs)
	return x
}

func (x *xdsServer) Name() string { return "xds server" }

func (x *xdsServer) Start(context.Context) {
	if x.gs != nil {
		go func() { x.errc <- serveErr(x.Name(), x.gs.Serve(x.l)) }()
	}
}

// Stop ends the streams, lets the server finish what it sends, and cuts
// it when ctx ends.
func (x *xdsServer) Stop(ctx context.Context) error {
	if x.gs == nil {
		return nil
	}
	x.close()
	done := make(chan struct{})
	go func() { x.gs.GracefulStop(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
		x.gs.Stop()
		<-done
	}
	_ = x.l.Close() // closed already, unless Serve never ran
	return nil
}

// adminServer serves the admin HTTP API: health, readiness, metrics, the
// sessions and the runtime configuration.
type adminServer struct {
	http  *http.Server
	l     net.Listener
	ready *admin.Readiness
	errc  chan<- error
}

func (a *adminServer) Name() string { return "admin server" }

func (a *adminServer) Start(context.Context) {
	go func() { a.errc <- serveErr(a.Name(), a.http.Serve(a.l)) }()
}

// Stop lets requests in flight finish, until ctx ends.
func (a *adminServer) Stop(ctx context.Context) error {
	err := a.http.Shutdown(ctx)
	_ = a.l.Close() // closed already, unless Serve never ran
	return err
}

// listeners are tether's sockets, opened before anything serves so a busy
// port fails the start cleanly.
type listeners struct {
	extproc, admin, xds net.Listener // xds is nil when the ADS server is off
}

func listen(at plan.Listen) (*listeners, error) {
	ls := &listeners{}
	var err error
	if ls.extproc, err = net.Listen("tcp", at.ExtProc); err != nil {
		return nil, fmt.Errorf("ext_proc listener: %w", err)
	}
	if ls.admin, err = net.Listen("tcp", at.Admin); err != nil {
		ls.close()
		return nil, fmt.Errorf("admin listener: %w", err)
	}
	if at.XDS != "" {
		if ls.xds, err = net.Listen("tcp", at.XDS); err != nil {
			ls.close()
			return nil, fmt.Errorf("xds listener: %w", err)
		}
	}
	return ls, nil
}

// close closes every listener still open, when the start fails.
func (ls *listeners) close() {
	for _, l := range []net.Listener{ls.extproc, ls.admin, ls.xds} {
		if l != nil {
			_ = l.Close()
		}
	}
}
