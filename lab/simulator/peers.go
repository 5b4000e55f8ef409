package simulator

import (
	"cmp"
	"context"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/lab/emulator"
)

// The peers' published content-reading policies, written from their
// sources and shipped defaults (lab/simulator/README.md, "The peers"):
// each reads the request's prompt, as the simulator's block chain
// (conversation.chain), never the instances' caches.
const (
	// GIEPrefix is the Gateway API Inference Extension's default
	// scheduling profile: its approximate prefix-cache scorer beside its
	// queue and KV-cache-utilization scorers, max-score picker.
	GIEPrefix Policy = "gie-prefix"
	// SGLangCacheAware is SGLang's router (sgl-router) cache_aware policy:
	// an approximate radix tree of the requests sent to each worker, and
	// shortest queue when the load is imbalanced.
	SGLangCacheAware Policy = "sglang-cache-aware"
)

// GIE's defaults, from kubernetes-sigs/gateway-api-inference-extension:
// pkg/epp/scheduling/framework/plugins/multi/prefix/plugin.go (and its
// later home prefixcachescorer/plugin.go: DefaultBlockSize 64 characters,
// "vLLM default token block size is 16, and a good guess of average
// characters per token is 4"; DefaultMaxPrefixBlocks 256;
// DefaultLRUCapacityPerServer 31250, which AutoTune, on by default,
// replaces with the server's vllm:cache_config_info num_gpu_blocks), and
// config/charts/inferencepool/templates/epp-config.yaml (the default
// profile: queue-scorer weight 2, kv-cache-utilization-scorer 2,
// prefix-cache-scorer 3; no picker named, so max-score-picker, which
// shuffles the endpoints before a stable sort: ties at random).
const (
	gieMaxPrefixBlocks = 256
	gieQueueWeight     = 2
	gieKVWeight        = 2
	giePrefixWeight    = 3
	// gieRefresh is how often the EPP refreshes each pod's metrics (its
	// --refresh-metrics-interval, 50 ms).
	gieRefresh = 50 * time.Millisecond
)

// gieRouter is GIEPrefix. One GIE block is 64 characters of the prompt,
// which at GIE's own 4 characters per token is one 16-token emulator
// block: the router hashes the prompt's chain (its full blocks), the first
// 256 of them (GIE truncates the prompt to 256 blocks: 4,096 tokens).
//
// Its indexer keeps, per server, an LRU of the block hashes of the
// requests it sent there (added when it routes, PreRequest; it never
// hears of the server's evictions), of the server's GPU blocks (AutoTune:
// the emulated instance's KV capacity / 16); a hash maps to the servers
// whose LRU holds it. A server's prefix score is the number of leading
// hashes (stopping at the first no server holds) its LRU holds, over the
// prompt's hashes; queue score (max − q)/(max − min) over the waiting
// requests (1 when all equal); KV score 1 − KV-cache use; the request goes
// to the highest 2·queue + 2·kv + 3·prefix, ties at random. The readings
// are vLLM's /metrics as the adaptive policy reads them (instance.reading),
// refreshed every 50 ms. The LRUs are kept in runs of blocks (gieIndex).
type gieRouter struct {
	instances []*instance
	live      []int
	clock     func() int64
	rng       *rand.Rand
	index     *gieIndex
	readings  []gieReading
	spans     []gieSpan
	match     []int
}

type gieReading struct {
	at      int64
	waiting int
	kv      float64
}

func newGIERouter(instances []*instance, capacityTokens int, clock func() int64, rng *rand.Rand) *gieRouter {
	r := &gieRouter{instances: instances, clock: clock, rng: rng, index: newGIEIndex(len(instances), max(capacityTokens/emulator.BlockSize, 1)),
		readings: make([]gieReading, len(instances)), match: make([]int, len(instances))}
	for i := range r.readings {
		r.readings[i].at = -1
	}
	return r
}

func (r *gieRouter) prepare(*conversation) {}

func (r *gieRouter) answered(*call, int64, int) {}

// update takes the live instances; an instance that left has its LRU
// dropped, as the EPP's inactive-pod cleanup does (within two minutes).
func (r *gieRouter) update(f *fleetState) {
	r.live = f.live
	up := make([]bool, len(r.instances))
	for _, i := range f.live {
		up[i] = true
	}
	for i := range r.instances {
		if !up[i] {
			r.index.drop(i)
		}
	}
}

func (r *gieRouter) route(_ context.Context, k *call) (int, affinity.Kind, error) {
	c := k.conv
	n := min((c.history+c.shape.turns[c.turn].userTokens)/emulator.BlockSize, gieMaxPrefixBlocks)
	r.spans = gieSpans(r.spans, c, n)
	now := r.clock()
	// matchLongestPrefix: every server holding block i counts one, until a
	// block no server holds.
	match := r.match
	r.index.match(r.spans, match)
	minQ, maxQ := int(^uint(0)>>1), -1
	for _, i := range r.live {
		rd := r.reading(i, now)
		minQ, maxQ = min(minQ, rd.waiting), max(maxQ, rd.waiting)
	}
	best, ties := -1, 0
	var bestScore float64
	for _, i := range r.live {
		rd := r.readings[i]
		queue := 1.0
		if maxQ != minQ {
			queue = float64(maxQ-rd.waiting) / float64(maxQ-minQ)
		}
		prefix := 0.0
		if n > 0 {
			prefix = float64(match[i]) / float64(n)
		}
		score := gieQueueWeight*queue + gieKVWeight*(1-rd.kv) + giePrefixWeight*prefix
		switch {
		case best < 0 || score > bestScore:
			best, bestScore, ties = i, score, 1
		case score == bestScore:
			ties++
			if r.rng.IntN(ties) == 0 {
				best = i
			}
		}
	}
	r.index.add(r.spans, best)
	return best, "", nil
}

// reading is instance i's metrics as the EPP last refreshed them.
func (r *gieRouter) reading(i int, now int64) gieReading {
	rd := &r.readings[i]
	if rd.at < 0 || now-rd.at >= int64(gieRefresh) {
		e := r.instances[i].reading(virtualTime(now))
		*rd = gieReading{at: now, waiting: e.Waiting, kv: e.KVUsage}
	}
	return *rd
}

// SGLang's router defaults, from sgl-project/sglang
// sgl-router/py_src/sglang_router/router_args.py (RouterArgs, what
// `python -m sglang_router.launch_router` ships; the Rust binary's
// command line has the same): cache_threshold 0.3, balance_abs_threshold
// 64, balance_rel_threshold 1.5, eviction_interval_secs 120, max_tree_size
// 2^26 (characters per worker). (CacheAwareConfig::default in
// sgl-router/src/policies/mod.rs, used only by code that builds the policy
// itself, says 0.5, 32, 1.1, 30 s and 10,000.) The algorithm is
// sgl-router/src/policies/cache_aware.rs and tree.rs.
const (
	sglangCacheThreshold = 0.3
	sglangBalanceAbs     = 64
	sglangBalanceRel     = 1.5
	sglangEvictEvery     = 120 * time.Second
	sglangMaxTreeChars   = 1 << 26
	// sglangBlockChars is the characters of one chain block (16 tokens at
	// 4 characters per token) for the tree's character counts.
	sglangBlockChars = 64
)

// sglangRouter is SGLangCacheAware.
//
// Load is the requests in flight the router sent to each worker (what
// its workers' load counts; here every request goes through the router,
// so the instance's requests in flight). The load is imbalanced when
// max − min > 64 and max > 1.5 × min: the request then goes to the
// least-loaded worker (the first in order). Otherwise the tree decides:
// the deepest node of the prompt's path held by any worker gives the match
// ratio (matched / prompt length) and the worker (the first tenant of
// that node: in SGLang a hash map's order, here one of them at random);
// above 0.3 the request goes there, else to the worker whose tree holds
// the fewest characters. Either way the prompt is then inserted in the
// chosen worker's tree.
//
// The tree is SGLang's radix tree over the prompt's text at the chain's
// granularity (one node per 64-character block; a ratio of blocks for a
// ratio of characters). The workload's structure lets it be kept
// compactly and exactly as such a tree: blocks before the end of the
// system prompt or shared document are shared by conversations, and are
// kept by hash with the workers holding them; a conversation's own blocks
// are only ever on its own path, so they are kept per conversation as the
// depth each worker's tree reaches on it. Every 120 s of virtual time a
// worker holding more than 2^26 characters loses its least recently used
// paths until it holds no more (SGLang evicts its least recently used
// leaves).
type sglangRouter struct {
	instances []*instance
	live      []int
	clock     func() int64
	rng       *rand.Rand
	shared    map[uint64][]tenantAt // block hash → workers whose tree holds it
	own       map[uint64][]tenantAt // conversation → workers' depth on its own blocks
	chars     []int                 // per worker: blocks its tree holds
	lastEvict int64
	// balanced, imbalanced count the decisions each way (tests).
	balanced, imbalanced int
}

// tenantAt is a worker holding a node (or, in own, the conversation's
// blocks up to depth), last touched at (virtual ns).
type tenantAt struct {
	inst  int32
	depth int32
	from  int32 // own: where the conversation's own blocks start
	at    int64
}

func newSGLangRouter(instances []*instance, clock func() int64, rng *rand.Rand) *sglangRouter {
	return &sglangRouter{instances: instances, clock: clock, rng: rng,
		shared: map[uint64][]tenantAt{}, own: map[uint64][]tenantAt{}, chars: make([]int, len(instances))}
}

func (r *sglangRouter) prepare(*conversation) {}

func (r *sglangRouter) answered(*call, int64, int) {}

// update takes the live instances; a worker that left keeps its tree, as
// the router keeps a worker's tree until the worker is removed from it.
func (r *sglangRouter) update(f *fleetState) { r.live = f.live }

func (r *sglangRouter) route(_ context.Context, k *call) (int, affinity.Kind, error) {
	c := k.conv
	now := r.clock()
	if now-r.lastEvict >= int64(sglangEvictEvery) {
		r.evict()
		r.lastEvict = now
	}
	hashes := c.chain()
	lo, hi, first := int(^uint(0)>>1), -1, -1
	for _, i := range r.live {
		load := r.instances[i].inFlight
		if load < lo {
			lo, first = load, i
		}
		hi = max(hi, load)
	}
	if hi-lo > sglangBalanceAbs && float32(hi) > float32(lo)*sglangBalanceRel {
		r.imbalanced++
		r.insert(c, hashes, first, now)
		return first, "", nil
	}
	r.balanced++
	matched, tenants := r.match(c, hashes)
	pick := -1
	if len(hashes) > 0 && float32(matched)/float32(len(hashes)) > sglangCacheThreshold && len(tenants) > 0 {
		pick = tenants[r.rng.IntN(len(tenants))]
	} else {
		// get_smallest_tenant: the fewest characters (ties: the map's order,
		// here at random).
		ties := 0
		for _, i := range r.live {
			switch {
			case pick < 0 || r.chars[i] < r.chars[pick]:
				pick, ties = i, 1
			case r.chars[i] == r.chars[pick]:
				ties++
				if r.rng.IntN(ties) == 0 {
					pick = i
				}
			}
		}
	}
	r.insert(c, hashes, pick, now)
	return pick, "", nil
}

// match returns how many leading blocks of hashes the tree holds (any
// worker) and the live workers holding the deepest of them.
func (r *sglangRouter) match(c *conversation, hashes []uint64) (int, []int) {
	var holders []tenantAt
	n := 0
	for n < len(hashes) && n < c.docEnd {
		t := r.shared[hashes[n]]
		if len(t) == 0 {
			break
		}
		holders, n = t, n+1
	}
	if n == c.docEnd && n < len(hashes) {
		deepest := 0
		for _, t := range r.own[c.shape.index] {
			deepest = max(deepest, int(t.depth))
		}
		if deepest > n {
			n = min(deepest, len(hashes))
			holders = holders[:0:0]
			for _, t := range r.own[c.shape.index] {
				if int(t.depth) >= n {
					holders = append(holders, t)
				}
			}
		}
	}
	var out []int
	for _, t := range holders {
		if r.instances[t.inst].up {
			out = append(out, int(t.inst))
		}
	}
	return n, out
}

// insert adds the prompt's path to worker i's tree, touched now.
func (r *sglangRouter) insert(c *conversation, hashes []uint64, i int, now int64) {
	// Worker i is usually at the same place in every shared block's
	// tenants (it reached them all at once): look there first.
	hint := 0
	for n, h := range hashes[:min(len(hashes), c.docEnd)] {
		ts := r.shared[h]
		if hint >= len(ts) || int(ts[hint].inst) != i {
			hint = slices.IndexFunc(ts, func(t tenantAt) bool { return int(t.inst) == i })
		}
		if hint >= 0 {
			ts[hint].at = now
			continue
		}
		r.chars[i]++
		hint = len(ts)
		r.shared[h] = append(ts, tenantAt{inst: int32(i), depth: int32(n + 1), at: now})
	}
	if len(hashes) <= c.docEnd {
		return
	}
	ts := r.own[c.shape.index]
	for j := range ts {
		if int(ts[j].inst) == i {
			if d := int32(len(hashes)); d > ts[j].depth {
				r.chars[i] += int(d - ts[j].depth)
				ts[j].depth = d
			}
			ts[j].at = now
			return
		}
	}
	r.chars[i] += len(hashes) - c.docEnd
	r.own[c.shape.index] = append(ts, tenantAt{inst: int32(i), depth: int32(len(hashes)), from: int32(c.docEnd), at: now})
}

// evict trims every worker whose tree holds more than the maximum, its
// least recently touched paths first: a conversation's own blocks, then
// shared blocks deepest first among equals.
func (r *sglangRouter) evict() {
	for i := range r.instances {
		if r.chars[i]*sglangBlockChars <= sglangMaxTreeChars {
			continue
		}
		type entry struct {
			own   bool
			key   uint64
			depth int32
			at    int64
		}
		var es []entry
		for conv, ts := range r.own {
			for _, t := range ts {
				if int(t.inst) == i {
					es = append(es, entry{own: true, key: conv, depth: t.depth, at: t.at})
				}
			}
		}
		for h, ts := range r.shared {
			for _, t := range ts {
				if int(t.inst) == i {
					es = append(es, entry{key: h, depth: t.depth, at: t.at})
				}
			}
		}
		slices.SortFunc(es, func(a, b entry) int {
			switch {
			case a.at != b.at:
				return cmp.Compare(a.at, b.at)
			case a.own != b.own:
				if a.own {
					return -1
				}
				return 1
			case a.depth != b.depth:
				return cmp.Compare(b.depth, a.depth)
			}
			return cmp.Compare(a.key, b.key)
		})
		for _, e := range es {
			if r.chars[i]*sglangBlockChars <= sglangMaxTreeChars {
				break
			}
			if e.own {
				ts := r.own[e.key]
				for j, t := range ts {
					if int(t.inst) == i {
						r.chars[i] -= int(t.depth - t.from)
						ts = slices.Delete(ts, j, j+1)
						break
					}
				}
				if len(ts) == 0 {
					delete(r.own, e.key)
				} else {
					r.own[e.key] = ts
				}
				continue
			}
			ts := r.shared[e.key]
			ts = slices.DeleteFunc(ts, func(t tenantAt) bool { return int(t.inst) == i })
			r.chars[i]--
			if len(ts) == 0 {
				delete(r.shared, e.key)
			} else {
				r.shared[e.key] = ts
			}
		}
	}
}
