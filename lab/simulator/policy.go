package simulator

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/store/memory"
)

// Policy is a way of routing requests to instances.
type Policy string

const (
	// Sticky is tether's sticky mode: affinity.Decider over store/memory,
	// the production decision code.
	Sticky Policy = "sticky"
	// Random is tether's random mode, through the same Decider.
	Random Policy = "random"
	// RingHash emulates Envoy's RING_HASH on tether's hash policies
	// (session id, else authorization, else device id + user id).
	RingHash Policy = "ring-hash"
	// RoundRobin emulates Envoy's ROUND_ROBIN.
	RoundRobin Policy = "round-robin"
)

// Policies lists the policies, in the order of the bench's quality table.
func Policies() []Policy { return []Policy{RoundRobin, RingHash, Random, Sticky} }

// ParsePolicy returns the policy called name (any case).
func ParsePolicy(name string) (Policy, error) {
	for _, p := range Policies() {
		if strings.EqualFold(name, string(p)) {
			return p, nil
		}
	}
	return "", fmt.Errorf("simulate: unknown policy %q: want one of %s", name, policyList())
}

func policyList() string {
	names := make([]string, 0, 4)
	for _, p := range Policies() {
		names = append(names, string(p))
	}
	return strings.Join(names, ", ")
}

// Label is the policy's name in the bench's tables.
func (p Policy) Label() string {
	switch p {
	case Sticky:
		return "tether sticky"
	case Random:
		return "tether random"
	case RingHash:
		return "Envoy ring hash"
	case RoundRobin:
		return "Envoy round robin"
	}
	return string(p)
}

// router picks the instance of each request.
type router interface {
	// prepare computes what the router needs of a conversation's
	// identity, once: the headers are the same on every turn.
	prepare(c *conversation)
	// route returns the index of the instance for c's next request, at
	// the current virtual time, and the decision's kind for tether ("" for
	// the Envoy policies).
	route(ctx context.Context, c *conversation) (int, affinity.Kind, error)
}

// identitySecret keys the simulation's session keys; any 16 bytes do.
const identitySecret = "tether-simulate-identity-secret"

// tetherRouter routes through affinity.Decider: the code tether runs, with
// the store in memory, the clock virtual and the random source seeded.
type tetherRouter struct {
	ids      *identity.Extractor
	decider  *affinity.Decider
	index    map[string]int
	names    []string
	now      func() time.Time
	lastSync time.Time
}

// syncEvery is how often, in virtual time, the router's load view reads
// the store's session index, as tether's load sync does each second.
const syncEvery = time.Second

func newTetherRouter(mode affinity.Mode, lt affinity.Lifetime, instances []fleet.Instance, now func() time.Time, rng *rand.Rand) (*tetherRouter, error) {
	ids, err := identity.New(identity.Config{Secret: []byte(identitySecret)})
	if err != nil {
		return nil, fmt.Errorf("simulate: %w", err)
	}
	index := make(map[string]int, len(instances))
	names := make([]string, len(instances))
	for i, in := range instances {
		index[in.Name] = i
		names[i] = in.Name
	}
	store := memory.New()
	// The load view reads active sessions from the store as tether's does,
	// so bounded-load placement sees sessions expire.
	load := affinity.NewLoad(store, "simulate")
	d := affinity.New(store, fleet.New(instances), affinity.Policy{Mode: mode, Lifetime: lt},
		affinity.WithClock(now), affinity.WithRand(rng.Uint64), affinity.WithLoad(load))
	return &tetherRouter{ids: ids, decider: d, index: index, names: names, now: now}, nil
}

func (t *tetherRouter) prepare(c *conversation) {
	h := make(identity.Map, len(c.headers))
	for _, hd := range c.headers {
		h[hd.Name] = hd.Value
	}
	c.id = t.ids.Extract(h)
}

func (t *tetherRouter) route(ctx context.Context, c *conversation) (int, affinity.Kind, error) {
	if now := t.now(); now.Sub(t.lastSync) >= syncEvery {
		if err := t.decider.Load().Sync(ctx, t.names, 3*syncEvery, now); err != nil {
			return 0, "", fmt.Errorf("simulate: load sync: %w", err)
		}
		t.lastSync = now
	}
	d, err := t.decider.Decide(ctx, affinity.Request{ID: c.id})
	if err != nil {
		return 0, "", fmt.Errorf("simulate: decide: %w", err)
	}
	// The simulation models no requests in flight as tether sees them.
	t.decider.Finish(d, affinity.Answer{Answered: true})
	i, ok := t.index[d.Instance.Name]
	if !ok {
		return 0, "", fmt.Errorf("simulate: decision names unknown instance %q", d.Instance.Name)
	}
	return i, d.Kind, nil
}

// ringRouter emulates Envoy's RING_HASH (see ring and envoyHash).
type ringRouter struct {
	ring ring
	rng  *rand.Rand
}

func (r *ringRouter) prepare(c *conversation) { c.ringHash, c.hashed = envoyHash(c.headers) }

func (r *ringRouter) route(_ context.Context, c *conversation) (int, affinity.Kind, error) {
	h := c.ringHash
	if !c.hashed {
		h = r.rng.Uint64()
	}
	return r.ring.pick(h), "", nil
}

// roundRobinRouter emulates Envoy's ROUND_ROBIN with equal weights: the
// hosts in turn, from a random first one. (Each Envoy worker thread keeps its
// own turn; with one thread or many, a conversation's next turn lands on
// another host about (n-1)/n of the time.)
type roundRobinRouter struct {
	n, next int
}

func (r *roundRobinRouter) prepare(*conversation) {}

func (r *roundRobinRouter) route(context.Context, *conversation) (int, affinity.Kind, error) {
	i := r.next
	r.next = (r.next + 1) % r.n
	return i, "", nil
}
