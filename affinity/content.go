package affinity

// Cache-aware placement: where a request goes when what the instances'
// KV caches hold of its prompt should decide.
//
// Decide answers from the request's headers, as always. Some decisions
// leave their placement open: a new session, a session placed again, an
// anonymous request. They say so (Decision.Open). The caller may then read
// the request's prompt and hand its chained block hashes (package prefix)
// to Refine. Refine runs the placement pipeline again with the prompt's
// score (promptScore). A hit on a live binding never comes here: it is
// answered from the headers, without the body.
//
// The prompt's score is what each candidate would make the request wait,
// in prompt tokens:
//
//	cost = tokens of the prompt it does not hold (the prefill there)
//	     + queued_tokens  × its requests waiting for a prefill
//	     + running_tokens × its requests running
//
// The load part is scaled by the candidates' mean weight over the
// instance's own. The cheapest candidate takes the request. On a tie, the
// instance identity chose keeps it. So a prefix pulls a request only where
// what it saves outweighs the instance's work, and an idle instance takes
// what a busy one would hold. A prompt of which no candidate holds
// Content.MinBlocks is not worth matching. The request then stays where
// identity placed it, where Envoy's fail-open pool sends it too.

import (
	"context"
	"time"

	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/fleet"
)

// PrefixIndex is what cache-aware placement reads and writes of the prefix
// index (prefix.Index).
type PrefixIndex interface {
	// Match writes how many leading blocks of chain each of names holds
	// into depth, and returns the most.
	Match(chain []uint64, names []string, depth []int) int
	// Record notes that chain was sent to instance.
	Record(instance string, chain []uint64, now time.Time)
	// Horizon is how long a prefix nobody sends survives on instance, as
	// the index measured it from its own evictions (ok false: none yet).
	Horizon(instance string) (time.Duration, bool)
}

// WithPrefixIndex gives the decider the prefix index cache-aware placement
// reads (Content turns it on).
func WithPrefixIndex(c PrefixIndex) Option { return func(d *Decider) { d.index = c } }

// Content is cache-aware placement's part of the policy.
type Content struct {
	// Enabled makes decisions whose placement is open say so
	// (Decision.Open). Refine then places them by what the caches hold.
	Enabled bool
	// MinBlocks is the shortest match that counts: a shorter one (a few
	// blocks of a shared template) decides nothing.
	MinBlocks int
	// BlockTokens is the prompt tokens of one block of the chain.
	BlockTokens float64
	// QueuedTokens is what one request waiting for its prefill on an
	// instance costs a prompt placed there, in prompt tokens;
	// RunningTokens what one request running there costs it.
	QueuedTokens, RunningTokens float64
}

// openKinds are the decisions whose placement is open: the request's
// instance was just chosen by identity, and what the caches hold may
// choose better.
var openKinds = map[Kind]bool{KindBind: true, KindRebind: true, KindMoved: true, KindAnonymous: true, KindExpired: true}

// Refine places dec by the prompt's chained block hashes (see the file's
// comment) and returns the decision the request goes with. It returns dec
// unchanged (apart from ByContent and Matched) when dec's placement is not
// open, the chain is empty, or no candidate holds enough of it. A store
// error keeps dec: the request goes where identity placed it.
func (d *Decider) Refine(ctx context.Context, dec Decision, chain []uint64) (out Decision) {
	p := d.policy.Load()
	if !dec.Open || len(chain) == 0 || d.index == nil {
		return dec
	}
	now := d.now()
	defer func() { d.index.Record(out.Instance.Name, chain, now) }()
	ps := promptScore{chain: chain, identity: dec.Instance.Name, policy: p.Content, sessions: dec.Key != ""}
	pl := placement{
		key:     promptKey(dec.Key, chain),
		from:    d.available(dec.subset),
		version: dec.Instance.Version,
		// An adaptive session is not placed where it would spill at once.
		unsaturated: dec.Mode == Adaptive,
		prompt:      &ps,
	}
	r := d.ranking()
	defer d.done(r)
	if d.rank(&pl, r); !ps.worth() {
		dec.Matched = 0
		if dec.Kind == KindExpired {
			// Nothing holds it: its cache is gone wherever it goes, so the
			// identity ranking places it, off an instance that is full.
			pl.prompt, pl.sessions, pl.key, pl.reserve = nil, true, fnv64(dec.Key), true
			d.rank(&pl, r)
			return d.moveTo(ctx, dec, r, now)
		}
		return dec
	}
	dec = d.moveTo(ctx, dec, r, now)
	dec.ByContent = true
	dec.Matched = ps.depthOf(dec.Instance.Name, pl.from)
	return dec
}

// promptKey is the rendezvous key of a content placement: the session's,
// else the prompt's own, so that equal prompts break ties alike.
func promptKey(key string, chain []uint64) uint64 {
	if key != "" {
		return fnv64(key)
	}
	return mix64(chain[len(chain)-1])
}

// moveTo moves dec to the first of r: its session's binding with one
// Replace, the request in flight, the breaker's probe. On a store error,
// or a probe it cannot take, dec stays as it is.
func (d *Decider) moveTo(ctx context.Context, dec Decision, r *Ranking, now time.Time) Decision {
	target, ok := r.First()
	if !ok || target.Name == dec.Instance.Name || dec.Probe {
		// Where it is; or the identity choice probes a half-open
		// instance, and keeps it.
		return dec
	}
	var probe bool
	if d.breaker != nil {
		var ok bool
		if probe, ok = d.breaker.TryBegin(target.Name); !ok {
			return dec
		}
	}
	if dec.Key != "" {
		if r.held.l == nil {
			r.held = d.load.holdOn(target.Name)
		}
		nb, err := d.store.Replace(ctx, dec.Key, dec.Instance.Name,
			bindings.Binding{Instance: target.Name, Version: target.Version, Since: now}, dec.lifetime)
		if err != nil || nb.Instance != target.Name {
			if probe {
				d.breaker.Done(target.Name, true, fleet.Outcome{})
			}
			return dec
		}
		r.commit(dec.Instance.Name)
	}
	d.load.End(dec.Instance.Name, dec.At, 0, false)
	d.load.Begin(target.Name, dec.At)
	dec.Fallbacks = shiftFallbacks(dec.Fallbacks, dec.Instance, target)
	dec.Instance, dec.Probe = target, probe
	return dec
}

// shiftFallbacks is the fallbacks of a request moved from one instance to
// another: the one it leaves first, then the rest without the one it
// goes to. The list keeps its length.
func shiftFallbacks(fallbacks []fleet.Instance, from, to fleet.Instance) []fleet.Instance {
	if len(fallbacks) == 0 {
		return nil
	}
	out := make([]fleet.Instance, 0, len(fallbacks))
	if from.Version == to.Version {
		out = append(out, from)
	}
	for _, in := range fallbacks {
		if in.Name != to.Name && len(out) < len(fallbacks) {
			out = append(out, in)
		}
	}
	return out
}

// promptScore is the pipeline's score of a prompt (stage 3): what each
// candidate's cache holds of it against its load (see the file's comment).
type promptScore struct {
	chain    []uint64
	identity string // the instance identity chose: it keeps a tie
	policy   Content
	sessions bool // the request binds a session: bounded load holds
	// depth is how many blocks of chain each instance of the placement's
	// from holds, by its index there; deepest the most.
	depth    []int
	deepest  int
	depthBuf [64]int
}

// match fills depth for the instances of from at idx.
func (ps *promptScore) match(c PrefixIndex, from []fleet.Instance, idx []int) {
	if len(from) <= len(ps.depthBuf) {
		ps.depth = ps.depthBuf[:len(from)]
	} else {
		ps.depth = make([]int, len(from))
	}
	var nameBuf [64]string
	var depthBuf [64]int
	names, depth := nameBuf[:0], depthBuf[:0]
	if len(idx) > len(nameBuf) {
		names, depth = make([]string, 0, len(idx)), make([]int, 0, len(idx))
	}
	for _, i := range idx {
		names = append(names, from[i].Name)
		depth = append(depth, 0)
	}
	ps.deepest = c.Match(ps.chain, names, depth)
	for k, i := range idx {
		ps.depth[i] = depth[k]
	}
}

// worth reports whether a candidate holds enough of the prompt to count.
func (ps *promptScore) worth() bool { return ps.deepest >= max(ps.policy.MinBlocks, 1) }

// depthOf is what instance name, of from, holds of the prompt.
func (ps *promptScore) depthOf(name string, from []fleet.Instance) int {
	for i, in := range from {
		if in.Name == name {
			return ps.depth[i]
		}
	}
	return 0
}

// score keys the candidates of r by their cost in prompt tokens. An
// instance other than identity's choice ranks after every other when it
// may not take the request. It may not when its engine's queue is
// saturated, or, for a session, when its active sessions are at their
// bound. A full KV cache is no bar: a cache full of prompts is what this
// placement wants.
func (ps *promptScore) score(l *Load, p *Policy, pl *placement, r *Ranking, engs []engineLoad) {
	idx, keys := r.idx(), r.keys()
	var activeBuf [64]int
	active := activeBuf[:0]
	total, weight := 0, 0.0
	for _, i := range idx {
		a := l.activeLocked(pl.from[i].Name)
		if pl.from[i].Name == ps.identity && ps.sessions {
			a = max(a-1, 0) // its session is counted there already
		}
		active = append(active, a)
		total += a
		weight += pl.from[i].Weight
	}
	mean := weight / float64(len(idx))
	sat := p.Saturation
	sat.KVUsage = 0
	n := len(ps.chain)
	for k, i := range idx {
		in := pl.from[i]
		own := in.Name == ps.identity
		self := 0
		if own {
			self = 1 // the request is counted there already
		}
		queued, running := l.workWith(in.Name, self, engs[i])
		load := ps.policy.QueuedTokens*float64(queued) + ps.policy.RunningTokens*float64(running)
		key := rankKey{pin: own, cost: float64(n-ps.depth[i])*ps.policy.BlockTokens + load*mean/in.Weight}
		if !own && (ps.sessions && active[k] >= bound(total, in, weight, p.Epsilon) || l.saturatedWith(in.Name, sat, engs[i])) {
			key.tier = 1
		}
		keys[k] = key
	}
}

// pastHorizon says whether a session idle this long has nothing left
// cached on instance.
func (d *Decider) pastHorizon(instance string, idle time.Duration) bool {
	if idle <= 0 {
		return false
	}
	h, ok := d.Horizon(instance)
	return ok && idle > h
}

// Horizon is how long a prefix nobody sends survives in instance's KV
// cache. It is the time an LRU cache takes to turn over: the capacity the
// engine publishes over the rate it fills the cache. That rate is the
// prompt tokens it had to compute: looked up less found, from vLLM's and
// SGLang's counters. Without such a reading, Horizon is what the prefix
// index measured of its own evictions. ok is false when neither knows;
// then nothing is ever past it.
func (d *Decider) Horizon(instance string) (time.Duration, bool) {
	p := d.policy.Load()
	if r, ok := d.load.Engine(instance, p.Saturation.Stale); ok && r.CacheTokens > 0 && r.RatesKnown {
		fill := r.QueryRate - r.HitRate
		if fill <= 0 {
			return 0, false // nothing new comes in: nothing is evicted
		}
		return time.Duration(float64(r.CacheTokens) / fill * float64(time.Second)), true
	}
	if d.index == nil {
		return 0, false
	}
	return d.index.Horizon(instance)
}
