package affinity

// The store interfaces, next to each other. Each consumer depends on the
// ones it uses; store/memory and store/redis implement them all, and
// store.Open returns them together (store.Store):
//
//	Store         the hot path: GetOrBind, Replace (the Decider)
//	SessionIndex  Show, Mark, Bound (the admin API, evacuation)
//	LoadSyncer    SyncLoad, SetDrained (the load sync, drains)
//	Circuits      ReportFailure, ReportRecovered, Circuits (the instance
//	              breaker shared between replicas)
//	Counts        Requests (the session-length metrics)
//	Checker       Ping, Health (readiness, /readyz)
//
// "Not found" is never an error: each method says what it returns instead.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/tetherproxy/tether/fleet"
)

// Binding ties a session key to one instance and the model version the
// session runs on.
type Binding struct {
	Instance string    // instance name
	Version  string    // model version the session started on (or was migrated to); may be empty
	Since    time.Time // when the session was (last) placed; max_sticky_duration counts from here
	// Failovers counts the times the session was rebound because its
	// instance failed (the fallback ladder), up to 2. A new placement
	// (bind, rebind) starts at 0; a Replace stores the value it is given.
	Failovers int
}

// Lifetime says how long a binding lives.
type Lifetime struct {
	Idle time.Duration // the binding expires after this long without use; every use refreshes it
	Max  time.Duration // a binding older than this is placed again (0: no limit)
}

// Outcome tells what GetOrBind found.
type Outcome int

const (
	// Found: an existing binding was returned and its idle timeout refreshed.
	Found Outcome = iota + 1
	// Created: there was no binding; the candidate was stored.
	Created
	// Renewed: the binding had outlived Lifetime.Max; the candidate replaced it.
	Renewed
)

func (o Outcome) String() string {
	switch o {
	case Found:
		return "found"
	case Created:
		return "created"
	case Renewed:
		return "renewed"
	}
	return "unknown"
}

// Move is an operator's request, stored with a binding, that the session be
// placed again at its next turn. Replace clears it.
type Move struct {
	Version string // move to this model version (blue-green migration)
	Off     string // move off this instance (drain)
}

// Pending reports whether a move was requested.
func (m Move) Pending() bool { return m.Version != "" || m.Off != "" }

// Lookup is one GetOrBind request.
type Lookup struct {
	// Key is the strongest identity key of the request.
	Key string
	// Aliases are the weaker keys the request also carried. Each is linked
	// to the session for the session's idle lifetime, so a later request
	// that carries only one of them finds the same session.
	Aliases []string
	// Candidate is stored when the session has no binding (or it outlived
	// Lifetime.Max). Candidate.Since is "now" for the store.
	Candidate Binding
	Lifetime  Lifetime
}

// Result is what GetOrBind returns.
type Result struct {
	// Key is the session key the binding is stored under: Lookup.Key, or
	// the key Lookup.Key is linked to when it is an alias. Replace takes it.
	Key     string
	Binding Binding
	Outcome Outcome
	// Move is a pending operator move (only on Found).
	Move Move
	// Previous is the binding the candidate replaced (only on Renewed), so
	// that a session re-placed after Lifetime.Max keeps its model version.
	Previous Binding
	// Requests is how many requests the session has made, this one
	// included: 1 when Created, one more than before when Found or Renewed
	// (a renewal places the same conversation again). Replace keeps it. A
	// binding stored before the store kept counts starts from 0.
	Requests int
}

// Store keeps session bindings. Keys are already hashed by the identity
// package; a store may prefix them but never sees a raw identifier.
//
// Both methods are atomic per session: two callers racing on the same key
// observe one winner and both return the winner's binding. A missing key
// is not an error: GetOrBind binds the candidate (Created), Replace stores
// next.
//
// A store also keeps, per instance, an index of the sessions bound to it
// (members expire with the sessions), so that active sessions can be
// counted and an instance's sessions found (SessionIndex).
type Store interface {
	// GetOrBind resolves l.Key (following an alias link when l.Key has
	// one), links l.Aliases to the resolved key, and returns its binding,
	// refreshing its idle timeout. When there is none, or it is older than
	// l.Lifetime.Max measured at l.Candidate.Since, the candidate is stored
	// and returned. Either way the request is counted (Result.Requests).
	// A hit is one round trip to a remote store.
	GetOrBind(ctx context.Context, l Lookup) (Result, error)
	// Replace moves key to next if it is still bound to instance old (or not
	// bound at all), clears any pending Move, and returns the binding now
	// stored: next on success, the binding another caller stored first
	// otherwise. The session's request count is kept (it starts again from
	// 0 when there was no binding). key is a Result.Key, never an alias.
	Replace(ctx context.Context, key, old string, next Binding, lt Lifetime) (Binding, error)
}

// CheckBinding reports why b cannot be stored with lt. Every Store refuses
// the same inputs with it, so they behave alike on bad input.
func CheckBinding(b Binding, lt Lifetime) error {
	switch {
	case b.Instance == "":
		return errors.New("empty instance name")
	case b.Since.IsZero():
		return errors.New("zero since time")
	case b.Failovers < 0 || b.Failovers > MaxFailovers:
		return fmt.Errorf("failovers must be 0 to %d, got %d", MaxFailovers, b.Failovers)
	case lt.Idle <= 0:
		return fmt.Errorf("idle lifetime must be positive, got %v", lt.Idle)
	case lt.Max < 0:
		return fmt.Errorf("max lifetime must not be negative, got %v", lt.Max)
	}
	return nil
}

// CheckMark reports why a Mark of m on the sessions f selects cannot be
// done; every SessionIndex refuses the same inputs with it.
func CheckMark(f MarkFilter, m Move) error {
	switch {
	case f.Instance == "":
		return errors.New("empty instance name")
	case f.Limit < 0:
		return fmt.Errorf("limit must not be negative, got %d", f.Limit)
	case !m.Pending():
		return errors.New("empty move")
	}
	return nil
}

// CheckBound reports why Bound(instance, limit) cannot be done; every
// SessionIndex refuses the same inputs with it.
func CheckBound(instance string, limit int) error {
	switch {
	case instance == "":
		return errors.New("empty instance name")
	case limit < 0:
		return fmt.Errorf("limit must not be negative, got %d", limit)
	}
	return nil
}

// CheckReport reports why r cannot be published for ttl; every LoadSyncer
// refuses the same inputs with it.
func CheckReport(r LoadReport, ttl time.Duration) error {
	switch {
	case r.Replica == "":
		return errors.New("empty replica name")
	case ttl <= 0:
		return fmt.Errorf("report ttl must be positive, got %v", ttl)
	}
	return nil
}

// Session is one stored session, for operators (tether sessions show).
type Session struct {
	Key     string        // the session key (after following an alias)
	Binding Binding       //
	Move    Move          // pending operator move
	TTL     time.Duration // until the binding expires if unused
}

// MarkFilter selects the sessions Mark acts on.
type MarkFilter struct {
	Instance string // sessions in this instance's index
	Version  string // only those whose binding records this version ("" any)
	Limit    int    // mark at most this many (0: all)
}

// SessionIndex is what operations need beyond the hot path: reading one
// session, counting the sessions per instance, and asking sessions to move.
type SessionIndex interface {
	// Show returns the session stored under key (following an alias link).
	// ok is false when there is none.
	Show(ctx context.Context, key string, now time.Time) (s Session, ok bool, err error)
	// Mark stores m as a pending move on the sessions selected by f that
	// have no pending move yet, and returns how many it marked and how many
	// selected sessions are still unmarked after it (0, 0 for an instance
	// without sessions).
	Mark(ctx context.Context, f MarkFilter, m Move, now time.Time) (marked, remaining int, err error)
	// Bound returns up to limit (0: all) of the sessions bound to instance,
	// read from its index; entries whose binding is gone or elsewhere are
	// left out (none: an empty slice, no error). TTL is each session's
	// remaining idle lifetime.
	Bound(ctx context.Context, instance string, limit int, now time.Time) ([]Session, error)
}

// LoadReport is what one tether replica tells the others about the
// requests it has in flight and the queue depth instances last reported to it.
type LoadReport struct {
	Replica  string
	InFlight map[string]int // instance → requests this replica has in flight to it
	Queue    map[string]int // instance → queue depth it last reported (absent: none known)
	// Engine holds the readings of the engines this replica scrapes.
	Engine map[string]EngineReading
}

// LoadState is the fleet's load as all replicas see it together.
type LoadState struct {
	Active   map[string]int  // instance → active sessions (from the session index)
	InFlight map[string]int  // instance → requests in flight, summed over the other live replicas
	Queue    map[string]int  // instance → the highest queue depth any live replica last saw
	Drained  map[string]bool // instances an operator is draining
	// Engine is the newest engine reading of each instance any other live
	// replica reported (absent: none).
	Engine map[string]EngineReading
}

// LoadSyncer exchanges load with the other replicas through the store.
type LoadSyncer interface {
	// SyncLoad publishes r (valid for ttl) and returns the load of every
	// instance in instances, with the other live replicas' reports summed
	// (r itself is left out of InFlight and Engine). An instance nobody
	// reported has Active 0 and no InFlight, Queue or Engine entry; no map
	// is nil.
	SyncLoad(ctx context.Context, r LoadReport, instances []string, ttl time.Duration, now time.Time) (LoadState, error)
	// SetDrained adds or removes an instance from the drained set.
	SetDrained(ctx context.Context, instance string, drained bool) error
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

// Circuits is the instance breaker's state shared between replicas
// (fleet.Breaker counts what one replica sees; this is where the fleet's
// counts meet). A circuit is closed, open until the end of its cooldown,
// or half-open once the cooldown has passed, until a probe's answer closes
// it (ReportRecovered) or opens it again (ReportFailure). Times are the
// caller's clock.
type Circuits interface {
	// ReportFailure adds one failure of instance, seen at at, to the
	// fleet's window (cfg.Window) and opens the circuit for cfg.Cooldown
	// when the window holds more than cfg.Threshold failures. member is
	// unique per report (replica name and a sequence number). A failure
	// while the circuit is open is not counted (it was in flight when the
	// circuit opened); one while it is half-open opens it again at once.
	// opened is true only for the report that opened (or reopened) the
	// circuit; until is the end of its cooldown while it is open, zero
	// while it is closed. An unknown instance is a closed circuit, not an
	// error.
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

// Counts reads the sessions' request counts (Result.Requests), for the
// session-length metrics.
type Counts interface {
	// Requests returns the request count of each session key's live
	// binding at now, in the order of keys: 0 for a key without one
	// (ended, never bound). keys are session keys (Result.Key): an alias
	// link is not followed.
	Requests(ctx context.Context, keys []string, now time.Time) ([]int, error)
}

// Checker tells readiness whether the store reaches its backend.
type Checker interface {
	// Ping returns nil when the backend answers (a store without one
	// always does). It is bounded like a call of the request path, and
	// refused at once while the store's guard is open.
	Ping(ctx context.Context) error
	// Health returns the state of the store's guard on its backend,
	// without a round trip. A store without a backend is always up.
	Health() StoreHealth
}

// GuardState is the state of a store's guard on its backend (store/redis:
// the hook that stops calling Redis after it failed calls in a row). It is
// not the instance breaker (fleet.Breaker), nor Envoy's circuit breakers.
type GuardState int32

// The guard's states.
const (
	// GuardClosed: calls go to the backend.
	GuardClosed GuardState = iota
	// GuardOpen: calls fail at once until the cooldown has passed.
	GuardOpen
	// GuardHalfOpen: one probe call is on its way to the backend; the
	// others fail at once. Its success closes the guard, its failure opens
	// it again for twice the cooldown.
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

// StoreHealth is the state of a store's guard, for readiness probes and
// metrics.
type StoreHealth struct {
	// State is the guard's state. Anything but GuardClosed means the
	// backend is taken as unreachable: callers decide without it.
	State GuardState
	// Failures is how many calls in a row have failed, probes included; 0
	// after a success.
	Failures int
	// LastError is the text of the last failure, with secrets removed; it
	// is kept after recovery.
	LastError string
	// Since is when the guard last opened or closed (a probe does not
	// move it), or when the store was built if it never opened.
	Since time.Time
	// Opens counts the guard's openings from closed, a start without the
	// backend included; reopenings after a failed probe are not counted.
	Opens uint64
	// Hits says how a sticky hit is served: "cached" (no round trip),
	// "one round trip", or empty for a store without a backend.
	Hits string
}

// Up reports whether the backend is taken as reachable.
func (h StoreHealth) Up() bool { return h.State == GuardClosed }
