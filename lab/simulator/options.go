package simulator

import (
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/lab/emulator"
	"github.com/tetherproxy/tether/lab/loadgen"
	"github.com/tetherproxy/tether/lab/workload"
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
	// Policy routes the requests. Empty: Sticky.
	Policy Policy

	// Instances is the number of emulated GPU instances, named
	// "<profile>-0", "<profile>-1", … as the bench names its fleet; Zones
	// spreads them over zone-a, zone-b, … in turn. Zero: 8 and 2.
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
	// defaults, idle 30 min and max_sticky_duration 1800 s.
	Lifetime affinity.Lifetime

	// RingSize is the ring hash's minimum ring size. Zero: Envoy's
	// default, DefaultRingSize.
	RingSize int

	// Exact prices every request through emulator.GPU.Cost on the request's
	// real text, as the emulator does, instead of the fast path (block
	// hashes without text, see blockModel). Both give the same results;
	// the exact path is slower by orders of magnitude and is there to
	// check the fast one.
	Exact bool

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
	if o.Lifetime == (affinity.Lifetime{}) {
		o.Lifetime = affinity.Lifetime{Idle: config.DefaultIdleTimeout, Max: config.DefaultMaxStickyDuration}
	}
	if o.RingSize == 0 {
		o.RingSize = DefaultRingSize
	}
	o.Workload = o.Workload.WithDefaults()
	return o
}

// Validate reports the first problem with the options, naming the option
// and the bad value.
func (o Options) Validate() error {
	if o.Policy != "" && !slices.Contains(Policies(), o.Policy) {
		return fmt.Errorf("simulate: unknown policy %q: want one of %s", o.Policy, policyList())
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
	case o.Lifetime != (affinity.Lifetime{}) && (o.Lifetime.Idle <= 0 || o.Lifetime.Max < 0):
		return fmt.Errorf("simulate: lifetime idle %v, max %v: want idle above 0 and max 0 (no limit) or above", o.Lifetime.Idle, o.Lifetime.Max)
	}
	if err := (emulator.GPUConfig{Profile: d.Profile, TimeScale: d.TimeScale, Cache: d.Cache}).Validate(); err != nil {
		return fmt.Errorf("simulate: %w", err)
	}
	if err := o.Workload.Validate(); err != nil {
		return fmt.Errorf("simulate: %w", err)
	}
	return nil
}
