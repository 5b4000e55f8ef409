// Package replicas keeps tether's replicas in step.
//
// Each replica decides on its own, from its own view. Nothing on the
// request path waits for another replica. Five things bring the views
// together, all through the binding store:
//
//   - The load sync (LoadSync, load.go). Every second a replica publishes
//     its requests in flight, the queue depths instances reported to it
//     and its engine readings. It takes in the others' (LoadSyncer).
//   - The shared circuits (CircuitShare, circuits.go). The instance
//     breaker's failures meet in the store, so a circuit opened or closed
//     by one replica holds everywhere. The replica whose report opened a
//     circuit moves the instance's sessions away (Circuits).
//   - The engine scrape shards (Shards, shards.go). One replica at a time
//     scrapes each shard of the fleet's engines, under a lease in the
//     store (Leases). The readings travel with the load sync.
//   - The content share (ContentShare, content.go). Each replica publishes
//     what its prefix index records: which prompt blocks went to which
//     instance. The others record it on their own index, so cache-aware
//     placement decides alike everywhere (ContentBus).
//   - The hit cache's invalidation. A replica that serves sticky hits
//     from its own cache drops a session when any replica changes its
//     binding. Every binding change publishes a message atomically with
//     it. This lives in store/redis, whose scripts publish it.
//
// The contracts the store keeps for them are declared here, where they are
// used. store/memory and store/redis implement them; store/storetest holds
// both to them.
package replicas

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/tetherproxy/tether/fleet"
)

// Name names this process among the replicas: host, pid and a random
// suffix, so two replicas never share a name, even across restarts.
func Name() string {
	host, _ := os.Hostname()
	var b [3]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%s-%d-%s", host, os.Getpid(), hex.EncodeToString(b[:]))
}

// LoadSyncer exchanges load with the other replicas through the store.
type LoadSyncer interface {
	// SyncLoad publishes r, valid for ttl, and returns the load of every
	// instance in instances. The other live replicas' reports are summed;
	// r itself is left out of InFlight and Engine. An instance nobody
	// reported has Active 0 and no InFlight, Queue or Engine entry. No map
	// is nil.
	SyncLoad(ctx context.Context, r fleet.LoadReport, instances []string, ttl time.Duration, now time.Time) (fleet.LoadState, error)
	// SetDrained adds or removes an instance from the drained set.
	SetDrained(ctx context.Context, instance string, drained bool) error
}

// CheckReport reports why r cannot be published for ttl; every LoadSyncer
// refuses the same inputs with it.
func CheckReport(r fleet.LoadReport, ttl time.Duration) error {
	switch {
	case r.Replica == "":
		return errors.New("empty replica name")
	case ttl <= 0:
		return fmt.Errorf("report ttl must be positive, got %v", ttl)
	}
	return nil
}

// Leases hands out short exclusive leases between replicas: the engine
// scrapes are split into shards, and one replica at a time holds each.
type Leases interface {
	// Lease takes name for holder until ttl from now, or renews it when
	// holder has it already; ok is false while another holder's lease
	// runs. Times are the caller's clock (store/redis uses the server's).
	Lease(ctx context.Context, name, holder string, ttl time.Duration, now time.Time) (ok bool, err error)
	// Release ends holder's lease on name at once (a replica stopping);
	// another holder's lease is left alone.
	Release(ctx context.Context, name, holder string) error
}

// CheckLease reports why Lease(name, holder, ttl) cannot be done; every
// Leases refuses the same inputs with it.
func CheckLease(name, holder string, ttl time.Duration) error {
	switch {
	case name == "":
		return errors.New("empty lease name")
	case holder == "":
		return errors.New("empty lease holder")
	case ttl < time.Millisecond:
		return fmt.Errorf("lease ttl must be at least 1ms, got %v", ttl)
	}
	return nil
}

// Circuits is the instance breaker's state shared between replicas.
// fleet.Breaker counts what one replica sees; here the fleet's counts
// meet. A circuit is closed, open until the end of its cooldown,
// or half-open once the cooldown has passed, until a probe's answer closes
// it (ReportRecovered) or opens it again (ReportFailure). Times are the
// caller's clock.
type Circuits interface {
	// ReportFailure adds one failure of instance, seen at at, to the
	// fleet's window (cfg.Window). It opens the circuit for cfg.Cooldown
	// when the window holds more than cfg.Threshold failures. member is
	// unique per report: the replica's name and a sequence number.
	//
	// A failure while the circuit is open is not counted: it was in
	// flight when the circuit opened. One while it is half-open opens it
	// again at once. opened is true only for the report that opened or
	// reopened the circuit. until is the end of the cooldown while the
	// circuit is open, zero while it is closed. An unknown instance is a
	// closed circuit, not an error.
	ReportFailure(ctx context.Context, instance string, at time.Time, member string, cfg fleet.BreakerConfig) (opened bool, until time.Time, err error)
	// ReportRecovered closes instance's circuit if it is half-open at at
	// (a probe succeeded) and forgets its failures. It reports whether it
	// closed it: false for a circuit that is closed (or unknown) or still
	// open.
	ReportRecovered(ctx context.Context, instance string, at time.Time) (closed bool, err error)
	// Circuits returns the circuits that are not closed at now, each with
	// the end of its cooldown (in the past for a half-open one); an empty
	// map when all are closed. A half-open circuit nobody probed for
	// StaleCircuit is dropped (the instance left the fleet, or takes no
	// traffic).
	Circuits(ctx context.Context, now time.Time) (map[string]time.Time, error)
}

// StaleCircuit is how long a half-open circuit may wait for a probe
// before Circuits forgets it.
const StaleCircuit = 24 * time.Hour

// CheckFailure reports why a failure report cannot be counted; every
// Circuits refuses the same inputs with it.
func CheckFailure(instance, member string, cfg fleet.BreakerConfig) error {
	switch {
	case instance == "" || member == "":
		return errors.New("empty instance or member")
	case cfg.Window <= 0 || cfg.Cooldown <= 0 || cfg.Threshold < 0:
		return fmt.Errorf("bad breaker config %+v", cfg)
	}
	return nil
}
