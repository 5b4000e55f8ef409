package affinity

// Cache-aware placement: where a request goes when what the instances'
// KV caches hold of its prompt should decide, and their load allows.
//
// Decide answers from the request's headers, as always. A decision whose
// placement is open (a new session, a session placed again, an anonymous
// request) says so (Decision.Content): the caller may then read the
// request's prompt and hand its chained block hashes (package prefix) to
// Refine, which
//
//  1. scores the candidates (the healthy instances of the decision's model
//     version, on-demand before spot, unsaturated) by the longest prefix
//     of the prompt each holds, as far as tether sent it there (Contents);
//  2. takes the one holding the longest prefix of at least
//     ContentPolicy.MinBlocks blocks whose load passes the gate: its
//     requests in flight below its weighted share of the candidates' by the
//     bounded-load factor (1+ε), plus ContentPolicy.Slack, its engine not
//     saturated by its queue (its KV cache's use is no gate: a cache full of
//     prompts is what this placement wants), and for a session, its active
//     sessions under their bound
//     (bounded load's, or kv_sessions when that is more);
//     on a tie, the fewer requests in flight;
//  3. moves the decision there (a session's binding with one Replace),
//     or keeps the identity placement when no candidate qualifies, so a
//     session the index says nothing about stays where Envoy's fail-open
//     pool would send it;
//  4. records the prompt's blocks on the instance it ends on.
//
// A hit on a live binding never comes here: it is answered from the
// headers, without the body.

import (
	"context"
	"time"

	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/fleet"
)

// Contents is what cache-aware placement reads and writes of the prefix
// index (prefix.Index).
type Contents interface {
	// Match writes how many leading blocks of chain each of names holds
	// into depth, and returns the most.
	Match(chain []uint64, names []string, depth []int) int
	// Record notes that chain was sent to instance.
	Record(instance string, chain []uint64, now time.Time)
	// Horizon is how long a prefix nobody sends survives on instance, as
	// the index measured it from its own evictions (ok false: none yet).
	Horizon(instance string) (time.Duration, bool)
}

// WithContents gives the decider the prefix index cache-aware placement
// reads (ContentPolicy turns it on).
func WithContents(c Contents) Option { return func(d *Decider) { d.contents = c } }

// ContentPolicy is cache-aware placement's part of the policy.
type ContentPolicy struct {
	// Enabled: decisions whose placement is open say so (Decision.Content),
	// and Refine places them by what the caches hold.
	Enabled bool
	// MinBlocks is the shortest match that counts: a shorter one (a few
	// blocks of a shared template) decides nothing.
	MinBlocks int
	// Slack is how many requests in flight beyond its bounded-load share
	// an instance may take for what its cache holds.
	Slack int
}

// contentKinds are the decisions whose placement is open: the request's
// instance was just chosen by identity, and what the caches hold may
// choose better.
var contentKinds = map[Kind]bool{KindBind: true, KindRebind: true, KindMoved: true, KindAnonymous: true, KindExpired: true}

// Refine places dec by the prompt's chained block hashes (see the file's
// comment) and returns the decision the request goes with. It returns dec
// unchanged (apart from ByContent) when dec's placement is not open, the
// chain is empty, or no candidate holds enough of it under the gate. A
// store error keeps dec: the request goes where identity placed it.
func (d *Decider) Refine(ctx context.Context, dec Decision, chain []uint64) (out Decision) {
	p := d.policy.Load()
	if !dec.Content || len(chain) == 0 || d.contents == nil {
		return dec
	}
	now := d.now()
	defer func() { d.contents.Record(out.Instance.Name, chain, now) }()
	cands := d.contentCandidates(p, dec)
	if len(cands) == 0 {
		return dec
	}
	var nameBuf [64]string
	var depthBuf [64]int
	names := nameBuf[:0]
	for _, in := range cands {
		names = append(names, in.Name)
	}
	var depth []int
	if len(cands) <= len(depthBuf) {
		depth = depthBuf[:len(cands)]
	} else {
		depth = make([]int, len(cands))
	}
	dec.Matched = d.contents.Match(chain, names, depth)
	i := -1
	if dec.Matched >= max(p.Content.MinBlocks, 1) {
		i = d.load.gate(cands, depth, p, dec.Key != "", dec.Instance.Name, max(p.Content.MinBlocks, 1))
	}
	if i < 0 {
		dec.Matched = 0
		if dec.Kind == KindExpired {
			// Nothing holds it: its cache is gone wherever it goes, so
			// bounded load places it, off an instance that is full.
			return d.moveTo(ctx, dec, d.place(dec.Key, cands, p), now, true)
		}
		return dec
	}
	dec.Matched = depth[i]
	dec = d.moveTo(ctx, dec, cands[i], now, false)
	dec.ByContent = dec.Instance.Name == cands[i].Name
	return dec
}

// moveTo moves dec to target: its session's binding with one Replace
// (reserved is true when target was reserved by place), the request in
// flight, the breaker's probe. On a store error, or a probe it cannot
// take, dec stays as it is.
func (d *Decider) moveTo(ctx context.Context, dec Decision, target fleet.Instance, now time.Time, reserved bool) Decision {
	if target.Name == dec.Instance.Name || dec.Probe {
		// Where it is; or the identity choice probes a half-open
		// instance, and keeps it.
		if reserved {
			d.load.unreserve(target.Name, false, "")
		}
		return dec
	}
	var probe bool
	if d.breaker != nil {
		var ok bool
		if probe, ok = d.breaker.TryBegin(target.Name); !ok {
			if reserved {
				d.load.unreserve(target.Name, false, "")
			}
			return dec
		}
	}
	if dec.Key != "" {
		if !reserved {
			d.load.reserveName(target.Name)
		}
		nb, err := d.store.Replace(ctx, dec.Key, dec.Instance.Name,
			bindings.Binding{Instance: target.Name, Version: target.Version, Since: now}, dec.lifetime)
		moved := err == nil && nb.Instance == target.Name
		d.load.unreserve(target.Name, moved, dec.Instance.Name)
		if !moved {
			if probe {
				d.breaker.Done(target.Name, true, fleet.Outcome{})
			}
			return dec
		}
	}
	d.load.End(dec.Instance.Name, dec.At, 0, false)
	d.load.Begin(target.Name, dec.At)
	dec.Instance, dec.Probe = target, probe
	return dec
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
// cache: the capacity its engine publishes over the rate its engine fills
// the cache with prompt tokens it had to compute (looked up less found in
// its prefix cache, from vLLM's and SGLang's counters), the time an LRU
// cache takes to turn over; without such a reading, what the prefix index
// measured of its own evictions. ok false: neither knows (nothing is ever
// past it).
func (d *Decider) Horizon(instance string) (time.Duration, bool) {
	p := d.policy.Load()
	if r, ok := d.load.Engine(instance, p.Saturation.Stale); ok && r.CacheTokens > 0 && r.RatesKnown {
		fill := r.QueryRate - r.HitRate
		if fill <= 0 {
			return 0, false // nothing new comes in: nothing is evicted
		}
		return time.Duration(float64(r.CacheTokens) / fill * float64(time.Second)), true
	}
	if d.contents == nil {
		return 0, false
	}
	return d.contents.Horizon(instance)
}

// contentCandidates is where dec's request may go by content: the healthy
// instances of its instance's model version, on-demand before spot, and
// for an adaptive decision the unsaturated ones.
func (d *Decider) contentCandidates(p *Policy, dec Decision) []fleet.Instance {
	cands := stickyCandidates(dec.Instance.Version, d.available())
	if dec.Mode == Adaptive {
		cands = d.unsaturated(cands, p.Saturation)
	}
	return cands
}

// gate returns the index in cands of the instance holding the longest
// prefix (depth, at least minBlocks) whose load passes (see the file's
// comment), -1 when none does. sessions says the request binds a session,
// so the instance's active sessions must also be under their bound; own
// is the instance the request is counted on already (in flight, and its
// session bound there), which the gate leaves out of its load.
func (l *Load) gate(cands []fleet.Instance, depth []int, p *Policy, sessions bool, own string, minBlocks int) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	var flightBuf, activeBuf [64]int
	flight, active := flightBuf[:0], activeBuf[:0]
	totalFlight, totalActive, weight := 0, 0, 0.0
	for _, in := range cands {
		f := max(l.state.InFlight[in.Name]+l.localFlight(in.Name), 0)
		a := l.activeLocked(in.Name)
		if in.Name == own {
			f = max(f-1, 0)
			if sessions {
				a = max(a-1, 0)
			}
		}
		flight, active = append(flight, f), append(active, a)
		totalFlight, totalActive, weight = totalFlight+f, totalActive+a, weight+in.Weight
	}
	// A cache full of prompts is what placement by content wants: the KV
	// cache's use is no gate here (its queue and requests in flight are).
	sat := p.Saturation
	sat.KVUsage = 0
	best := -1
	for i, in := range cands {
		if depth[i] < minBlocks || best >= 0 && (depth[i] < depth[best] || depth[i] == depth[best] && flight[i] >= flight[best]) {
			continue
		}
		share := in.Weight / weight
		if flight[i] >= ceil((1+p.Epsilon)*float64(totalFlight+1)*share)+p.Content.Slack {
			continue
		}
		if sessions && active[i] >= max(ceil((1+p.Epsilon)*float64(totalActive+1)*share), in.KVSessions) {
			continue
		}
		if l.saturatedLocked(in.Name, sat) {
			continue
		}
		best = i
	}
	return best
}
