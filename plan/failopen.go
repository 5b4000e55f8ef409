package plan

import (
	"sort"
	"sync/atomic"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/ringhash"
	"github.com/tetherproxy/tether/xds"
)

// failOpen is Envoy's fail-open pool as s builds it, for the decider
// (affinity.WithFailOpen). It holds:
//   - the default route's pool: s.DefaultVersion, else the version with
//     the most instances, as xds picks it;
//   - a ring over its instances, keyed by their names as xds sets each
//     endpoint's hash_key, and weighted as xds weights them
//     (ringhash.LBWeights of the instance weights);
//   - the route's header hash policies.
//
// It is nil when the pools do not hash (pool_lb round_robin or
// least_request).
func failOpen(s xds.Spec) affinity.FailOpen {
	if s.PoolLB != xds.RingHash || len(s.HashPolicy) == 0 {
		return nil
	}
	policies := make([]ringhash.Policy, len(s.HashPolicy))
	for i, h := range s.HashPolicy {
		policies[i] = ringhash.Policy{Header: h.Name, Terminal: h.Terminal}
	}
	version := s.DefaultVersion
	var cur atomic.Pointer[pool]
	return func(h identity.Headers, all []fleet.Instance) (string, bool) {
		if h == nil {
			return "", false
		}
		hash, ok := ringhash.Hash(policies, h.Get)
		if !ok {
			return "", false
		}
		p := cur.Load()
		if !p.of(all) {
			p = newPool(all, version)
			cur.Store(p)
		}
		if len(p.keys) == 0 {
			return "", false
		}
		return p.keys[p.ring.Pick(hash)], true
	}
}

// pool is the fail-open pool of one fleet snapshot: the instances of the
// default route's version, and Envoy's ring over them. The fleet hands out
// immutable snapshots, so a pool is built once per snapshot, not per
// session.
type pool struct {
	first *fleet.Instance // the snapshot's first instance, and its length
	n     int
	keys  []string
	ring  *ringhash.Ring
}

// of reports whether p is the pool of snapshot all.
func (p *pool) of(all []fleet.Instance) bool {
	return p != nil && p.n == len(all) && (len(all) == 0 || p.first == &all[0])
}

// newPool builds the pool of snapshot all: version's instances (the
// version with the most instances when version is ""), weighted as xds
// weights the pool's endpoints (ringhash.LBWeights).
func newPool(all []fleet.Instance, version string) *pool {
	p := &pool{n: len(all)}
	if len(all) > 0 {
		p.first = &all[0]
	}
	if version == "" {
		version = mostInstances(all)
	}
	var weights []float64
	for _, in := range all {
		if in.Version == version {
			p.keys, weights = append(p.keys, in.Name), append(weights, in.Weight)
		}
	}
	p.ring = ringhash.NewWeighted(p.keys, ringhash.LBWeights(nil, weights), ringhash.DefaultMinSize)
	return p
}

// mostInstances is the version with the most instances, ties to the first
// in sorted order (xds's defaultVersion).
func mostInstances(all []fleet.Instance) string {
	n := map[string]int{}
	for _, in := range all {
		n[in.Version]++
	}
	versions := make([]string, 0, len(n))
	for v := range n {
		versions = append(versions, v)
	}
	sort.Strings(versions)
	best := ""
	for _, v := range versions {
		if best == "" || n[v] > n[best] {
			best = v
		}
	}
	return best
}
