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
	"reflect"
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
	// Instances are the fleet, in configuration order, defaults filled in.
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
	// Pinned is what the plan was made with of what only a restart
	// changes: Options.Pinned, or the configuration's own.
	Pinned Pinned
}

// Pinned is what a running tether keeps from its start until a restart,
// whatever a live edit says, and so what Envoy must be told too: the
// header tether routes by, the identity headers it reads (and Envoy
// hashes on), and the [tls] Envoy's side is built from (tether's servers
// keep the [tls] they started with; reload decides when a new
// [tls.envoy] fits it). A cluster_header edit that reached Envoy alone
// would send every request past tether's decision to the default pool; a
// [tls] edit, make every handshake with tether fail.
type Pinned struct {
	ClusterHeader string
	Identity      config.Identity
	TLS           config.TLS
	// Engines is how the engines are scraped, and how old a reading may be
	// (engines.default follows the file: it decides which instances are
	// scraped, as their own engine keys do).
	Engines config.Engines
}

// Scrape is how often and how patiently tether reads the engines' metrics
// ([engines]); which instances, at which URL, is in the fleet.
type Scrape struct {
	Interval, Timeout, Staleness time.Duration
	MaxBody                      int64
}

// PinnedOf is what c pins when tether starts with it.
func PinnedOf(c config.Config) Pinned {
	return Pinned{ClusterHeader: c.Routing.ClusterHeader, Identity: c.Identity, TLS: c.TLS, Engines: c.Engines}
}

// Options are what the translation takes besides the configuration.
type Options struct {
	// ExtProc lists the tether replicas Envoy calls when
	// envoy.extproc_endpoints names none (serve: this replica's
	// listener). Empty: server.extproc_addr.
	ExtProc []string
	// Pinned, when set, is what the running tether keeps until a restart
	// (reload passes it on a live change); nil: the configuration's own.
	Pinned *Pinned
}

// FromConfig translates cfg, validated as tether will run it: cfg itself,
// then with the pinned routing and identity headers (an edit that moved
// cluster_header and gave a rule header the old name would otherwise
// match on a header Envoy strips from every request). Errors name the key.
func FromConfig(cfg config.Config, o Options) (Plan, error) {
	if err := cfg.Validate(); err != nil {
		return Plan{}, err
	}
	pin := PinnedOf(cfg)
	if o.Pinned != nil {
		pin = *o.Pinned
	}
	if pin.ClusterHeader != cfg.Routing.ClusterHeader || !reflect.DeepEqual(pin.Identity, cfg.Identity) {
		run := cfg
		run.Routing.ClusterHeader, run.Identity = pin.ClusterHeader, pin.Identity
		if err := run.Validate(); err != nil {
			return Plan{}, fmt.Errorf("with the routing and identity headers tether runs with until a restart: %w", err)
		}
	}
	pol, err := policy(cfg)
	if err != nil {
		return Plan{}, err
	}
	env, err := envoy(cfg, pin, o.ExtProc)
	if err != nil {
		return Plan{}, err
	}
	pol.Saturation.Stale = pin.Engines.Staleness.D
	r := cfg.Routing
	e := pin.Engines
	return Plan{
		Instances:  Instances(cfg),
		Policy:     pol,
		Breaker:    breaker(r),
		RandomSeed: r.RandomSeed,
		Identity:   identityConfig(pin.Identity),
		ExtProc: extproc.Options{
			ClusterHeader: pin.ClusterHeader,
			UserHeader:    pin.Identity.UserHeader,
			QueueHeader:   r.QueueDepthHeader,
			OOMHeader:     r.OOMHeader,
			GPUHeader:     r.GPUUtilizationHeader,
			DebugHeaders:  cfg.Server.DebugHeaders,
		},
		Envoy: env,
		Scrape: Scrape{
			Interval: e.ScrapeInterval.D, Timeout: e.ScrapeTimeout.D,
			Staleness: e.Staleness.D, MaxBody: e.MaxBodyBytes,
		},
		Pinned: pin,
	}, nil
}

// Envoy is the spec of Envoy's resources for cfg alone, for the
// bootstraps and the tests that build them (FromConfig makes it too).
// cfg should have passed config.Validate.
func Envoy(cfg config.Config, o Options) (xds.Spec, error) {
	pin := PinnedOf(cfg)
	if o.Pinned != nil {
		pin = *o.Pinned
	}
	return envoy(cfg, pin, o.ExtProc)
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
