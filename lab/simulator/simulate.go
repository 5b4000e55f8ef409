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
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/lab/emulator"
	"github.com/tetherproxy/tether/lab/loadgen"
	"github.com/tetherproxy/tether/lab/workload"
	"github.com/tetherproxy/tether/plan"
	"github.com/tetherproxy/tether/ringhash"
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
	// request and ringHash/hashed are the routers' view of the headers;
	// decision and reply are tether's of the request in flight.
	request  affinity.Request
	decision affinity.Decision
	decided  int // the decision's number (tetherRouter.trace)
	reply    affinity.Answer
	ringHash uint64
	hashed   bool

	turn    int // the turn being sent or served
	history int // prompt tokens before the user message of turn
	last    int // instance that served the previous turn; -1 before
	inst    int // instance serving the current turn

	// Exact path only: the conversation's text, the answers so far and
	// the answer of the turn in flight.
	text    *workload.Conversation
	answers []string
	answer  string
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
}

type runner struct {
	opts      Options
	plan      plan.Plan // the instances and tether's policy
	gen       *workload.Generator
	shapes    *shapes
	apps      []workload.App
	router    router
	instances []*instance
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

	all           tally
	ttfb          latencies
	kinds         map[workload.Kind]*tally
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
		opts:     opts,
		gen:      gen,
		shapes:   newShapes(opts.Workload),
		apps:     gen.Config().Apps,
		end:      int64(opts.Duration),
		deadline: int64(opts.Duration + opts.Drain),
		arrivals: rand.New(rand.NewPCG(opts.Workload.Seed, 0x6172726976616c73)), // loadgen's: "arrivals"
		convRate: opts.Rate / gen.MeanRequestsPerConversation(),
		salt:     wlSplitmix(opts.Workload.Seed ^ 0x626c6f636b73), // "blocks"
		kinds:    map[workload.Kind]*tally{},
		errors:   map[string]int{},
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
	return r, nil
}

// buildFleet makes the plan's instances and their cost models.
func (r *runner) buildFleet() error {
	o := r.opts
	// The full blocks of each system prompt: as many as BlockHasher cuts
	// from it (its token count / 16).
	system := make([]int, len(r.apps))
	for i, a := range r.apps {
		prompt, _ := r.gen.SystemPrompt(a.Name)
		system[i] = emulator.CountTokens(prompt) / emulator.BlockSize
	}
	for _, fi := range r.plan.Instances {
		in := &instance{Instance: fi}
		if o.Exact {
			gpu, err := emulator.NewGPU(emulator.GPUConfig{Profile: o.Profile, TimeScale: o.TimeScale, Cache: o.Cache})
			if err != nil {
				return fmt.Errorf("simulate: %w", err)
			}
			in.model = &textModel{name: in.Name, gpu: gpu}
		} else {
			in.model = &blockModel{profile: o.Profile, timeScale: o.TimeScale, cache: newRunCache(o.Cache, system), system: system}
		}
		r.instances = append(r.instances, in)
	}
	r.bound = newBoundTally(system)
	return nil
}

func (r *runner) buildRouter() error {
	o := r.opts
	rng := rand.New(rand.NewPCG(o.Seed, 0x726f75746572)) // "router"
	switch o.Policy {
	case Sticky, Random, Tether:
		r.decisions = map[string]int{}
		t, err := newTetherRouter(r.plan, func() int64 { return r.now }, rng)
		if err != nil {
			return err
		}
		r.router = t
	case RingHash:
		// Keyed by name: the hash_key tether's xDS server gives each
		// pool endpoint.
		keys := make([]string, len(r.instances))
		for i, in := range r.instances {
			keys[i] = in.Name
		}
		r.router = &ringRouter{ring: ringhash.New(keys, o.RingSize), rng: rng}
	case RoundRobin:
		r.router = &roundRobinRouter{n: len(r.instances), next: rng.IntN(len(r.instances))}
	case LeastRequest:
		r.router = &leastRequestRouter{instances: r.instances, rng: rng}
	case Oracle:
		r.router = newOracleRouter(r.instances, r.bound.system, func() int64 { return r.now }, rng)
	default:
		return fmt.Errorf("simulate: unknown policy %q", o.Policy)
	}
	return nil
}

// drawArrival returns the arrival after one at prev: loadgen's schedule.
func (r *runner) drawArrival(prev int64) int64 {
	at := prev + int64(time.Duration(r.arrivals.ExpFloat64()/r.convRate*float64(time.Second)))
	if at >= r.end {
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
		switch {
		case len(r.queue) > 0 && r.queue[0].at <= r.nextArrival:
			ev := r.queue.pop()
			r.advance(ev.at)
			if ev.kind == eventDone {
				r.done(ev.conv)
			} else {
				stepErr = r.send(step, ev.conv)
			}
		case r.nextArrival != math.MaxInt64:
			r.advance(r.nextArrival)
			stepErr = r.arrive(step)
			r.nextArrival = r.drawArrival(r.nextArrival)
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
	r.now = at
}

func (r *runner) schedule(at int64, kind eventKind, c *conversation) {
	r.seq++
	r.queue.push(event{at: at, seq: r.seq, kind: kind, conv: c})
}

// arrive starts the next conversation of the workload.
func (r *runner) arrive(ctx context.Context) error {
	n := r.nextIndex
	r.nextIndex++
	c := &conversation{last: -1}
	if r.opts.Exact {
		conv := r.gen.At(n)
		c.text = &conv
		c.shape = shapeOf(conv, r.apps)
	} else {
		c.shape = r.shapes.at(n)
	}
	c.headers = c.shape.identity.Headers
	for _, h := range c.headers {
		if h.Name == emulator.SessionHeader {
			c.session = h.Value
			c.sessionKey = sessionKey(h.Value)
		}
	}
	c.salt = wlSplitmix(r.salt + n)
	c.history = r.apps[c.shape.app].SystemTokens
	r.router.prepare(c)
	r.conversations++
	return r.send(ctx, c)
}

// shapeOf is the shape of a generated conversation (exact path).
func shapeOf(c workload.Conversation, apps []workload.App) shape {
	s := shape{index: c.Index, kind: c.Kind, identity: c.Identity}
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

// send sends c's current turn.
func (r *runner) send(ctx context.Context, c *conversation) error {
	k, turns := c.turn, len(c.shape.turns)
	kt := r.kinds[c.shape.kind]
	r.requests++
	r.all.requests++
	kt.requests++
	if r.opts.MaxInFlight > 0 && r.inFlight >= r.opts.MaxInFlight {
		r.dropped++
		r.errors[fmt.Sprintf("%d requests in flight", r.opts.MaxInFlight)]++
		r.turnsNotSent += turns - (k + 1)
		return nil
	}
	i, kind, err := r.router.route(ctx, c)
	if err != nil {
		return err
	}
	in := r.instances[i]
	t := c.shape.turns[k]
	r.bound.price(c)
	cost := in.model.cost(c, r.now, in.inFlight)
	// The response headers: at the first token when streamed, else with
	// the whole answer, each with the depth the emulator reports (the
	// requests it was already working on).
	headers := r.now + int64(cost.Wait)
	if !r.opts.Stream {
		headers += int64(cost.Decode)
	}
	r.router.answered(c, headers, in.inFlight)
	in.priced++
	in.completion += int64(t.maxTokens)
	// The request holds its place on the instance until it ends;
	// a cancelled one until the drain deadline, after every send.
	in.inFlight++
	r.inFlight++
	finish := r.now + int64(cost.Wait+cost.Decode)
	if finish > r.deadline {
		r.cancelled++
		r.errors[errCancelled]++
		r.turnsNotSent += turns - (k + 1)
		return nil
	}

	prompt := c.history + t.userTokens
	cached := min(max(cost.CachedTokens, 0), prompt)
	latency := cost.Wait + cost.Decode
	if r.opts.Stream {
		r.ttfb.add(cost.Wait)
	} else {
		r.ttfb.add(latency)
	}
	for _, ta := range []*tally{&r.all, kt} {
		ta.ok++
		ta.prompt += int64(prompt)
		ta.cached += int64(cached)
		ta.completion += int64(t.maxTokens)
		ta.latency.add(latency)
		if k > 0 {
			ta.followUps++
			if c.last == i {
				ta.sameInstance++
			}
		}
	}
	in.served++
	r.bound.ok()
	if r.decisions != nil && kind != "" {
		r.decisions[string(kind)]++
	}
	c.inst = i
	r.schedule(finish, eventDone, c)
	return nil
}

// done ends c's current turn (OK) and schedules the next.
func (r *runner) done(c *conversation) {
	in := r.instances[c.inst]
	in.inFlight--
	r.inFlight--
	t := c.shape.turns[c.turn]
	if c.text != nil {
		c.answers = append(c.answers, c.answer)
	}
	c.history += t.userTokens + t.maxTokens
	c.last = c.inst
	c.turn++
	if c.turn == len(c.shape.turns) {
		r.completed++
		return
	}
	at := r.now + int64(time.Duration(float64(c.shape.turns[c.turn].think)*r.opts.ThinkScale))
	if at >= r.end {
		r.turnsNotSent += len(c.shape.turns) - c.turn
		return
	}
	r.schedule(at, eventSend, c)
}

// result assembles the figures.
func (r *runner) result(started time.Time, err error) *Result {
	o := r.opts
	s := r.summary()
	res := &Result{
		Settings:    r.settings(),
		Summary:     s,
		OKPerSecond: float64(s.OK) / o.Duration.Seconds(),
		Events:      r.events,
		Simulated:   time.Duration(r.now),
		Interrupted: err != nil,
	}
	busiest := 0.0
	for _, in := range r.instances {
		st := in.model.stats()
		res.Instances = append(res.Instances, InstanceResult{Name: in.Name, Zone: in.Zone, Served: in.served, Priced: in.priced, Model: st})
		res.PrefillGPUSeconds += st.PrefillGPUSeconds
		res.DecodeGPUSeconds += st.DecodeGPUSeconds
		res.PricedCompletionTokens += in.completion
		busiest = max(busiest, st.PrefillGPUSeconds+st.DecodeGPUSeconds)
	}
	gpu := res.PrefillGPUSeconds + res.DecodeGPUSeconds
	n := float64(len(r.instances))
	if res.PricedCompletionTokens > 0 {
		res.GPUSecondsPer1kOutput = gpu / float64(res.PricedCompletionTokens) * 1000
	}
	res.GPUImbalance = ratio(busiest, gpu/n)
	fleetSeconds := n * o.Duration.Seconds() / o.TimeScale // emulated time the fleet had
	res.GPUBusy = gpu / fleetSeconds
	res.PrefillLoad = res.PrefillGPUSeconds / fleetSeconds
	res.InfiniteCacheBound = ratio(float64(r.bound.tokens), float64(s.PromptTokens))
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
	}
}
