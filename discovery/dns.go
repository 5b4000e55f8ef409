// Package discovery finds instances beside the static [[instances]]. DNS
// follows the addresses behind DNS names ([[discovery.dns]]): a
// Kubernetes headless Service, a compose service. Each group's instances
// go to a Sink, reload.Runtime, which applies them as it applies a
// changed file.
package discovery

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/config"
)

// Resolver is what discovery needs of DNS. *net.Resolver is one.
type Resolver interface {
	LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error)
}

// Sink takes the instances a group finds. reload.Runtime is one.
type Sink interface {
	// Discover makes found the group's instances. An error means they
	// were refused, and the previous ones stay in force.
	Discover(ctx context.Context, group string, found []config.Instance) (version string, err error)
}

// Options are what DNS is built with.
type Options struct {
	// Resolver resolves the groups' names. nil is Go's own resolver,
	// which reads /etc/resolv.conf and caches nothing.
	Resolver Resolver
	Sink     Sink
	Log      zerolog.Logger
}

// A lookup's result, the label of tether_discovery_lookups_total.
const (
	resultOK        = "ok"        // addresses, all taken
	resultTruncated = "truncated" // more than config.MaxDiscovered; the lowest taken
	resultNotFound  = "not_found" // NXDOMAIN, or no A or AAAA record: the set in force stays
	resultError     = "error"     // SERVFAIL, a timeout, a refused connection: the set in force stays
)

// minLookupTimeout bounds a lookup from below when the interval is
// shorter. A truncated answer is asked again over TCP within it.
const minLookupTimeout = 2 * time.Second

// DNS resolves each [[discovery.dns]] group's name every interval and
// hands its instances to the sink when they change.
//
// The rules, the same for every group:
//   - An address is added as soon as an answer has it.
//   - An address leaves once remove_after answers in a row lack it. An
//     endpoint that flaps in and out of DNS stays.
//   - A failed lookup, NXDOMAIN or an answer without addresses changes
//     nothing: the set in force stays. It is counted and logged. So DNS
//     never empties the fleet.
//   - An answer takes at most config.MaxDiscovered addresses, the lowest.
//   - An address in DNS but unhealthy is the health checks' to judge: the
//     instance breaker, the engine scrape and Envoy's outlier detection.
type DNS struct {
	groups   []*group
	resolver Resolver
	sink     Sink
	lookups  *prometheus.CounterVec
	found    *prometheus.GaugeVec
	log      zerolog.Logger
}

// NewDNS returns the discoverer of groups, which have passed
// config.Validate. Run starts it.
func NewDNS(groups []config.DNSGroup, o Options, reg prometheus.Registerer) *DNS {
	d := &DNS{
		resolver: o.Resolver, sink: o.Sink, log: o.Log,
		lookups: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tether_discovery_lookups_total",
			Help: "DNS lookups of each [[discovery.dns]] group, by result (ok, truncated, not_found, error).",
		}, []string{"group", "result"}),
		found: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "tether_discovery_instances",
			Help: "The instances each [[discovery.dns]] group holds.",
		}, []string{"group"}),
	}
	if d.resolver == nil {
		d.resolver = &net.Resolver{PreferGo: true}
	}
	reg.MustRegister(d.lookups, d.found)
	for _, g := range groups {
		d.groups = append(d.groups, &group{cfg: g, missed: map[netip.Addr]int{}})
		d.found.WithLabelValues(g.Name)
	}
	return d
}

// Prime resolves every group once and hands the sink what each finds.
// serve calls it before its start: reload.Runtime applies at its start
// what it was handed before. So a fleet found in DNS serves from the
// start.
func (d *DNS) Prime(ctx context.Context) {
	var wg sync.WaitGroup
	for _, g := range d.groups {
		wg.Go(func() { d.poll(ctx, g) })
	}
	wg.Wait()
}

// Run resolves every group at once, then every group's interval, until
// ctx ends.
func (d *DNS) Run(ctx context.Context) {
	var wg sync.WaitGroup
	for _, g := range d.groups {
		wg.Go(func() {
			t := time.NewTicker(g.cfg.Interval.D)
			defer t.Stop()
			for {
				d.poll(ctx, g)
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
			}
		})
	}
	wg.Wait()
}

// poll resolves g's name once and hands g's instances to the sink when
// they changed, or when the sink refused them last time.
func (d *DNS) poll(ctx context.Context, g *group) {
	lctx, cancel := context.WithTimeout(ctx, max(g.cfg.Interval.D, minLookupTimeout))
	addrs, err := d.resolver.LookupNetIP(lctx, "ip", g.cfg.Host)
	cancel()
	if ctx.Err() != nil {
		return // stopping: not a failed lookup
	}
	result, changed := g.observe(addrs, err)
	d.lookups.WithLabelValues(g.cfg.Name, result).Inc()
	d.logResult(g, result, len(addrs), err)
	if changed || g.refused {
		found := g.instances()
		_, err := d.sink.Discover(ctx, g.cfg.Name, found)
		g.refused = err != nil
		if err != nil {
			d.log.Warn().Err(err).Str("group", g.cfg.Name).Msg("discovered instances refused; trying again after the next lookup")
		} else {
			d.log.Info().Str("group", g.cfg.Name).Int("instances", len(found)).Msg("discovered instances changed")
		}
	}
	d.found.WithLabelValues(g.cfg.Name).Set(float64(len(g.missed)))
}

// logResult logs a lookup that kept the set in force, or took part of an
// answer: a warning when the result changes, at debug level while it
// stays.
func (d *DNS) logResult(g *group, result string, n int, err error) {
	same := result == g.last
	g.last = result
	if result == resultOK {
		return
	}
	ev := d.log.Warn()
	if same {
		ev = d.log.Debug()
	}
	ev = ev.Str("group", g.cfg.Name).Str("host", g.cfg.Host).Str("result", result).Int("kept", len(g.missed))
	if result == resultTruncated {
		ev.Int("addresses", n).Int("taken", config.MaxDiscovered).Msg("more addresses than a group takes; the lowest taken")
		return
	}
	ev.Err(err).Msg("DNS lookup changed nothing; the instances found before stay")
}

// group is one [[discovery.dns]] group and what it found.
type group struct {
	cfg config.DNSGroup
	// missed holds the addresses in force, each with the answers in a row
	// that lacked it.
	missed  map[netip.Addr]int
	refused bool   // the sink refused the set in force
	last    string // the last lookup's result
}

// observe takes one lookup: its addresses, or its error. It returns the
// lookup's result and whether the set in force changed.
func (g *group) observe(addrs []netip.Addr, err error) (result string, changed bool) {
	if err != nil {
		var dnsErr *net.DNSError
		if errors.As(err, &dnsErr) && dnsErr.IsNotFound {
			return resultNotFound, false
		}
		return resultError, false
	}
	addrs, truncated := usable(addrs)
	if len(addrs) == 0 {
		return resultNotFound, false
	}
	result = resultOK
	if truncated {
		result = resultTruncated
	}
	for a, n := range g.missed {
		if _, ok := slices.BinarySearchFunc(addrs, a, netip.Addr.Compare); ok {
			g.missed[a] = 0
		} else if n+1 >= g.cfg.RemoveAfter {
			delete(g.missed, a)
			changed = true
		} else {
			g.missed[a] = n + 1
		}
	}
	for _, a := range addrs {
		if _, ok := g.missed[a]; !ok {
			g.missed[a] = 0
			changed = true
		}
	}
	return result, changed
}

// usable sorts the addresses an answer gives, without repeats, zoned
// addresses (link-local with an interface) or any that cannot be an
// engine's. It keeps the lowest config.MaxDiscovered and says whether it
// left some out.
func usable(addrs []netip.Addr) ([]netip.Addr, bool) {
	out := make([]netip.Addr, 0, len(addrs))
	for _, a := range addrs {
		a = a.Unmap()
		if a.IsValid() && a.Zone() == "" && !a.IsUnspecified() && !a.IsMulticast() {
			out = append(out, a)
		}
	}
	slices.SortFunc(out, netip.Addr.Compare)
	out = slices.Compact(out)
	if len(out) > config.MaxDiscovered {
		return out[:config.MaxDiscovered], true
	}
	return out, false
}

// instances are the group's instances, in address order.
func (g *group) instances() []config.Instance {
	addrs := make([]netip.Addr, 0, len(g.missed))
	for a := range g.missed {
		addrs = append(addrs, a)
	}
	slices.SortFunc(addrs, netip.Addr.Compare)
	out := make([]config.Instance, len(addrs))
	for i, a := range addrs {
		out[i] = g.cfg.Instance(netip.AddrPortFrom(a, uint16(g.cfg.Port)))
	}
	return out
}
