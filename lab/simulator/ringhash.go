package simulator

import (
	"github.com/tetherproxy/tether/lab/workload"
	"github.com/tetherproxy/tether/ringhash"
)

// DefaultRingSize is Envoy's default minimum_ring_size for RING_HASH.
const DefaultRingSize = ringhash.DefaultMinSize

// MaxRingSize is Envoy's default maximum_ring_size.
const MaxRingSize = ringhash.MaxSize

// envoyPolicies are the hash policies of tether's routes
// (xds/resources.go): x-session-id (terminal), else authorization
// (terminal), else x-device-id then x-user-id.
var envoyPolicies = []ringhash.Policy{
	{Header: workload.SessionHeader, Terminal: true},
	{Header: workload.AuthHeader, Terminal: true},
	{Header: workload.DeviceHeader},
	{Header: workload.UserHeader, Terminal: true},
}

// envoyHash is the hash Envoy computes from a request's headers with the
// hash policies of tether's routes, as package ringhash computes it for
// tether's own placement (so the simulated ring hash and tether's
// fail-open placement are Envoy's, by the same code). ok is false when no
// header is present: Envoy then picks the host from a random hash.
func envoyHash(headers []workload.Header) (h uint64, ok bool) {
	return ringhash.Hash(envoyPolicies, func(name string) string {
		for _, hd := range headers {
			if hd.Name == name {
				return hd.Value
			}
		}
		return ""
	})
}
