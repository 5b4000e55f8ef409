// Package bindings is the vocabulary of the binding store. It says what
// tether keeps of a session: its binding to one instance, its lifetime,
// and an operator's pending move. It also says what a store reports of its
// backend.
//
// It holds types and the input checks every store applies alike, nothing
// else. The decision (affinity), the stores (store/memory, store/redis)
// and the packages that read sessions (admin, metrics, replicas) all speak
// it. Each declares the store interface it uses itself.
//
// "Not found" is never an error. Each method of a store says what it
// returns instead.
package bindings

import (
	"errors"
	"fmt"
	"time"
)

// Binding ties a session key to one instance and the model version the
// session runs on.
type Binding struct {
	Instance string    // instance name
	Version  string    // model version the session started on (or was migrated to); may be empty
	Since    time.Time // when the session was (last) placed; max_sticky_duration counts from here
	// Failovers counts the times the fallback ladder rebound the session
	// because its instance failed, up to MaxFailovers. A new placement, a
	// bind or rebind, starts at 0. A Replace stores the value it is given.
	Failovers int
}

// MaxFailovers is how many rebinding failovers a session takes before the
// fallback ladder routes it at random. Binding.Failovers counts them, up
// to this.
const MaxFailovers = 2

// Lifetime says how long a binding lives.
type Lifetime struct {
	Idle time.Duration // the binding expires after this long without use; every use refreshes it
	Max  time.Duration // a binding older than this is placed again (0: no limit)
}

// Origin says where the binding GetOrBind returns comes from.
type Origin int

const (
	// Found means an existing binding was returned and its idle timeout refreshed.
	Found Origin = iota + 1
	// Created means there was no binding; the candidate was stored.
	Created
	// Renewed means the binding had outlived Lifetime.Max; the candidate replaced it.
	Renewed
)

func (o Origin) String() string {
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
	// Candidate is stored when the session has no binding, or its binding
	// outlived Lifetime.Max. Candidate.Since is "now" for the store.
	Candidate Binding
	Lifetime  Lifetime
}

// Result is what GetOrBind returns.
type Result struct {
	// Key is the session key the binding is stored under. That is
	// Lookup.Key, or the key Lookup.Key is linked to when it is an alias.
	// Replace takes it.
	Key     string
	Binding Binding
	Origin  Origin
	// Move is a pending operator move. It is set only when Found.
	Move Move
	// Previous is the binding the candidate replaced. It is set only when
	// Renewed. With it, a session re-placed after Lifetime.Max keeps its
	// model version.
	Previous Binding
	// Requests is how many requests the session has made, this one
	// included. It is 1 when Created, and one more than before when Found
	// or Renewed. A renewal places the same conversation again. Replace
	// keeps the count. A binding stored before the store kept counts
	// starts from 0.
	Requests int
	// Idle is how long the session had gone unused before this request.
	// It is set only when Found, and is 0 when the store cannot tell. A
	// store that serves hits from a replica's cache counts from the last
	// use that replica saw. So it may say longer than it was.
	Idle time.Duration
}

// Session is one stored session. Operators see it in tether sessions
// show. It also serves to move an instance's sessions away.
type Session struct {
	Key     string        // the session key (after following an alias)
	Binding Binding       //
	Move    Move          // pending operator move
	TTL     time.Duration // until the binding expires if unused
}

// MarkFilter selects the sessions a Mark acts on.
type MarkFilter struct {
	Instance string // sessions in this instance's index
	Version  string // only those whose binding records this version ("" any)
	Limit    int    // mark at most this many (0: all)
}

// CheckBinding reports why b cannot be stored with lt. Every store refuses
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
// done. Every store refuses the same inputs with it.
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

// CheckBound reports why Bound(instance, limit) cannot be done. Every
// store refuses the same inputs with it.
func CheckBound(instance string, limit int) error {
	switch {
	case instance == "":
		return errors.New("empty instance name")
	case limit < 0:
		return fmt.Errorf("limit must not be negative, got %d", limit)
	}
	return nil
}
