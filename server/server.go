// Package server assembles a running tether from a configuration and runs
// it: the binding store, the routing audit (audit/sinks), live reload
// (reload, which translates the configuration with plan), the decider, the
// ext_proc and ADS gRPC servers, the admin HTTP API (admin), and the
// background loops that share load and circuits between replicas; then the
// lame-duck delay and the drain. cmd/tether parses flags and calls Run.
package server

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	accesslogv3 "github.com/envoyproxy/go-control-plane/envoy/service/accesslog/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/tetherproxy/tether/admin"
	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/extproc"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/metrics"
	"github.com/tetherproxy/tether/plan"
	"github.com/tetherproxy/tether/prefix"
	"github.com/tetherproxy/tether/reload"
	"github.com/tetherproxy/tether/replicas"
	"github.com/tetherproxy/tether/store"
	redisstore "github.com/tetherproxy/tether/store/redis"
	"github.com/tetherproxy/tether/xds"
)

// Options are what Run needs besides the configuration.
type Options struct {
	Logger zerolog.Logger
	// ConfigPath, when set, is watched: a change to the file updates the
	// fleet and the Envoy resources while tether runs.
	ConfigPath string
	// Overrides re-applies command-line flags to every configuration read
	// from ConfigPath, so a reload does not undo them.
	Overrides func(*config.Config)
	// WrapRegisterer, when set, wraps the registerer every collector is
	// registered with (tests list tether's metrics through it); /metrics
	// serves what reaches the registry underneath.
	WrapRegisterer func(prometheus.Registerer) prometheus.Registerer
}

// Run serves until ctx ends, then reports itself down while still serving
// for server.drain_delay, serves on until it has heard the end of every
// request it routed (settle, bounded by server.drain_timeout) and returns. It returns an error only when tether
// cannot start or a listener fails.
//
// cfg has passed config.Validate. Run hands it to reload, which keeps it in
// force, and reads what it runs with from its translation (plan); only the
// identity secret and the admin token are read from where cfg names them.
func Run(ctx context.Context, cfg config.Config, opts Options) error {
	log := opts.Logger
	p, err := plan.FromConfig(cfg, plan.Options{})
	if err != nil {
		return err
	}
	secret, err := identitySecret(cfg.Identity, p.Store.URL, log)
	if err != nil {
		return err
	}

	registry := prometheus.NewRegistry()
	var reg prometheus.Registerer = registry
	if opts.WrapRegisterer != nil {
		reg = opts.WrapRegisterer(registry)
	}
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	creds, err := reload.GRPCCredentials(p.TLS, log, reg) // none when [tls] is off
	if err != nil {
		return err
	}
	adminToken, err := cfg.Server.AdminToken() // "" when none is set
	if err != nil {
		return fmt.Errorf("admin: %w", err)
	}
	rec := metrics.New(reg)
	// "embedded" is the memory store; a Redis store starts without Redis
	// (its guard open) rather than fail: tether places requests without it
	// and uses it once it answers.
	st, err := store.Open(ctx, p.Store.URL, store.Options{
		Timeout: p.Store.Timeout, OnIndexError: rec.IndexError, OnGuard: rec.RedisGuard,
		Cache: redisstore.CacheOptions{Enabled: p.Store.Cache, Size: p.Store.CacheSize,
			TTL: p.Store.CacheTTL, FlushInterval: p.Store.CacheFlushInterval, WriteBack: p.Store.CacheWriteBack},
	})
	if err != nil {
		return fmt.Errorf("binding store: %w", err)
	}
	defer func() {
		if err := st.Close(); err != nil {
			log.Warn().Err(err).Msg("binding store close")
		}
	}()
	lengths := metrics.NewSessionLengths(reg, st, metrics.SessionLengthsOptions{})
	rec.TrackSessions(lengths)
	// The Redis sink writes to the bindings' Redis; the memory store has
	// none (config validation refuses that sink with it).
	redisStore, _ := st.(*redisstore.Store)
	if redisStore != nil {
		// Said once at start, and in /readyz ("hits"): where a hit cannot
		// be cached, every sticky request costs a Redis round trip.
		if mode, why := redisStore.Hits(); why != "" {
			log.Info().Str("hits", mode).Str("why", why).Msg("sticky hits: one Redis round trip each")
		} else {
			log.Info().Str("hits", mode).Msg("sticky hits: served from the replica's cache, invalidated by Redis messages")
		}
		registerHitCache(reg, redisStore)
	}
	// Deferred after store.Close, so it runs before it, and after the
	// ext_proc server has stopped below: in-flight decisions are recorded.
	auditor, stopAudit, err := startAudit(ctx, p.Audit, p.Identity.MaxValueBytes, redisStore, reg, log)
	if err != nil {
		return err
	}
	defer stopAudit()

	ls, err := listen(p.Listen)
	if err != nil {
		return err
	}
	defer ls.close()

	sctx, stopStreams := context.WithCancel(context.Background())
	defer stopStreams()
	var ads *xds.Server
	if ls.xds != nil {
		ads = xds.NewServer(sctx, log, reg)
	}
	rt := reload.New(ls.extproc.Addr().String(), ads, log, reg)
	if _, err := rt.Apply(ctx, cfg, "start"); err != nil {
		return err
	}
	// What only a restart changes comes from the start's plan (now with
	// this replica's listener for Envoy): the identity, the breaker, the
	// ext_proc handler's headers.
	start := rt.Plan()
	ids, err := start.Extractor(secret)
	if err != nil {
		return err
	}

	replica := replicas.Name()
	load := affinity.NewLoad()
	var breaker *fleet.Breaker
	brec := metrics.NewBreaker(reg, func() uint64 { return breaker.Dropped() })
	breaker = fleet.NewBreaker(start.Breaker, nil, brec.Changed)
	metrics.NewInstances(reg, fleetView{fleet: rt.Fleet(), load: load, breaker: breaker})
	// The decider tether-lab simulate --config builds too, on the memory
	// store (lab/simulator's TestSimulateDecidesAsServe).
	// The prefix index cache-aware placement reads ([content]), kept at
	// each instance's KV-cache capacity.
	index := prefix.NewIndex(start.Content.IndexBlocks(start.Content.CacheTokens))
	caps := &capacities{index: index, load: load, instances: rt.Fleet().All, stale: start.Scrape.Staleness, interval: start.Scrape.Interval}
	caps.content.Store(&start.Content)
	hasher, err := prefix.NewHasher(start.Content.BlockBytes, 0)
	if err != nil {
		return err
	}
	// What the index records is shared with the other replicas
	// (replicas.ContentShare, run below with the other loops). It runs
	// whether or not [content] is enabled: enabled is live, and a replica
	// with it off records nothing (it publishes nothing) but keeps taking
	// in the others' records, so turning it on finds the index as warm as
	// theirs. Its cost while nobody records is one idle subscription.
	known := func(in string) bool { _, ok := rt.Fleet().Lookup(in); return ok }
	contents := replicas.NewContentShare(replica, index, st, known, log)
	metrics.NewContentShare(reg, contents)
	decider := plan.NewDecider(start, rt.Fleet(), plan.Deps{Store: metrics.NewStore(reg, st), Load: load, Breaker: breaker, Index: contents})
	rt.OnApply(func(p plan.Plan) {
		decider.SetPolicy(p.Policy)
		caps.content.Store(&p.Content)
	})
	metrics.NewPrefix(reg, index, decider)
	reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "tether_failopen_overrides_total",
		Help: "New sessions bound elsewhere than where Envoy's fail-open pool would send them: " +
			"that instance was over its bounded load, its engine reported its KV cache full, or it was not a candidate.",
	}, func() float64 { return float64(decider.FailOpenOverrides()) }))
	eo := start.ExtProc
	eo.Auditor, eo.Logger = auditor, log
	// Tickets always: envoy.outcomes may change live, and Envoy keeps the
	// ticket only where the filters it is sent need it.
	eo.Tickets, eo.Instances = extproc.NewTickets(secret), rt.Fleet()
	eo.Prompts = hasher
	processor := extproc.New(ids, decider, rec, eo)

	gs := grpc.NewServer(append(extprocServerOptions(), creds...)...)
	extprocv3.RegisterExternalProcessorServer(gs, processor)
	accesslogv3.RegisterAccessLogServiceServer(gs, processor.AccessLog())
	hs := health.NewServer()
	healthpb.RegisterHealthServer(gs, hs)
	var xs *grpc.Server
	if ads != nil {
		xs = grpc.NewServer(creds...)
		ads.Register(xs)
	}

	ready := admin.NewReadiness(st)
	sessions := admin.NewSessionOps(admin.SessionOpsConfig{
		Index: st, Drains: st, Load: load, Fleet: rt.Fleet(),
		Identity: ids, Headers: start.Identity, Logger: log,
	})
	adminAPI := admin.Guard(adminToken, cfg.Server, ls.admin.Addr(), log, admin.NewHandler(admin.Config{
		Metrics: registry, Ready: ready, Runtime: rt, ADS: ads, Sessions: sessions,
	}))
	adminServer := &http.Server{Handler: adminAPI, ReadHeaderTimeout: 5 * time.Second}

	errc := make(chan error, 4)
	go func() { errc <- serveErr("ext_proc", gs.Serve(ls.extproc)) }()
	go func() { errc <- serveErr("admin", adminServer.Serve(ls.admin)) }()
	if xs != nil {
		go func() { errc <- serveErr("xds", xs.Serve(ls.xds)) }()
	}
	// The background loops: they keep running through the drain delay,
	// while the replica still decides, and are stopped (and waited for)
	// before its listener closes.
	wctx, stopWatch := context.WithCancel(context.WithoutCancel(ctx))
	var watchers sync.WaitGroup
	watchers.Go(func() { lengths.Run(wctx) })
	// What keeps this replica in step with the others (package replicas).
	loadSync := &replicas.LoadSync{Replica: replica, View: load, Store: st, Instances: rt.Fleet().All,
		OnFailure: rec.LoadSyncFailures().Inc, Log: log}
	watchers.Go(func() { loadSync.Run(wctx) })
	poller := newPoller(start.Scrape, replica, rt.Fleet(), load, st, reg, log)
	watchers.Go(func() { poller.Run(wctx) })
	watchers.Go(func() { caps.run(wctx) })
	circuits := &replicas.CircuitShare{Replica: replica, Breaker: breaker, Store: st, Index: st, Mover: decider,
		Known: known, Recorder: brec, Log: log}
	watchers.Go(func() { circuits.Run(wctx) })
	watchers.Go(func() { contents.Run(wctx) })
	if opts.ConfigPath != "" {
		watchers.Go(func() {
			if err := rt.WatchFile(wctx, opts.ConfigPath, opts.Overrides); err != nil {
				log.Error().Err(err).Msg("config file not watched; changes need a restart or the admin API")
			}
		})
	}
	ev := log.Info().Str("extproc", ls.extproc.Addr().String()).Str("admin", ls.admin.Addr().String())
	if ls.xds != nil {
		ev = ev.Str("xds", ls.xds.Addr().String())
	}
	ev.Str("mode", string(start.Policy.Mode)).Int("instances", len(start.Instances)).Msg("tether ready")

	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-errc:
	}
	ready.Drain()
	hs.Shutdown()
	if d := start.Drain.Delay; d > 0 && runErr == nil {
		runErr = lameDuck(d, errc, log)
	}
	log.Info().Dur("timeout", start.Drain.Timeout).Msg("draining ext_proc streams")
	// No request this replica routed is still running when every engine,
	// read a second or more after its last decision, serves and queues
	// nothing: the ends still pending then will not come (a request its
	// client cancelled while tether decided is logged without its ticket).
	idle := func() bool {
		return load.EnginesIdle(rt.Fleet().All(), processor.LastDecision().Add(time.Second))
	}
	settle(gs, processor, load, idle, start.Drain.Timeout, log)
	stopWatch()
	watchers.Wait()
	if xs != nil {
		stopStreams() // ADS streams never end by themselves
		stopGRPC(xs, time.Second)
	}
	hctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = adminServer.Shutdown(hctx)
	log.Info().Msg("tether stopped")
	return runErr
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

// close closes every listener still open; servers close theirs on stop,
// and a second close is harmless.
func (ls *listeners) close() {
	for _, l := range []net.Listener{ls.extproc, ls.admin, ls.xds} {
		if l != nil {
			_ = l.Close()
		}
	}
}

// identitySecret returns the HMAC secret. Replicas sharing a Redis must
// share it, or they would key the same caller differently; so it is
// required unless the store is embedded (and dies with the process anyway).
func identitySecret(id config.Identity, storeURL string, log zerolog.Logger) ([]byte, error) {
	if s := id.SecretBytes(); len(s) > 0 {
		if len(s) < 16 {
			return nil, fmt.Errorf("identity secret (from $%s or identity.secret) must be at least 16 bytes", id.SecretEnv)
		}
		return s, nil
	}
	if storeURL != store.Embedded {
		return nil, fmt.Errorf("identity secret missing: set $%s (or identity.secret); every replica sharing a Redis needs the same one", id.SecretEnv)
	}
	s := make([]byte, 32)
	if _, err := rand.Read(s); err != nil {
		return nil, fmt.Errorf("identity secret: %w", err)
	}
	log.Warn().Str("env", id.SecretEnv).Msg("no identity secret set; using a random one for this process (fine with the embedded store only)")
	return s, nil
}

// lameDuck waits out server.drain_delay with /readyz and the gRPC health
// service already reporting the replica down but its ext_proc listener
// still open: Envoy's health checks (twice a second, out after two
// failures) and Kubernetes' endpoints take it out of rotation meanwhile,
// so no new stream meets a closed port and skips tether. A server that
// fails in the meantime ends the wait with its error.
func lameDuck(d time.Duration, errc <-chan error, log zerolog.Logger) error {
	log.Info().Dur("delay", d).Msg("not ready; still deciding until Envoy stops sending streams")
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			return nil
		case err := <-errc:
			if err != nil {
				return err
			}
		}
	}
}

// settleEvery is how often settle looks at what is still to come.
const settleEvery = 10 * time.Millisecond

// settle stops the ext_proc server once every request this replica
// routed has ended, bounded by timeout. It serves on meanwhile: a request's
// end may come on an access-log stream Envoy opens only then (a worker
// opens its stream at its first entry). Envoy holds streams open that end
// no request (each worker's access-log stream, for as long as Envoy runs),
// so the server stops, cutting what is open, as soon as nothing is
// pending: no request whose end comes on its routing stream, and no
// request whose end is reported apart, unless another replica is live
// (Envoy takes its access-log streams there when this one's are cut, and
// any replica hears a ticket's report) or the engines say that nothing
// runs (idle): the ends still counted then never come.
func settle(gs *grpc.Server, p interface{ Pending() (apart, stream int) }, others interface{ Replicas() int }, idle func() bool, timeout time.Duration, log zerolog.Logger) {
	defer gs.Stop()
	began := time.Now()
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(settleEvery)
	defer tick.Stop()
	for {
		apart, stream := p.Pending()
		switch {
		case stream > 0:
		case apart == 0 || others.Replicas() > 0:
			log.Info().Dur("waited", time.Since(began)).Int("other_replicas", others.Replicas()).Msg("every request's end heard (or left to another replica)")
			return
		case idle():
			log.Info().Dur("waited", time.Since(began)).Int("apart", apart).
				Msg("every engine idle since the last decision: the ends still pending will not come (requests cancelled while tether decided)")
			return
		}
		select {
		case <-tick.C:
		case <-deadline.C:
			apart, stream := p.Pending()
			log.Warn().Int("apart", apart).Int("stream", stream).Msg("drain timeout: the ends of requests still pending are not heard here")
			return
		}
	}
}

// stopGRPC lets open streams finish, then cuts them after timeout.
func stopGRPC(gs *grpc.Server, timeout time.Duration) {
	done := make(chan struct{})
	go func() { gs.GracefulStop(); close(done) }()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		gs.Stop()
		<-done
	}
}

func serveErr(name string, err error) error {
	if err == nil || errors.Is(err, http.ErrServerClosed) || errors.Is(err, grpc.ErrServerStopped) {
		return nil
	}
	return fmt.Errorf("%s server: %w", name, err)
}
