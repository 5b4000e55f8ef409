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
// given how many times it has failed over (n): the rung, and the
// placement that ranks its candidates. Under the gradual policy, the
// first failover prefers the failed instance's zone, the second another
// zone (each takes the other when its own has no instance), and the
// third routes at random. The session's version affinity holds on every
// rung; under strict, a session with no other instance of its version
// gets ErrNoVersion.
func (d *Decider) ladder(p *Policy, c terms, key string, b bindings.Binding, n int, avail []fleet.Instance) (Stage, placement, error) {
	v, err := d.moveVersion(p, c, b.Version, avail, b.Instance)
	if err != nil {
		return StageNone, placement{}, err
	}
	pl := placement{key: fnv64(key), from: avail, leave: b.Instance, version: v, sessions: true, reserve: true}
	failed, _ := find(d.fleet.All(), b.Instance)
	var here, there int
	for _, i := range filter(&pl, candidates(&pl, nil)) {
		if avail[i].Zone == failed.Zone {
			here++
		} else {
			there++
		}
	}
	if here+there == 0 {
		return StageNone, pl, ErrNoInstance
	}
	if p.fallback() != Gradual || n >= bindings.MaxFailovers {
		return StageRandom, pl, nil
	}
	// The rung's own zone, else the other: the same zone first, then
	// another; after one failover, another zone first.
	stage := StageSameZone
	if n == 1 {
		stage = StageOtherZone
	}
	switch {
	case stage == StageSameZone && here == 0:
		stage = StageOtherZone
	case stage == StageOtherZone && there == 0:
		stage = StageSameZone
	}
	pl.zone, pl.otherZones = failed.Zone, stage == StageOtherZone
	return stage, pl, nil
}

// failover routes a session whose instance is out: a 503 under
// fallback_policy "none", else down the ladder. A rung that rebinds
// stores the session's new instance; the random rung routes this request
// at random and leaves the binding, so the session returns to its
// instance once it is back.
func (d *Decider) failover(ctx context.Context, p *Policy, c terms, key string, b bindings.Binding, mode Mode, lt bindings.Lifetime, avail []fleet.Instance, now time.Time) (Decision, error) {
	if p.fallback() == FallbackNone {
		return Decision{}, fmt.Errorf("%w: %s (fallback_policy = \"none\")", ErrInstanceUnavailable, b.Instance)
	}
	n := failovers(b, now)
	stage, pl, err := d.ladder(p, c, key, b, n, avail)
	if err != nil {
		return Decision{}, err
	}
	r := d.ranking()
	defer d.done(r)
	if stage == StageRandom {
		pl.key, pl.sessions, pl.reserve = d.rand(), false, false
		d.rank(&pl, r)
		in, _ := r.First()
		return Decision{Instance: in, Mode: Random, Kind: KindFallback, Stage: StageRandom}, nil
	}
	d.rank(&pl, r)
	dec, err := d.rebind(ctx, key, b.Instance, n+1, now, lt, r, avail)
	if err != nil {
		return Decision{}, err
	}
	dec.Mode, dec.Stage = mode, stage
	if dec.Kind == "" {
		dec.Kind = KindFailover
	}
	return dec, nil
}

// rebind stores the first of r for key (if it is still bound to from),
// with failovers n, and routes to the instance the store then holds. Kind
// is left empty on success for the caller; a store failure routes to the
// first of r anyway (degraded).
func (d *Decider) rebind(ctx context.Context, key, from string, n int, now time.Time, lt bindings.Lifetime, r *Ranking, avail []fleet.Instance) (Decision, error) {
	target, _ := r.First()
	nb, err := d.store.Replace(ctx, key, from, bindings.Binding{Instance: target.Name, Version: target.Version, Since: now, Failovers: n}, lt)
	if err != nil {
		if ctx.Err() != nil {
			return Decision{}, ctx.Err()
		}
		return Decision{Instance: target, Kind: KindDegraded, Err: err}, nil
	}
	if nb.Instance == target.Name {
		r.commit(from)
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
	for _, in := range d.available(nil) {
		if d.breaker == nil || d.breaker.State(in.Name) == fleet.Closed {
			avail = append(avail, in)
		}
	}
	for _, s := range sessions {
		if err := ctx.Err(); err != nil {
			return moved, err
		}
		ok, err := d.evacuate(ctx, p, c, instance, s, avail, now)
		if err != nil {
			return moved, err
		}
		if ok {
			moved++
		}
	}
	return moved, nil
}

// evacuate moves one session off instance down its ladder; moved says
// the store took the move.
func (d *Decider) evacuate(ctx context.Context, p *Policy, c terms, instance string, s bindings.Session, avail []fleet.Instance, now time.Time) (moved bool, err error) {
	n := failovers(s.Binding, now)
	stage, pl, err := d.ladder(p, c, s.Key, s.Binding, n, avail)
	if err != nil || stage == StageRandom {
		return false, nil // nowhere to rebind: its next request decides
	}
	r := d.ranking()
	defer d.done(r)
	d.rank(&pl, r)
	next, _ := r.First()
	// The session keeps the idle lifetime it has left.
	lt := bindings.Lifetime{Idle: max(s.TTL, time.Millisecond), Max: p.Lifetime.Max}
	nb, err := d.store.Replace(ctx, s.Key, instance, bindings.Binding{Instance: next.Name, Version: next.Version, Since: now, Failovers: n + 1}, lt)
	if err != nil {
		return false, err
	}
	if nb.Instance != next.Name {
		return false, nil
	}
	r.commit(instance)
	return true, nil
}
