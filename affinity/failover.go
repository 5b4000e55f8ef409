package affinity

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/fleet"
)

// Fallback is what happens to a session whose instance is unavailable (its
// breaker is open): fallback_policy.
type Fallback string

const (
	// Gradual walks the ladder: another instance in the session's zone,
	// then another zone, then random routing for the session.
	Gradual Fallback = "gradual"
	// FallbackRandom routes the session at random while its instance is out.
	FallbackRandom Fallback = "random"
	// FallbackNone refuses the session's requests (ErrInstanceUnavailable)
	// while its instance is out.
	FallbackNone Fallback = "none"
)

// Stage is a step of the fallback ladder.
type Stage int

// The rungs of the ladder.
const (
	StageNone      Stage = iota
	StageSameZone        // rebound to another instance of the failed one's zone
	StageOtherZone       // rebound to an instance of another zone
	StageRandom          // routed at random, binding kept, while its instance is out
)

func (s Stage) String() string {
	switch s {
	case StageSameZone:
		return "same_zone"
	case StageOtherZone:
		return "other_zone"
	case StageRandom:
		return "random"
	}
	return "none"
}

// ErrInstanceUnavailable means the session's instance is unavailable and
// fallback_policy is "none".
var ErrInstanceUnavailable = errors.New("the session's instance is unavailable")

// WithBreaker gives the decider the instance breaker: instances whose
// circuit is open take no requests, and their sessions walk the fallback
// ladder. Without it every instance counts as available.
func WithBreaker(b *fleet.Breaker) Option { return func(d *Decider) { d.breaker = b } }

// Breaker returns the decider's breaker (nil when it has none).
func (d *Decider) Breaker() *fleet.Breaker { return d.breaker }

// out reports whether instance, missing from the available instances of
// a decision, was left out by the breaker: it is in the fleet and not
// drained. (Asking the breaker again could race with a cooldown that ends
// meanwhile.)
func (d *Decider) out(instance string) bool {
	if d.breaker == nil || d.load.Drained(instance) {
		return false
	}
	_, ok := find(d.fleet.All(), instance)
	return ok
}

// ladderMemory is how long the ladder remembers a session's failovers: a
// session whose last failover is older starts again at the first rung
// (and a session on the random rung gets a binding again).
const ladderMemory = 10 * time.Minute

// failovers is how many times the session bound as b has failed over,
// as the ladder counts them at now.
func failovers(b bindings.Binding, now time.Time) int {
	if now.Sub(b.Since) > ladderMemory {
		return 0
	}
	return b.Failovers
}

// ladder is where a session bound as b goes when its instance is out,
// given how many times it has failed over (n): under the gradual policy,
// the first failover prefers the failed instance's zone, the second
// another zone (each takes the other when its own has no instance), and
// the third routes at random. The session's version affinity holds on
// every rung; under strict, a session with no other instance of its
// version gets ErrNoVersion.
func (d *Decider) ladder(p *Policy, c choice, b bindings.Binding, n int, avail []fleet.Instance) (Stage, []fleet.Instance, error) {
	failed, _ := find(d.fleet.All(), b.Instance)
	pool := without(avail, b.Instance)
	if b.Version != "" && p.VersionAffinity != AnyVersion {
		same := ofVersion(pool, b.Version)
		switch {
		case len(same) > 0:
			pool = same
		case p.VersionAffinity == Strict:
			return StageNone, nil, fmt.Errorf("%w %q", ErrNoVersion, b.Version)
		default:
			pool = stickyCandidates(p.versionOf(c, d.rand), pool)
		}
	}
	if len(pool) == 0 {
		return StageNone, nil, ErrNoInstance
	}
	if p.fallback() != Gradual {
		return StageRandom, pool, nil
	}
	var here, there []fleet.Instance
	for _, in := range pool {
		if in.Zone == failed.Zone {
			here = append(here, in)
		} else {
			there = append(there, in)
		}
	}
	near, far := here, there
	nearStage, farStage := StageSameZone, StageOtherZone
	if n == 1 {
		near, far, nearStage, farStage = there, here, StageOtherZone, StageSameZone
	}
	switch {
	case n >= bindings.MaxFailovers:
		return StageRandom, pool, nil
	case len(near) > 0:
		return nearStage, avoidSpot(near), nil
	default:
		return farStage, avoidSpot(far), nil
	}
}

// failover routes a session whose instance is out: a 503 under
// fallback_policy "none", else down the ladder. A rung that rebinds
// stores the session's new instance; the random rung routes this request
// at random and leaves the binding, so the session returns to its
// instance once it is back.
func (d *Decider) failover(ctx context.Context, p *Policy, c choice, key string, b bindings.Binding, mode Mode, lt bindings.Lifetime, avail []fleet.Instance, now time.Time) (Decision, error) {
	if p.fallback() == FallbackNone {
		return Decision{}, fmt.Errorf("%w: %s (fallback_policy = \"none\")", ErrInstanceUnavailable, b.Instance)
	}
	n := failovers(b, now)
	stage, cands, err := d.ladder(p, c, b, n, avail)
	if err != nil {
		return Decision{}, err
	}
	if stage == StageRandom {
		return Decision{Instance: d.pick(cands), Mode: Random, Kind: KindFallback, Stage: StageRandom}, nil
	}
	next := d.place(key, cands, p)
	dec, err := d.rebind(ctx, key, b.Instance, bindings.Binding{Instance: next.Name, Version: next.Version, Since: now, Failovers: n + 1}, lt, next, avail)
	if err != nil {
		return Decision{}, err
	}
	dec.Mode, dec.Stage = mode, stage
	if dec.Kind == "" {
		dec.Kind = KindFailover
	}
	return dec, nil
}

// rebind stores next for key (if it is still bound to from) and routes to
// the instance the store then holds. Kind is left empty on success for
// the caller; a store failure routes to next anyway (degraded).
func (d *Decider) rebind(ctx context.Context, key, from string, next bindings.Binding, lt bindings.Lifetime, target fleet.Instance, avail []fleet.Instance) (Decision, error) {
	nb, err := d.store.Replace(ctx, key, from, next, lt)
	d.load.unreserve(target.Name, err == nil && nb.Instance == target.Name, from)
	if err != nil {
		if ctx.Err() != nil {
			return Decision{}, ctx.Err()
		}
		return Decision{Instance: target, Kind: KindDegraded, Err: err}, nil
	}
	if in, ok := find(avail, nb.Instance); ok {
		return Decision{Instance: in}, nil
	}
	// Another replica moved the session to an instance this one does not
	// know or has out (their fleets or breaker views differ): route by
	// our own choice for now, and say so.
	return Decision{Instance: target, Kind: KindDegraded, Err: fmt.Errorf("%w: %s", ErrFleetMismatch, nb.Instance)}, nil
}

// Evacuate moves sessions, bound to instance, whose breaker has just
// opened, down the fallback ladder ahead of their next request, so that
// request is an ordinary hit on the new instance (replicas.CircuitShare
// reads them from the store's index). Only the gradual policy rebinds;
// sessions whose rung is random stay bound and are routed at random per
// request. It returns how many sessions it moved; sessions another replica
// moved first are not counted.
func (d *Decider) Evacuate(ctx context.Context, instance string, sessions []bindings.Session) (moved int, err error) {
	p := d.policy.Load()
	if p.fallback() != Gradual {
		return 0, nil
	}
	now := d.now()
	c := p.resolve(Request{}, now)
	// Only instances whose circuit is closed: a half-open one has not
	// proven itself yet, and would take all the sessions at once.
	var avail []fleet.Instance
	for _, in := range d.available() {
		if d.breaker == nil || d.breaker.State(in.Name) == fleet.Closed {
			avail = append(avail, in)
		}
	}
	for _, s := range sessions {
		if err := ctx.Err(); err != nil {
			return moved, err
		}
		n := failovers(s.Binding, now)
		stage, cands, err := d.ladder(p, c, s.Binding, n, avail)
		if err != nil || stage == StageRandom {
			continue // nowhere to rebind: its next request decides
		}
		next := d.place(s.Key, cands, p)
		// The session keeps the idle lifetime it has left.
		lt := bindings.Lifetime{Idle: max(s.TTL, time.Millisecond), Max: p.Lifetime.Max}
		nb, err := d.store.Replace(ctx, s.Key, instance, bindings.Binding{Instance: next.Name, Version: next.Version, Since: now, Failovers: n + 1}, lt)
		placed := err == nil && nb.Instance == next.Name
		d.load.unreserve(next.Name, placed, instance)
		if err != nil {
			return moved, err
		}
		if placed {
			moved++
		}
	}
	return moved, nil
}

// pick chooses among cands at random, in proportion to their weights.
func (d *Decider) pick(cands []fleet.Instance) fleet.Instance {
	total := 0.0
	for _, in := range cands {
		total += in.Weight
	}
	// 53 random bits give a uniform float in [0,1).
	x := float64(d.rand()>>11) / (1 << 53) * total
	for _, in := range cands {
		if x < in.Weight {
			return in
		}
		x -= in.Weight
	}
	return cands[len(cands)-1]
}
