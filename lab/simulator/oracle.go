package simulator

import (
	"context"
	"math/rand/v2"
	"strings"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/lab/emulator"
)

// The bounds tether is measured against, and Envoy's least-request
// balancer.
const (
	// Oracle sends each request to the instance whose KV cache holds the
	// longest prefix of its prompt (ties to the instance with the fewest
	// requests in flight, then at random): it reads every instance's cache,
	// so no router can find more of a prompt cached than it does. It is what
	// precise KV-event routing (llm-d's precise prefix-cache scorer,
	// Dynamo's KV router) aims at.
	Oracle Policy = "oracle"
	// LeastRequest emulates Envoy's LEAST_REQUEST with equal weights: the
	// power of two choices, two hosts drawn at random and the one with
	// fewer active requests taken (the first on a tie).
	LeastRequest Policy = "least-request"
)

// leastRequestChoices is Envoy's default choice_count.
const leastRequestChoices = 2

// leastRequestRouter emulates Envoy's LEAST_REQUEST with equal weights
// (LeastRequestLoadBalancer's unweighted pick): choice_count hosts drawn
// uniformly with replacement, the one with the fewest active requests
// kept, the earlier draw on a tie. Envoy's active requests are the
// requests it sent to the host that have not ended: the simulator's
// requests in flight on the instance (queued, prefilling or decoding).
type leastRequestRouter struct {
	instances []*instance
	live      []int
	rng       *rand.Rand
}

func (r *leastRequestRouter) prepare(*conversation) {}

func (r *leastRequestRouter) answered(*call, int64, int) {}

func (r *leastRequestRouter) update(f *fleetState) { r.live = f.live }

func (r *leastRequestRouter) route(context.Context, *call) (int, affinity.Kind, error) {
	best := -1
	for range leastRequestChoices {
		i := r.live[r.rng.IntN(len(r.live))]
		if best < 0 || r.instances[i].inFlight < r.instances[best].inFlight {
			best = i
		}
	}
	return best, "", nil
}

// prefixer is a model that can tell, without changing anything, how many
// leading blocks of a conversation's next prompt its cache would serve.
type prefixer interface {
	// cachedPrefix is the number of blocks of c's current turn the cache
	// would find if the request arrived at now (virtual ns): the lookup
	// cost does when the request's prefill starts.
	cachedPrefix(c *conversation, now int64) int
}

// oracleRouter is the Oracle policy.
//
// A match that covers only the application's system prompt counts as no
// match: taken literally, "longest prefix" sends every new conversation of
// an application to the instances that already hold its system prompt, so
// from cold caches the whole application lands on the first instance it
// reached (at 64 instances, 60 requests/s, requests per instance reached
// 17× the mean). Any instance computes a system prompt once and keeps it
// (it is shared, so it stays at the front of the LRU), so the oracle ranks
// instances by the conversation's own cached prefix, then by the fewest
// requests in flight, then by the cached system prompt, then at random.
type oracleRouter struct {
	instances []*instance
	live      []int
	models    []prefixer
	system    []int // per application: its system prompt's full blocks
	clock     func() int64
	rng       *rand.Rand
}

func (r *oracleRouter) prepare(*conversation) {}

func (r *oracleRouter) answered(*call, int64, int) {}

func (r *oracleRouter) update(f *fleetState) { r.live = f.live }

func (r *oracleRouter) route(_ context.Context, k *call) (int, affinity.Kind, error) {
	c := k.conv
	now := r.clock()
	sys := r.system[c.shape.app]
	best, ties := -1, 0
	var bestOwn, bestLoad, bestBlocks int
	for _, i := range r.live {
		blocks, load := r.models[i].cachedPrefix(c, now), r.instances[i].inFlight
		own := 0
		if blocks > sys {
			own = blocks
		}
		better := best < 0 || own > bestOwn ||
			(own == bestOwn && (load < bestLoad || (load == bestLoad && blocks > bestBlocks)))
		switch {
		case better:
			best, bestOwn, bestLoad, bestBlocks, ties = i, own, load, blocks, 1
		case own == bestOwn && load == bestLoad && blocks == bestBlocks:
			// Reservoir sampling: each tied instance equally likely.
			ties++
			if r.rng.IntN(ties) == 0 {
				best = i
			}
		}
	}
	return best, "", nil
}

// newOracleRouter reads the instances' models; each must be a prefixer
// (both cost models are).
func newOracleRouter(instances []*instance, system []int, clock func() int64, rng *rand.Rand) *oracleRouter {
	r := &oracleRouter{instances: instances, system: system, clock: clock, rng: rng}
	for _, in := range instances {
		r.models = append(r.models, in.model.(prefixer))
	}
	return r
}

// lookupBlocks is the number of leading prompt blocks emulator.GPU.Cost
// looks up for a prompt of promptTokens tokens: its full blocks, less the
// last one when the prompt ends on a block boundary (a prefill computes
// at least one token).
func lookupBlocks(promptTokens int) int {
	if promptTokens <= 0 {
		return 0
	}
	return min(promptTokens/emulator.BlockSize, (promptTokens-1)/emulator.BlockSize)
}

func (m *blockModel) cachedPrefix(c *conversation, now int64) int {
	lookup := lookupBlocks(c.history + c.shape.turns[c.turn].userTokens)
	if m.docs != nil {
		return m.docs.match(c, lookup, max(now, m.prefillFree))
	}
	return m.cache.match(c.shape.app, c.shape.index, lookup, max(now, m.prefillFree))
}

func (m *textModel) cachedPrefix(c *conversation, now int64) int {
	msgs, err := c.text.Messages(c.turn, c.answers)
	if err != nil {
		panic(err) // the runner keeps one answer per turn served: a bug
	}
	parts := make([]string, len(msgs))
	for i, msg := range msgs {
		parts[i] = msg.Content
	}
	var h emulator.BlockHasher
	hashes := h.Append(nil, strings.Join(parts, "\n"))
	lookup := lookupBlocks(h.Tokens())
	return m.gpu.Cache().Match(hashes[:min(lookup, len(hashes))], virtualTime(max(now, m.prefillFree)))
}

// boundTally measures the infinite-cache bound over a run's requests: the
// prompt tokens (of the blocks a lookup covers) that repeat a prefix some
// earlier request had already sent, on any instance, as if every instance
// shared one cache that never evicts and every block were ready at once.
// No router and no cache can serve more: a block cached anywhere was stored
// by an earlier request. A conversation's prompt repeats its previous
// turn's prompt and answer; its application's system prompt is repeated
// once any request of the application has been priced.
type boundTally struct {
	system []int  // per application: its system prompt's full blocks
	seen   []bool // per application: a request of it has been priced
	// docs are the (application, document) pairs a request has carried:
	// their blocks up to the document's end are repeated after that.
	docs    map[[2]int]bool
	tokens  int64 // repeated prompt tokens, OK requests
	current int   // repeated tokens of the request being sent
}

func newBoundTally(system []int) boundTally {
	return boundTally{system: system, seen: make([]bool, len(system))}
}

// price notes c's current turn, priced now: its repeated tokens are those
// of the blocks sent before, and its application's system prompt has been
// sent, and so has its shared document (with this application's). A fan-out request after the turn's first (again) repeats its
// whole prompt.
func (b *boundTally) price(c *conversation, again bool) {
	a := c.shape.app
	seen := 0
	if b.seen[a] {
		seen = b.system[a]
	}
	if c.turn > 0 {
		// The previous turn stored its prompt's and answer's full blocks.
		seen = max(seen, c.history/emulator.BlockSize)
	}
	lookup := lookupBlocks(c.history + c.shape.turns[c.turn].userTokens)
	if again {
		seen = lookup
	}
	if d := c.shape.doc; d >= 0 {
		key := [2]int{a, d}
		if b.docs[key] {
			seen = max(seen, c.docEnd)
		}
		if b.docs == nil {
			b.docs = map[[2]int]bool{}
		}
		b.docs[key] = true
	}
	b.current = min(lookup, seen) * emulator.BlockSize
	b.seen[a] = true
}
