package affinity

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Binding ties a session key to one instance.
type Binding struct {
	Instance string    // instance name
	Since    time.Time // when the session was (last) placed; max_sticky_duration counts from here
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

// Store keeps session bindings. Keys are already hashed by the identity
// package; a store may prefix them but never sees a raw identifier.
//
// Both methods are atomic: two callers racing on the same key observe one
// winner and both return the winner's binding. Each is one round trip to a
// remote store. A missing key is not an error.
type Store interface {
	// GetOrBind returns the binding of key, refreshing its idle timeout. When
	// there is none, or it is older than lt.Max measured at candidate.Since,
	// candidate is stored and returned.
	GetOrBind(ctx context.Context, key string, candidate Binding, lt Lifetime) (Binding, Outcome, error)
	// Replace moves key to next if it is still bound to instance old (or not
	// bound at all), and returns the binding now stored: next on success, the
	// binding another caller stored first otherwise.
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
	case lt.Idle <= 0:
		return fmt.Errorf("idle lifetime must be positive, got %v", lt.Idle)
	case lt.Max < 0:
		return fmt.Errorf("max lifetime must not be negative, got %v", lt.Max)
	}
	return nil
}
