package server

import (
	"context"
	"crypto/rand"
	"fmt"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"

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
)

// tether is a running tether's components, as assemble builds them.
type tether struct {
	store  *storePart
	audit  *auditPart
	reload *reloadPart
	// discovery follows [[discovery.dns]]; it runs nothing without.
	discovery *loops
	loops     *loops
	xds       *xdsServer
	extproc   *extprocServer
	admin     *adminServer

	drain plan.Drain
	errc  chan error // the servers' failures
	start plan.Plan  // the plan tether started with
	log   zerolog.Logger
}

// shared is what the components are built with.
type shared struct {
	cfg        config.Config
	opts       Options
	secret     []byte
	registry   *prometheus.Registry // what /metrics serves
	reg        prometheus.Registerer
	creds      []grpc.ServerOption // none when [tls] is off
	adminToken string              // "" when none is set
	rec        *metrics.Metrics
	log        zerolog.Logger
}

// assemble builds every component; nothing serves yet. cfg goes to
// reload, which keeps it in force. What tether runs with comes from its
// translation (plan). Only the identity secret and the admin token are
// read from where cfg names them. A failed start closes what it opened.
func assemble(ctx context.Context, cfg config.Config, opts Options) (_ *tether, err error) {
	s := shared{cfg: cfg, opts: opts, log: opts.Logger}
	p, err := plan.FromConfig(cfg, plan.Options{})
	if err != nil {
		return nil, err
	}
	if s.secret, err = identitySecret(cfg.Identity, p.Store.URL, s.log); err != nil {
		return nil, err
	}
	s.registry, s.reg = newRegistry(opts.WrapRegisterer)
	if s.creds, err = reload.GRPCCredentials(p.TLS, s.log, s.reg); err != nil {
		return nil, err
	}
	if s.adminToken, err = cfg.Server.AdminToken(); err != nil {
		return nil, fmt.Errorf("admin: %w", err)
	}
	s.rec = metrics.New(s.reg)

	var undo []func() // last first, when the start fails
	defer func() {
		for i := len(undo) - 1; err != nil && i >= 0; i-- {
			undo[i]()
		}
	}()
	t := &tether{errc: make(chan error, 3), log: s.log}
	if t.store, err = openStore(ctx, p.Store, s.rec, s.reg, s.log); err != nil {
		return nil, err
	}
	undo = append(undo, func() { stop(t.store, 0, s.log) })
	if t.audit, err = openAudit(ctx, p.Audit, p.Identity.MaxValueBytes, t.store.redis, s.reg, s.log); err != nil {
		return nil, err
	}
	undo = append(undo, func() { stop(t.audit, auditCloseTimeout, s.log) })
	ls, err := listen(p.Listen)
	if err != nil {
		return nil, err
	}
	undo = append(undo, ls.close)
	t.xds = newXDS(ls.xds, s.creds, t.errc, s.reg, s.log)
	undo = append(undo, func() { stop(t.xds, time.Second, s.log) })
	if t.reload, t.discovery, err = newReload(ctx, cfg, p.Discovery, ls.extproc.Addr().String(), t.xds.ads, opts, s.reg); err != nil {
		return nil, err
	}
	if err = t.build(s, ls); err != nil {
		return nil, err
	}
	return t, nil
}

// build makes what decides and serves, from the start's plan: what only
// a restart changes (the identity, the breaker, the ext_proc handler's
// headers) is read from it, now with this replica's listener for Envoy.
func (t *tether) build(s shared, ls *listeners) error {
	rt := t.reload.rt
	t.start = rt.Plan()
	t.drain = t.start.Drain
	ids, err := t.start.Extractor(s.secret)
	if err != nil {
		return err
	}
	c, err := newCore(t.start, rt, t.store.st, s.reg, s.log)
	if err != nil {
		return err
	}
	eo := t.start.ExtProc
	eo.Auditor, eo.Logger = t.audit.recorder, s.log
	// Tickets always: envoy.outcomes may change live, and Envoy keeps the
	// ticket only where the filters it is sent need it.
	eo.Tickets, eo.Instances = extproc.NewTickets(s.secret), rt.Fleet()
	eo.Prompts = c.hasher
	processor := extproc.New(ids, c.decider, s.rec, eo)
	t.extproc = newExtprocServer(ls.extproc, s.creds, processor, c, t.errc, s.log)

	st := t.store.st
	ready := admin.NewReadiness(st)
	sessions := admin.NewSessionOps(admin.SessionOpsConfig{
		Index: st, Drains: st, Load: c.load, Fleet: rt.Fleet(),
		Identity: ids, Headers: t.start.Identity, Logger: s.log,
	})
	api := admin.Guard(s.adminToken, s.cfg.Server, ls.admin.Addr(), s.log, admin.NewHandler(admin.Config{
		Metrics: s.registry, Ready: ready, Runtime: rt, ADS: t.xds.ads, Sessions: sessions,
	}))
	t.admin = &adminServer{http: &http.Server{Handler: api, ReadHeaderTimeout: 5 * time.Second},
		l: ls.admin, ready: ready, errc: t.errc}
	t.loops = newLoops(c, st, t.start.Scrape, s)
	return nil
}

// logReady says where tether serves, once every component runs.
func (t *tether) logReady() {
	ev := t.log.Info().Str("extproc", t.extproc.l.Addr().String()).Str("admin", t.admin.l.Addr().String())
	if t.xds.l != nil {
		ev = ev.Str("xds", t.xds.l.Addr().String())
	}
	ev.Str("mode", string(t.start.Policy.Mode)).Int("instances", len(t.start.Instances)).Msg("tether ready")
}

// newRegistry is the registry /metrics serves, with the Go runtime's and
// the process's collectors, and the registerer tether's collectors go to.
func newRegistry(wrap func(prometheus.Registerer) prometheus.Registerer) (*prometheus.Registry, prometheus.Registerer) {
	registry := prometheus.NewRegistry()
	var reg prometheus.Registerer = registry
	if wrap != nil {
		reg = wrap(registry)
	}
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return registry, reg
}

// core is the decider and what it reads, which the background loops keep
// current.
type core struct {
	replica string
	fleet   *fleet.Fleet
	load    *affinity.Load
	breaker *fleet.Breaker
	brec    *metrics.Breaker
	caps    *capacities
	hasher  *prefix.Hasher
	share   *replicas.ContentShare
	decider *affinity.Decider
	known   func(instance string) bool
}

// newCore builds the decider tether-lab simulate --config builds too, on
// the memory store (lab/simulator's TestSimulateDecidesAsServe), with
// the prefix index cache-aware placement reads ([content]).
func newCore(start plan.Plan, rt *reload.Runtime, st store.Store, reg prometheus.Registerer, log zerolog.Logger) (*core, error) {
	c := &core{replica: replicas.Name(), fleet: rt.Fleet(), load: affinity.NewLoad()}
	c.brec = metrics.NewBreaker(reg, func() uint64 { return c.breaker.Dropped() })
	c.breaker = fleet.NewBreaker(start.Breaker, nil, c.brec.Changed)
	metrics.NewInstances(reg, fleetView{fleet: c.fleet, load: c.load, breaker: c.breaker})
	// The index is kept at each instance's KV-cache capacity (capacities).
	index := prefix.NewIndex(start.Content.IndexBlocks(start.Content.CacheTokens))
	c.caps = &capacities{index: index, load: c.load, instances: c.fleet.All, stale: start.Scrape.Staleness, interval: start.Scrape.Interval}
	c.caps.content.Store(&start.Content)
	var err error
	if c.hasher, err = prefix.NewHasher(start.Content.BlockBytes, 0); err != nil {
		return nil, err
	}
	// What the index records is shared with the other replicas, whether
	// or not [content] is enabled: enabled is live. A replica with it off
	// records nothing but takes in the others' records, so turning it on
	// finds the index as warm as theirs. Its cost while nobody records is
	// one idle subscription.
	c.known = func(in string) bool { _, ok := c.fleet.Lookup(in); return ok }
	c.share = replicas.NewContentShare(c.replica, index, st, c.known, log)
	metrics.NewContentShare(reg, c.share)
	c.decider = plan.NewDecider(start, c.fleet, plan.Deps{Store: metrics.NewStore(reg, st), Load: c.load, Breaker: c.breaker, Index: c.share})
	rt.OnApply(func(p plan.Plan) {
		c.decider.SetPolicy(p.Policy)
		c.caps.content.Store(&p.Content)
	})
	metrics.NewPrefix(reg, index, c.decider)
	reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "tether_failopen_overrides_total",
		Help: "New sessions bound elsewhere than where Envoy's fail-open pool would send them: " +
			"that instance was over its bounded load, its engine reported its KV cache full, or it was not a candidate.",
	}, func() float64 { return float64(c.decider.FailOpenOverrides()) }))
	return c, nil
}

// newLoops are the background loops: the session lengths, and what keeps
// this replica in step with the others (package replicas).
func newLoops(c *core, st store.Store, sc plan.Scrape, s shared) *loops {
	lengths := metrics.NewSessionLengths(s.reg, st, metrics.SessionLengthsOptions{})
	s.rec.TrackSessions(lengths)
	l := &loops{name: "background loops"}
	l.add(lengths.Run)
	l.add((&replicas.LoadSync{Replica: c.replica, View: c.load, Store: st, Instances: c.fleet.All,
		OnFailure: s.rec.LoadSyncFailures().Inc, Log: s.log}).Run)
	l.add(newPoller(sc, c.replica, c.fleet, c.load, st, s.reg, s.log).Run)
	l.add(c.caps.run)
	l.add((&replicas.CircuitShare{Replica: c.replica, Breaker: c.breaker, Store: st, Index: st, Mover: c.decider,
		Known: c.known, Recorder: c.brec, Log: s.log}).Run)
	l.add(c.share.Run)
	return l
}

// identitySecret returns the HMAC secret. Replicas sharing a Redis must
// share it, or they would key the same caller differently. So it is
// required unless the store is embedded, and dies with the process.
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
