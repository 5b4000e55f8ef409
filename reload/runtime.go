// Package reload keeps a running tether on its configuration file.
//   - Runtime applies a changed file, or an admin API change, to the
//     fleet, the decision policy and Envoy's resources together.
//   - Runtime.WatchFile watches the file.
//   - GRPCCredentials serves renewed TLS certificates without a restart.
//
// What a running tether cannot change keeps its start value and is logged
// as restart-only. config's reload tags say which keys those are
// (config.Running, config.RestartChanges).
package reload

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/plan"
	"github.com/tetherproxy/tether/xds"
)

// ackWait bounds how long a change waits for Envoy to acknowledge new
// clusters before tether starts routing to them.
const ackWait = 5 * time.Second

// Runtime owns what may change while tether runs. That is the fleet the
// decision reads, and the Envoy resources made from the same
// configuration. Every change goes through Apply, so the two move
// together.
type Runtime struct {
	mu sync.Mutex // one change at a time
	// cfg is the configuration last accepted. start is the one tether
	// started with. run is what runs: cfg with the instances discovery
	// found, and every restart-only key as start has it (config.Running).
	// plan is run's translation.
	cfg, start, run config.Config
	// found is what each [[discovery.dns]] group found (Discover), by
	// group. left names the instances found that the last change left
	// out, so each is logged once.
	found   map[string][]config.Instance
	left    map[string]bool
	plan    plan.Plan
	fleet   *fleet.Fleet
	ads     *xds.Server // nil when the ADS server is off
	self    string      // this replica's ext_proc address (see New)
	version string      // of the Envoy resources in force
	log     zerolog.Logger
	reloads *prometheus.CounterVec
	// applied hears the plan of every configuration applied after
	// OnApply. The decider takes its policy from it. So rules, versions
	// and weights change without a restart.
	applied func(plan.Plan)
}

// New returns a runtime with an empty fleet. The first Apply starts it.
// self is this replica's ext_proc address. Envoy calls it when
// envoy.extproc_endpoints names no replica. ads is nil when the ADS server
// is off.
func New(self string, ads *xds.Server, log zerolog.Logger, reg prometheus.Registerer) *Runtime {
	r := &Runtime{
		fleet: fleet.New(nil), ads: ads, self: self, log: log, found: map[string][]config.Instance{},
		reloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tether_config_reloads_total",
			Help: "Configuration changes by source (start, file, admin, dns) and result (applied, unchanged, invalid).",
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

// OnApply registers f to hear the plan of every configuration applied
// after it. serve hands the decider its policy this way.
func (r *Runtime) OnApply(f func(plan.Plan)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.applied = f
}

// Fleet is the fleet the decider reads. Apply changes it.
func (r *Runtime) Fleet() *fleet.Fleet { return r.fleet }

// Current returns the configuration in force, as the file and the admin
// API made it: without the instances discovery found.
func (r *Runtime) Current() config.Config {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.cfg
}

// ErrInvalid marks a change refused because the new configuration is
// invalid. The previous one stays in force.
var ErrInvalid = errors.New("invalid configuration")

// Apply makes next the configuration in force. source labels the reload
// counter and the logs: "start", "file", "admin" or "dns" (Discover).
// The instances discovery found are added to next (Discover). next has passed
// config.Validate, through config.Load or the admin API's
// config.Config.WithInstance. A next that does not fit what tether keeps
// until a restart is refused. The refusal is logged and counted, and
// nothing changes. Otherwise:
//  1. Instances leaving the fleet stop getting decisions at once.
//  2. With the ADS server on, Envoy gets the new resources. Apply waits,
//     bounded, for every connected Envoy to acknowledge them.
//  3. Only then do new instances get decisions. So tether never names a
//     cluster Envoy does not have yet.
//
// Restart-only keys next changes are logged as such. They keep their
// start value, for tether and for the Envoy configuration it serves.
func (r *Runtime) Apply(ctx context.Context, next config.Config, source string) (version string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.apply(ctx, next, source)
}

// Discover makes found what the [[discovery.dns]] group named group finds
// now, and applies the configuration in force with it, as Apply does,
// labelled "dns". Discovered instances come after the file's, and every
// later change (the file, the admin API) keeps them
// (config.WithDiscovered says which are left out). A refused change
// leaves the group's previous instances in force. Before the first Apply,
// Discover only records found, and the start applies it. So serve can
// start with the instances DNS finds.
func (r *Runtime) Discover(ctx context.Context, group string, found []config.Instance) (version string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	prev, had := r.found[group]
	r.found[group] = slices.Clone(found)
	if r.version == "" {
		return "", nil // the start applies it
	}
	if version, err = r.apply(ctx, r.cfg, "dns"); err != nil {
		if had {
			r.found[group] = prev
		} else {
			delete(r.found, group)
		}
	}
	return version, err
}

// withFound is next with the instances discovery found, the groups in the
// order the file that started tether lists them.
func (r *Runtime) withFound(next config.Config, source string) (config.Config, error) {
	if len(r.found) == 0 {
		return next, nil
	}
	groups := r.start.Discovery.DNS
	if r.version == "" {
		groups = next.Discovery.DNS // the start's
	}
	var found []config.Instance
	for _, g := range groups {
		found = append(found, r.found[g.Name]...)
	}
	merged, left, err := next.WithDiscovered(found)
	if err != nil {
		return config.Config{}, fmt.Errorf("with the instances discovery found: %w", err)
	}
	now := map[string]bool{}
	for _, in := range left {
		now[in.Name] = true
		if !r.left[in.Name] {
			r.log.Warn().Str("source", source).Str("instance", in.Name).Str("address", in.Address).
				Msg("discovered instance left out: an [[instances]] entry or an earlier group has its name or address")
		}
	}
	r.left = now
	return merged, nil
}

func (r *Runtime) apply(ctx context.Context, next config.Config, source string) (version string, err error) {
	starting := r.version == ""
	base := next
	if next, err = r.withFound(next, source); err != nil {
		return "", r.refuse(source, err)
	}
	run := next
	if starting {
		r.start = base
	} else {
		var held string
		if run, held, err = config.Running(r.start, r.run, next); err != nil {
			return "", r.refuse(source, fmt.Errorf("with the values tether keeps until a restart: %w", err))
		}
		if held != "" && next.TLS.Envoy != r.cfg.TLS.Envoy { // once per change
			r.log.Warn().Str("key", "tls.envoy").Str("reason", held).
				Msg("[tls.envoy] changed but does not fit the [tls] tether runs with; Envoy keeps its previous side until a restart")
		}
	}
	if len(run.Instances) == 0 && len(run.Discovery.DNS) > 0 {
		return "", r.refuse(source, errors.New("no instances: the file names none and [[discovery.dns]] found none yet"))
	}
	p, err := plan.FromConfig(run, plan.Options{ExtProc: []string{r.self}})
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
	if version == r.version && reflect.DeepEqual(run, r.run) {
		// Nothing in force changes. next is remembered, so a restart-only
		// change is warned about once.
		r.cfg = base
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
	if r.applied != nil {
		r.applied(p)
	}
	r.cfg, r.run, r.version, r.plan = base, run, version, p
	r.reloads.WithLabelValues(source, "applied").Inc()
	r.log.Info().Str("source", source).Str("version", version).Int("instances", len(p.Instances)).Msg("configuration applied")
	return version, nil
}

// Edit applies edit to the configuration in force. Once config has
// validated the result, Edit applies it as Apply does, labelled by source.
// A result that does not validate is refused: logged, counted, and wrapped
// in ErrInvalid. Edit returns the version in force and the configuration
// edited. The admin API's fleet changes go through it.
func (r *Runtime) Edit(ctx context.Context, source string, edit func(*config.Config)) (string, config.Config, error) {
	next := r.Current()
	edit(&next)
	if err := next.Validate(); err != nil {
		return "", next, r.refuse(source, err)
	}
	version, err := r.Apply(ctx, next, source)
	return version, next, err
}

func (r *Runtime) refuse(source string, err error) error {
	r.reloads.WithLabelValues(source, "invalid").Inc()
	r.log.Error().Err(err).Str("source", source).Msg("configuration refused; the previous one stays in force")
	return fmt.Errorf("%w: %w", ErrInvalid, err)
}

// warnRestartOnly logs each restart-only key next changes. Such a key
// differs from what tether runs with, its start value. It also differs
// from the configuration last accepted. So a change is logged once, and a
// return to the running value not at all.
func (r *Runtime) warnRestartOnly(next config.Config) {
	last := config.RestartChanges(r.cfg, next)
	for _, key := range config.RestartChanges(r.start, next) {
		if slices.Contains(last, key) {
			r.log.Warn().Str("key", key).Msg("this key changed but takes effect only after a restart")
		}
	}
}
