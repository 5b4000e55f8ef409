// Package fleet holds the GPU instances tether routes to. It knows nothing of
// Envoy, gRPC or Redis: the decision core reads it, the xDS and ext_proc edges
// turn its instances into clusters and header values.
package fleet

import (
	"net/netip"
	"sync/atomic"
)

// ClusterPrefix is the prefix of the Envoy cluster that serves one instance.
const ClusterPrefix = "inst-"

// Instance is one model server.
type Instance struct {
	Name    string
	Address string // host:port
	Zone    string
	Version string
	Weight  float64
	// KVSessions is the number of conversations whose KV cache the
	// instance keeps: below it, placement never counts the instance as
	// overloaded.
	KVSessions int
	// Capacity is Spot, or on-demand ("" or anything else).
	Capacity string
	// Engine is the serving engine whose metrics tether scrapes ("vllm",
	// "sglang"), at MetricsURL; "" for one it does not scrape.
	Engine     string
	MetricsURL string
}

// Spot is the capacity of instances that may be reclaimed at short
// notice: random traffic prefers them, sticky sessions avoid them.
const Spot = "spot"

// Spot reports whether the instance is spot capacity.
func (i Instance) Spot() bool { return i.Capacity == Spot }

// Cluster is the name of the Envoy cluster that holds only this instance.
func (i Instance) Cluster() string { return ClusterPrefix + i.Name }

// Fleet is the current set of instances. Readers get an immutable snapshot;
// Replace swaps it atomically, so a decision never sees half an update.
type Fleet struct {
	cur atomic.Pointer[snapshot]
}

type snapshot struct {
	all    []Instance
	byName map[string]int
	byAddr map[string]int // by Endpoint(Address)
}

// New returns a fleet holding instances.
func New(instances []Instance) *Fleet {
	f := &Fleet{}
	f.Replace(instances)
	return f
}

// Replace installs a new set of instances.
func (f *Fleet) Replace(instances []Instance) {
	s := &snapshot{all: append([]Instance(nil), instances...),
		byName: make(map[string]int, len(instances)), byAddr: make(map[string]int, len(instances))}
	for i, in := range s.all {
		s.byName[in.Name] = i
		if _, taken := s.byAddr[Endpoint(in.Address)]; !taken {
			s.byAddr[Endpoint(in.Address)] = i
		}
	}
	f.cur.Store(s)
}

// All returns every configured instance. The slice is shared and must not
// be modified. Health is not the fleet's: the instance breaker (Breaker)
// and drains are applied by the decision on top of it, so a circuit's
// state never changes the fleet.
func (f *Fleet) All() []Instance { return f.cur.Load().all }

// AtAddress finds the instance at addr, a host:port. An IP address
// matches in any of its spellings: "[::1]:80" is "[0:0::1]:80". Of two
// instances at one address, the first configured is found.
func (f *Fleet) AtAddress(addr string) (Instance, bool) {
	s := f.cur.Load()
	i, ok := s.byAddr[Endpoint(addr)]
	if !ok {
		return Instance{}, false
	}
	return s.all[i], true
}

// Endpoint is addr in one spelling: an IP address and port as
// netip.AddrPort writes them, IPv6 in brackets. A host name, or anything
// that is not an IP address and port, is returned as it is.
func Endpoint(addr string) string {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return addr
	}
	return netip.AddrPortFrom(ap.Addr().Unmap().WithZone(""), ap.Port()).String()
}

// Lookup finds an instance by name.
func (f *Fleet) Lookup(name string) (Instance, bool) {
	s := f.cur.Load()
	i, ok := s.byName[name]
	if !ok {
		return Instance{}, false
	}
	return s.all[i], true
}
