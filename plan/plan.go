// Package plan is the one translation from tether's configuration to what
// runs: FromConfig turns a config.Config into the fleet, the routing
// policy, the instance breaker's settings, the identity extraction, the
// ext_proc handler's options and the spec of Envoy's resources
// (xds.Spec). `tether serve` (through reload, at start and on every live
// change) and `tether-lab simulate --config` both go through it, and both
// build their decider with NewDecider, so the simulator runs the policy
// serve runs.
package plan

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/extproc"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/xds"
)

// Plan is what a configuration runs as.
type Plan struct {
	// Instances are the fleet, in configuration order.
	Instances []fleet.Instance
	// Policy is what the decider applies ([routing], [[versions]]).
	Policy affinity.Policy
	// Breaker is the instance breaker's (routing.failure_*).
	Breaker fleet.BreakerConfig
	// RandomSeed seeds random routing (routing.random_seed); 0: unseeded.
	RandomSeed uint64
	// Identity reads a request's identity ([identity]); its Secret is the
	// caller's to give (Extractor).
	Identity identity.Config
	// ExtProc is the ext_proc handler's options, without the auditor and
	// the logger the caller adds.
	ExtProc extproc.Options
	// Envoy is what xds.Build makes Envoy's resources from.
	Envoy xds.Spec
	// Scrape is how the instances' engines are read ([engines]).
	Scrape Scrape
	// Content is how prompts are cut and indexed ([content]); the
	// decider's part is Policy.Content.
	Content Content

	// What tether's own process runs with, which serve reads once at its
	// start (every key of it is restart-only, config's reload tags).
	Listen Listen
	Drain  Drain
	Store  Store
	// TLS is [tls] as it stands: its files are read where they are used
	// (reload.GRPCCredentials), and again when they change.
	TLS config.TLS
	// Audit is [audit] as it stands: its sink is opened, and its keys read
	// from the environment, at the start (audit/sinks).
	Audit config.Audit
	// Discovery is [[discovery.dns]] as it stands: its groups are resolved
	// from the start (package discovery).
	Discovery []config.DNSGroup
}

// Content is how prompts are cut into blocks and how much of them the
// index keeps per instance ([content]).
type Content struct {
	Enabled    bool
	BlockBytes int
	// CacheTokens is an instance's KV-cache capacity when its engine
	// publishes none (content.cache_tokens).
	CacheTokens int
}

func content(c config.Content) Content {
	return Content{Enabled: c.Enabled, BlockBytes: c.BlockBytes, CacheTokens: c.CacheTokens}
}

// IndexBlocks is the index capacity, in blocks, of a KV cache of tokens
// (CharsPerToken characters a token).
func (c Content) IndexBlocks(tokens int) int {
	return max(tokens*config.CharsPerToken/c.BlockBytes, 1)
}

// Listen is where tether's servers listen ([server], [xds]).
type Listen struct {
	ExtProc, Admin string
	XDS            string // "": the ADS server is off
}

// Drain is how a stopping tether lets Envoy go ([server]).
type Drain struct {
	// Delay is the lame-duck time: not ready, still deciding.
	Delay time.Duration
	// Timeout bounds the wait for open ext_proc streams after it.
	Timeout time.Duration
}

// Store is the binding store tether opens ([redis]).
type Store struct {
	URL     string
	Timeout time.Duration
	// The Redis hit cache.
	Cache              bool
	CacheSize          int
	CacheTTL           time.Duration
	CacheFlushInterval time.Duration
	CacheWriteBack     time.Duration
}

// Scrape is how often and how patiently tether reads the engines' metrics
// ([engines]); which instances, at which URL, is in the fleet.
type Scrape struct {
	Interval, Timeout, Staleness time.Duration
	MaxBody                      int64
}

// Options are what the translation takes besides the configuration.
type Options struct {
	// ExtProc lists the tether replicas Envoy calls when
	// envoy.extproc_endpoints names none (serve: this replica's
	// listener). Empty: server.extproc_addr.
	ExtProc []string
}

// FromConfig translates the whole of cfg, restart-only keys included: a
// running tether hands it what it runs (config.Running), which is cfg as
// it started for every restart-only key. cfg must have passed
// config.Validate, which checks it and resolves what its keys leave to be
// derived; FromConfig reads fields only. An error means it did not.
func FromConfig(cfg config.Config, o Options) (Plan, error) {
	pol, err := policy(cfg)
	if err != nil {
		return Plan{}, err
	}
	r, e, srv := cfg.Routing, cfg.Engines, cfg.Server
	p := Plan{
		Instances:  Instances(cfg),
		Policy:     pol,
		Breaker:    fleet.BreakerConfig{Threshold: r.FailureThreshold, Window: r.FailureWindow.D, Cooldown: r.FailureCooldown.D},
		RandomSeed: r.RandomSeed,
		Identity:   identityConfig(cfg.Identity),
		ExtProc: extproc.Options{
			ClusterHeader: r.ClusterHeader,
			UserHeader:    cfg.Identity.UserHeader,
			QueueHeader:   r.QueueDepthHeader,
			OOMHeader:     r.OOMHeader,
			GPUHeader:     r.GPUUtilizationHeader,
			DebugHeaders:  srv.DebugHeaders,
			MaxBody:       cfg.Content.MaxBodyBytes,
			Fallbacks:     srv.DestinationFallbacks,
		},
		Envoy: envoy(cfg, o.ExtProc),
		Scrape: Scrape{
			Interval: e.ScrapeInterval.D, Timeout: e.ScrapeTimeout.D,
			Staleness: e.Staleness.D, MaxBody: e.MaxBodyBytes,
		},
		Content: content(cfg.Content),
		Listen:  Listen{ExtProc: srv.ExtProcAddr, Admin: srv.AdminAddr, XDS: cfg.XDS.Addr},
		Drain:   Drain{Delay: srv.DrainDelay.D, Timeout: srv.DrainTimeout.D},
		Store: Store{
			URL: cfg.Redis.URL, Timeout: cfg.Redis.Timeout.D, Cache: cfg.Redis.Cache, CacheSize: cfg.Redis.CacheSize,
			CacheTTL: cfg.Redis.CacheTTL.D, CacheFlushInterval: cfg.Redis.CacheFlushInterval.D, CacheWriteBack: cfg.Redis.CacheWriteBack.D,
		},
		TLS:       cfg.TLS,
		Audit:     cfg.Audit,
		Discovery: cfg.Discovery.DNS,
	}
	p.Envoy.RequestHeaders, p.Envoy.ResponseHeaders = forwarded(p)
	return p, nil
}

func identityConfig(id config.Identity) identity.Config {
	return identity.Config{
		SessionHeader: id.SessionHeader,
		AuthHeader:    id.AuthHeader,
		DeviceHeader:  id.DeviceHeader,
		UserHeader:    id.UserHeader,
		MaxValueBytes: id.MaxValueBytes,
	}
}

// Extractor returns the identity extractor of p, keyed by secret (serve's
// identity secret; the simulator's fixed one).
func (p Plan) Extractor(secret []byte) (*identity.Extractor, error) {
	c := p.Identity
	c.Secret = secret
	ids, err := identity.New(c)
	if err != nil {
		return nil, fmt.Errorf("identity: %w", err)
	}
	return ids, nil
}

// Deps are what a decider runs on besides its plan: serve passes the
// Redis store, the load view shared through it and the instance breaker;
// the simulator the memory store, a virtual clock and a seeded random
// source.
type Deps struct {
	Store affinity.Store
	// Load is the fleet's load (bounded load, saturation, drains); nil:
	// every instance idle.
	Load *affinity.Load
	// Breaker keeps failing instances out; nil: every instance available.
	Breaker *fleet.Breaker
	// Now is the clock; nil: time.Now.
	Now func() time.Time
	// Rand is random routing's source; nil: the plan's (RandomSeed).
	Rand func() uint64
	// Index is the prefix index cache-aware placement reads ([content]);
	// nil: none, whatever the policy says.
	Index affinity.PrefixIndex
}

// NewDecider is the decider of p over fl: the one constructor serve and
// the simulator both call.
func NewDecider(p Plan, fl affinity.Fleet, d Deps) *affinity.Decider {
	r := d.Rand
	if r == nil {
		r = randomSource(p.RandomSeed)
	}
	opts := []affinity.Option{affinity.WithRand(r)}
	if d.Load != nil {
		opts = append(opts, affinity.WithLoad(d.Load))
	}
	if d.Breaker != nil {
		opts = append(opts, affinity.WithBreaker(d.Breaker))
	}
	if d.Now != nil {
		opts = append(opts, affinity.WithClock(d.Now))
	}
	if f := failOpen(p.Envoy); f != nil {
		opts = append(opts, affinity.WithFailOpen(f))
	}
	if d.Index != nil {
		opts = append(opts, affinity.WithPrefixIndex(d.Index))
	}
	return affinity.New(d.Store, fl, p.Policy, opts...)
}

// randomSource returns the generator random routing draws from: seeded and
// reproducible when seed is set, else from the runtime's per-thread source.
func randomSource(seed uint64) func() uint64 {
	if seed == 0 {
		return rand.Uint64
	}
	var mu sync.Mutex
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	return func() uint64 {
		mu.Lock()
		defer mu.Unlock()
		return r.Uint64()
	}
}
