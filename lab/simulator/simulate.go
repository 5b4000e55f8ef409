// Package simulator evaluates routing policies on an emulated GPU fleet in
// virtual time: a discrete-event simulation of the workload loadgen replays
// (lab/workload), routed by tether's own decision code (the decider tether
// serve builds, plan.NewDecider over store/memory, from a tether
// configuration: Options.Config, or the one the options stand for) or by
// emulations of Envoy's ring hash and round robin, and priced by the
// emulated instances' cost model (emulator.GPU: the prefix KV cache, the
// prefill queue, the decode batch). There is no network, no sleeping and no
// wall clock: an hour of traffic at 10,000 requests per second runs in
// minutes. The figures are loadgen's (loadgen.Summary), so they compare
// with `tether-lab bench` and `tether-lab loadgen` runs. See README.md.
package simulator

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/lab/emulator"
	"github.com/tetherproxy/tether/lab/loadgen"
	"github.com/tetherproxy/tether/lab/workload"
	"github.com/tetherproxy/tether/plan"
)

// Result is the outcome of a Run. It marshals to JSON.
type Result struct {
	Settings Settings `json:"settings"`
	// Summary holds loadgen's figures with loadgen's definitions (see
	// loadgen.Summary), computed over the simulated requests. Latency is
	// the modelled time from arrival at the instance to the end of the
	// answer (no network, no proxy); TTFB the time to the first token when
	// Stream is set (the prefill's end), else the latency, as loadgen
	// measures each.
	Summary loadgen.Summary `json:"summary"`
	// OKPerSecond is the OK requests divided by the duration.
	OKPerSecond float64 `json:"ok_per_second"`

	// PrefillGPUSeconds and DecodeGPUSeconds add up the instances'
	// emulated GPU time (emulator.ModelStats, unscaled seconds); every priced
	// request counts, cancelled ones included, as on the emulator.
	PrefillGPUSeconds float64 `json:"prefill_gpu_seconds"`
	DecodeGPUSeconds  float64 `json:"decode_gpu_seconds"`
	// PricedCompletionTokens are the output tokens of the priced requests.
	PricedCompletionTokens int64 `json:"priced_completion_tokens"`
	// GPUSecondsPer1kOutput is (prefill + decode GPU seconds) per 1,000
	// priced output tokens: the bench's cost figure.
	GPUSecondsPer1kOutput float64 `json:"gpu_seconds_per_1k_output"`
	// GPUImbalance is max / mean emulated GPU-seconds per instance, the
	// bench's imbalance: work, not request counts (Summary.LoadImbalance
	// counts requests, as loadgen).
	GPUImbalance float64 `json:"gpu_imbalance"`
	// GPUBusy is the emulated GPU time spent over the time the fleet had
	// (scaled GPU-seconds / instances / duration), as the bench's.
	GPUBusy float64 `json:"gpu_busy"`
	// PrefillLoad is the share of the run's duration the instances spent
	// prefilling, on average (scaled GPU time / instances / duration). The
	// cost model prefills one request at a time per instance: near or
	// above 1 the prefill queues grow without bound and the fleet is
	// overloaded at this rate.
	PrefillLoad float64 `json:"prefill_load"`
	// InfiniteCacheBound is the share of the OK requests' prompt tokens
	// that repeat a prefix an earlier request had sent, on any instance:
	// the hit rate of one shared cache that never evicts (see boundTally).
	// No policy's KVHitRate on the same requests exceeds it.
	InfiniteCacheBound float64 `json:"infinite_cache_bound"`

	// Regime holds the figures of the run's Scenario: moves, failures,
	// model switches, fan-out, load against capacity.
	Regime RegimeFigures `json:"regime"`
	// Series has the figures of every minute from the warmup's end
	// (Options.Series).
	Series []Minute `json:"series,omitempty"`

	Instances []InstanceResult `json:"instances"`

	// Events is the number of events the simulation processed (arrivals,
	// sends, completions); Simulated the virtual time of the last one;
	// Wall the real time the run took.
	Events    int64         `json:"events"`
	Simulated time.Duration `json:"simulated_ns"`
	Wall      time.Duration `json:"wall_ns"`
	// Interrupted is set when the context ended the run early; the figures
	// then cover the part that ran.
	Interrupted bool `json:"interrupted"`
}

// InstanceResult describes one instance at the end of a run.
type InstanceResult struct {
	Name string `json:"name"`
	Zone string `json:"zone"`
	// Served counts the OK requests it answered (loadgen's requests per
	// instance); Priced every request its model priced.
	Served int                 `json:"served"`
	Priced int                 `json:"priced"`
	Model  emulator.ModelStats `json:"model"`
}

// Settings records the options of a run, defaults filled in.
type Settings struct {
	Policy                      Policy               `json:"policy"`
	Label                       string               `json:"label"`
	Instances                   int                  `json:"instances"`
	Zones                       int                  `json:"zones"`
	Profile                     string               `json:"profile"`
	TimeScale                   float64              `json:"time_scale"`
	Cache                       emulator.CacheConfig `json:"cache"`
	Rate                        float64              `json:"rate"`
	ConversationRate            float64              `json:"conversation_rate"`
	MeanRequestsPerConversation float64              `json:"mean_requests_per_conversation"`
	Duration                    time.Duration        `json:"duration_ns"`
	Drain                       time.Duration        `json:"drain_ns"`
	ThinkScale                  float64              `json:"think_scale"`
	MaxInFlight                 int                  `json:"max_in_flight"`
	Seed                        uint64               `json:"seed"`
	WorkloadSeed                uint64               `json:"workload_seed"`
	Mix                         workload.Mix         `json:"mix"`
	Identities                  workload.IdentityMix `json:"identities"`
	Apps                        []workload.App       `json:"apps"`
	IdleTimeout                 time.Duration        `json:"idle_timeout_ns"`
	MaxStickyDuration           time.Duration        `json:"max_sticky_duration_ns"`
	RingSize                    int                  `json:"ring_size"`
	Stream                      bool                 `json:"stream"`
	Exact                       bool                 `json:"exact"`
	Scenario                    Scenario             `json:"scenario,omitzero"`
}

// Error messages of the requests that do not end OK, as loadgen words them.
const errCancelled = "cancelled: drain deadline passed"

// Run simulates opts and returns the figures. When ctx ends first, it
// returns what it measured so far with ctx's error.
//
// The model, event by event:
//   - new conversations arrive as loadgen's Poisson process (same seed,
//     same times) until Duration; each sends its first turn on arrival;
//   - a turn is refused (dropped, its conversation ends) when MaxInFlight
//     requests are in flight; otherwise the policy routes it, and the
//     chosen instance prices it at the current virtual time with its
//     current number of requests in flight (emulator.GPU.Cost's Arrived and
//     InFlight); it ends at arrival + Wait + Decode, or is cancelled (its
//     conversation ends) when that is after Duration + Drain;
//   - when a turn ends, the next one is sent after its think time (scaled)
//     unless that is at or after Duration.
//
// Events at the same virtual time run in the order they were scheduled;
// requests ending at a time run before conversations arriving then.
func Run(ctx context.Context, opts Options) (*Result, error) {
	r, err := newRunner(opts)
	if err != nil {
		return nil, err
	}
	return r.run(ctx)
}

// conversation is a conversation in progress.
type conversation struct {
	shape   shape
	headers []workload.Header
	// session is the x-session-id value (the KV cache's conversation key).
	session    string
	sessionKey uint64
	// salt identifies the conversation's own KV blocks (blockModel).
	salt uint64
	// The prompt's block chain (chain.go): the system prompt's full
	// blocks, the end of the shared document's (sysBlocks without one),
	// and the hashes so far.
	sysBlocks, docEnd int
	hashes            []uint64
	// request and ringHash/hashed are the routers' view of the headers.
	request  affinity.Request
	ringHash uint64
	hashed   bool
	// identified: a header Envoy's hash policies use is present (the
	// conversation has an identity that can keep it on one instance).
	identified bool
	burst      bool // sent by the burst's tenant (Scenario.Burst)

	turn    int // the turn being sent or served
	history int // prompt tokens before the user message of turn
	// calls are the requests of the turn in flight (Scenario.FanOut of
	// them); pending counts those not ended; ended says one failed, so
	// the conversation ends with the turn.
	calls   []call
	pending int
	ended   bool
	// The instance that served the previous turn (-1 before), its epoch
	// and its model version then.
	last        int
	lastEpoch   int
	lastVersion string
	// Counted once each (RegimeFigures), for conversations with an
	// identity: one without is routed request by request.
	moved, displaced, switched bool

	// Exact path only: the conversation's text, the answers so far and
	// the answer of the turn in flight.
	text    *workload.Conversation
	answers []string
	answer  string
}

// call is one request of a conversation's turn.
type call struct {
	conv *conversation
	sub  int // which of the turn's fan-out
	inst int // the instance serving it
	// decision and reply are tether's (decided numbers the decision for
	// tetherRouter.trace); failOpen says Envoy's fail-open route sent it.
	decision affinity.Decision
	decided  int
	reply    fleet.Outcome
	failOpen bool
	kind     affinity.Kind
	// deaths is its instance's failures when it was sent: a change when it
	// ends means it failed with the instance.
	deaths  int
	epoch   int
	version string // the instance's model version when it was sent
	// What it is counted as when it ends OK.
	sent            int64
	prompt, cached  int
	latency, ttfb   time.Duration
	bound           int
	queued, follows bool
	same, together  bool
}

// instance is one emulated GPU instance.
type instance struct {
	fleet.Instance
	model    model
	inFlight int
	served   int
	priced   int
	// completion adds up the output tokens of the requests it priced.
	completion int64
	// member: it is in the deployment (the autoscaler's count); up: it
	// takes requests (a member that failed is not up until it returns).
	// epoch changes whenever it starts, stops or restarts (its cache is
	// then another); deaths counts its failures.
	member, up bool
	epoch      int
	deaths     int
	// flights are the requests it holds, for its engine's readings (kept
	// only for instances with an engine); queried and hits add up the
	// prompt tokens it looked up in its prefix cache and found there
	// (vLLM's prefix_cache_queries and prefix_cache_hits), and last is
	// its previous reading, for the rates tether's tracker takes.
	flights       []flight
	queried, hits float64
	last          fleet.EngineReading
	hasLast       bool
	// capacity is its KV cache's capacity in tokens, as its engine
	// publishes it (vllm:cache_config_info).
	capacity int
	// base is its model's figures when the warmup ended.
	base emulator.ModelStats
}

// flight is a request an instance holds: its prefill starts at start, its
// answer ends at end.
type flight struct {
	start, end       int64
	prompt, complete int
}

// reading is what the instance's engine (vLLM's /metrics) would publish
// at now: the requests waiting for their prefill and those running, and
// the share of its KV cache the running requests hold (their prompt and
// the tokens generated so far; blocks two requests share count twice, so
// it reads a little high).
func (in *instance) reading(now time.Time) fleet.EngineReading {
	t := now.Sub(virtualTime(0)).Nanoseconds()
	r := fleet.EngineReading{At: now, KVKnown: true}
	live := in.flights[:0]
	held := 0.0
	for _, f := range in.flights {
		switch {
		case f.end <= t:
			continue
		case f.start > t:
			r.Waiting++
		default:
			r.Running++
			held += float64(f.prompt) + float64(f.complete)*float64(t-f.start)/float64(max(f.end-f.start, 1))
		}
		live = append(live, f)
	}
	in.flights = live
	if in.capacity > 0 {
		r.KVUsage = min(held/float64(in.capacity), 1)
		r.CacheTokens = in.capacity // vllm:cache_config_info
	}
	r.PrefixQueries, r.PrefixHits, r.PrefixKnown = in.queried, in.hits, true
	if p := &in.last; in.hasLast && now.After(p.At) && r.PrefixQueries >= p.PrefixQueries {
		dt := now.Sub(p.At).Seconds()
		r.QueryRate, r.HitRate, r.RatesKnown = (r.PrefixQueries-p.PrefixQueries)/dt, (r.PrefixHits-p.PrefixHits)/dt, true
	}
	in.last, in.hasLast = r, true
	return r
}

type runner struct {
	opts      Options
	plan      plan.Plan // the instances and tether's policy
	gen       *workload.Generator
	shapes    *shapes
	apps      []workload.App
	router    router
	instances []*instance
	fleet     fleetState
	queue     eventQueue
	seq       uint64

	now      int64 // virtual ns
	end      int64 // Duration
	deadline int64 // Duration + Drain
	inFlight int

	arrivals    *rand.Rand
	convRate    float64
	nextArrival int64 // math.MaxInt64 once past Duration
	nextIndex   uint64
	salt        uint64
	// The burst's arrivals (Scenario.Burst).
	bursts      *rand.Rand
	nextBurst   int64
	burstIndex  uint64
	changes     []change // the scenario's changes still to come, in time order
	failures    int      // instances failed so far
	measuring   bool     // past the warmup
	measureFrom int64

	all           tally
	ttfb          latencies
	kinds         map[workload.Kind]*tally
	burstTTFB     latencies
	othersTTFB    latencies
	conversations int
	completed     int
	dropped       int
	cancelled     int
	turnsNotSent  int
	decisions     map[string]int
	errors        map[string]int
	requests      int64
	events        int64
	bound         boundTally
	regime        RegimeFigures
	liveConvs     int
	convArea      float64 // live conversations × ns, while measuring
	instArea      float64 // live instances × ns, while measuring
	series        []minuteTally

	// chains are the block chains of conversations that ended, for new
	// ones (conversation.hashes).
	chains [][]uint64

	// observe, when set (tests), sees the virtual time of every event.
	observe func(at int64)
}

func newRunner(opts Options) (*runner, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	opts = opts.withDefaults()
	gen, err := workload.New(opts.Workload)
	if err != nil {
		return nil, fmt.Errorf("simulate: %w", err)
	}
	r := &runner{
		opts:      opts,
		gen:       gen,
		shapes:    newShapes(opts.Workload),
		apps:      gen.Config().Apps,
		end:       int64(opts.Duration),
		deadline:  int64(opts.Duration + opts.Drain),
		arrivals:  rand.New(rand.NewPCG(opts.Workload.Seed, 0x6172726976616c73)), // loadgen's: "arrivals"
		bursts:    rand.New(rand.NewPCG(opts.Workload.Seed, 0x627572737473)),     // "bursts"
		convRate:  opts.Rate / gen.MeanRequestsPerConversation() / float64(opts.Scenario.fanOut()),
		salt:      wlSplitmix(opts.Workload.Seed ^ 0x626c6f636b73), // "blocks"
		kinds:     map[workload.Kind]*tally{},
		errors:    map[string]int{},
		measuring: opts.Scenario.Warmup == 0,
	}
	for _, k := range workload.Kinds() {
		r.kinds[k] = &tally{}
	}
	if r.plan, err = opts.plan(); err != nil {
		return nil, err
	}
	if err := r.buildFleet(); err != nil {
		return nil, err
	}
	if err := r.buildRouter(); err != nil {
		return nil, err
	}
	r.changes = opts.Scenario.schedule(opts.Duration, opts.Instances, func(i int) string { return r.instances[i].Version })
	r.router.update(&r.fleet)
	return r, nil
}

// buildFleet makes the plan's instances and their cost models; the first
// Options.Instances are up (the others join when the fleet scales out).
func (r *runner) buildFleet() error {
	o := r.opts
	// The full blocks of each system prompt: as many as BlockHasher cuts
	// from it (its token count / 16).
	system := make([]int, len(r.apps))
	for i, a := range r.apps {
		prompt, _ := r.gen.SystemPrompt(a.Name)
		system[i] = emulator.CountTokens(prompt) / emulator.BlockSize
	}
	for i, fi := range r.plan.Instances {
		in := &instance{Instance: fi, member: i < o.Instances, up: i < o.Instances}
		if o.Exact {
			gpu, err := emulator.NewGPU(emulator.GPUConfig{Profile: o.Profile, TimeScale: o.TimeScale, Cache: o.Cache})
			if err != nil {
				return fmt.Errorf("simulate: %w", err)
			}
			in.model = &textModel{name: in.Name, gpu: gpu, cfg: emulator.GPUConfig{Profile: o.Profile, TimeScale: o.TimeScale, Cache: o.Cache}}
		} else {
			m := &blockModel{profile: o.Profile, timeScale: o.TimeScale, cacheConfig: o.Cache, system: system}
			if o.Workload.Mix.Docs > 0 {
				kv, err := emulator.NewKVCache(o.Cache)
				if err != nil {
					return fmt.Errorf("simulate: %w", err)
				}
				m.docs = &chainCache{kv: kv}
			} else {
				m.cache = newRunCache(o.Cache, system)
			}
			in.model = m
		}
		in.capacity = in.model.stats().Cache.CapacityTokens
		r.instances = append(r.instances, in)
	}
	r.fleet = fleetState{instances: r.instances, died: -1}
	r.refleet()
	r.bound = newBoundTally(system)
	return nil
}

// refleet recomputes the live instances and the deployment's members.
func (r *runner) refleet() {
	f := &r.fleet
	f.live, f.members = f.live[:0:0], f.members[:0:0]
	for i, in := range r.instances {
		if in.up {
			f.live = append(f.live, i)
		}
		if in.member {
			f.members = append(f.members, i)
		}
	}
}

func (r *runner) buildRouter() error {
	o := r.opts
	rng := rand.New(rand.NewPCG(o.Seed, 0x726f75746572)) // "router"
	switch o.Policy {
	case Sticky, Random, Adaptive, CacheAware, Tether:
		r.decisions = map[string]int{}
		t, err := newTetherRouter(r.plan, func() int64 { return r.now }, rng)
		if err != nil {
			return err
		}
		r.router = t
	case RingHash:
		r.router = &ringRouter{size: o.RingSize, rng: rng}
	case RoundRobin:
		r.router = &roundRobinRouter{next: rng.IntN(o.Instances)}
	case LeastRequest:
		r.router = &leastRequestRouter{instances: r.instances, rng: rng}
	case Oracle:
		r.router = newOracleRouter(r.instances, r.bound.system, func() int64 { return r.now }, rng)
	case GIEPrefix:
		r.router = newGIERouter(r.instances, o.Cache.CapacityTokens, func() int64 { return r.now }, rng)
	case SGLangCacheAware:
		r.router = newSGLangRouter(r.instances, func() int64 { return r.now }, rng)
	default:
		return fmt.Errorf("simulate: unknown policy %q", o.Policy)
	}
	return nil
}

// drawArrival returns the arrival after one at prev: loadgen's schedule,
// at the rate the scenario's load factor gives (a Poisson process whose
// rate changes at the factor's steps: the exponential draw is spent
// across them).
func (r *runner) drawArrival(prev int64) int64 {
	e := r.arrivals.ExpFloat64()
	for t := prev; ; {
		f, next := r.opts.Scenario.loadFactor(t)
		rate := r.convRate * f
		at := t + int64(time.Duration(e/rate*float64(time.Second)))
		if at < next {
			if at >= r.end {
				return math.MaxInt64
			}
			return at
		}
		e -= float64(next-t) / float64(time.Second) * rate
		t = next
	}
}

// drawBurst returns the burst's arrival after one at prev (math.MaxInt64:
// none).
func (r *runner) drawBurst(prev int64) int64 {
	b := r.opts.Scenario.Burst
	if b == (Burst{}) {
		return math.MaxInt64
	}
	prev = max(prev, int64(b.At))
	rate := r.opts.Rate * b.Share / r.gen.MeanRequestsPerConversation() / float64(r.opts.Scenario.fanOut())
	at := prev + int64(time.Duration(r.bursts.ExpFloat64()/rate*float64(time.Second)))
	if at >= int64(b.At+b.For) || at >= r.end {
		return math.MaxInt64
	}
	return at
}

func (r *runner) run(ctx context.Context) (*Result, error) {
	started := time.Now()
	// The loop checks ctx between events; an event, once started, runs to
	// its end (the decision code would otherwise fail it half done).
	step := context.WithoutCancel(ctx)
	r.nextArrival = r.drawArrival(0)
	r.nextBurst = r.drawBurst(0)
	var err error
	for {
		if r.events%4096 == 0 {
			if err = ctx.Err(); err != nil {
				break
			}
			if r.opts.Progress != nil && r.events%ProgressEvery == 0 {
				r.opts.Progress(r.progress())
			}
		}
		var stepErr error
		arrival := min(r.nextArrival, r.nextBurst)
		switch {
		case len(r.changes) > 0 && r.changes[0].at <= arrival && (len(r.queue) == 0 || r.changes[0].at <= r.queue[0].at):
			ch := r.changes[0]
			r.changes = r.changes[1:]
			r.advance(ch.at)
			r.apply(ch)
		case len(r.queue) > 0 && r.queue[0].at <= arrival:
			ev := r.queue.pop()
			r.advance(ev.at)
			if ev.kind == eventDone {
				r.done(ev.call)
			} else {
				stepErr = r.send(step, ev.call.conv)
			}
		case r.nextArrival != math.MaxInt64 && r.nextArrival <= r.nextBurst:
			r.advance(r.nextArrival)
			stepErr = r.arrive(step, false)
			r.nextArrival = r.drawArrival(r.nextArrival)
		case r.nextBurst != math.MaxInt64:
			r.advance(r.nextBurst)
			stepErr = r.arrive(step, true)
			r.nextBurst = r.drawBurst(r.nextBurst)
		default:
			return r.result(started, nil), nil
		}
		r.events++
		if stepErr != nil {
			return nil, stepErr
		}
	}
	return r.result(started, err), fmt.Errorf("simulate: interrupted: %w", err)
}

func (r *runner) progress() Progress {
	return Progress{Simulated: time.Duration(r.now), Events: r.events, Requests: r.requests}
}

func (r *runner) advance(at int64) {
	if r.observe != nil {
		r.observe(at)
	}
	if from, to := min(r.now, r.end), min(at, r.end); r.measuring && to > from {
		dt := float64(to - from)
		r.convArea += float64(r.liveConvs) * dt
		r.instArea += float64(len(r.fleet.live)) * dt
	}
	r.now = at
}

func (r *runner) schedule(at int64, kind eventKind, k *call) {
	r.seq++
	r.queue.push(event{at: at, seq: r.seq, kind: kind, call: k})
}

// apply makes one change of the scenario.
func (r *runner) apply(ch change) {
	r.fleet.died = -1
	switch ch.kind {
	case changeWarm:
		r.startMeasuring()
		return
	case changeOutage, changeRestore:
		r.fleet.tetherDown = ch.kind == changeOutage
	case changeUp:
		in := r.instances[ch.inst]
		in.member, in.up = true, true
		in.epoch++
		in.model.reset()
	case changeReturn:
		in := r.instances[ch.inst]
		if !in.member || in.up {
			return // scaled in while it was down, or already back
		}
		in.up = true
		in.epoch++
		in.model.reset()
	case changeDown:
		in := r.instances[ch.inst]
		in.member, in.up = false, false
		in.epoch++
	case changeUpgrade:
		in := r.instances[ch.inst]
		in.Version = ch.to
		in.epoch++
		in.model.reset()
	case changeDie, changeKill:
		if len(r.fleet.live) < 2 {
			return // the last instance standing does not fail
		}
		i, until := ch.inst, ch.until
		if ch.kind == changeDie { // Failures: the next in a fixed order among those up
			i = r.fleet.live[(r.failures*7)%len(r.fleet.live)]
			r.failures++
			until = ch.at + int64(r.opts.Scenario.Failures.Down)
			back := change{at: until, kind: changeReturn, inst: i}
			at, _ := slices.BinarySearchFunc(r.changes, until+1, func(c change, t int64) int { return cmp.Compare(c.at, t) })
			r.changes = slices.Insert(r.changes, at, back)
		}
		in := r.instances[i]
		in.up = false
		in.epoch++
		in.deaths++
		// What it held fails (each when it would have ended, see done).
		r.inFlight -= in.inFlight
		in.inFlight = 0
		in.flights = in.flights[:0]
		r.fleet.died, r.fleet.until = i, until
	}
	r.refleet()
	r.router.update(&r.fleet)
}

// startMeasuring ends the warmup: every figure starts from zero, the
// caches and bindings stay as they are.
func (r *runner) startMeasuring() {
	r.measuring, r.measureFrom = true, r.now
	r.all, r.ttfb, r.burstTTFB, r.othersTTFB = tally{}, latencies{}, latencies{}, latencies{}
	for _, k := range workload.Kinds() {
		r.kinds[k] = &tally{}
	}
	r.conversations, r.completed, r.dropped, r.cancelled, r.turnsNotSent = 0, 0, 0, 0, 0
	r.requests, r.regime, r.series = 0, RegimeFigures{}, nil
	r.bound.tokens = 0
	if r.decisions != nil {
		r.decisions = map[string]int{}
	}
	r.errors = map[string]int{}
	for _, in := range r.instances {
		in.served, in.priced, in.completion = 0, 0, 0
		in.base = in.model.stats()
	}
}

// arrive starts the next conversation of the workload, or of the burst's
// tenant.
func (r *runner) arrive(ctx context.Context, burst bool) error {
	n := r.nextIndex
	if burst {
		n = burstIndexBase + r.burstIndex
		r.burstIndex++
	} else {
		r.nextIndex++
	}
	c := &conversation{last: -1, burst: burst}
	if n := len(r.chains); n > 0 {
		c.hashes, r.chains = r.chains[n-1], r.chains[:n-1]
	}
	if r.opts.Exact {
		conv := r.gen.At(n)
		c.text = &conv
		c.shape = shapeOf(conv, r.apps)
	} else {
		c.shape = r.shapes.at(n)
	}
	if burst {
		c.shape.identity = workload.Identity{Headers: []workload.Header{{Name: workload.AuthHeader, Value: BurstKey}}}
	}
	c.headers = c.shape.identity.Headers
	for _, h := range c.headers {
		if h.Name == emulator.SessionHeader {
			c.session = h.Value
			c.sessionKey = sessionKey(h.Value)
		}
	}
	_, c.identified = envoyHash(c.headers)
	c.salt = wlSplitmix(r.salt + n)
	c.history = r.apps[c.shape.app].SystemTokens
	c.sysBlocks, c.docEnd = r.bound.system[c.shape.app], r.bound.system[c.shape.app]
	if d := c.shape.doc; d >= 0 {
		c.docEnd = (c.history + r.shapes.docTokens[d]) / emulator.BlockSize
	}
	c.calls = make([]call, r.opts.Scenario.fanOut())
	for j := range c.calls {
		c.calls[j] = call{conv: c, sub: j}
	}
	r.router.prepare(c)
	r.conversations++
	r.liveConvs++
	return r.send(ctx, c)
}

// burstIndexBase numbers the burst's conversations apart from the
// workload's (their own blocks are keyed by it).
const burstIndexBase = 1 << 40

// shapeOf is the shape of a generated conversation (exact path).
func shapeOf(c workload.Conversation, apps []workload.App) shape {
	s := shape{index: c.Index, kind: c.Kind, identity: c.Identity, doc: c.Document}
	for i, a := range apps {
		if a.Name == c.App {
			s.app = i
		}
	}
	for _, t := range c.Turns {
		s.turns = append(s.turns, turnShape{userTokens: t.UserTokens, maxTokens: t.MaxTokens, think: t.Think})
	}
	return s
}

// send sends c's current turn: its requests, at once.
func (r *runner) send(ctx context.Context, c *conversation) error {
	c.pending = len(c.calls)
	for j := range c.calls {
		ok, err := r.sendCall(ctx, &c.calls[j])
		if err != nil {
			return err
		}
		if !ok {
			c.ended = true
			c.pending--
		}
	}
	if c.pending == 0 {
		r.endConversation(c, false)
	}
	return nil
}

// sendCall sends request k of its conversation's turn; false: it ended at
// once (dropped, refused or cancelled).
func (r *runner) sendCall(ctx context.Context, k *call) (bool, error) {
	c := k.conv
	kt := r.kinds[c.shape.kind]
	r.requests++
	r.all.requests++
	kt.requests++
	if r.opts.MaxInFlight > 0 && r.inFlight >= r.opts.MaxInFlight {
		r.dropped++
		r.errors[fmt.Sprintf("%d requests in flight", r.opts.MaxInFlight)]++
		r.lost(r.now)
		return false, nil
	}
	i, kind, err := r.router.route(ctx, k)
	if errors.Is(err, errRefused) {
		r.regime.Refused++
		r.errors[err.Error()]++
		r.lost(r.now)
		return false, nil
	}
	if err != nil {
		return false, err
	}
	in := r.instances[i]
	t := c.shape.turns[c.turn]
	r.bound.price(c, k.sub > 0)
	cost := in.model.cost(c, r.now, in.inFlight)
	// The response headers: at the first token when streamed, else with
	// the whole answer, each with the depth the emulator reports (the
	// requests it was already working on).
	headers := r.now + int64(cost.Wait)
	if !r.opts.Stream {
		headers += int64(cost.Decode)
	}
	r.router.answered(k, headers, in.inFlight)
	in.priced++
	in.completion += int64(t.maxTokens)
	// The request holds its place on the instance until it ends;
	// a cancelled one until the drain deadline, after every send.
	in.inFlight++
	r.inFlight++
	finish := r.now + int64(cost.Wait+cost.Decode)
	prompt := c.history + t.userTokens
	if in.Engine != "" {
		in.flights = append(in.flights, flight{start: r.now + int64(cost.Queued), end: finish, prompt: prompt, complete: t.maxTokens})
		in.queried += float64(prompt)
		in.hits += float64(min(max(cost.CachedTokens, 0), prompt))
	}
	if finish > r.deadline {
		r.cancelled++
		r.errors[errCancelled]++
		r.lost(r.now)
		return false, nil
	}
	// What it counts as when it ends (route set its decision, answered
	// its reply).
	k.inst, k.kind = i, kind
	k.deaths, k.epoch, k.version, k.sent = in.deaths, in.epoch, in.Version, r.now
	k.prompt, k.cached = prompt, min(max(cost.CachedTokens, 0), prompt)
	k.latency, k.ttfb, k.bound = cost.Wait+cost.Decode, cost.Wait, r.bound.current
	k.queued, k.follows, k.same = cost.Queued > 0, c.turn > 0, c.last == i
	k.together = k.sub > 0 && c.calls[0].inst == i
	if !r.opts.Stream {
		k.ttfb = k.latency
	}
	r.followed(c, k, in)
	r.schedule(finish, eventDone, k)
	return true, nil
}

// followed counts what request k of c's turn, on in, does to the
// conversation: moved off an instance still up, displaced from one gone
// or restarted, or switched to another model version.
func (r *runner) followed(c *conversation, k *call, in *instance) {
	if c.last < 0 || !r.measuring {
		return
	}
	if k.sub == 0 && k.inst != c.last && c.identified {
		prev := r.instances[c.last]
		switch {
		case prev.up && prev.epoch == c.lastEpoch && !c.moved:
			c.moved = true
			r.regime.Moved++
		case (!prev.up || prev.epoch != c.lastEpoch) && !c.displaced:
			c.displaced = true
			r.regime.Displaced++
		}
	}
	if c.identified && in.Version != c.lastVersion && !c.switched {
		c.switched = true
		r.regime.ModelSwitches++
	}
}

// done ends request k: OK, or failed with its instance.
func (r *runner) done(k *call) {
	c := k.conv
	in := r.instances[k.inst]
	if in.deaths != k.deaths {
		// Its instance failed meanwhile (and let go of what it held).
		if r.counts(k) {
			r.regime.Failed++
			r.errors["instance failed"]++
			r.lost(k.sent)
		}
		c.ended = true
	} else {
		in.inFlight--
		r.inFlight--
		r.count(k, in)
	}
	if c.pending--; c.pending > 0 {
		return
	}
	if c.ended {
		r.endConversation(c, false)
		return
	}
	t := c.shape.turns[c.turn]
	if c.text != nil {
		c.answers = append(c.answers, c.answer)
	}
	lead := &c.calls[0]
	c.history += t.userTokens + t.maxTokens
	c.last, c.lastEpoch, c.lastVersion = lead.inst, lead.epoch, lead.version
	c.turn++
	if c.turn == len(c.shape.turns) {
		r.endConversation(c, true)
		return
	}
	at := r.now + int64(time.Duration(float64(c.shape.turns[c.turn].think)*r.opts.ThinkScale))
	if at >= r.end {
		r.turnsNotSent += len(c.shape.turns) - c.turn
		r.liveConvs--
		r.letGo(c)
		return
	}
	r.schedule(at, eventSend, lead)
}

// endConversation ends c: completed, or after its current turn (a
// request of it did not end OK).
func (r *runner) endConversation(c *conversation, completed bool) {
	r.liveConvs--
	r.letGo(c)
	if completed {
		r.completed++
		return
	}
	r.turnsNotSent += len(c.shape.turns) - (c.turn + 1)
}

// letGo keeps the chain of c, which has ended, for a conversation to come.
func (r *runner) letGo(c *conversation) {
	if cap(c.hashes) > 0 && len(r.chains) < maxSpareChains {
		r.chains = append(r.chains, c.hashes[:0])
	}
	c.hashes = nil
}

// maxSpareChains bounds the chains kept for conversations to come.
const maxSpareChains = 1024

// counts reports whether request k counts in the figures: it was sent
// after the warmup.
func (r *runner) counts(k *call) bool { return r.measuring && k.sent >= r.measureFrom }

// count adds request k, ended OK on in, to the figures.
func (r *runner) count(k *call, in *instance) {
	if !r.counts(k) {
		return
	}
	c := k.conv
	kt := r.kinds[c.shape.kind]
	r.ttfb.add(k.ttfb)
	if r.opts.Scenario.Burst != (Burst{}) {
		if c.burst {
			r.burstTTFB.add(k.ttfb)
		} else {
			r.othersTTFB.add(k.ttfb)
		}
	}
	for _, ta := range []*tally{&r.all, kt} {
		ta.ok++
		ta.prompt += int64(k.prompt)
		ta.cached += int64(k.cached)
		ta.completion += int64(c.shape.turns[c.turn].maxTokens)
		ta.latency.add(k.latency)
		if k.follows {
			ta.followUps++
			if k.same {
				ta.sameInstance++
			}
		}
	}
	in.served++
	r.bound.tokens += int64(k.bound)
	if r.decisions != nil && k.kind != "" {
		r.decisions[string(k.kind)]++
	}
	if k.failOpen {
		r.regime.FailOpen++
	}
	if k.queued {
		r.regime.Queued++
	}
	if k.sub > 0 {
		r.regime.FanOut++
		if k.together {
			r.regime.FanOutTogether++
		}
	}
	if m := r.minute(k.sent); m != nil {
		m.add(k, len(r.fleet.live))
	}
}

// result assembles the figures.
func (r *runner) result(started time.Time, err error) *Result {
	o := r.opts
	if r.measuring && r.now < r.end { // the fleet's time up to the end
		dt := float64(r.end - r.now)
		r.convArea += float64(r.liveConvs) * dt
		r.instArea += float64(len(r.fleet.live)) * dt
	}
	s := r.summary()
	measured := time.Duration(r.end - r.measureFrom)
	res := &Result{
		Settings:    r.settings(),
		Summary:     s,
		OKPerSecond: float64(s.OK) / measured.Seconds(),
		Events:      r.events,
		Simulated:   time.Duration(r.now),
		Interrupted: err != nil,
		Regime:      r.regime,
	}
	busiest := 0.0
	for _, in := range r.instances {
		st := in.model.stats()
		st.PrefillGPUSeconds -= in.base.PrefillGPUSeconds
		st.DecodeGPUSeconds -= in.base.DecodeGPUSeconds
		res.Instances = append(res.Instances, InstanceResult{Name: in.Name, Zone: in.Zone, Served: in.served, Priced: in.priced, Model: st})
		res.PrefillGPUSeconds += st.PrefillGPUSeconds
		res.DecodeGPUSeconds += st.DecodeGPUSeconds
		res.PricedCompletionTokens += in.completion
		busiest = max(busiest, st.PrefillGPUSeconds+st.DecodeGPUSeconds)
	}
	gpu := res.PrefillGPUSeconds + res.DecodeGPUSeconds
	// The instances the fleet had, on average, and the emulated time they
	// had: a fixed fleet's, or the time each instance was up.
	n := float64(len(r.instances))
	fleetSeconds := n * o.Duration.Seconds() / o.TimeScale
	if !o.Scenario.zero() {
		n = r.instArea / float64(measured)
		fleetSeconds = r.instArea / float64(time.Second) / o.TimeScale
	}
	if res.PricedCompletionTokens > 0 {
		res.GPUSecondsPer1kOutput = gpu / float64(res.PricedCompletionTokens) * 1000
	}
	res.GPUImbalance = ratio(busiest, gpu/n)
	res.GPUBusy = gpu / fleetSeconds
	res.PrefillLoad = res.PrefillGPUSeconds / fleetSeconds
	res.InfiniteCacheBound = ratio(float64(r.bound.tokens), float64(s.PromptTokens))
	res.Regime.finish(r, s, n)
	for i := range r.series {
		res.Series = append(res.Series, r.series[i].minute(r.measureFrom, i, o.SeriesEvery))
	}
	if o.Progress != nil {
		o.Progress(r.progress())
	}
	res.Wall = time.Since(started)
	return res
}

// summary gives the request figures as loadgen.Summarize defines them.
func (r *runner) summary() loadgen.Summary {
	s := loadgen.Summary{
		Conversations:          r.conversations,
		ConversationsCompleted: r.completed,
		Requests:               r.all.requests,
		OK:                     r.all.ok,
		Dropped:                r.dropped,
		Cancelled:              r.cancelled,
		TurnsNotSent:           r.turnsNotSent,
		PromptTokens:           r.all.prompt,
		CachedTokens:           r.all.cached,
		CompletionTokens:       r.all.completion,
		KVHitRate:              r.all.hitRate(),
		Latency:                r.all.latency.percentiles(),
		FollowUps:              r.all.followUps,
		FollowUpsSameInstance:  r.all.sameInstance,
		Continuity:             r.all.continuity(),
		RequestsPerInstance:    map[string]int{},
		ByKind:                 map[workload.Kind]loadgen.KindSummary{},
	}
	s.TTFB = r.ttfb.percentiles()
	if len(r.decisions) > 0 {
		s.Decisions = r.decisions
	}
	if len(r.errors) > 0 {
		s.Errors = r.errors
	}
	most, total := 0, 0
	for _, in := range r.instances {
		s.RequestsPerInstance[in.Name] = in.served
		most = max(most, in.served)
		total += in.served
	}
	s.LoadImbalance = ratio(float64(most), float64(total)/float64(len(r.instances)))
	for _, k := range workload.Kinds() {
		t := r.kinds[k]
		if t.requests == 0 {
			continue
		}
		s.ByKind[k] = loadgen.KindSummary{
			Requests: t.requests, OK: t.ok, KVHitRate: t.hitRate(),
			Continuity: t.continuity(), Latency: t.latency.percentiles(),
		}
	}

	return s
}

func (r *runner) settings() Settings {
	o := r.opts
	return Settings{
		Policy:                      o.Policy,
		Label:                       o.Policy.Label(),
		Instances:                   o.Instances,
		Zones:                       o.Zones,
		Profile:                     o.Profile.Name,
		TimeScale:                   o.TimeScale,
		Cache:                       o.Cache,
		Rate:                        o.Rate,
		ConversationRate:            r.convRate,
		MeanRequestsPerConversation: r.gen.MeanRequestsPerConversation(),
		Duration:                    o.Duration,
		Drain:                       o.Drain,
		ThinkScale:                  o.ThinkScale,
		MaxInFlight:                 o.MaxInFlight,
		Seed:                        o.Seed,
		WorkloadSeed:                o.Workload.Seed,
		Mix:                         o.Workload.Mix,
		Identities:                  o.Workload.Identities,
		Apps:                        r.apps,
		IdleTimeout:                 r.plan.Policy.Lifetime.Idle,
		MaxStickyDuration:           r.plan.Policy.Lifetime.Max,
		RingSize:                    o.RingSize,
		Stream:                      o.Stream,
		Exact:                       o.Exact,
		Scenario:                    o.Scenario,
	}
}
