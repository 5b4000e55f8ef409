// Package affinity decides which instance serves a request. It is the
// decision core: plain Go structs in and out, no gRPC, Envoy or Redis. It
// declares the Store it needs (store.go); store/memory and store/redis
// provide it.
package affinity

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
)

// Mode is the routing policy.
type Mode string

const (
	Sticky Mode = "sticky"
	Random Mode = "random"
)

// Kind says how a decision was reached; it is what x-tether-decision shows
// and what metrics count.
type Kind string

const (
	KindHit       Kind = "hit"       // an existing binding was used
	KindBind      Kind = "bind"      // a new session was placed and bound
	KindRebind    Kind = "rebind"    // the binding outlived max_sticky_duration and was placed again
	KindMoved     Kind = "moved"     // the bound instance left the fleet; the session was placed again
	KindRandom    Kind = "random"    // random mode (or sticky disabled)
	KindAnonymous Kind = "anonymous" // no usable identity: routed at random
	KindDegraded  Kind = "degraded"  // the store failed: placed by rendezvous hashing without it
)

// ErrNoInstance means the fleet has no healthy instance.
var ErrNoInstance = errors.New("no healthy instance")

// ErrFleetMismatch means the store holds a binding to an instance this
// replica's fleet does not have.
var ErrFleetMismatch = errors.New("session bound to an instance unknown to this replica")

// Policy is the part of the configuration the decision reads.
type Policy struct {
	Mode     Mode
	Lifetime Lifetime
}

// Fleet is what the decision needs to know about instances.
type Fleet interface {
	Healthy() []fleet.Instance
}

// Decision is the outcome for one request.
type Decision struct {
	Instance fleet.Instance
	Mode     Mode
	Kind     Kind
	// Err is the store error behind a degraded decision, for logging.
	Err error
}

// Decider makes decisions. It is safe for concurrent use.
type Decider struct {
	store  Store
	fleet  Fleet
	policy Policy
	now    func() time.Time
	rand   func() uint64
}

// Option configures a Decider.
type Option func(*Decider)

// WithClock injects the clock (tests).
func WithClock(now func() time.Time) Option { return func(d *Decider) { d.now = now } }

// WithRand injects the random source used by random routing. It must be safe
// for concurrent use.
func WithRand(r func() uint64) Option { return func(d *Decider) { d.rand = r } }

// New returns a Decider.
func New(store Store, f Fleet, p Policy, opts ...Option) *Decider {
	d := &Decider{store: store, fleet: f, policy: p, now: time.Now, rand: rand.Uint64}
	for _, o := range opts {
		o(d)
	}
	return d
}

// Decide picks the instance for a request from caller id.
func (d *Decider) Decide(ctx context.Context, id identity.Identity) (Decision, error) {
	healthy := d.fleet.Healthy()
	if len(healthy) == 0 {
		return Decision{}, ErrNoInstance
	}
	switch {
	case d.policy.Mode != Sticky:
		return d.random(healthy, KindRandom), nil
	case id.Anonymous():
		return d.random(healthy, KindAnonymous), nil
	}
	return d.sticky(ctx, id.Key, healthy)
}

func (d *Decider) sticky(ctx context.Context, key string, healthy []fleet.Instance) (Decision, error) {
	place := Rendezvous(key, healthy)
	cand := Binding{Instance: place.Name, Since: d.now()}
	b, out, err := d.store.GetOrBind(ctx, key, cand, d.policy.Lifetime)
	if err != nil {
		return d.storeFailed(ctx, place, err)
	}
	kind := KindHit
	switch out {
	case Created:
		kind = KindBind
	case Renewed:
		kind = KindRebind
	}
	if in, ok := find(healthy, b.Instance); ok {
		return Decision{Instance: in, Mode: Sticky, Kind: kind}, nil
	}
	// The binding names an instance that is no longer in the fleet: move
	// the session, unless another replica already did.
	b, err = d.store.Replace(ctx, key, b.Instance, cand, d.policy.Lifetime)
	if err != nil {
		return d.storeFailed(ctx, place, err)
	}
	if in, ok := find(healthy, b.Instance); ok {
		return Decision{Instance: in, Mode: Sticky, Kind: KindMoved}, nil
	}
	// Another replica moved the session to an instance this one does not
	// know (their fleets differ, as during a rollout): route by our own
	// placement for now, and say so.
	return Decision{Instance: place, Mode: Sticky, Kind: KindDegraded, Err: fmt.Errorf("%w: %s", ErrFleetMismatch, b.Instance)}, nil
}

// storeFailed places by rendezvous hashing when the store fails, unless the
// request itself is gone (Envoy's message timeout, a client that left):
// that is not the store's fault and nobody waits for the answer.
func (d *Decider) storeFailed(ctx context.Context, place fleet.Instance, err error) (Decision, error) {
	if ctx.Err() != nil {
		return Decision{}, ctx.Err()
	}
	return Decision{Instance: place, Mode: Sticky, Kind: KindDegraded, Err: err}, nil
}

func find(instances []fleet.Instance, name string) (fleet.Instance, bool) {
	for _, in := range instances {
		if in.Name == name {
			return in, true
		}
	}
	return fleet.Instance{}, false
}

// random picks an instance with probability proportional to its weight.
func (d *Decider) random(healthy []fleet.Instance, kind Kind) Decision {
	total := 0.0
	for _, in := range healthy {
		total += in.Weight
	}
	// 53 random bits give a uniform float in [0,1).
	x := float64(d.rand()>>11) / (1 << 53) * total
	pick := healthy[len(healthy)-1]
	for _, in := range healthy {
		if x < in.Weight {
			pick = in
			break
		}
		x -= in.Weight
	}
	return Decision{Instance: pick, Mode: d.policy.Mode, Kind: kind}
}
