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
	"github.com/tetherproxy/tether/lab/emulator"
	"github.com/tetherproxy/tether/plan"
	"github.com/tetherproxy/tether/ringhash"
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
	// Tether is the policy of Options.Config, as `tether serve` runs it:
	// its rules, versions, bounded load, saturation thresholds,
	// lifetimes and fallback.
	Tether Policy = "tether"
	// RingHash emulates Envoy's RING_HASH on tether's hash policies
	// (session id, else authorization, else device id + user id).
	RingHash Policy = "ring-hash"
	// RoundRobin emulates Envoy's ROUND_ROBIN.
	RoundRobin Policy = "round-robin"
)

// Policies lists the policies of a run without a configuration, in the
// order of the bench's quality table, then the oracle.
func Policies() []Policy {
	return []Policy{RoundRobin, LeastRequest, RingHash, Random, Sticky, Oracle}
}

// ConfigPolicies lists the policies of a run with a configuration: Envoy's
// balancers over its instances, tether's policy, and the oracle.
func ConfigPolicies() []Policy { return []Policy{RoundRobin, LeastRequest, RingHash, Tether, Oracle} }

// ParsePolicy returns the policy called name (any case).
func ParsePolicy(name string) (Policy, error) {
	for _, p := range append(Policies(), Tether) {
		if strings.EqualFold(name, string(p)) {
			return p, nil
		}
	}
	return "", fmt.Errorf("simulate: unknown policy %q: want one of %s", name, policyList())
}

func policyList() string {
	names := make([]string, 0, 7)
	for _, p := range append(Policies(), Tether) {
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
	case Tether:
		return "tether (config)"
	case RingHash:
		return "Envoy ring hash"
	case RoundRobin:
		return "Envoy round robin"
	case LeastRequest:
		return "Envoy least request"
	case Oracle:
		return "oracle (longest cached prefix)"
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
	// answered says when the request route last placed for c gets its
	// response headers (at, virtual ns), and the queue depth its instance
	// reports with them.
	answered(c *conversation, at int64, queue int)
}

// identitySecret keys the simulation's session keys; any 16 bytes do.
const identitySecret = "tether-simulate-identity-secret"

// requestPath is the path of every request, as loadgen sends them: rules
// match on it.
const requestPath = "/v1/chat/completions"

// tetherRouter routes through the decider tether serve builds
// (plan.NewDecider, from the same translation of the configuration), with
// the store in memory, the clock virtual and the random source seeded. As
// in tether, a decision counts as a request in flight until its response
// headers arrive (answered), with the queue depth the instance reports in
// them, and the load view syncs once a (virtual) second.
type tetherRouter struct {
	ids      *identity.Extractor
	decider  *affinity.Decider
	index    map[string]int
	names    []string
	clock    func() int64 // virtual ns
	lastSync time.Time
	// queueKnown: tether reads the queue depth the emulator reports
	// (routing.queue_depth_header is the emulator's header). The simulated
	// instances report it as the bench's do (emulator.Instance's
	// ReportHeaders, off by default since real engines send no such
	// header).
	queueKnown bool
	// pending are the requests waiting for their response headers
	// (eventAnswered), in the order they get them.
	pending eventQueue
	seq     uint64
	// trace, when set (tests), sees every call on the decider; decided
	// numbers the decisions for it.
	trace   func(deciderCall)
	decided int
}

// syncEvery is how often, in virtual time, the router's load view reads
// the store's session index, as tether's load sync does each second.
const syncEvery = time.Second

func newTetherRouter(p plan.Plan, clock func() int64, rng *rand.Rand) (*tetherRouter, error) {
	ids, err := p.Extractor([]byte(identitySecret))
	if err != nil {
		return nil, fmt.Errorf("simulate: %w", err)
	}
	index := make(map[string]int, len(p.Instances))
	names := make([]string, len(p.Instances))
	for i, in := range p.Instances {
		index[in.Name] = i
		names[i] = in.Name
	}
	store := memory.New()
	now := func() time.Time { return virtualTime(clock()) }
	d := plan.NewDecider(p, fleet.New(p.Instances), plan.Deps{
		Store: store,
		// The load view reads active sessions from the store as tether's
		// does, so bounded-load placement sees sessions expire.
		Load:    affinity.NewLoad(store, "simulate"),
		Breaker: fleet.NewBreaker(p.Breaker, now, nil),
		Now:     now,
		Rand:    rng.Uint64,
	})
	return &tetherRouter{ids: ids, decider: d, index: index, names: names, clock: clock,
		queueKnown: p.ExtProc.QueueHeader == emulator.QueueDepthHeader}, nil
}

func (t *tetherRouter) prepare(c *conversation) {
	h := make(identity.Map, len(c.headers))
	for _, hd := range c.headers {
		h[hd.Name] = hd.Value
	}
	c.request = affinity.Request{ID: t.ids.Extract(h), Path: requestPath, Headers: h}
}

func (t *tetherRouter) route(ctx context.Context, c *conversation) (int, affinity.Kind, error) {
	t.finish(t.clock())
	now := virtualTime(t.clock())
	if now.Sub(t.lastSync) >= syncEvery {
		if err := t.decider.Load().Sync(ctx, t.names, 3*syncEvery, now); err != nil {
			return 0, "", fmt.Errorf("simulate: load sync: %w", err)
		}
		t.lastSync = now
		if t.trace != nil {
			t.trace(deciderCall{at: now, sync: true})
		}
	}
	d, err := t.decider.Decide(ctx, c.request)
	if err != nil {
		return 0, "", fmt.Errorf("simulate: decide: %w", err)
	}
	c.decision, c.decided = d, t.decided
	if t.trace != nil {
		t.trace(deciderCall{at: now, n: t.decided, request: c.request, decision: d})
	}
	t.decided++
	i, ok := t.index[d.Instance.Name]
	if !ok {
		return 0, "", fmt.Errorf("simulate: decision names unknown instance %q", d.Instance.Name)
	}
	return i, d.Kind, nil
}

func (t *tetherRouter) answered(c *conversation, at int64, queue int) {
	c.reply = affinity.Answer{Answered: true, Queue: queue, QueueKnown: t.queueKnown}
	t.seq++
	t.pending.push(event{at: at, seq: t.seq, conv: c, kind: eventAnswered})
}

// finish hands the decider the answers that arrived by now (virtual ns),
// in the order they arrived. A conversation's next request comes after
// its answer (its turn ends, then its think time): its decision and answer
// are still the ones of its request in flight.
func (t *tetherRouter) finish(now int64) {
	for len(t.pending) > 0 && t.pending[0].at <= now {
		ev := t.pending.pop()
		c := ev.conv
		t.decider.Finish(c.decision, c.reply)
		if t.trace != nil {
			a := c.reply
			t.trace(deciderCall{at: virtualTime(ev.at), n: c.decided, decision: c.decision, answer: &a})
		}
	}
}

// deciderCall is one call the tether router made on its decider: a load
// sync, a decision (request and decision), or an answer (decision and
// answer). n numbers a decision, and an answer by the decision it answers.
type deciderCall struct {
	at       time.Time
	n        int
	sync     bool
	request  affinity.Request
	decision affinity.Decision
	answer   *affinity.Answer
}

// ringRouter is Envoy's RING_HASH (package ringhash, and envoyHash).
type ringRouter struct {
	ring *ringhash.Ring
	rng  *rand.Rand
}

func (r *ringRouter) prepare(c *conversation) { c.ringHash, c.hashed = envoyHash(c.headers) }

func (r *ringRouter) answered(*conversation, int64, int) {}

func (r *ringRouter) route(_ context.Context, c *conversation) (int, affinity.Kind, error) {
	h := c.ringHash
	if !c.hashed {
		h = r.rng.Uint64()
	}
	return r.ring.Pick(h), "", nil
}

// roundRobinRouter emulates Envoy's ROUND_ROBIN with equal weights: the
// hosts in turn, from a random first one. (Each Envoy worker thread keeps its
// own turn; with one thread or many, a conversation's next turn lands on
// another host about (n-1)/n of the time.)
type roundRobinRouter struct {
	n, next int
}

func (r *roundRobinRouter) prepare(*conversation) {}

func (r *roundRobinRouter) answered(*conversation, int64, int) {}

func (r *roundRobinRouter) route(context.Context, *conversation) (int, affinity.Kind, error) {
	i := r.next
	r.next = (r.next + 1) % r.n
	return i, "", nil
}
