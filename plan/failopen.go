package plan

import (
	"sort"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/ringhash"
	"github.com/tetherproxy/tether/xds"
)

// failOpen is Envoy's fail-open pool as s builds it, for the decider
// (affinity.WithFailOpen): the default route's pool (s.DefaultVersion, else
// the version with the most instances, as xds picks it), a ring over its
// instances keyed by their names (xds sets each pool endpoint's hash_key
// to it) and weighted as xds weights them (each endpoint's
// load_balancing_weight is ringhash.LBWeights of the pool's instance
// weights), and the route's header hash policies. nil when the pools do
// not hash (pool_lb round_robin or least_request).
func failOpen(s xds.Spec) affinity.FailOpen {
	if s.PoolLB != xds.RingHash || len(s.HashPolicy) == 0 {
		return nil
	}
	policies := make([]ringhash.Policy, len(s.HashPolicy))
	for i, h := range s.HashPolicy {
		policies[i] = ringhash.Policy{Header: h.Name, Terminal: h.Terminal}
	}
	var ring ringhash.Cache
	version := s.DefaultVersion
	return func(h identity.Headers, all []fleet.Instance) (string, bool) {
		if h == nil {
			return "", false
		}
		hash, ok := ringhash.Hash(policies, h.Get)
		if !ok {
			return "", false
		}
		v := version
		if v == "" {
			v = mostInstances(all)
		}
		var kbuf [16]string
		var wbuf [16]float64
		keys, weights := kbuf[:0], wbuf[:0]
		for _, in := range all {
			if in.Version == v {
				keys, weights = append(keys, in.Name), append(weights, in.Weight)
			}
		}
		i := ring.PickWeighted(keys, weights, hash)
		if i < 0 {
			return "", false
		}
		return keys[i], true
	}
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
