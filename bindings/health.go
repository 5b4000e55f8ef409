package bindings

import (
	"fmt"
	"time"
)

// GuardState is the state of a store's guard on its backend. In
// store/redis the guard is the hook that stops calling Redis after calls
// failed in a row. It is not the instance breaker (fleet.Breaker), nor
// Envoy's circuit breakers.
type GuardState int32

// The guard's states.
const (
	// GuardClosed: calls go to the backend.
	GuardClosed GuardState = iota
	// GuardOpen: calls fail at once until the cooldown has passed.
	GuardOpen
	// GuardHalfOpen: one probe call is on its way to the backend. The
	// others fail at once. The probe's success closes the guard. Its
	// failure opens the guard again for twice the cooldown.
	GuardHalfOpen
)

func (s GuardState) String() string {
	switch s {
	case GuardClosed:
		return "closed"
	case GuardOpen:
		return "open"
	case GuardHalfOpen:
		return "half-open"
	}
	return fmt.Sprintf("GuardState(%d)", int32(s))
}

// Health is the state of a store's guard on its backend, for readiness
// probes and metrics.
type Health struct {
	// State is the guard's state. Anything but GuardClosed means the
	// backend is taken as unreachable. Callers then decide without it.
	State GuardState
	// Failures is how many calls in a row have failed, probes included.
	// It is 0 after a success.
	Failures int
	// LastError is the text of the last failure, with secrets removed. It
	// is kept after recovery.
	LastError string
	// Since is when the guard last opened or closed. A probe does not move
	// it. If the guard never opened, Since is when the store was built.
	Since time.Time
	// Opens counts the guard's openings from closed, a start without the
	// backend included. Reopenings after a failed probe are not counted.
	Opens uint64
	// Hits says how a sticky hit is served: "cached", with no round trip,
	// or "one round trip". It is empty for a store without a backend.
	Hits string
}

// Up reports whether the backend is taken as reachable.
func (h Health) Up() bool { return h.State == GuardClosed }
