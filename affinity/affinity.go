// Package affinity decides which instance serves a request. It is the
// decision core: plain Go structs in and out, no gRPC, Envoy or Redis. It
// declares the two store methods it calls itself (store.go), in the
// vocabulary of package bindings; what the rest of tether needs of the
// same store is declared where it is used.
package affinity

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
)

// Kind says how a decision was reached; it is what x-tether-decision shows
// and what metrics count.
type Kind string

// The kinds of decision.
const (
	KindHit       Kind = "hit"       // an existing binding was used
	KindBind      Kind = "bind"      // a new session was placed and bound
	KindRebind    Kind = "rebind"    // the binding outlived max_sticky_duration and was placed again
	KindMoved     Kind = "moved"     // the bound instance left the fleet (or changed model); the session was placed again
	KindMigrated  Kind = "migrated"  // an operator migrated the session to another model version
	KindDrained   Kind = "drained"   // an operator drained the session's instance
	KindSpilled   Kind = "spilled"   // adaptive: the session's instance was saturated; it moved to its next choice
	KindRandom    Kind = "random"    // random mode (or sticky disabled)
	KindAnonymous Kind = "anonymous" // no usable identity: routed at random
	KindDegraded  Kind = "degraded"  // the store failed: placed by rendezvous hashing without it
	KindFailover  Kind = "failover"  // the session's instance was out (breaker open): rebound down the fallback ladder
	KindFallback  Kind = "fallback"  // the session's instance was out and its rung is random: routed at random, binding kept
	KindExpired   Kind = "expired"   // the session idled past its instance's cache horizon: placed again by content and load
)

// ErrNoInstance means the fleet has no healthy instance.
var ErrNoInstance = errors.New("no healthy instance")

// ErrNoVersion means a session under strict version affinity has no
// healthy instance of its model version.
var ErrNoVersion = errors.New("no healthy instance of the session's model version")

// ErrNoEligible means the caller's subset (Request.Subset) holds no
// instance that may take the request.
var ErrNoEligible = errors.New("no eligible instance in the request's subset")

// ErrFleetMismatch means the store holds a binding to an instance this
// replica's fleet does not have.
var ErrFleetMismatch = errors.New("session bound to an instance unknown to this replica")

// Fleet is what the decision needs to know about instances: every
// configured one (the breaker and drains decide which take requests).
type Fleet interface {
	All() []fleet.Instance
}

// Decision is the outcome for one request.
type Decision struct {
	Instance fleet.Instance
	Mode     Mode // Sticky, Adaptive or Random: how this request was routed
	Kind     Kind
	Rule     string // the rule that matched, "" for none
	// Stage is the fallback ladder's rung for a failover or fallback.
	Stage Stage
	// Previous is the instance the session was bound to before this
	// request: the one holding its KV cache. It is "" for a new session
	// and for requests routed without the store (random, anonymous, and
	// degraded ones, whose binding could not be read). A follow-up whose
	// Instance is Previous kept its continuity.
	Previous string
	// Key is the session key the binding is stored under: the request's
	// key, or the session key it is an alias of (Result.Key). Requests is
	// the session's request count with this request; a rebinding keeps
	// it. Both are unset for requests routed without the store (random,
	// anonymous) and for degraded ones whose binding could not be read.
	Key      string
	Requests int
	// Err is the store error behind a degraded decision, for logging.
	Err error

	// At is when the decision was made; Probe says the request is the
	// probe of Instance's half-open circuit (fleet.Breaker.Begin). Finish
	// needs both, so a decision that travels to another replica (in an
	// outcome ticket) must carry them.
	At    time.Time
	Probe bool

	// Open says the request's prompt may still place it better
	// (Decider.Refine). It is set when cache-aware placement is on and the
	// decision is a new session, one placed again or an anonymous request.
	Open bool
	// ByContent says Refine placed the request by its prompt's cost.
	// Matched is how many blocks of the prompt that instance holds; 0 is
	// none that counts.
	ByContent bool
	Matched   int
	// Fallbacks are where a retry of the request goes, in order: the next
	// instances of the ranking that would place its session anew, without
	// Instance. The request asks for them (Request.Fallbacks).
	Fallbacks []fleet.Instance
	// lifetime is the session's binding lifetime, and subset the
	// request's, for Refine's move.
	lifetime bindings.Lifetime
	subset   []string
}

// Decider makes decisions. It is safe for concurrent use.
type Decider struct {
	store   Store
	fleet   Fleet
	load    *Load
	breaker *fleet.Breaker // nil: every instance is available
	policy  atomic.Pointer[Policy]
	now     func() time.Time
	rand    func() uint64

	failOpen          FailOpen
	failOpenOverrides atomic.Uint64
	index             PrefixIndex // nil: no cache-aware placement
	rankings          sync.Pool   // of *Ranking (ranking, done)
	peeker            Peeker      // the store, when it is one; else nil
}

// Option configures a Decider.
type Option func(*Decider)

// WithClock injects the clock (tests).
func WithClock(now func() time.Time) Option { return func(d *Decider) { d.now = now } }

// WithRand injects the random source used by random routing. It must be safe
// for concurrent use.
func WithRand(r func() uint64) Option { return func(d *Decider) { d.rand = r } }

// WithLoad gives the decider the fleet's load: bounded-load placement,
// adaptive saturation and drained instances use it. Without it every
// instance counts as idle.
func WithLoad(l *Load) Option { return func(d *Decider) { d.load = l } }

// FailOpen names the instance Envoy's fail-open pool would send a request
// with headers h to, given every configured instance (ok false: the pool
// would pick at random, or balances without hashing). It reads the raw
// identity headers, as Envoy hashes them, and must keep nothing of them.
type FailOpen func(h identity.Headers, all []fleet.Instance) (instance string, ok bool)

// WithFailOpen places new sessions where Envoy's fail-open pool would send
// them, so a session keeps its instance while no tether replica answers:
// the bounded load, or a KV cache its engine reports full, overrides the
// pool's choice (FailOpenOverrides counts those).
func WithFailOpen(f FailOpen) Option { return func(d *Decider) { d.failOpen = f } }

// FailOpenOverrides is how many sessions were bound elsewhere than where
// the fail-open pool would send them (its instance over its bound, full,
// or not a candidate) since the decider started.
func (d *Decider) FailOpenOverrides() uint64 { return d.failOpenOverrides.Load() }

// New returns a Decider.
func New(store Store, f Fleet, p Policy, opts ...Option) *Decider {
	d := &Decider{store: store, fleet: f, now: time.Now, rand: rand.Uint64}
	d.peeker, _ = store.(Peeker)
	for _, o := range opts {
		o(d)
	}
	if d.load == nil {
		d.load = NewLoad()
	}
	d.load.now = d.now // the decider's clock ages queue readings too
	d.SetPolicy(p)
	return d
}

// SetPolicy replaces the policy; decisions already under way finish with
// the old one.
func (d *Decider) SetPolicy(p Policy) {
	// Canaries first: raising a canary's weight only adds users to it.
	p.draws = versionDraws{}
	for pass := range 2 {
		for _, v := range p.Versions {
			if v.Canary == (pass == 0) {
				p.draws.all = append(p.draws.all, v)
				if v.Canary {
					p.draws.canary = append(p.draws.canary, v)
				} else {
					p.draws.stable = append(p.draws.stable, v)
				}
			}
		}
	}
	d.policy.Store(&p)
}

// versionDraws are Policy.Versions in draw order, canaries first: all of
// them, the canaries only (x-canary: always), the others (never).
type versionDraws struct{ all, canary, stable []VersionWeight }

// Policy returns the policy in force.
func (d *Decider) Policy() Policy { return *d.policy.Load() }

// Load returns the load view the decider uses.
func (d *Decider) Load() *Load { return d.load }

// Decide picks the instance for a request. A decision counts as a request
// in flight to its instance until Finish.
func (d *Decider) Decide(ctx context.Context, req Request) (Decision, error) {
	dec, err := d.decide(ctx, req)
	if err != nil {
		return Decision{}, err
	}
	if d.breaker != nil {
		probe, ok := d.breaker.TryBegin(dec.Instance.Name)
		if !ok {
			// The instance is half-open and another request took its
			// probe after this one read it available: decide again, now
			// without it. Once: the second decision goes as it is. (The
			// session's request count in the store counts both.)
			if dec, err = d.decide(ctx, req); err != nil {
				return Decision{}, err
			}
			probe = d.breaker.Begin(dec.Instance.Name)
		}
		dec.Probe = probe
	}
	d.load.Begin(dec.Instance.Name, dec.At)
	if req.Fallbacks > 0 {
		dec.Fallbacks = d.fallbacks(req, dec.Instance)
	}
	return dec, nil
}

// fallbacks is where a retry of a request placed on chosen goes: where
// the failover ladder's first rung would move its session, then the next
// rung. That is the ranking of the session's key over chosen's zone, then
// over the other zones; a request without a session ranks a random key.
// They are of chosen's version, within bounded load, and in req's subset.
func (d *Decider) fallbacks(req Request, chosen fleet.Instance) []fleet.Instance {
	key := fnv64(req.ID.Key)
	if req.ID.Anonymous() {
		key = d.rand()
	}
	avail := d.available(req.Subset)
	passes := []bool{false, true} // chosen's zone, then the others
	if chosen.Zone == "" {
		passes = passes[:1] // no zones: one ranking of all
	}
	var out []fleet.Instance
	for _, other := range passes {
		pl := placement{key: key, from: avail, version: chosen.Version, leave: chosen.Name, sessions: true,
			zone: chosen.Zone, otherZones: other}
		r := d.ranking()
		d.rank(&pl, r)
		out = append(out, r.Top(req.Fallbacks-len(out))...)
		d.done(r)
		if len(out) == req.Fallbacks {
			break
		}
	}
	return out
}

// decide is Decide before the request is counted on its instance.
func (d *Decider) decide(ctx context.Context, req Request) (Decision, error) {
	p := d.policy.Load()
	healthy := d.available(req.Subset)
	if len(healthy) == 0 {
		if len(req.Subset) > 0 && len(d.available(nil)) > 0 {
			return Decision{}, ErrNoEligible
		}
		return Decision{}, ErrNoInstance
	}
	now := d.now()
	c := p.resolve(req, now)
	var dec Decision
	var err error
	switch {
	case c.mode == Random:
		dec = d.random(p, c, healthy, KindRandom)
	case req.ID.Anonymous():
		dec = d.random(p, c, healthy, KindAnonymous)
	default:
		dec, err = d.sticky(ctx, p, req, c, healthy, now)
	}
	if err != nil {
		return Decision{}, err
	}
	dec.Rule, dec.At, dec.subset = c.rule, now, req.Subset
	dec.Open = p.Content.Enabled && d.index != nil && openKinds[dec.Kind]
	return dec, nil
}

// Finish ends the request dec routed with its outcome: the load view and
// the breaker hear of it. It is called once per decision.
func (d *Decider) Finish(dec Decision, o fleet.Outcome) {
	d.load.End(dec.Instance.Name, dec.At, o.Queue, o.QueueKnown && o.Answered)
	if d.breaker != nil {
		d.breaker.Done(dec.Instance.Name, dec.Probe, o)
	}
}

// available is the fleet's instances that may take requests: healthy or
// probing, not drained, and in subset when one is given. It is the
// pipeline's first filter, applied once per decision.
func (d *Decider) available(subset []string) []fleet.Instance {
	all := d.fleet.All()
	drained := d.load.drained()
	open := d.breaker != nil && !d.breaker.Quiet()
	if len(drained) == 0 && !open && len(subset) == 0 {
		return all
	}
	out := make([]fleet.Instance, 0, len(all))
	for _, in := range all {
		if !drained[in.Name] && (!open || d.breaker.Available(in.Name)) && (len(subset) == 0 || slices.Contains(subset, in.Name)) {
			out = append(out, in)
		}
	}
	return out
}

func (d *Decider) sticky(ctx context.Context, p *Policy, req Request, c terms, healthy []fleet.Instance, now time.Time) (dec Decision, err error) {
	key := req.ID.Key
	mode := c.mode // Sticky or Adaptive
	lt := bindings.Lifetime{Idle: c.idle, Max: p.Lifetime.Max}
	r := d.ranking()
	defer d.done(r)
	pl, res, err := d.lookup(ctx, p, req, c, healthy, now, lt, r)
	if err != nil {
		return d.storeFailed(ctx, &pl, mode, err)
	}
	b := res.Binding
	kind, prev := storeKind(res)
	outcome := kind
	// Every decision from here on follows the binding read above.
	defer func() { dec.Previous, dec.Key, dec.Requests, dec.lifetime = prev, res.Key, res.Requests, lt }()
	in, ok := find(healthy, b.Instance)
	// Why the session must leave its instance, if it must.
	switch {
	case res.Origin == bindings.Renewed && res.Previous.Version != "" && res.Previous.Version != b.Version && p.VersionAffinity != AnyVersion:
		// Re-placed after max_sticky_duration by today's version weights:
		// the session keeps the version it runs on.
		b.Version = res.Previous.Version
	case res.Move.Version != "" && res.Move.Version != b.Version:
		kind = KindMigrated
	case res.Move.Off != "" && res.Move.Off == b.Instance && d.load.Drained(b.Instance):
		// A drain mark counts only while the drain lasts.
		kind = KindDrained
	case !ok && (len(req.Subset) == 0 || slices.Contains(req.Subset, b.Instance)) && d.out(b.Instance):
		return d.failover(ctx, p, c, res.Key, b, mode, lt, healthy, now)
	case !ok:
		// Gone from the fleet, or outside the caller's subset.
		kind = KindMoved
	case b.Version != "" && in.Version != b.Version && p.VersionAffinity != AnyVersion:
		// The instance now serves another model: its KV cache is no use.
		kind = KindMoved
	case mode == Adaptive && c.priority != High && d.load.Saturated(in.Name, p.Saturation):
		kind = KindSpilled
	case res.Origin == bindings.Found && p.Content.Enabled && d.index != nil && d.pastHorizon(in.Name, res.Idle):
		// Its instance kept nothing of it: content and load place it
		// again (Refine), and it stays when they say nothing better.
		return Decision{Instance: in, Mode: mode, Kind: KindExpired}, nil
	default:
		return Decision{Instance: in, Mode: mode, Kind: kind}, nil
	}
	next := d.ranking()
	defer d.done(next)
	kind, err = d.relocate(p, c, key, b, res.Move, kind, healthy, next)
	if errors.Is(err, errStay) {
		// Still the store's outcome: a binding just made is a bind, not a hit.
		return Decision{Instance: in, Mode: mode, Kind: outcome}, nil
	}
	if err != nil {
		if res.Origin == bindings.Renewed && errors.Is(err, ErrNoVersion) {
			d.restore(ctx, res, now, lt)
		}
		return Decision{}, err
	}
	dec, err = d.rebind(ctx, res.Key, b.Instance, 0, now, lt, next, healthy)
	if err != nil {
		return Decision{}, err
	}
	dec.Mode = mode
	if dec.Kind == "" {
		dec.Kind = kind
	}
	return dec, nil
}

// lookup finds the session's binding, or binds it where the pipeline
// ranks first. A new session placed on a saturated instance would spill at
// once, so adaptive ranks only unsaturated ones. r holds the reservation
// until the caller releases it. A session the store can peek at, bound to
// an available instance, is not ranked: its instance is the candidate.
func (d *Decider) lookup(ctx context.Context, p *Policy, req Request, c terms, healthy []fleet.Instance, now time.Time, lt bindings.Lifetime, r *Ranking) (placement, bindings.Result, error) {
	pl := placement{key: fnv64(req.ID.Key), from: healthy, version: p.versionOf(c, d.rand),
		unsaturated: c.mode == Adaptive, sessions: true, reserve: true}
	place, peeked := d.peek(req.ID.Key, healthy, now, lt)
	if !peeked {
		pl.failOpen = d.failOpenChoice(req)
		d.rank(&pl, r)
		place, _ = r.First()
	}
	res, err := d.store.GetOrBind(ctx, bindings.Lookup{
		Key: req.ID.Key, Aliases: req.ID.Aliases, Candidate: bindings.Binding{Instance: place.Name, Version: place.Version, Since: now}, Lifetime: lt,
	})
	if err != nil && peeked {
		pl.failOpen = d.failOpenChoice(req) // the degraded choice goes where Envoy's fail-open would
	}
	if err != nil || res.Origin == bindings.Found || res.Binding.Instance != place.Name {
		return pl, res, err
	}
	var from string
	if res.Origin == bindings.Renewed && res.Previous.Instance != place.Name {
		from = res.Previous.Instance // the renewal took the session off it
	}
	if peeked {
		// The binding went between the peek and the store: the session is
		// bound again where it was, which the load view counts.
		h := d.load.holdOn(place.Name)
		h.end(true, from)
		return pl, res, nil
	}
	r.commit(from)
	if r.overridden {
		d.failOpenOverrides.Add(1)
	}
	return pl, res, nil
}

// peek is the available instance the store says, without a round trip,
// key is bound to. ok false: it cannot say, or the instance is not
// available; the session is ranked.
func (d *Decider) peek(key string, healthy []fleet.Instance, now time.Time, lt bindings.Lifetime) (fleet.Instance, bool) {
	if d.peeker == nil {
		return fleet.Instance{}, false
	}
	b, ok := d.peeker.Peek(key, now, lt)
	if !ok {
		return fleet.Instance{}, false
	}
	return find(healthy, b.Instance)
}

// storeKind is what the store's answer makes of a request, and the
// instance the session was on before it.
func storeKind(res bindings.Result) (Kind, string) {
	switch res.Origin {
	case bindings.Created:
		return KindBind, ""
	case bindings.Renewed:
		return KindRebind, res.Previous.Instance
	}
	return KindHit, res.Binding.Instance
}

// restore puts a session back on its version. GetOrBind renewed it onto an
// instance of another version (res), and strict version affinity found
// none of its own up. The session goes on failing on its version, as
// strict asks, rather than continue on the other one. Best effort: the
// request fails with ErrNoVersion either way.
func (d *Decider) restore(ctx context.Context, res bindings.Result, now time.Time, lt bindings.Lifetime) {
	prev := res.Previous
	h := d.load.holdOn(prev.Instance)
	nb, err := d.store.Replace(ctx, res.Key, res.Binding.Instance, bindings.Binding{Instance: prev.Instance, Version: prev.Version, Since: now}, lt)
	h.end(err == nil && nb.Instance == prev.Instance, res.Binding.Instance)
}

// errStay: the session keeps its instance (a saturated instance with no
// unsaturated alternative).
var errStay = errors.New("stay")

// relocate ranks, into r, where a session bound as b goes when it must
// leave its instance for reason kind, and says why it goes there (a
// migration whose target version is down becomes a move within the
// session's own). errStay: it keeps its instance.
func (d *Decider) relocate(p *Policy, c terms, key string, b bindings.Binding, mv bindings.Move, kind Kind, healthy []fleet.Instance, r *Ranking) (Kind, error) {
	pl := placement{key: fnv64(key), from: healthy, leave: b.Instance, sessions: true, reserve: true}
	switch {
	case kind == KindMigrated && serves(healthy, b.Instance, mv.Version):
		pl.version = mv.Version
	case kind == KindMigrated:
		// Nothing of the target version is up: the move waits for a later
		// turn, on the session's own instance while it is up, else where
		// its version affinity allows.
		if _, ok := find(healthy, b.Instance); ok {
			return kind, errStay
		}
		return d.relocate(p, c, key, b, bindings.Move{}, KindMoved, healthy, r)
	case kind == KindSpilled:
		// The next choice in the session's own ranking that is not
		// saturated, of its version, so every replica spills a session the
		// same way. The move is a rebinding: the session's KV cache builds
		// up there and it stays.
		pl.version, pl.sessions = b.Version, false
		if !d.spillable(p, healthy, b) {
			return kind, errStay
		}
		pl.unsaturated = true
	case kind == KindRebind && b.Version != "" && p.VersionAffinity == Prefer && !serves(healthy, b.Instance, b.Version):
		// Renewed onto another version while none of its own is up:
		// prefer lets it stay on the instance just bound.
		return kind, errStay
	default:
		v, err := d.moveVersion(p, c, b.Version, healthy, b.Instance)
		if err != nil {
			return kind, err
		}
		pl.version = v
	}
	if d.rank(&pl, r); r.best < 0 {
		return kind, ErrNoInstance
	}
	return kind, nil
}

// spillable reports whether a saturated session bound as b has somewhere
// to spill to: another instance of its version that is not saturated.
func (d *Decider) spillable(p *Policy, healthy []fleet.Instance, b bindings.Binding) bool {
	for _, in := range healthy {
		if in.Name != b.Instance && (b.Version == "" || in.Version == b.Version) && !d.load.Saturated(in.Name, p.Saturation) {
			return true
		}
	}
	return false
}

// moveVersion is the model version a session bound on version v may move
// to, leaving instance leave: v while another available instance serves
// it; otherwise, under prefer, the version a new session would take, and
// under strict none (ErrNoVersion). A session without a version, or under
// version_affinity none, takes the version a new session would.
func (d *Decider) moveVersion(p *Policy, c terms, v string, avail []fleet.Instance, leave string) (string, error) {
	switch {
	case v == "" || p.VersionAffinity == AnyVersion:
		return p.versionOf(c, d.rand), nil
	case serves(avail, leave, v):
		return v, nil
	case p.VersionAffinity == Strict:
		return "", fmt.Errorf("%w %q", ErrNoVersion, v)
	}
	return p.versionOf(c, d.rand), nil
}

// serves reports whether an instance of avail other than leave serves
// version v.
func serves(avail []fleet.Instance, leave, v string) bool {
	return slices.ContainsFunc(avail, func(in fleet.Instance) bool { return in.Name != leave && in.Version == v })
}

// storeFailed places a request when the store fails. It uses the rule new
// sessions are placed by, without the load bound: the fail-open pool's
// choice, else rendezvous. That is where most sessions already are. A
// request that is itself gone gets its context's error instead: Envoy's
// message timeout or a client that left is not the store's fault, and
// nobody waits for the answer.
func (d *Decider) storeFailed(ctx context.Context, pl *placement, mode Mode, err error) (Decision, error) {
	if ctx.Err() != nil {
		return Decision{}, ctx.Err()
	}
	without := *pl
	without.sessions, without.reserve = false, false
	r := d.ranking()
	defer d.done(r)
	d.rank(&without, r)
	in, _ := r.First()
	return Decision{Instance: in, Mode: mode, Kind: KindDegraded, Err: err}, nil
}

// failOpenChoice is the instance Envoy's fail-open pool would send req to,
// "" when it would pick at random or there is no pool (WithFailOpen).
func (d *Decider) failOpenChoice(req Request) string {
	if d.failOpen == nil {
		return ""
	}
	name, _ := d.failOpen(req.Headers, d.fleet.All())
	return name
}

// random routes a request at random, in proportion to the instances'
// weights: the ranking of a random key, among the instances of the
// request's version, spot ones first.
func (d *Decider) random(p *Policy, c terms, healthy []fleet.Instance, kind Kind) Decision {
	pl := placement{key: d.rand(), from: healthy, version: p.versionOf(c, d.rand), spotFirst: true}
	r := d.ranking()
	defer d.done(r)
	d.rank(&pl, r)
	in, _ := r.First()
	return Decision{Instance: in, Mode: Random, Kind: kind}
}

func find(instances []fleet.Instance, name string) (fleet.Instance, bool) {
	for _, in := range instances {
		if in.Name == name {
			return in, true
		}
	}
	return fleet.Instance{}, false
}

// terms is what the policy and the matching rule say for one request.
type terms struct {
	rule     string
	mode     Mode // Sticky, Adaptive or Random
	priority Priority
	idle     time.Duration
	version  string // the rule's version, "" for none
	canary   string // the canary header's value
	cohort   string // what canary cohorts hash: the user, else the session
}

// resolve applies the first matching rule to the policy.
func (p *Policy) resolve(req Request, now time.Time) terms {
	c := terms{mode: p.Mode, priority: Normal, idle: p.Lifetime.Idle,
		canary: req.header(p.CanaryHeader), cohort: req.ID.Cohort}
	if c.cohort == "" {
		c.cohort = req.ID.Key
	}
	for i := range p.Rules {
		r := &p.Rules[i]
		if !r.matches(req, p.TierHeader, now) {
			continue
		}
		c.rule = r.Name
		if r.Mode != "" {
			c.mode = r.Mode
		}
		if r.Idle > 0 {
			c.idle = r.Idle
		}
		if r.Priority != "" {
			c.priority = r.Priority
		}
		c.version = r.Version
		break
	}
	if c.mode == Hybrid {
		// Hybrid's unmatched traffic is the edge: random.
		c.mode = Random
	}
	return c
}

// versionOf is the model version a new session (or a random request)
// starts on: the rule's, else by the [[versions]] weights over a hash of
// the cohort, so a user is consistently in or out of a canary. A canary
// header "always" or "never" restricts the choice to or away from the
// canary versions. Requests without a cohort (anonymous) draw from draw.
func (p *Policy) versionOf(c terms, draw func() uint64) string {
	if c.version != "" {
		return c.version
	}
	if len(p.Versions) == 0 {
		return ""
	}
	ordered := p.draws.all
	switch c.canary {
	case "always":
		if len(p.draws.canary) > 0 {
			ordered = p.draws.canary
		}
	case "never":
		if len(p.draws.stable) > 0 {
			ordered = p.draws.stable
		}
	}
	total := 0.0
	for _, v := range ordered {
		total += v.Weight
	}
	if total == 0 {
		// A forced canary with weight 0: the first one.
		return ordered[0].Name
	}
	var u float64
	if c.cohort != "" {
		u = unit(mix64(fnv64(c.cohort) ^ 0x63616e617279)) // "canary"
	} else {
		u = unit(draw())
	}
	x := u * total
	for _, v := range ordered {
		if x < v.Weight {
			return v.Name
		}
		x -= v.Weight
	}
	return ordered[len(ordered)-1].Name
}

// unit maps 64 random bits to [0,1).
func unit(h uint64) float64 { return float64(h>>11) / (1 << 53) }
