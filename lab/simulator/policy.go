package simulator

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/lab/emulator"
	"github.com/tetherproxy/tether/plan"
	"github.com/tetherproxy/tether/replicas"
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
	// Adaptive is tether's adaptive mode: sticky, but a session leaves an
	// instance its engine reports saturated (requests waiting, KV cache
	// use), with the instances' readings taken as tether's poller takes
	// them from vLLM's /metrics (engines.scrape_interval, 1 s).
	Adaptive Policy = "adaptive"
	// CacheAware is tether's sticky mode with cache-aware placement
	// ([content] on): a new session, an anonymous request, or a session
	// idle past its instance's cache horizon is placed by what the
	// instances' caches hold of its prompt (affinity.Decider.Refine, the
	// production code, over prefix.Index's answers: contentRuns), with
	// vLLM's readings every second as tether's poller takes them.
	CacheAware Policy = "cache-aware"
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
// order of the bench's quality table, then the peers' content-reading
// routers, then the oracle.
func Policies() []Policy {
	return []Policy{RoundRobin, LeastRequest, RingHash, Random, Sticky, Adaptive, CacheAware, GIEPrefix, SGLangCacheAware, Oracle}
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
	names := make([]string, 0, 8)
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
	case Adaptive:
		return "tether adaptive"
	case CacheAware:
		return "tether cache-aware"
	case Tether:
		return "tether (config)"
	case RingHash:
		return "Envoy ring hash"
	case RoundRobin:
		return "Envoy round robin"
	case LeastRequest:
		return "Envoy least request"
	case GIEPrefix:
		return "GIE prefix scorer"
	case SGLangCacheAware:
		return "SGLang cache_aware"
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
	// route returns the index of the instance for request k (of its
	// conversation's current turn), at the current virtual time, and the
	// decision's kind for tether ("" for the Envoy policies). An error
	// wrapping errRefused refuses the request; any other stops the run.
	route(ctx context.Context, k *call) (int, affinity.Kind, error)
	// answered says when request k gets its response headers (at,
	// virtual ns), and the queue depth its instance reports with them.
	answered(k *call, at int64, queue int)
	// update tells the router the fleet changed: which instances take
	// requests now (and which failed).
	update(f *fleetState)
}

// errRefused is a request tether refuses (no instance of its version, no
// instance at all): the request fails, the run goes on.
var errRefused = errors.New("refused")

// fleetState is the fleet as the routers see it.
type fleetState struct {
	instances []*instance
	// live are the indices of the instances that take requests, in
	// order; members those in the deployment (live, and failed ones that
	// will return).
	live, members []int
	// died is the instance that just failed (-1: none), back at until
	// (virtual ns).
	died  int
	until int64
	// tetherDown: every tether replica is unreachable (Scenario.Outage).
	tetherDown bool
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
// them, and the load view syncs once a (virtual) second. Instances with an
// engine (adaptive) have their readings taken at each sync, as tether's
// poller scrapes them. While tether is unreachable (fleetState.tetherDown)
// Envoy's fail-open pool routes: its ring hash over the live instances of
// the pool's version.
type tetherRouter struct {
	ids      *identity.Extractor
	decider  *affinity.Decider
	fleet    *fleet.Fleet
	breaker  *fleet.Breaker
	index    map[string]int
	names    []string
	sync     *replicas.LoadSync
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
	// answerAt is the arrival time of the answer being handed to the
	// decider (finish), -1 otherwise.
	answerAt int64
	// state is the fleet; pool and poolIndex Envoy's fail-open ring over
	// it; rng draws the hash of a request without identity headers there.
	state     *fleetState
	pool      *ringhash.Ring
	poolIndex []int
	rng       *rand.Rand
	// prompts is the prefix index the decider places open decisions by
	// (Refine, with the prompt's chain); nil without [content].
	prompts *contentRuns
	// trace, when set (tests), sees every call on the decider; decided
	// numbers the decisions for it.
	trace   func(deciderCall)
	decided int
}

// syncEvery is how often, in virtual time, the router's load view reads
// the store's session index, as tether's load sync does each second (and
// tether's poller scrapes the engines, engines.scrape_interval).
const syncEvery = time.Second

// KindFailOpen counts the requests Envoy's fail-open route carried while
// tether was unreachable (Scenario.Outage).
const KindFailOpen affinity.Kind = "fail-open"

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
	t := &tetherRouter{ids: ids, index: index, names: names, clock: clock, rng: rng,
		queueKnown: p.ExtProc.QueueHeader == emulator.QueueDepthHeader}
	// The decider's clock: the virtual time, or while it hears of an
	// answer, the time the answer arrived (as serve's response phase
	// would tell it then).
	now := func() time.Time {
		if t.answerAt >= 0 {
			return virtualTime(t.answerAt)
		}
		return virtualTime(clock())
	}
	t.answerAt = -1
	fl := fleet.New(p.Instances)
	br := fleet.NewBreaker(p.Breaker, now, nil)
	load := affinity.NewLoad()
	// Synced with the store as tether's replicas sync theirs (every
	// syncEvery of virtual time), over the configured instances.
	all := p.Instances
	t.sync = &replicas.LoadSync{Replica: "simulate", View: load, Store: store, Instances: func() []fleet.Instance { return all }}
	var contents affinity.PrefixIndex
	if p.Content.Enabled {
		// One index block is one emulator block (16 tokens): the plan's
		// block size is 64 bytes at plan's 4 characters a token.
		t.prompts = newContentRuns(p.Content.IndexBlocks(p.Content.CacheTokens))
		contents = t.prompts
	}
	d := plan.NewDecider(p, fl, plan.Deps{
		Index: contents,
		Store: store,
		// The load view reads active sessions from the store as tether's
		// does, so bounded-load placement sees sessions expire.
		Load:    load,
		Breaker: br,
		Now:     now,
		Rand:    rng.Uint64,
	})
	t.decider, t.fleet, t.breaker = d, fl, br
	return t, nil
}

func (t *tetherRouter) prepare(c *conversation) {
	h := make(identity.Map, len(c.headers))
	for _, hd := range c.headers {
		h[hd.Name] = hd.Value
	}
	c.request = affinity.Request{ID: t.ids.Extract(h), Path: requestPath, Headers: h}
}

// update installs the deployment's instances in tether's fleet (with the
// versions they serve now), opens the circuit of one that failed until it
// returns, and rebuilds the fail-open ring.
func (t *tetherRouter) update(f *fleetState) {
	t.state = f
	members := make([]fleet.Instance, 0, len(f.members))
	for _, i := range f.members {
		members = append(members, f.instances[i].Instance)
	}
	t.fleet.Replace(members)
	if f.died >= 0 {
		t.breaker.Opened(f.instances[f.died].Name, virtualTime(f.until))
	}
	version := mostServed(f)
	var keys []string
	t.poolIndex = t.poolIndex[:0]
	for _, i := range f.live {
		if in := f.instances[i]; in.Version == version {
			keys = append(keys, in.Name)
			t.poolIndex = append(t.poolIndex, i)
		}
	}
	t.pool = ringhash.New(keys, DefaultRingSize)
}

// mostServed is the version most live instances serve (the first in
// instance order on a tie): the default route's pool, as xds picks it.
func mostServed(f *fleetState) string {
	n := map[string]int{}
	best := ""
	for _, i := range f.live {
		v := f.instances[i].Version
		n[v]++
		if best == "" || n[v] > n[best] {
			best = v
		}
	}
	return best
}

func (t *tetherRouter) route(ctx context.Context, k *call) (int, affinity.Kind, error) {
	c := k.conv
	if t.state.tetherDown {
		// Envoy's fail-open route: the pool's ring on the raw headers.
		if len(t.poolIndex) == 0 {
			return 0, "", fmt.Errorf("%w: no instance in the fail-open pool", errRefused)
		}
		h, ok := envoyHash(c.headers)
		if !ok {
			h = t.rng.Uint64()
		}
		k.failOpen = true
		return t.poolIndex[t.pool.Pick(h)], KindFailOpen, nil
	}
	k.failOpen = false
	t.finish(t.clock())
	now := virtualTime(t.clock())
	if now.Sub(t.lastSync) >= syncEvery {
		t.scrape(now)
		if err := t.sync.Sync(ctx, now); err != nil {
			return 0, "", fmt.Errorf("simulate: load sync: %w", err)
		}
		t.lastSync = now
		if t.trace != nil {
			t.trace(deciderCall{at: now, sync: true})
		}
	}
	d, err := t.decider.Decide(ctx, c.request)
	if errors.Is(err, affinity.ErrNoVersion) || errors.Is(err, affinity.ErrNoInstance) {
		return 0, "", fmt.Errorf("%w: %w", errRefused, err)
	}
	if err != nil {
		return 0, "", fmt.Errorf("simulate: decide: %w", err)
	}
	var chain []uint64
	if d.Open {
		// What tether does with the body Envoy then sends.
		t.prompts.conv = c // what the chain is made of
		chain = c.chain()
		d = t.decider.Refine(ctx, d, chain)
		t.prompts.conv = nil
	}
	k.decision, k.decided = d, t.decided
	if t.trace != nil {
		// A copy: a conversation that ends hands its chain's slice on.
		t.trace(deciderCall{at: now, n: t.decided, request: c.request, decision: d, chain: slices.Clone(chain)})
	}
	t.decided++
	i, ok := t.index[d.Instance.Name]
	if !ok {
		return 0, "", fmt.Errorf("simulate: decision names unknown instance %q", d.Instance.Name)
	}
	return i, d.Kind, nil
}

// scrape records, for every live instance with an engine, the reading
// its engine would publish now (instance.reading), as tether's poller
// does once per scrape interval.
func (t *tetherRouter) scrape(now time.Time) {
	for _, i := range t.state.live {
		if in := t.state.instances[i]; in.Engine != "" {
			t.decider.Load().SetEngine(in.Name, in.reading(now))
		}
	}
}

func (t *tetherRouter) answered(k *call, at int64, queue int) {
	if k.failOpen {
		return // tether never decided it
	}
	k.reply = fleet.Outcome{Answered: true, Queue: queue, QueueKnown: t.queueKnown}
	t.seq++
	t.pending.push(event{at: at, seq: t.seq, call: k, kind: eventAnswered})
}

// finish hands the decider the answers that arrived by now (virtual ns),
// in the order they arrived. A conversation's next request comes after
// its answer (its turn ends, then its think time): a call's decision and
// answer are still the ones of its request in flight.
func (t *tetherRouter) finish(now int64) {
	for len(t.pending) > 0 && t.pending[0].at <= now {
		ev := t.pending.pop()
		k := ev.call
		t.answerAt = ev.at
		t.decider.Finish(k.decision, k.reply)
		t.answerAt = -1
		if t.trace != nil {
			a := k.reply
			t.trace(deciderCall{at: virtualTime(ev.at), n: k.decided, decision: k.decision, answer: &a})
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
	chain    []uint64 // the prompt Refine placed the decision by; nil for none
	answer   *fleet.Outcome
}

// ringRouter is Envoy's RING_HASH (package ringhash, and envoyHash) over
// the live instances: Envoy builds its ring over the healthy hosts, so an
// instance leaving or returning moves the keys of its points.
type ringRouter struct {
	size  int
	ring  *ringhash.Ring
	index []int // ring host → instance
	rng   *rand.Rand
}

func (r *ringRouter) prepare(c *conversation) { c.ringHash, c.hashed = envoyHash(c.headers) }

func (r *ringRouter) answered(*call, int64, int) {}

func (r *ringRouter) update(f *fleetState) {
	// Keyed by name: the hash_key tether's xDS server gives each pool
	// endpoint.
	keys := make([]string, len(f.live))
	for j, i := range f.live {
		keys[j] = f.instances[i].Name
	}
	r.ring, r.index = ringhash.New(keys, r.size), slices.Clone(f.live)
}

func (r *ringRouter) route(_ context.Context, k *call) (int, affinity.Kind, error) {
	c := k.conv
	h := c.ringHash
	if !c.hashed {
		h = r.rng.Uint64()
	}
	return r.index[r.ring.Pick(h)], "", nil
}

// roundRobinRouter emulates Envoy's ROUND_ROBIN with equal weights: the
// live hosts in turn, from a random first one. (Each Envoy worker thread
// keeps its own turn; with one thread or many, a conversation's next turn
// lands on another host about (n-1)/n of the time.)
type roundRobinRouter struct {
	live []int
	next int
}

func (r *roundRobinRouter) prepare(*conversation) {}

func (r *roundRobinRouter) answered(*call, int64, int) {}

func (r *roundRobinRouter) update(f *fleetState) { r.live = f.live }

func (r *roundRobinRouter) route(context.Context, *call) (int, affinity.Kind, error) {
	i := r.live[r.next%len(r.live)]
	r.next = (r.next + 1) % len(r.live)
	return i, "", nil
}
