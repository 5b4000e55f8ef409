package server

import (
	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/fleet"
)

// fleetView is what the per-instance gauges read (metrics.FleetView): the
// current fleet, this replica's view of its load, and the breaker.
type fleetView struct {
	fleet   *fleet.Fleet
	load    *affinity.Load
	breaker *fleet.Breaker
}

func (v fleetView) Instances() []string {
	all := v.fleet.All()
	out := make([]string, len(all))
	for i, in := range all {
		out[i] = in.Name
	}
	return out
}

func (v fleetView) InFlight(instance string) int { return v.load.InFlight(instance) }
func (v fleetView) Queue(instance string) int    { return v.load.Queue(instance) }
func (v fleetView) Active(instance string) int   { return v.load.Active(instance) }

// Available reports whether the instance takes requests: not drained, and
// its breaker not open. A half-open instance takes its probe. Instances
// lists only those in the fleet.
func (v fleetView) Available(instance string) bool {
	return !v.load.Drained(instance) && v.breaker.State(instance) != fleet.Open
}
