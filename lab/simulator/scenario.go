package simulator

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"reflect"
	"slices"
	"time"
)

// Scenario changes a run's conditions over virtual time: the fleet scales
// with its load, instances upgrade their model or fail, a tenant bursts,
// agents fan out, tether becomes unreachable. Its zero value changes
// nothing: a fixed fleet under a steady load.
type Scenario struct {
	// Warmup is how long the run goes before its figures start: the
	// requests sent before it are priced (they fill the caches) but not
	// counted, and the GPU figures count from it. It must be below the
	// run's Duration.
	Warmup time.Duration `json:"warmup_ns,omitempty"`
	// Scale makes the load and the fleet step up and down together.
	Scale Scale `json:"scale,omitzero"`
	// Upgrade switches instances to a new model version one by one.
	Upgrade Upgrade `json:"upgrade,omitzero"`
	// Failures kill an instance now and then; it returns with an empty
	// cache.
	Failures Failures `json:"failures,omitzero"`
	// Burst adds one tenant's traffic behind one API key.
	Burst Burst `json:"burst,omitzero"`
	// FanOut is how many requests each turn sends at once under the
	// conversation's session (an agent's concurrent sub-requests, on one
	// prompt); the turn ends when all have. 0 or 1: one.
	FanOut int `json:"fan_out,omitempty"`
	// Outage makes every tether replica unreachable for a while: Envoy's
	// fail-open route (the pool's ring hash) carries the tether policies'
	// requests meanwhile.
	Outage Outage `json:"outage,omitzero"`
	// Events change the fleet at set times, each naming its instance: the
	// bench's churn (an instance killed, restored, one added) as a
	// schedule. They take neither Scale nor Failures beside them (those
	// choose their own instances).
	Events []FleetEvent `json:"events,omitempty"`
}

// FleetEvent is one change of the fleet at a set time.
type FleetEvent struct {
	At   time.Duration  `json:"at_ns"`
	Kind FleetEventKind `json:"kind"`
	// Instance is the index of the instance: one up for a fail, one a
	// fail took down for a restore, and for an add one of the spares the
	// fleet is built with (Options.Instances, Options.Instances+1, … in
	// the order of the adds: the first add takes Options.Instances).
	Instance int `json:"instance"`
}

// FleetEventKind is what a FleetEvent does.
type FleetEventKind string

const (
	// EventFail kills the instance as Failures does: what it holds fails,
	// every router stops sending to it at once, and it stays down until a
	// restore (tether's breaker holds it open until then).
	EventFail FleetEventKind = "fail"
	// EventRestore brings a failed instance back, its cache empty.
	EventRestore FleetEventKind = "restore"
	// EventAdd adds a spare instance to the deployment, its cache empty.
	EventAdd FleetEventKind = "add"
)

// Scale is a queue-based autoscaler's effect: every Every, the load
// (the arrival rate of new conversations) steps through 1, 1+Step, 1,
// 1−Step, 1, … times its base, and Lag later the fleet follows to the
// instances that load needs (round(instances × factor)). Instances added
// start with an empty cache; the last added are the first removed, and
// those finish the requests they hold.
type Scale struct {
	Every time.Duration `json:"every_ns"`
	Step  float64       `json:"step"`
	Lag   time.Duration `json:"lag_ns"`
}

// Upgrade switches the instances serving From to To one by one, evenly
// over Over from At: an instance restarts on the new model (its cache
// empty; the requests it holds finish). Over 0: all at once.
type Upgrade struct {
	From string        `json:"from"`
	To   string        `json:"to"`
	At   time.Duration `json:"at_ns"`
	Over time.Duration `json:"over_ns"`
}

// Failures kill one instance every Every (from Every on, each time the
// next in a fixed order among those up): the requests it holds fail, every
// router stops sending to it at once (Envoy's outlier detection and
// tether's breaker take a fraction of a second), and Down later it returns
// with an empty cache.
type Failures struct {
	Every time.Duration `json:"every_ns"`
	Down  time.Duration `json:"down_ns"`
}

// Burst adds, from At for For, requests at Share × the run's rate, all
// behind one API key (authorization, no session id): one tenant's batch.
type Burst struct {
	At    time.Duration `json:"at_ns"`
	For   time.Duration `json:"for_ns"`
	Share float64       `json:"share"`
}

// Outage makes tether unreachable from At for For.
type Outage struct {
	At  time.Duration `json:"at_ns"`
	For time.Duration `json:"for_ns"`
}

// BurstKey is the API key of the burst's tenant.
const BurstKey = "Bearer tenant-burst-key"

// MaxFanOut bounds Scenario.FanOut.
const MaxFanOut = 256

// validate checks s against the run's options (defaults filled in).
func (s Scenario) validate(o Options) error {
	in := func(name string, at, span time.Duration) error {
		if at < 0 || span < 0 || at+span > o.Duration {
			return fmt.Errorf("simulate: %s at %v for %v: want a span inside the run's duration, %v", name, at, span, o.Duration)
		}
		return nil
	}
	switch {
	case s.Warmup < 0 || s.Warmup >= o.Duration:
		return fmt.Errorf("simulate: warmup %v: want 0 up to below the duration, %v", s.Warmup, o.Duration)
	case s.FanOut < 0 || s.FanOut > MaxFanOut:
		return fmt.Errorf("simulate: fan-out %d: want 1 to %d requests per turn (0: 1)", s.FanOut, MaxFanOut)
	case s.Scale != (Scale{}) && (s.Scale.Every <= 0 || s.Scale.Lag < 0 || s.Scale.Lag >= s.Scale.Every):
		return fmt.Errorf("simulate: scale every %v, lag %v: want a period above 0 and a lag from 0 to below it", s.Scale.Every, s.Scale.Lag)
	case s.Scale != (Scale{}) && (math.IsNaN(s.Scale.Step) || s.Scale.Step <= 0 || s.Scale.Step >= 1):
		return fmt.Errorf("simulate: scale step %v: want a share of the fleet above 0 and below 1", s.Scale.Step)
	case s.Scale != (Scale{}) && int(math.Round(float64(o.Instances)*s.Scale.Step)) < 1:
		return fmt.Errorf("simulate: scale step %v of %d instances is %.2f instances: want at least one instance per step",
			s.Scale.Step, o.Instances, float64(o.Instances)*s.Scale.Step)
	case s.Failures != (Failures{}) && (s.Failures.Every <= 0 || s.Failures.Down <= 0):
		return fmt.Errorf("simulate: failures every %v, down %v: want both above 0", s.Failures.Every, s.Failures.Down)
	case s.Failures != (Failures{}) && o.Instances < 2:
		return fmt.Errorf("simulate: failures with %d instance: want at least 2, so a router has somewhere to go", o.Instances)
	case s.Burst != (Burst{}) && (math.IsNaN(s.Burst.Share) || s.Burst.Share <= 0 || s.Burst.Share > 10):
		return fmt.Errorf("simulate: burst share %v: want a share of the rate above 0, at most 10", s.Burst.Share)
	case s.Outage != (Outage{}) && s.Outage.For <= 0:
		return fmt.Errorf("simulate: outage for %v: want above 0", s.Outage.For)
	case s.active() && o.Exact:
		return fmt.Errorf("simulate: exact prices a fixed fleet under a steady load: it takes no scenario (scale, upgrade, failures, burst, fan-out, outage)")
	}
	if s.Burst != (Burst{}) {
		if err := in("burst", s.Burst.At, s.Burst.For); err != nil {
			return err
		}
	}
	if s.Outage != (Outage{}) {
		if err := in("outage", s.Outage.At, s.Outage.For); err != nil {
			return err
		}
	}
	if err := s.validateEvents(o); err != nil {
		return err
	}
	if u := s.Upgrade; u != (Upgrade{}) {
		if err := in("upgrade", u.At, u.Over); err != nil {
			return err
		}
		if u.To == "" || u.To == u.From {
			return fmt.Errorf("simulate: upgrade from %q to %q: want a new version to switch to", u.From, u.To)
		}
		if !slices.Contains(o.versions(), u.From) {
			return fmt.Errorf("simulate: upgrade from %q: no instance serves it (the fleet serves %v)", u.From, o.versions())
		}
	}
	return nil
}

// validateEvents checks s.Events by playing them in time order on the
// fleet o builds (defaults filled in).
func (s Scenario) validateEvents(o Options) error {
	if len(s.Events) == 0 {
		return nil
	}
	switch {
	case s.Scale != (Scale{}):
		return errors.New("simulate: events with scale: the autoscaler picks the instances it adds and removes; use one or the other")
	case s.Failures != (Failures{}):
		return errors.New("simulate: events with failures: failures pick the instances they kill; use one or the other")
	}
	up := make([]bool, s.peak(o.Instances))
	for i := range o.Instances {
		up[i] = true
	}
	live, failed, added := o.Instances, map[int]bool{}, 0
	for _, e := range s.sortedEvents() {
		name := fmt.Sprintf("simulate: event %s of instance %d at %v", e.Kind, e.Instance, e.At)
		if e.At <= 0 || e.At >= o.Duration {
			return fmt.Errorf("%s: want a time after the start and before the run's duration, %v", name, o.Duration)
		}
		switch e.Kind {
		case EventFail:
			switch {
			case e.Instance < 0 || e.Instance >= len(up):
				return fmt.Errorf("%s: want an instance from 0 to %d", name, len(up)-1)
			case !up[e.Instance]:
				return fmt.Errorf("%s: the instance is not up then", name)
			case live < 2:
				return fmt.Errorf("%s: it is the last instance up, and a router needs somewhere to go", name)
			}
			up[e.Instance], failed[e.Instance] = false, true
			live--
		case EventRestore:
			if !failed[e.Instance] {
				return fmt.Errorf("%s: the instance is not down then (only a fail takes one down)", name)
			}
			up[e.Instance], failed[e.Instance] = true, false
			live++
		case EventAdd:
			if o.Config != nil {
				return fmt.Errorf("%s: with a configuration, the fleet is its [[instances]]: add one there", name)
			}
			if want := o.Instances + added; e.Instance != want {
				return fmt.Errorf("%s: want instance %d, the next spare (adds take %d, %d, … in time order)", name, want, o.Instances, o.Instances+1)
			}
			up[e.Instance] = true
			live++
			added++
		default:
			return fmt.Errorf("%s: unknown kind %q: want %s, %s or %s", name, e.Kind, EventFail, EventRestore, EventAdd)
		}
	}
	return nil
}

// sortedEvents are s.Events in time order (the given order at one time).
func (s Scenario) sortedEvents() []FleetEvent {
	out := slices.Clone(s.Events)
	slices.SortStableFunc(out, func(a, b FleetEvent) int { return cmp.Compare(a.At, b.At) })
	return out
}

// adds counts the add events.
func (s Scenario) adds() int {
	n := 0
	for _, e := range s.Events {
		if e.Kind == EventAdd {
			n++
		}
	}
	return n
}

// zero reports whether s is the zero Scenario.
func (s Scenario) zero() bool {
	if len(s.Events) > 0 {
		return false
	}
	s.Events = nil
	return reflect.ValueOf(s).IsZero()
}

// active reports whether s changes anything but the warmup.
func (s Scenario) active() bool {
	s.Warmup = 0
	return !s.zero()
}

// fanOut is s.FanOut with its default.
func (s Scenario) fanOut() int { return max(s.FanOut, 1) }

// peak is the most instances the fleet has at once.
func (s Scenario) peak(instances int) int {
	if s.Scale == (Scale{}) {
		return instances + s.adds()
	}
	return scaled(instances, 1+s.Scale.Step)
}

func scaled(n int, factor float64) int { return max(int(math.Round(float64(n)*factor)), 1) }

// loadFactor is the factor of the base rate at virtual time t (ns), and
// when it next changes (math.MaxInt64: never).
func (s Scenario) loadFactor(t int64) (float64, int64) {
	if s.Scale == (Scale{}) {
		return 1, math.MaxInt64
	}
	every := int64(s.Scale.Every)
	k := t / every
	return s.Scale.factor(k), (k + 1) * every
}

// factor is the load factor of the k-th period.
func (sc Scale) factor(k int64) float64 {
	switch k % 4 {
	case 1:
		return 1 + sc.Step
	case 3:
		return 1 - sc.Step
	}
	return 1
}

// change is one change of the fleet or of tether's reachability.
type change struct {
	at   int64
	kind changeKind
	inst int    // the instance (up, down, kill, upgrade)
	to   string // upgrade: the new version
	// until, for a kill, is when the instance returns (math.MaxInt64: not
	// in the run).
	until int64
}

type changeKind uint8

const (
	changeUp      changeKind = iota + 1 // an instance joins (scale-out), its cache empty
	changeDown                          // an instance leaves (scale-in), finishing what it holds
	changeDie                           // an instance fails: what it holds fails
	changeKill                          // a set instance fails (Scenario.Events), as changeDie
	changeReturn                        // a failed instance returns, its cache empty, unless it was scaled in meanwhile
	changeUpgrade                       // an instance restarts on another version
	changeOutage                        // tether becomes unreachable
	changeRestore                       // tether answers again
	changeWarm                          // the figures start
)

// schedule is every change of s in a run of duration d with base
// instances (the first up at the start), in time order; failures take
// the instances up in the order pick gives (an index into those up).
// The failures depend on which instances are up, so they are computed as
// the run reaches them (see runner.apply); schedule holds their times.
func (s Scenario) schedule(d time.Duration, instances int, versionOf func(i int) string) []change {
	var out []change
	end := int64(d)
	add := func(c change) {
		if c.at < end {
			out = append(out, c)
		}
	}
	if s.Warmup > 0 {
		add(change{at: int64(s.Warmup), kind: changeWarm})
	}
	if sc := s.Scale; sc != (Scale{}) {
		up := instances
		for k := int64(1); k*int64(sc.Every) < end; k++ {
			want := scaled(instances, sc.factor(k))
			at := k*int64(sc.Every) + int64(sc.Lag)
			for ; up < want; up++ {
				add(change{at: at, kind: changeUp, inst: up})
			}
			for ; up > want; up-- {
				add(change{at: at, kind: changeDown, inst: up - 1})
			}
		}
	}
	if u := s.Upgrade; u != (Upgrade{}) {
		var of []int
		for i := range s.peak(instances) {
			if versionOf(i) == u.From {
				of = append(of, i)
			}
		}
		for j, i := range of {
			at := int64(u.At)
			if len(of) > 1 {
				at += int64(u.Over) * int64(j) / int64(len(of)-1)
			}
			add(change{at: at, kind: changeUpgrade, inst: i, to: u.To})
		}
	}
	if f := s.Failures; f != (Failures{}) {
		for at := int64(f.Every); at < end; at += int64(f.Every) {
			add(change{at: at, kind: changeDie, inst: -1})
		}
	}
	events := s.sortedEvents()
	for j, e := range events {
		switch e.Kind {
		case EventFail:
			until := int64(math.MaxInt64)
			for _, next := range events[j+1:] {
				if next.Instance == e.Instance && next.Kind == EventRestore {
					until = int64(next.At)
					break
				}
			}
			add(change{at: int64(e.At), kind: changeKill, inst: e.Instance, until: until})
		case EventRestore:
			add(change{at: int64(e.At), kind: changeReturn, inst: e.Instance})
		case EventAdd:
			add(change{at: int64(e.At), kind: changeUp, inst: e.Instance})
		}
	}
	if o := s.Outage; o != (Outage{}) {
		add(change{at: int64(o.At), kind: changeOutage})
		add(change{at: int64(o.At + o.For), kind: changeRestore})
	}
	slices.SortStableFunc(out, func(a, b change) int { return cmp.Compare(a.at, b.at) })
	return out
}
