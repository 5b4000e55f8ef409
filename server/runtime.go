package server

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
	"github.com/tetherproxy/tether/xds"
)

// ackWait bounds how long a change waits for Envoy to acknowledge new
// clusters before tether starts routing to them.
const ackWait = 5 * time.Second

// runtime owns what may change while tether runs: the fleet the decision
// reads and the Envoy resources made from the same configuration. Every
// change goes through apply, so the two move together.
type runtime struct {
	mu      sync.Mutex // one change at a time
	cfg     config.Config
	fleet   *fleet.Fleet
	ads     *xds.Server // nil when the ADS server is off
	extproc []string    // ext_proc endpoints Envoy is told to call
	version string      // of the Envoy resources in force
	log     zerolog.Logger
	reloads *prometheus.CounterVec
	// policy receives the routing policy of every configuration applied
	// after setPolicy: rules, versions and weights change without a restart.
	policy func(affinity.Policy)
	pol    affinity.Policy // of cfg
}

// currentPolicy returns the decision policy of the configuration in force.
func (r *runtime) currentPolicy() affinity.Policy {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.pol
}

// setPolicy registers the decider's SetPolicy.
func (r *runtime) setPolicy(f func(affinity.Policy)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.policy = f
}

func newRuntime(extproc []string, ads *xds.Server, log zerolog.Logger, reg prometheus.Registerer) *runtime {
	r := &runtime{
		fleet: fleet.New(nil), ads: ads, extproc: extproc, log: log,
		reloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tether_config_reloads_total",
			Help: "Configuration changes by source (file, admin) and result (applied, unchanged, invalid).",
		}, []string{"source", "result"}),
	}
	reg.MustRegister(r.reloads)
	return r
}

// current returns the configuration in force.
func (r *runtime) current() config.Config {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.cfg
}

// ErrInvalid marks a change refused because the new configuration is
// invalid; the previous one stays in force.
var ErrInvalid = errors.New("invalid configuration")

// apply makes next the configuration in force. An invalid next is refused
// (logged, counted, nothing changes). Otherwise:
//  1. instances leaving the fleet stop getting decisions at once;
//  2. Envoy gets the new resources (when the ADS server is on), and apply
//     waits, bounded, for every connected Envoy to acknowledge them;
//  3. only then do new instances get decisions, so tether never names a
//     cluster Envoy does not have yet.
func (r *runtime) apply(ctx context.Context, next config.Config, source string) (version string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := next.Validate(); err != nil {
		return "", r.refuse(source, err)
	}
	pol, err := Policy(next)
	if err != nil {
		return "", r.refuse(source, err)
	}
	res, err := xds.Build(next, r.extproc, xds.ADS)
	if err != nil {
		return "", r.refuse(source, err)
	}
	if version, err = xds.Version(res); err != nil {
		return "", r.refuse(source, err)
	}
	if version == r.version && reflect.DeepEqual(next.Instances, r.cfg.Instances) &&
		reflect.DeepEqual(next.Routing, r.cfg.Routing) && reflect.DeepEqual(next.Versions, r.cfg.Versions) {
		r.reloads.WithLabelValues(source, "unchanged").Inc()
		return version, nil
	}
	if r.version != "" {
		r.warnRestartOnly(next)
	}

	now := Instances(next)
	kept := make([]fleet.Instance, 0, len(now))
	for _, in := range now {
		if _, ok := r.fleet.Lookup(in.Name); ok {
			kept = append(kept, in)
		}
	}
	r.fleet.Replace(kept)
	if r.ads != nil {
		if _, err := r.ads.Publish(res); err != nil {
			r.fleet.Replace(Instances(r.cfg))
			return "", r.refuse(source, err)
		}
		wctx, cancel := context.WithTimeout(ctx, ackWait)
		err := r.ads.WaitAcked(wctx, version)
		cancel()
		if err != nil {
			r.log.Warn().Err(err).Msg("routing to the new instances anyway")
		}
	}
	r.fleet.Replace(now)
	if r.policy != nil {
		r.policy(pol)
	}
	r.cfg, r.version, r.pol = next, version, pol
	r.reloads.WithLabelValues(source, "applied").Inc()
	r.log.Info().Str("source", source).Str("version", version).Int("instances", len(now)).Msg("configuration applied")
	return version, nil
}

func (r *runtime) refuse(source string, err error) error {
	r.reloads.WithLabelValues(source, "invalid").Inc()
	r.log.Error().Err(err).Str("source", source).Msg("configuration refused; the previous one stays in force")
	return fmt.Errorf("%w: %w", ErrInvalid, err)
}

// warnRestartOnly logs the sections a running tether does not change.
func (r *runtime) warnRestartOnly(next config.Config) {
	for _, s := range []struct {
		name      string
		old, next any
	}{
		{"server", r.cfg.Server, next.Server}, {"redis", r.cfg.Redis, next.Redis}, {"audit", r.cfg.Audit, next.Audit},
		// tether's own certificate files are re-read when they change;
		// which files, and the client CA, only at a restart ([tls.envoy]
		// reaches Envoy over xDS at once).
		{"tls", serverTLS(r.cfg.TLS), serverTLS(next.TLS)},
		{"routing.cluster_header", r.cfg.Routing.ClusterHeader, next.Routing.ClusterHeader},
		{"routing.queue_depth_header", r.cfg.Routing.QueueDepthHeader, next.Routing.QueueDepthHeader},
		{"routing.oom_header", r.cfg.Routing.OOMHeader, next.Routing.OOMHeader},
		{"routing.gpu_utilization_header", r.cfg.Routing.GPUUtilizationHeader, next.Routing.GPUUtilizationHeader},
		{"routing.random_seed", r.cfg.Routing.RandomSeed, next.Routing.RandomSeed},
		{"routing.failure_threshold", *r.cfg.Routing.FailureThreshold, *next.Routing.FailureThreshold},
		{"routing.failure_window", r.cfg.Routing.FailureWindow.D, next.Routing.FailureWindow.D},
		{"routing.failure_cooldown", r.cfg.Routing.FailureCooldown.D, next.Routing.FailureCooldown.D},
		{"identity", r.cfg.Identity, next.Identity},
		{"xds", r.cfg.XDS, next.XDS},
	} {
		if !reflect.DeepEqual(s.old, s.next) {
			r.log.Warn().Str("section", s.name).Msg("this section changed but takes effect only after a restart")
		}
	}
}

// serverTLS is the part of [tls] tether's own servers use.
func serverTLS(t config.TLS) config.TLS {
	t.Envoy = config.EnvoyTLS{}
	return t
}
