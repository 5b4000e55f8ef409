// Package reload keeps a running tether on its configuration file: it
// applies a changed file (or an admin API change) to the fleet, the
// decision policy and Envoy's resources together (Runtime), watches the
// file (Runtime.WatchFile), and serves renewed TLS certificates without a
// restart (GRPCCredentials). What a running tether cannot change is
// pinned (plan.Pinned) and logged as restart-only.
package reload

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/plan"
	"github.com/tetherproxy/tether/xds"
)

// ackWait bounds how long a change waits for Envoy to acknowledge new
// clusters before tether starts routing to them.
const ackWait = 5 * time.Second

// Runtime owns what may change while tether runs: the fleet the decision
// reads and the Envoy resources made from the same configuration. Every
// change goes through Apply, so the two move together.
type Runtime struct {
	mu sync.Mutex // one change at a time
	// cfg is the configuration last accepted, start is the one tether
	// started with: the restart-only parts of cfg may differ from what
	// runs, which is start's.
	cfg, start config.Config
	// plan is the translation in force (of the configuration last
	// applied), with what tether keeps from its start (plan.Pinned): the
	// routing and identity headers, and the [tls] Envoy's side is built
	// from (tether's own servers keep the [tls] they started with, so
	// Envoy must too; only [tls.envoy] follows the configuration, see
	// envoyTLS).
	plan    plan.Plan
	fleet   *fleet.Fleet
	ads     *xds.Server // nil when the ADS server is off
	self    string      // this replica's ext_proc address (see New)
	version string      // of the Envoy resources in force
	log     zerolog.Logger
	reloads *prometheus.CounterVec
	// policy receives the routing policy of every configuration applied
	// after OnPolicy: rules, versions and weights change without a restart.
	policy func(affinity.Policy)
}

// New returns a runtime with an empty fleet; the first Apply starts it.
// self is this replica's ext_proc address: Envoy calls it when
// envoy.extproc_endpoints names no replica. ads is nil when the ADS server
// is off.
func New(self string, ads *xds.Server, log zerolog.Logger, reg prometheus.Registerer) *Runtime {
	r := &Runtime{
		fleet: fleet.New(nil), ads: ads, self: self, log: log,
		reloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tether_config_reloads_total",
			Help: "Configuration changes by source (file, admin) and result (applied, unchanged, invalid).",
		}, []string{"source", "result"}),
	}
	reg.MustRegister(r.reloads)
	return r
}

// Plan returns the translation of the configuration in force.
func (r *Runtime) Plan() plan.Plan {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.plan
}

// OnPolicy registers the decider's SetPolicy: every configuration applied
// after it hands the decider its policy.
func (r *Runtime) OnPolicy(f func(affinity.Policy)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.policy = f
}

// Fleet is the fleet the decider reads; Apply changes it.
func (r *Runtime) Fleet() *fleet.Fleet { return r.fleet }

// Current returns the configuration in force.
func (r *Runtime) Current() config.Config {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.cfg
}

// ErrInvalid marks a change refused because the new configuration is
// invalid; the previous one stays in force.
var ErrInvalid = errors.New("invalid configuration")

// Apply makes next the configuration in force; source ("start", "file",
// "admin") labels the reload counter and the logs. An invalid next is refused
// (logged, counted, nothing changes). Otherwise:
//  1. instances leaving the fleet stop getting decisions at once;
//  2. Envoy gets the new resources (when the ADS server is on), and apply
//     waits, bounded, for every connected Envoy to acknowledge them;
//  3. only then do new instances get decisions, so tether never names a
//     cluster Envoy does not have yet.
//
// Sections a running tether does not change are logged as restart-only;
// Envoy's side of [tls], the routing header and the identity headers
// follow what tether runs with, not next.
func (r *Runtime) Apply(ctx context.Context, next config.Config, source string) (version string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := next.Validate(); err != nil {
		return "", r.refuse(source, err)
	}
	starting := r.version == ""
	pins := plan.PinnedOf(next)
	if starting {
		r.start = next
	} else {
		// What runs is next with the routing header and the identity
		// headers tether started with (they change only at a restart),
		// and Envoy's side of the [tls] in force; Envoy is told the same.
		pins = r.plan.Pinned
		pins.TLS = r.envoyTLS(next.TLS)
	}
	p, err := plan.FromConfig(next, plan.Options{ExtProc: []string{r.self}, Pinned: &pins})
	if err != nil {
		return "", r.refuse(source, err)
	}
	if starting {
		if next.TLS.Enabled() && next.TLS.Envoy == (config.EnvoyTLS{}) {
			// Valid only with the ADS server off (config.Validate).
			r.log.Info().Msg("[tls.envoy] is empty and the ADS server is off: tether generates no TLS for Envoy's side, " +
				"so the Envoy configuration (an Istio EnvoyFilter) must give its tether-extproc cluster a TLS transport socket (docs/security.md)")
		}
	}
	res, err := xds.Build(p.Envoy, xds.ADS)
	if err != nil {
		return "", r.refuse(source, err)
	}
	if version, err = xds.Version(res); err != nil {
		return "", r.refuse(source, err)
	}
	if !starting {
		r.warnRestartOnly(next)
	}
	if version == r.version && reflect.DeepEqual(next.Instances, r.cfg.Instances) &&
		reflect.DeepEqual(next.Routing, r.cfg.Routing) && reflect.DeepEqual(next.Versions, r.cfg.Versions) {
		// Nothing in force changes; next is remembered, so a restart-only
		// change is warned about once.
		r.cfg = next
		r.reloads.WithLabelValues(source, "unchanged").Inc()
		return version, nil
	}

	kept := make([]fleet.Instance, 0, len(p.Instances))
	for _, in := range p.Instances {
		if _, ok := r.fleet.Lookup(in.Name); ok {
			kept = append(kept, in)
		}
	}
	r.fleet.Replace(kept)
	if r.ads != nil {
		if _, err := r.ads.Publish(res); err != nil {
			r.fleet.Replace(r.plan.Instances)
			return "", r.refuse(source, err)
		}
		wctx, cancel := context.WithTimeout(ctx, ackWait)
		err := r.ads.WaitAcked(wctx, version)
		cancel()
		if err != nil {
			r.log.Warn().Err(err).Msg("routing to the new instances anyway")
		}
	}
	r.fleet.Replace(p.Instances)
	if r.policy != nil {
		r.policy(p.Policy)
	}
	r.cfg, r.version, r.plan = next, version, p
	r.reloads.WithLabelValues(source, "applied").Inc()
	r.log.Info().Str("source", source).Str("version", version).Int("instances", len(p.Instances)).Msg("configuration applied")
	return version, nil
}

func (r *Runtime) refuse(source string, err error) error {
	r.reloads.WithLabelValues(source, "invalid").Inc()
	r.log.Error().Err(err).Str("source", source).Msg("configuration refused; the previous one stays in force")
	return fmt.Errorf("%w: %w", ErrInvalid, err)
}

// envoyTLS is the [tls] Envoy's side is built from for a configuration
// whose [tls] is next. tether's servers keep the [tls] they started with
// until a restart (certificate files are re-read in place, see certSource;
// which files, the client CA and min_version are not), so Envoy keeps
// being told to speak that: a [tls] edit that reached Envoy at once would
// make its handshakes with tether fail and every request skip tether.
// Only [tls.envoy] (Envoy's own files, the SNI) follows next, and only
// while it fits the [tls] in force: TLS neither turned on nor off, and
// nothing Envoy needs left out. Otherwise Envoy keeps its side as it is.
func (r *Runtime) envoyTLS(next config.TLS) config.TLS {
	t := r.plan.Pinned.TLS
	if next.Envoy == t.Envoy {
		return t
	}
	why := ""
	switch {
	case next.Enabled() != t.Enabled():
		why = "TLS was turned on or off, which takes a restart"
	default:
		try := t
		try.Envoy = next.Envoy
		check := r.start
		check.TLS = try
		if err := check.Validate(); err != nil {
			why = err.Error()
			break
		}
		return try
	}
	if next.Envoy != r.cfg.TLS.Envoy { // once per change
		r.log.Warn().Str("section", "tls.envoy").Str("reason", why).
			Msg("[tls.envoy] changed but does not fit the [tls] tether runs with; Envoy keeps its previous side until a restart")
	}
	return t
}

// restartSection is a part of the configuration a running tether does
// not change, by its name.
type restartSection struct {
	name  string
	value any
}

// restartOnly lists c's restart-only parts.
func restartOnly(c config.Config) []restartSection {
	return []restartSection{
		{"server", c.Server}, {"redis", c.Redis}, {"audit", c.Audit},
		// tether's own certificate files are re-read when they change;
		// which files, the client CA and min_version only at a restart
		// ([tls.envoy] reaches Envoy over xDS at once, see envoyTLS).
		// Envoy keeps the cluster and identity headers tether started
		// with (apply) until then too.
		{"tls", serverTLS(c.TLS)},
		{"routing.cluster_header", c.Routing.ClusterHeader},
		{"routing.queue_depth_header", c.Routing.QueueDepthHeader},
		{"routing.oom_header", c.Routing.OOMHeader},
		{"routing.gpu_utilization_header", c.Routing.GPUUtilizationHeader},
		{"routing.random_seed", c.Routing.RandomSeed},
		{"routing.failure_threshold", c.Routing.FailureThreshold},
		{"routing.failure_window", c.Routing.FailureWindow.D},
		{"routing.failure_cooldown", c.Routing.FailureCooldown.D},
		{"identity", c.Identity},
		{"xds", c.XDS},
		{"engines (all but default)", engineScrape(c.Engines)},
	}
}

// engineScrape is [engines] without default, which changes live.
func engineScrape(e config.Engines) config.Engines {
	e.Default = ""
	return e
}

// warnRestartOnly logs each restart-only section next changes: one that
// differs from what tether runs with (start) and from the configuration
// last accepted, so a change is logged once and a return to the running
// value not at all.
func (r *Runtime) warnRestartOnly(next config.Config) {
	start, last := restartOnly(r.start), restartOnly(r.cfg)
	for i, s := range restartOnly(next) {
		if !reflect.DeepEqual(s.value, start[i].value) && !reflect.DeepEqual(s.value, last[i].value) {
			r.log.Warn().Str("section", s.name).Msg("this section changed but takes effect only after a restart")
		}
	}
}

// serverTLS is the part of [tls] tether's own servers use.
func serverTLS(t config.TLS) config.TLS {
	t.Envoy = config.EnvoyTLS{}
	return t
}
