package simulator

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/lab/emulator"
	"github.com/tetherproxy/tether/lab/loadgen"
	"github.com/tetherproxy/tether/lab/workload"
	"github.com/tetherproxy/tether/plan"
)

// Defaults and limits of Options.
const (
	DefaultInstances = 8
	DefaultZones     = 2
	// DefaultDrain is loadgen's: requests still running this long after
	// Duration are cancelled.
	DefaultDrain = loadgen.DefaultDrain
	// DefaultMaxInFlightPerInstance bounds the requests in flight, times
	// the number of instances, when Options.MaxInFlight is zero.
	DefaultMaxInFlightPerInstance = 256

	MaxInstances  = 4096
	MaxRate       = 1_000_000.0
	MaxDuration   = 7 * 24 * time.Hour
	MaxDrain      = time.Hour
	MaxThinkScale = loadgen.MaxThinkScale
)

// Options configures a Run. The zero value of every field but Rate and
// Duration means its default.
type Options struct {
	// Policy routes the requests. Empty: Sticky, or Tether with a Config.
	Policy Policy

	// Config, when set, is a tether configuration (a tether.toml, read by
	// config.Load) the run replays: its [[instances]] are the fleet (their
	// names, zones, versions, weights, kv_sessions and pools; their
	// addresses place them on the ring hash), and Policy Tether routes as
	// `tether serve` would with it: the same translation (plan.FromConfig)
	// and the same decider (plan.NewDecider). Instances, Zones and
	// Lifetime must be zero then, and Policy Tether, RingHash or
	// RoundRobin: the file decides the rest.
	Config *config.Config

	// Instances is the number of emulated GPU instances, named
	// "<profile>-0", "<profile>-1", … as the bench names its fleet; Zones
	// spreads them over zone-a, zone-b, … in turn. Zero: 8 and 2 (or the
	// Config's).
	Instances int
	Zones     int

	// Profile is every instance's cost model. Zero: emulator.ProfileA100().
	Profile emulator.Profile
	// TimeScale multiplies every duration the cost model hands out, as
	// emulator.GPUConfig.TimeScale (the bench's smoke scale runs at 0.05). Zero:
	// 1.
	TimeScale float64
	// Cache configures each instance's KV cache as emulator.CacheConfig: zero
	// CapacityTokens is the profile's, zero MaxConversations is the
	// emulator's cap (emulator.DefaultMaxConversations), negative no cap.
	Cache emulator.CacheConfig
	// ContentCosts sets the cache-aware policy's content.queued_tokens
	// and content.running_tokens; nil: tether's defaults.
	ContentCosts *ContentCosts

	// Workload is the traffic; its zero value is the field's mix with seed
	// 0. New conversations arrive as a Poisson process drawn from
	// Workload.Seed exactly as loadgen draws it, so a simulation and a
	// loadgen run of the same seed, rate and duration send the same
	// conversations at the same (virtual) times.
	Workload workload.Config

	// Rate is the target rate in requests per second, follow-up turns
	// included, as loadgen's: conversations arrive at Rate / (mean requests
	// per conversation). Required.
	Rate float64
	// Duration is how long requests start (no conversation and no turn
	// starts after it). Required.
	Duration time.Duration
	// Drain is how long after Duration requests may finish; those that
	// would end later are cancelled, as loadgen cancels them. Zero:
	// DefaultDrain.
	Drain time.Duration
	// ThinkScale multiplies the think times between turns (0: none), as
	// loadgen's.
	ThinkScale float64
	// Stream says the answers are streamed, as the bench asks for them:
	// TTFB is then the time to the first token (the end of the prefill),
	// otherwise the time to the whole answer, as loadgen measures each.
	Stream bool
	// MaxInFlight bounds the requests in flight across the fleet, as
	// loadgen's: a request beyond it is dropped and its conversation ends.
	// Zero: DefaultMaxInFlightPerInstance × Instances; negative: no bound.
	MaxInFlight int

	// Seed seeds the routers' random draws (tether random, anonymous
	// requests under sticky and ring hash, round robin's first host).
	Seed uint64

	// Lifetime is tether's binding lifetime (sticky). Zero: tether's
	// defaults, idle 30 min and max_sticky_duration 1800 s (with a Config,
	// its routing.idle_timeout and max_sticky_duration).
	Lifetime bindings.Lifetime

	// RingSize is the ring hash's minimum ring size. Zero: Envoy's
	// default, DefaultRingSize.
	RingSize int

	// Exact prices every request through emulator.GPU.Cost on the request's
	// real text, as the emulator does, instead of the fast path (block
	// hashes without text, see blockModel). Both give the same results;
	// the exact path is slower by orders of magnitude and is there to
	// check the fast one.
	Exact bool

	// Scenario changes the conditions over the run (the fleet scales,
	// upgrades or fails, a tenant bursts, agents fan out, tether becomes
	// unreachable); its zero value is a fixed fleet under a steady load.
	// See Regimes for the named ones.
	Scenario Scenario

	// Series, when set, adds the figures of every minute to the result
	// (Result.Series), for charts.
	Series bool
	// SeriesEvery is the span of each of the series' entries. Zero: a
	// minute.
	SeriesEvery time.Duration
	// SeriesByEnd counts each request of the series in the entry it ended
	// in (a failed one: when its instance's failure reached it), as the
	// bench's churn phases count them, rather than the one it was sent in.
	SeriesByEnd bool

	// Progress, when set, is called from Run's goroutine about every
	// ProgressEvery events and once at the end.
	Progress func(Progress)
}

// ProgressEvery is how many events pass between two Progress calls.
const ProgressEvery = 1 << 16

// Progress tells how far a run is.
type Progress struct {
	Simulated time.Duration // virtual time reached
	Events    int64
	Requests  int64
}

func (o Options) withDefaults() Options {
	if o.Config != nil {
		if o.Policy == "" {
			o.Policy = Tether
		}
		zones := map[string]bool{}
		for _, in := range o.Config.Instances {
			zones[in.Zone] = true
		}
		o.Instances, o.Zones = len(o.Config.Instances), len(zones)
	}
	if o.Policy == "" {
		o.Policy = Sticky
	}
	if o.Instances == 0 {
		o.Instances = DefaultInstances
	}
	if o.Zones == 0 {
		o.Zones = min(DefaultZones, o.Instances)
	}
	if o.Profile.Name == "" {
		o.Profile = emulator.ProfileA100()
	}
	if o.TimeScale == 0 {
		o.TimeScale = 1
	}
	if o.Cache.CapacityTokens == 0 {
		o.Cache.CapacityTokens = o.Profile.KVCapacityTokens
	}
	if o.Drain == 0 {
		o.Drain = DefaultDrain
	}
	if o.MaxInFlight == 0 {
		o.MaxInFlight = DefaultMaxInFlightPerInstance * o.Instances
	}
	if o.Lifetime == (bindings.Lifetime{}) && o.Config == nil {
		o.Lifetime = bindings.Lifetime{Idle: config.DefaultIdleTimeout, Max: config.DefaultMaxStickyDuration}
	}
	if o.RingSize == 0 {
		o.RingSize = DefaultRingSize
	}
	if o.SeriesEvery == 0 {
		o.SeriesEvery = time.Minute
	}
	o.Workload = o.Workload.WithDefaults()
	return o
}

// Validate reports the first problem with the options, naming the option
// and the bad value.
func (o Options) Validate() error {
	if o.Policy != "" && !slices.Contains(Policies(), o.Policy) && o.Policy != Tether {
		return fmt.Errorf("simulate: unknown policy %q: want one of %s", o.Policy, policyList())
	}
	if err := o.validateConfig(); err != nil {
		return err
	}
	d := o.withDefaults()
	switch {
	case o.Instances < 0 || o.Instances > MaxInstances:
		return fmt.Errorf("simulate: instances %d: want 1 to %d (0: %d)", o.Instances, MaxInstances, DefaultInstances)
	case o.Zones < 0 || d.Zones > d.Instances:
		return fmt.Errorf("simulate: zones %d: want 1 to the number of instances, %d", o.Zones, d.Instances)
	case math.IsNaN(o.Rate) || o.Rate <= 0 || o.Rate > MaxRate:
		return fmt.Errorf("simulate: rate %v: want requests per second above 0, at most %v", o.Rate, MaxRate)
	case o.Duration <= 0 || o.Duration > MaxDuration:
		return fmt.Errorf("simulate: duration %v: want above 0, at most %v", o.Duration, MaxDuration)
	case o.Drain < 0 || o.Drain > MaxDrain:
		return fmt.Errorf("simulate: drain %v: want 0 (the default, %v) up to %v", o.Drain, DefaultDrain, MaxDrain)
	case math.IsNaN(o.ThinkScale) || o.ThinkScale < 0 || o.ThinkScale > MaxThinkScale:
		return fmt.Errorf("simulate: think scale %v: want 0 (no think time) to %v", o.ThinkScale, MaxThinkScale)
	case math.IsNaN(o.TimeScale) || math.IsInf(o.TimeScale, 0) || o.TimeScale < 0:
		return fmt.Errorf("simulate: time scale %v: want a finite number > 0 (0: 1)", o.TimeScale)
	case o.RingSize < 0 || o.RingSize > MaxRingSize:
		return fmt.Errorf("simulate: ring size %d: want 1 to %d (0: %d)", o.RingSize, MaxRingSize, DefaultRingSize)
	case o.Cache.CapacityTokens < 0:
		return fmt.Errorf("simulate: kv capacity %d tokens: want at least one block (%d tokens; 0: the profile's)", o.Cache.CapacityTokens, emulator.BlockSize)
	case o.SeriesEvery < 0:
		return fmt.Errorf("simulate: series every %v: want above 0 (0: a minute)", o.SeriesEvery)
	case o.Lifetime != (bindings.Lifetime{}) && (o.Lifetime.Idle <= 0 || o.Lifetime.Max < 0):
		return fmt.Errorf("simulate: lifetime idle %v, max %v: want idle above 0 and max 0 (no limit) or above", o.Lifetime.Idle, o.Lifetime.Max)
	}
	if err := o.Scenario.validate(d); err != nil {
		return err
	}
	if err := (emulator.GPUConfig{Profile: d.Profile, TimeScale: d.TimeScale, Cache: d.Cache}).Validate(); err != nil {
		return fmt.Errorf("simulate: %w", err)
	}
	if err := o.Workload.Validate(); err != nil {
		return fmt.Errorf("simulate: %w", err)
	}
	return nil
}

// validateConfig checks what a Config decides is left to it.
func (o Options) validateConfig() error {
	if o.Config == nil {
		if o.Policy == Tether {
			return errors.New("simulate: policy tether runs a configuration's policy: set the configuration (--config)")
		}
		return nil
	}
	switch {
	case o.Policy == Sticky || o.Policy == Random:
		return fmt.Errorf("simulate: policy %s: with a configuration, tether routes by its [routing] (policy tether)", o.Policy)
	case o.Instances != 0 || o.Zones != 0:
		return errors.New("simulate: instances and zones: with a configuration, the fleet is its [[instances]]")
	case o.Lifetime != (bindings.Lifetime{}):
		return errors.New("simulate: lifetime: with a configuration, its routing.idle_timeout and max_sticky_duration decide")
	case o.Scenario.Scale != (Scale{}):
		return errors.New("simulate: scale: with a configuration, the fleet is its [[instances]]: it does not scale")
	case len(o.Config.Instances) > MaxInstances:
		return fmt.Errorf("simulate: the configuration has %d instances: at most %d", len(o.Config.Instances), MaxInstances)
	}
	c := *o.Config
	if err := c.Validate(); err != nil {
		return fmt.Errorf("simulate: configuration: %w", err)
	}
	return nil
}

// plan is what the run's fleet and tether's decider are made from: the
// translation of the Config, or of the configuration the options stand
// for (generatedConfig).
func (o Options) plan() (plan.Plan, error) {
	cfg := o.generatedConfig()
	if o.Config != nil {
		cfg = *o.Config
		// The simulated prompts are chains of emulator blocks: the index
		// keeps them as such, whatever block the file sets.
		cfg.Content.BlockBytes = SimBlockBytes
	}
	if err := cfg.Validate(); err != nil {
		return plan.Plan{}, fmt.Errorf("simulate: configuration: %w", err)
	}
	p, err := plan.FromConfig(cfg, plan.Options{})
	if err != nil {
		return plan.Plan{}, fmt.Errorf("simulate: configuration: %w", err)
	}
	return p, nil
}

// generatedConfig is the tether configuration of options without a
// Config (defaults filled in): o.Instances instances "<profile>-i" on
// 127.0.0.1:20000+i, in o.Zones zones in turn, each taking as many
// sessions as the emulator's cache keeps conversations (kv_sessions; the
// largest tether allows when the cache has no cap), and sticky or random
// routing with o.Lifetime; every other key tether's default.
func (o Options) generatedConfig() config.Config {
	c := config.Default()
	// Identity alone for every policy but cache-aware's.
	c.Content.Enabled = false
	switch o.Policy {
	case Random:
		c.Routing.Mode = config.ModeRandom
	case Adaptive:
		c.Routing.AdaptiveSticky = 1
	case CacheAware:
		c.Content = CacheAwareContent(o.Cache)
		if o.ContentCosts != nil {
			c.Content.QueuedTokens, c.Content.RunningTokens = o.ContentCosts.Queued, o.ContentCosts.Running
		}
	}
	if o.Scenario.Upgrade != (Upgrade{}) {
		// Sessions keep their model: a conversation does not change
		// model mid-way (what the upgrade regime counts).
		c.Routing.VersionAffinity = config.VersionStrict
	}
	c.Routing.IdleTimeout, c.Routing.MaxStickyDuration = config.Dur(o.Lifetime.Idle), config.Dur(o.Lifetime.Max)
	kv := cmp.Or(o.Cache.MaxConversations, emulator.DefaultMaxConversations)
	if kv < 0 {
		kv = config.MaxKVSessions
	}
	for i := range o.Scenario.peak(o.Instances) {
		c.Instances = append(c.Instances, config.Instance{
			Name:       fmt.Sprintf("%s-%d", o.Profile.Name, i),
			Address:    fmt.Sprintf("127.0.0.1:%d", 20000+i),
			Zone:       zoneName(i % o.Zones),
			Version:    "v1",
			Weight:     1,
			KVSessions: kv,
			// Adaptive reads the instances' engines (vLLM's /metrics), as
			// tether does when instances name their engine.
			Engine: engineOf(o.Policy),
		})
	}
	return c
}

// engineOf is the engine the generated instances name: vLLM for the
// policies that read its metrics (adaptive, GIE's scorers), none otherwise.
func engineOf(p Policy) string {
	if p == Adaptive || p == GIEPrefix || p == CacheAware {
		return "vllm"
	}
	return ""
}

// versions are the model versions the fleet serves at the start.
func (o Options) versions() []string {
	if o.Config == nil {
		return []string{"v1"}
	}
	var out []string
	for _, in := range o.Config.Instances {
		if !slices.Contains(out, in.Version) {
			out = append(out, in.Version)
		}
	}
	return out
}

func zoneName(i int) string {
	if i < 26 {
		return "zone-" + string(rune('a'+i))
	}
	return fmt.Sprintf("zone-%d", i)
}

// ContentCosts are what a prompt placed by content pays for an
// instance's work, in tokens (tether's [content] keys of the same names).
type ContentCosts struct{ Queued, Running int }

// SimBlockBytes is content.block_bytes in the simulator: one emulator
// block (16 tokens) at four characters a token.
const SimBlockBytes = emulator.BlockSize * config.CharsPerToken

// CacheAwareContent is the [content] of the CacheAware policy on caches
// configured as cache: the product's defaults, in the simulator's blocks:
// one index block is one emulator block (16 tokens, 64 bytes at four
// characters a token), every cache cache.CapacityTokens (filled in). The bench's
// cache-aware row runs tether with it, so that both decide alike.
func CacheAwareContent(cache emulator.CacheConfig) config.Content {
	c := config.Default().Content
	c.Enabled = true
	c.BlockBytes = SimBlockBytes
	c.CacheTokens = cache.CapacityTokens
	return c
}
